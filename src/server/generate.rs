//! `POST /v1/completions` and `POST /v1/chat/completions`: reading and checking the request,
//! making its prompts and [`GenerationParams`]; [`super::response`] answers it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::engine::GenerationParams;
use crate::metrics::Outcome;
use crate::runner::step::SamplingParams;
use crate::tokenizer::ChatMessage;

use super::error::ApiError;
use super::protocol::{ChatRequest, CompletionRequest, Message, Prompt, SamplingFields};
use super::response::{respond, ChoiceSpec, Flavor, Prepared};
use super::AppState;

/// The most choices (prompts times `n`) one request may ask for.
const MAX_CHOICES: usize = 64;

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(state, body, prepare_completion).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(state, body, prepare_chat).await
}

/// Reads the body, prepares the request with `prepare`, and answers it (or the error).
async fn answer(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    prepare: fn(&AppState, &Value) -> Result<Prepared, ApiError>,
) -> Response {
    match read_json(&state, body).and_then(|v| prepare(&state, &v)) {
        Ok(p) => respond(state, p).await,
        Err(e) => reject(&state, e),
    }
}

/// The sampling fields of a request for `model`, checked.
fn checked_sampling(
    state: &AppState,
    body: &Value,
    model: &str,
) -> Result<SamplingFields, ApiError> {
    let sampling: SamplingFields = from_json(body)?;
    check_model(state, model)?;
    sampling.check()?;
    Ok(sampling)
}

fn prepare_completion(state: &AppState, body: &Value) -> Result<Prepared, ApiError> {
    let req: CompletionRequest = from_json(body)?;
    let sampling = checked_sampling(state, body, &req.model)?;
    if req.best_of.is_some_and(|b| b != sampling.n.unwrap_or(1)) {
        return Err(ApiError::invalid_field(
            "best_of",
            "best_of must equal n (choices are not ranked)",
        ));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_field("suffix", "suffix is not supported"));
    }
    // Each prompt's tokens, and its text when it is echoed.
    let prompts: Vec<(Vec<u32>, Option<String>)> = match &req.prompt {
        Prompt::Text(t) => vec![(encode_prompt(state, t)?, Some(t.clone()))],
        Prompt::Texts(v) => v
            .iter()
            .map(|t| Ok((encode_prompt(state, t)?, Some(t.clone()))))
            .collect::<Result<_, ApiError>>()?,
        Prompt::Tokens(ids) => vec![(ids.clone(), None)],
        Prompt::TokenLists(v) => v.iter().map(|ids| (ids.clone(), None)).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid_field(
            "prompt",
            "the prompt list is empty",
        ));
    }
    let logprobs = sampling.logprobs(false)?;
    if req.max_tokens == Some(0) && !req.echo {
        return Err(ApiError::invalid_field(
            "max_tokens",
            "max_tokens must be at least 1 (0 only with echo)",
        ));
    }
    let choices = prompts
        .into_iter()
        .map(|(prompt, text)| {
            let mut params = generation_params(
                state,
                &sampling,
                req.max_tokens,
                Some(16),
                prompt.len(),
                logprobs,
            )?;
            let echo = req.echo.then(|| {
                text.unwrap_or_else(|| {
                    state
                        .tokenizer
                        .as_ref()
                        .and_then(|t| t.decode(&prompt, true).ok())
                        .unwrap_or_default()
                })
            });
            if req.echo {
                // Echoed prompts carry their log-probabilities; with max_tokens 0 the engine
                // needs them to have anything to do.
                params.prompt_logprobs = logprobs.or((params.max_tokens == 0).then_some(0));
            }
            Ok(ChoiceSpec {
                prompt,
                params,
                echo,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    prepared(Flavor::Completion, &sampling, choices)
}

/// A completion prompt's tokens (bos prepended as the tokenizer is configured to).
fn encode_prompt(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Err(ApiError::invalid_field("prompt", "the prompt is empty"));
    }
    encode(state, text, true)
}

/// The request's choices: each (prompt, parameters) `n` times, the k-th copy sampling with
/// the seed plus k so that copies differ (and a seed still reproduces them all).
fn prepared(
    flavor: Flavor,
    sampling: &SamplingFields,
    per_prompt: Vec<ChoiceSpec>,
) -> Result<Prepared, ApiError> {
    let n = sampling.n.unwrap_or(1) as usize;
    if per_prompt.len() * n > MAX_CHOICES {
        return Err(ApiError::invalid_field(
            "n",
            format!(
                "{} prompts times n = {n} asks for more than {MAX_CHOICES} choices",
                per_prompt.len()
            ),
        ));
    }
    let prompt_tokens = per_prompt.iter().map(|c| c.prompt.len()).sum();
    let mut choices = Vec::with_capacity(per_prompt.len() * n);
    for spec in per_prompt {
        for k in 0..n {
            let mut c = spec.clone();
            c.params.sampling.seed = c.params.sampling.seed.wrapping_add(k as u32);
            choices.push(c);
        }
    }
    Ok(Prepared {
        flavor,
        choices,
        prompt_tokens,
        stream: sampling.stream,
        include_usage: sampling.include_usage(),
    })
}

fn prepare_chat(state: &AppState, body: &Value) -> Result<Prepared, ApiError> {
    let req: ChatRequest = from_json(body)?;
    let sampling = checked_sampling(state, body, &req.model)?;
    let prompt = chat_prompt(state, &req.messages)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    if max_tokens == Some(0) {
        return Err(ApiError::invalid_field(
            "max_tokens",
            "max_tokens must be at least 1, got 0",
        ));
    }
    let logprobs = sampling.logprobs(true)?;
    let params = generation_params(state, &sampling, max_tokens, None, prompt.len(), logprobs)?;
    prepared(
        Flavor::Chat,
        &sampling,
        vec![ChoiceSpec {
            prompt,
            params,
            echo: None,
        }],
    )
}

/// The tokens of `messages` rendered with the model's chat template, ending with the prompt for
/// the assistant's reply.
pub(super) fn chat_prompt(state: &AppState, messages: &[Message]) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_field(
            "messages",
            "messages must contain at least one message",
        ));
    }
    let tokenizer = state.tokenizer.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no tokenizer, so it cannot serve chat requests")
    })?;
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            Ok(ChatMessage {
                role: m.template_role(i)?.to_owned(),
                content: m.text(i)?,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = tokenizer
        .apply_chat_template(&messages, true)
        .map_err(|e| ApiError::invalid_field("messages", e.to_string()))?;
    // The template writes the bos token itself.
    encode(state, &text, false)
}

/// Counts a refused request and turns the error into its response.
pub(super) fn reject(state: &AppState, e: ApiError) -> Response {
    state.engine.metrics().record_outcome(Outcome::Rejected);
    e.into_response()
}

/// Reads the body as JSON.
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

/// The engine's parameters for a request, checking `max_tokens` against the context.
/// `default_max` of `None` means "the rest of the context".
fn generation_params(
    state: &AppState,
    s: &SamplingFields,
    max_tokens: Option<i64>,
    default_max: Option<usize>,
    prompt_len: usize,
    logprobs: Option<usize>,
) -> Result<GenerationParams, ApiError> {
    let max_len = state.engine.info().max_len;
    if prompt_len == 0 {
        return Err(ApiError::invalid_field("prompt", "the prompt is empty"));
    }
    if prompt_len >= max_len {
        return Err(ApiError::context_length(format!(
            "this model's context is {max_len} tokens and the prompt has {prompt_len}, \
             leaving no room for a completion"
        )));
    }
    let room = max_len - prompt_len;
    let max_tokens = match max_tokens {
        // 0 is checked by the caller (completions allow it with echo).
        Some(n) if n < 0 => {
            return Err(ApiError::invalid_field(
                "max_tokens",
                format!("max_tokens must be at least 1, got {n}"),
            ))
        }
        Some(n) if n as u64 > room as u64 => {
            return Err(ApiError::context_length(format!(
                "this model's context is {max_len} tokens; the prompt has {prompt_len} and \
                 max_tokens asks for {n} more (at most {room})"
            )))
        }
        Some(n) => n as usize,
        None => default_max.map_or(room, |d| d.min(room)),
    };
    let seed = match s.seed {
        // Fold 64 bits into the generator's 32.
        Some(v) => (v as u64 ^ (v as u64 >> 32)) as u32,
        None => fresh_seed(),
    };
    Ok(GenerationParams {
        sampling: SamplingParams {
            temperature: s.temperature.unwrap_or(1.0),
            top_k: s.top_k.unwrap_or(0).max(0),
            top_p: s.top_p.unwrap_or(1.0),
            seed,
        },
        max_tokens,
        stop: s.stop_strings(),
        stop_token_ids: s.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: s.ignore_eos,
        logprobs,
        prompt_logprobs: None,
    })
}

/// A seed for a request that gave none: different for every request, as OpenAI's sampling is.
fn fresh_seed() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}
