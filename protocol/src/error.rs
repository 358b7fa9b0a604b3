//! Error codes of `ERR` lines and the error a line that cannot be read gives.

use serde::{Deserialize, Serialize};

/// Why a request cannot be served (the `code` of an `ERR` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The line or its values are wrong: malformed, unknown verb, invalid JSON, a missing field, a token
    /// outside the vocabulary, a sampling value out of range, an unknown id to cancel, a line too long.
    BadRequest,
    /// The prompt plus `max_tokens` do not fit in the engine's context.
    ContextOverflow,
    /// The request queue is full.
    Busy,
    /// The engine failed (including a model that cannot be loaded).
    Internal,
    /// A code this version does not know (a newer engine); read as an error all the same.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::ContextOverflow => "context_overflow",
            ErrorCode::Busy => "busy",
            ErrorCode::Internal => "internal",
            ErrorCode::Unknown => "unknown",
        }
    }
}

/// A line that cannot be turned into a message. Carries the request id when the line had a readable one,
/// so the engine can address its `ERR` to it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProtocolError {
    pub id: Option<String>,
    pub code: ErrorCode,
    pub message: String,
}

impl ProtocolError {
    pub fn new(id: Option<String>, code: ErrorCode, message: impl Into<String>) -> ProtocolError {
        ProtocolError {
            id,
            code,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(id: Option<String>, message: impl Into<String>) -> ProtocolError {
        ProtocolError::new(id, ErrorCode::BadRequest, message)
    }
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.id {
            Some(id) => write!(f, "{} ({id}): {}", self.code.as_str(), self.message),
            None => write!(f, "{}: {}", self.code.as_str(), self.message),
        }
    }
}

impl std::error::Error for ProtocolError {}
