//! Turning generated tokens into text as they arrive.
//!
//! Decoding one token at a time is wrong in two ways: a multi-byte character split over two
//! byte-level tokens decodes as U+FFFD halves, and decoders that strip a leading space (or merge
//! across tokens) give a different text alone than in context. [`IncrementalDecoder`] decodes a
//! short window ending at the new tokens and emits only what the window adds, holding tokens
//! back while the window ends in an incomplete character (the method of TGI and vLLM).
//!
//! [`StopStrings`] then holds back any tail that could still become a stop string, so a stream
//! never shows text that a later token turns into a stop.

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
            .decode(&self.tokens[range], self.skip_special_tokens)
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
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
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
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
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
        self.pending.push_str(text);
        // The earliest match wins: it is where the text would have stopped first.
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            self.pending.truncate(at);
            return StopCheck {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let hold = self.longest_partial_match();
        let keep = self.pending.split_off(self.pending.len() - hold);
        StopCheck {
            text: std::mem::replace(&mut self.pending, keep),
            stopped: false,
        }
    }

    /// The length of the longest tail of `pending` that is a proper prefix of a stop string.
    fn longest_partial_match(&self) -> usize {
        let p = &self.pending;
        self.stops
            .iter()
            .flat_map(|s| {
                (1..s.len().min(p.len() + 1))
                    .filter(|&n| s.is_char_boundary(n) && p.ends_with(&s[..n]))
                    .max()
            })
            .max()
            .unwrap_or(0)
    }

    /// The text held back, once generation ended for another reason.
    pub fn flush(&mut self) -> String {
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
