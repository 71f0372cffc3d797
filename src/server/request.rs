//! Reading a request, shared by every endpoint that takes a JSON body: the body as JSON, a
//! typed request out of it (naming the field at fault), the `model` check, and prompts as
//! tokens (plain text, or chat messages through the model's template).
//!
//! Parsing, templating and tokenizing a request is CPU work that grows with the prompt (a
//! megabyte of text takes tens of milliseconds): [`off_runtime`] runs it on tokio's blocking
//! threads, at most one request per core at a time, so that the async workers keep serving
//! every other connection (streams, `/health`, `/metrics`) meanwhile.

use std::sync::OnceLock;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::error::ErrorKind;

use super::error::ApiError;
use super::state::AppState;

/// Runs `work` (a request's parsing and tokenizing) on a blocking thread, off the async
/// workers. At most one such job per core runs at once; the others wait for a turn without
/// holding a thread, so a flood of long prompts queues here rather than spawning a blocking
/// thread each (tokio allows 512) on a machine with a few cores. Errors are `work`'s own; a
/// panic in it is an internal error.
pub(super) async fn off_runtime<T, F>(work: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    /// One permit per core, made on first use (a process serves one app).
    static TURNS: OnceLock<Semaphore> = OnceLock::new();
    let turns = TURNS.get_or_init(|| {
        Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
    });
    // The semaphore is never closed, so acquiring cannot fail; were it to, the work would run
    // without a turn rather than fail the request. The turn goes with the work: a request
    // dropped meanwhile (its client gone) does not free it while the work still runs.
    let turn = turns.acquire().await.ok();
    let job = move || {
        let _turn = turn;
        work()
    };
    match tokio::task::spawn_blocking(job).await {
        Ok(result) => result,
        Err(e) => Err(ApiError::from_kind(
            ErrorKind::Internal,
            format!("reading the request failed: {e}"),
        )),
    }
}

/// Reads the body as a JSON object (a body over the limit is a 413).
pub(super) fn read_json(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(state.config.max_body_bytes)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(value)
}

/// Reads a request type out of the body, naming the field at fault when a value has the
/// wrong type.
pub(super) fn from_json<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(format!("invalid request: {inner}"))
        } else {
            ApiError::invalid_field(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })
}

/// Checks that the request asks for the model this server serves (a 404 otherwise).
pub(super) fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model == state.config.served_model_name {
        Ok(())
    } else {
        Err(ApiError::model_not_found(
            model,
            &state.config.served_model_name,
        ))
    }
}

/// The tokens of a text prompt; without a tokenizer only token-id prompts can be served.
pub(super) fn encode(
    state: &AppState,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, ApiError> {
    let tokenizer = state.tokenizer.as_ref().ok_or_else(|| {
        ApiError::invalid_field(
            "prompt",
            "this model has no tokenizer: send the prompt as a list of token ids",
        )
    })?;
    tokenizer
        .encode(text, add_special_tokens)
        .map_err(|e| ApiError::invalid_field("prompt", e.to_string()))
}
