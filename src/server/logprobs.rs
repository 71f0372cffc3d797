//! Log-probabilities in OpenAI's two shapes.
//!
//! Completions use the legacy parallel arrays (`tokens`, `token_logprobs`, `top_logprobs` as
//! token → logprob maps, `text_offset`); chat uses `content`, a list of `{token, logprob, bytes,
//! top_logprobs}`. A token's text is its own decode (special tokens included); a byte-level token
//! that holds only part of a character decodes to U+FFFD, while `bytes` carries the token's own
//! bytes ([`Tokenizer::token_bytes`]), so that a client joining them gets the text back, as
//! OpenAI documents `bytes`.

use serde_json::{json, Map, Value};

use crate::engine::TokenLogprobs;
use crate::tokenizer::Tokenizer;

/// The log-probabilities of a response (or of one streamed chunk), built token by token.
#[derive(Debug)]
pub struct LogprobsBuilder {
    chat: bool,
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
}

/// A token's text and bytes, by the tokenizer (or `token_id:N` without one, as vLLM writes).
/// The bytes are the token's own, also when it holds part of a character (its text is then
/// U+FFFD).
fn token_text(tokenizer: Option<&Tokenizer>, id: u32) -> (String, Vec<u8>) {
    let text = tokenizer
        .and_then(|t| t.decode(&[id], false).ok())
        .unwrap_or_else(|| format!("token_id:{id}"));
    let bytes = tokenizer
        .and_then(|t| t.token_bytes(id))
        .unwrap_or_else(|| text.clone().into_bytes());
    (text, bytes)
}

impl LogprobsBuilder {
    /// An empty builder for a chat (`chat`) or completions response.
    pub fn new(chat: bool) -> Self {
        LogprobsBuilder {
            chat,
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
        }
    }

    /// Adds a token whose text starts at `offset` in the completion text.
    pub fn push(
        &mut self,
        tokenizer: Option<&Tokenizer>,
        token: u32,
        lp: &TokenLogprobs,
        offset: usize,
    ) {
        let (text, bytes) = token_text(tokenizer, token);
        if self.chat {
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|&(t, l)| {
                    let (text, bytes) = token_text(tokenizer, t);
                    json!({"token": text, "logprob": l, "bytes": bytes})
                })
                .collect();
            self.tokens.push(json!({
                "token": text, "logprob": lp.logprob, "bytes": bytes, "top_logprobs": top,
            }));
        } else {
            let mut top = Map::new();
            for &(t, l) in &lp.top {
                top.insert(token_text(tokenizer, t).0, json!(l));
            }
            self.tokens.push(json!(text));
            self.token_logprobs.push(json!(lp.logprob));
            self.top_logprobs.push(Value::Object(top));
            self.text_offset.push(json!(offset));
        }
    }

    /// Adds a prompt token (echoed) whose text starts at `offset`; the first prompt token has no
    /// log-probability (`None`). Returns the length the token adds to the echoed text (none for
    /// a special token such as bos, which the prompt text does not contain).
    pub fn push_prompt(
        &mut self,
        tokenizer: Option<&Tokenizer>,
        token: u32,
        lp: Option<&TokenLogprobs>,
        offset: usize,
    ) -> usize {
        match lp {
            Some(lp) => self.push(tokenizer, token, lp, offset),
            None => {
                let (text, bytes) = token_text(tokenizer, token);
                if self.chat {
                    self.tokens.push(json!({
                        "token": text, "logprob": null, "bytes": bytes, "top_logprobs": [],
                    }));
                } else {
                    self.tokens.push(json!(text));
                    self.token_logprobs.push(Value::Null);
                    self.top_logprobs.push(Value::Null);
                    self.text_offset.push(json!(offset));
                }
            }
        }
        tokenizer
            .and_then(|t| t.decode(&[token], true).ok())
            .map_or(0, |s| s.len())
    }

    /// The `logprobs` field of a choice.
    pub fn finish(self) -> Value {
        if self.chat {
            json!({"content": self.tokens})
        } else {
            json!({
                "tokens": self.tokens,
                "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset,
            })
        }
    }
}
