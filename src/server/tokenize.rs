//! `POST /tokenize` and `POST /detokenize` (vLLM's): the model's tokenizer over HTTP, so a
//! client can count tokens, or fit a prompt to the context, exactly as the server will.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::chat::chat_prompt;
use super::error::ApiError;
use super::protocol::{Message, PromptFields};
use super::request::{check_model, encode, from_json, off_runtime, read_json};
use super::state::AppState;

/// `POST /tokenize`: a `prompt`, or chat `messages`.
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    /// Checked when given.
    model: Option<String>,
    /// Text to encode.
    prompt: Option<String>,
    /// Or a conversation, rendered as for `/v1/chat/completions` (with its tools, tool choice,
    /// response format and thinking mode: [`PromptFields`]).
    messages: Option<Vec<Message>>,
    /// For `prompt`: add bos (and eos) as the tokenizer is configured to. Defaults to true.
    add_special_tokens: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    /// Checked when given.
    model: Option<String>,
    /// The token ids.
    tokens: Vec<u32>,
}

fn tokenize_body(state: &AppState, body: &Value) -> Result<Value, ApiError> {
    let req: TokenizeRequest = from_json(body)?;
    if let Some(m) = &req.model {
        check_model(state, m)?;
    }
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => encode(state, p, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(messages)) => {
            let fields: PromptFields = from_json(body)?;
            chat_prompt(state, messages, &fields)?.tokens
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` and `messages`",
            ))
        }
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": state.engine.info().max_len,
        "tokens": tokens,
    }))
}

fn detokenize_body(state: &AppState, body: &Value) -> Result<Value, ApiError> {
    let req: DetokenizeRequest = from_json(body)?;
    if let Some(m) = &req.model {
        check_model(state, m)?;
    }
    let vocab = state.engine.info().vocab_size;
    if let Some(t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_field(
            "tokens",
            format!("token id {t} is outside the vocabulary (size {vocab})"),
        ));
    }
    let tokenizer = state
        .tokenizer
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("this model has no tokenizer"))?;
    let text = tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::invalid_field("tokens", e.to_string()))?;
    Ok(json!({ "prompt": text }))
}

/// `POST /tokenize`, off the async workers (see [`off_runtime`]).
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(state, body, tokenize_body).await
}

/// `POST /detokenize`, off the async workers (see [`off_runtime`]).
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(state, body, detokenize_body).await
}

/// Reads the body and answers it with `work`, on a blocking thread.
async fn answer(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    work: fn(&AppState, &Value) -> Result<Value, ApiError>,
) -> Response {
    let job = state.clone();
    match off_runtime(move || read_json(&job, body).and_then(|v| work(&job, &v))).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => state.reject(e),
    }
}
