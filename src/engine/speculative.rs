//! Speculative decoding with the model's own multi-token-prediction layer (see
//! [`crate::model::mtp`]): what the scheduler needs besides its steps.
//!
//! With `--speculative-tokens K` every decoding sequence carries up to `K` drafted tokens, and
//! every decode step verifies them. One [`crate::runner::Step::Verify`] feeds each row's last
//! token and its drafts (`K + 1` positions) and returns a token at every position, equal to
//! the draft after it exactly when the draft is accepted. A greedy row's token is the main
//! model's argmax, so the accepted drafts are exactly the tokens `K = 0` would have produced
//! one step at a time. A sampled row's token comes from rejection sampling
//! ([`crate::model::sampling::verify`]), so each token keeps the target's distribution. The
//! row keeps the drafts up to the first not accepted plus the step's token there
//! (`accepted_prefix`). The cache slots written for rejected drafts are simply not counted
//! (the sequence's `computed` stops before them) and are overwritten by the next step. Each
//! position is penalised, biased and masked as the plain step deciding its token would be: a
//! row under a structured-output constraint gets the grammar's mask after the drafts before
//! each position (`draft_masks`), and a row reporting log-probabilities gets each token's
//! from its own position.
//!
//! After every step that runs the main model (prefill chunks, decode, verify) a draft step
//! runs the MTP layer over the same positions (each with the token after it and the main
//! model's hidden state there), which keeps the layer's own KV cache complete and proposes the
//! next draft from each sequence's last row; `K > 1` chains the layer on its own output,
//! one position further each time, as SGLang and vLLM chain DeepSeek-V3's single layer.
//!
//! Not yet: device backends (the draft and verify graphs run on the CPU runner only).

use super::grammar::{Advance, Constraint, GrammarError};

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

/// The allowed-token masks of a constrained sequence's verify positions (see
/// [`crate::runner::Step::Verify`]): the constraint's mask now, then its mask after each draft
/// in turn, the constraint advanced through the drafts and rolled back after. A draft the mask
/// before it forbids would be rejected for certain, so the drafts stop before it; a draft that
/// ends the document (end-of-sequence when nothing else may follow) is the last fed. Returns
/// how many drafts to feed and their `n + 1` masks of `words` words, one after another.
pub(crate) fn draft_masks(
    constraint: &mut Constraint,
    drafts: &[u32],
    words: usize,
) -> Result<(usize, Vec<u32>), GrammarError> {
    let mut masks = vec![u32::MAX; words];
    constraint.fill_mask(&mut masks);
    let mut advanced = 0;
    let mut fed = 0;
    for &d in drafts {
        let allowed = masks[masks.len() - words..]
            .get(d as usize / 32)
            .is_some_and(|w| w >> (d % 32) & 1 == 1);
        if !allowed {
            break;
        }
        let finished = match constraint.advance(d) {
            Advance::Accepted => false,
            Advance::WasFinished => true,
            // The mask allowed it: the grammar contradicting itself.
            Advance::Refused(message) => return Err(GrammarError::Rejected { token: d, message }),
        };
        advanced += usize::from(!finished);
        fed += 1;
        let start = masks.len();
        masks.resize(start + words, u32::MAX);
        constraint.fill_mask(&mut masks[start..]);
        if finished {
            break;
        }
    }
    constraint.rollback(advanced)?;
    Ok((fed, masks))
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
    use crate::engine::grammar::{GrammarCompiler, ResponseFormat};
    use crate::tokenizer::Tokenizer;

    /// A constraint to a JSON object, over the default model's tokenizer, and that tokenizer.
    fn json_object() -> (Constraint, Tokenizer) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/default-model");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let compiler = GrammarCompiler::new(&tokenizer).unwrap();
        let format = ResponseFormat::from_openai(&serde_json::json!({"type": "json_object"}));
        let constraint = compiler.matcher(&format.unwrap()).unwrap().unwrap();
        (constraint, tokenizer)
    }

    fn allows(mask: &[u32], token: u32) -> bool {
        mask[token as usize / 32] >> (token % 32) & 1 == 1
    }

    #[test]
    fn draft_masks_follow_the_drafts_and_stop_before_a_forbidden_one() {
        let (mut c, tok) = json_object();
        let words = tok.vocab_size().div_ceil(32);
        let ids = |s: &str| tok.encode(s, false).unwrap();
        let mut before = vec![0; words];
        c.fill_mask(&mut before);
        // `{"a":` starts a document; `}` right after it (no value) does not.
        let mut drafts = ids(r#"{"a":"#);
        let n = drafts.len();
        drafts.extend(ids("}"));
        let (fed, masks) = draft_masks(&mut c, &drafts, words).unwrap();
        assert_eq!(fed, n);
        assert_eq!(masks.len(), (n + 1) * words);
        for (j, &d) in drafts[..n].iter().enumerate() {
            assert!(allows(&masks[j * words..(j + 1) * words], d), "draft {j}");
        }
        assert!(!allows(&masks[n * words..], drafts[n]));
        // The constraint is where it was: same mask, and it takes the first draft again.
        let mut after = vec![0; words];
        c.fill_mask(&mut after);
        assert_eq!(after, before);
        assert_eq!(masks[..words], before[..]);
        assert!(matches!(c.advance(drafts[0]), Advance::Accepted));
    }

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
