//! Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` read and checked,
//! the tool-call [`format`] a model's chat template writes, and the [`parser`] that turns the
//! model's text into `tool_calls`.
//!
//! The tools reach the model through its chat template (as transformers passes them, the
//! template sees `tools`). `auto` lets the model choose; `required` and a named function
//! constrain the reply with a grammar (`engine::grammar`) that admits only calls in the
//! template's format, with arguments valid for each function's `parameters` schema; `none`
//! leaves the text alone. A model's reply is parsed for calls whatever the choice but `none`.

pub mod format;
pub mod parser;

use serde_json::{json, Value};

use super::error::ApiError;
use format::ToolCallFormat;

/// One function a request offers the model.
#[derive(Debug, Clone)]
pub struct FunctionTool {
    /// `function.name`.
    pub name: String,
    /// `function.parameters` (a JSON schema of the arguments object; `{"type": "object"}`
    /// when absent, as OpenAI reads it).
    pub parameters: Value,
}

impl FunctionTool {
    /// The schema a constrained call's arguments follow: `parameters`, written as Python's
    /// `json.dumps` writes JSON (`{"a": 1, "b": 2}`, no other whitespace) unless the schema
    /// sets llguidance's options itself. Arguments are read by programs, not people, and an
    /// untrained model left free whitespace spends its tokens on it.
    pub fn arguments_schema(&self) -> Value {
        let mut schema = self.parameters.clone();
        if let Value::Object(object) = &mut schema {
            object.entry("x-guidance").or_insert_with(|| {
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
            });
        }
        schema
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call a tool.
    None,
    /// The model decides.
    Auto,
    /// At least one call.
    Required,
    /// Exactly one call, of this function.
    Function(String),
}

/// A request's tools and how it wants them used.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    /// The functions, in the request's order.
    pub tools: Vec<FunctionTool>,
    /// The `tools` entries as sent, which the chat template sees.
    pub definitions: Vec<Value>,
    /// `tool_choice` (default: `auto` with tools).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call in a reply.
    pub parallel: bool,
}

/// OpenAI's rule for function names.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolRequest {
    /// Reads the request's `tools`, `tool_choice` and `parallel_tool_calls`; `None` when it
    /// offers no tools. Every error is a 400 naming the field at fault.
    pub fn from_request(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let definitions = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(other) => {
                return Err(ApiError::invalid_field(
                    "tools",
                    format!("tools must be a list of tools, got {other}"),
                ))
            }
        };
        let tools = definitions
            .iter()
            .enumerate()
            .map(|(i, t)| function_tool(i, t))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u| u.name == t.name) {
                return Err(ApiError::invalid_field(
                    &format!("tools[{i}].function.name"),
                    format!("two tools are named {:?}", t.name),
                ));
            }
        }
        let choice = parse_choice(choice, &tools)?;
        if tools.is_empty() {
            return Ok(None);
        }
        Ok(Some(ToolRequest {
            tools,
            definitions,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Whether the reply must be tool calls (`required` or a named function), which a
    /// grammar enforces.
    pub fn constrained(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The Lark grammar a constrained reply follows (see [`ToolChoice`]), or `None` when the
    /// reply is free.
    pub fn grammar(
        &self,
        format: &ToolCallFormat,
        token_id: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<String> {
        let schemas: Vec<Value> = self
            .tools
            .iter()
            .map(FunctionTool::arguments_schema)
            .collect();
        let functions: Vec<(&str, &Value)> = self
            .tools
            .iter()
            .zip(&schemas)
            .map(|(t, s)| (t.name.as_str(), s))
            .collect();
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => Some(format.lark_grammar(&functions, self.parallel, token_id)),
            ToolChoice::Function(name) => {
                let one: Vec<_> = functions.into_iter().filter(|(n, _)| n == name).collect();
                Some(format.lark_grammar(&one, false, token_id))
            }
        }
    }
}

/// One entry of `tools`: `{"type": "function", "function": {"name", "description"?,
/// "parameters"?, "strict"?}}`.
fn function_tool(i: usize, tool: &Value) -> Result<FunctionTool, ApiError> {
    let path = format!("tools[{i}]");
    let bad = |field: &str, message: String| {
        Err(ApiError::invalid_field(&format!("{path}{field}"), message))
    };
    let Some(object) = tool.as_object() else {
        return bad("", format!("{path} must be an object, got {tool}"));
    };
    match object.get("type") {
        Some(Value::String(t)) if t == "function" => {}
        Some(other) => {
            return bad(
                ".type",
                format!("{path}.type must be \"function\", got {other}"),
            )
        }
        None => return bad(".type", format!("{path}.type is required (\"function\")")),
    }
    let Some(function) = object.get("function").and_then(Value::as_object) else {
        return bad(".function", format!("{path}.function must be an object"));
    };
    let name = match function.get("name") {
        Some(Value::String(name)) if valid_name(name) => name.clone(),
        Some(Value::String(name)) => {
            return bad(
                ".function.name",
                format!(
                    "{path}.function.name {name:?} must be 1 to 64 letters, digits, `_` or `-`"
                ),
            )
        }
        Some(other) => {
            return bad(
                ".function.name",
                format!("{path}.function.name must be a string, got {other}"),
            )
        }
        None => {
            return bad(
                ".function.name",
                format!("{path}.function.name is required"),
            )
        }
    };
    if let Some(d) = function
        .get("description")
        .filter(|d| !d.is_string() && !d.is_null())
    {
        return bad(
            ".function.description",
            format!("{path}.function.description must be a string, got {d}"),
        );
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => {
            return bad(
                ".function.parameters",
                format!("{path}.function.parameters must be a JSON schema object, got {other}"),
            )
        }
    };
    Ok(FunctionTool { name, parameters })
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function":
/// {"name"}}` naming one of `tools`. Without tools only `none` (or nothing) is meaningful.
fn parse_choice(choice: Option<&Value>, tools: &[FunctionTool]) -> Result<ToolChoice, ApiError> {
    let bad = |message: String| Err(ApiError::invalid_field("tool_choice", message));
    let parsed = match choice {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return bad(format!(
                    "tool_choice {other:?} must be \"none\", \"auto\", \"required\" or a named function"
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Function(name.to_owned()),
                _ => {
                    return bad(
                        "a named tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}"
                            .into(),
                    )
                }
            }
        }
        Some(other) => return bad(format!("tool_choice must be a string or an object, got {other}")),
    };
    match &parsed {
        ToolChoice::Auto | ToolChoice::Required if tools.is_empty() => bad(format!(
            "tool_choice {:?} needs tools",
            if parsed == ToolChoice::Auto {
                "auto"
            } else {
                "required"
            }
        )),
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => bad(format!(
            "tool_choice names the function {name:?}, which is not in tools"
        )),
        _ => Ok(parsed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn refused(tools: Value, choice: Option<Value>) -> String {
        let e = ToolRequest::from_request(Some(&tools), choice.as_ref(), None).unwrap_err();
        e.body()["error"]["param"].as_str().unwrap_or("").to_owned()
    }

    #[test]
    fn reads_tools_and_choices() {
        let tools = json!([weather()]);
        let r = ToolRequest::from_request(Some(&tools), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(r.choice, ToolChoice::Auto);
        assert!(r.parallel && !r.constrained());
        assert_eq!(r.tools[0].name, "get_weather");
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let r = ToolRequest::from_request(Some(&tools), Some(&named), Some(false))
            .unwrap()
            .unwrap();
        assert_eq!(r.choice, ToolChoice::Function("get_weather".into()));
        assert!(r.constrained() && !r.parallel);
        assert!(ToolRequest::from_request(None, Some(&json!("none")), None)
            .unwrap()
            .is_none());
    }

    #[test]
    fn bad_tools_name_their_field() {
        let no_name = json!([{"type": "function", "function": {"parameters": {}}}]);
        assert_eq!(refused(no_name, None), "tools[0].function.name");
        let bad_name = json!([{"type": "function", "function": {"name": "a b"}}]);
        assert_eq!(refused(bad_name, None), "tools[0].function.name");
        assert_eq!(
            refused(json!([{"function": {"name": "f"}}]), None),
            "tools[0].type"
        );
        let params = json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]);
        assert_eq!(refused(params, None), "tools[0].function.parameters");
        assert_eq!(
            refused(json!([weather(), weather()]), None),
            "tools[1].function.name"
        );
        assert_eq!(refused(json!({}), None), "tools");
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(refused(json!([weather()]), Some(unknown)), "tool_choice");
        assert_eq!(
            refused(json!([weather()]), Some(json!("sometimes"))),
            "tool_choice"
        );
        assert_eq!(refused(json!([]), Some(json!("required"))), "tool_choice");
    }
}
