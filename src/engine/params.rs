//! What a request asks of the engine, and how it ended.

use crate::runner::step::SamplingParams;

/// Per-request generation settings (OpenAI's plus vLLM's `stop_token_ids` and `ignore_eos`).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationParams {
    /// How each token is drawn (the seed makes sampling reproducible per request, whatever the
    /// batch it runs in).
    pub sampling: SamplingParams,
    /// Generate at most this many tokens (at least 1, or 0 when only the prompt's
    /// log-probabilities are wanted).
    pub max_tokens: usize,
    /// Stop when the text contains any of these; the match is cut from the output.
    pub stop: Vec<String>,
    /// Stop after any of these tokens (counted, not shown).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Report each token's log-probability and this many most likely alternatives (`None`:
    /// no log-probabilities, and no logits leave the device).
    pub logprobs: Option<usize>,
    /// Report the log-probability of every prompt token after the first, with this many
    /// alternatives (what evaluation harnesses score).
    pub prompt_logprobs: Option<usize>,
    /// `(token, bias)` added to the logits before sampling (OpenAI's `logit_bias`, distinct
    /// tokens).
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop tokens cannot be generated before this many tokens (vLLM's
    /// `min_tokens`).
    pub min_tokens: usize,
    /// The choices of one HTTP request share a group; the scheduler admits waiting sequences
    /// from the group with the fewest running first, so a request asking for more choices
    /// than there are free batch slots cannot hold the engine (its extra choices wait while
    /// others' requests run). `None`: a group of its own.
    pub group: Option<u64>,
}

impl GenerationParams {
    /// Whether presence, frequency or repetition penalties apply: they count the tokens a
    /// sequence feeds on the device, so such a sequence computes its whole prompt (no prefix
    /// cache).
    pub fn penalised(&self) -> bool {
        let s = &self.sampling;
        s.presence_penalty != 0.0 || s.frequency_penalty != 0.0 || s.repetition_penalty != 1.0
    }

    /// Greedy decoding of up to `max_tokens` tokens, stopping at end of sequence.
    pub fn greedy(max_tokens: usize) -> Self {
        GenerationParams {
            sampling: SamplingParams::GREEDY,
            max_tokens,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
            group: None,
        }
    }
}

/// Why a sequence stopped, as OpenAI's `finish_reason` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
}

impl FinishReason {
    /// `"stop"` or `"length"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}
