//! The sizes a runner captures graphs for, and the dispatcher from a step to its bucket.
//!
//! Like vLLM's `CudagraphDispatcher`, [`Buckets`] is the single source of truth for which
//! (batch, context) and (chunk, context) shapes exist: capture builds exactly these graphs, and
//! replay asks [`Buckets::decode_bucket`] / [`Buckets::prefill_bucket`] which one a step runs
//! on. A step is padded up to the smallest bucket that holds it.

use crate::error::{Error, Result};
use crate::graph::DType;
use crate::model::MoeStrategy;

use super::step::{DecodeRow, PrefillChunk};

/// The smallest prefill graph (see [`Buckets::prefill_sizes`]).
const MIN_PREFILL_BUCKET: usize = 16;

/// The graph shapes a runner captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets {
    /// Decode batch sizes, ascending.
    pub batch: Vec<usize>,
    /// Context lengths, ascending, each a multiple of the cache's block size.
    pub ctx: Vec<usize>,
    /// Tokens per prefill chunk: the largest prefill graph. Shorter chunks run on smaller
    /// graphs (see [`Buckets::prefill_sizes`]).
    pub prefill_chunk: usize,
}

/// A runner's fixed sizes: the cache it allocates once, and the buckets it captures.
#[derive(Debug, Clone, PartialEq)]
pub struct RunnerConfig {
    /// Slots per cache block.
    pub block_size: usize,
    /// Blocks in the cache, the scratch block included.
    pub num_blocks: usize,
    /// The graphs captured at start-up.
    pub buckets: Buckets,
    /// Force one MoE strategy instead of choosing per bucket.
    pub moe: Option<MoeStrategy>,
    /// The KV cache's element type (the precision policy's, see [`crate::model::precision`]).
    pub kv_dtype: DType,
}

impl RunnerConfig {
    /// Buckets for `max_batch` sequences of up to `max_len` tokens: batch 1, 2, 4, 8, then steps
    /// of 8; contexts doubling from 64 up to `max_len`; enough blocks for every sequence at full
    /// length plus scratch.
    pub fn for_limits(max_batch: usize, max_len: usize) -> Self {
        let block_size = 16;
        let max_len = max_len.div_ceil(block_size) * block_size;
        let mut batch: Vec<usize> = [1, 2, 4, 8]
            .into_iter()
            .filter(|&b| b < max_batch)
            .collect();
        let mut b = 8;
        while b < max_batch {
            b += 8;
            if b < max_batch {
                batch.push(b);
            }
        }
        batch.push(max_batch);
        let mut ctx = Vec::new();
        let mut c = 64.min(max_len);
        while c < max_len {
            ctx.push(c);
            c *= 2;
        }
        ctx.push(max_len);
        RunnerConfig {
            block_size,
            num_blocks: max_batch * (max_len / block_size) + 1,
            buckets: Buckets {
                batch,
                ctx,
                prefill_chunk: 64.min(max_len),
            },
            moe: None,
            kv_dtype: DType::F32,
        }
    }
}

impl Buckets {
    /// Checks that there is something to capture and that every context is a whole number of
    /// `block_size` blocks.
    pub fn validate(&self, block_size: usize) -> Result<()> {
        if self.batch.is_empty() || self.ctx.is_empty() || self.prefill_chunk == 0 {
            return Err(Error::InvalidInput(
                "a runner needs at least one batch bucket, one context bucket and a prefill \
                 chunk of at least one token"
                    .into(),
            ));
        }
        if let Some(c) = self
            .ctx
            .iter()
            .find(|&&c| block_size == 0 || c % block_size != 0)
        {
            return Err(Error::InvalidInput(format!(
                "context bucket {c} is not a multiple of the block size {block_size}"
            )));
        }
        Ok(())
    }

    /// The longest sequence any bucket holds.
    pub fn max_len(&self) -> usize {
        self.ctx.last().copied().unwrap_or(0)
    }

    /// The largest decode batch.
    pub fn max_batch(&self) -> usize {
        self.batch.last().copied().unwrap_or(0)
    }

    /// The chunk sizes prefill graphs exist for, ascending: 16, 64, 256, ... below
    /// `prefill_chunk`, then `prefill_chunk`. A short prompt (most chat turns) then runs on a
    /// graph a few times its size instead of one padded to the full chunk: on the CPU a
    /// 16-token chunk costs about 0.6x a 64-token one.
    pub fn prefill_sizes(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut t = MIN_PREFILL_BUCKET;
        while t < self.prefill_chunk {
            out.push(t);
            t *= 4;
        }
        out.push(self.prefill_chunk);
        out
    }

    /// The (chunk size, context) bucket of a prefill chunk, checking its tokens against `vocab`.
    pub fn prefill_bucket(&self, chunk: &PrefillChunk<'_>, vocab: usize) -> Result<(usize, usize)> {
        check_tokens(chunk.tokens.iter().copied(), vocab)?;
        let (n, max) = (chunk.tokens.len(), self.prefill_chunk);
        if n > max {
            return Err(Error::InvalidInput(format!(
                "a prefill chunk of {n} tokens exceeds the chunk size {max}"
            )));
        }
        // The smallest of `prefill_sizes` that holds n, without allocating.
        let mut t = MIN_PREFILL_BUCKET;
        while t < n && t < max {
            t *= 4;
        }
        let t = t.min(max);
        let ctx = smallest_fitting(&self.ctx, chunk.start + n, "context length")?;
        Ok((t, ctx))
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

fn smallest_fitting(buckets: &[usize], need: usize, what: &str) -> Result<usize> {
    buckets.iter().copied().find(|&b| b >= need).ok_or_else(|| {
        Error::InvalidInput(format!(
            "{what} {need} exceeds the largest bucket ({})",
            buckets.last().copied().unwrap_or(0)
        ))
    })
}
