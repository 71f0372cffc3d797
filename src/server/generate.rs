//! `POST /v1/completions` and `POST /v1/chat/completions`: checking the request, making its
//! prompts and [`GenerationParams`], and submitting its choices to the engine;
//! [`super::response`] answers with what the engine produces.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use serde_json::Value;

use crate::engine::grammar::{OutputGrammar, ResponseFormat};
use crate::engine::{GenerationParams, RequestStream};
use crate::runner::step::SamplingParams;

use super::chat::{chat_prompt, prefills_calls, ChatPrompt};
use super::error::ApiError;
use super::protocol::{ChatRequest, CompletionRequest, Prompt, PromptFields, SamplingFields};
use super::request::{check_model, encode, from_json, off_runtime, read_json};
use super::response::{respond, ChoiceSpec, Flavor, Prepared};
use super::state::AppState;
use super::tools::reply::ToolReply;
use super::tools::{ToolChoice, ToolRequest};

/// The most choices (prompts times `n`) one request may ask for.
const MAX_CHOICES: usize = 64;

/// Numbers requests for [`GenerationParams::group`].
static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);

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

/// Prepares and submits the request (off the async workers: parsing, chat templating and
/// tokenizing grow with the prompt), then answers it; a refusal before the engine took it is
/// answered (and counted) as rejected.
async fn answer(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    prepare: fn(&AppState, &Value) -> Result<Prepared, ApiError>,
) -> Response {
    let job = state.clone();
    match off_runtime(move || submit(&job, body, prepare)).await {
        Ok((p, streams)) => respond(&state, p, streams).await,
        Err(e) => state.reject(e),
    }
}

/// Reads the body, prepares the request with `prepare`, and submits every choice. A choice the
/// engine refuses refuses the request (the choices already queued are cancelled when their
/// streams drop).
fn submit(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    prepare: fn(&AppState, &Value) -> Result<Prepared, ApiError>,
) -> Result<(Prepared, Vec<RequestStream>), ApiError> {
    let p = prepare(state, &read_json(state, body)?)?;
    // One constraint per choice (each advances with its own tokens), compiled before any
    // choice is queued so a bad schema refuses the request whole.
    let constraints = match &p.grammar {
        None => p.choices.iter().map(|_| None).collect::<Vec<_>>(),
        Some((grammar, param)) => {
            let compiler = state.grammar(param)?;
            p.choices
                .iter()
                .map(|_| {
                    compiler
                        .grammar_matcher(grammar)
                        .map(Some)
                        .map_err(|e| ApiError::invalid_field(param, e.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    // The request's choices are one admission group (see `GenerationParams::group`).
    let group = Some(NEXT_GROUP.fetch_add(1, Ordering::Relaxed));
    let streams = p
        .choices
        .iter()
        .zip(constraints)
        .map(|(c, constraint)| {
            let params = GenerationParams {
                group,
                ..c.params.clone()
            };
            state
                .engine
                .submit_constrained(c.prompt.clone(), params, constraint)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((p, streams))
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
    prepared(state, Flavor::Completion, &sampling, choices)
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
    state: &AppState,
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
    let grammar = match &sampling.response_format {
        None | Some(Value::Null) => None,
        Some(v) => ResponseFormat::from_openai(v)
            .map_err(|e| ApiError::invalid_field("response_format", e.to_string()))?
            .grammar_with(&state.config.json)
            .map(|g| (g, "response_format")),
    };
    Ok(Prepared {
        flavor,
        choices,
        prompt_tokens,
        stream: sampling.stream,
        include_usage: sampling.include_usage(),
        grammar,
        tool_reply: None,
        thinking: false,
    })
}

fn prepare_chat(state: &AppState, body: &Value) -> Result<Prepared, ApiError> {
    let req: ChatRequest = from_json(body)?;
    let sampling = checked_sampling(state, body, &req.model)?;
    let fields: PromptFields = from_json(body)?;
    let ChatPrompt {
        tokens: prompt,
        tools,
        thinking,
    } = chat_prompt(state, &req.messages, &fields)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    if max_tokens == Some(0) {
        return Err(ApiError::invalid_field(
            "max_tokens",
            "max_tokens must be at least 1, got 0",
        ));
    }
    let logprobs = sampling.logprobs(true)?;
    let params = generation_params(state, &sampling, max_tokens, None, prompt.len(), logprobs)?;
    let mut p = prepared(
        state,
        Flavor::Chat,
        &sampling,
        vec![ChoiceSpec {
            prompt,
            params,
            echo: None,
        }],
    )?;
    if let Some(tools) = tools.filter(|t| t.choice != ToolChoice::None) {
        use_tools(state, &tools, &mut p)?;
    }
    p.thinking = thinking.is_some();
    Ok(p)
}

/// Sets up a chat request that offers tools the model may call: its replies are parsed for
/// calls in the model's format, and for `required` or a named function constrained to be
/// calls. A model without a known format is served `required` and a named function as vLLM
/// serves them, its reply constrained to JSON (see [`ToolRequest::json_schema`]); only `auto`
/// is refused. Every function's `parameters` schema is compiled here, so a schema the grammar
/// engine refuses is a 400 naming that tool whatever the choice.
fn use_tools(state: &AppState, tools: &ToolRequest, p: &mut Prepared) -> Result<(), ApiError> {
    let options = &state.config.json;
    let format = state.tool_format();
    if format.is_none() && tools.choice == ToolChoice::Auto {
        return Err(ApiError::invalid_field(
            "tools",
            "this model's chat template writes no tool calls in a known format, so tool_choice \
             \"auto\" cannot be served: serve it with --chat-template (a template in \
             DeepSeek-V3's tool format) or --tool-call-parser, or ask for tool_choice \
             \"required\" or a named function (constrained to JSON, no format needed)",
        ));
    }
    let compiler = state.grammar("tools")?;
    for (i, tool) in tools.tools.iter().enumerate() {
        compiler
            .grammar_matcher(&OutputGrammar::JsonSchema(tool.arguments_schema(options)))
            .map_err(|e| {
                ApiError::invalid_field(&format!("tools[{i}].function.parameters"), e.to_string())
            })?;
    }
    if tools.constrained() && p.grammar.is_some() {
        return Err(ApiError::invalid_field(
            "response_format",
            "response_format cannot be combined with tool_choice \"required\" or a named \
             function (the reply is the calls)",
        ));
    }
    let Some(format) = format else {
        p.grammar = tools
            .json_schema(options)?
            .map(|schema| (OutputGrammar::JsonSchema(schema), "tools"));
        p.tool_reply = match &tools.choice {
            ToolChoice::Function(name) => Some(ToolReply::Named(name.clone())),
            ToolChoice::Required => Some(ToolReply::Required),
            ToolChoice::Auto | ToolChoice::None => None,
        };
        return Ok(());
    };
    let prefilled = tools.constrained() && prefills_calls(state);
    if tools.constrained() {
        let tokenizer = state.tokenizer.as_ref();
        let token_id = |piece: &str| tokenizer.and_then(|t| t.inner().token_to_id(piece));
        p.grammar = tools
            .grammar(format, prefilled, options, &token_id)
            .map(|lark| (OutputGrammar::Lark(lark), "tools"));
    }
    p.tool_reply = Some(ToolReply::Format {
        format,
        named: matches!(tools.choice, ToolChoice::Function(_)),
        prefilled,
    });
    Ok(())
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
    let vocab = state.engine.info().vocab_size;
    if let Some(t) = s
        .stop_token_ids
        .iter()
        .flatten()
        .find(|&&t| t as usize >= vocab)
    {
        return Err(ApiError::invalid_field(
            "stop_token_ids",
            format!("stop token id {t} is outside the vocabulary (size {vocab})"),
        ));
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
    let logit_bias = s.logit_bias(vocab)?;
    let min_tokens = s.min_tokens.unwrap_or(0) as usize;
    if min_tokens > max_tokens {
        return Err(ApiError::invalid_field(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"),
        ));
    }
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
            min_p: s.min_p.unwrap_or(0.0),
            presence_penalty: s.presence_penalty.unwrap_or(0.0),
            frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        },
        max_tokens,
        stop: s.stop_strings(),
        stop_token_ids: s.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: s.ignore_eos,
        logprobs,
        prompt_logprobs: None,
        logit_bias,
        min_tokens,
        group: None,
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
