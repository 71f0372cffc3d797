//! Answering a submitted request: either collect its choices' events into one JSON body or
//! stream them as SSE chunks.
//!
//! A request has one choice per prompt and per `n`; each is its own engine request, so they
//! batch with everything else. Streamed chunks of different choices interleave, each carrying
//! its `index`, as OpenAI's do. If one choice fails, the response fails (a 500, or an error
//! event that ends the stream) and the other choices are cancelled.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, BoxStream, Stream, StreamExt};
use serde_json::{json, Value};

use crate::engine::grammar::OutputGrammar;
use crate::engine::{Event, FinishReason, GenerationParams, RequestStream};
use crate::error::ErrorKind;
use crate::tokenizer::Tokenizer;

use super::error::ApiError;
use super::logprobs::LogprobsBuilder;
use super::reasoning::ReasoningSplitter;
use super::state::AppState;
use super::tools::parser::Parsed;
use super::tools::reply::{ReplyParser, ToolReply};

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
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
}

/// One choice of a request.
#[derive(Debug, Clone)]
pub struct ChoiceSpec {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// How to generate.
    pub params: GenerationParams,
    /// With `echo`: the prompt's text, which the choice's text starts with.
    pub echo: Option<String>,
}

/// A request ready for the engine: one prompt and parameters per choice.
#[derive(Debug)]
pub struct Prepared {
    /// Which endpoint.
    pub flavor: Flavor,
    /// The choices, in `index` order.
    pub choices: Vec<ChoiceSpec>,
    /// Distinct prompt tokens, for `usage` (a prompt with `n` choices counts once).
    pub prompt_tokens: usize,
    /// Stream over SSE.
    pub stream: bool,
    /// End a stream with a usage chunk.
    pub include_usage: bool,
    /// Structured outputs: the grammar every choice's text must follow (`None`: free text),
    /// and the request field that asked for it (named by its errors).
    pub grammar: Option<(OutputGrammar, &'static str)>,
    /// Chat with tools: how the model's replies write calls, which they are parsed for.
    pub tool_reply: Option<ToolReply>,
    /// Thinking mode: each reply is reasoning, then `</think>`, then the answer.
    pub thinking: bool,
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
    prompt_tokens: usize,
}

impl Header {
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

    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    fn logprobs_builder(&self) -> Option<LogprobsBuilder> {
        self.logprobs
            .then(|| LogprobsBuilder::new(self.flavor == Flavor::Chat))
    }
}

/// One choice's progress.
#[derive(Debug)]
struct Choice {
    index: usize,
    tokens: usize,
    /// Text so far (whole responses: the echoed prompt, then the generated text).
    text: String,
    /// Text bytes sent so far (streams), the echoed prompt included.
    sent: usize,
    /// No chunk of this choice was sent yet (a chat's first carries the role, an echoing
    /// completion's first the prompt).
    first: bool,
    /// With `echo`: the prompt text, and its tokens (for the text of their log-probabilities).
    echo: Option<String>,
    prompt: Vec<u32>,
    /// Where the next prompt token's text starts, for `text_offset`.
    prompt_offset: usize,
    /// Log-probabilities not sent yet (streams), or all of them (whole responses).
    logprobs: Option<LogprobsBuilder>,
    finish: Option<FinishReason>,
    /// Chat with tools: the parser of the reply's text (fed as it streams, or whole at the
    /// end).
    tool_parser: Option<ReplyParser>,
    /// Thinking mode: splits the reasoning off the reply (before the tool parser sees it).
    reasoning: Option<ReasoningSplitter>,
}

impl Choice {
    fn new(
        index: usize,
        spec: &ChoiceSpec,
        header: &Header,
        tool_reply: Option<&ToolReply>,
        thinking: bool,
    ) -> Self {
        Choice {
            tool_parser: tool_reply.map(ReplyParser::new),
            reasoning: thinking.then(ReasoningSplitter::default),
            index,
            tokens: 0,
            text: String::new(),
            sent: 0,
            first: true,
            echo: spec.echo.clone(),
            prompt: spec.prompt.clone(),
            prompt_offset: 0,
            logprobs: header.logprobs_builder(),
            finish: None,
        }
    }

    /// Takes one event of this choice. For a stream, returns the chunk choice to send (when the
    /// event releases text, or is the choice's first or last).
    fn on_event(&mut self, header: &Header, event: &Event, streaming: bool) -> Option<Value> {
        let tokenizer = header.tokenizer.as_deref();
        let echo = if self.first {
            self.echo.clone().unwrap_or_default()
        } else {
            String::new()
        };
        let mut piece = String::new();
        match event {
            Event::PromptLogprobs { start, logprobs } => {
                if let Some(b) = self.logprobs.as_mut() {
                    for (j, lp) in (*start..).zip(logprobs) {
                        let token = self.prompt.get(j).copied().unwrap_or(0);
                        let len = b.push_prompt(tokenizer, token, lp.as_ref(), self.prompt_offset);
                        self.prompt_offset += len;
                    }
                }
                return None;
            }
            Event::Token(t) => {
                self.tokens += 1;
                if let (Some(b), Some(lp)) = (self.logprobs.as_mut(), &t.logprobs) {
                    let offset = if streaming {
                        self.sent + echo.len()
                    } else {
                        self.text.len() + echo.len()
                    };
                    b.push(tokenizer, t.token, lp, offset);
                }
                piece.push_str(&t.text);
                self.finish = t.finish;
            }
            Event::Finished(f) => self.finish = Some(*f),
            Event::Failed { .. } => return None,
        }
        let text = echo + &piece;
        if !streaming {
            self.text.push_str(&text);
            self.first = false;
            return None;
        }
        // Chat replies may hold reasoning, then tool calls: what the splitter and the parser
        // release of the text so far.
        let (reasoning, answer) = self.split_reasoning(&text);
        let (content, tool_calls) = match header.flavor {
            Flavor::Completion => (text.clone(), Vec::new()),
            Flavor::Chat => self.parse_tool_calls(header, &answer),
        };
        // After the parser has seen the text: a call may have begun in it.
        let finish = self.finish_reason();
        self.sent += text.len();
        let quiet = reasoning.is_empty() && content.is_empty() && tool_calls.is_empty();
        if quiet && finish.is_none() && !self.first {
            return None;
        }
        let lp = std::mem::replace(&mut self.logprobs, header.logprobs_builder())
            .map_or(Value::Null, LogprobsBuilder::finish);
        let choice = match header.flavor {
            Flavor::Completion => json!({
                "index": self.index, "text": content, "logprobs": lp, "finish_reason": finish,
            }),
            Flavor::Chat => {
                let mut delta = if self.first {
                    json!({"role": "assistant", "content": content})
                } else if content.is_empty() {
                    json!({})
                } else {
                    json!({"content": content})
                };
                if !reasoning.is_empty() {
                    delta["reasoning_content"] = Value::String(reasoning);
                }
                if !tool_calls.is_empty() {
                    delta["tool_calls"] = Value::Array(tool_calls);
                }
                json!({"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
        };
        self.first = false;
        Some(choice)
    }

    /// Streams in thinking mode: the reasoning `text` adds (with what was held back, after the
    /// last token) and the answer it releases; otherwise `text` is all answer.
    fn split_reasoning(&mut self, text: &str) -> (String, String) {
        let Some(splitter) = self.reasoning.as_mut() else {
            return (String::new(), text.to_owned());
        };
        let (mut reasoning, answer) = splitter.push(text);
        if self.finish.is_some() {
            reasoning.push_str(&splitter.finish());
        }
        (reasoning, answer)
    }

    /// Streams with tools: passes `text` through the tool-call parser (flushing it after the
    /// last token) and returns the content it releases and the `tool_calls` deltas it
    /// completes. Without tools, `text` is all content.
    fn parse_tool_calls(&mut self, header: &Header, text: &str) -> (String, Vec<Value>) {
        let Some(parser) = self.tool_parser.as_mut() else {
            return (text.to_owned(), Vec::new());
        };
        let mut parsed = parser.push(text);
        if self.finish.is_some() {
            parsed.extend(parser.finish());
        }
        let mut content = String::new();
        let mut calls = Vec::new();
        for p in parsed {
            match p {
                Parsed::Content(c) => content.push_str(&c),
                Parsed::CallStart { index, name } => calls.push(json!({
                    "index": index,
                    "id": call_id(header, self.index, index),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                })),
                Parsed::Arguments { index, text } => calls.push(json!({
                    "index": index, "function": {"arguments": text},
                })),
            }
        }
        (content, calls)
    }

    /// The finish reason to report: `tool_calls` for a reply that called tools and ended by
    /// itself (as OpenAI's; a named function's forced call is `stop`, see
    /// [`ReplyParser::stops_as_tool_calls`]), otherwise the engine's (`length` for a reply cut
    /// by `max_tokens`, calls or not).
    fn finish_reason(&self) -> Option<&'static str> {
        let called = self
            .tool_parser
            .as_ref()
            .is_some_and(ReplyParser::stops_as_tool_calls);
        match self.finish {
            Some(FinishReason::Stop) if called => Some("tool_calls"),
            other => other.map(FinishReason::as_str),
        }
    }

    /// The choice object of a whole response.
    fn whole(mut self, header: &Header) -> Value {
        let lp = self
            .logprobs
            .take()
            .map_or(Value::Null, LogprobsBuilder::finish);
        match header.flavor {
            Flavor::Completion => json!({
                "index": self.index,
                "text": self.text,
                "logprobs": lp,
                "finish_reason": self.finish.map(FinishReason::as_str),
            }),
            Flavor::Chat => {
                let (reasoning, answer) = match self.reasoning {
                    Some(_) => {
                        let (r, a) = ReasoningSplitter::split(&self.text);
                        (Some(r), a)
                    }
                    None => (None, std::mem::take(&mut self.text)),
                };
                let (content, calls) = match self.tool_parser.as_mut() {
                    Some(parser) => parser.parse_rest(&answer),
                    None => (Some(answer), Vec::new()),
                };
                let mut message = json!({"role": "assistant", "content": content});
                if let Some(reasoning) = reasoning {
                    message["reasoning_content"] = Value::String(reasoning);
                }
                if !calls.is_empty() {
                    let calls: Vec<Value> = calls
                        .into_iter()
                        .enumerate()
                        .map(|(k, (name, arguments))| {
                            json!({
                                "id": call_id(header, self.index, k),
                                "type": "function",
                                "function": {"name": name, "arguments": arguments},
                            })
                        })
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                } else if message["content"].is_null() {
                    message["content"] = json!("");
                }
                json!({
                    "index": self.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": self.finish_reason(),
                })
            }
        }
    }
}

/// A tool call's id: the response's id, the choice and the call's place in it (unique, as
/// clients match tool messages to calls by it).
fn call_id(header: &Header, choice: usize, call: usize) -> String {
    let response = header.id.trim_start_matches("chatcmpl-");
    format!("call_{response}_{choice}_{call}")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The events of every choice, merged, each tagged with its choice's index.
fn merged(streams: Vec<RequestStream>) -> BoxStream<'static, (usize, Event)> {
    let per_choice = streams.into_iter().enumerate().map(|(i, s)| {
        stream::unfold(s, |mut s| async move { s.next().await.map(|e| (e, s)) })
            .map(move |e| (i, e))
            .boxed()
    });
    stream::select_all(per_choice).boxed()
}

/// Answers a request whose choices the engine took (`streams`, one per choice in order),
/// streamed or whole.
pub async fn respond(state: &AppState, p: Prepared, streams: Vec<RequestStream>) -> Response {
    let logprobs = p.choices.iter().any(|c| c.params.logprobs.is_some());
    let first_id = streams.first().map_or(0, |s| s.id());
    let header = Arc::new(Header {
        id: format!("{}-{}{first_id}", p.flavor.id_prefix(), state.id_prefix),
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        flavor: p.flavor,
        tokenizer: state.tokenizer.clone().filter(|_| logprobs),
        logprobs,
        prompt_tokens: p.prompt_tokens,
    });
    let choices: Vec<Choice> = p
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| Choice::new(i, c, &header, p.tool_reply.as_ref(), p.thinking))
        .collect();
    let events = merged(streams);
    if p.stream {
        Sse::new(sse_events(header, events, choices, p.include_usage))
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        collect(header, events, choices).await.into_response()
    }
}

/// What a request gets when the engine stops sending its events before the last one: the
/// engine thread died, which is no fault of the request's.
fn engine_stopped() -> ApiError {
    ApiError::from_kind(
        ErrorKind::Internal,
        "the engine stopped before the request finished",
    )
}

/// Waits for every choice and answers with one JSON body; a failed choice fails the request.
async fn collect(
    header: Arc<Header>,
    mut events: BoxStream<'static, (usize, Event)>,
    mut choices: Vec<Choice>,
) -> Result<Json<Value>, ApiError> {
    let mut done = 0;
    while let Some((i, event)) = events.next().await {
        if let Event::Failed { kind, message } = event {
            return Err(ApiError::from_kind(kind, message));
        }
        choices[i].on_event(&header, &event, false);
        if event.is_last() {
            done += 1;
        }
        if done == choices.len() {
            let tokens = choices.iter().map(|c| c.tokens).sum();
            let body = header.with(
                false,
                Value::Array(choices.into_iter().map(|c| c.whole(&header)).collect()),
                Some(header.usage(tokens)),
            );
            return Ok(Json(body));
        }
    }
    Err(engine_stopped())
}

/// Where a streamed response is.
enum StreamState {
    Running {
        events: BoxStream<'static, (usize, Event)>,
        choices: Vec<Choice>,
        done: usize,
    },
    Usage(Value),
    Done,
    End,
}

/// The SSE events of a streamed response: a chunk per event that releases text (and each
/// choice's first and last, the last with its finish reason), the usage chunk if asked, then
/// `[DONE]`. A failure sends an `{"error": ...}` event and ends the stream.
fn sse_events(
    header: Arc<Header>,
    events: BoxStream<'static, (usize, Event)>,
    choices: Vec<Choice>,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let start = StreamState::Running {
        events,
        choices,
        done: 0,
    };
    stream::unfold(start, move |state| {
        let header = header.clone();
        async move {
            match state {
                StreamState::Running {
                    mut events,
                    mut choices,
                    mut done,
                } => loop {
                    let Some((i, event)) = events.next().await else {
                        return Some((Ok(data(&engine_stopped().body())), StreamState::End));
                    };
                    if let Event::Failed { kind, message } = event {
                        let e = ApiError::from_kind(kind, message);
                        return Some((Ok(data(&e.body())), StreamState::End));
                    }
                    if event.is_last() {
                        done += 1;
                    }
                    let Some(choice) = choices[i].on_event(&header, &event, true) else {
                        continue;
                    };
                    let chunk = header.with(true, json!([choice]), None);
                    let next = if done < choices.len() {
                        StreamState::Running {
                            events,
                            choices,
                            done,
                        }
                    } else if include_usage {
                        let tokens = choices.iter().map(|c| c.tokens).sum();
                        StreamState::Usage(header.with(true, json!([]), Some(header.usage(tokens))))
                    } else {
                        StreamState::Done
                    };
                    return Some((Ok(data(&chunk)), next));
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
