//! Errors in each API's own shape: OpenAI's `{"error":{"message","type","param","code"}}`, Anthropic's
//! `{"type":"error","error":{"type","message"}}`, the management API's `{"error":{"message","code"}}`
//! and Ollama's `{"error": "message"}`.

use super::body::{json_response, RespBody};
use crate::engine::supervisor::ServeError;
use hyper::{header, Response, StatusCode};
use serde_json::json;

/// Which API a request belongs to, for the shape of its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
    Plain,
    /// Ollama's `{"error": "message"}`.
    Ollama,
}

/// What went wrong, independent of the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    BadRequest,
    Unauthorized,
    /// A foreign `Host` or web origin.
    Forbidden,
    NotFound,
    ModelNotFound,
    MethodNotAllowed,
    PayloadTooLarge,
    UnsupportedMediaType,
    /// A request that did not arrive in time.
    Timeout,
    Busy,
    Conflict,
    Internal,
    Unavailable,
}

impl Kind {
    fn status(self) -> StatusCode {
        match self {
            Kind::BadRequest => StatusCode::BAD_REQUEST,
            Kind::Unauthorized => StatusCode::UNAUTHORIZED,
            Kind::Forbidden => StatusCode::FORBIDDEN,
            Kind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Kind::Timeout => StatusCode::REQUEST_TIMEOUT,
            Kind::NotFound | Kind::ModelNotFound => StatusCode::NOT_FOUND,
            Kind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Kind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::Busy | Kind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Kind::Conflict => StatusCode::CONFLICT,
            Kind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn openai_type(self) -> &'static str {
        match self {
            Kind::BadRequest
            | Kind::NotFound
            | Kind::ModelNotFound
            | Kind::MethodNotAllowed
            | Kind::PayloadTooLarge
            | Kind::UnsupportedMediaType
            | Kind::Timeout
            | Kind::Conflict => "invalid_request_error",
            Kind::Unauthorized => "authentication_error",
            Kind::Forbidden => "permission_error",
            Kind::Busy | Kind::Unavailable | Kind::Internal => "server_error",
        }
    }

    fn anthropic_type(self) -> &'static str {
        match self {
            Kind::BadRequest
            | Kind::MethodNotAllowed
            | Kind::Conflict
            | Kind::UnsupportedMediaType
            | Kind::Timeout => "invalid_request_error",
            Kind::Unauthorized => "authentication_error",
            Kind::Forbidden => "permission_error",
            Kind::NotFound | Kind::ModelNotFound => "not_found_error",
            Kind::PayloadTooLarge => "request_too_large",
            Kind::Busy | Kind::Unavailable => "overloaded_error",
            Kind::Internal => "api_error",
        }
    }

    fn code(self) -> &'static str {
        match self {
            Kind::BadRequest => "bad_request",
            Kind::Unauthorized => "invalid_api_key",
            Kind::Forbidden => "forbidden",
            Kind::UnsupportedMediaType => "unsupported_media_type",
            Kind::Timeout => "request_timeout",
            Kind::NotFound => "not_found",
            Kind::ModelNotFound => "model_not_found",
            Kind::MethodNotAllowed => "method_not_allowed",
            Kind::PayloadTooLarge => "payload_too_large",
            Kind::Busy => "busy",
            Kind::Conflict => "conflict",
            Kind::Internal => "internal_error",
            Kind::Unavailable => "model_unavailable",
        }
    }
}

/// An error on its way to the client.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub kind: Kind,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: Kind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::BadRequest, message)
    }

    /// The JSON document of this error in `flavor`'s shape.
    pub fn body(&self, flavor: Flavor) -> serde_json::Value {
        match flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.kind.openai_type(),
                "param": null,
                "code": self.kind.code(),
            }}),
            Flavor::Anthropic => json!({"type": "error", "error": {
                "type": self.kind.anthropic_type(),
                "message": self.message,
            }}),
            Flavor::Plain => json!({"error": {"message": self.message, "code": self.kind.code()}}),
            Flavor::Ollama => json!({"error": self.message}),
        }
    }

    pub fn response(&self, flavor: Flavor) -> Response<RespBody> {
        let mut resp = json_response(self.kind.status(), &self.body(flavor));
        if self.kind == Kind::Busy {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("2"));
        }
        resp
    }
}

impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> ApiError {
        let kind = match &e {
            ServeError::Busy(_) => Kind::Busy,
            ServeError::ModelNotFound(_) => Kind::ModelNotFound,
            ServeError::ModelUnavailable(_) => Kind::Unavailable,
            ServeError::SwitchTimeout(_) => Kind::Busy,
            ServeError::BadRequest(_) => Kind::BadRequest,
            ServeError::Engine(_) => Kind::Internal,
        };
        ApiError::new(kind, e.message())
    }
}

impl From<crate::generate::Failure> for ApiError {
    fn from(f: crate::generate::Failure) -> ApiError {
        use poly_protocol::ErrorCode;
        let kind = match f.code {
            Some(ErrorCode::BadRequest | ErrorCode::ContextOverflow) => Kind::BadRequest,
            Some(ErrorCode::Busy) => Kind::Busy,
            Some(ErrorCode::Internal | ErrorCode::Unknown) | None => Kind::Internal,
        };
        ApiError::new(kind, f.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_statuses() {
        let e = ApiError::new(Kind::ModelNotFound, "model \"x\" not found");
        assert_eq!(e.body(Flavor::OpenAi)["error"]["code"], "model_not_found");
        assert_eq!(
            e.body(Flavor::Anthropic)["error"]["type"],
            "not_found_error"
        );
        assert_eq!(e.body(Flavor::Anthropic)["type"], "error");
        assert_eq!(e.response(Flavor::Plain).status(), StatusCode::NOT_FOUND);
        let busy = ApiError::from(ServeError::Busy("full".into())).response(Flavor::OpenAi);
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(busy.headers()[header::RETRY_AFTER], "2");
    }
}
