//! Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` read and checked,
//! the tool-call [`format`](mod@format) a model's chat template writes, and the [`parser`] that turns the
//! model's text into `tool_calls`.
//!
//! The tools reach the model through its chat template (as transformers passes them, the
//! template sees `tools`). `auto` lets the model choose; `required` and a named function
//! constrain the reply with a grammar (`engine::grammar`) that admits only calls in the
//! template's format, with arguments valid for each function's `parameters` schema; `none`
//! leaves the text alone. A model's reply is parsed for calls whatever the choice but `none`.
//!
//! A model without a known call format (no `--tool-call-parser`, a template that writes no
//! calls) is still served `required` and a named function, as vLLM serves them: the reply is
//! constrained to JSON, the named function's arguments object or an array of
//! `{"name", "parameters"}` calls ([`ToolRequest::json_schema`]), and read back as calls
//! ([`reply`]). Only `auto`, where the model must be able to write prose or calls, needs the
//! format.

pub mod dsml;
pub mod format;
pub mod parser;
pub mod reply;

use serde_json::{json, Map, Value};

use crate::engine::grammar::JsonOptions;

use super::error::ApiError;
use format::CallFormat;

/// One function a request offers the model.
#[derive(Debug, Clone)]
pub struct FunctionTool {
    /// `function.name`.
    pub name: String,
    /// `function.parameters` (a JSON schema of the arguments object). When absent, a
    /// function of no arguments, as OpenAI reads it ("omitting parameters defines a function
    /// with an empty parameter list"): `{"type": "object", "properties": {}}`, which admits
    /// only `{}` unless the server allows additional properties.
    pub parameters: Value,
}

impl FunctionTool {
    /// The schema a constrained call's arguments follow: `parameters` under the server's JSON
    /// options (no properties beyond the listed ones, compact whitespace, by default: see
    /// [`JsonOptions`]). Arguments are read by programs, not people, and an untrained model
    /// left free keys or whitespace spends its tokens on them.
    pub fn arguments_schema(&self, options: &JsonOptions) -> Value {
        options.apply(self.parameters.clone())
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

    /// The definitions V4's prompt states, as DeepSeek's encoder states them: none for
    /// `none`, only the named function for a named choice, every one otherwise.
    pub fn stated_to_v4(&self) -> Vec<Value> {
        let names = self.tools.iter().map(|t| t.name.as_str());
        self.definitions
            .iter()
            .zip(names)
            .filter(|(_, name)| match &self.choice {
                ToolChoice::None => false,
                ToolChoice::Function(named) => named == name,
                ToolChoice::Auto | ToolChoice::Required => true,
            })
            .map(|(d, _)| d.clone())
            .collect()
    }

    /// Whether the reply must be tool calls (`required` or a named function), which a
    /// grammar enforces.
    pub fn constrained(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The Lark grammar a constrained reply follows in the model's call `format` (see
    /// [`ToolChoice`]), or `None` when the reply is free. `prefilled`: the prompt already
    /// opened DSML's calls block (V4's encoder does for a constrained reply).
    pub fn grammar(
        &self,
        format: CallFormat,
        prefilled: bool,
        options: &JsonOptions,
        token_id: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<String> {
        let schemas: Vec<Value> = self
            .tools
            .iter()
            .map(|t| t.arguments_schema(options))
            .collect();
        let functions: Vec<(&str, &Value)> = self
            .tools
            .iter()
            .zip(&schemas)
            .map(|(t, s)| (t.name.as_str(), s))
            .collect();
        let (functions, parallel) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => (functions, self.parallel),
            ToolChoice::Function(name) => {
                let one: Vec<_> = functions.into_iter().filter(|(n, _)| n == name).collect();
                (one, false)
            }
        };
        Some(match format {
            CallFormat::Markers(f) => f.lark_grammar(&functions, parallel, token_id),
            CallFormat::Dsml => dsml::lark_grammar(&functions, parallel, prefilled, token_id),
        })
    }

    /// For a model without a call format: the JSON schema a constrained reply follows (vLLM's
    /// forms), or `None` when the reply is free (`auto`, `none`).
    ///
    /// - A named function: its arguments schema ([`FunctionTool::arguments_schema`]); the
    ///   reply is the call's arguments.
    /// - `required`: an array of one or more calls (exactly one without
    ///   `parallel_tool_calls`), each `{"name": <an offered name>, "parameters": <its
    ///   arguments>}` in that order. Every function's `$defs` and `definitions` move to the
    ///   array's schema, where its `#/$defs/...` references then point; two functions
    ///   defining one name differently are a 400 naming the second.
    pub fn json_schema(&self, options: &JsonOptions) -> Result<Option<Value>, ApiError> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            ToolChoice::Function(name) => Ok(self
                .tools
                .iter()
                .find(|t| &t.name == name)
                .map(|t| t.arguments_schema(options))),
            ToolChoice::Required => {
                let mut lifted: Map<String, Value> = Map::new();
                let mut calls = Vec::with_capacity(self.tools.len());
                for (i, tool) in self.tools.iter().enumerate() {
                    let mut parameters = tool.parameters.clone();
                    if let Value::Object(object) = &mut parameters {
                        // Read only at the top of a schema: the array's are the server's.
                        object.remove("x-guidance");
                        for key in ["$defs", "definitions"] {
                            let Some(Value::Object(defs)) = object.remove(key) else {
                                continue;
                            };
                            let into = lifted
                                .entry(key)
                                .or_insert_with(|| Value::Object(Map::new()));
                            let Value::Object(into) = into else { continue };
                            for (name, def) in defs {
                                match into.get(&name) {
                                    Some(other) if *other != def => {
                                        return Err(ApiError::invalid_field(
                                            &format!("tools[{i}].function.parameters"),
                                            format!(
                                                "{key}/{name} differs from another tool's \
                                                 {key}/{name}; with tool_choice \"required\" \
                                                 the tools' definitions share one namespace"
                                            ),
                                        ))
                                    }
                                    _ => {
                                        into.insert(name, def);
                                    }
                                }
                            }
                        }
                    }
                    calls.push(json!({
                        "type": "object",
                        "properties": {"name": {"const": tool.name}, "parameters": parameters},
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    }));
                }
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if !self.parallel {
                    schema["maxItems"] = json!(1);
                }
                if let Value::Object(object) = &mut schema {
                    object.extend(lifted);
                }
                Ok(Some(options.apply(schema)))
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
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
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

    /// Without a call format, a constrained reply is JSON: a named function's arguments, or
    /// `required`'s array of calls (vLLM's forms), under the server's JSON options.
    #[test]
    fn json_schemas_of_constrained_choices() {
        let defs = json!({"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}}});
        let tools = json!([weather(), {"type": "function", "function": {"name": "get_time"}},
            {"type": "function", "function": {"name": "d", "parameters": defs}}]);
        let options = JsonOptions::default();
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let r = ToolRequest::from_request(Some(&tools), Some(&named), None)
            .unwrap()
            .unwrap();
        let schema = r.json_schema(&options).unwrap().unwrap();
        assert_eq!(schema["properties"], json!({"city": {"type": "string"}}));
        assert_eq!(schema["additionalProperties"], json!(false));
        assert_eq!(schema["x-guidance"], json!({"whitespace_flexible": false}));

        let r = ToolRequest::from_request(Some(&tools), Some(&json!("required")), Some(false))
            .unwrap()
            .unwrap();
        let schema = r.json_schema(&options).unwrap().unwrap();
        assert_eq!(schema["type"], "array");
        assert_eq!(
            (schema["minItems"].clone(), schema["maxItems"].clone()),
            (json!(1), json!(1))
        );
        let calls = schema["items"]["anyOf"].as_array().unwrap();
        assert_eq!(calls.len(), 3);
        assert_eq!(
            calls[0]["properties"]["name"],
            json!({"const": "get_weather"})
        );
        assert_eq!(calls[0]["required"], json!(["name", "parameters"]));
        // Omitted parameters: no arguments, `{}` only.
        assert_eq!(
            calls[1]["properties"]["parameters"],
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        );
        // Definitions move to the array's schema, where `#/$defs/P` points; closed there.
        assert!(calls[2]["properties"]["parameters"].get("$defs").is_none());
        assert_eq!(schema["$defs"]["P"]["additionalProperties"], json!(false));
        assert!(ToolRequest::from_request(Some(&tools), None, None)
            .unwrap()
            .unwrap()
            .json_schema(&options)
            .unwrap()
            .is_none());
    }

    #[test]
    fn required_refuses_two_tools_defining_one_name_differently() {
        let with = |x: &str| {
            json!({"type": "function", "function": {"name": x, "parameters": {
                "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                "$defs": {"P": {"const": x}}}}})
        };
        let tools = json!([with("a"), with("b")]);
        let r = ToolRequest::from_request(Some(&tools), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        let e = r.json_schema(&JsonOptions::default()).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "tools[1].function.parameters");
    }
}
