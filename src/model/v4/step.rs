//! DeepSeek-V4's step graph over typed cache roots: a chunked, packed prefill or a decode step,
//! with MLA's step contract (`input_ids`, `positions`, `slot_mapping`, `block_tables`,
//! `state_rows`; `last_index` and, packed, `seq_ids` for a prefill). Every state a later step
//! needs lives in a root, so any split of a prompt into chunks computes what one forward over
//! the whole sequence computes ([`super::forward`]); `docs/deepseek-v4.md` has the design.
//!
//! | root | rows | per row, for each layer that has it |
//! |---|---|---|
//! | [`SWA_RING`] | `sliding_window` per sequence state row | a position's shared K=V (`head_dim`), every layer (the MTP layer's too, when in use) |
//! | [`CSA_RING`] / [`HCA_RING`] | `2 x rate` (CSA) or `rate` (HCA) per sequence state row | a position's compressor value and gate (`ape` added), CSA's indexer's too |
//! | [`CSA_ROOT`] / [`HCA_ROOT`] | entry rows, one per `min(rate, block)` token slots, plus a dump row | a window's pooled entry (`head_dim`) and, CSA, its index key |
//!
//! **Rings.** What a token reads of its sequence's recent positions (the window's keys, a
//! window's compressor inputs) is per sequence and bounded, so it lives in rings indexed by the
//! sequence's state row (the row the scheduler gives every running sequence, row 0 being
//! scratch): position `q` at ring row `state x len + q % len`. A position fed in this step is
//! read from the step's own values (a chunk may be longer than a ring), an earlier one from
//! the ring as the step found it; each chunk then writes its last `len` positions (the others,
//! and padding, write the scratch row's). A ring holds exactly the positions a later read can
//! reach, so the cache a token costs is its compressed entries alone.
//!
//! **Entries.** Window `w` of a sequence (positions `[w m, (w + 1) m)`, `m` the layer's rate)
//! is pooled by the step that feeds its last token, and goes to the entry row `slot / min(m,
//! block)` of that token's slot: one row per window, in the blocks the sequence owns (the rate
//! and the block size must divide one another). Every token pools the latest window (the graph
//! is the same every step); a token that completes none writes its pool to the dump row, the
//! root's last, which nothing reads. A query at position `p` sees the entries `w < (p + 1) /
//! m` of its sequence (HCA: all; CSA: those the lightning indexer picks): a decode row gathers
//! its own sequence's `ctx / m` entries, a packed prefill scores its tokens against every
//! chunk's entries side by side and masks the other sequences', as MLA's prefill does.
//!
//! Outputs: the sampled `next_tokens` (each decode row's, each prefill chunk's), the
//! [`LogitsOutput`] the step asks for (every fed token's: `[n, vocab]`; under tensor
//! parallelism a rank's vocabulary rows' columns, [`super::shard`]), and the updated roots under
//! their input names, aliased; every rank's roots hold the same values. The sampler is MLA's
//! (`model::decode_tail`, `model::prefill_tail`) over the sampling-state root
//! every model keeps. Weights are f32 inputs by published name, as in [`super::forward`].

use crate::config::v4::{V4Attention, V4Config};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Literal, Tensor};
use crate::model::mtp::{DRAFT_HIDDEN, HIDDEN};
use crate::model::ops::{div_const, mul_const};
use crate::model::{
    decode_tail, inputs, prefill_tail, sampling_root, slots_at, step_outputs, CacheLayout, Dots,
    LogitsOutput, MoeStrategy, RootSpec, Sampler, STEP_LOGITS,
};

use super::attention::{self as attn, and, Keys};
use super::weights::{Rope, Weights};

/// Every layer's window of shared K=V, per sequence.
pub const SWA_RING: &str = "swa_ring";
/// The CSA layers' compressor (and indexer compressor) inputs, per sequence.
pub const CSA_RING: &str = "csa_ring";
/// The HCA layers' compressor inputs, per sequence.
pub const HCA_RING: &str = "hca_ring";
/// The CSA layers' pooled entries and index keys, paged.
pub const CSA_ROOT: &str = "csa_entries";
/// The HCA layers' pooled entries, paged.
pub const HCA_ROOT: &str = "hca_entries";

/// One step graph's static sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct V4Step {
    /// Fed tokens (decode: one per sequence).
    pub rows: usize,
    /// Sequences whose block tables the step carries (decode: `rows`).
    pub seqs: usize,
    /// Context positions a sequence may reach (a multiple of the block size).
    pub ctx: usize,
    /// A decode step: row `i` is sequence `i`'s next token, and reads its own entries only.
    pub decode: bool,
    /// Tensor-parallel ranks (1: unsplit), see [`super::shard`].
    pub ranks: usize,
    /// Which logits the graph returns besides the sampled tokens.
    pub logits: LogitsOutput,
    /// What picks a decode step's next tokens (a prefill always samples in full).
    pub sampler: Sampler,
    /// How the routed experts are evaluated.
    pub moe: MoeStrategy,
    /// The dtype the matrices are held in (f32 or bf16; the other weights are f32, see
    /// [`super::tensors::V4TensorKind`]).
    pub weights: DType,
    /// How bf16 matrices and FP4 experts multiply: [`Dots::Widen`] (widened, FP4 dequantized,
    /// to f32: the CPU's), or a device's [`Dots::Split`] (the f32 activations split in two
    /// bf16 parts against the bf16 weights, FP4 dequantized to bf16, which is exact for E2M1
    /// times a power of two, multiplied at the matmul units' bf16 rate into f32).
    pub dots: Dots,
}

/// Where one layer keeps its cache: its first column in each root it uses.
#[derive(Debug, Clone, Copy)]
struct LayerCache {
    /// Its K=V in [`SWA_RING`] (`head_dim` wide).
    swa: usize,
    /// Compressed layers: its compressor inputs in its rate's ring.
    source: usize,
    /// Compressed layers: its entries in its rate's entry root.
    entries: usize,
}

/// Columns of a compressed layer's compressor inputs: value and gate, each `series x width`,
/// for its compressor (`head_dim`) and, CSA, its indexer's (`index_head_dim`).
fn source_width(cfg: &V4Config, kind: V4Attention) -> usize {
    let index = cfg.indexer.map(|ix| ix.head_dim).unwrap_or_default();
    match kind {
        V4Attention::Sliding => 0,
        V4Attention::HeavilyCompressed => 2 * cfg.head_dim,
        V4Attention::CompressedSparse => 4 * (cfg.head_dim + index),
    }
}

/// Columns of a compressed layer's entry: the pooled K=V and, CSA, the index key.
fn entry_width(cfg: &V4Config, kind: V4Attention) -> usize {
    match kind {
        V4Attention::Sliding => 0,
        V4Attention::HeavilyCompressed => cfg.head_dim,
        V4Attention::CompressedSparse => {
            cfg.head_dim + cfg.indexer.map(|ix| ix.head_dim).unwrap_or_default()
        }
    }
}

/// The rate of a compressed layer kind, and how many positions its compressor reads: the
/// window (HCA), or the window and the one before it (CSA).
fn rate_and_span(cfg: &V4Config, kind: V4Attention) -> (usize, usize) {
    match kind {
        V4Attention::CompressedSparse => (cfg.csa_rate, 2 * cfg.csa_rate),
        _ => (cfg.hca_rate, cfg.hca_rate),
    }
}

/// Slots per entry row: a window's last slot, divided by this, is its entry row.
fn entry_stride(rate: usize, block: usize) -> Result<usize> {
    let (lo, hi) = (rate.min(block), rate.max(block));
    if lo == 0 || !hi.is_multiple_of(lo) {
        return Err(Error::shape(
            "cache",
            format!(
                "a compress rate of {rate} and a block of {block} tokens: one must divide the \
                 other for a window's entry to have a row of its own"
            ),
        ));
    }
    Ok(lo)
}

/// Every layer's columns, and the roots' specs.
struct Layout {
    layers: Vec<LayerCache>,
    roots: Vec<RootSpec>,
}

impl Layout {
    fn new(cfg: &V4Config, cache: &CacheLayout) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        // Columns so far: (CSA ring, HCA ring, CSA entries, HCA entries).
        let (mut csa_src, mut hca_src, mut csa, mut hca) = (0, 0, 0, 0);
        for (l, &kind) in cfg.attention.iter().enumerate() {
            let (source, entries) = match kind {
                V4Attention::Sliding => (0, 0),
                V4Attention::CompressedSparse => (csa_src, csa),
                V4Attention::HeavilyCompressed => (hca_src, hca),
            };
            layers.push(LayerCache {
                swa: l * cfg.head_dim,
                source,
                entries,
            });
            let (src, entry) = (source_width(cfg, kind), entry_width(cfg, kind));
            match kind {
                V4Attention::Sliding => {}
                V4Attention::CompressedSparse => (csa_src, csa) = (csa_src + src, csa + entry),
                V4Attention::HeavilyCompressed => (hca_src, hca) = (hca_src + src, hca + entry),
            }
        }
        let states = cache.state_rows.max(1);
        let dtype = cache.dtype;
        let mut roots = vec![RootSpec {
            name: SWA_RING,
            rows: states * cfg.sliding_window,
            // Every layer's, the MTP layer in use included.
            cols: cfg.attention.len() * cfg.head_dim,
            dtype,
        }];
        let kinds = [
            (
                V4Attention::CompressedSparse,
                CSA_RING,
                CSA_ROOT,
                csa_src,
                csa,
            ),
            (
                V4Attention::HeavilyCompressed,
                HCA_RING,
                HCA_ROOT,
                hca_src,
                hca,
            ),
        ];
        for (kind, ring, pool, ring_cols, pool_cols) in kinds {
            if ring_cols == 0 {
                continue;
            }
            let (rate, span) = rate_and_span(cfg, kind);
            roots.push(RootSpec {
                name: ring,
                rows: states * span,
                cols: ring_cols,
                dtype,
            });
            roots.push(RootSpec {
                name: pool,
                rows: cache.num_slots / entry_stride(rate, cache.block_size)? + 1,
                cols: pool_cols,
                dtype,
            });
        }
        Ok(Layout { layers, roots })
    }
}

/// The cache roots of `cfg` under `cache`, in the order the step graphs declare them: the
/// rings and entries, then the sampling-state root every model's steps keep.
pub fn cache_roots(cfg: &V4Config, cache: &CacheLayout) -> Result<Vec<RootSpec>> {
    let mut roots = Layout::new(cfg, cache)?.roots;
    roots.push(sampling_root(cfg.vocab_size, cache));
    Ok(roots)
}

/// What V4's cache costs at a cache dtype and block size: the compressed entries are paged,
/// so they cost per token of context; the rings cost per running sequence, whatever its
/// length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct V4CacheCost {
    /// Bytes of entry rows per token slot (a window's entry per `rate` tokens, or per block
    /// when the rate is longer than a block).
    pub bytes_per_token: f64,
    /// Bytes of a sequence's rings (its window and its compressors' inputs).
    pub bytes_per_sequence: u64,
}

impl V4CacheCost {
    /// The cache a sequence of `ctx` tokens costs, per token.
    pub fn per_token_at(&self, ctx: usize) -> f64 {
        self.bytes_per_token + self.bytes_per_sequence as f64 / ctx as f64
    }
}

/// The cache cost of `cfg` in `dtype` with blocks of `block_size` tokens.
pub fn cache_cost(cfg: &V4Config, dtype: DType, block_size: usize) -> Result<V4CacheCost> {
    // One block and one sequence: the roots' rows per slot and per state row.
    let layout = Layout::new(cfg, &CacheLayout::new(block_size, 1, dtype, 0))?;
    let mut cost = V4CacheCost {
        bytes_per_token: 0.0,
        bytes_per_sequence: 0,
    };
    let width = dtype.size_in_bytes();
    for r in &layout.roots {
        let row = (r.cols * width) as u64;
        match r.name {
            CSA_ROOT | HCA_ROOT => {
                let rate = if r.name == CSA_ROOT {
                    cfg.csa_rate
                } else {
                    cfg.hca_rate
                };
                cost.bytes_per_token += row as f64 / entry_stride(rate, block_size)? as f64;
            }
            // Rings: `span` rows a state row.
            _ => cost.bytes_per_sequence += row * r.rows as u64,
        }
    }
    Ok(cost)
}

/// The roots as a step sees them, by name, updated as its layers write.
struct Roots(Vec<(&'static str, Tensor)>);

impl Roots {
    fn get(&self, name: &str) -> Result<&Tensor> {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| Error::shape("cache", format!("no `{name}` root")))
    }

    fn set(&mut self, name: &str, value: Tensor) -> Result<()> {
        let slot = self
            .0
            .iter_mut()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| Error::shape("cache", format!("no `{name}` root")))?;
        slot.1 = value;
        Ok(())
    }
}

/// What every layer reads from the step's metadata, per fed token.
struct Step {
    positions: Tensor,
    slots: Tensor,
    /// Its sequence's block table, `[n, ctx / block]`.
    tables: Tensor,
    /// The sequences' block tables, `[seqs, ctx / block]`.
    seq_tables: Tensor,
    /// Its sequence (row of `seq_tables`), `[n]`.
    seq_ids: Tensor,
    /// Its sequence's state row, `[n]`.
    state: Tensor,
    /// The position of its chunk's first token, `[n]`.
    chunk_start: Tensor,
    /// Its chunk's last row, `[n]` (a padding token's is before it).
    last_row: Tensor,
    block: usize,
    ctx: usize,
    decode: bool,
    main: Rope,
    compress: Rope,
}

/// What every V4 step graph declares: the weights, the step's metadata and cache roots, and
/// the per-token view of them its layers read.
struct Declared {
    b: GraphBuilder,
    w: Weights,
    ids: Tensor,
    layout: Layout,
    step: Step,
    /// A prefill's chunk ends (`last_index`) and, packed, which chunk each token is.
    chunks: Option<(Tensor, Option<Tensor>)>,
    /// The layout's roots as declared (the sampling-state root aside).
    roots: Vec<(&'static str, Tensor)>,
}

/// Declares graph `name`'s inputs for `spec` over `cfg`'s cache roots under `cache` (see the
/// module docs), after checking `spec`'s sizes.
fn declare(cfg: &V4Config, cache: &CacheLayout, spec: &V4Step, name: String) -> Result<Declared> {
    let V4Step {
        rows: n,
        seqs,
        ctx,
        decode,
        ..
    } = *spec;
    let block = cache.block_size;
    if n == 0 || seqs == 0 || seqs > n || (decode && seqs != n) || !ctx.is_multiple_of(block) {
        return Err(Error::shape(
            "bucket",
            format!(
                "a V4 {} step of {n} tokens, {seqs} sequences and a context of {ctx} (a multiple \
                 of the block size {block})",
                if decode { "decode" } else { "prefill" }
            ),
        ));
    }
    let layout = Layout::new(cfg, cache)?;
    let b = GraphBuilder::new(name);
    let w = Weights::declare(&b, cfg, spec.ranks, spec.weights, spec.dots)?;
    let meta =
        |name: &str, shape: Vec<usize>| b.input(name, InputRole::Metadata, shape, DType::I32);
    let ids = meta(inputs::INPUT_IDS, vec![n])?;
    let positions = meta(inputs::POSITIONS, vec![n])?;
    let slots = meta(inputs::SLOT_MAPPING, vec![n])?;
    let seq_tables = meta(inputs::BLOCK_TABLES, vec![seqs, ctx / block])?;
    let seq_states = meta(inputs::STATE_ROWS, vec![seqs])?;
    // A prefill's chunk ends, and (packed) which chunk each token is.
    let mut chunks = None;
    let (seq_ids, chunk_start, last_row) = match decode {
        // Every row is a chunk of one token.
        true => {
            let rows = b.iota([n], DType::I32, 0)?;
            (rows.clone(), positions.clone(), rows)
        }
        false => {
            let last_index = meta(inputs::LAST_INDEX, vec![seqs])?;
            let packed = match seqs {
                1 => None,
                _ => Some(meta(inputs::SEQ_IDS, vec![n])?),
            };
            let seq_ids = match &packed {
                None => b.full(0.0, [n], DType::I32)?,
                Some(ids) => ids.clone(),
            };
            // Chunks are packed in order: chunk c starts after chunk c - 1's last row.
            let first = match seqs {
                1 => b.full(0.0, [1], DType::I32)?,
                _ => b.cat(
                    &[
                        &b.full(0.0, [1], DType::I32)?,
                        &last_index.narrow(0, 0, seqs - 1)?.affine(1.0, 1.0)?,
                    ],
                    0,
                )?,
            };
            let row = b.iota([n], DType::I32, 0)?;
            let first_row = first.index_select(&seq_ids, 0)?;
            let chunk_start = positions.sub(&row.sub(&first_row)?)?;
            let last_row = last_index.index_select(&seq_ids, 0)?;
            chunks = Some((last_index, packed));
            (seq_ids, chunk_start, last_row)
        }
    };
    let mut roots = Vec::with_capacity(layout.roots.len());
    for r in &layout.roots {
        let t = b.input(r.name, InputRole::CacheRoot, r.shape().to_vec(), r.dtype)?;
        roots.push((r.name, t));
    }
    let step = Step {
        tables: seq_tables.index_select(&seq_ids, 0)?,
        seq_tables,
        state: seq_states.index_select(&seq_ids, 0)?,
        seq_ids,
        chunk_start,
        last_row,
        block,
        ctx,
        decode,
        main: Rope::new(cfg.rope_dim, &cfg.main_rope, &positions)?,
        compress: Rope::new(cfg.rope_dim, &cfg.compress_rope, &positions)?,
        positions,
        slots,
    };
    Ok(Declared {
        b,
        w,
        ids,
        layout,
        step,
        chunks,
        roots,
    })
}

/// The step graph of `spec` over `cfg`'s cache roots under `cache`. With `cfg`'s MTP layer in
/// use ([`V4Config::with_draft_layer`]) it also returns every fed token's residual streams
/// before the hyper-head as [`HIDDEN`] (`[n, hc_mult * hidden]`), what the draft graphs read.
pub fn build_step(cfg: &V4Config, cache: &CacheLayout, spec: &V4Step) -> Result<Graph> {
    let V4Step {
        rows: n,
        ctx,
        decode,
        logits: want,
        sampler,
        moe,
        ..
    } = *spec;
    let name = match (decode, sampler) {
        (true, Sampler::Full) => format!("v4_decode_b{n}_c{ctx}"),
        (true, Sampler::Greedy) => format!("v4_decode_greedy_b{n}_c{ctx}"),
        (true, Sampler::Deferred) => format!("v4_decode_logits_b{n}_c{ctx}"),
        (false, Sampler::Full) => format!("v4_prefill_t{n}_s{}_c{ctx}", spec.seqs),
        // No verify graph yet: the MTP layer is not served (`ModelConfig::with_draft_layer`).
        (_, sampler) => {
            return Err(Error::shape(
                "bucket",
                format!(
                    "a V4 {} graph does not sample with {sampler:?}",
                    if decode { "decode" } else { "prefill" }
                ),
            ))
        }
    };
    let Declared {
        b,
        w,
        ids,
        layout,
        step,
        chunks,
        roots: old,
    } = declare(cfg, cache, spec, name)?;
    let mut roots = Roots(old.clone());
    let streams = super::streams(cfg, &w, &ids, moe, |l, x| {
        attention(cfg, &w, l, layout.layers[l], x, &step, &mut roots)
    })?;
    if cfg.draft_layers > 0 {
        b.output(
            HIDDEN,
            &streams.reshape([n, cfg.hc_mult * cfg.hidden_size])?,
        )?;
    }
    let x = super::collapse(cfg, &w, &streams)?;
    let vocab = w.vocab_slice(cfg)?;
    let sampling = sampling_root(cfg.vocab_size, cache);
    let state = b.input(
        sampling.name,
        InputRole::CacheRoot,
        sampling.shape().to_vec(),
        sampling.dtype,
    )?;
    let new_state = match chunks {
        None => {
            let logits = super::head(&w, &x)?;
            let (next, new_state) =
                decode_tail(&b, sampler, &logits, &vocab, &state, &ids, &step.positions)?;
            step_outputs(&b, next.as_ref(), &logits, want)?;
            new_state
        }
        Some((last_index, packed)) => {
            let last = super::head(&w, &x.index_select(&last_index, 0)?)?;
            let (next, new_state) = prefill_tail(
                &b,
                &last,
                &vocab,
                &state,
                &ids,
                &step.positions,
                &last_index,
                packed.as_ref(),
            )?;
            b.output("next_tokens", &next)?;
            match want {
                LogitsOutput::None => {}
                LogitsOutput::Sampled => b.output(STEP_LOGITS, &last)?,
                LogitsOutput::AllPositions => b.output(STEP_LOGITS, &super::head(&w, &x)?)?,
            }
            new_state
        }
    };
    for (name, input) in &old {
        b.output_aliased(*name, roots.get(name)?, input)?;
    }
    b.output_aliased(sampling.name, &new_state, &state)?;
    b.finish()
}

/// The MTP layer's step graph ([`super::mtp`]) over `spec`'s rows, `cfg` with the layer in use:
/// row `i` is a position whose main-model streams ([`HIDDEN`], `[n, hc_mult * hidden]`, what
/// [`build_step`] returned for it) and next token (`input_ids`) are known, at that position.
/// Its K=V goes to the sliding-window ring as any layer's does (the MTP layer's own columns of
/// [`SWA_RING`]), so chunks and decode rows of one sequence attend as one forward over its
/// rows would ([`super::forward::build_stateless_draft`]). Outputs: `next_tokens` (each decode
/// row's proposal, or each prefill chunk's last row's), [`STEP_LOGITS`] as `spec.logits` asks,
/// [`DRAFT_HIDDEN`] (the block's output streams, what a chained draft reads) and the updated
/// roots; the sampling-state root is not an input (a draft samples by argmax).
pub fn build_draft_step(cfg: &V4Config, cache: &CacheLayout, spec: &V4Step) -> Result<Graph> {
    if cfg.draft_layers == 0 {
        return Err(Error::shape(
            "bucket",
            "a draft graph of a DeepSeek-V4 model loaded without its MTP layer",
        ));
    }
    let V4Step {
        rows: n,
        seqs,
        ctx,
        decode,
        moe,
        ..
    } = *spec;
    let name = match decode {
        true => format!("v4_draft_b{n}_c{ctx}"),
        false => format!("v4_draft_t{n}_s{seqs}_c{ctx}"),
    };
    let Declared {
        b,
        w,
        ids,
        layout,
        step,
        chunks,
        roots: old,
    } = declare(cfg, cache, spec, name)?;
    let width = cfg.hc_mult * cfg.hidden_size;
    let hidden = b.input(HIDDEN, InputRole::Carried, [n, width], DType::F32)?;
    let mut roots = Roots(old.clone());
    let (normed, out) = super::mtp::draft(
        cfg,
        &w,
        &hidden.reshape([n, cfg.hc_mult, cfg.hidden_size])?,
        &ids,
        moe,
        |l, x| attention(cfg, &w, l, layout.layers[l], x, &step, &mut roots),
    )?;
    let logits = super::head(&w, &normed)?;
    let proposed = match &chunks {
        None => logits.clone(),
        Some((last_index, _)) => logits.index_select(last_index, 0)?,
    };
    b.output("next_tokens", &w.vocab_slice(cfg)?.argmax(&proposed)?)?;
    match spec.logits {
        LogitsOutput::None => {}
        LogitsOutput::Sampled => b.output(STEP_LOGITS, &proposed)?,
        LogitsOutput::AllPositions => b.output(STEP_LOGITS, &logits)?,
    }
    b.output(DRAFT_HIDDEN, &out.reshape([n, width])?)?;
    for (name, input) in &old {
        b.output_aliased(*name, roots.get(name)?, input)?;
    }
    b.finish()
}

/// `max(x, 0)`.
fn non_negative(x: &Tensor) -> Result<Tensor> {
    x.maximum(&x.full_like(0.0)?)
}

/// Reads rows `rows` (`[r, k]`) of `width` columns from `col` of `root`, as f32 `[r, k,
/// width]`.
fn read_rows(root: &Tensor, col: usize, width: usize, rows: &Tensor) -> Result<Tensor> {
    let (r, k) = (rows.dim(0), rows.dim(1));
    root.narrow(1, col, width)?
        .index_select(&rows.reshape([r * k])?, 0)?
        .reshape([r, k, width])?
        .to_dtype(DType::F32)
}

/// Writes `values` (`[n, width]`, f32) at rows `rows` from column `col` of `root`.
fn write_rows(root: &Tensor, rows: &Tensor, col: usize, values: &Tensor) -> Result<Tensor> {
    root.scatter_rows(rows, col, &values.to_dtype(root.dtype())?)
}

/// A per-sequence ring of `len` positions, at columns `col..col + width` of its root.
struct Ring {
    name: &'static str,
    len: usize,
    col: usize,
}

impl Ring {
    /// Each token's values at positions `pos` (`[n, k]`, of its sequence, at most its own):
    /// from `fresh` (`[n, width]`, the step's own rows) where the position was fed in this
    /// step, else from the ring as the step found it. Positions below 0 read position 0.
    fn read(&self, roots: &Roots, step: &Step, pos: &Tensor, fresh: &Tensor) -> Result<Tensor> {
        let (n, k, width) = (pos.dim(0), pos.dim(1), fresh.dim(1));
        let pos = non_negative(pos)?;
        let ring = read_rows(
            roots.get(self.name)?,
            self.col,
            width,
            &self.rows(step, &pos)?,
        )?;
        // Row of position q in this step: i - (p_i - q), clamped for positions never used.
        let row = pos.builder().iota([n, k], DType::I32, 0)?;
        let back = step
            .positions
            .unsqueeze(1)?
            .broadcast_as([n, k])?
            .sub(&pos)?;
        let fresh_row = non_negative(&row.sub(&back)?)?.minimum(&row.full_like((n - 1) as f64)?)?;
        let own = fresh
            .index_select(&fresh_row.reshape([n * k])?, 0)?
            .reshape([n, k, width])?;
        let is_fresh = pos
            .ge(&step.chunk_start.unsqueeze(1)?.broadcast_as([n, k])?)?
            .unsqueeze(2)?
            .broadcast_as([n, k, width])?;
        is_fresh.where_cond(&own, &ring)
    }

    /// The ring after the step: each chunk's last `len` positions written from `fresh`; the
    /// other tokens (and padding) write the scratch row's ring.
    fn write(&self, roots: &mut Roots, step: &Step, fresh: &Tensor) -> Result<()> {
        let n = fresh.dim(0);
        let p = &step.positions;
        let target = self.rows(step, &p.unsqueeze(1)?)?.reshape([n])?;
        let row = p.builder().iota([n], DType::I32, 0)?;
        let recent = and(
            &row.gt(&step.last_row.affine(1.0, -(self.len as f64))?)?,
            &row.le(&step.last_row)?,
        )?;
        let target = recent.where_cond(&target, &target.full_like(0.0)?)?;
        let root = write_rows(roots.get(self.name)?, &target, self.col, fresh)?;
        roots.set(self.name, root)
    }

    /// Ring rows of positions `pos` (`[n, k]`, non-negative) of each token's sequence.
    fn rows(&self, step: &Step, pos: &Tensor) -> Result<Tensor> {
        let (n, k) = (pos.dim(0), pos.dim(1));
        let base = mul_const(&step.state, self.len)?;
        let at = pos.rem(&pos.full_like(self.len as f64)?)?;
        base.unsqueeze(1)?.broadcast_as([n, k])?.add(&at)
    }
}

/// Layer `l`'s attention for the step's tokens (`x`: `[n, hidden]`, normalised), updating its
/// cache in `roots`.
fn attention(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    at: LayerCache,
    x: &Tensor,
    step: &Step,
    roots: &mut Roots,
) -> Result<Tensor> {
    let kind = cfg.attention[l];
    let rope = match kind {
        V4Attention::Sliding => &step.main,
        _ => &step.compress,
    };
    let (q_res, q) = attn::queries(cfg, w, l, x, rope)?;
    let kv = attn::key_value(cfg, w, l, x, rope)?;
    // The window: the sequence's last `sliding_window` positions up to the query's own.
    let ring = Ring {
        name: SWA_RING,
        len: cfg.sliding_window,
        col: at.swa,
    };
    let pos = positions_before(&step.positions, cfg.sliding_window)?;
    let keys = ring.read(roots, step, &pos, &kv)?;
    ring.write(roots, step, &kv)?;
    let mut sets = vec![(Keys::PerRow(keys), pos.ge(&pos.full_like(0.0)?)?)];
    if kind != V4Attention::Sliding {
        if let Some(set) = compressed(cfg, w, l, at, x, &q_res, step, roots)? {
            sets.push(set);
        }
    }
    let out = attn::attend(cfg, w, l, &q, &sets)?;
    attn::output(cfg, w, l, &out, rope)
}

/// `[n, span]`: for each `end` (`[n]`), the positions `end - span + 1 ..= end`.
fn positions_before(end: &Tensor, span: usize) -> Result<Tensor> {
    let n = end.dim(0);
    let offsets = end.builder().iota([n, span], DType::I32, 1)?;
    end.unsqueeze(1)?
        .broadcast_as([n, span])?
        .add(&offsets)?
        .affine(1.0, -((span - 1) as f64))
}

/// A compressed layer's entries as each query sees them (`None` when the context bucket holds
/// no whole window), after pooling the windows this step completes into the layer's entry root
/// (see the module docs).
#[allow(clippy::too_many_arguments)]
fn compressed(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    at: LayerCache,
    x: &Tensor,
    q_res: &Tensor,
    step: &Step,
    roots: &mut Roots,
) -> Result<Option<(Keys, Tensor)>> {
    let b = x.builder();
    let kind = cfg.attention[l];
    let csa = kind == V4Attention::CompressedSparse;
    let (m, span) = rate_and_span(cfg, kind);
    let stride = entry_stride(m, step.block)?;
    let (d, ci) = (
        cfg.head_dim,
        cfg.indexer.map(|ix| ix.head_dim).unwrap_or_default(),
    );
    let a = attn::prefix(cfg, l);
    let compressor = format!("{a}.compressor");
    let index_compressor = format!("{a}.indexer.compressor");
    let mut compressors = vec![(compressor.as_str(), d)];
    if csa {
        compressors.push((index_compressor.as_str(), ci));
    }
    let series = span / m;

    // Each token's compressor inputs: value and gate (+ ape at its place in its window).
    let p = &step.positions;
    let place = p.rem(&p.full_like(m as f64)?)?;
    let mut source = Vec::new();
    for (prefix, _) in &compressors {
        source.push(w.linear(x, &format!("{prefix}.wkv.weight"))?);
        let ape = w.get(&format!("{prefix}.ape"))?.index_select(&place, 0)?;
        source.push(w.linear(x, &format!("{prefix}.wgate.weight"))?.add(&ape)?);
    }
    let fresh = b.cat(&source.iter().collect::<Vec<_>>(), 1)?;

    // Each token pools the latest window that has begun to complete: the one it completes, or
    // an earlier one (written to the dump row). Its first position is `start`.
    let next = p.affine(1.0, 1.0)?;
    let start = non_negative(
        &next
            .sub(&next.rem(&next.full_like(m as f64)?)?)?
            .affine(1.0, -(m as f64))?,
    )?;
    let pos = positions_before(&start.affine(1.0, (m - 1) as f64)?, span)?;
    let exists = pos.ge(&pos.full_like(0.0)?)?;
    let ring = Ring {
        name: if csa { CSA_RING } else { HCA_RING },
        len: span,
        col: at.source,
    };
    let rows = ring.read(roots, step, &pos, &fresh)?;
    ring.write(roots, step, &fresh)?;
    let at_start = Rope::new(cfg.rope_dim, &cfg.compress_rope, &start)?;
    let mut entry = Vec::new();
    let mut col = 0;
    for (prefix, cw) in &compressors {
        let value = series_of(&rows, col, *cw, series, m)?;
        let gate = series_of(&rows, col + series * cw, *cw, series, m)?;
        col += 2 * series * cw;
        let exists = exists.unsqueeze(2)?.broadcast_as(value.shape().clone())?;
        let value = exists.where_cond(&value, &value.full_like(0.0)?)?;
        let gate = exists.where_cond(&gate, &gate.full_like(f64::NEG_INFINITY)?)?;
        entry.push(attn::pool(cfg, w, prefix, &value, &gate, &at_start)?);
    }
    let name = if csa { CSA_ROOT } else { HCA_ROOT };
    let root = roots.get(name)?;
    let dump = root.dim(0) - 1;
    let completes = next
        .rem(&next.full_like(m as f64)?)?
        .eq(&next.full_like(0.0)?)?;
    let target = completes.where_cond(
        &div_const(&step.slots, stride)?,
        &step.slots.full_like(dump as f64)?,
    )?;
    let root = write_rows(
        root,
        &target,
        at.entries,
        &b.cat(&entry.iter().collect::<Vec<_>>(), 1)?,
    )?;
    roots.set(name, root.clone())?;

    // The entries each query may read: window e's row is its last slot's.
    let entries = step.ctx / m;
    if entries == 0 {
        return Ok(None);
    }
    let last: Vec<i32> = (0..entries).map(|e| (e * m + m - 1) as i32).collect();
    let last = b.constant(Literal::I32(last), [1, entries])?;
    let tables = if step.decode {
        &step.tables
    } else {
        &step.seq_tables
    };
    let r = tables.dim(0);
    let rows = div_const(
        &slots_at(tables, &last.broadcast_as([r, entries])?, step.block)?,
        stride,
    )?;
    let read = read_rows(&root, at.entries, entry_width(cfg, kind), &rows)?;
    let kv = read.narrow(2, 0, d)?;
    let ready = div_const(&next, m)?;
    let n = p.dim(0);
    let (keys, visible) = match step.decode {
        true => {
            let e = b.iota([n, entries], DType::I32, 1)?;
            (Keys::PerRow(kv), e.lt(&ready.unsqueeze(1)?)?)
        }
        false => {
            let e = b.iota([n, r, entries], DType::I32, 2)?;
            let owner = b.iota([n, r, entries], DType::I32, 1)?;
            let own = owner.eq(&step.seq_ids.reshape([n, 1, 1])?)?;
            let visible = and(&own, &e.lt(&ready.reshape([n, 1, 1])?)?)?;
            (
                Keys::Shared(kv.reshape([r * entries, d])?),
                visible.reshape([n, r * entries])?,
            )
        }
    };
    if !csa {
        return Ok(Some((keys, visible)));
    }
    let index_keys = read.narrow(2, d, ci)?;
    let index_keys = match step.decode {
        true => Keys::PerRow(index_keys),
        false => Keys::Shared(index_keys.reshape([r * entries, ci])?),
    };
    let scores = attn::index_scores(cfg, w, l, x, q_res, &step.compress, &index_keys)?;
    let chosen = attn::select(cfg, &scores, &visible)?;
    Ok(Some((keys, chosen)))
}

/// One compressor quantity (value or gate) of a window's positions (`rows`: `[n, series x m,
/// source width]`, the quantity at column `col`, `series x width` wide): `[n, series x m,
/// width]`. With two series (CSA), the first `m` positions (the previous window) contribute
/// the first series and the last `m` the second.
fn series_of(rows: &Tensor, col: usize, width: usize, series: usize, m: usize) -> Result<Tensor> {
    if series == 1 {
        return rows.narrow(2, col, width);
    }
    let first = rows.narrow(1, 0, m)?.narrow(2, col, width)?;
    let second = rows.narrow(1, m, m)?.narrow(2, col + width, width)?;
    rows.builder().cat(&[&first, &second], 1)
}
