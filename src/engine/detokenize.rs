//! Turning generated tokens into text as they arrive.
//!
//! Decoding one token at a time is wrong in two ways: a multi-byte character split over two
//! byte-level tokens decodes as U+FFFD halves, and decoders that strip a leading space (or merge
//! across tokens) give a different text alone than in context. [`IncrementalDecoder`] decodes a
//! short window ending at the new tokens and emits only what the window adds, holding tokens
//! back while the window ends in an incomplete character (the method of TGI and vLLM).
//!
//! [`StopStrings`] then holds back any tail that could still become a stop string, so a stream
//! never shows text that a later token turns into a stop. It matches incrementally, so its
//! cost per token depends on neither the text generated so far nor (beyond a constant) the
//! stop strings' length.

use std::sync::Arc;

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Prompt tokens kept as left context for the first generated tokens.
const PROMPT_CONTEXT: usize = 5;

/// Decodes a growing token sequence into text deltas that never split a character.
#[derive(Debug)]
pub struct IncrementalDecoder {
    tokenizer: Arc<Tokenizer>,
    tokens: Vec<u32>,
    /// Start of the window decoded as context.
    prefix_offset: usize,
    /// Tokens before this one have been emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder for the tokens generated after `prompt`.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt: &[u32], skip_special_tokens: bool) -> Self {
        let tokens = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let n = tokens.len();
        IncrementalDecoder {
            tokenizer,
            tokens,
            prefix_offset: 0,
            read_offset: n,
            skip_special_tokens,
        }
    }

    fn decode(&self, range: std::ops::Range<usize>) -> Result<String> {
        self.tokenizer
            .decode_generated(&self.tokens[range], self.skip_special_tokens)
    }

    /// Adds a token; returns the text it completes (empty while a character is incomplete).
    pub fn push(&mut self, token: u32) -> Result<String> {
        self.tokens.push(token);
        let prefix = self.decode(self.prefix_offset..self.read_offset)?;
        let full = self.decode(self.prefix_offset..self.tokens.len())?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = full.get(prefix.len()..).unwrap_or_default().to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        // Keep the window short: drop tokens no longer needed as context.
        if self.prefix_offset > 64 {
            self.tokens.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        Ok(delta)
    }

    /// The text of tokens still held back (an incomplete character at the end of generation,
    /// decoded as U+FFFD as a full decode would).
    pub fn flush(&mut self) -> Result<String> {
        if self.read_offset == self.tokens.len() {
            return Ok(String::new());
        }
        let prefix = self.decode(self.prefix_offset..self.read_offset)?;
        let full = self.decode(self.prefix_offset..self.tokens.len())?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_owned())
    }
}

/// Finds stop strings in streamed text, holding back what could be the start of one.
///
/// Each stop string is matched incrementally, Knuth-Morris-Pratt over bytes: a push costs
/// amortized constant work per byte of new text and per stop string, however long the text so
/// far or the stop strings are, and only the longest tail of the text that is a proper prefix
/// of some stop string is held back (at most the longest stop string's length minus one byte).
/// The earlier version searched the held text again on every push and tried every prefix of
/// every stop string against its tail: quadratic in a stop string's length, about 4 ms per
/// token with long ones. A byte automaton (a table of 256 transitions per state) would make
/// the worst case of one push constant too, at 256 words per stop-string byte per sequence;
/// KMP's one word per byte was preferred.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<Matcher>,
    /// Text not released yet: the tail that could still become a stop string.
    pending: String,
}

/// One stop string's matcher.
#[derive(Debug, Clone)]
struct Matcher {
    stop: Vec<u8>,
    /// `fallback[i]`: the length of the longest proper prefix of `stop[..=i]` that is also a
    /// suffix of it (KMP's failure function).
    fallback: Vec<usize>,
    /// The length of the longest prefix of `stop` the text so far ends with (less than the
    /// whole: a whole match is reported and the state falls back).
    state: usize,
}

impl Matcher {
    fn new(stop: &str) -> Self {
        let stop = stop.as_bytes().to_vec();
        let mut fallback = vec![0; stop.len()];
        let mut k = 0;
        for i in 1..stop.len() {
            while k > 0 && stop[i] != stop[k] {
                k = fallback[k - 1];
            }
            if stop[i] == stop[k] {
                k += 1;
            }
            fallback[i] = k;
        }
        Matcher {
            stop,
            fallback,
            state: 0,
        }
    }

    /// Takes the next byte of text; true when it completes the stop string.
    fn advance(&mut self, byte: u8) -> bool {
        while self.state > 0 && self.stop[self.state] != byte {
            self.state = self.fallback[self.state - 1];
        }
        if self.stop[self.state] == byte {
            self.state += 1;
        }
        if self.state == self.stop.len() {
            self.state = self.fallback[self.state - 1];
            return true;
        }
        false
    }
}

/// What [`StopStrings::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCheck {
    /// Text that is safe to show.
    pub text: String,
    /// A stop string matched: `text` ends right before it and generation should stop.
    pub stopped: bool,
}

impl StopStrings {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopStrings {
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| Matcher::new(s))
                .collect(),
            pending: String::new(),
        }
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck {
                text: text.to_owned(),
                stopped: false,
            };
        }
        let base = self.pending.len();
        self.pending.push_str(text);
        let longest = self.stops.iter().map(|m| m.stop.len()).max().unwrap_or(0);
        // The earliest start of a match wins: it is where the text would have stopped first.
        // Only matches ending in the new text are possible (an earlier one stopped an earlier
        // push), and none starts before `pending` (what was released could not begin one).
        let mut first: Option<usize> = None;
        for (k, &byte) in text.as_bytes().iter().enumerate() {
            let end = base + k + 1;
            if first.is_some_and(|f| end >= f + longest) {
                // Every match ending here or later starts at or after `first`.
                break;
            }
            for m in &mut self.stops {
                if m.advance(byte) {
                    if let Some(start) = end.checked_sub(m.stop.len()) {
                        first = Some(first.map_or(start, |f| f.min(start)));
                    }
                }
            }
        }
        if let Some(at) = first {
            // A stop string starts with a whole character, so `at` is a boundary; the loop
            // only guards against a bug turning into a panic.
            let mut at = at;
            while !self.pending.is_char_boundary(at) {
                at -= 1;
            }
            self.pending.truncate(at);
            self.reset();
            return StopCheck {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        // Hold back the longest tail that is a prefix of a stop string. The tail starts at a
        // character (its first byte is a stop string's first); the loop is the same guard.
        let hold = self.stops.iter().map(|m| m.state).max().unwrap_or(0);
        let mut cut = self.pending.len().saturating_sub(hold);
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let keep = self.pending.split_off(cut);
        StopCheck {
            text: std::mem::replace(&mut self.pending, keep),
            stopped: false,
        }
    }

    /// Forgets the text so far: matching starts afresh.
    fn reset(&mut self) {
        for m in &mut self.stops {
            m.state = 0;
        }
    }

    /// The text held back, once generation ended for another reason.
    pub fn flush(&mut self) -> String {
        self.reset();
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopStrings::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let c = m.push(p);
            out.push_str(&c.text);
            if c.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_string_split_over_pieces_is_cut() {
        assert_eq!(
            run(&["\n\n"], &["Hi", "\n", "\nthere"]),
            ("Hi".into(), true)
        );
        assert_eq!(run(&["END"], &["abcE", "N", "Dxyz"]), ("abc".into(), true));
    }

    #[test]
    fn partial_matches_are_released_when_they_fail() {
        let stops = vec!["END".to_string()];
        let mut m = StopStrings::new(&stops);
        assert_eq!(m.push("abE").text, "ab");
        assert_eq!(m.push("x").text, "Ex");
        assert_eq!(run(&["END"], &["aEN"]), ("aEN".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
    }

    #[test]
    fn multibyte_stop_prefixes_respect_char_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }
}
