//! Speculative decoding with the model's own multi-token-prediction layer (see
//! [`crate::model::mtp`]): what the scheduler needs besides its steps.
//!
//! With `--speculative-tokens K` every decoding sequence carries up to `K` drafted tokens. An
//! iteration whose decoding rows have no structured-output constraint and report no
//! log-probabilities verifies them. One [`crate::runner::Step::Verify`] feeds each row's last
//! token and its drafts (`K + 1` positions) and returns a token at every position, equal to
//! the draft after it exactly when the draft is accepted. A greedy row's token is the main
//! model's argmax, so the accepted drafts are exactly the tokens `K = 0` would have produced
//! one step at a time. A sampled row's token comes from rejection sampling
//! ([`crate::model::sampling::verify`]), so each token keeps the target's distribution. The
//! row keeps the drafts up to the first not accepted plus the step's token there
//! (`accepted_prefix`). The cache slots written for rejected drafts are simply not counted
//! (the sequence's `computed` stops before them) and are overwritten by the next step. Other
//! iterations decode one token a row as usual.
//!
//! After every step that runs the main model (prefill chunks, decode, verify) a draft step
//! runs the MTP layer over the same positions (each with the token after it and the main
//! model's hidden state there), which keeps the layer's own KV cache complete and proposes the
//! next draft from each sequence's last row; `K > 1` chains the layer on its own output,
//! one position further each time, as SGLang and vLLM chain DeepSeek-V3's single layer.
//!
//! Not yet: rows with structured output or log-probabilities (they decode one token a step,
//! and an iteration that has any does not verify), and device backends (the draft and verify
//! graphs run on the CPU runner only).

/// How many of `drafts` a verify step accepted: the length of the longest prefix where each
/// draft equals the token `verified` at the position before it (`verified[j]` is the step's
/// token after the row's `j`-th fed token, so it judges `drafts[j]`).
pub(crate) fn accepted_prefix(drafts: &[u32], verified: &[u32]) -> usize {
    drafts
        .iter()
        .zip(verified)
        .take_while(|(d, v)| d == v)
        .count()
}

/// What speculative decoding did so far ([`super::Scheduler::speculative_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculativeStats {
    /// Verify steps run.
    pub verify_steps: u64,
    /// Rows those steps verified (sequences, counted once per step).
    pub verified_rows: u64,
    /// Drafted tokens those rows fed.
    pub drafted: u64,
    /// Drafted tokens the main model agreed with.
    pub accepted: u64,
}

impl SpeculativeStats {
    /// The share of drafted tokens accepted (0 before any was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        match self.drafted {
            0 => 0.0,
            d => self.accepted as f64 / d as f64,
        }
    }

    /// Tokens a verified row produced per verify step: its accepted drafts plus the main
    /// model's own token (1 means speculation gained nothing).
    pub fn tokens_per_row_step(&self) -> f64 {
        match self.verified_rows {
            0 => 0.0,
            r => (self.accepted + r) as f64 / r as f64,
        }
    }
}

/// The rows of one sequence a draft step runs (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct DraftRows {
    /// The sequence's index among the running ones.
    pub seq: usize,
    /// Position of the first row.
    pub start: usize,
    /// Each row's next token.
    pub next_tokens: Vec<u32>,
    /// Each row's row in the previous step's hidden states.
    pub hidden_rows: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accepted_prefix_stops_at_the_first_disagreement() {
        assert_eq!(accepted_prefix(&[], &[7]), 0);
        assert_eq!(accepted_prefix(&[5, 6], &[5, 6, 9]), 2);
        assert_eq!(accepted_prefix(&[5, 6], &[5, 8, 6]), 1);
        assert_eq!(accepted_prefix(&[5, 6], &[4, 6, 6]), 0);
    }

    #[test]
    fn stats_count_the_model_token_of_every_row() {
        let s = SpeculativeStats {
            verify_steps: 2,
            verified_rows: 4,
            drafted: 8,
            accepted: 6,
        };
        assert_eq!(s.acceptance_rate(), 0.75);
        assert_eq!(s.tokens_per_row_step(), 2.5);
        assert_eq!(SpeculativeStats::default().tokens_per_row_step(), 0.0);
    }
}
