//! The line protocol between `polystrata` (the server) and `poly-engine` (one child per model).
//!
//! This crate owns the wire format; `protocol/README.md` is its specification. One message per line: a
//! verb, one space, a JSON object. The server writes [`ToEngine`] messages to the engine's stdin; the
//! engine writes [`FromEngine`] messages to its stdout and nothing else there (its logs go to stderr).
//! Both sides parse and format through this crate and never on their own. It knows nothing of tensors,
//! kernels or HTTP.
//!
//! Unknown JSON fields are ignored when reading, so either side can grow a field without breaking the
//! other; the names and meanings defined here are fixed.
//!
//! ```
//! use poly_protocol::{FromEngine, ToEngine};
//!
//! let req = ToEngine::parse(r#"GEN {"id":"r1","tokens":[1,2,3],"max_tokens":8}"#).unwrap();
//! let ToEngine::Gen(gen) = req else { unreachable!() };
//! assert_eq!(gen.max_tokens(), 8);
//! assert_eq!(gen.temperature(), 0.0); // greedy by default
//!
//! let line = FromEngine::Tokens(poly_protocol::Tokens {
//!     id: "r1".into(),
//!     tokens: vec![42],
//!     logprobs: vec![-0.25],
//!     top: None,
//! })
//! .to_line();
//! assert_eq!(line, r#"T {"id":"r1","tokens":[42],"logprobs":[-0.25]}"#);
//! ```

mod base64;
mod error;
mod from_engine;
mod line;
mod to_engine;

pub use base64::{decode_base64, encode_base64};
pub use error::{ErrorCode, ProtocolError};
pub use from_engine::{
    ConversationInfo, Done, ErrorReply, FromEngine, LeftOut, Progress, PromptCalls, Ready, Stats,
    StopReason, SwappedIn, Tokens, Vision,
};
pub use line::{read_line_bounded, LineRead};
pub use to_engine::{Cancel, Gen, Picture, ToEngine, MAX_PICTURES};

/// The protocol version the engine announces in its `READY` line.
pub const PROTOCOL_VERSION: u32 = 1;

/// The longest line either side accepts, in bytes (without the newline). A longer line is answered
/// with `ERR bad_request` and skipped, never buffered whole.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// Splits a line into its verb and its JSON body. A line with no space is a verb with an empty body.
fn split_verb(line: &str) -> (&str, &str) {
    let line = line.trim_end_matches(['\r', '\n']);
    match line.split_once(' ') {
        Some((verb, body)) => (verb, body.trim()),
        None => (line.trim(), ""),
    }
}

/// Parses a body that must be a JSON object; an empty body is `{}` (so `STATS` and `QUIT` may be written
/// bare by a person at a terminal).
fn parse_object(verb: &str, body: &str) -> Result<serde_json::Value, ProtocolError> {
    if body.is_empty() {
        return Ok(serde_json::Value::Object(Default::default()));
    }
    let value: serde_json::Value = serde_json::from_str(body).map_err(|e| {
        ProtocolError::new(
            None,
            ErrorCode::BadRequest,
            format!("{verb}: invalid JSON: {e}"),
        )
    })?;
    if !value.is_object() {
        return Err(ProtocolError::new(
            None,
            ErrorCode::BadRequest,
            format!("{verb}: the body must be a JSON object"),
        ));
    }
    Ok(value)
}

/// Formats `VERB {json}`.
fn format_line<T: serde::Serialize>(verb: &str, body: &T) -> String {
    // Serializing these plain structs cannot fail: every map key is a string and every float is finite
    // (non-finite values are mapped by the fields' serializers).
    let json = serde_json::to_string(body).unwrap_or_else(|_| "{}".to_owned());
    format!("{verb} {json}")
}
