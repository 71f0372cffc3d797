//! The OpenAI request bodies we accept, and their checks.
//!
//! Fields we do not implement but that change what a client gets (`best_of > n`, `suffix`,
//! ...) are refused with a 400 naming the field rather than silently ignored; unknown fields
//! are ignored, as OpenAI's SDKs send new ones over time.
//!
//! Every optional field takes `null` as its default, as OpenAI's API and vLLM do: clients
//! (and OpenAI's own SDKs, for some fields) serialize an unset field as `null`. An `Option`
//! field does so by itself; a field with a plain default (`stream`, `echo`, `ignore_eos`,
//! `include_usage`) needs `null_is_false`, since serde's `#[serde(default)]` only covers an
//! absent field.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::error::ApiError;

/// The most alternatives a request may ask for per token (vLLM's default cap; OpenAI's is 5
/// for completions and 20 for chat).
pub const MAX_LOGPROBS: usize = 20;

/// The most choices per prompt (`n`).
pub const MAX_N: i64 = 16;

/// `prompt` of a completion request.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids, or a list of such lists"
)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids: one choice each.
    TokenLists(Vec<Vec<u32>>),
    /// Several texts: one choice each.
    Texts(Vec<String>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`: an object (or `null`), read by `object_or_null`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts.
    #[serde(default, deserialize_with = "null_is_false")]
    pub include_usage: bool,
}

/// Sampling and stopping fields shared by both endpoints, read from the same body as the
/// endpoint's own fields (not `#[serde(flatten)]`ed, which would lose the field names from
/// type errors).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Defaults to 1.
    pub temperature: Option<f32>,
    /// Defaults to 1.
    pub top_p: Option<f32>,
    /// vLLM's extension; 0 or -1 is off.
    pub top_k: Option<i32>,
    /// Makes sampling reproducible.
    pub seed: Option<i64>,
    /// Stop strings (at most 4).
    pub stop: Option<Stop>,
    /// vLLM's extension: stop after any of these tokens.
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's extension: keep going past end-of-sequence (`null` is `false`).
    #[serde(default, deserialize_with = "null_is_false")]
    pub ignore_eos: bool,
    /// Stream over SSE (`null`, as OpenAI's clients may send, is `false`).
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    /// Streaming options: an object or `null`, anything else a 400 naming the field.
    #[serde(default, deserialize_with = "object_or_null")]
    pub stream_options: Option<StreamOptions>,
    /// Choices per prompt (each its own sequence; the k-th samples with the seed plus k).
    pub n: Option<i64>,
    /// OpenAI's, in [-2, 2]: subtracted once from every generated token's logit.
    pub presence_penalty: Option<f32>,
    /// OpenAI's, in [-2, 2]: subtracted from a token's logit per time it was generated.
    pub frequency_penalty: Option<f32>,
    /// vLLM's extension, > 0 (1 is off): divides positive and multiplies negative logits of
    /// the prompt's and generated tokens.
    pub repetition_penalty: Option<f32>,
    /// vLLM's extension, in [0, 1]: drops tokens less likely than `min_p` times the likeliest.
    pub min_p: Option<f32>,
    /// vLLM's extension: no end-of-sequence or stop token before this many tokens.
    pub min_tokens: Option<i64>,
    /// OpenAI's: token id (as a string) to a bias in [-100, 100] added to its logit.
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// OpenAI's structured outputs: `{"type": "text" | "json_object" | "json_schema", ...}`
    /// (read by `engine::grammar::ResponseFormat::from_openai`).
    pub response_format: Option<serde_json::Value>,
    /// Completions: how many alternatives to report with each token's log-probability;
    /// chat: `true` to report log-probabilities (see [`SamplingFields::logprobs`]).
    pub logprobs: Option<serde_json::Value>,
    /// Chat: how many alternatives to report with each token's log-probability.
    pub top_logprobs: Option<i64>,
    /// Ignored (OpenAI uses it for abuse monitoring).
    pub user: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Must be the served model's name.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Defaults to 16, as OpenAI's.
    pub max_tokens: Option<i64>,
    /// Start each choice's text with its prompt (and its log-probabilities with the prompt's,
    /// when `logprobs` is set); allows `max_tokens: 0`. `null` is `false`.
    #[serde(default, deserialize_with = "null_is_false")]
    pub echo: bool,
    /// Refused unless equal to `n` (choices are not ranked).
    pub best_of: Option<i64>,
    /// Refused unless empty.
    pub suffix: Option<String>,
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Only `text` is served.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A message's `content`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of content parts")]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Parts; the text parts are joined.
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (null for an assistant turn that only called tools).
    pub content: Option<Content>,
    /// An assistant turn's tool calls: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}`.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message's answer to this call.
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, as a thinking-mode reply returned it (V4's encoder
    /// writes it back beside tools).
    pub reasoning_content: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Must be the served model's name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Defaults to the rest of the context.
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
}

/// The fields of a chat request that shape its prompt besides the messages, read from the
/// same body as the endpoint's own fields (`/v1/chat/completions`, and `/tokenize` with
/// `messages`, read the same).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PromptFields {
    /// Functions the model may call (read by `tools::ToolRequest::from_request`).
    pub tools: Option<serde_json::Value>,
    /// `none`, `auto`, `required` or a named function.
    pub tool_choice: Option<serde_json::Value>,
    /// Whether a reply may hold more than one call (default true).
    pub parallel_tool_calls: Option<bool>,
    /// A `json_schema` response format's schema is stated in V4's prompt.
    pub response_format: Option<serde_json::Value>,
    /// DeepSeek's switch of thinking mode: `{"type": "enabled" | "disabled"}`.
    pub thinking: Option<serde_json::Value>,
    /// vLLM's and SGLang's way to the same switch: `{"thinking": true}`.
    pub chat_template_kwargs: Option<serde_json::Value>,
    /// How hard a thinking-mode reply reasons (`low`, `high`, `max`, ...).
    pub reasoning_effort: Option<String>,
}

/// A boolean field that may also be `null` (meaning `false`).
fn null_is_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// An object field that may also be `null` (meaning absent), and nothing else.
///
/// serde's derived `Deserialize` for a struct also reads a JSON array as its fields in order,
/// so `"stream_options": []` was taken as no options and `[true]` as `include_usage`, where
/// OpenAI refuses both. Reading through [`MapAccessDeserializer`] rather than a
/// `serde_json::Value` keeps the caller's path tracking, so an error inside the object names
/// its field (`stream_options.include_usage`).
fn object_or_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct ObjectOrNull<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectOrNull<T> {
        type Value = Option<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object or null")
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            T::deserialize(MapAccessDeserializer::new(map)).map(Some)
        }
    }

    d.deserialize_any(ObjectOrNull(PhantomData))
}

impl SamplingFields {
    /// Refuses the fields we do not implement, and values outside their ranges.
    pub fn check(&self) -> Result<(), ApiError> {
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid_field(
                    "temperature",
                    format!("temperature must be between 0 and 2, got {t}"),
                ));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid_field(
                    "top_p",
                    format!("top_p must be in (0, 1], got {p}"),
                ));
            }
        }
        if let Some(k) = self.top_k {
            if k < -1 {
                return Err(ApiError::invalid_field(
                    "top_k",
                    format!("top_k must be -1, 0 (off) or positive, got {k}"),
                ));
            }
        }
        if let Some(n) = self.n {
            if !(1..=MAX_N).contains(&n) {
                return Err(ApiError::invalid_field(
                    "n",
                    format!("n must be between 1 and {MAX_N}, got {n}"),
                ));
            }
        }
        if let Some(Stop::Many(v)) = &self.stop {
            if v.len() > 4 {
                return Err(ApiError::invalid_field(
                    "stop",
                    format!("at most 4 stop strings are allowed, got {}", v.len()),
                ));
            }
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = v.filter(|v| !(-2.0..=2.0).contains(v)) {
                return Err(ApiError::invalid_field(
                    name,
                    format!("{name} must be between -2 and 2, got {v}"),
                ));
            }
        }
        if let Some(r) = self
            .repetition_penalty
            .filter(|r| !(*r > 0.0 && r.is_finite()))
        {
            return Err(ApiError::invalid_field(
                "repetition_penalty",
                format!("repetition_penalty must be a positive number (1 is off), got {r}"),
            ));
        }
        if let Some(m) = self.min_p.filter(|m| !(0.0..=1.0).contains(m)) {
            return Err(ApiError::invalid_field(
                "min_p",
                format!("min_p must be between 0 and 1, got {m}"),
            ));
        }
        if let Some(n) = self.min_tokens.filter(|n| *n < 0) {
            return Err(ApiError::invalid_field(
                "min_tokens",
                format!("min_tokens must be at least 0, got {n}"),
            ));
        }
        Ok(())
    }

    /// `logit_bias` as `(token, bias)` pairs, each token below `vocab` and each bias in
    /// [-100, 100] (OpenAI's range).
    pub fn logit_bias(&self, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        let most = crate::runner::step::LOGIT_BIAS_SLOTS;
        if map.len() > most {
            return Err(ApiError::invalid_field(
                "logit_bias",
                format!(
                    "logit_bias has {} entries; at most {most} are supported",
                    map.len()
                ),
            ));
        }
        let mut out = Vec::with_capacity(map.len());
        for (key, value) in map {
            let token = key.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
            let Some(token) = token else {
                return Err(ApiError::invalid_field(
                    "logit_bias",
                    format!("logit_bias key {key:?} is not a token id below {vocab}"),
                ));
            };
            let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b));
            let Some(bias) = bias else {
                return Err(ApiError::invalid_field(
                    "logit_bias",
                    format!(
                        "logit_bias[{key:?}] must be a number between -100 and 100, got {value}"
                    ),
                ));
            };
            out.push((token, bias as f32));
        }
        Ok(out)
    }

    /// The number of alternatives to report with each token's log-probability, or `None` for
    /// no log-probabilities. Completions spell it `logprobs: N`; chat `logprobs: true` with
    /// `top_logprobs: N`.
    pub fn logprobs(&self, chat: bool) -> Result<Option<usize>, ApiError> {
        use serde_json::Value;
        let count = |param: &str, n: Option<i64>| match n {
            Some(n) if (0..=MAX_LOGPROBS as i64).contains(&n) => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid_field(
                param,
                format!("{param} must be between 0 and {MAX_LOGPROBS}, got {n}"),
            )),
            None => Ok(None),
        };
        match (chat, &self.logprobs) {
            (false, None | Some(Value::Null)) => Ok(None),
            (false, Some(Value::Number(n))) => match n.as_i64() {
                Some(i) => count("logprobs", Some(i)),
                None => Err(ApiError::invalid_field(
                    "logprobs",
                    format!("logprobs must be an integer between 0 and {MAX_LOGPROBS}, got {n}"),
                )),
            },
            (false, Some(_)) => Err(ApiError::invalid_field(
                "logprobs",
                "logprobs must be an integer (the number of alternatives per token)",
            )),
            (true, Some(Value::Bool(true))) => {
                Ok(count("top_logprobs", self.top_logprobs)?.or(Some(0)))
            }
            (true, None | Some(Value::Null) | Some(Value::Bool(false))) => {
                if self.top_logprobs.is_some_and(|n| n > 0) {
                    Err(ApiError::invalid_field(
                        "top_logprobs",
                        "top_logprobs needs logprobs: true",
                    ))
                } else {
                    Ok(None)
                }
            }
            (true, Some(_)) => Err(ApiError::invalid_field(
                "logprobs",
                "logprobs must be a boolean",
            )),
        }
    }

    /// The stop strings.
    pub fn stop_strings(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
    }

    /// Whether a streamed response ends with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

impl Message {
    /// The role as the chat template knows it: `system`, `user`, `assistant` or `tool`
    /// (OpenAI's `developer` is its newer name for `system`).
    pub fn template_role(&self, index: usize) -> Result<&'static str, ApiError> {
        match self.role.as_str() {
            "system" | "developer" => Ok("system"),
            "user" => Ok("user"),
            "assistant" => Ok("assistant"),
            "tool" => Ok("tool"),
            other => Err(ApiError::invalid_field(
                &format!("messages[{index}].role"),
                format!(
                    "unsupported role `{other}`: use `system`, `developer`, `user`, \
                     `assistant` or `tool`"
                ),
            )),
        }
    }

    /// An assistant message's tool calls as the chat template expects them: each with a
    /// `function.name` and its `function.arguments` as a JSON string (an object, which some
    /// clients send, is written out as one). `None` for a message without calls.
    pub fn template_tool_calls(
        &self,
        index: usize,
    ) -> Result<Option<Vec<serde_json::Value>>, ApiError> {
        use serde_json::Value;
        let Some(calls) = self.tool_calls.as_ref().filter(|c| !c.is_empty()) else {
            return Ok(None);
        };
        if self.role != "assistant" {
            return Err(ApiError::invalid_field(
                &format!("messages[{index}].tool_calls"),
                "only assistant messages carry tool_calls",
            ));
        }
        let mut out = Vec::with_capacity(calls.len());
        for (j, call) in calls.iter().enumerate() {
            let path = format!("messages[{index}].tool_calls[{j}]");
            let function = call.get("function").and_then(Value::as_object);
            let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
            let (Some(function), Some(name)) = (function, name) else {
                return Err(ApiError::invalid_field(
                    &format!("{path}.function.name"),
                    format!("{path} needs a function with a name"),
                ));
            };
            let arguments = match function.get("arguments") {
                None | Some(Value::Null) => "{}".to_owned(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            let mut call = call.clone();
            call["type"] = Value::from("function");
            call["function"] = serde_json::json!({"name": name, "arguments": arguments});
            out.push(call);
        }
        Ok(Some(out))
    }

    /// The message's text: the content, or its text parts joined by `separator`.
    pub fn text(&self, index: usize, separator: &str) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for (j, p) in parts.iter().enumerate() {
                    if j > 0 {
                        out.push_str(separator);
                    }
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid_field(
                                &format!("messages[{index}].content"),
                                format!(
                                    "content parts of type `{kind}` are not supported (text only)"
                                ),
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}
