//! How a model writes tool calls: the markers around each call, its name and its arguments,
//! and the Lark grammar that makes a constrained choice follow them.
//!
//! DeepSeek's chat models write calls between special tokens. DeepSeek-V3 (and R1, V3-0324)
//! put the call's type, the function name, and the arguments in a fenced JSON block:
//!
//! ```text
//! <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
//! ```json
//! {"city": "Paris"}
//! ```<｜tool▁call▁end｜>
//! <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
//! ```
//!
//! DeepSeek-V3.1 dropped the type and the fence:
//! `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>`.
//! Both are the same shape (begin, name, separator, arguments, end), which [`ToolCallFormat`]
//! describes with five strings; the parser and the grammar read only those.
//!
//! DeepSeek-V4 writes calls as DSML tags, one per argument ([`super::dsml`]); [`CallFormat`]
//! is either kind.

use serde_json::Value;

/// The markers of one tool-call format (see the module docs).
#[derive(Debug, PartialEq, Eq)]
pub struct ToolCallFormat {
    /// The name `--tool-call-parser` knows the format by (vLLM's names).
    pub name: &'static str,
    /// Opens the list of calls.
    pub calls_begin: &'static str,
    /// Opens one call, up to its function name.
    pub call_begin: &'static str,
    /// Between the function name and the arguments.
    pub name_end: &'static str,
    /// After the arguments: closes the call.
    pub args_end: &'static str,
    /// Between two calls.
    pub call_separator: &'static str,
    /// Closes the list of calls.
    pub calls_end: &'static str,
}

/// DeepSeek-V3's format (also R1's and V3-0324's).
pub const DEEPSEEK_V3: ToolCallFormat = ToolCallFormat {
    name: "deepseek_v3",
    calls_begin: "<｜tool▁calls▁begin｜>",
    call_begin: "<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
    name_end: "\n```json\n",
    args_end: "\n```<｜tool▁call▁end｜>",
    call_separator: "\n",
    calls_end: "<｜tool▁calls▁end｜>",
};

/// DeepSeek-V3.1's format.
pub const DEEPSEEK_V31: ToolCallFormat = ToolCallFormat {
    name: "deepseek_v31",
    calls_begin: "<｜tool▁calls▁begin｜>",
    call_begin: "<｜tool▁call▁begin｜>",
    name_end: "<｜tool▁sep｜>",
    args_end: "<｜tool▁call▁end｜>",
    call_separator: "",
    calls_end: "<｜tool▁calls▁end｜>",
};

/// Every marker format, for `--tool-call-parser`.
pub const FORMATS: [&ToolCallFormat; 2] = [&DEEPSEEK_V3, &DEEPSEEK_V31];

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// Between special-token markers (DeepSeek-V3, V3.1).
    Markers(&'static ToolCallFormat),
    /// DeepSeek-V4's DSML tags.
    Dsml,
}

impl CallFormat {
    /// `--tool-call-parser`'s name of DeepSeek-V4's format (vLLM's).
    pub const DSML_NAME: &'static str = "deepseek_v4";

    /// The format by its `--tool-call-parser` name.
    pub fn by_name(name: &str) -> Option<CallFormat> {
        if name == Self::DSML_NAME {
            return Some(CallFormat::Dsml);
        }
        ToolCallFormat::by_name(name).map(CallFormat::Markers)
    }

    /// Every `--tool-call-parser` name.
    pub fn names() -> Vec<&'static str> {
        let mut names: Vec<&str> = FORMATS.iter().map(|f| f.name).collect();
        names.push(Self::DSML_NAME);
        names
    }
}

impl ToolCallFormat {
    /// The format by its `--tool-call-parser` name.
    pub fn by_name(name: &str) -> Option<&'static ToolCallFormat> {
        FORMATS.into_iter().find(|f| f.name == name)
    }

    /// The format a chat template renders past tool calls in, or `None` when it renders none.
    ///
    /// A model is prompted with its template, so the way the template writes an assistant's
    /// earlier calls is the way the model writes new ones: V3's templates fence the arguments
    /// in a `json` block, V3.1's do not.
    pub fn detect(template: &str) -> Option<&'static ToolCallFormat> {
        if !template.contains(DEEPSEEK_V3.calls_begin) {
            return None;
        }
        Some(if template.contains("```json") {
            &DEEPSEEK_V3
        } else {
            &DEEPSEEK_V31
        })
    }

    /// The Lark grammar (llguidance's dialect) of a reply that is only tool calls: one call
    /// when `parallel` is false, one or more otherwise, each of a function in `functions`
    /// (name, JSON schema of its arguments) with arguments valid for its schema.
    ///
    /// `token_id` finds a marker piece that is a single token of the vocabulary (DeepSeek's
    /// `<｜tool▁sep｜>` and friends are): the grammar names it as that token, since the model
    /// writes the token rather than the characters it is spelled with. Pieces that are not
    /// tokens (a tokenizer without DeepSeek's added tokens) are matched as text.
    pub fn lark_grammar(
        &self,
        functions: &[(&str, &Value)],
        parallel: bool,
        token_id: &dyn Fn(&str) -> Option<u32>,
    ) -> String {
        let lit = |text: &str| lark_literal(text, token_id);
        let mut out = String::new();
        let repeat = if parallel {
            format!(" ({} call)*", lit(self.call_separator))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "start: {} call{repeat} {}\n",
            lit(self.calls_begin),
            lit(self.calls_end)
        ));
        let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
        out.push_str(&format!(
            "call: {} ({}) {}\n",
            lit(self.call_begin),
            alternatives.join(" | "),
            lit(self.args_end)
        ));
        for (i, (name, schema)) in functions.iter().enumerate() {
            out.push_str(&format!(
                "fn_{i}: {} {} %json {schema}\n",
                lit(name),
                lit(self.name_end)
            ));
        }
        out
    }
}

/// `text` as a sequence of Lark atoms: each DeepSeek special-token spelling (`<｜...｜>`) that
/// `token_id` knows becomes `<[id]>`, the rest quoted strings. An empty text is `""`.
fn lark_literal(text: &str, token_id: &dyn Fn(&str) -> Option<u32>) -> String {
    const OPEN: &str = "<｜";
    const CLOSE: &str = "｜>";
    let mut atoms = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let special = rest.find(OPEN).and_then(|start| {
            let end = rest[start..].find(CLOSE)? + start + CLOSE.len();
            Some((start, end))
        });
        let Some((start, end)) = special else {
            atoms.push(quoted(rest));
            break;
        };
        if start > 0 {
            atoms.push(quoted(&rest[..start]));
        }
        let piece = &rest[start..end];
        atoms.push(match token_id(piece) {
            Some(id) => format!("<[{id}]>"),
            None => quoted(piece),
        });
        rest = &rest[end..];
    }
    if atoms.is_empty() {
        atoms.push(quoted(""));
    }
    atoms.join(" ")
}

/// A Lark string literal: JSON's escapes are Lark's.
fn quoted(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_the_format_a_template_renders() {
        let v3 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + \
                  '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' }}";
        let v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] \
                   + '<｜tool▁sep｜>' + tool['function']['arguments'] }}";
        assert_eq!(ToolCallFormat::detect(v3), Some(&DEEPSEEK_V3));
        assert_eq!(ToolCallFormat::detect(v31), Some(&DEEPSEEK_V31));
        assert_eq!(
            ToolCallFormat::detect("{{ 'User: ' + m['content'] }}"),
            None
        );
        assert_eq!(ToolCallFormat::by_name("deepseek_v31"), Some(&DEEPSEEK_V31));
        assert_eq!(ToolCallFormat::by_name("hermes"), None);
    }

    #[test]
    fn literals_name_known_tokens_and_quote_the_rest() {
        let ids = |piece: &str| (piece == "<｜tool▁sep｜>").then_some(7);
        assert_eq!(
            lark_literal("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", &ids),
            "\"<｜tool▁call▁begin｜>\" \"function\" <[7]>"
        );
        assert_eq!(lark_literal("\n```json\n", &ids), "\"\\n```json\\n\"");
        assert_eq!(lark_literal("", &ids), "\"\"");
    }

    #[test]
    fn grammar_lists_every_function() {
        let a = json!({"type": "object"});
        let b = json!({"type": "object", "properties": {"x": {"type": "integer"}}});
        let g = DEEPSEEK_V3.lark_grammar(&[("f", &a), ("g", &b)], true, &|_| None);
        assert!(g.contains("call: "), "{g}");
        assert!(g.contains("(fn_0 | fn_1)"), "{g}");
        assert!(g.contains("fn_1: \"g\" \"\\n```json\\n\" %json {"), "{g}");
        assert!(g.contains("(\"\\n\" call)*"), "{g}");
        let one = DEEPSEEK_V3.lark_grammar(&[("f", &a)], false, &|_| None);
        assert!(!one.contains(")*"), "{one}");
    }
}
