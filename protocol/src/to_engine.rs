//! Messages the server sends to the engine: `GEN`, `CANCEL`, `STATS`, `QUIT`.

use serde::{Deserialize, Serialize};

use crate::{format_line, parse_object, split_verb, ErrorCode, ProtocolError};

/// The most tokens one `GEN` may ask to write (a sanity bound; the context is the real one).
pub const MAX_GEN_TOKENS: u32 = 1 << 24;
/// The most likeliest tokens one `GEN` may ask for per step.
pub const MAX_TOP_LOGPROBS: u32 = 100;
/// The longest request or conversation id, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// A message to the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum ToEngine {
    /// `GEN {...}`: read a prompt and write tokens.
    Gen(Gen),
    /// `CANCEL {"id":"r1"}`: stop that request (running or queued).
    Cancel(Cancel),
    /// `STATS {}`: answer with a `STATS` line.
    Stats,
    /// `QUIT {}`: free everything and exit 0.
    Quit,
}

/// `GEN`: everything but `id` and `tokens` may be left out and has a default (greedy, 256 tokens, the
/// model's end tokens). Read the values through the accessors, which apply the defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Gen {
    pub id: String,
    /// The whole prompt (the server sends the full rendered conversation every time).
    pub tokens: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// How many of the last tokens the penalties look at (default 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub penalty_last_n: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Tokens that end the answer (default: the model's end tokens). The stop token itself is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_tokens: Option<Vec<u32>>,
    /// How many likeliest tokens to report per generated token (default 0: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    /// Which conversation this continues (default: the active one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
    /// A prompt position to keep a checkpoint at (where the last user turn begins, say), for states that
    /// cannot be rewound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_at: Option<u32>,
    /// Pictures read into the prompt (a model served with a projector, `--mmproj`): each stands for the
    /// one token at its `at`, which the engine widens to the picture's rows. Absent: text only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pictures: Vec<Picture>,
}

/// One picture of a `GEN`: the encoded image file (PNG, JPEG or WebP) in base64, and the index in
/// `tokens` of the placeholder token it replaces. The engine encodes it with its projector into rows and
/// reads them where the placeholder stands, each row recorded as that token; the tokens after it move
/// back by the rows less one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Picture {
    pub at: u32,
    pub data: String,
}

/// The most pictures one `GEN` may carry (each is encoded before the request runs).
pub const MAX_PICTURES: usize = 64;

impl Gen {
    pub const DEFAULT_MAX_TOKENS: u32 = 256;
    pub const DEFAULT_PENALTY_LAST_N: u32 = 64;

    /// A greedy request with every default.
    pub fn new(id: impl Into<String>, tokens: Vec<u32>) -> Gen {
        Gen {
            id: id.into(),
            tokens,
            ..Gen::default()
        }
    }

    pub fn max_tokens(&self) -> u32 {
        self.max_tokens.unwrap_or(Gen::DEFAULT_MAX_TOKENS)
    }
    /// 0 (the default) is greedy.
    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(0.0)
    }
    /// 0 (the default) is off.
    pub fn top_k(&self) -> u32 {
        self.top_k.unwrap_or(0)
    }
    /// 1 (the default) is off.
    pub fn top_p(&self) -> f32 {
        self.top_p.unwrap_or(1.0)
    }
    /// 0 (the default) is off.
    pub fn min_p(&self) -> f32 {
        self.min_p.unwrap_or(0.0)
    }
    /// 1 (the default) is off.
    pub fn repeat_penalty(&self) -> f32 {
        self.repeat_penalty.unwrap_or(1.0)
    }
    pub fn presence_penalty(&self) -> f32 {
        self.presence_penalty.unwrap_or(0.0)
    }
    pub fn frequency_penalty(&self) -> f32 {
        self.frequency_penalty.unwrap_or(0.0)
    }
    pub fn penalty_last_n(&self) -> u32 {
        self.penalty_last_n.unwrap_or(Gen::DEFAULT_PENALTY_LAST_N)
    }
    pub fn top_logprobs(&self) -> u32 {
        self.top_logprobs.unwrap_or(0)
    }

    /// Checks what can be checked without the model: ids, a non-empty prompt, and every sampling value in
    /// its range. The engine adds the checks that need the model (vocabulary, context).
    pub fn check(&self) -> Result<(), ProtocolError> {
        let bad = |msg: String| Err(ProtocolError::bad_request(Some(self.id.clone()), msg));
        if self.tokens.is_empty() {
            return bad("GEN: `tokens` is empty".into());
        }
        if let Some(c) = &self.conversation {
            check_id("conversation", c).map_err(|m| {
                ProtocolError::bad_request(Some(self.id.clone()), format!("GEN: {m}"))
            })?;
        }
        if self.max_tokens() > MAX_GEN_TOKENS {
            return bad(format!(
                "GEN: max_tokens {} is over {MAX_GEN_TOKENS}",
                self.max_tokens()
            ));
        }
        if self.top_logprobs() > MAX_TOP_LOGPROBS {
            return bad(format!(
                "GEN: top_logprobs {} is over {MAX_TOP_LOGPROBS}",
                self.top_logprobs()
            ));
        }
        // top_k is an integer, compared and printed as one (as an f32, 4294967295 read 4294967300).
        let top_k = self.top_k();
        if top_k > MAX_TOP_K {
            return bad(format!("GEN: top_k {top_k} is outside [0, {MAX_TOP_K}]"));
        }
        let ranges: [(&str, Option<f32>, f32, f32); 6] = [
            ("temperature", self.temperature, 0.0, 100.0),
            ("top_p", self.top_p, 0.0, 1.0),
            ("min_p", self.min_p, 0.0, 1.0),
            ("repeat_penalty", self.repeat_penalty, 0.0, 100.0),
            ("presence_penalty", self.presence_penalty, -100.0, 100.0),
            ("frequency_penalty", self.frequency_penalty, -100.0, 100.0),
        ];
        for (name, value, lo, hi) in ranges {
            if let Some(v) = value {
                if !v.is_finite() || v < lo || v > hi {
                    return bad(format!("GEN: {name} {v} is outside [{lo}, {hi}]"));
                }
            }
        }
        if self.repeat_penalty == Some(0.0) {
            return bad("GEN: repeat_penalty must be above 0".into());
        }
        self.check_pictures()
            .map_err(|m| ProtocolError::bad_request(Some(self.id.clone()), format!("GEN: {m}")))
    }

    /// Pictures in prompt order, each on its own token with at least one token after it (the request's
    /// logits come from a token of text), none empty, at most [`MAX_PICTURES`].
    fn check_pictures(&self) -> Result<(), String> {
        if self.pictures.len() > MAX_PICTURES {
            return Err(format!(
                "{} pictures; at most {MAX_PICTURES}",
                self.pictures.len()
            ));
        }
        let mut after = None;
        for (i, p) in self.pictures.iter().enumerate() {
            if after.is_some_and(|a| p.at <= a) {
                return Err(format!(
                    "pictures[{i}].at {} is not after the picture before it",
                    p.at
                ));
            }
            if p.at as usize + 1 >= self.tokens.len() {
                return Err(format!(
                    "pictures[{i}].at {} needs a prompt token after it (the prompt has {})",
                    p.at,
                    self.tokens.len()
                ));
            }
            if p.data.is_empty() {
                return Err(format!("pictures[{i}].data is empty"));
            }
            after = Some(p.at);
        }
        Ok(())
    }
}

/// The largest `top_k` a GEN may ask for.
pub const MAX_TOP_K: u32 = 1 << 24;

/// `CANCEL`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancel {
    pub id: String,
}

/// Checks a request or conversation id: non-empty, at most [`MAX_ID_BYTES`], no control characters.
fn check_id(what: &str, id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err(format!("`{what}` is empty"));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(format!("`{what}` is longer than {MAX_ID_BYTES} bytes"));
    }
    if id.chars().any(char::is_control) {
        return Err(format!("`{what}` has control characters"));
    }
    Ok(())
}

/// serde's error does not name the field; find the first field whose value alone makes a `GEN` fail.
fn field_at_fault(value: &serde_json::Value) -> Option<(String, serde_json::Error)> {
    let object = value.as_object()?;
    object.iter().find_map(|(key, v)| {
        let mut probe = serde_json::Map::new();
        probe.insert("id".into(), "probe".into());
        probe.insert("tokens".into(), serde_json::json!([0]));
        probe.insert(key.clone(), v.clone());
        serde_json::from_value::<Gen>(serde_json::Value::Object(probe))
            .err()
            .map(|e| (key.clone(), e))
    })
}

/// The request id of a body, when it has a readable one.
fn id_of(value: &serde_json::Value) -> Option<String> {
    value.get("id")?.as_str().map(str::to_owned)
}

impl ToEngine {
    /// Reads one line (with or without its newline). Every failure is a [`ProtocolError`] with code
    /// `bad_request` and, when the line had a readable `id`, that id.
    pub fn parse(line: &str) -> Result<ToEngine, ProtocolError> {
        let (verb, body) = split_verb(line);
        if verb.is_empty() {
            return Err(ProtocolError::bad_request(None, "empty line"));
        }
        let known = ["GEN", "CANCEL", "STATS", "QUIT"];
        if !known.contains(&verb) {
            return Err(ProtocolError::bad_request(
                None,
                format!(
                    "unknown verb `{}` (expected GEN, CANCEL, STATS or QUIT)",
                    truncate(verb, 40)
                ),
            ));
        }
        let value = parse_object(verb, body)?;
        let id = id_of(&value);
        let need_id = |v: &serde_json::Value| -> Result<String, ProtocolError> {
            match v.get("id") {
                None => Err(ProtocolError::bad_request(
                    None,
                    format!("{verb}: missing `id`"),
                )),
                Some(serde_json::Value::String(s)) => {
                    check_id("id", s)
                        .map_err(|m| ProtocolError::bad_request(None, format!("{verb}: {m}")))?;
                    Ok(s.clone())
                }
                Some(_) => Err(ProtocolError::bad_request(
                    None,
                    format!("{verb}: `id` must be a string"),
                )),
            }
        };
        match verb {
            "GEN" => {
                need_id(&value)?;
                let gen: Gen = serde_json::from_value(value.clone()).map_err(|e| {
                    let message = match field_at_fault(&value) {
                        Some((field, e)) => format!("GEN: `{field}`: {e}"),
                        None => format!("GEN: {e}"),
                    };
                    ProtocolError::new(id.clone(), ErrorCode::BadRequest, message)
                })?;
                gen.check()?;
                Ok(ToEngine::Gen(gen))
            }
            "CANCEL" => Ok(ToEngine::Cancel(Cancel {
                id: need_id(&value)?,
            })),
            "STATS" => Ok(ToEngine::Stats),
            _ => Ok(ToEngine::Quit),
        }
    }

    /// The line, without its newline.
    pub fn to_line(&self) -> String {
        match self {
            ToEngine::Gen(g) => format_line("GEN", g),
            ToEngine::Cancel(c) => format_line("CANCEL", c),
            ToEngine::Stats => "STATS {}".to_owned(),
            ToEngine::Quit => "QUIT {}".to_owned(),
        }
    }
}

/// At most `n` characters of `s`, for messages that quote input.
pub(crate) fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(line: &str) -> ProtocolError {
        ToEngine::parse(line).expect_err(line)
    }

    #[test]
    fn gen_defaults_are_greedy_256_tokens() {
        let ToEngine::Gen(g) = ToEngine::parse(r#"GEN {"id":"a","tokens":[5]}"#).unwrap() else {
            panic!("not a GEN")
        };
        assert_eq!(
            (g.max_tokens(), g.temperature(), g.top_k(), g.top_p()),
            (256, 0.0, 0, 1.0)
        );
        assert_eq!(
            (g.min_p(), g.repeat_penalty(), g.top_logprobs()),
            (0.0, 1.0, 0)
        );
        assert!(g.stop_tokens.is_none() && g.conversation.is_none() && g.seed.is_none());
    }

    #[test]
    fn every_field_round_trips_and_unknown_fields_are_ignored() {
        let line = r#"GEN {"id":"r1","tokens":[1,2],"max_tokens":3,"temperature":0.5,"top_k":4,"top_p":0.9,"min_p":0.1,"repeat_penalty":1.1,"presence_penalty":0.2,"frequency_penalty":0.3,"seed":7,"stop_tokens":[9],"top_logprobs":5,"conversation":"c1","checkpoint_at":1,"future_field":{"x":1}}"#;
        let req = ToEngine::parse(line).unwrap();
        let ToEngine::Gen(g) = &req else {
            panic!("not a GEN")
        };
        assert_eq!(g.seed, Some(7));
        assert_eq!(g.stop_tokens.as_deref(), Some(&[9u32][..]));
        assert_eq!(g.conversation.as_deref(), Some("c1"));
        assert_eq!(ToEngine::parse(&req.to_line()).unwrap(), req);
        assert!(!req.to_line().contains("future_field"));
    }

    #[test]
    fn bad_lines_say_what_is_wrong_and_keep_the_id_when_readable() {
        assert!(err("").message.contains("empty line"));
        assert!(err("HELLO {}").message.contains("unknown verb"));
        assert!(err("GEN {not json").message.contains("invalid JSON"));
        assert!(err("GEN [1,2]").message.contains("JSON object"));
        assert!(err(r#"GEN {"tokens":[1]}"#)
            .message
            .contains("missing `id`"));
        assert!(err(r#"GEN {"id":5,"tokens":[1]}"#)
            .message
            .contains("string"));
        let e = err(r#"GEN {"id":"r9","tokens":[]}"#);
        assert_eq!(e.id.as_deref(), Some("r9"));
        assert!(e.message.contains("empty"));
        let e = err(r#"GEN {"id":"r9","tokens":[-1]}"#);
        assert_eq!(
            (e.id.as_deref(), e.code),
            (Some("r9"), ErrorCode::BadRequest)
        );
        assert!(err(r#"GEN {"id":"r9","tokens":[1],"temperature":-1}"#)
            .message
            .contains("temperature"));
        assert!(err(r#"GEN {"id":"r9","tokens":[1],"top_p":1.5}"#)
            .message
            .contains("top_p"));
        assert!(err(r#"GEN {"id":"r9","tokens":[1],"top_logprobs":1000}"#)
            .message
            .contains("top_logprobs"));
        assert!(err(r#"GEN {"id":"r9","tokens":[1],"max_tokens":-3}"#)
            .message
            .contains("max_tokens"));
        assert!(err(r#"GEN {"id":"r9","tokens":[1],"repeat_penalty":0}"#)
            .message
            .contains("repeat_penalty"));
        assert!(err(r#"CANCEL {}"#).message.contains("missing `id`"));
        let long = "x".repeat(MAX_ID_BYTES + 1);
        assert!(err(&format!(r#"CANCEL {{"id":"{long}"}}"#))
            .message
            .contains("longer"));
    }

    #[test]
    fn pictures_round_trip_and_are_checked() {
        let line = r#"GEN {"id":"r1","tokens":[1,2,3,4],"pictures":[{"at":1,"data":"Zm9v"},{"at":2,"data":"YmFy"}]}"#;
        let req = ToEngine::parse(line).unwrap();
        let ToEngine::Gen(g) = &req else {
            panic!("not a GEN")
        };
        assert_eq!(g.pictures.len(), 2);
        assert_eq!(ToEngine::parse(&req.to_line()).unwrap(), req);
        // Without pictures the line is what version 1 always wrote.
        let plain = ToEngine::Gen(Gen::new("r1", vec![1]));
        assert!(!plain.to_line().contains("pictures"));
        for (pictures, needle) in [
            (r#"[{"at":2,"data":"a"},{"at":1,"data":"b"}]"#, "not after"),
            (r#"[{"at":1,"data":"a"},{"at":1,"data":"b"}]"#, "not after"),
            (r#"[{"at":3,"data":"a"}]"#, "after it"),
            (r#"[{"at":1,"data":""}]"#, "empty"),
            (r#"[{"at":1}]"#, "pictures"),
        ] {
            let e = err(&format!(
                r#"GEN {{"id":"r2","tokens":[1,2,3,4],"pictures":{pictures}}}"#
            ));
            assert_eq!(e.id.as_deref(), Some("r2"));
            assert!(e.message.contains(needle), "{}", e.message);
        }
    }

    #[test]
    fn stats_and_quit_may_be_bare() {
        assert_eq!(ToEngine::parse("STATS").unwrap(), ToEngine::Stats);
        assert_eq!(ToEngine::parse("QUIT {}\r\n").unwrap(), ToEngine::Quit);
        assert_eq!(
            ToEngine::parse(r#"CANCEL {"id":"r1"}"#).unwrap(),
            ToEngine::Cancel(Cancel { id: "r1".into() })
        );
    }

    #[test]
    fn top_k_out_of_range_is_printed_exactly() {
        let e = ToEngine::parse(r#"GEN {"id":"r1","tokens":[1],"top_k":4294967295}"#)
            .expect_err("over the bound");
        assert!(
            e.message
                .contains("top_k 4294967295 is outside [0, 16777216]"),
            "{}",
            e.message
        );
    }
}
