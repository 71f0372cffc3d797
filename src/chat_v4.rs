//! DeepSeek-V4's chat encoding: how a conversation becomes V4's prompt, and how V4 writes
//! tool calls (DSML), without a Jinja template.
//!
//! DeepSeek publishes V4 with no `chat_template`: its prompt format is code
//! (`encoding/encoding_dsv4.py` in the checkpoint, and DeepSeek's `deepseek-recipe` package,
//! which SGLang serves V4 through). This module writes the prompts `deepseek-recipe` 0.2.0
//! writes, checked against it by `tests/server/test_v4_chat.py`; in non-thinking ("chat")
//! mode:
//!
//! ```text
//! <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>
//! <｜User｜><tool_result>{result}</tool_result><｜Assistant｜></think>
//! ```
//!
//! - Every system message, wherever it stands, goes first, joined by blank lines; the
//!   request's tools ([`tools_block`]) and a `json_schema` response format follow them.
//! - V4 has no tool role: consecutive user and tool messages become one user turn, their
//!   texts joined by blank lines, each tool result as `<tool_result>...</tool_result>` in the
//!   order the assistant made the calls.
//! - An assistant turn is its content, then its calls as a DSML block ([`calls_block`]),
//!   then the end-of-sentence token. The prompt ends with the assistant's header; when the
//!   reply must be calls (`tool_choice` `required` or a function), with the opening of the
//!   calls block too ([`CALLS_OPENING`]), as DeepSeek's encoder prefills it.
//!
//! A call is written in DSML:
//!
//! ```text
//! <｜DSML｜tool_calls>
//! <｜DSML｜invoke name="get_weather">
//! <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
//! <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜tool_calls>
//! ```
//!
//! A string argument is written as is (`string="true"`), any other as JSON.
//!
//! In thinking mode ([`Effort`]) the reply opens with `<think>`: the model reasons, closes with
//! `</think>`, then answers. The prompt starts with the effort's instruction (none for `low`);
//! earlier assistant turns keep their reasoning (`<think>{reasoning}</think>{content}`) when the
//! request offers tools, and drop it (`</think>{content}`) otherwise, as `deepseek-recipe` does.
//! (The checkpoint's `encoding_dsv4.py` differs on efforts: it writes the instruction `high`
//! gets here only for `max`. The recipe is followed because it is what V4 is served with.)

use serde_json::Value;

use crate::error::{Error, Result};
use crate::tokenizer::ChatMessage;

/// Opens the prompt.
pub const BOS: &str = "<｜begin▁of▁sentence｜>";
/// Ends an assistant turn (and the reply).
pub const EOS: &str = "<｜end▁of▁sentence｜>";
/// Opens a user turn.
pub const USER: &str = "<｜User｜>";
/// Opens an assistant turn; non-thinking mode follows it with [`THINK_END`].
pub const ASSISTANT: &str = "<｜Assistant｜>";
/// Opens the reasoning of a thinking-mode reply.
pub const THINK_BEGIN: &str = "<think>";
/// Ends the reasoning (empty in non-thinking mode, which it marks).
pub const THINK_END: &str = "</think>";
/// The marker DSML's tags are spelled with.
pub const DSML: &str = "｜DSML｜";
/// Opens the block of calls.
pub const CALLS_BEGIN: &str = "<｜DSML｜tool_calls>";
/// Closes the block of calls.
pub const CALLS_END: &str = "</｜DSML｜tool_calls>";
/// Opens one call, up to its function name.
pub const INVOKE_BEGIN: &str = "<｜DSML｜invoke name=\"";
/// Closes one call.
pub const INVOKE_END: &str = "</｜DSML｜invoke>";
/// Opens one argument, up to its name.
pub const PARAMETER_BEGIN: &str = "<｜DSML｜parameter name=\"";
/// Closes one argument.
pub const PARAMETER_END: &str = "</｜DSML｜parameter>";
/// What an assistant's content is separated from its calls by, and the prefill of a reply
/// that must be calls: the first call follows it.
pub const CALLS_OPENING: &str = "\n\n<｜DSML｜tool_calls>\n";

/// The instructions on tools V4 was trained with; `{schemas}` is each tool, one JSON line.
const TOOLS_TEMPLATE: &str = "## Tools\n\nYou have access to a set of tools to help answer \
the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the \
following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter \
name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n\
</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set `string=\"true\"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and \
set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output \
your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after </think> with tool calls or final response.\n\n### Available \
Tool Schemas\n\n{schemas}\n\nYou MUST strictly follow the above defined tool name and parameter \
schemas to invoke tool calls.\n";

/// How hard a thinking-mode reply reasons: OpenAI's `reasoning_effort`, as `deepseek-recipe`
/// reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effort {
    /// `minimal`, `low`: no instruction.
    Low,
    /// `none`, `medium`, `high`, `xhigh`, or not given.
    High,
    /// `max`, `ultra`.
    Max,
}

impl Effort {
    /// `reasoning_effort`'s value (`None`: not given), or `None` for a value DeepSeek's
    /// encoder does not know.
    pub fn parse(value: Option<&str>) -> Option<Effort> {
        Some(match value {
            None | Some("none" | "medium" | "high" | "xhigh") => Effort::High,
            Some("minimal" | "low") => Effort::Low,
            Some("max" | "ultra") => Effort::Max,
            Some(_) => return None,
        })
    }

    /// The instruction the prompt starts with.
    fn instruction(self) -> &'static str {
        match self {
            Effort::Low => "",
            Effort::High => EFFORT_HIGH,
            Effort::Max => EFFORT_MAX,
        }
    }
}

/// The instruction of [`Effort::High`].
const EFFORT_HIGH: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve \
the root cause, rigorously stress-testing your logic against all potential paths, edge cases, \
and adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting \
every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely \
no assumption is left unchecked.\n\n";

/// The instruction of [`Effort::Max`].
const EFFORT_MAX: &str = "Reasoning Effort: Beyond maximum \u{2014} exhaustive, relentless, \
and uncompromising.\nYou MUST reason with the utmost depth and rigor, leaving absolutely nothing \
to chance: exhaustively decompose the problem into its most fundamental components, trace every \
causal chain to its root, and resolve the underlying cause rather than any surface symptom.\nDo \
not stop reasoning until you have independently verified the solution from multiple angles and \
are certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

/// Introduces a `json_schema` response format in the system text.
const RESPONSE_FORMAT: &str =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

/// A conversation to encode, with what the request adds around it.
#[derive(Debug, Clone, Copy)]
pub struct V4Chat<'a> {
    /// The messages, as the server reads them (tool calls in OpenAI's shape, `arguments` a
    /// JSON string).
    pub messages: &'a [ChatMessage],
    /// The request's `tools` (`{"type": "function", "function": {...}}`), if any.
    pub tools: Option<&'a [Value]>,
    /// A `json_schema` response format's schema, which V4's encoder states in the system text.
    pub response_schema: Option<&'a Value>,
    /// The reply must be calls: the prompt ends inside the opened calls block.
    pub calls_forced: bool,
    /// Thinking mode, at this effort (`None`: non-thinking).
    pub thinking: Option<Effort>,
}

/// One turn after system messages are lifted and user and tool messages merged.
enum Turn<'a> {
    User(Vec<Block<'a>>),
    Assistant {
        content: &'a str,
        reasoning: &'a str,
        calls: Vec<(&'a str, &'a str)>,
    },
}

/// A piece of a user turn.
enum Block<'a> {
    Text(&'a str),
    /// A tool's result, and the position of the call it answers.
    ToolResult(&'a str, usize),
}

/// Encodes `chat` as V4's prompt (see the module docs). A tool message that answers no call of
/// the assistant turn before it, a call left unanswered, an assistant turn with neither
/// content nor calls, or an unknown role is an error naming the message.
pub fn render(chat: &V4Chat) -> Result<String> {
    let bad = |i: usize, why: String| Error::Tokenizer(format!("messages[{i}]: {why}"));
    // A call of message `caller` that no tool message answered before the next turn.
    let unanswered = |calls: &[String], answered: &[bool], caller: usize| {
        let j = answered.iter().position(|a| !a)?;
        Some(bad(
            caller,
            format!("tool call {:?} has no tool message answering it", calls[j]),
        ))
    };
    let mut system: Vec<&str> = Vec::new();
    let mut turns: Vec<Turn> = Vec::new();
    // The last calls made, and which of them are answered.
    let mut open_calls: Vec<String> = Vec::new();
    let mut answered: Vec<bool> = Vec::new();
    let mut caller = 0;
    for (i, m) in chat.messages.iter().enumerate() {
        let content = m.content.as_deref().unwrap_or("");
        if m.role != "tool" {
            if let Some(e) = unanswered(&open_calls, &answered, caller) {
                return Err(e);
            }
        }
        match m.role.as_str() {
            "system" | "developer" => system.push(content),
            "user" => match turns.last_mut() {
                Some(Turn::User(blocks)) => blocks.push(Block::Text(content)),
                _ => turns.push(Turn::User(vec![Block::Text(content)])),
            },
            "tool" => {
                if open_calls.is_empty() {
                    return Err(bad(
                        i,
                        "a tool message must follow an assistant message with tool_calls".into(),
                    ));
                }
                let id = m.tool_call_id.as_deref().unwrap_or("");
                let Some(order) = open_calls.iter().position(|c| c == id) else {
                    return Err(bad(
                        i,
                        format!(
                            "tool_call_id {id:?} answers none of messages[{caller}]'s tool \
                             calls ({})",
                            open_calls.join(", ")
                        ),
                    ));
                };
                answered[order] = true;
                let block = Block::ToolResult(content, order);
                match turns.last_mut() {
                    Some(Turn::User(blocks)) => blocks.push(block),
                    _ => turns.push(Turn::User(vec![block])),
                }
            }
            "assistant" => {
                let calls = assistant_calls(m).map_err(|why| bad(i, why))?;
                if m.content.is_none() && calls.is_empty() {
                    return Err(bad(
                        i,
                        "an assistant message needs content or tool_calls".into(),
                    ));
                }
                if !calls.is_empty() {
                    open_calls = m
                        .tool_calls
                        .iter()
                        .flatten()
                        .map(|c| c.get("id").and_then(Value::as_str).unwrap_or("").to_owned())
                        .collect();
                    answered = vec![false; open_calls.len()];
                    caller = i;
                }
                let reasoning = m.reasoning_content.as_deref().unwrap_or("");
                turns.push(Turn::Assistant {
                    content,
                    reasoning,
                    calls,
                });
            }
            other => return Err(bad(i, format!("V4 has no role `{other}`"))),
        }
    }
    if let Some(e) = unanswered(&open_calls, &answered, caller) {
        return Err(e);
    }

    let mut out = String::from(BOS);
    if let Some(effort) = chat.thinking {
        out.push_str(effort.instruction());
    }
    out.push_str(&system.join("\n\n"));
    let tools = chat.tools.filter(|t| !t.is_empty());
    // Earlier reasoning stays in the prompt only beside tools (a reasoning model's calls and
    // their results are one line of thought).
    let keep_reasoning = tools.is_some();
    if let Some(tools) = tools {
        out.push_str("\n\n");
        out.push_str(&tools_block(tools));
    }
    if let Some(schema) = chat.response_schema {
        out.push_str("\n\n");
        out.push_str(RESPONSE_FORMAT);
        out.push_str(&python_json(schema));
    }
    for turn in &mut turns {
        match turn {
            Turn::User(blocks) => {
                sort_results(blocks);
                out.push_str(USER);
                let texts: Vec<String> = blocks
                    .iter()
                    .map(|b| match b {
                        Block::Text(t) => (*t).to_owned(),
                        Block::ToolResult(t, _) => format!("<tool_result>{t}</tool_result>"),
                    })
                    .collect();
                out.push_str(&texts.join("\n\n"));
            }
            Turn::Assistant {
                content,
                reasoning,
                calls,
            } => {
                out.push_str(ASSISTANT);
                if chat.thinking.is_some() && keep_reasoning {
                    out.push_str(THINK_BEGIN);
                    out.push_str(reasoning);
                }
                out.push_str(THINK_END);
                out.push_str(content);
                if !calls.is_empty() {
                    out.push_str("\n\n");
                    out.push_str(&calls_block(calls));
                }
                out.push_str(EOS);
            }
        }
    }
    out.push_str(ASSISTANT);
    out.push_str(if chat.thinking.is_some() {
        THINK_BEGIN
    } else {
        THINK_END
    });
    if chat.calls_forced {
        out.push_str(CALLS_OPENING);
    }
    Ok(out)
}

/// An assistant message's calls as (name, arguments JSON text).
fn assistant_calls(m: &ChatMessage) -> std::result::Result<Vec<(&str, &str)>, String> {
    let mut calls = Vec::new();
    for (j, call) in m.tool_calls.iter().flatten().enumerate() {
        let function = call.get("function");
        let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
        let arguments = function
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
            .unwrap_or("{}");
        let Some(name) = name else {
            return Err(format!("tool_calls[{j}] has no function name"));
        };
        calls.push((name, arguments));
    }
    Ok(calls)
}

/// Puts a user turn's tool results in the order of the calls they answer, leaving its texts
/// where they are (DeepSeek's encoder does the same).
fn sort_results(blocks: &mut [Block]) {
    let mut results: Vec<(usize, &str)> = blocks
        .iter()
        .filter_map(|b| match b {
            Block::ToolResult(t, order) => Some((*order, *t)),
            Block::Text(_) => None,
        })
        .collect();
    results.sort_by_key(|(order, _)| *order);
    let mut sorted = results.into_iter();
    for b in blocks.iter_mut() {
        if let Block::ToolResult(..) = b {
            if let Some((order, t)) = sorted.next() {
                *b = Block::ToolResult(t, order);
            }
        }
    }
}

/// The system text's tools section: each tool as `{"name", "description", "parameters"}` on
/// one line (an absent description is `""`, absent parameters `{}`).
pub fn tools_block(tools: &[Value]) -> String {
    let schemas: Vec<String> = tools
        .iter()
        .map(|t| {
            let f = t.get("function").unwrap_or(t);
            let mut line = serde_json::Map::new();
            line.insert("name".into(), f.get("name").cloned().unwrap_or(Value::Null));
            line.insert(
                "description".into(),
                match f.get("description") {
                    Some(d @ Value::String(_)) => d.clone(),
                    _ => Value::String(String::new()),
                },
            );
            line.insert(
                "parameters".into(),
                match f.get("parameters") {
                    None | Some(Value::Null) => Value::Object(Default::default()),
                    Some(p) => p.clone(),
                },
            );
            python_json(&Value::Object(line))
        })
        .collect();
    TOOLS_TEMPLATE.replace("{schemas}", &schemas.join("\n"))
}

/// Calls as a DSML block, from `<｜DSML｜tool_calls>` to `</｜DSML｜tool_calls>`.
pub fn calls_block(calls: &[(&str, &str)]) -> String {
    let invokes: Vec<String> = calls
        .iter()
        .map(|(name, arguments)| invoke(name, arguments))
        .collect();
    format!("{CALLS_BEGIN}\n{}\n{CALLS_END}", invokes.join("\n"))
}

/// One call: its arguments object's members as parameters, in order. Arguments that are not
/// a JSON object are one string parameter named `arguments`, as DeepSeek's encoder writes them.
fn invoke(name: &str, arguments: &str) -> String {
    let parameters: Vec<String> = match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(members)) => members
            .iter()
            .map(|(key, value)| match value {
                Value::String(s) => parameter(key, true, s),
                other => parameter(key, false, &python_json(other)),
            })
            .collect(),
        _ => vec![parameter("arguments", true, arguments)],
    };
    let mut out = format!("{INVOKE_BEGIN}{name}\">\n");
    for p in parameters {
        out.push_str(&p);
        out.push('\n');
    }
    out.push_str(INVOKE_END);
    out
}

/// One argument.
fn parameter(key: &str, string: bool, value: &str) -> String {
    format!("{PARAMETER_BEGIN}{key}\" string=\"{string}\">{value}{PARAMETER_END}")
}

/// JSON as DeepSeek's encoder writes it (Python's `json.dumps` layout): `", "` and `": "`
/// between items, non-ASCII text as is; numbers as serde_json writes them (`2.5`, `1e+16`,
/// `1e-7`), which is how `deepseek-recipe` writes them too.
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python_json(value, &mut out);
    out
}

fn write_python_json(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            out.push('{');
            for (i, (key, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, out);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::text(role, content)
    }

    fn assistant_calling(calls: &[(&str, &str, &str)]) -> ChatMessage {
        ChatMessage {
            role: "assistant".into(),
            content: None,
            tool_calls: Some(
                calls
                    .iter()
                    .map(|(id, name, args)| {
                        json!({"id": id, "type": "function",
                            "function": {"name": name, "arguments": args}})
                    })
                    .collect(),
            ),
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    fn tool(id: &str, content: &str) -> ChatMessage {
        ChatMessage {
            tool_call_id: Some(id.into()),
            ..msg("tool", content)
        }
    }

    fn chat(messages: &[ChatMessage]) -> Result<String> {
        render(&V4Chat {
            messages,
            tools: None,
            response_schema: None,
            calls_forced: false,
            thinking: None,
        })
    }

    #[test]
    fn merges_turns_and_orders_results_by_call() {
        let messages = [
            msg("user", "Hi"),
            msg("system", "S"),
            assistant_calling(&[("a", "f", r#"{"x": "é", "n": 1e16}"#), ("b", "g", "[1]")]),
            tool("b", "rb"),
            tool("a", "ra"),
            msg("user", "U"),
        ];
        assert_eq!(
            chat(&messages).unwrap(),
            "<｜begin▁of▁sentence｜>S<｜User｜>Hi<｜Assistant｜></think>\n\n\
             <｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\
             <｜DSML｜parameter name=\"x\" string=\"true\">é</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"n\" string=\"false\">1e+16</｜DSML｜parameter>\n\
             </｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\n\
             <｜DSML｜parameter name=\"arguments\" string=\"true\">[1]</｜DSML｜parameter>\n\
             </｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜>\
             <tool_result>ra</tool_result>\n\n<tool_result>rb</tool_result>\n\nU\
             <｜Assistant｜></think>"
        );
    }

    #[test]
    fn refuses_unanswered_and_stray_tool_messages() {
        let call = assistant_calling(&[("a", "f", "{}")]);
        let e = chat(&[msg("user", "x"), tool("a", "r")]).unwrap_err();
        assert!(e.to_string().contains("messages[1]"), "{e}");
        let e = chat(&[msg("user", "x"), call.clone(), tool("zz", "r")]).unwrap_err();
        assert!(e.to_string().contains("\"zz\""), "{e}");
        let e = chat(&[msg("user", "x"), call, msg("user", "y")]).unwrap_err();
        assert!(e.to_string().contains("messages[1]"), "{e}");
    }

    #[test]
    fn python_layout_of_json() {
        let v = json!({"a": [1, 2.5, "x\n"], "b": {"c": null}, "d": 1e-7, "e": 1e300});
        assert_eq!(
            python_json(&v),
            r#"{"a": [1, 2.5, "x\n"], "b": {"c": null}, "d": 1e-7, "e": 1e+300}"#
        );
    }
}
