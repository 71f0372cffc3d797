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
use crate::tokenizer::{ChatEncoding, ChatMessage};

use super::error::ApiError;
use super::protocol::Message;
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

/// What a chat prompt is rendered from besides its messages.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ChatExtras<'a> {
    /// The request's `tools` entries, which the template (or V4's encoder) sees.
    pub tools: Option<&'a [Value]>,
    /// A `json_schema` response format's schema (stated in V4's system text).
    pub response_schema: Option<&'a Value>,
    /// The reply must be tool calls (V4's encoder opens the calls block).
    pub calls_forced: bool,
}

/// The tokens of `messages` rendered with the model's chat template, or V4's encoder for a
/// `deepseek_v4` model (see [`crate::chat_v4`]), ending with the prompt for the assistant's
/// reply.
pub(super) fn chat_prompt(
    state: &AppState,
    messages: &[Message],
    extras: ChatExtras,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_field(
            "messages",
            "messages must contain at least one message",
        ));
    }
    let tokenizer = state.tokenizer.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no tokenizer, so it cannot serve chat requests")
    })?;
    let v4 = tokenizer.chat_encoding() == ChatEncoding::DeepseekV4;
    // DeepSeek's V4 encoder joins text parts by blank lines; templates see them joined.
    let separator = if v4 { "\n\n" } else { "" };
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let tool_calls = m.template_tool_calls(i)?;
            // An assistant turn that only called tools has no content (the template's none).
            let content = match (&m.content, &tool_calls) {
                (None, Some(_)) => None,
                _ => Some(m.text(i, separator)?),
            };
            Ok(ChatMessage {
                role: m.template_role(i)?.to_owned(),
                content,
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = if v4 {
        crate::chat_v4::render(&crate::chat_v4::V4Chat {
            messages: &messages,
            tools: extras.tools,
            response_schema: extras.response_schema,
            calls_forced: extras.calls_forced,
        })
    } else {
        tokenizer.apply_chat_template_with_tools(&messages, extras.tools, true)
    }
    .map_err(|e| ApiError::invalid_field("messages", e.to_string()))?;
    // The template writes the bos token itself.
    encode(state, &text, false)
}
