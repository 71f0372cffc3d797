//! `POST /v1/completions` and `POST /v1/chat/completions`.
//!
//! Both turn the request into prompt tokens and [`GenerationParams`], submit them to the engine
//! and either collect the events into one response or stream them as SSE chunks. The two differ
//! only in how the prompt is made and how a piece of text is wrapped ([`Flavor`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::engine::{Event, GenerationParams, RequestStream, SubmitError, TokenEvent};
use crate::metrics::Outcome;
use crate::step::SamplingParams;
use crate::tokenizer::{ChatMessage, Tokenizer};

use super::error::ApiError;
use super::logprobs::LogprobsBuilder;
use super::protocol::{ChatRequest, CompletionRequest, Prompt, SamplingFields};
use super::AppState;

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Completion,
    Chat,
}

impl Flavor {
    fn id_prefix(self) -> &'static str {
        match self {
            Flavor::Completion => "cmpl",
            Flavor::Chat => "chatcmpl",
        }
    }

    fn object(self, streaming: bool) -> &'static str {
        match (self, streaming) {
            (Flavor::Completion, _) => "text_completion",
            (Flavor::Chat, false) => "chat.completion",
            (Flavor::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A streamed choice carrying `text` (and the role, in a chat's first chunk).
    fn chunk_choice(self, text: &str, first: bool, finish: Option<&str>, logprobs: Value) -> Value {
        match self {
            Flavor::Completion => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Flavor::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    /// The one choice of a non-streamed response.
    fn full_choice(self, text: &str, finish: &str, logprobs: Value) -> Value {
        match self {
            Flavor::Completion => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Flavor::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        }
    }
}

/// What both endpoints hand to [`respond`].
struct Prepared {
    flavor: Flavor,
    prompt: Vec<u32>,
    params: GenerationParams,
    stream: bool,
    include_usage: bool,
}

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
    if req.echo {
        return Err(ApiError::invalid_field("echo", "echo is not supported"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid_field(
            "best_of",
            "only best_of = 1 is supported",
        ));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_field("suffix", "suffix is not supported"));
    }
    let text = match &req.prompt {
        Prompt::Text(t) => Some(t),
        Prompt::Texts(v) if v.len() == 1 => Some(&v[0]),
        Prompt::Texts(v) => {
            return Err(ApiError::invalid_field(
                "prompt",
                format!(
                    "{} prompts in one request are not supported; send one request per prompt",
                    v.len()
                ),
            ))
        }
        Prompt::Tokens(_) => None,
    };
    let prompt = match (text, &req.prompt) {
        (Some(t), _) if t.is_empty() => {
            return Err(ApiError::invalid_field("prompt", "the prompt is empty"))
        }
        (Some(t), _) => encode(state, t, true)?,
        (None, Prompt::Tokens(ids)) => ids.clone(),
        (None, _) => Vec::new(),
    };
    let logprobs = sampling.logprobs(false)?;
    let params = generation_params(
        state,
        &sampling,
        req.max_tokens,
        Some(16),
        prompt.len(),
        logprobs,
    )?;
    Ok(Prepared {
        flavor: Flavor::Completion,
        prompt,
        params,
        stream: sampling.stream,
        include_usage: sampling.include_usage(),
    })
}

fn prepare_chat(state: &AppState, body: &Value) -> Result<Prepared, ApiError> {
    let req: ChatRequest = from_json(body)?;
    let sampling = checked_sampling(state, body, &req.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid_field(
            "messages",
            "messages must contain at least one message",
        ));
    }
    let tokenizer = state.tokenizer.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no tokenizer, so it cannot serve chat requests")
    })?;
    let messages = req
        .messages
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
    let prompt = encode(state, &text, false)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    let logprobs = sampling.logprobs(true)?;
    let params = generation_params(state, &sampling, max_tokens, None, prompt.len(), logprobs)?;
    Ok(Prepared {
        flavor: Flavor::Chat,
        prompt,
        params,
        stream: sampling.stream,
        include_usage: sampling.include_usage(),
    })
}

/// Counts a refused request and turns the error into its response.
fn reject(state: &AppState, e: ApiError) -> Response {
    state.engine.metrics().record_outcome(Outcome::Rejected);
    e.into_response()
}

/// Reads the body as JSON.
fn read_json(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
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
fn from_json<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
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

fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model == state.config.served_model_name {
        Ok(())
    } else {
        Err(ApiError::model_not_found(
            model,
            &state.config.served_model_name,
        ))
    }
}

fn encode(state: &AppState, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
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
        Some(n) if n < 1 => {
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Submits the request and answers it, streamed or whole.
async fn respond(state: Arc<AppState>, p: Prepared) -> Response {
    let logprobs = p.params.logprobs.is_some();
    let stream = match state.engine.submit(p.prompt, p.params) {
        Ok(s) => s,
        Err(e) => {
            let err = match e {
                SubmitError::Invalid(m) => ApiError::invalid_field("prompt", m),
                SubmitError::QueueFull(_) => ApiError::queue_full(e.to_string()),
                SubmitError::Draining => ApiError::draining(),
            };
            return reject(&state, err);
        }
    };
    let id = format!(
        "{}-{}{}",
        p.flavor.id_prefix(),
        state.id_prefix,
        stream.id()
    );
    let header = Arc::new(Header {
        id,
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        flavor: p.flavor,
        tokenizer: state.tokenizer.clone().filter(|_| logprobs),
        logprobs,
    });
    if p.stream {
        Sse::new(sse_events(header, stream, p.include_usage))
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        collect(header, stream).await
    }
}

/// The fields every response and chunk starts with, and how tokens are reported.
#[derive(Debug)]
struct Header {
    id: String,
    created: u64,
    model: String,
    flavor: Flavor,
    /// Report log-probabilities.
    logprobs: bool,
    /// For the text of tokens in log-probabilities.
    tokenizer: Option<Arc<Tokenizer>>,
}

impl Header {
    /// A fresh log-probabilities builder, when the request asked for them.
    fn logprobs_builder(&self) -> Option<LogprobsBuilder> {
        self.logprobs
            .then(|| LogprobsBuilder::new(self.flavor == Flavor::Chat))
    }

    /// Adds `t`'s log-probabilities (its text starting at `offset`) to `b`.
    fn add_logprobs(&self, b: &mut Option<LogprobsBuilder>, t: &TokenEvent, offset: usize) {
        if let (Some(b), Some(lp)) = (b.as_mut(), &t.logprobs) {
            b.push(self.tokenizer.as_deref(), t.token, lp, offset);
        }
    }

    fn with(&self, streaming: bool, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.flavor.object(streaming),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

/// Waits for the whole generation and answers with one JSON body.
async fn collect(header: Arc<Header>, mut stream: RequestStream) -> Response {
    let mut text = String::new();
    let mut tokens = 0;
    let mut logprobs = header.logprobs_builder();
    while let Some(event) = stream.next().await {
        match event {
            Event::Token(t) => {
                tokens += 1;
                header.add_logprobs(&mut logprobs, &t, text.len());
                text.push_str(&t.text);
                if let Some(f) = t.finish {
                    let lp = logprobs.take().map_or(Value::Null, LogprobsBuilder::finish);
                    let body = header.with(
                        false,
                        json!([header.flavor.full_choice(&text, f.as_str(), lp)]),
                        Some(usage(stream.prompt_tokens(), tokens)),
                    );
                    return Json(body).into_response();
                }
            }
            Event::Failed(m) => return ApiError::device(m).into_response(),
        }
    }
    ApiError::device("the engine stopped before the request finished").into_response()
}

/// Where a streamed response is.
enum StreamState {
    Running {
        stream: RequestStream,
        tokens: usize,
        first: bool,
        /// Text bytes sent so far (the offset of the next token's text).
        sent: usize,
        /// Log-probabilities of tokens whose text has not been sent yet.
        pending: Option<LogprobsBuilder>,
    },
    Usage(Value),
    Done,
    End,
}

/// The SSE events of a streamed response: one chunk per token that releases text (and the
/// final one, with its finish reason), the usage chunk if asked, then `[DONE]`. A failure sends
/// an `{"error": ...}` event and ends the stream.
fn sse_events(
    header: Arc<Header>,
    stream: RequestStream,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let start = StreamState::Running {
        stream,
        tokens: 0,
        first: true,
        sent: 0,
        pending: header.logprobs_builder(),
    };
    stream::unfold(start, move |state| {
        let header = header.clone();
        async move {
            match state {
                StreamState::Running {
                    mut stream,
                    mut tokens,
                    mut first,
                    mut sent,
                    mut pending,
                } => loop {
                    match stream.next().await {
                        Some(Event::Token(t)) => {
                            tokens += 1;
                            header.add_logprobs(&mut pending, &t, sent);
                            let finish = t.finish.map(|f| f.as_str());
                            if t.text.is_empty() && finish.is_none() && !first {
                                continue;
                            }
                            let lp = std::mem::replace(&mut pending, header.logprobs_builder())
                                .map_or(Value::Null, LogprobsBuilder::finish);
                            let choice = header.flavor.chunk_choice(&t.text, first, finish, lp);
                            first = false;
                            sent += t.text.len();
                            let chunk = header.with(true, json!([choice]), None);
                            let next = match finish {
                                None => StreamState::Running {
                                    stream,
                                    tokens,
                                    first,
                                    sent,
                                    pending,
                                },
                                Some(_) if include_usage => StreamState::Usage(header.with(
                                    true,
                                    json!([]),
                                    Some(usage(stream.prompt_tokens(), tokens)),
                                )),
                                Some(_) => StreamState::Done,
                            };
                            return Some((Ok(data(&chunk)), next));
                        }
                        Some(Event::Failed(m)) => {
                            return Some((Ok(data(&ApiError::device(m).body())), StreamState::End))
                        }
                        None => {
                            let e =
                                ApiError::device("the engine stopped before the request finished");
                            return Some((Ok(data(&e.body())), StreamState::End));
                        }
                    }
                },
                StreamState::Usage(u) => Some((Ok(data(&u)), StreamState::Done)),
                StreamState::Done => {
                    Some((Ok(SseEvent::default().data("[DONE]")), StreamState::End))
                }
                StreamState::End => None,
            }
        }
    })
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}
