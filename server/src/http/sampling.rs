//! Reading the sampling fields both APIs share out of a request body, with clear errors for wrong types
//! and out-of-range values.

use super::errors::ApiError;
use crate::generate::Sampling;
use serde_json::Value;

fn number(body: &Value, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
            Some(x) => Err(ApiError::bad_request(format!(
                "`{key}` must be between {lo} and {hi} (got {x})"
            ))),
            None => Err(ApiError::bad_request(format!("`{key}` must be a number"))),
        },
    }
}

pub fn integer(body: &Value, key: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            Some(x) => Err(ApiError::bad_request(format!(
                "`{key}` must be between {lo} and {hi} (got {x})"
            ))),
            None => Err(ApiError::bad_request(format!(
                "`{key}` must be a non-negative integer"
            ))),
        },
    }
}

/// `stop` as a string or an array of strings.
pub fn stop_strings(body: &Value, key: &str) -> Result<Vec<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::bad_request(format!("`{key}` must hold strings")))
            })
            .collect(),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{key}` must be a string or an array of strings"
        ))),
    }
}

/// The sampling fields of an OpenAI or Anthropic body (`max_tokens_keys` in order of preference).
pub fn sampling(
    body: &Value,
    max_tokens_keys: &[&str],
    stop_key: &str,
) -> Result<Sampling, ApiError> {
    let mut max_tokens = None;
    for key in max_tokens_keys {
        if let Some(n) = integer(body, key, 1, 1 << 24)? {
            max_tokens = Some(n as u32);
            break;
        }
    }
    Ok(Sampling {
        max_tokens,
        temperature: number(body, "temperature", 0.0, 100.0)?,
        top_p: number(body, "top_p", 0.0, 1.0)?,
        top_k: integer(body, "top_k", 0, 1 << 20)?.map(|k| k as u32),
        min_p: number(body, "min_p", 0.0, 1.0)?,
        presence_penalty: number(body, "presence_penalty", -2.0, 2.0)?,
        frequency_penalty: number(body, "frequency_penalty", -2.0, 2.0)?,
        repeat_penalty: number(body, "repeat_penalty", 0.0001, 100.0)?,
        seed: match body.get("seed") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .or_else(|| v.as_i64().map(|x| x as u64))
                    .ok_or_else(|| ApiError::bad_request("`seed` must be an integer"))?,
            ),
        },
        top_logprobs: None,
        stop: stop_strings(body, stop_key)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_fields_and_refuses_bad_values() {
        let s = sampling(
            &json!({"max_tokens": 5, "temperature": 0.5, "stop": "x", "seed": 7}),
            &["max_completion_tokens", "max_tokens"],
            "stop",
        )
        .expect("valid");
        assert_eq!(s.max_tokens, Some(5));
        assert_eq!(s.temperature, Some(0.5));
        assert_eq!(s.stop, vec!["x".to_string()]);
        assert_eq!(s.seed, Some(7));
        for bad in [
            json!({"temperature": "hot"}),
            json!({"top_p": 2}),
            json!({"max_tokens": -1}),
            json!({"stop": 3}),
        ] {
            assert!(sampling(&bad, &["max_tokens"], "stop").is_err(), "{bad}");
        }
    }
}
