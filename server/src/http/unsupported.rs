//! Request fields that would change the answer and that this server cannot honour, refused with a 400
//! that says so rather than ignored: constrained output (OpenAI's `response_format` of `json_object` or
//! `json_schema`, llama-server's `grammar` and `json_schema`, Ollama's `format`, Anthropic's
//! `output_format` / `output_config.format`) — there is no
//! constrained decoding yet — and image or audio input (the engine reads text only).

use super::errors::ApiError;
use serde_json::Value;

const NO_CONSTRAINED: &str =
    "constrained decoding is not supported by this server yet, so the answer \
    could not be held to it; leave the field out (and ask for JSON in the prompt) or use a server \
    with grammars";

/// Refuses `response_format` other than `text`, and llama-server's `grammar` / `json_schema` fields.
pub fn refuse_constrained_output(body: &Value) -> Result<(), ApiError> {
    match body.get("response_format") {
        None | Some(Value::Null) => {}
        Some(rf) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some(kind @ ("json_object" | "json_schema")) => {
                return Err(ApiError::bad_request(format!(
                    "`response_format` {kind:?}: {NO_CONSTRAINED}"
                )))
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "`response_format.type` {other:?} is unknown (text, json_object or json_schema)"
                )))
            }
            None => {
                return Err(ApiError::bad_request(
                    "`response_format` must be an object with a `type`",
                ))
            }
        },
    }
    for key in ["grammar", "json_schema"] {
        match body.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(_) => return Err(ApiError::bad_request(format!("`{key}`: {NO_CONSTRAINED}"))),
        }
    }
    Ok(())
}

/// Refuses Ollama's `format` (`"json"` or a schema); an empty one is no constraint.
pub fn refuse_ollama_format(body: &Value) -> Result<(), ApiError> {
    match body.get("format") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Ok(()),
        Some(_) => Err(ApiError::bad_request(format!("`format`: {NO_CONSTRAINED}"))),
    }
}

/// Refuses Anthropic's structured outputs: `output_format` (`{"type": "json_schema", "schema"}`, the
/// beta) and `output_config.format` (the same, generally available).
pub fn refuse_anthropic_output_format(body: &Value) -> Result<(), ApiError> {
    let given = |v: Option<&Value>| !matches!(v, None | Some(Value::Null));
    if given(body.get("output_format")) {
        return Err(ApiError::bad_request(format!(
            "`output_format`: {NO_CONSTRAINED}"
        )));
    }
    if given(body.get("output_config").and_then(|c| c.get("format"))) {
        return Err(ApiError::bad_request(format!(
            "`output_config.format`: {NO_CONSTRAINED}"
        )));
    }
    Ok(())
}

/// The message of a refused image or audio part, naming the model.
pub fn text_only(model: Option<&str>, what: &str) -> ApiError {
    ApiError::bad_request(format!(
        "messages hold {what}, but {} reads text only; send text",
        model.map_or("the model".to_string(), |m| format!("model {m:?}"))
    ))
}

/// Refuses OpenAI messages with image, audio or file content parts (`image_url`, `input_image`,
/// `input_audio`, `file`).
pub fn refuse_media_parts(messages: &[Value], model: Option<&str>) -> Result<(), ApiError> {
    for (i, m) in messages.iter().enumerate() {
        let Some(Value::Array(parts)) = m.get("content") else {
            continue;
        };
        for part in parts {
            let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
            if matches!(
                kind,
                "image_url" | "input_image" | "image" | "input_audio" | "audio" | "file"
            ) {
                return Err(text_only(
                    model,
                    &format!("a content part of type {kind:?} (messages[{i}])"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn constrained_output_is_refused_by_name() {
        assert!(refuse_constrained_output(&json!({})).is_ok());
        assert!(refuse_constrained_output(&json!({"response_format": {"type": "text"}})).is_ok());
        for (body, needle) in [
            (
                json!({"response_format": {"type": "json_object"}}),
                "json_object",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                "json_schema",
            ),
            (json!({"grammar": "root ::= \"a\""}), "grammar"),
            (json!({"json_schema": {"type": "object"}}), "json_schema"),
        ] {
            let e = refuse_constrained_output(&body).expect_err("refused");
            assert!(e.message.contains(needle), "{}", e.message);
            assert!(e.message.contains("not supported"), "{}", e.message);
        }
        assert!(refuse_ollama_format(&json!({"format": "json"})).is_err());
        assert!(refuse_ollama_format(&json!({"format": ""})).is_ok());
        let schema = json!({"type": "json_schema", "schema": {"type": "object"}});
        for body in [
            json!({"output_format": schema}),
            json!({"output_config": {"format": schema}}),
        ] {
            let e = refuse_anthropic_output_format(&body).expect_err("refused");
            assert!(e.message.contains("not supported"), "{}", e.message);
        }
        assert!(
            refuse_anthropic_output_format(&json!({"output_config": {"effort": "low"}})).is_ok()
        );
    }

    #[test]
    fn media_parts_are_refused() {
        let text = json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]);
        assert!(refuse_media_parts(&text.as_array().cloned().unwrap_or_default(), None).is_ok());
        let image = json!([{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}]);
        let e = refuse_media_parts(&image.as_array().cloned().unwrap_or_default(), Some("m"))
            .expect_err("400");
        assert!(e.message.contains("image_url") && e.message.contains("text only"));
    }
}
