//! The dispatcher from a step to its bucket: which of the captured [`Buckets`] (the shapes, in
//! [`crate::deployment`]) a decode or prefill step runs on. A step is padded up to the smallest
//! bucket that holds it.

use crate::deployment::{smallest_fitting, Buckets};
use crate::error::{Error, Result};

use super::step::{DecodeRow, PrefillChunk};

impl Buckets {
    /// The (tokens, sequences, context) bucket of a prefill step over `chunks` (each of a
    /// different sequence), checking their tokens against `vocab`.
    pub fn prefill_bucket(
        &self,
        chunks: &[PrefillChunk<'_>],
        vocab: usize,
    ) -> Result<(usize, usize, usize)> {
        if chunks.is_empty() {
            return Err(Error::Internal("a prefill step with no chunk".into()));
        }
        check_tokens(chunks.iter().flat_map(|c| c.tokens.iter().copied()), vocab)?;
        let (tokens, end) = chunk_extent(chunks);
        self.prefill_shape(chunks.len(), tokens, end)
    }

    /// The (batch, context) bucket of a decode step, checking its tokens against `vocab`.
    pub fn decode_bucket(&self, rows: &[DecodeRow<'_>], vocab: usize) -> Result<(usize, usize)> {
        check_tokens(rows.iter().map(|r| r.token), vocab)?;
        let batch = smallest_fitting(&self.batch, rows.len(), "batch size")?;
        let longest = rows.iter().map(|r| r.position + 1).max().unwrap_or(1);
        let ctx = smallest_fitting(&self.ctx, longest, "context length")?;
        Ok((batch, ctx))
    }
}

fn check_tokens(tokens: impl IntoIterator<Item = u32>, vocab: usize) -> Result<()> {
    for t in tokens {
        if t as usize >= vocab {
            return Err(Error::InvalidInput(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
    }
    Ok(())
}

/// A prefill step's tokens in all and the furthest position one of its chunks reaches (1 for
/// none): what picks its bucket.
pub(crate) fn chunk_extent(chunks: &[PrefillChunk<'_>]) -> (usize, usize) {
    let tokens = chunks.iter().map(|c| c.tokens.len()).sum();
    let end = chunks
        .iter()
        .map(|c| c.start + c.tokens.len())
        .max()
        .unwrap_or(1);
    (tokens, end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deployment::RunnerConfig;

    #[test]
    fn packed_prefill_buckets_bound_sequences_by_tokens_and_context() {
        let b = RunnerConfig::for_limits(32, 2048).buckets;
        let chunk = |tokens: &'static [u32], start| PrefillChunk {
            tokens,
            start,
            blocks: &[],
            sampling: super::super::step::SamplingParams::GREEDY,
            controls: crate::runner::step::LogitControls::NONE,
        };
        let one = [chunk(&[1; 10], 0)];
        assert_eq!(b.prefill_bucket(&one, 100).unwrap(), (16, 1, 128));
        let three = [chunk(&[1; 10], 0), chunk(&[2; 10], 100), chunk(&[3; 5], 0)];
        assert_eq!(b.prefill_bucket(&three, 100).unwrap(), (64, 8, 128));
        // Context 512 packs 4, 2048 none.
        let far = [chunk(&[1; 4], 400), chunk(&[2; 4], 0)];
        assert_eq!(b.prefill_bucket(&far, 100).unwrap(), (16, 4, 512));
        let farther = [chunk(&[1; 4], 1000), chunk(&[2; 4], 0)];
        assert!(b.prefill_bucket(&farther, 100).is_err());
        assert!(!b.prefill_fits(2, 8, 1004));
        assert!(b.prefill_fits(1, 8, 1004));
        assert!(
            !b.prefill_fits(9, 60, 100),
            "more chunks than the widest packing"
        );
        assert!(
            !b.prefill_fits(1, 65, 100),
            "more tokens than the largest chunk"
        );
    }
}
