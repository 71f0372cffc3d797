//! A chat request's prompt: its messages, tools, response format and thinking mode rendered
//! by the model's chat template, or by V4's encoder ([`crate::chat_v4`]) for a `deepseek_v4`
//! model, and tokenized. `/v1/chat/completions` and `/tokenize` read a chat the same way.

use serde_json::Value;

use crate::chat_v4::Effort;
use crate::tokenizer::{ChatEncoding, ChatMessage};

use super::error::ApiError;
use super::protocol::{Message, PromptFields};
use super::request::encode;
use super::state::AppState;
use super::tools::format::CallFormat;
use super::tools::{ToolChoice, ToolRequest};

/// A chat's prompt, and what of the request the reply is read with.
#[derive(Debug)]
pub(super) struct ChatPrompt {
    /// The prompt's tokens.
    pub tokens: Vec<u32>,
    /// The request's tools, if it offers any.
    pub tools: Option<ToolRequest>,
    /// Thinking mode, at its effort (`None`: non-thinking).
    pub thinking: Option<Effort>,
}

/// Reads `fields` (tools, thinking mode, response format), checks that they go together, and
/// renders and tokenizes `messages` with them. Every error is a 400 naming the field.
pub(super) fn chat_prompt(
    state: &AppState,
    messages: &[Message],
    fields: &PromptFields,
) -> Result<ChatPrompt, ApiError> {
    let tools = ToolRequest::from_request(
        fields.tools.as_ref(),
        fields.tool_choice.as_ref(),
        fields.parallel_tool_calls,
    )?;
    let thinking = thinking_mode(state, fields)?;
    let constrained = tools
        .as_ref()
        .is_some_and(|t| t.choice != ToolChoice::None && t.constrained());
    let response_format = fields.response_format.as_ref().filter(|f| !f.is_null());
    if thinking.is_some() {
        if constrained {
            return Err(ApiError::invalid_field(
                "tool_choice",
                "thinking mode cannot force tool calls (the reply reasons first; DeepSeek's \
                 encoder refuses it too): use tool_choice \"auto\", or turn thinking off",
            ));
        }
        if response_format.is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text")) {
            return Err(ApiError::invalid_field(
                "response_format",
                "thinking mode cannot constrain the reply (the reply reasons first): turn \
                 thinking off for structured outputs",
            ));
        }
    }
    let response_schema = response_format
        .filter(|f| f.get("type").and_then(Value::as_str) == Some("json_schema"))
        .and_then(|f| f.get("json_schema"))
        .and_then(|s| s.get("schema"));
    let stated = match &tools {
        Some(t) if state.v4_encoding() => Some(t.stated_to_v4()),
        Some(t) => Some(t.definitions.clone()),
        None => None,
    };
    let extras = ChatExtras {
        tools: stated.as_deref(),
        response_schema,
        calls_forced: constrained && prefills_calls(state),
        thinking,
    };
    let tokens = render_messages(state, messages, extras)?;
    Ok(ChatPrompt {
        tokens,
        tools,
        thinking,
    })
}

/// Whether the prompt of a reply that must be calls already opens the calls block: V4's
/// encoder writes DSML's opening into the prompt, as DeepSeek's does.
pub(super) fn prefills_calls(state: &AppState) -> bool {
    state.v4_encoding() && state.tool_format() == Some(CallFormat::Dsml)
}

/// A chat request's thinking mode, at its effort (`None`: non-thinking, the default, as vLLM
/// serves DeepSeek's hybrid models): DeepSeek's `thinking: {"type": "enabled"}` or vLLM's
/// `chat_template_kwargs: {"thinking": true}`, with `reasoning_effort`. Only V4's encoder
/// writes thinking prompts; another model asking for it is a 400.
fn thinking_mode(state: &AppState, req: &PromptFields) -> Result<Option<Effort>, ApiError> {
    let switch = match &req.thinking {
        None | Some(Value::Null) => None,
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") => Some(true),
            Some("disabled") => Some(false),
            _ => {
                return Err(ApiError::invalid_field(
                    "thinking",
                    format!("thinking must be {{\"type\": \"enabled\" | \"disabled\"}}, got {t}"),
                ))
            }
        },
    };
    let kwarg = match req
        .chat_template_kwargs
        .as_ref()
        .and_then(|k| k.get("thinking"))
    {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(other) => {
            return Err(ApiError::invalid_field(
                "chat_template_kwargs.thinking",
                format!("chat_template_kwargs.thinking must be a boolean, got {other}"),
            ))
        }
    };
    if !switch.or(kwarg).unwrap_or(false) {
        return Ok(None);
    }
    if !state.v4_encoding() {
        return Err(ApiError::invalid_field(
            "thinking",
            "thinking mode is served for DeepSeek-V4 models (whose prompts deepinfer writes \
             itself); this model's chat template decides its own prompt",
        ));
    }
    Effort::parse(req.reasoning_effort.as_deref())
        .map(Some)
        .ok_or_else(|| {
            ApiError::invalid_field(
                "reasoning_effort",
                format!(
                    "unknown reasoning_effort {:?}: use none, minimal, low, medium, high, \
                     xhigh, ultra or max",
                    req.reasoning_effort.as_deref().unwrap_or("")
                ),
            )
        })
}

/// What a chat prompt is rendered from besides its messages.
#[derive(Debug, Default, Clone, Copy)]
struct ChatExtras<'a> {
    /// The request's `tools` entries, which the template (or V4's encoder) sees.
    tools: Option<&'a [Value]>,
    /// A `json_schema` response format's schema (stated in V4's system text).
    response_schema: Option<&'a Value>,
    /// The reply must be tool calls (V4's encoder opens the calls block).
    calls_forced: bool,
    /// V4's thinking mode, at this effort (`None`: non-thinking).
    thinking: Option<Effort>,
}

/// The tokens of `messages` rendered with the model's chat template, or V4's encoder for a
/// `deepseek_v4` model, ending with the prompt for the assistant's reply.
fn render_messages(
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
                reasoning_content: m.reasoning_content.clone(),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = if v4 {
        crate::chat_v4::render(&crate::chat_v4::V4Chat {
            messages: &messages,
            tools: extras.tools,
            response_schema: extras.response_schema,
            calls_forced: extras.calls_forced,
            thinking: extras.thinking,
        })
    } else {
        tokenizer.apply_chat_template_with_tools(&messages, extras.tools, true)
    }
    .map_err(|e| ApiError::invalid_field("messages", e.to_string()))?;
    // The template writes the bos token itself.
    encode(state, &text, false)
}
