//! DeepSeek-V4's tool calls (DSML, see [`crate::chat_v4`]): read out of a reply as it streams,
//! and the grammar a reply that must be calls follows.
//!
//! DSML writes each argument as its own tag, so a call's arguments are rebuilt as the JSON
//! object OpenAI's clients expect, laid out as DeepSeek's parser lays it out (`{"city":
//! "Paris", "days": 2}`): a `string="true"` value becomes a JSON string, any other is passed
//! as the JSON text the model wrote. Arguments stream one parameter at a time.

use serde_json::{Map, Value};

use crate::chat_v4::{
    CALLS_BEGIN, CALLS_END, CALLS_OPENING, DSML, INVOKE_BEGIN, INVOKE_END, PARAMETER_BEGIN,
    PARAMETER_END,
};

use super::parser::{partial_marker_len, push_arguments, push_content, Parsed, MAX_NAME_BYTES};

/// Where the parser is in the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Content, before the calls block.
    Content,
    /// Inside the block, between calls: a call or the block's end comes next.
    BetweenCalls,
    /// Reading a call's function name.
    Name,
    /// Inside a call: a parameter or the call's end comes next.
    Parameters,
    /// After the block: the rest is not part of the reply.
    Done,
    /// The format broke: the rest is content.
    Broken,
}

/// An incremental parser of one V4 reply (see the module docs).
#[derive(Debug)]
pub struct DsmlParser {
    state: State,
    /// Text received but not yet passed on.
    held: String,
    /// Calls begun so far.
    calls: usize,
    /// Parameters of the current call passed on so far.
    parameters: usize,
    /// Every piece of text received.
    pushed: String,
    /// Where in `pushed` the calls began (`Some(0)` for a reply that starts inside the block).
    calls_start: Option<usize>,
}

impl DsmlParser {
    /// A parser of a reply that starts as content, or (`in_calls`) inside an opened calls
    /// block: the prompt ended with [`crate::chat_v4::CALLS_OPENING`].
    pub fn new(in_calls: bool) -> Self {
        DsmlParser {
            state: if in_calls {
                State::BetweenCalls
            } else {
                State::Content
            },
            held: String::new(),
            calls: 0,
            parameters: 0,
            pushed: String::new(),
            calls_start: in_calls.then_some(0),
        }
    }

    /// The number of calls begun so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Takes the next piece of text; returns what it (with text held back before) completes.
    pub fn push(&mut self, text: &str) -> Vec<Parsed> {
        self.held.push_str(text);
        self.pushed.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// Ends the reply: passes on what was held back. A reply cut inside a call keeps what
    /// the call holds (its name, and its arguments so far, unclosed); one cut in the block
    /// before any call gives its text from the block's beginning on as content.
    pub fn finish(&mut self) -> Vec<Parsed> {
        let mut out = Vec::new();
        while self.step(&mut out) {}
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Content | State::Broken => push_content(&mut out, held),
            State::Name => {
                let held = held.trim_end_matches('\u{FFFD}');
                let name = &held[..held.len() - partial_marker_len(held, "\">")];
                if !name.is_empty() {
                    out.push(Parsed::CallStart {
                        index: self.calls,
                        name: name.to_owned(),
                    });
                    self.calls += 1;
                }
            }
            State::Parameters => push_arguments(&mut out, self.calls - 1, held),
            State::BetweenCalls | State::Done => {}
        }
        if let (0, Some(start), State::BetweenCalls | State::Name | State::Done) =
            (self.calls, self.calls_start, self.state)
        {
            push_content(&mut out, self.pushed[start..].to_owned());
        }
        out
    }

    /// One move on the held text; false when it needs more text to move on.
    fn step(&mut self, out: &mut Vec<Parsed>) -> bool {
        match self.state {
            State::Content => {
                if let Some(at) = self.held.find(CALLS_BEGIN) {
                    let content = self.held[..at].trim_end_matches('\n').to_owned();
                    self.calls_start = Some(self.pushed.len() - self.held.len() + content.len());
                    push_content(out, content);
                    self.held.drain(..at + CALLS_BEGIN.len());
                    self.state = State::BetweenCalls;
                    return true;
                }
                // Hold back what may still open the block: the newlines before it, and its
                // beginning.
                let keep = partial_marker_len(&self.held, CALLS_BEGIN);
                let safe = self.held[..self.held.len() - keep]
                    .trim_end_matches('\n')
                    .len();
                let rest = self.held.split_off(safe);
                push_content(out, std::mem::replace(&mut self.held, rest));
                false
            }
            State::BetweenCalls => {
                self.expect(&[(INVOKE_BEGIN, State::Name), (CALLS_END, State::Done)])
            }
            State::Name => match self.held.find("\">") {
                Some(at) => {
                    let name = self.held[..at].to_owned();
                    self.held.drain(..at + 2);
                    out.push(Parsed::CallStart {
                        index: self.calls,
                        name,
                    });
                    self.calls += 1;
                    self.parameters = 0;
                    self.state = State::Parameters;
                    true
                }
                None if self.held.len() > MAX_NAME_BYTES => {
                    self.state = State::Broken;
                    true
                }
                None => false,
            },
            State::Parameters => {
                let start = self.held.len() - self.held.trim_start().len();
                let rest = &self.held[start..];
                if rest.starts_with(PARAMETER_BEGIN) {
                    let Some(end) = rest.find(PARAMETER_END) else {
                        return false;
                    };
                    let Some(member) = member(&rest[PARAMETER_BEGIN.len()..end]) else {
                        self.state = State::Broken;
                        return true;
                    };
                    let sep = if self.parameters == 0 { "{" } else { ", " };
                    push_arguments(out, self.calls - 1, format!("{sep}{member}"));
                    self.parameters += 1;
                    self.held.drain(..start + end + PARAMETER_END.len());
                    return true;
                }
                if rest.starts_with(INVOKE_END) {
                    let close = if self.parameters == 0 { "{}" } else { "}" };
                    push_arguments(out, self.calls - 1, close.to_owned());
                    self.held.drain(..start + INVOKE_END.len());
                    self.state = State::BetweenCalls;
                    return true;
                }
                let unfinished = rest.trim_end_matches('\u{FFFD}');
                if PARAMETER_BEGIN.starts_with(unfinished) || INVOKE_END.starts_with(unfinished) {
                    false
                } else {
                    self.state = State::Broken;
                    true
                }
            }
            State::Done => {
                self.held.clear();
                false
            }
            State::Broken => {
                push_content(out, std::mem::take(&mut self.held));
                false
            }
        }
    }

    /// After optional whitespace, one of `tags` moves to its state; the beginning of one
    /// waits; anything else breaks the format.
    fn expect(&mut self, tags: &[(&str, State)]) -> bool {
        let start = self.held.len() - self.held.trim_start().len();
        let rest = &self.held[start..];
        for (tag, next) in tags {
            if rest.starts_with(tag) {
                self.held.drain(..start + tag.len());
                self.state = *next;
                return true;
            }
        }
        let unfinished = rest.trim_end_matches('\u{FFFD}');
        if tags.iter().any(|(tag, _)| tag.starts_with(unfinished)) {
            return false;
        }
        self.state = State::Broken;
        true
    }
}

/// One parameter (`KEY" string="true|false">VALUE`) as a JSON object member, or `None` when
/// it is not in that form.
fn member(tag: &str) -> Option<String> {
    let (key, rest) = tag.split_once("\" string=\"")?;
    let (string, value) = rest.split_once("\">")?;
    let key = Value::String(key.to_owned()).to_string();
    match string {
        "true" => Some(format!("{key}: {}", Value::String(value.to_owned()))),
        "false" => Some(format!("{key}: {value}")),
        _ => None,
    }
}

/// The Lark grammar (llguidance's dialect) of a reply that is only calls: the calls block's
/// opening ([`crate::chat_v4::CALLS_OPENING`]) unless the prompt `prefilled` it, one call when
/// `parallel` is false, one or more otherwise, each of a function in `functions` (name, JSON
/// schema of its arguments under the server's options), then the block's end.
///
/// Each argument is a parameter tag, in the schema's order, required ones always and the
/// others optionally. A plain string property is written as is (`string="true"`: any text
/// without `<`, or one of its `enum` values); any other property, a string with a `pattern`
/// or length bounds included, as JSON valid for its schema (`string="false"`), which DSML
/// reads the same way. Properties beyond the listed ones are not offered.
///
/// `token_id` finds DSML's marker as a single token when the vocabulary has it.
pub fn lark_grammar(
    functions: &[(&str, &Value)],
    parallel: bool,
    prefilled: bool,
    token_id: &dyn Fn(&str) -> Option<u32>,
) -> String {
    let lit = |text: &str| literal(text, token_id);
    let repeat = if parallel {
        format!(" ({} call)*", lit("\n"))
    } else {
        String::new()
    };
    let opening = if prefilled {
        String::new()
    } else {
        format!("{} ", lit(CALLS_OPENING))
    };
    let end = lit(&format!("\n{CALLS_END}"));
    let mut out = format!("start: {opening}call{repeat} {end}\n");
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
    out.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for (i, (name, schema)) in functions.iter().enumerate() {
        let properties = schema.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = vec![lit(&format!("{INVOKE_BEGIN}{name}\">\n"))];
        for (j, (key, property)) in properties.into_iter().flatten().enumerate() {
            let rule = format!("p_{i}_{j}");
            let optional = if required.contains(&key.as_str()) {
                ""
            } else {
                "?"
            };
            body.push(format!("{rule}{optional}"));
            out.push_str(&format!(
                "{rule}: {}\n",
                parameter_rule(key, property, schema, &lit)
            ));
        }
        body.push(lit(INVOKE_END));
        out.push_str(&format!("fn_{i}: {}\n", body.join(" ")));
    }
    out
}

/// One parameter tag of property `key` (see [`lark_grammar`]), followed by its newline.
fn parameter_rule(
    key: &str,
    property: &Value,
    root: &Value,
    lit: &dyn Fn(&str) -> String,
) -> String {
    let open = |string: bool| lit(&format!("{PARAMETER_BEGIN}{key}\" string=\"{string}\">"));
    let close = lit(&format!("{PARAMETER_END}\n"));
    if let Some(values) = plain_string(property) {
        let value = match values {
            Some(values) => format!(
                "({})",
                values
                    .iter()
                    .map(|v| lit(v))
                    .collect::<Vec<_>>()
                    .join(" | ")
            ),
            None => "/[^<]*/".to_owned(),
        };
        return format!("{} {value} {close}", open(true));
    }
    format!(
        "{} %json {} {close}",
        open(false),
        standalone(property, root)
    )
}

/// For a property that is a plain string (no pattern, format or length bounds; or, without a
/// `type`, an `enum` or `const` of strings only): its `enum` (or `const`) values if it lists
/// any, else `Some(None)`; `None` for any other property.
fn plain_string(property: &Value) -> Option<Option<Vec<&str>>> {
    const PLAIN: [&str; 7] = [
        "type",
        "description",
        "title",
        "enum",
        "const",
        "default",
        "examples",
    ];
    let object = property.as_object()?;
    // A string, or (no `type`) a choice among values, which must then all be strings.
    let typed = match object.get("type") {
        Some(t) => t.as_str() == Some("string"),
        None => object.contains_key("enum") || object.contains_key("const"),
    };
    if !typed || object.keys().any(|k| !PLAIN.contains(&k.as_str())) {
        return None;
    }
    if let Some(c) = object.get("const") {
        return Some(Some(vec![c.as_str()?]));
    }
    match object.get("enum") {
        None => Some(None),
        Some(Value::Array(values)) => {
            let values: Option<Vec<&str>> = values.iter().map(Value::as_str).collect();
            Some(Some(values?))
        }
        Some(_) => None,
    }
}

/// A property's schema as a schema of its own: with the root's definitions (its `$ref`s
/// point there) and the root's `x-guidance` options.
fn standalone(property: &Value, root: &Value) -> Value {
    let mut schema = match property {
        Value::Object(o) => o.clone(),
        other => {
            let mut m = Map::new();
            m.insert("allOf".into(), Value::Array(vec![other.clone()]));
            m
        }
    };
    for key in ["$defs", "definitions", "x-guidance"] {
        if let Some(v) = root.get(key) {
            schema.entry(key).or_insert_with(|| v.clone());
        }
    }
    Value::Object(schema)
}

/// `text` as Lark atoms: DSML's marker as its token when the vocabulary has one, the rest
/// quoted.
fn literal(text: &str, token_id: &dyn Fn(&str) -> Option<u32>) -> String {
    let quoted = |t: &str| Value::String(t.to_owned()).to_string();
    let Some(id) = token_id(DSML) else {
        return quoted(text);
    };
    let atoms: Vec<String> = text
        .split(DSML)
        .enumerate()
        .flat_map(|(i, piece)| {
            let marker = (i > 0).then(|| format!("<[{id}]>"));
            let piece = (!piece.is_empty()).then(|| quoted(piece));
            marker.into_iter().chain(piece)
        })
        .collect();
    if atoms.is_empty() {
        quoted("")
    } else {
        atoms.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::super::parser::assemble;
    use super::*;
    use serde_json::json;

    const CALL: &str = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
        <｜DSML｜parameter name=\"city\" string=\"true\">Pa\"ris</｜DSML｜parameter>\n\
        <｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n\
        </｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n\
        </｜DSML｜tool_calls>";

    fn streamed(text: &str, size: usize, in_calls: bool) -> (String, Vec<(String, String)>) {
        let chars: Vec<char> = text.chars().collect();
        let mut parser = DsmlParser::new(in_calls);
        let mut parsed = Vec::new();
        for piece in chars.chunks(size) {
            parsed.extend(parser.push(&piece.iter().collect::<String>()));
        }
        parsed.extend(parser.finish());
        assemble(parsed)
    }

    fn two_calls() -> Vec<(String, String)> {
        vec![
            (
                "get_weather".into(),
                r#"{"city": "Pa\"ris", "days": 2}"#.into(),
            ),
            ("now".into(), "{}".into()),
        ]
    }

    #[test]
    fn content_then_calls_in_any_pieces() {
        for size in [1, 2, 3, 7, 1000] {
            let (content, calls) = streamed(&format!("Let me check.{CALL}"), size, false);
            assert_eq!(content, "Let me check.", "pieces of {size}");
            assert_eq!(calls, two_calls(), "pieces of {size}");
        }
        let (content, calls) = streamed("a\n\nb <｜DSML｜x", 2, false);
        assert_eq!((content.as_str(), calls.len()), ("a\n\nb <｜DSML｜x", 0));
    }

    #[test]
    fn a_prefilled_block_starts_inside_the_calls() {
        let body = &CALL[crate::chat_v4::CALLS_OPENING.len()..];
        assert_eq!(streamed(body, 5, true), (String::new(), two_calls()));
    }

    #[test]
    fn a_cut_reply_keeps_what_it_holds() {
        let cut = &CALL[..CALL.find("<｜DSML｜parameter name=\"days\"").unwrap() + 12];
        let (content, calls) = streamed(cut, 4, false);
        assert_eq!(content, "");
        assert_eq!(calls[0].0, "get_weather");
        assert!(calls[0].1.starts_with(r#"{"city": "Pa\"ris""#), "{calls:?}");
        // Cut in the block before any call: its text is content.
        let text = "x\n\n<｜DSML｜tool_calls>\n<｜DS";
        let (content, calls) = streamed(text, 3, false);
        assert_eq!((content.as_str(), calls.len()), (text, 0));
    }

    #[test]
    fn a_broken_block_is_content() {
        let (content, calls) = streamed("<｜DSML｜tool_calls>\nnot a call", 3, false);
        assert_eq!((content.as_str(), calls.len()), ("\nnot a call", 0));
    }

    #[test]
    fn grammar_writes_parameters_in_schema_order() {
        let schema = json!({"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["C", "F"]},
            "days": {"type": "integer", "minimum": 1},
            "tag": {"$ref": "#/$defs/T"}},
            "required": ["city", "days"], "$defs": {"T": {"type": "string", "maxLength": 3}}});
        let mixed = json!({"properties": {"m": {"enum": ["a", 1]}}});
        let g_mixed = lark_grammar(&[("m", &mixed)], false, true, &|_| None);
        assert!(
            g_mixed.contains("string=\\\"false\\\">\" %json"),
            "{g_mixed}"
        );
        let g = lark_grammar(&[("w", &schema)], true, true, &|_| None);
        assert!(
            g.starts_with("start: call (\"\\n\" call)* \"\\n</｜DSML｜tool_calls>\"\n"),
            "{g}"
        );
        assert!(g.contains("fn_0: \"<｜DSML｜invoke name=\\\"w\\\">\\n\" p_0_0 p_0_1? p_0_2 p_0_3? \"</｜DSML｜invoke>\""), "{g}");
        assert!(g.contains("string=\\\"true\\\">\" /[^<]*/"), "{g}");
        assert!(g.contains("(\"C\" | \"F\")"), "{g}");
        assert!(
            g.contains("%json {\"type\":\"integer\",\"minimum\":1,"),
            "{g}"
        );
        assert!(g.contains("\"$ref\":\"#/$defs/T\",\"$defs\""), "{g}");
        let with_token = lark_grammar(&[("w", &json!({}))], false, false, &|p| {
            (p == DSML).then_some(9)
        });
        assert!(
            with_token.contains("\"<\" <[9]> \"invoke name="),
            "{with_token}"
        );
        assert!(
            with_token.starts_with("start: \"\\n\\n<\" <[9]> \"tool_calls>\\n\" call \""),
            "{with_token}"
        );
    }
}
