//! A thinking-mode reply split into its reasoning (`reasoning_content`, as vLLM, SGLang and
//! DeepSeek's API return it) and its answer: the prompt opened `<think>`, so the reply is
//! reasoning up to the first `</think>`, then the answer (newlines right after the marker
//! dropped, as DeepSeek's parser drops them). A reply cut before `</think>` is all reasoning.
//!
//! The answer then goes on to the tool-call parser like any reply's content.

use crate::chat_v4::THINK_END;

use super::tools::parser::partial_marker_len;

/// Splits one reply as it streams (see the module docs).
#[derive(Debug, Default)]
pub struct ReasoningSplitter {
    /// `</think>` was seen: the rest is the answer.
    answering: bool,
    /// The answer has begun with something other than a newline.
    answer_begun: bool,
    /// Reasoning held back: it may be the beginning of `</think>`.
    held: String,
}

impl ReasoningSplitter {
    /// Takes the next piece of the reply; returns the reasoning and the answer it releases.
    pub fn push(&mut self, text: &str) -> (String, String) {
        if self.answering {
            return (String::new(), self.answer(text));
        }
        self.held.push_str(text);
        if let Some(at) = self.held.find(THINK_END) {
            let rest = self.held.split_off(at);
            let reasoning = std::mem::take(&mut self.held);
            self.answering = true;
            return (reasoning, self.answer(&rest[THINK_END.len()..]));
        }
        let keep = partial_marker_len(&self.held, THINK_END);
        let rest = self.held.split_off(self.held.len() - keep);
        (std::mem::replace(&mut self.held, rest), String::new())
    }

    /// Ends the reply: what was held back is reasoning.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// A whole reply's reasoning and answer.
    pub fn split(text: &str) -> (String, String) {
        let mut splitter = ReasoningSplitter::default();
        let (mut reasoning, answer) = splitter.push(text);
        reasoning.push_str(&splitter.finish());
        (reasoning, answer)
    }

    fn answer(&mut self, text: &str) -> String {
        if self.answer_begun {
            return text.to_owned();
        }
        let text = text.trim_start_matches('\n');
        self.answer_begun = !text.is_empty();
        text.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(text: &str, size: usize) -> (String, String) {
        let chars: Vec<char> = text.chars().collect();
        let mut s = ReasoningSplitter::default();
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for piece in chars.chunks(size) {
            let (r, a) = s.push(&piece.iter().collect::<String>());
            reasoning.push_str(&r);
            answer.push_str(&a);
        }
        reasoning.push_str(&s.finish());
        (reasoning, answer)
    }

    #[test]
    fn splits_at_the_first_end_of_thinking_in_any_pieces() {
        for size in [1, 2, 3, 100] {
            let want = ("I <think>.".to_owned(), "A\n</think>b".to_owned());
            assert_eq!(streamed("I <think>.</think>\n\nA\n</think>b", size), want);
            assert_eq!(
                streamed("still </thin", size),
                ("still </thin".into(), "".into())
            );
        }
        assert_eq!(ReasoningSplitter::split("</think>"), ("".into(), "".into()));
    }
}
