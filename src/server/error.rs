//! Errors as OpenAI returns them: a status and `{"error": {message, type, param, code}}`.
//!
//! Clients (the `openai` packages among them) map the status to an exception class and show
//! `message`, so every message says what was wrong and, where it applies, which field.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What was wrong, for a person.
    pub message: String,
    /// OpenAI's error class: `invalid_request_error`, `rate_limit_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 400 naming the field at fault.
    pub fn invalid_field(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_owned()),
            ..ApiError::bad_request(message)
        }
    }

    /// 400 `context_length_exceeded`.
    pub fn context_length(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad_request(message)
        }
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist; this server serves `{served}`."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 401 `invalid_api_key`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 413 `request_too_large`.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body exceeds the server's limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// 429 `queue_full`.
    pub fn queue_full(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    /// 503 `shutting_down`.
    pub fn draining() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down and takes no new requests".into(),
            kind: "server_error",
            param: None,
            code: Some("shutting_down"),
        }
    }

    /// 500 `device_error`: the step the request was in failed.
    pub fn device(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("device_error"),
        }
    }

    /// 404 for a route that does not exist.
    pub fn no_route(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route {path}"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// The `{"error": ...}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
