//! Which buckets a runner can run a step on now, while the rest are still being compiled.
//!
//! A device capture of the serve defaults is 28 NEFFs; neuronx-cc takes minutes to hours for
//! each. With background compiling ([`super::DeviceOptions::background_compile`]) a capture
//! loads only its first buckets and returns; the others join one by one as their NEFFs are
//! compiled and loaded. [`LiveBuckets`] is the dispatcher over what has joined: like
//! [`Buckets`], the single source of truth for which graph a step runs on, but over a subset.
//!
//! The first buckets are chosen so that every request can run on them alone: the smallest
//! decode batch and the largest prefill chunk (one sequence), both at the longest context
//! ([`LiveBuckets::first`]). Any single sequence, whatever its length, decodes on the first
//! and prefills in chunks on the second; until more join, requests wait in the queue for a
//! slot instead of failing. Rejected: the smallest context first (quicker to compile), because
//! a running sequence that grew past it would have nowhere to decode until a longer context
//! joined, and could not be preempted into waiting without recomputing it.
//!
//! The scheduler asks [`LiveBuckets::max_decode_batch`] (the most sequences it may run at
//! once: a decode batch that size fits at any length) and [`LiveBuckets::prefill_fits`]; the
//! runner asks [`LiveBuckets::decode_bucket`] / [`LiveBuckets::prefill_bucket`], which take the
//! smallest live bucket that holds the step (the one [`Buckets`] would choose when it is live).

use std::collections::BTreeSet;

use crate::deployment::{Buckets, StepKind};
use crate::error::{Error, Result};

use super::step::{DecodeRow, PrefillChunk};

/// The two families of captured graphs, as a bucket's label says them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BucketKind {
    /// One token for each of a batch of sequences.
    Decode,
    /// Prompt chunks of one or more sequences.
    Prefill,
}

impl BucketKind {
    /// The label value (`decode`, `prefill`) in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            BucketKind::Decode => "decode",
            BucketKind::Prefill => "prefill",
        }
    }
}

/// One bucket: the shape of one captured graph (on a device with a split sampler, a decode
/// bucket is its forward graph and its sampling graph, which join together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey {
    /// Decode or prefill.
    pub kind: BucketKind,
    /// Rows: the batch (decode) or the tokens of the step (prefill).
    pub rows: usize,
    /// Sequences: the batch again (decode), or the chunks a prefill step packs.
    pub seqs: usize,
    /// The context length.
    pub ctx: usize,
}

impl std::fmt::Display for BucketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            BucketKind::Decode => write!(f, "decode batch {} ctx {}", self.rows, self.ctx),
            BucketKind::Prefill if self.seqs > 1 => write!(
                f,
                "prefill {} tokens of {} sequences ctx {}",
                self.rows, self.seqs, self.ctx
            ),
            BucketKind::Prefill => write!(f, "prefill {} tokens ctx {}", self.rows, self.ctx),
        }
    }
}

/// The buckets of a capture and which of them can run steps now.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveBuckets {
    all: Buckets,
    /// How many buckets `all` has.
    count: usize,
    live: BTreeSet<BucketKey>,
    /// Buckets whose compile or load failed, with why: they stay absent.
    failed: Vec<(BucketKey, String)>,
}

impl LiveBuckets {
    /// Every bucket of `buckets`, each live: a capture that loaded them all.
    pub fn complete(buckets: &Buckets) -> Self {
        let live: BTreeSet<BucketKey> = Self::keys_of(buckets).into_iter().collect();
        LiveBuckets {
            count: live.len(),
            live,
            all: buckets.clone(),
            failed: Vec::new(),
        }
    }

    /// None of `buckets` live yet.
    pub fn none(buckets: &Buckets) -> Self {
        LiveBuckets {
            all: buckets.clone(),
            count: Self::keys_of(buckets).len(),
            live: BTreeSet::new(),
            failed: Vec::new(),
        }
    }

    /// Every bucket of `buckets` (one per captured graph but the sampling graphs, as many as
    /// [`Buckets::graph_count`]), context by context: decode batches, then prefill chunks.
    pub fn keys_of(buckets: &Buckets) -> Vec<BucketKey> {
        buckets
            .graphs()
            .into_iter()
            .map(|(kind, rows, seqs, ctx)| BucketKey {
                kind: match kind {
                    StepKind::Prefill => BucketKind::Prefill,
                    _ => BucketKind::Decode,
                },
                rows,
                seqs,
                ctx,
            })
            .collect()
    }

    /// The buckets a background capture loads before it returns: the smallest decode batch
    /// and the largest single-sequence prefill chunk, both at the longest context, which
    /// between them run any request (see the module docs).
    pub fn first(buckets: &Buckets) -> [BucketKey; 2] {
        let ctx = buckets.max_len();
        let b = buckets.batch.first().copied().unwrap_or(1);
        [
            BucketKey {
                kind: BucketKind::Decode,
                rows: b,
                seqs: b,
                ctx,
            },
            BucketKey {
                kind: BucketKind::Prefill,
                rows: buckets.prefill_chunk,
                seqs: 1,
                ctx,
            },
        ]
    }

    /// The order a background capture compiles the rest in: the decode batches at the longest
    /// context, smallest first (each raises [`LiveBuckets::max_decode_batch`]: more requests at
    /// once), then every other bucket from the cheapest (rows x context x sequences).
    pub fn background_order(buckets: &Buckets) -> Vec<BucketKey> {
        let first = Self::first(buckets);
        let max_ctx = buckets.max_len();
        let mut rest: Vec<BucketKey> = Self::keys_of(buckets)
            .into_iter()
            .filter(|k| !first.contains(k))
            .collect();
        rest.sort_by_key(|k| {
            let widens = k.kind == BucketKind::Decode && k.ctx == max_ctx;
            (!widens, k.rows * k.ctx * k.seqs, k.ctx, k.kind, k.seqs)
        });
        rest
    }

    /// Every bucket of the capture.
    pub fn buckets(&self) -> &Buckets {
        &self.all
    }

    /// Marks `key` live.
    pub fn join(&mut self, key: BucketKey) {
        self.live.insert(key);
    }

    /// Records that `key` failed to compile or load (it stays absent).
    pub fn fail(&mut self, key: BucketKey, why: String) {
        self.live.remove(&key);
        self.failed.push((key, why));
    }

    /// Whether `key` can run steps.
    pub fn is_live(&self, key: &BucketKey) -> bool {
        self.live.contains(key)
    }

    /// The live buckets.
    pub fn live(&self) -> impl Iterator<Item = &BucketKey> {
        self.live.iter()
    }

    /// The buckets that failed, with why.
    pub fn failed(&self) -> &[(BucketKey, String)] {
        &self.failed
    }

    /// The buckets neither live nor failed: still compiling or loading.
    pub fn pending(&self) -> Vec<BucketKey> {
        Self::keys_of(&self.all)
            .into_iter()
            .filter(|k| !self.live.contains(k) && !self.failed.iter().any(|(f, _)| f == k))
            .collect()
    }

    /// Whether every bucket is live.
    pub fn is_complete(&self) -> bool {
        self.live.len() == self.count
    }

    /// Whether some bucket is still compiling or loading (neither live nor failed).
    pub fn has_pending(&self) -> bool {
        self.live.len() + self.failed.len() < self.count
    }

    /// The most sequences that may run at once: the largest live decode batch at the longest
    /// context (so the batch still fits whatever the sequences grow to); 0 when none is live.
    pub fn max_decode_batch(&self) -> usize {
        let ctx = self.all.max_len();
        self.live
            .iter()
            .filter(|k| k.kind == BucketKind::Decode && k.ctx == ctx)
            .map(|k| k.rows)
            .max()
            .unwrap_or(0)
    }

    /// The most tokens one prefill step of one sequence may take at any position: the
    /// largest live single-or-packed prefill chunk at the longest context (0 when none).
    pub fn max_prefill_tokens(&self) -> usize {
        let ctx = self.all.max_len();
        self.live
            .iter()
            .filter(|k| k.kind == BucketKind::Prefill && k.ctx == ctx)
            .map(|k| k.rows)
            .max()
            .unwrap_or(0)
    }

    /// The live decode bucket (batch, context) a step of `rows` runs on: the one
    /// [`Buckets::decode_bucket`] chooses when it is live, else the cheapest live one that
    /// holds the step.
    pub fn decode_bucket(&self, rows: &[DecodeRow<'_>], vocab: usize) -> Result<(usize, usize)> {
        let (batch, ctx) = self.all.decode_bucket(rows, vocab)?;
        let want = BucketKey {
            kind: BucketKind::Decode,
            rows: batch,
            seqs: batch,
            ctx,
        };
        if self.live.contains(&want) {
            return Ok((batch, ctx));
        }
        let longest = rows.iter().map(|r| r.position + 1).max().unwrap_or(1);
        self.live
            .iter()
            .filter(|k| k.kind == BucketKind::Decode && k.rows >= rows.len() && k.ctx >= longest)
            .min_by_key(|k| (k.rows * k.ctx, k.ctx))
            .map(|k| (k.rows, k.ctx))
            .ok_or_else(|| not_live(&want, rows.len(), longest))
    }

    /// The live prefill bucket (tokens, sequences, context) a step over `chunks` runs on: the
    /// one [`Buckets::prefill_bucket`] chooses when it is live, else the cheapest live one that
    /// holds the step.
    pub fn prefill_bucket(
        &self,
        chunks: &[PrefillChunk<'_>],
        vocab: usize,
    ) -> Result<(usize, usize, usize)> {
        let (t, seqs, ctx) = self.all.prefill_bucket(chunks, vocab)?;
        let want = BucketKey {
            kind: BucketKind::Prefill,
            rows: t,
            seqs,
            ctx,
        };
        if self.live.contains(&want) {
            return Ok((t, seqs, ctx));
        }
        let (tokens, end) = super::buckets::chunk_extent(chunks);
        self.live_prefill(chunks.len(), tokens, end)
            .map(|k| (k.rows, k.seqs, k.ctx))
            .ok_or_else(|| not_live(&want, tokens, end))
    }

    /// Whether some live prefill bucket holds `chunks` chunks of `tokens` tokens in all, the
    /// longest reaching position `end`: [`Buckets::prefill_fits`] over the live buckets.
    pub fn prefill_fits(&self, chunks: usize, tokens: usize, end: usize) -> bool {
        self.all.prefill_fits(chunks, tokens, end)
            && self.live_prefill(chunks, tokens, end).is_some()
    }

    /// The cheapest live prefill bucket holding such a step.
    fn live_prefill(&self, chunks: usize, tokens: usize, end: usize) -> Option<&BucketKey> {
        self.live
            .iter()
            .filter(|k| {
                k.kind == BucketKind::Prefill
                    && k.rows >= tokens
                    && k.ctx >= end
                    && k.seqs >= chunks.max(1)
            })
            .min_by_key(|k| (k.rows * k.ctx * k.seqs, k.ctx, k.seqs))
    }
}

/// The error of a step no live bucket holds (the scheduler keeps such steps from forming).
fn not_live(want: &BucketKey, rows: usize, reach: usize) -> Error {
    Error::InvalidInput(format!(
        "no live bucket holds a step of {rows} rows reaching position {reach} yet ({want} is \
         still compiling)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deployment::RunnerConfig;
    use crate::runner::step::{LogitControls, SamplingParams};

    fn row(position: usize) -> DecodeRow<'static> {
        DecodeRow {
            token: 1,
            position,
            blocks: &[],
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        }
    }

    #[test]
    fn the_first_buckets_run_any_single_sequence() {
        let b = RunnerConfig::for_limits(32, 2048).buckets;
        let mut live = LiveBuckets::none(&b);
        for k in LiveBuckets::first(&b) {
            live.join(k);
        }
        assert_eq!(live.max_decode_batch(), 1);
        assert_eq!(live.max_prefill_tokens(), 64);
        // A short sequence runs on the long context until its own joins.
        assert_eq!(live.decode_bucket(&[row(3)], 10).unwrap(), (1, 2048));
        assert!(live.decode_bucket(&[row(3), row(4)], 10).is_err());
        assert!(live.prefill_fits(1, 10, 10));
        assert!(live.prefill_fits(1, 64, 2000));
        assert!(!live.prefill_fits(2, 20, 30), "packing is not live yet");
        let key = |rows, ctx| BucketKey {
            kind: BucketKind::Decode,
            rows,
            seqs: rows,
            ctx,
        };
        live.join(key(4, 2048));
        assert_eq!(live.max_decode_batch(), 4);
        assert_eq!(
            live.decode_bucket(&[row(3), row(4)], 10).unwrap(),
            (4, 2048)
        );
        live.join(key(1, 128));
        assert_eq!(live.decode_bucket(&[row(3)], 10).unwrap(), (1, 128));
        assert_eq!(live.pending().len(), 28 - 4);
        assert!(!live.is_complete());
    }

    #[test]
    fn prefill_takes_the_cheapest_live_bucket_and_failures_stay_absent() {
        let b = RunnerConfig::for_limits(32, 2048).buckets;
        let mut live = LiveBuckets::none(&b);
        for k in LiveBuckets::first(&b) {
            live.join(k);
        }
        let chunk = |tokens: &'static [u32], start| PrefillChunk {
            tokens,
            start,
            blocks: &[],
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        };
        let one = [chunk(&[1; 10], 0)];
        // Its own bucket (16 tokens, context 128) is not live: the longest context's chunk.
        assert_eq!(live.prefill_bucket(&one, 100).unwrap(), (64, 1, 2048));
        let packed = BucketKey {
            kind: BucketKind::Prefill,
            rows: 16,
            seqs: 8,
            ctx: 128,
        };
        live.join(packed);
        assert_eq!(live.prefill_bucket(&one, 100).unwrap(), (16, 8, 128));
        assert!(live.prefill_fits(3, 15, 100));
        assert!(
            !live.prefill_fits(3, 15, 200),
            "no live packing at context 512"
        );
        let b1 = BucketKey {
            kind: BucketKind::Decode,
            rows: 1,
            seqs: 1,
            ctx: 128,
        };
        let before = live.pending().len();
        live.fail(b1, "compiler said no".into());
        assert_eq!(live.pending().len(), before - 1);
        assert!(!live.is_live(&b1) && live.has_pending() && !live.is_complete());
        assert_eq!(live.decode_bucket(&[row(3)], 10).unwrap(), (1, 2048));
    }

    #[test]
    fn background_order_widens_the_batch_first() {
        let b = RunnerConfig::for_limits(8, 256).buckets;
        let order = LiveBuckets::background_order(&b);
        assert_eq!(order.len(), b.graph_count() - 2);
        let widening: Vec<usize> = order
            .iter()
            .take_while(|k| k.kind == BucketKind::Decode && k.ctx == 256)
            .map(|k| k.rows)
            .collect();
        assert_eq!(widening, [2, 4, 8]);
        assert!(LiveBuckets::complete(&b).is_complete());
    }
}
