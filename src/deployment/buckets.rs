//! The graph shapes a deployment captures ([`Buckets`]), a runner's fixed sizes
//! ([`RunnerConfig`]) and the graph families ([`StepKind`]).
//!
//! Like vLLM's `CudagraphDispatcher`, [`Buckets`] is the single source of truth for which
//! (batch, context) and (chunk, context) shapes exist: capture builds exactly these graphs, the
//! memory plan (`crate::plan`) counts exactly these before any runner exists, and replay asks
//! the runner's dispatcher ([`Buckets::decode_bucket`] / [`Buckets::prefill_bucket`], in
//! `crate::runner`) which one a step runs on. A step is padded up to the smallest bucket that
//! holds it.

use crate::error::{Error, Result};
use crate::graph::DType;
use crate::model::{LogitsOutput, MoeStrategy, Sampler};

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
    /// The most sequences one prefill step packs together (1: one chunk per step). Where a
    /// context bucket allows fewer, fewer are packed (see [`Buckets::packed_seqs`]).
    pub prefill_seqs: usize,
}

/// The default [`Buckets::prefill_seqs`]: a burst of short prompts enters eight at a time.
/// Each packing width is one more prefill graph per (chunk size, context) bucket it fits, so
/// the set stays at one packed graph per such bucket rather than one per width.
pub const DEFAULT_PREFILL_SEQS: usize = 8;

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
    /// The tensor-parallel degree: ranks (NeuronCores, or threads on the CPU) the model is
    /// split over, each running the same graphs on its own shards (see `model::shard`).
    pub tp: usize,
    /// `--speculative-tokens`: tokens drafted a sequence per decode step with the model's
    /// multi-token-prediction layer (0: off; see [`crate::engine::speculative`]).
    pub speculative_tokens: usize,
}

/// The largest ratio between neighbouring default context buckets (see
/// [`RunnerConfig::for_limits`]).
pub const CTX_BUCKET_RATIO: usize = 4;

/// The smallest default context bucket, unless `max_len` is smaller.
pub const MIN_CTX_BUCKET: usize = 64;

impl RunnerConfig {
    /// Buckets for `max_batch` sequences of up to `max_len` tokens, and enough blocks for every
    /// sequence at full length plus scratch.
    ///
    /// Each bucket is one NEFF per (batch, context) pair on Neuron, compiled at capture (minutes
    /// each), so the sets are small and the padding they cost is bounded:
    ///
    /// - Batch: the powers of two below `max_batch`, then `max_batch` (1, 2, 4, 8, 16, 32 for 32).
    ///   A batch of n runs on a bucket of fewer than 2n rows.
    /// - Context: `max_len`, then each bucket a quarter ([`CTX_BUCKET_RATIO`]) of the one above,
    ///   rounded up to the block size, while that stays at least [`MIN_CTX_BUCKET`] (2048, 512,
    ///   128 for 2048). Neighbouring buckets differ by at most 4x, so a sequence longer than the
    ///   smallest bucket runs on a bucket shorter than 4x its length: fewer than 3/4 of the
    ///   context positions a step gathers are padding. Shorter sequences pad to the smallest
    ///   bucket (128 at the default 2048).
    ///
    /// Why 4x and not 2x: a decode step is memory-bound and reads the weights in full, while the
    /// padding only adds latent-cache rows (576 values per token and layer in MLA), so for
    /// DeepSeek models a 4x context bucket costs a few percent of a step where a 2x set would
    /// double the NEFFs. V2-Lite at batch 32, context 512 instead of 129: 27 layers x 576 x 2 B
    /// x 383 x 32 = 0.38 GB more read against about 31 GB of weights.
    pub fn for_limits(max_batch: usize, max_len: usize) -> Self {
        let block_size = 16;
        let max_len = max_len.div_ceil(block_size) * block_size;
        let mut batch: Vec<usize> = std::iter::successors(Some(1usize), |b| b.checked_mul(2))
            .take_while(|&b| b < max_batch)
            .collect();
        batch.push(max_batch);
        let mut ctx = vec![max_len];
        loop {
            let above = ctx[ctx.len() - 1];
            let next = (above / CTX_BUCKET_RATIO).div_ceil(block_size) * block_size;
            if next < MIN_CTX_BUCKET.max(block_size) || next >= above {
                break;
            }
            ctx.push(next);
        }
        ctx.reverse();
        RunnerConfig {
            block_size,
            num_blocks: max_batch * (max_len / block_size) + 1,
            buckets: Buckets {
                batch,
                ctx,
                prefill_chunk: 64.min(max_len),
                prefill_seqs: DEFAULT_PREFILL_SEQS.min(max_batch).max(1),
            },
            moe: None,
            kv_dtype: DType::F32,
            tp: 1,
            speculative_tokens: 0,
        }
    }
}

impl RunnerConfig {
    /// The cache geometry graphs are built for: the KV blocks, and sampling state for every
    /// sequence that can run at once.
    pub fn cache_layout(&self) -> crate::model::CacheLayout {
        crate::model::CacheLayout::new(
            self.block_size,
            self.num_blocks,
            self.kv_dtype,
            self.buckets.max_batch(),
        )
    }
}

impl Buckets {
    /// Checks that there is something to capture and that every context is a whole number of
    /// `block_size` blocks.
    pub fn validate(&self, block_size: usize) -> Result<()> {
        if self.batch.is_empty()
            || self.ctx.is_empty()
            || self.prefill_chunk == 0
            || self.prefill_seqs == 0
        {
            return Err(Error::InvalidInput(
                "a runner needs at least one batch bucket, one context bucket, a prefill \
                 chunk of at least one token and at least one sequence per prefill"
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

    /// How many graphs a capture of these buckets builds (and, on Neuron, compiles into
    /// NEFFs): one decode graph per (batch, context), one prefill graph per (chunk size,
    /// context), and one packed prefill graph per (chunk size, context) that packs.
    pub fn graph_count(&self) -> usize {
        self.graphs().len()
    }

    /// The graph of every bucket a device capture of a model of `cfg` builds for a rank of
    /// `tp`, in [`Buckets::graphs`]'s order: decode with the sampled logits as an output,
    /// prefill with every position's, each with the MoE strategy a device takes
    /// ([`MoeStrategy::for_tokens`]); with `split_sampler`, each decode bucket's forward pass
    /// (`Sampler::Deferred`) followed by the sampling graphs, one per decode bucket (the same
    /// NEFF for every context of a batch size: callers keep one per name). Then each decode
    /// bucket's greedy variant ([`StepKind::Greedy`] or, split, [`StepKind::Argmax`]), which
    /// callers keep only where [`keep_paying_greedy`] says it pays. A model loaded with its MTP
    /// layer (`cfg.draft_layers > 0`, speculative decoding) adds each prefill bucket's draft
    /// graph and each decode bucket's verify and draft graphs last. The device runner, the
    /// memory plan and `lower --check neuron` all build this list, so what is planned and
    /// checked is what is captured.
    pub(crate) fn capture_specs(
        &self,
        cfg: &crate::config::ModelConfig,
        tp: usize,
        split_sampler: bool,
    ) -> Vec<(StepKind, crate::model::GraphSpec)> {
        use crate::model::{GraphSpec, Sampler};
        let moe = |rows: usize| MoeStrategy::for_model(cfg, rows, tp);
        let mut out: Vec<(StepKind, GraphSpec)> = self
            .graphs()
            .into_iter()
            .map(|(kind, rows, seqs, ctx)| {
                let spec = GraphSpec {
                    rows,
                    seqs,
                    ctx,
                    logits: kind.device_logits(),
                    moe: moe(rows),
                    sampler: match kind == StepKind::Decode && split_sampler {
                        true => Sampler::Deferred,
                        false => Sampler::Full,
                    },
                };
                (kind, spec)
            })
            .collect();
        let decode: Vec<GraphSpec> = out
            .iter()
            .filter(|(kind, _)| *kind == StepKind::Decode)
            .map(|(_, spec)| *spec)
            .collect();
        let variant = |kind: StepKind, sampler| {
            decode.iter().map(move |spec| {
                let logits = kind.device_logits();
                (
                    kind,
                    GraphSpec {
                        logits,
                        sampler,
                        ..*spec
                    },
                )
            })
        };
        // A drafting model's speculative graphs: each decode bucket's verify graph for sampled
        // rows and its draft graph, and each prefill bucket's draft graph.
        let drafts: Vec<(StepKind, GraphSpec)> = match cfg.draft_layers {
            0 => Vec::new(),
            _ => out
                .iter()
                .filter(|(kind, _)| *kind == StepKind::Prefill)
                .map(|(_, spec)| (StepKind::Draft, *spec))
                .chain(variant(StepKind::Verify, Sampler::Rejection))
                .chain(variant(StepKind::DecodeDraft, Sampler::Full))
                .map(|(kind, spec)| {
                    let logits = kind.device_logits();
                    (kind, GraphSpec { logits, ..spec })
                })
                .collect(),
        };
        if split_sampler {
            out.extend(variant(StepKind::Sample, Sampler::Full));
            out.extend(variant(StepKind::Argmax, Sampler::Greedy));
        } else {
            out.extend(variant(StepKind::Greedy, Sampler::Greedy));
        }
        out.extend(drafts);
        out
    }

    /// Every graph of [`Buckets::graph_count`] as (kind, rows, sequences, context), context by
    /// context (decode's sequences are its rows).
    pub(crate) fn graphs(&self) -> Vec<(StepKind, usize, usize, usize)> {
        let mut out = Vec::new();
        for &ctx in &self.ctx {
            out.extend(self.batch.iter().map(|&b| (StepKind::Decode, b, b, ctx)));
            for t in self.prefill_sizes() {
                out.push((StepKind::Prefill, t, 1, ctx));
                let s = self.packed_seqs(t, ctx);
                if s > 1 {
                    out.push((StepKind::Prefill, t, s, ctx));
                }
            }
        }
        out
    }

    /// How many sequences the packed prefill graph of `t` tokens at context `ctx` carries (1:
    /// that bucket does not pack): [`Buckets::prefill_seqs`], but no more than `t` (each
    /// sequence brings a token) and no more than `max_len / ctx`. The last bound keeps a packed
    /// step's attention (every token against `seqs * ctx` context positions) within that of one
    /// prefill at the longest context: short contexts pack widely, the longest not at all.
    pub fn packed_seqs(&self, t: usize, ctx: usize) -> usize {
        self.prefill_seqs
            .min(t)
            .min(self.max_len() / ctx.max(1))
            .max(1)
    }

    /// Whether some prefill bucket holds `chunks` chunks of `tokens` tokens in all, the longest
    /// reaching position `end` (exclusive): what a scheduler packing a step asks before adding
    /// a chunk.
    pub fn prefill_fits(&self, chunks: usize, tokens: usize, end: usize) -> bool {
        self.prefill_shape(chunks, tokens, end).is_ok()
    }

    /// The (tokens, sequences, context) bucket of `chunks` chunks of `tokens` tokens in all
    /// reaching position `end`.
    pub(crate) fn prefill_shape(
        &self,
        chunks: usize,
        tokens: usize,
        end: usize,
    ) -> Result<(usize, usize, usize)> {
        let max = self.prefill_chunk;
        if tokens > max {
            return Err(Error::InvalidInput(format!(
                "a prefill of {tokens} tokens exceeds the chunk size {max}"
            )));
        }
        // The smallest of `prefill_sizes` that holds the tokens, without allocating.
        let mut t = MIN_PREFILL_BUCKET;
        while t < tokens && t < max {
            t *= 4;
        }
        let t = t.min(max);
        let ctx = smallest_fitting(&self.ctx, end, "context length")?;
        let seqs = match chunks {
            0 | 1 => 1,
            n => {
                let s = self.packed_seqs(t, ctx);
                if n > s {
                    return Err(Error::InvalidInput(format!(
                        "{n} chunks exceed the {s} sequences a prefill of {t} tokens at context \
                         {ctx} packs"
                    )));
                }
                s
            }
        };
        Ok((t, seqs, ctx))
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
}

/// The smallest of `buckets` (ascending) that holds `need`, or an error naming `what`.
pub(crate) fn smallest_fitting(buckets: &[usize], need: usize, what: &str) -> Result<usize> {
    buckets.iter().copied().find(|&b| b >= need).ok_or_else(|| {
        Error::InvalidInput(format!(
            "{what} {need} exceeds the largest bucket ({})",
            buckets.last().copied().unwrap_or(0)
        ))
    })
}

/// The graph families; with a bucket's sizes (rows, sequences, context), the key of a
/// captured graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum StepKind {
    Decode,
    Prefill,
    /// The sampling graph of a split decode step (device runners with
    /// [`crate::runner::DeviceOptions::split_sampler`]), which samples from the logits its `Decode` graph
    /// left on the device.
    Sample,
    /// A decode bucket's graph for steps whose rows are all greedy with no logit controls
    /// (`Sampler::Greedy`: a plain argmax in place of the sampler), captured beside its
    /// `Decode` graph where that pays ([`keep_paying_greedy`]).
    Greedy,
    /// [`StepKind::Greedy`] of a split decode step: an argmax of the logits its `Decode` graph
    /// left, in place of its `Sample` graph.
    Argmax,
    /// The MTP layer's draft graph ([`crate::model::mtp::build_draft`]): prefill-shaped, a
    /// prefill bucket's (what drafts over a prefilled chunk's positions).
    Draft,
    /// A decode bucket's verify graph for sampled rows ([`crate::model::Sampler::Rejection`]
    /// at the end of [`crate::model::build_decode`]): every row one position of a sequence's
    /// last token and drafts. Greedy rows verify on the bucket's `Decode` or `Greedy` graph,
    /// whose argmax per row is already what verifying needs.
    Verify,
    /// A decode bucket's draft graph ([`crate::model::mtp::build_decode_draft`]): the MTP
    /// layer over the positions a verify step kept, and each chained draft.
    DecodeDraft,
}

impl StepKind {
    /// The logits a device graph of this kind returns (and so binds an output buffer for):
    /// decode the sampled rows', prefill every position's, so one captured graph serves
    /// every request. The cost model counts these outputs too.
    pub(crate) fn device_logits(self) -> LogitsOutput {
        match self {
            StepKind::Decode | StepKind::Greedy | StepKind::Verify => LogitsOutput::Sampled,
            StepKind::Prefill => LogitsOutput::AllPositions,
            // They read their forward graph's logits, which stay where they are; drafts are
            // proposals, whose logits nobody reads.
            StepKind::Sample | StepKind::Argmax | StepKind::Draft | StepKind::DecodeDraft => {
                LogitsOutput::None
            }
        }
    }

    /// Whether a graph of this kind belongs to a decode bucket (and reads its buffers).
    pub(crate) fn is_decode(self) -> bool {
        !matches!(self, StepKind::Prefill | StepKind::Draft)
    }

    /// Whether this is a decode bucket's greedy variant ([`StepKind::Greedy`],
    /// [`StepKind::Argmax`]): an optional graph that replay takes when it is loaded.
    pub(crate) fn is_greedy(self) -> bool {
        matches!(self, StepKind::Greedy | StepKind::Argmax)
    }

    /// Builds this kind's graph of `spec` (a capture's, the plan's or the Neuron check's).
    pub(crate) fn build(
        self,
        cfg: &crate::config::ModelConfig,
        specs: &crate::model::WeightSpecs,
        layout: &crate::model::CacheLayout,
        spec: &crate::model::GraphSpec,
    ) -> Result<crate::graph::Graph> {
        use crate::model;
        // A split step's sampling graphs read only the carried logits, the same for V4.
        if let (StepKind::Decode | StepKind::Greedy | StepKind::Prefill, Some(v4)) = (self, &cfg.v4)
        {
            return self.build_v4(v4, specs, layout, spec);
        }
        match self {
            StepKind::Decode | StepKind::Greedy => model::build_decode(cfg, specs, layout, spec),
            StepKind::Prefill => model::build_prefill(cfg, specs, layout, spec),
            StepKind::Sample => model::build_sample(cfg, specs, layout, spec.rows),
            StepKind::Argmax => model::build_argmax(cfg, specs, spec.rows),
            StepKind::Draft => model::mtp::build_draft(cfg, specs, layout, spec),
            StepKind::Verify => model::build_decode(cfg, specs, layout, spec),
            StepKind::DecodeDraft => model::mtp::build_decode_draft(cfg, specs, layout, spec),
        }
    }
}

impl StepKind {
    /// [`StepKind::build`]'s step graphs for a DeepSeek-V4 model of `specs`' ranks and dots
    /// ([`crate::model::v4::step`]).
    fn build_v4(
        self,
        cfg: &crate::config::v4::V4Config,
        specs: &crate::model::WeightSpecs,
        layout: &crate::model::CacheLayout,
        spec: &crate::model::GraphSpec,
    ) -> Result<crate::graph::Graph> {
        use crate::model::v4::step::{build_step, V4Step};
        let decode = self.is_decode();
        let step = V4Step {
            rows: spec.rows,
            seqs: if decode { spec.rows } else { spec.seqs.max(1) },
            ctx: spec.ctx,
            decode,
            ranks: specs.ranks(),
            logits: spec.logits,
            sampler: if decode { spec.sampler } else { Sampler::Full },
            moe: spec.moe,
            weights: specs.precision().weights,
            dots: specs.precision().dots,
        };
        build_step(cfg, layout, &step)
    }
}

/// The least share of a fused decode graph's instructions its sampler must take for the
/// bucket's [`StepKind::Greedy`] graph to be captured: below it, what greedy steps would save
/// is not worth a second NEFF of the whole model per bucket (neuronx-cc's time, and the
/// NEFF's device memory). At serve's defaults the share is 1.3-4.4% for V2-Lite at tp 1 and V2
/// at tp 32 at small batches and 8-32% at tp 2 from batch 8 (benches/README.md, "The
/// sampler's share").
pub(crate) const GREEDY_GRAPH_MIN_SHARE: f64 = 0.10;

/// Whether a [`StepKind::Greedy`] graph of `greedy` instructions is worth capturing beside its
/// bucket's `Decode` graph of `full` (see [`GREEDY_GRAPH_MIN_SHARE`]).
pub(crate) fn greedy_graph_pays(full: u64, greedy: u64) -> bool {
    full > 0 && full.saturating_sub(greedy) as f64 >= GREEDY_GRAPH_MIN_SHARE * full as f64
}

/// Keeps of a capture's graphs (`graphs`, [`Buckets::capture_specs`]' list, each with what the
/// caller built of it) the greedy variants that pay, and drops the others:
///
/// - an [`StepKind::Argmax`] graph always (it is a few vocabulary-wide ops, compiled in
///   moments, and it spares a greedy step the whole sampling graph);
/// - a [`StepKind::Greedy`] graph when the instructions it saves against its bucket's `Decode`
///   graph (`instructions` of each) are at least [`GREEDY_GRAPH_MIN_SHARE`] of that graph's.
///
/// One rule for the capture, the plan and the Neuron check, so each counts the same NEFFs.
pub(crate) fn keep_paying_greedy<G>(
    graphs: &mut Vec<(StepKind, crate::model::GraphSpec, G)>,
    instructions: impl Fn(&G) -> Result<u64>,
) -> Result<()> {
    let mut keep = Vec::with_capacity(graphs.len());
    for (kind, spec, g) in graphs.iter() {
        let pays = match kind {
            StepKind::Greedy => {
                let full = graphs
                    .iter()
                    .find(|(k, s, _)| {
                        *k == StepKind::Decode && s.rows == spec.rows && s.ctx == spec.ctx
                    })
                    .ok_or_else(|| {
                        Error::Internal(format!(
                            "a greedy graph of {} rows at context {} without its decode graph",
                            spec.rows, spec.ctx
                        ))
                    })?;
                greedy_graph_pays(instructions(&full.2)?, instructions(g)?)
            }
            _ => true,
        };
        keep.push(pays);
    }
    let mut pays = keep.into_iter();
    graphs.retain(|_| pays.next().unwrap_or(true));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_defaults_capture_six_batches_and_three_contexts() {
        let rc = RunnerConfig::for_limits(32, 2048);
        assert_eq!(rc.buckets.batch, [1, 2, 4, 8, 16, 32]);
        assert_eq!(rc.buckets.ctx, [128, 512, 2048]);
        assert_eq!(rc.buckets.prefill_sizes(), [16, 64]);
        // 54 before this rule (7 batch x 6 context decode graphs + 2 x 6 prefill); then 24,
        // plus a packed prefill per chunk size at contexts 128 (8 sequences) and 512 (4).
        assert_eq!(rc.buckets.graph_count(), 28);
        assert_eq!(rc.buckets.packed_seqs(64, 128), 8);
        assert_eq!(rc.buckets.packed_seqs(16, 512), 4);
        assert_eq!(rc.buckets.packed_seqs(64, 2048), 1);
    }

    #[test]
    fn batch_buckets_are_powers_of_two_then_the_limit() {
        let batch = |n| RunnerConfig::for_limits(n, 64).buckets.batch;
        assert_eq!(batch(1), [1]);
        assert_eq!(batch(2), [1, 2]);
        assert_eq!(batch(24), [1, 2, 4, 8, 16, 24]);
        assert_eq!(batch(64), [1, 2, 4, 8, 16, 32, 64]);
    }

    /// The documented bound, over every length up to several limits: a sequence longer than
    /// the smallest bucket runs on a bucket shorter than 4x its length; every bucket is a
    /// multiple of the block size; the largest is the limit; the smallest is at least 64
    /// unless the limit is smaller.
    #[test]
    fn context_padding_is_bounded_by_the_ratio() {
        for max_len in [16, 40, 64, 100, 128, 256, 1000, 2048, 4096, 5000, 163_840] {
            let rc = RunnerConfig::for_limits(1, max_len);
            let ctx = &rc.buckets.ctx;
            rc.buckets.validate(rc.block_size).unwrap();
            assert_eq!(
                ctx.last().copied(),
                Some(max_len.div_ceil(16) * 16),
                "{ctx:?}"
            );
            assert!(ctx.windows(2).all(|w| w[0] < w[1]), "{ctx:?}");
            assert!(ctx[0] >= MIN_CTX_BUCKET.min(ctx[ctx.len() - 1]), "{ctx:?}");
            for len in 1..=rc.buckets.max_len() {
                let bucket = smallest_fitting(ctx, len, "context length").unwrap();
                if len > ctx[0] {
                    assert!(
                        bucket < CTX_BUCKET_RATIO * len,
                        "max_len {max_len}: {len} tokens run on {bucket} ({ctx:?})"
                    );
                }
            }
        }
    }

    /// A greedy graph is kept where it saves at least 10% of its decode graph's instructions
    /// and dropped where it saves less (or its decode graph is unknown); every other graph is
    /// kept.
    #[test]
    fn greedy_graphs_are_kept_where_the_sampler_is_a_tenth_of_the_decode_graph() {
        use crate::model::{GraphSpec, MoeStrategy, Sampler};
        let spec = |rows, ctx| GraphSpec {
            rows,
            seqs: rows,
            ctx,
            logits: LogitsOutput::Sampled,
            moe: MoeStrategy::Dense,
            sampler: Sampler::Full,
        };
        let mut graphs = vec![
            (StepKind::Decode, spec(1, 64), 1000u64),
            (StepKind::Decode, spec(8, 64), 1000),
            (StepKind::Prefill, spec(16, 64), 5),
            (StepKind::Greedy, spec(1, 64), 901),
            (StepKind::Greedy, spec(8, 64), 900),
            (StepKind::Argmax, spec(1, 64), 999),
        ];
        keep_paying_greedy(&mut graphs, |&n| Ok(n)).unwrap();
        let kept: Vec<(StepKind, usize)> = graphs.iter().map(|(k, s, _)| (*k, s.rows)).collect();
        assert_eq!(
            kept,
            [
                (StepKind::Decode, 1),
                (StepKind::Decode, 8),
                (StepKind::Prefill, 16),
                (StepKind::Greedy, 8),
                (StepKind::Argmax, 1),
            ]
        );
        let mut orphan = vec![(StepKind::Greedy, spec(2, 64), 1u64)];
        assert!(keep_paying_greedy(&mut orphan, |&n| Ok(n)).is_err());
        assert!(!greedy_graph_pays(0, 0));
    }
}
