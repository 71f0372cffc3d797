//! Reading tool calls out of a model's text as it streams: plain text before the calls is the
//! message's content; each call yields its name once, then its arguments in pieces.
//!
//! Text that could be the start of a marker is held back until the next piece says whether it
//! is one, so a streamed client never sees half a marker as content. Text that breaks the
//! format after the calls began is passed on as content (the model wrote something that is
//! not a call; the client should see it rather than lose it).

use super::format::ToolCallFormat;

/// What a piece of the model's text turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// Message content.
    Content(String),
    /// Call number `index` (from 0) began, of function `name`.
    CallStart {
        /// The call's position in the reply.
        index: usize,
        /// The function's name as the model wrote it.
        name: String,
    },
    /// More of call `index`'s arguments (a JSON text, in pieces).
    Arguments {
        /// The call's position in the reply.
        index: usize,
        /// The next piece of the arguments.
        text: String,
    },
}

/// Where the parser is in the model's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Content, before any call.
    Content,
    /// After the calls began, or after a call: a call, or the end of the calls, comes next.
    BetweenCalls,
    /// Reading a call's function name.
    Name,
    /// Reading a call's arguments.
    Arguments,
    /// After the end of the calls: the rest is not part of the reply.
    Done,
    /// The format broke: the rest is content.
    Broken,
}

/// The longest function name the parser waits for before deciding the text is not a call.
pub(super) const MAX_NAME_BYTES: usize = 256;

/// An incremental parser of one reply (see the module docs).
#[derive(Debug)]
pub struct ToolCallParser {
    format: &'static ToolCallFormat,
    state: State,
    /// Text received but not yet passed on.
    held: String,
    /// Calls begun so far.
    calls: usize,
    /// Every piece of text received (a reply cut before its first call is given back from it).
    pushed: String,
    /// Where in `pushed` the calls began.
    calls_start: Option<usize>,
}

impl ToolCallParser {
    /// A parser of text in `format`.
    pub fn new(format: &'static ToolCallFormat) -> Self {
        ToolCallParser {
            format,
            state: State::Content,
            held: String::new(),
            calls: 0,
            pushed: String::new(),
            calls_start: None,
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

    /// Ends the text: passes on what was held back (content, or the arguments of a call the
    /// reply was cut in, as a length limit does). A reply cut inside a call's name gives that
    /// call with the partial name; one cut after the calls began but before the first call's
    /// name gives its text from the calls' beginning on as content: what the model wrote is
    /// never dropped.
    pub fn finish(&mut self) -> Vec<Parsed> {
        let mut out = Vec::new();
        while self.step(&mut out) {}
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Content | State::Broken => push_content(&mut out, held),
            State::Arguments => push_arguments(&mut out, self.calls - 1, held),
            State::Name => {
                // Less a character the reply was cut inside, and the separator's beginning.
                let held = held.trim_end_matches('\u{FFFD}');
                let name =
                    held[..held.len() - partial_marker_len(held, self.format.name_end)].trim();
                if !name.is_empty() {
                    out.push(Parsed::CallStart {
                        index: self.calls,
                        name: name.to_owned(),
                    });
                    self.calls += 1;
                }
            }
            State::BetweenCalls | State::Done => {}
        }
        if let (0, Some(start), State::BetweenCalls | State::Name | State::Done) =
            (self.calls, self.calls_start, self.state)
        {
            push_content(&mut out, self.pushed[start..].to_owned());
        }
        out
    }

    /// Takes the rest of the reply at once and ends it: its content (`None` when empty) and
    /// calls (name, arguments), in order.
    pub fn parse_rest(&mut self, text: &str) -> (Option<String>, Vec<(String, String)>) {
        let mut parsed = self.push(text);
        parsed.extend(self.finish());
        let (content, calls) = assemble(parsed);
        ((!content.is_empty()).then_some(content), calls)
    }

    /// One move on the held text; false when it needs more text to move on.
    fn step(&mut self, out: &mut Vec<Parsed>) -> bool {
        let f = self.format;
        match self.state {
            State::Content => {
                if let Some(at) = self.held.find(f.calls_begin) {
                    // `held` is the end of `pushed` not yet passed on.
                    self.calls_start = Some(self.pushed.len() - self.held.len() + at);
                    let content = self.take(at);
                    push_content(out, content);
                    self.skip(f.calls_begin.len());
                    self.state = State::BetweenCalls;
                    return true;
                }
                let keep = partial_marker_len(&self.held, f.calls_begin);
                let content = self.take(self.held.len() - keep);
                push_content(out, content);
                false
            }
            State::BetweenCalls => {
                let start = self.held.len() - self.held.trim_start().len();
                let rest = &self.held[start..];
                // A reply cut mid-character ends in U+FFFD: still a call's beginning, not a
                // break of the format (`finish` drops it).
                let unfinished = rest.trim_end_matches('\u{FFFD}');
                if let Some(rest) = rest.strip_prefix(f.call_begin) {
                    let consumed = self.held.len() - rest.len();
                    self.skip(consumed);
                    self.state = State::Name;
                    true
                } else if let Some(rest) = rest.strip_prefix(f.calls_end) {
                    let consumed = self.held.len() - rest.len();
                    self.skip(consumed);
                    self.state = State::Done;
                    true
                } else if f.call_begin.starts_with(unfinished)
                    || f.calls_end.starts_with(unfinished)
                {
                    false
                } else {
                    self.state = State::Broken;
                    true
                }
            }
            State::Name => match self.held.find(f.name_end) {
                Some(at) => {
                    let name = self.take(at).trim().to_owned();
                    self.skip(f.name_end.len());
                    out.push(Parsed::CallStart {
                        index: self.calls,
                        name,
                    });
                    self.calls += 1;
                    self.state = State::Arguments;
                    true
                }
                None if self.held.len() > MAX_NAME_BYTES => {
                    self.state = State::Broken;
                    true
                }
                None => false,
            },
            State::Arguments => {
                let index = self.calls - 1;
                if let Some(at) = self.held.find(f.args_end) {
                    let text = self.take(at);
                    push_arguments(out, index, text);
                    self.skip(f.args_end.len());
                    self.state = State::BetweenCalls;
                    return true;
                }
                let keep = partial_marker_len(&self.held, f.args_end);
                let text = self.take(self.held.len() - keep);
                push_arguments(out, index, text);
                false
            }
            State::Done => {
                self.held.clear();
                false
            }
            State::Broken => {
                let content = std::mem::take(&mut self.held);
                push_content(out, content);
                false
            }
        }
    }

    /// Removes and returns the first `len` bytes of the held text.
    fn take(&mut self, len: usize) -> String {
        let rest = self.held.split_off(len);
        std::mem::replace(&mut self.held, rest)
    }

    /// Drops the first `len` bytes of the held text.
    fn skip(&mut self, len: usize) {
        self.held.drain(..len);
    }
}

pub(super) fn push_content(out: &mut Vec<Parsed>, text: String) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Parsed::Content(c)) => c.push_str(&text),
        _ => out.push(Parsed::Content(text)),
    }
}

pub(super) fn push_arguments(out: &mut Vec<Parsed>, index: usize, text: String) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Parsed::Arguments { index: i, text: t }) if *i == index => t.push_str(&text),
        _ => out.push(Parsed::Arguments { index, text }),
    }
}

/// The length of the longest end of `text` that is a proper beginning of `marker` (text that
/// may become the marker with what comes next).
pub(crate) fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| marker.is_char_boundary(k) && text.ends_with(&marker[..k]))
        .unwrap_or(0)
}

/// The content and the calls (name, arguments) that parsed pieces add up to.
pub(super) fn assemble(parsed: Vec<Parsed>) -> (String, Vec<(String, String)>) {
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for p in parsed {
        match p {
            Parsed::Content(c) => content.push_str(&c),
            Parsed::CallStart { name, .. } => calls.push((name, String::new())),
            Parsed::Arguments { index, text } => {
                if let Some(call) = calls.get_mut(index) {
                    call.1.push_str(&text);
                }
            }
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::super::format::{DEEPSEEK_V3, DEEPSEEK_V31};
    use super::*;

    fn parse_whole(
        format: &'static ToolCallFormat,
        text: &str,
    ) -> (Option<String>, Vec<(String, String)>) {
        ToolCallParser::new(format).parse_rest(text)
    }

    /// Two calls as DeepSeek-V3 writes them (vLLM's parser documents the same example).
    const V3_TWO_CALLS: &str = "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": \"CET\", \"fmt\": \"```\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

    fn expected_calls() -> Vec<(String, String)> {
        vec![
            ("get_weather".into(), "{\"city\": \"Paris\"}".into()),
            (
                "get_time".into(),
                "{\"zone\": \"CET\", \"fmt\": \"```\"}".into(),
            ),
        ]
    }

    /// Feeds `text` in pieces of `size` characters and rebuilds content and calls.
    fn streamed(
        format: &'static ToolCallFormat,
        text: &str,
        size: usize,
    ) -> (String, Vec<(String, String)>) {
        let chars: Vec<char> = text.chars().collect();
        let mut parser = ToolCallParser::new(format);
        let mut parsed = Vec::new();
        for piece in chars.chunks(size) {
            parsed.extend(parser.push(&piece.iter().collect::<String>()));
        }
        parsed.extend(parser.finish());
        let starts: Vec<usize> = parsed
            .iter()
            .filter_map(|p| match p {
                Parsed::CallStart { index, .. } => Some(*index),
                _ => None,
            })
            .collect();
        assert!(
            starts.iter().copied().eq(0..starts.len()),
            "calls numbered in order"
        );
        assemble(parsed)
    }

    #[test]
    fn whole_reply_splits_content_and_calls() {
        let (content, calls) = parse_whole(&DEEPSEEK_V3, V3_TWO_CALLS);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls, expected_calls());
    }

    #[test]
    fn every_chunking_gives_the_same_calls() {
        for size in [1, 2, 3, 5, 8, 13, 1000] {
            let (content, calls) = streamed(&DEEPSEEK_V3, V3_TWO_CALLS, size);
            assert_eq!(content, "Let me check.", "pieces of {size}");
            assert_eq!(calls, expected_calls(), "pieces of {size}");
        }
    }

    #[test]
    fn v31_format() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        for size in [1, 4, 1000] {
            let (content, calls) = streamed(&DEEPSEEK_V31, text, size);
            assert_eq!(content, "");
            assert_eq!(
                calls,
                vec![
                    ("get_weather".into(), "{\"city\": \"Paris\"}".into()),
                    ("get_time".into(), "{}".into())
                ]
            );
        }
    }

    #[test]
    fn text_without_calls_is_content_even_near_a_marker() {
        let text = "a < b and <｜tool is not a marker; <｜tool▁calls";
        let (content, calls) = streamed(&DEEPSEEK_V3, text, 1);
        assert_eq!(content, text, "held text is released at the end");
        assert!(calls.is_empty());
    }

    #[test]
    fn a_broken_call_is_passed_on_as_content() {
        let text = "<｜tool▁calls▁begin｜>I changed my mind.";
        let (content, calls) = parse_whole(&DEEPSEEK_V3, text);
        assert_eq!(content.as_deref(), Some("I changed my mind."));
        assert!(calls.is_empty());
    }

    #[test]
    fn a_cut_reply_keeps_its_partial_arguments() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1\n``";
        let (content, calls) = parse_whole(&DEEPSEEK_V3, text);
        assert_eq!(content, None);
        assert_eq!(calls, vec![("f".into(), "{\"a\": 1\n``".into())]);
    }

    #[test]
    fn a_reply_cut_between_calls_has_no_content() {
        // The detokenizer ends a cut reply with U+FFFD when it stops inside a character.
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool\u{FFFD}";
        for size in [1, 1000] {
            let (content, calls) = streamed(&DEEPSEEK_V3, text, size);
            assert_eq!(content, "", "pieces of {size}");
            assert_eq!(calls, vec![("f".into(), "{}".into())]);
        }
    }

    /// Issue 46: a reply cut by `max_tokens` inside a call's name came back with no content
    /// and no call.
    #[test]
    fn a_reply_cut_in_a_name_gives_the_partial_call() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wea";
        for cut in [text.to_owned(), format!("{text}ther\n``")] {
            let want = if cut == text {
                "get_wea"
            } else {
                "get_weather"
            };
            for size in [1, 3, 1000] {
                let (content, calls) = streamed(&DEEPSEEK_V3, &cut, size);
                assert_eq!(content, "", "pieces of {size}");
                assert_eq!(calls, vec![(want.into(), String::new())]);
            }
        }
    }

    #[test]
    fn a_reply_cut_before_its_first_name_is_content() {
        let text = "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>func";
        for size in [1, 3, 1000] {
            let (content, calls) = streamed(&DEEPSEEK_V3, text, size);
            assert_eq!(content, text, "pieces of {size}");
            assert!(calls.is_empty());
        }
    }

    #[test]
    fn partial_marker_lengths() {
        assert_eq!(partial_marker_len("abc<", "<x>"), 1);
        assert_eq!(partial_marker_len("abc<x", "<x>"), 2);
        assert_eq!(partial_marker_len("abc", "<x>"), 0);
        assert_eq!(partial_marker_len("x<｜", "<｜tool"), "<｜".len());
    }
}
