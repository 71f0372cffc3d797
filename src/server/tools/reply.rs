//! Reading a reply with tools as it streams, whichever way its calls are written: in the
//! model's own call format ([`super::parser`]), or, for a model without one, as the JSON a
//! constrained `tool_choice` holds the reply to (vLLM's way, no format needed):
//!
//! - a named function: the reply is that function's arguments object, nothing else;
//! - `required`: the reply is a JSON array of `{"name": ..., "parameters": {...}}` objects,
//!   one per call, each naming an offered function.
//!
//! Either way a reply cut short (by `max_tokens`) gives back what it holds: the call it was
//! cut in, with its partial arguments (and name, when cut inside it), or, when it was cut
//! before any call began, its text as content. Nothing the model wrote is dropped.

use super::dsml::DsmlParser;
use super::format::CallFormat;
use super::parser::{assemble, Parsed, ToolCallParser};

/// How a reply with tools is written, so how it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolReply {
    /// In the model's own tool-call format (`--tool-call-parser`, or the chat template's).
    Format {
        /// The format.
        format: CallFormat,
        /// A named `tool_choice` forces the call (reported as `"stop"`, see
        /// [`ReplyParser::stops_as_tool_calls`]).
        named: bool,
        /// The prompt opened DSML's calls block: the reply starts inside it.
        prefilled: bool,
    },
    /// The arguments object of this function (a named `tool_choice`, no format).
    Named(String),
    /// A JSON array of `{"name", "parameters"}` calls (`tool_choice: "required"`, no format).
    Required,
}

/// The parser of one reply (see the module docs).
#[derive(Debug)]
pub enum ReplyParser {
    /// Calls in a marker format.
    Format {
        /// Reads the format.
        parser: ToolCallParser,
        /// As in [`ToolReply::Format`].
        named: bool,
    },
    /// Calls in DSML.
    Dsml {
        /// Reads DSML.
        parser: DsmlParser,
        /// As in [`ToolReply::Format`].
        named: bool,
    },
    /// The whole reply is one call's arguments.
    Named(NamedCallParser),
    /// The reply is a JSON array of calls.
    Required(CallListParser),
}

impl ReplyParser {
    /// A parser for replies written as `reply` says.
    pub fn new(reply: &ToolReply) -> Self {
        match reply {
            ToolReply::Format {
                format: CallFormat::Markers(format),
                named,
                ..
            } => ReplyParser::Format {
                parser: ToolCallParser::new(format),
                named: *named,
            },
            ToolReply::Format {
                format: CallFormat::Dsml,
                named,
                prefilled,
            } => ReplyParser::Dsml {
                parser: DsmlParser::new(*prefilled),
                named: *named,
            },
            ToolReply::Named(name) => ReplyParser::Named(NamedCallParser::new(name.clone())),
            ToolReply::Required => ReplyParser::Required(CallListParser::default()),
        }
    }

    /// The number of calls begun so far.
    pub fn calls(&self) -> usize {
        match self {
            ReplyParser::Format { parser, .. } => parser.calls(),
            ReplyParser::Dsml { parser, .. } => parser.calls(),
            ReplyParser::Named(p) => usize::from(p.started),
            ReplyParser::Required(p) => p.calls,
        }
    }

    /// Whether a reply that ended by itself after calls reports `finish_reason: "tool_calls"`
    /// (otherwise `"stop"`). A named function's call is reported as `"stop"`, as OpenAI and
    /// vLLM report a forced call, whether it is written as bare arguments or in the model's
    /// format; calls the model chose to make (`auto`, or `required`) as `"tool_calls"`.
    pub fn stops_as_tool_calls(&self) -> bool {
        let named = match self {
            ReplyParser::Named(_) => true,
            ReplyParser::Format { named, .. } | ReplyParser::Dsml { named, .. } => *named,
            ReplyParser::Required(_) => false,
        };
        !named && self.calls() > 0
    }

    /// Takes the next piece of text; returns what it (with text held back before) completes.
    pub fn push(&mut self, text: &str) -> Vec<Parsed> {
        match self {
            ReplyParser::Format { parser, .. } => parser.push(text),
            ReplyParser::Dsml { parser, .. } => parser.push(text),
            ReplyParser::Named(p) => p.push(text),
            ReplyParser::Required(p) => p.push(text),
        }
    }

    /// Ends the text: passes on what was held back (see the module docs for a cut reply).
    pub fn finish(&mut self) -> Vec<Parsed> {
        match self {
            ReplyParser::Format { parser, .. } => parser.finish(),
            ReplyParser::Dsml { parser, .. } => parser.finish(),
            ReplyParser::Named(p) => p.finish(),
            ReplyParser::Required(p) => p.finish(),
        }
    }

    /// Takes the rest of the reply at once and ends it: its content (`None` when empty) and
    /// calls (name, arguments), in order.
    pub fn parse_rest(&mut self, text: &str) -> (Option<String>, Vec<(String, String)>) {
        let mut parsed = self.push(text);
        parsed.extend(self.finish());
        let (content, calls) = assemble(parsed);
        ((!content.is_empty()).then_some(content), calls)
    }
}

/// A named function's reply: every piece of text is more of its one call's arguments.
#[derive(Debug)]
pub struct NamedCallParser {
    name: String,
    /// The call's start was passed on.
    started: bool,
}

impl NamedCallParser {
    /// A parser of a reply that is `name`'s arguments.
    pub fn new(name: String) -> Self {
        NamedCallParser {
            name,
            started: false,
        }
    }

    fn start(&mut self, out: &mut Vec<Parsed>) {
        if !self.started {
            self.started = true;
            out.push(Parsed::CallStart {
                index: 0,
                name: self.name.clone(),
            });
        }
    }

    /// The call's start with the first piece, then each piece as arguments.
    pub fn push(&mut self, text: &str) -> Vec<Parsed> {
        let mut out = Vec::new();
        self.start(&mut out);
        if !text.is_empty() {
            out.push(Parsed::Arguments {
                index: 0,
                text: text.to_owned(),
            });
        }
        out
    }

    /// The call's start if no text came (the call is there, with empty arguments).
    pub fn finish(&mut self) -> Vec<Parsed> {
        let mut out = Vec::new();
        self.start(&mut out);
        out
    }
}

/// Where a [`CallListParser`] is inside the current call object (depth 2 of the array).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Slot {
    /// Before a key (or between members).
    #[default]
    Key,
    /// Inside a key's string, which began at this byte (its opening quote).
    InKey(usize),
    /// After a key's colon: its value comes next.
    Value,
    /// Inside the `name` value's string, which began at this byte (its opening quote).
    InName(usize),
    /// Inside the `parameters` value, which began at this byte.
    InParameters(usize),
    /// Inside some other member's value (not one of ours: skipped).
    InOther,
}

/// A `required` reply: a JSON array of `{"name": "...", "parameters": {...}}` objects, read
/// incrementally. Each call starts when its name's string closes (the grammar puts `name`
/// first); its arguments are the `parameters` value's text exactly as written, passed on as
/// it comes.
#[derive(Debug, Default)]
pub struct CallListParser {
    /// The reply so far.
    text: String,
    /// Bytes of `text` scanned.
    scanned: usize,
    /// Open arrays and objects at the scan position.
    depth: usize,
    /// Inside a string (at any depth), and just after its backslash.
    in_string: bool,
    escaped: bool,
    /// Where the scan is in the current call object.
    slot: Slot,
    /// The last key read in the current call object.
    key: String,
    /// The current call object's call was started (its name read).
    started: bool,
    /// Bytes of `text` passed on as the current call's arguments, up to here.
    sent: usize,
    /// Calls begun.
    calls: usize,
}

impl CallListParser {
    /// Scans the new text; passes on call starts and argument pieces.
    pub fn push(&mut self, text: &str) -> Vec<Parsed> {
        self.text.push_str(text);
        let mut out = Vec::new();
        self.scan(&mut out);
        // Arguments as far as they go, but whitespace after a scalar `parameters` value
        // (which ends only at the next `,` or `}`) is held back.
        if let Slot::InParameters(_) = self.slot {
            let upto = self.text.trim_end().len().max(self.sent);
            self.send_arguments(&mut out, upto);
        }
        out
    }

    /// Ends the reply: a call cut inside its name starts with the partial name; a call cut in
    /// its arguments gets the rest of them; a reply with no call at all is content.
    pub fn finish(&mut self) -> Vec<Parsed> {
        let mut out = Vec::new();
        match self.slot {
            Slot::InName(start) => {
                // The grammar only allows the offered names: the partial one is plain text,
                // less a character the reply was cut inside.
                let name = self.text[start + 1..]
                    .trim_end_matches('\u{FFFD}')
                    .to_owned();
                self.start_call(&mut out, name);
            }
            Slot::InParameters(_) => {
                let end = self.text.trim_end().len().max(self.sent);
                self.send_arguments(&mut out, end);
            }
            _ => {}
        }
        if self.calls == 0 && !self.text.is_empty() {
            out.push(Parsed::Content(std::mem::take(&mut self.text)));
        }
        out
    }

    fn start_call(&mut self, out: &mut Vec<Parsed>, name: String) {
        out.push(Parsed::CallStart {
            index: self.calls,
            name,
        });
        self.calls += 1;
        self.started = true;
    }

    /// Passes on the current call's arguments up to byte `end`.
    fn send_arguments(&mut self, out: &mut Vec<Parsed>, end: usize) {
        if !self.started || end <= self.sent {
            return;
        }
        let text = self.text[self.sent..end].to_owned();
        self.sent = end;
        match out.last_mut() {
            Some(Parsed::Arguments { index, text: t }) if *index == self.calls - 1 => {
                t.push_str(&text)
            }
            _ => out.push(Parsed::Arguments {
                index: self.calls - 1,
                text,
            }),
        }
    }

    /// The `parameters` value that began at `start` ended before byte `end`.
    fn end_parameters(&mut self, out: &mut Vec<Parsed>, start: usize, end: usize) {
        if self.started {
            self.sent = self.sent.max(start);
            let end = start + self.text[start..end].trim_end().len();
            self.send_arguments(out, end);
        }
        self.slot = Slot::Key;
    }

    /// Scans `text` from `scanned` on. Structure is read from ASCII bytes only (the bytes of
    /// a multi-byte character never are), so every position it cuts at is a character
    /// boundary.
    fn scan(&mut self, out: &mut Vec<Parsed>) {
        for at in self.scanned..self.text.len() {
            let b = self.text.as_bytes()[at];
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    self.string_closed(out, at);
                }
                continue;
            }
            match b {
                b'"' => {
                    self.in_string = true;
                    if self.depth == 2 {
                        self.slot = match self.slot {
                            Slot::Key => Slot::InKey(at),
                            Slot::Value if self.key == "name" && !self.started => Slot::InName(at),
                            Slot::Value if self.key == "parameters" => {
                                self.sent = at;
                                Slot::InParameters(at)
                            }
                            Slot::Value => Slot::InOther,
                            other => other,
                        };
                    }
                }
                b'{' | b'[' => {
                    if self.depth == 1 && b == b'{' {
                        // A new call object.
                        self.slot = Slot::Key;
                        self.key.clear();
                        self.started = false;
                        self.sent = 0;
                    } else if self.depth == 2 {
                        self.begin_value(at);
                    }
                    self.depth += 1;
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 2 {
                        // A nested value of the call object closed: it ended with this byte.
                        if let Slot::InParameters(start) = self.slot {
                            self.end_parameters(out, start, at + 1);
                        } else if self.slot == Slot::InOther {
                            self.slot = Slot::Key;
                        }
                    } else if self.depth == 1 {
                        // The call object closed: a scalar value ends with it.
                        if let Slot::InParameters(start) = self.slot {
                            self.end_parameters(out, start, at);
                        }
                        self.slot = Slot::Key;
                    }
                }
                b':' if self.depth == 2 => self.slot = Slot::Value,
                b',' if self.depth == 2 => {
                    if let Slot::InParameters(start) = self.slot {
                        self.end_parameters(out, start, at);
                    }
                    self.slot = Slot::Key;
                }
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ if self.depth == 2 => self.begin_value(at),
                _ => {}
            }
        }
        self.scanned = self.text.len();
    }

    /// A value (not a string) of the call object begins at byte `at`.
    fn begin_value(&mut self, at: usize) {
        if self.slot == Slot::Value {
            self.slot = if self.key == "parameters" {
                Slot::InParameters(at)
            } else {
                Slot::InOther
            };
            if self.key == "parameters" {
                self.sent = at;
            }
        }
    }

    /// The string that ends at byte `at` (its closing quote) closed.
    fn string_closed(&mut self, out: &mut Vec<Parsed>, at: usize) {
        if self.depth != 2 {
            return;
        }
        match self.slot {
            Slot::InKey(start) => {
                self.key = unquote(&self.text[start..=at]);
                self.slot = Slot::Key;
            }
            Slot::InName(start) => {
                let name = unquote(&self.text[start..=at]);
                self.slot = Slot::Key;
                self.start_call(out, name);
            }
            Slot::InParameters(start) => self.end_parameters(out, start, at + 1),
            Slot::InOther => self.slot = Slot::Key,
            Slot::Key | Slot::Value => {}
        }
    }
}

/// A JSON string literal's text (its raw inside when it does not parse).
fn unquote(literal: &str) -> String {
    serde_json::from_str::<String>(literal).unwrap_or_else(|_| literal.trim_matches('"').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `size` characters; the content and calls the pieces add up to.
    fn streamed(reply: &ToolReply, text: &str, size: usize) -> (String, Vec<(String, String)>) {
        let chars: Vec<char> = text.chars().collect();
        let mut parser = ReplyParser::new(reply);
        let mut parsed = Vec::new();
        for piece in chars.chunks(size) {
            parsed.extend(parser.push(&piece.iter().collect::<String>()));
        }
        parsed.extend(parser.finish());
        assemble(parsed)
    }

    fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, a)| (n.to_string(), a.to_string()))
            .collect()
    }

    #[test]
    fn a_named_reply_is_its_arguments() {
        let reply = ToolReply::Named("add".into());
        for size in [1, 3, 1000] {
            let (content, got) = streamed(&reply, r#"{"a":2,"b":3}"#, size);
            assert_eq!(content, "");
            assert_eq!(got, calls(&[("add", r#"{"a":2,"b":3}"#)]));
            // Cut: the partial arguments.
            let (content, got) = streamed(&reply, r#"{"a":2,"b"#, size);
            assert_eq!(content, "");
            assert_eq!(got, calls(&[("add", r#"{"a":2,"b"#)]));
        }
        let mut parser = ReplyParser::new(&reply);
        assert!(!parser.stops_as_tool_calls());
        assert_eq!(parser.parse_rest(""), (None, calls(&[("add", "")])));
        assert_eq!(parser.calls(), 1);
        assert!(
            !parser.stops_as_tool_calls(),
            "a forced call stops as `stop`"
        );
    }

    const TWO_CALLS: &str = r#"[{"name":"get_weather","parameters":{"city":"Paris \"}{,","n":[1,{"x":2}]}},{"name":"get_time","parameters":{}}]"#;

    #[test]
    fn a_required_reply_gives_each_call_as_written() {
        let want = calls(&[
            ("get_weather", r#"{"city":"Paris \"}{,","n":[1,{"x":2}]}"#),
            ("get_time", "{}"),
        ]);
        for size in [1, 2, 5, 7, 1000] {
            assert_eq!(
                streamed(&ToolReply::Required, TWO_CALLS, size),
                (String::new(), want.clone())
            );
        }
        let pretty = "[\n  {\n    \"name\": \"get_time\",\n    \"parameters\": {\n      \"zone\": \"CET\"\n    }\n  }\n]";
        for size in [1, 1000] {
            let (content, got) = streamed(&ToolReply::Required, pretty, size);
            assert_eq!(content, "");
            assert_eq!(
                got,
                calls(&[("get_time", "{\n      \"zone\": \"CET\"\n    }")])
            );
        }
        let mut parser = ReplyParser::new(&ToolReply::Required);
        parser.parse_rest(TWO_CALLS);
        assert!(parser.stops_as_tool_calls());
    }

    #[test]
    fn scalar_parameters_end_at_the_member_end() {
        let text = r#"[{"name":"f","parameters":12 },{"name":"g","parameters":"s,}"}]"#;
        for size in [1, 1000] {
            assert_eq!(
                streamed(&ToolReply::Required, text, size),
                (String::new(), calls(&[("f", "12"), ("g", r#""s,}""#)]))
            );
        }
    }

    #[test]
    fn a_cut_required_reply_keeps_what_it_holds() {
        let cases = [
            // Cut in the arguments: the call with its partial arguments.
            (
                r#"[{"name":"get_weather","parameters":{"city":"Ver"#,
                "",
                calls(&[("get_weather", r#"{"city":"Ver"#)]),
            ),
            // Cut in the second call's name: the partial name, no arguments yet.
            (
                r#"[{"name":"get_time","parameters":{}},{"name":"get_we"#,
                "",
                calls(&[("get_time", "{}"), ("get_we", "")]),
            ),
            // Cut before the parameters.
            (r#"[{"name":"add","param"#, "", calls(&[("add", "")])),
            // Cut before any call began: the text, as content.
            (r#"[{"na"#, r#"[{"na"#, vec![]),
        ];
        for (text, content, want) in cases {
            for size in [1, 3, 1000] {
                assert_eq!(
                    streamed(&ToolReply::Required, text, size),
                    (content.to_owned(), want.clone()),
                    "{text} in pieces of {size}"
                );
            }
        }
    }
}
