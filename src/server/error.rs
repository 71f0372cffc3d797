//! Errors as OpenAI returns them: a status and `{"error": {message, type, param, code}}`.
//!
//! Clients (the `openai` packages among them) map the status to an exception class and show
//! `message`, so every message says what was wrong and, where it applies, which field.
//!
//! Handlers build the request's own faults with the constructors below and convert everything
//! else with `?`: the library's [`Error`] and a failed request's
//! [`Event::Failed`](crate::engine::Event::Failed) by their [`ErrorKind`], a refused submission
//! by its [`SubmitError`]. The mapping lives here, once, so a device or internal fault can never
//! reach a client as its invalid request. Faults of the server (5xx) are logged with their
//! details; an internal fault's details are only logged, the client gets a generic message.
//!
//! This module imports nothing else of the server's: every other server module may use it.

use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine::SubmitError;
use crate::error::{Error, ErrorKind};

/// What the shutdown ends the requests still running at the drain deadline with (through
/// `Engine::abort_all`, whose events are of kind [`ErrorKind::ShuttingDown`]: 503
/// `shutting_down`, the code a request refused while draining gets).
pub const SHUTDOWN_MESSAGE: &str =
    "the server is shutting down and ended this request (its drain timeout passed)";

/// An error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What was wrong, for a person.
    pub message: String,
    /// OpenAI's error class (the body's `type`): `invalid_request_error`, `rate_limit_error`,
    /// `server_error`.
    pub error_type: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

/// The `type` of errors that are the request's fault.
const INVALID_REQUEST: &str = "invalid_request_error";
/// The `type` of errors that are the server's fault, or its state's.
const SERVER_ERROR: &str = "server_error";

impl ApiError {
    /// An error with no `param` and no `code`.
    fn new(status: StatusCode, error_type: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            error_type,
            param: None,
            code: None,
        }
    }

    /// The same error with a `code`.
    fn with_code(self, code: &'static str) -> Self {
        ApiError {
            code: Some(code),
            ..self
        }
    }

    /// 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, INVALID_REQUEST, message)
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
        ApiError::bad_request(message).with_code("context_length_exceeded")
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                INVALID_REQUEST,
                format!("The model `{asked}` does not exist; this server serves `{served}`."),
            )
            .with_code("model_not_found")
        }
    }

    /// 401 `invalid_api_key`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, INVALID_REQUEST, message)
            .with_code("invalid_api_key")
    }

    /// 413 `request_too_large`.
    pub fn too_large(limit: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            INVALID_REQUEST,
            format!("the request body exceeds the server's limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    /// 429 `queue_full`: the client may retry later (the `openai` clients do, by themselves).
    pub fn queue_full(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .with_code("queue_full")
    }

    /// 503 `shutting_down`.
    pub fn draining() -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            SERVER_ERROR,
            "the server is shutting down and takes no new requests",
        )
        .with_code("shutting_down")
    }

    /// 408 `request_timeout`: the client stopped sending its body; it waited `secs` seconds
    /// for the rest. The request's fault, hence `invalid_request_error` (OpenAI's clients retry
    /// a 408 by themselves).
    pub fn body_timeout(secs: u64) -> Self {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            INVALID_REQUEST,
            format!(
                "the request body did not arrive within {secs} s (the server's --body-timeout-secs)"
            ),
        )
        .with_code("request_timeout")
    }

    /// 503 `too_many_connections`: the server already holds its limit of open connections.
    /// Answered with `Retry-After` (the caller adds it: see [`RETRY_AFTER_SECS`]).
    pub fn too_many_connections(limit: u32) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            SERVER_ERROR,
            format!(
                "the server already holds its limit of {limit} open connections; retry shortly"
            ),
        )
        .with_code("too_many_connections")
    }

    /// 500 `device_error`: the step the request was in failed on the device (or the compiler
    /// failed on its graph).
    pub fn device(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR, message)
            .with_code("device_error")
    }

    /// 500 `internal_error`: a bug or a broken installation. The client learns only that; the
    /// details are for the server's log.
    pub fn internal() -> Self {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            SERVER_ERROR,
            "the server failed while serving this request (an internal error); \
             its log has the details",
        )
        .with_code("internal_error")
    }

    /// 404 for a route that does not exist.
    pub fn no_route(path: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            format!("no route {path}"),
        )
    }

    /// 405 for a route that exists but not for `method` (the response's `Allow` header lists
    /// the methods it takes).
    pub fn method_not_allowed(method: &Method, path: &str) -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            INVALID_REQUEST,
            format!(
                "{path} does not take {method} requests (the Allow header says which it takes)"
            ),
        )
    }

    /// The response to a failure of `kind` (a library error, or a request the engine failed),
    /// and the one place that decides it:
    ///
    /// | kind | status | `type` | `code` |
    /// |---|---|---|---|
    /// | `InvalidInput` | 400 | `invalid_request_error` | none |
    /// | `ResourceExhausted` | 503 | `server_error` | `resource_exhausted` |
    /// | `ShuttingDown` | 503 | `server_error` | `shutting_down` |
    /// | `Unavailable` | 503 | `server_error` | `unavailable` |
    /// | `Device`, `Compile` | 500 | `server_error` | `device_error` |
    /// | `Internal`, `Io`, `InvalidModel` | 500 | `server_error` | `internal_error` |
    ///
    /// Running out of KV-cache blocks is the server's capacity, not the client's rate, hence
    /// 503 rather than 429 (which `queue_full` keeps for a client to back off). Every 5xx is
    /// logged with `message`; an internal one sends the client a generic message instead.
    pub fn from_kind(kind: ErrorKind, message: impl Into<String>) -> Self {
        let message = message.into();
        let server_fault = |status| {
            tracing::error!(?kind, %status, "request failed: {message}");
        };
        match kind {
            ErrorKind::InvalidInput => ApiError::bad_request(message),
            ErrorKind::ResourceExhausted => {
                server_fault(StatusCode::SERVICE_UNAVAILABLE);
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, SERVER_ERROR, message)
                    .with_code("resource_exhausted")
            }
            // The drain deadline passed: the server ended the request, nothing failed.
            ErrorKind::ShuttingDown => {
                tracing::info!("request ended by the shutdown: {message}");
                ApiError {
                    message,
                    ..ApiError::draining()
                }
            }
            ErrorKind::Unavailable => {
                server_fault(StatusCode::SERVICE_UNAVAILABLE);
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, SERVER_ERROR, message)
                    .with_code("unavailable")
            }
            ErrorKind::Device | ErrorKind::Compile => {
                server_fault(StatusCode::INTERNAL_SERVER_ERROR);
                ApiError::device(message)
            }
            ErrorKind::Internal | ErrorKind::Io | ErrorKind::InvalidModel => {
                server_fault(StatusCode::INTERNAL_SERVER_ERROR);
                ApiError::internal()
            }
        }
    }

    /// The `{"error": ...}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError::from_kind(e.kind(), e.to_string())
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            // The engine checks the prompt's tokens against the model.
            SubmitError::Invalid(m) => ApiError::invalid_field("prompt", m),
            SubmitError::QueueFull(_) => ApiError::queue_full(e.to_string()),
            SubmitError::Draining => ApiError::draining(),
        }
    }
}

/// The `Retry-After` a 429 carries, in seconds.
pub const RETRY_AFTER_SECS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // A full queue drains in about a step per waiting request: a second is a retry
            // that can find room, not a hammering one (the `openai` clients honour it).
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_of_the_server_is_never_the_requests() {
        for kind in [
            ErrorKind::ResourceExhausted,
            ErrorKind::Unavailable,
            ErrorKind::Io,
            ErrorKind::Compile,
            ErrorKind::Device,
            ErrorKind::Internal,
            ErrorKind::InvalidModel,
        ] {
            let e = ApiError::from_kind(kind, "x");
            assert!(e.status.is_server_error(), "{kind:?}: {}", e.status);
            assert_eq!(e.error_type, SERVER_ERROR, "{kind:?}");
        }
        let e = ApiError::from_kind(ErrorKind::InvalidInput, "bad token");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.error_type, INVALID_REQUEST);
        assert_eq!(e.message, "bad token");
    }

    #[test]
    fn an_internal_fault_keeps_its_details_out_of_the_response() {
        let e = ApiError::from(Error::Internal("secret /path/to/model".into()));
        assert_eq!(e.code, Some("internal_error"));
        assert!(!e.message.contains("secret"), "{}", e.message);
        let e = ApiError::from(Error::Candle(candle_core::Error::Msg("inner".into())));
        assert_eq!(e.code, Some("internal_error"));
    }

    #[test]
    fn a_device_fault_is_a_device_error_with_its_message() {
        let e = ApiError::from(Error::Device {
            graph: "decode_b1_c256".into(),
            nrt: neuron_sys::Error::status("nrt_execute", 1),
        });
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.code, Some("device_error"));
        assert!(e.message.contains("decode_b1_c256"), "{}", e.message);
    }

    #[test]
    fn refused_submissions_keep_their_statuses() {
        let e = ApiError::from(SubmitError::Invalid("token 9999 is outside".into()));
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("prompt"))
        );
        let e = ApiError::from(SubmitError::QueueFull(3));
        assert_eq!(
            (e.status, e.code),
            (StatusCode::TOO_MANY_REQUESTS, Some("queue_full"))
        );
        assert!(e.message.contains('3'), "{}", e.message);
        let e = ApiError::from(SubmitError::Draining);
        assert_eq!(
            (e.status, e.code),
            (StatusCode::SERVICE_UNAVAILABLE, Some("shutting_down"))
        );
    }

    #[test]
    fn a_request_ended_by_the_shutdown_is_shutting_down_not_a_fault() {
        let e = ApiError::from_kind(ErrorKind::ShuttingDown, SHUTDOWN_MESSAGE);
        assert_eq!(e.error_type, SERVER_ERROR);
        assert_eq!(e.message, SHUTDOWN_MESSAGE);
        assert_eq!(
            (e.status, e.code),
            (StatusCode::SERVICE_UNAVAILABLE, Some("shutting_down"))
        );
        // Any other unavailability (a library not installed) keeps its own code.
        let e = ApiError::from_kind(ErrorKind::Unavailable, "libnrt.so not found");
        assert_eq!(e.code, Some("unavailable"));
    }

    #[test]
    fn connection_level_refusals_are_openai_shaped() {
        let e = ApiError::body_timeout(30);
        assert_eq!(
            (e.status, e.error_type, e.code),
            (
                StatusCode::REQUEST_TIMEOUT,
                INVALID_REQUEST,
                Some("request_timeout")
            )
        );
        assert!(e.message.contains("30"), "{}", e.message);
        let e = ApiError::too_many_connections(4);
        assert_eq!(
            (e.status, e.error_type, e.code),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER_ERROR,
                Some("too_many_connections")
            )
        );
    }
}
