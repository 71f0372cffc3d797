//! The DeepSeek forward pass, written once as graph builders.
//!
//! [`build_decode`] and [`build_prefill`] return a [`Graph`] for one bucket: static shapes, i32
//! metadata, the KV root as a cache-root input whose updated value is an aliased output. Every
//! value derived from the step's metadata (rope angles, context slots, masks) is computed inside
//! the graph. Builders only use the `graph` API; they never name a backend.
//!
//! Graph inputs (besides weights, which take their parameter names):
//!
//! | name | decode `(b, ctx)` | prefill `(t, s, ctx)` |
//! |---|---|---|
//! | `input_ids` | `[b]` i32 | `[t]` i32 |
//! | `positions` | `[b]` i32 | `[t]` i32 |
//! | `slot_mapping` | `[b]` i32 | `[t]` i32 |
//! | `block_tables` | `[b, ctx / block]` i32 | `[s, ctx / block]` i32 |
//! | `context_lens` | `[b]` i32 (including the new token) | — |
//! | `last_index` | — | `[s]` i32: each chunk's last real token |
//! | `seq_ids` | — | `[t]` i32: each token's chunk (only when `s > 1`) |
//! | `temperature`, `top_p` | `[b]` f32 | `[s]` f32 |
//! | `top_k` | `[b]` i32 | `[s]` i32 |
//! | `seeds` | `[b]` u32 | `[s]` u32 |
//! | `kv_cache` | `[slots, layers * width]` in the cache dtype, updated in place | same |
//! | `index_cache` | V3.2 only: `[slots, layers * index_head_dim]`, the state root | same |
//!
//! A prefill graph of `s > 1` sequences is a *packed* prefill: the chunks of several sequences
//! side by side in one step, so a burst of short prompts costs about one step instead of one
//! each (the weights are read once for all of them).
//!
//! Weights are inputs in their stored dtype; [`precision`] says in which dtype the forward
//! multiplies them.
//!
//! Outputs: `next_tokens` (`[b]` / `[s]` i32), `logits` on request (`[b, vocab]` for decode and
//! each chunk's last position in prefill, or `[t, vocab]` for every position), and the updated
//! cache roots under their input names (see [`cache_roots`]). Split by vocabulary (`--tp N`),
//! each rank's `logits` are its slice's columns (`vocab / N` of them, rounded up, see
//! [`vocab`]): no collective gathers them, the runner joins the ranks' slices on the host when
//! asked.

pub mod attention;
pub mod attn_step;
pub mod cost;
pub mod indexer;
pub mod inputs;
pub mod logits;
pub mod moe;
pub mod mtp;
pub mod ops;
pub mod params;
pub mod precision;
pub mod rope;
pub mod sampling;
pub mod shard;
pub mod v4;
pub mod vocab;

use std::cell::RefCell;
use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, ReduceOp, Tensor};

use attention::Roots;
use attn_step::AttnStep;
use vocab::VocabSlice;

pub use moe::MoeStrategy;
pub use params::{ModelWeights, WeightSpecs};
pub use precision::{DTypeChoice, Dots, Precision, PrecisionChoice, Quantize};

/// Declares weight inputs on first use, so each graph binds only the weights it reads.
pub struct Weights<'a> {
    builder: GraphBuilder,
    specs: &'a WeightSpecs,
    declared: RefCell<HashMap<String, Tensor>>,
}

impl<'a> Weights<'a> {
    /// A weight registry for one graph under construction.
    pub fn new(builder: &GraphBuilder, specs: &'a WeightSpecs) -> Self {
        Weights {
            builder: builder.clone(),
            specs,
            declared: RefCell::new(HashMap::new()),
        }
    }

    /// The input for weight `name`, declared the first time it is asked for.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        if let Some(t) = self.declared.borrow().get(name) {
            return Ok(t.clone());
        }
        let shape = self.specs.shape(name).ok_or_else(|| {
            Error::shape("weight", format!("the model has no parameter `{name}`"))
        })?;
        let t = self.builder.input(
            name,
            InputRole::Weight,
            shape.to_vec(),
            self.specs.dtype(name),
        )?;
        self.declared
            .borrow_mut()
            .insert(name.to_string(), t.clone());
        Ok(t)
    }

    /// In which dtype the graph's matmuls multiply (the weights' [`Precision::dots`]).
    pub fn dots(&self) -> Dots {
        self.specs.precision().dots
    }

    /// The weights' precision.
    pub fn precision(&self) -> &Precision {
        self.specs.precision()
    }

    /// The tensor-parallel degree of the weights (1: the whole model on one rank).
    pub fn ranks(&self) -> usize {
        self.specs.ranks()
    }

    /// The attention heads this rank computes.
    pub fn heads(&self, cfg: &ModelConfig) -> usize {
        cfg.num_attention_heads / self.ranks()
    }

    /// The part of the vocabulary this rank's embedding rows and LM head cover.
    pub fn vocab_slice(&self) -> Result<VocabSlice> {
        Ok(match self.ranks() {
            1 => VocabSlice::Whole,
            ranks => VocabSlice::Shard {
                ranks,
                first: self.get(shard::SHARD_OFFSETS)?.narrow(0, 0, 1)?,
                vocab: self.specs.vocab_size(),
            },
        })
    }

    /// A rank's partial result (head-split attention, split MLP, its experts) summed over
    /// the ranks; the value itself at one rank.
    pub fn complete(&self, partial: Tensor) -> Result<Tensor> {
        match self.ranks() {
            1 => Ok(partial),
            n => partial.all_reduce(ReduceOp::Sum, n),
        }
    }

    /// For each of the `ids` (`[n]` or `[n, k]` i32, indices into a rank-split axis of
    /// `local_len` per rank whose first index is offset `which` of [`shard::SHARD_OFFSETS`]):
    /// the index into this rank's shard (0 where the id is another rank's) and whether it is
    /// this rank's.
    pub fn local_ids(
        &self,
        ids: &Tensor,
        which: usize,
        local_len: usize,
    ) -> Result<(Tensor, Tensor)> {
        let start = self.get(shard::SHARD_OFFSETS)?.narrow(0, which, 1)?;
        local_indices(ids, &start, local_len)
    }
}

/// For each of the `ids` (i32 indices into an axis split across the ranks, `local_len` a rank,
/// this rank's share starting at `start`, `[1]` i32): the index into this rank's share (0 where
/// the id is another rank's) and whether it is this rank's.
pub(crate) fn local_indices(
    ids: &Tensor,
    start: &Tensor,
    local_len: usize,
) -> Result<(Tensor, Tensor)> {
    let local = ids.broadcast_sub(start)?;
    let lo = local.ge(&local.full_like(0.0)?)?;
    let mine = lo.where_cond(&local.lt(&local.full_like(local_len as f64)?)?, &lo)?;
    Ok((mine.where_cond(&local, &local.full_like(0.0)?)?, mine))
}

/// The f32 rows of the embedding `table` for `ids` (`[n]` i32). With `first` (`[1]` i32: the
/// vocabulary row this rank's share of the table starts at), an id of another rank's rows
/// gives zeros: a partial embedding, which the caller all-reduces.
pub(crate) fn embed_rows(table: &Tensor, ids: &Tensor, first: Option<&Tensor>) -> Result<Tensor> {
    let Some(first) = first else {
        return table.index_select(ids, 0)?.to_dtype(DType::F32);
    };
    let (local, mine) = local_indices(ids, first, table.dim(0))?;
    let x = table.index_select(&local, 0)?.to_dtype(DType::F32)?;
    let mine = mine.unsqueeze(1)?.broadcast_as(x.shape().clone())?;
    mine.where_cond(&x, &x.full_like(0.0)?)
}

/// The paged KV-cache geometry a graph is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    /// Token slots per block.
    pub block_size: usize,
    /// Rows of the KV root (`blocks * block_size`).
    pub num_slots: usize,
    /// The cache's element type.
    pub dtype: DType,
    /// Rows of the sampling-state root (see [`logits`]): one per sequence that can run at once,
    /// plus the scratch row 0.
    pub state_rows: usize,
}

impl CacheLayout {
    /// The layout of `blocks` blocks of `block_size` tokens in `dtype`, with sampling state for
    /// `max_batch` sequences.
    pub fn new(block_size: usize, blocks: usize, dtype: DType, max_batch: usize) -> Self {
        CacheLayout {
            block_size,
            num_slots: blocks * block_size,
            dtype,
            state_rows: max_batch + 1,
        }
    }
}

/// Which logits a graph returns besides the sampled tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogitsOutput {
    /// Only `next_tokens`.
    None,
    /// The logits the sample was drawn from (`[b, vocab]`).
    Sampled,
    /// Prefill only: every position's logits (`[t, vocab]`).
    AllPositions,
}

/// One bucket's graph: its kind and static sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphSpec {
    /// Rows (decode: sequences; prefill: tokens of the chunks).
    pub rows: usize,
    /// Prefill: the sequences whose chunks the step packs (1: one chunk, the unpacked graph).
    /// Decode ignores it (each row is a sequence).
    pub seqs: usize,
    /// Context positions visible (a multiple of the block size).
    pub ctx: usize,
    /// Which logits to return.
    pub logits: LogitsOutput,
    /// MoE evaluation strategy.
    pub moe: MoeStrategy,
    /// What picks a decode step's next tokens (prefill always runs the full sampler).
    pub sampler: Sampler,
}

/// What picks a decode graph's next tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Sampler {
    /// Every row's own sampling parameters and logit controls (penalties, bias, allowed
    /// tokens): the graph every device bucket compiles.
    #[default]
    Full,
    /// Every row greedy with no logit controls: a plain argmax of the logits, which is what
    /// [`Sampler::Full`] computes for such rows (the controls are then identities), without its
    /// vocabulary-wide filters and draw, and without updating the rows' token counts in the
    /// sampling-state root (no such row is ever penalised, see [`build_decode`]). The CPU
    /// runner builds it for steps where it applies (one more graph per bucket costs a
    /// NeuronCore a NEFF, a CPU nothing).
    Greedy,
    /// None: the graph ends at every row's logits (its `logits` output, whatever
    /// [`GraphSpec::logits`] says) and leaves the rows' token counts alone; [`build_sample`]
    /// then samples from those logits in a graph of its own, as [`Sampler::Full`] would have.
    /// A device runner splits its decode steps so the host computes the allowed-token masks
    /// while the forward pass runs (see `runner::device`, "Split sampling").
    Deferred,
    /// Speculative decoding's verify graph for rows that sample ([`build_prefill`] only):
    /// every position's token by rejection sampling against the token fed after it, with each
    /// position's own sampling parameters and logit controls ([`sampling::verify`]).
    Rejection,
}

/// The name of a split decode step's logits: its forward graph's output and its sampling
/// graph's [`InputRole::Carried`] input, one device buffer.
pub const STEP_LOGITS: &str = "logits";

fn metadata(b: &GraphBuilder, name: &str, shape: Vec<usize>, dtype: DType) -> Result<Tensor> {
    b.input(name, InputRole::Metadata, shape, dtype)
}

/// Cache slot of every context position: `block_tables[s, j / block] * block + j % block`,
/// flattened to `[seqs * ctx]`.
fn context_slots(block_tables: &Tensor, ctx: usize, block: usize) -> Result<Tensor> {
    let seqs = block_tables.dim(0);
    let j = block_tables.builder().iota([seqs, ctx], DType::I32, 1)?;
    slots_at(block_tables, &j, block)?.reshape([seqs * ctx])
}

/// The cache slots of positions `pos` (`[r, k]` i32, each below the tables' reach) of the
/// sequences whose block tables are `tables` (`[r, blocks]`): `tables[i, p / block] * block
/// + p % block`.
///
/// For a power-of-two block (every block size the runner uses) the product is a left shift
/// ([`ops::mul_const`]).
pub(crate) fn slots_at(tables: &Tensor, pos: &Tensor, block: usize) -> Result<Tensor> {
    let blk = pos.full_like(block as f64)?;
    let blocks = tables.gather(&pos.div(&blk)?, 1)?;
    ops::mul_const(&blocks, block)?.add(&pos.rem(&blk)?)
}

fn check_spec(spec: &GraphSpec, cache: &CacheLayout) -> Result<()> {
    if spec.rows == 0 || spec.ctx == 0 || !spec.ctx.is_multiple_of(cache.block_size) {
        return Err(Error::shape(
            "bucket",
            format!(
                "rows {} and ctx {} (ctx must be a positive multiple of the block size {})",
                spec.rows, spec.ctx, cache.block_size
            ),
        ));
    }
    Ok(())
}

/// The input (and aliased output) name of the KV root: every layer's MLA latents.
pub const KV_ROOT: &str = "kv_cache";
/// The input (and aliased output) name of the state root: every layer's V3.2 index keys.
pub const INDEX_ROOT: &str = "index_cache";

/// One cache root: a persistent `[num_slots, cols]` buffer of `dtype`, every layer's cache a
/// column range of it, bound to the graphs as a cache-root input and an output aliased to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootSpec {
    /// The graph input and output name.
    pub name: &'static str,
    /// Rows (token slots).
    pub rows: usize,
    /// Values per slot, all layers side by side.
    pub cols: usize,
    /// Element type.
    pub dtype: DType,
}

impl RootSpec {
    /// The root's size in bytes.
    pub fn bytes(&self) -> u64 {
        (self.rows * self.cols * self.dtype.size_in_bytes()) as u64
    }

    /// The root's shape.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }
}

/// The cache roots of `cfg` under `cache`, in the order graphs declare them: the KV root, then
/// (V3.2) the state root of index keys, held in the cache dtype like the latents, then the
/// sampling-state root of the penalties' token counts (f32, see [`logits`]).
///
/// A DeepSeek-V4 model keeps its own roots ([`v4::step::cache_roots`]: rings and compressed
/// entries, then the same sampling state), and fails when its compress rates and the block
/// size do not divide one another.
pub fn cache_roots(cfg: &ModelConfig, cache: &CacheLayout) -> Result<Vec<RootSpec>> {
    if let Some(v4) = &cfg.v4 {
        return v4::step::cache_roots(v4, cache);
    }
    let mut roots = vec![RootSpec {
        name: KV_ROOT,
        rows: cache.num_slots,
        cols: cfg.cached_layers() * cfg.kv_cache_width(),
        dtype: cache.dtype,
    }];
    if cfg.indexer.is_some() {
        roots.push(RootSpec {
            name: INDEX_ROOT,
            rows: cache.num_slots,
            cols: cfg.cached_layers() * cfg.index_cache_width(),
            dtype: cache.dtype,
        });
    }
    roots.push(sampling_root(cfg.vocab_size, cache));
    Ok(roots)
}

/// The sampling-state root every model's step graphs keep last among their roots: the
/// penalties' token counts of each state row, over a vocabulary of `vocab` (f32, see
/// [`logits`]).
pub(crate) fn sampling_root(vocab: usize, cache: &CacheLayout) -> RootSpec {
    RootSpec {
        name: logits::STATE_ROOT,
        rows: cache.state_rows.max(1),
        cols: 2 * vocab,
        dtype: DType::F32,
    }
}

/// Declares every cache root: the layers' (KV, and V3.2's index keys) and the sampling state.
fn root_inputs(
    cfg: &ModelConfig,
    b: &GraphBuilder,
    cache: &CacheLayout,
) -> Result<(Roots, Tensor)> {
    let (mut kv, mut index, mut state) = (None, None, None);
    for r in cache_roots(cfg, cache)? {
        let t = Some(b.input(r.name, InputRole::CacheRoot, r.shape().to_vec(), r.dtype)?);
        match r.name {
            KV_ROOT => kv = t,
            INDEX_ROOT => index = t,
            _ => state = t,
        }
    }
    let missing = |what: &str| Error::shape("cache", format!("no {what} root"));
    Ok((
        Roots {
            kv: kv.ok_or_else(|| missing("KV"))?,
            index,
        },
        state.ok_or_else(|| missing("sampling-state"))?,
    ))
}

/// Declares every updated root as an output aliased to its input: the layers' `new` for
/// `old`, and the sampling state `(new, old)`.
fn output_roots(
    b: &GraphBuilder,
    new: &Roots,
    old: &Roots,
    state: (&Tensor, &Tensor),
) -> Result<()> {
    b.output_aliased(KV_ROOT, &new.kv, &old.kv)?;
    if let (Some(new), Some(old)) = (&new.index, &old.index) {
        b.output_aliased(INDEX_ROOT, new, old)?;
    }
    b.output_aliased(logits::STATE_ROOT, state.0, state.1)
}

/// The MLP (dense or MoE) of `layer` on normalized hidden states.
fn feed_forward(
    cfg: &ModelConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
    strategy: MoeStrategy,
) -> Result<Tensor> {
    match &cfg.routing {
        Some(r) if cfg.is_moe_layer(layer) => moe::moe(cfg, r, w, layer, x, strategy),
        _ => {
            let p = format!("model.layers.{layer}.mlp");
            ops::mlp(
                w.dots(),
                x,
                &w.get(&format!("{p}.gate_proj.weight"))?,
                &w.get(&format!("{p}.up_proj.weight"))?,
                &w.get(&format!("{p}.down_proj.weight"))?,
            )
        }
    }
}

type AttnFn =
    fn(&ModelConfig, &Weights, usize, &Tensor, &Roots, &AttnStep<'_>) -> Result<(Tensor, Roots)>;

/// Runs every decoder layer; returns the final normalized hidden states and the updated roots.
fn decoder(
    cfg: &ModelConfig,
    w: &Weights,
    mut x: Tensor,
    mut root: Roots,
    step: &AttnStep<'_>,
    attn: AttnFn,
    strategy: MoeStrategy,
) -> Result<(Tensor, Roots)> {
    for layer in 0..cfg.num_hidden_layers {
        (x, root) = decoder_layer(cfg, w, layer, x, &root, step, attn, strategy)?;
    }
    let x = ops::rms_norm(&x, &w.get("model.norm.weight")?, cfg.rms_norm_eps)?;
    Ok((x, root))
}

/// Decoder layer `layer` (an MTP layer's block too) on the residual stream `x`: attention and
/// the MLP, each on the normalized stream and added back; returns the new stream and roots.
#[allow(clippy::too_many_arguments)]
fn decoder_layer(
    cfg: &ModelConfig,
    w: &Weights,
    layer: usize,
    x: Tensor,
    root: &Roots,
    step: &AttnStep<'_>,
    attn: AttnFn,
    strategy: MoeStrategy,
) -> Result<(Tensor, Roots)> {
    let p = format!("model.layers.{layer}");
    let h = ops::rms_norm(
        &x,
        &w.get(&format!("{p}.input_layernorm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    let (a, root) = attn(cfg, w, layer, &h, root, step)?;
    let x = x.add(&w.complete(a)?)?;
    let h = ops::rms_norm(
        &x,
        &w.get(&format!("{p}.post_attention_layernorm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    let x = x.add(&w.complete(feed_forward(cfg, w, layer, &h, strategy)?)?)?;
    Ok((x, root))
}

/// The f32 embeddings of `ids` (`[n]`) in the model's table.
fn embed(w: &Weights, ids: &Tensor) -> Result<Tensor> {
    embed_in(w, "model.embed_tokens.weight", ids)
}

/// The f32 embeddings of `ids` (`[n]`) in the table `name` (the model's, or an MTP layer's
/// own). Split by vocabulary, a rank looks up the ids in its rows, zeroes the others, and the
/// all-reduce fills them in.
fn embed_in(w: &Weights, name: &str, ids: &Tensor) -> Result<Tensor> {
    let table = w.get(name)?;
    match w.ranks() {
        1 => embed_rows(&table, ids, None),
        _ => {
            let first = w.get(shard::SHARD_OFFSETS)?.narrow(0, 0, 1)?;
            w.complete(embed_rows(&table, ids, Some(&first))?)
        }
    }
}

/// The logits of the hidden states `x` (`[n, hidden]`) over the part of the vocabulary this
/// rank's LM head holds ([`Weights::vocab_slice`]); never gathered, see the module docs.
fn lm_logits(cfg: &ModelConfig, w: &Weights, x: &Tensor) -> Result<Tensor> {
    head_logits(w, ModelWeights::lm_head_name(cfg), x)
}

/// The logits of `x` through the head `name` (the model's, or an MTP layer's own), over this
/// rank's part of the vocabulary.
fn head_logits(w: &Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    let logits = ops::linear(w.dots(), x, &w.get(name)?)?;
    w.vocab_slice()?.mask_padding(&logits)
}

/// Declares the per-row sampling inputs, adjusts `logits` (mask, bias, penalties from the rows'
/// `counts` and `prompt` presence, see [`logits`]) and samples from them; `logits` cover
/// `vocab`'s part of the vocabulary.
fn sample_rows(
    b: &GraphBuilder,
    logits: &Tensor,
    vocab: &VocabSlice,
    positions: &Tensor,
    counts: &Tensor,
    prompt: &Tensor,
    drafts: Option<&Tensor>,
) -> Result<Tensor> {
    let rows = logits.dim(0);
    let temperature = metadata(b, inputs::TEMPERATURE, vec![rows], DType::F32)?;
    let top_k = metadata(b, inputs::TOP_K, vec![rows], DType::I32)?;
    let top_p = metadata(b, inputs::TOP_P, vec![rows], DType::F32)?;
    let seeds = metadata(b, inputs::SEEDS, vec![rows], DType::U32)?;
    let min_p = metadata(b, inputs::MIN_P, vec![rows], DType::F32)?;
    let f32_row = |name| metadata(b, name, vec![rows], DType::F32);
    let (presence, frequency, repetition) = (
        f32_row(inputs::PRESENCE_PENALTY)?,
        f32_row(inputs::FREQUENCY_PENALTY)?,
        f32_row(inputs::REPETITION_PENALTY)?,
    );
    let entries = rows * logits::LOGIT_BIAS_SLOTS;
    let bias_index = metadata(b, inputs::LOGIT_BIAS_INDEX, vec![entries], DType::I32)?;
    let bias_values = metadata(b, inputs::LOGIT_BIAS_VALUES, vec![entries], DType::F32)?;
    let allowed = metadata(
        b,
        inputs::ALLOWED_TOKENS,
        vec![rows, vocab.vocab(logits.dim(1)).div_ceil(32)],
        DType::U32,
    )?;
    let adjusted = logits::adjust(
        logits,
        counts,
        prompt,
        &logits::LogitInputs {
            allowed: &allowed,
            bias_index: &bias_index,
            bias_values: &bias_values,
            presence: &presence,
            frequency: &frequency,
            repetition: &repetition,
        },
        vocab,
    )?;
    let params = sampling::SamplingInputs {
        temperature: &temperature,
        top_k: &top_k,
        top_p: &top_p,
        min_p: &min_p,
        seeds: &seeds,
        positions,
    };
    match drafts {
        None => sampling::sample(&adjusted, &params, vocab),
        Some(d) => sampling::verify(&adjusted, &params, d, vocab),
    }
}

/// The inputs every step graph declares, and what the forward derives from them.
struct StepInputs {
    input_ids: Tensor,
    positions: Tensor,
    roots: Roots,
    /// The sampling-state root (see [`logits`]).
    state: Tensor,
    ctx: usize,
    cos: Tensor,
    sin: Tensor,
    slots: Tensor,
    ctx_slots: Tensor,
}

/// Declares the shared metadata for `rows` new tokens of `seqs` sequences (one block-table row
/// each) over a context of `ctx`, and derives the rope angles and context slots from it.
fn step_inputs(
    b: &GraphBuilder,
    cfg: &ModelConfig,
    cache: &CacheLayout,
    rows: usize,
    seqs: usize,
    ctx: usize,
) -> Result<StepInputs> {
    let input_ids = metadata(b, inputs::INPUT_IDS, vec![rows], DType::I32)?;
    let positions = metadata(b, inputs::POSITIONS, vec![rows], DType::I32)?;
    let slots = metadata(b, inputs::SLOT_MAPPING, vec![rows], DType::I32)?;
    let width = ctx / cache.block_size;
    let block_tables = metadata(b, inputs::BLOCK_TABLES, vec![seqs, width], DType::I32)?;
    let (roots, state) = root_inputs(cfg, b, cache)?;
    let (cos, sin) = rope::cos_sin(cfg, &positions)?;
    let ctx_slots = context_slots(&block_tables, ctx, cache.block_size)?;
    Ok(StepInputs {
        input_ids,
        positions,
        roots,
        state,
        ctx,
        cos,
        sin,
        slots,
        ctx_slots,
    })
}

impl StepInputs {
    /// Embeds the tokens and runs every layer with `attn`; returns the final normalized hidden
    /// states and the updated roots.
    fn forward(
        &self,
        cfg: &ModelConfig,
        w: &Weights,
        visible: &Tensor,
        attn: AttnFn,
        strategy: MoeStrategy,
    ) -> Result<(Tensor, Roots)> {
        let x = embed(w, &self.input_ids)?;
        let step = self.attn_step(visible);
        decoder(cfg, w, x, self.roots.clone(), &step, attn, strategy)
    }

    /// What every layer's attention reads of this step, with `visible` its mask.
    fn attn_step<'a>(&'a self, visible: &'a Tensor) -> AttnStep<'a> {
        AttnStep {
            cos: &self.cos,
            sin: &self.sin,
            slots: &self.slots,
            ctx_slots: &self.ctx_slots,
            visible,
            seq_ctx: self.ctx,
        }
    }
}

/// The decode graph for `spec.rows` sequences of one new token each, attending to up to
/// `spec.ctx` positions.
pub fn build_decode(
    cfg: &ModelConfig,
    specs: &WeightSpecs,
    cache: &CacheLayout,
    spec: &GraphSpec,
) -> Result<Graph> {
    check_spec(spec, cache)?;
    let (rows, ctx) = (spec.rows, spec.ctx);
    let name = match spec.sampler {
        Sampler::Full => format!("decode_b{rows}_c{ctx}"),
        Sampler::Greedy => format!("decode_greedy_b{rows}_c{ctx}"),
        Sampler::Deferred => format!("decode_logits_b{rows}_c{ctx}"),
        Sampler::Rejection => format!("verify_b{rows}_c{ctx}"),
    };
    let b = GraphBuilder::new(name);
    let w = Weights::new(&b, specs);
    let s = step_inputs(&b, cfg, cache, rows, rows, ctx)?;
    let context_lens = metadata(&b, inputs::CONTEXT_LENS, vec![rows], DType::I32)?;
    let j = b.iota([rows, ctx], DType::I32, 1)?;
    let visible = j.lt(&context_lens.unsqueeze(1)?)?;
    let (x, new_roots) = s.forward(cfg, &w, &visible, attention::decode, spec.moe)?;
    output_hidden(&b, cfg, &x)?;
    let logits = lm_logits(cfg, &w, &x)?;
    let vocab = w.vocab_slice()?;
    let (next, state) = decode_tail(
        &b,
        spec.sampler,
        &logits,
        &vocab,
        &s.state,
        &s.input_ids,
        &s.positions,
    )?;
    step_outputs(&b, next.as_ref(), &logits, spec.logits)?;
    output_roots(&b, &new_roots, &s.roots, (&state, &s.state))?;
    b.finish()
}

/// The sampler at the end of a decode graph over `logits` (`[rows, this rank's vocabulary
/// slice]`) of the rows that fed `input_ids` at `positions`: the next tokens (none with
/// [`Sampler::Deferred`], whose graph ends at the logits) and the sampling-state root's new
/// value (`state` when the rows' token counts are left alone). Every model's decode graph ends
/// in it, so each draws its tokens the same way.
pub(crate) fn decode_tail(
    b: &GraphBuilder,
    sampler: Sampler,
    logits: &Tensor,
    vocab: &VocabSlice,
    state: &Tensor,
    input_ids: &Tensor,
    positions: &Tensor,
) -> Result<(Option<Tensor>, Tensor)> {
    let rows = logits.dim(0);
    match sampler {
        Sampler::Full => {
            let state_rows = b.metadata(inputs::STATE_ROWS, [rows], DType::I32)?;
            let (new_state, counts, prompt) = logits::decode_state(state, &state_rows, input_ids)?;
            let next = sample_rows(b, logits, vocab, positions, &counts, &prompt, None)?;
            Ok((Some(next), new_state))
        }
        // No row of a greedy step has a penalty, now or later (a request's parameters are
        // fixed and a step with one penalised row samples in full), so no row's token counts
        // are ever read: the state root goes out as it came in. A penalised request that later
        // takes the row starts it afresh (its prompt is prefilled from position 0: penalised
        // sequences are never prefix-cached). Updating it cost a few vocabulary-wide ops a
        // step (benches/LOG.md, "Step overhead outside the matmuls").
        Sampler::Greedy => Ok((Some(vocab.argmax(logits)?), state.clone())),
        Sampler::Deferred => Ok((None, state.clone())),
        // A decode-shaped verify step (a device's, see `StepKind::Verify`): every row one
        // position of a chunk, the rows of a chunk consecutive, `seq_ids` naming each row's
        // chunk and `last_index` each chunk's last row.
        Sampler::Rejection => {
            let last_index = b.metadata(inputs::LAST_INDEX, [rows], DType::I32)?;
            let seq_ids = b.metadata(inputs::SEQ_IDS, [rows], DType::I32)?;
            let fed = (input_ids, positions, state);
            let (next, state) = verify_tail(b, logits, vocab, fed, &last_index, Some(&seq_ids))?;
            Ok((Some(next), state))
        }
    }
}

/// Declares a step graph's `next_tokens` (when it samples) and the logits `want` asks for
/// (all of `logits`; a graph that defers its sampling always returns them).
pub(crate) fn step_outputs(
    b: &GraphBuilder,
    next: Option<&Tensor>,
    logits: &Tensor,
    want: LogitsOutput,
) -> Result<()> {
    match next {
        Some(next) => {
            b.output("next_tokens", next)?;
            match want {
                LogitsOutput::None => Ok(()),
                _ => b.output(STEP_LOGITS, logits),
            }
        }
        None => b.output(STEP_LOGITS, logits),
    }
}

/// The sampling half of a split decode step of `rows` rows ([`Sampler::Deferred`]): the logit
/// controls and sampler of [`Sampler::Full`] over the logits the step's forward graph left on
/// the device ([`STEP_LOGITS`], an [`InputRole::Carried`] input bound to that graph's output),
/// counting the fed tokens in the sampling-state root as the fused graph does. It reads the
/// same inputs and runs the same ops on the same logits, so it draws the same tokens.
pub fn build_sample(
    cfg: &ModelConfig,
    specs: &WeightSpecs,
    cache: &CacheLayout,
    rows: usize,
) -> Result<Graph> {
    let (b, w, logits) = carried_logits(cfg, specs, "sample", rows)?;
    let input_ids = metadata(&b, inputs::INPUT_IDS, vec![rows], DType::I32)?;
    let positions = metadata(&b, inputs::POSITIONS, vec![rows], DType::I32)?;
    let state_rows = metadata(&b, inputs::STATE_ROWS, vec![rows], DType::I32)?;
    let root = cache_roots(cfg, cache)?
        .into_iter()
        .find(|r| r.name == logits::STATE_ROOT)
        .ok_or_else(|| Error::shape("cache", "no sampling-state root"))?;
    let state = b.input(
        root.name,
        InputRole::CacheRoot,
        root.shape().to_vec(),
        root.dtype,
    )?;
    let (new_state, counts, prompt) = logits::decode_state(&state, &state_rows, &input_ids)?;
    let vocab = w.vocab_slice()?;
    let next = sample_rows(&b, &logits, &vocab, &positions, &counts, &prompt, None)?;
    b.output("next_tokens", &next)?;
    b.output_aliased(logits::STATE_ROOT, &new_state, &state)?;
    b.finish()
}

/// The greedy half of a split decode step of `rows` rows: each row's argmax of the logits the
/// step's forward graph left on the device, which is what [`build_sample`] draws for rows that
/// are greedy with no logit controls (the case [`Sampler::Greedy`] covers in a fused graph),
/// without its vocabulary-wide filters and draw and without touching the token counts.
pub fn build_argmax(cfg: &ModelConfig, specs: &WeightSpecs, rows: usize) -> Result<Graph> {
    let (b, w, logits) = carried_logits(cfg, specs, "argmax", rows)?;
    let next = w.vocab_slice()?.argmax(&logits)?;
    b.output("next_tokens", &next)?;
    b.finish()
}

/// The start of a graph `{kind}_b{rows}` over a split step's carried logits (`[rows, this
/// rank's vocabulary slice]`, see [`STEP_LOGITS`]): its builder, weights and the logits input.
fn carried_logits<'a>(
    cfg: &ModelConfig,
    specs: &'a WeightSpecs,
    kind: &str,
    rows: usize,
) -> Result<(GraphBuilder, Weights<'a>, Tensor)> {
    let width = lm_head_width(cfg, specs)?;
    if rows == 0 {
        return Err(Error::shape("bucket", format!("a {kind} graph of no rows")));
    }
    let b = GraphBuilder::new(format!("{kind}_b{rows}"));
    let w = Weights::new(&b, specs);
    let logits = b.input(
        STEP_LOGITS,
        InputRole::Carried,
        vec![rows, width],
        DType::F32,
    )?;
    Ok((b, w, logits))
}

/// The columns of this rank's LM head: the width of the logits a forward graph leaves.
fn lm_head_width(cfg: &ModelConfig, specs: &WeightSpecs) -> Result<usize> {
    let head = ModelWeights::lm_head_name(cfg);
    match specs.shape(head) {
        Some(&[width, _]) => Ok(width),
        other => Err(Error::shape(
            "weight",
            format!("the LM head `{head}` is {other:?}, not a matrix"),
        )),
    }
}

/// The prefill graph for chunks of up to `spec.seqs` sequences, `spec.rows` tokens in all,
/// whose earlier tokens are already cached, each attending to up to `spec.ctx` positions of its
/// own sequence.
///
/// With [`Sampler::Greedy`] it is speculative decoding's verify graph: every position's argmax
/// (`next_tokens` is `[t]`), the token counts left alone, every position's logits on request
/// (see `engine::speculative`).
///
/// With one sequence, every token belongs to it. With several (a packed prefill), `seq_ids`
/// says whose each token is, and the context is every sequence's `ctx` positions side by side
/// (`[s * ctx]`, in block-table row order): a token sees the positions of its own sequence up
/// to its own, nothing of the others'. Attention then costs `t x s * ctx` scores where `s`
/// separate steps would cost `s` times `t_i x ctx`; the buckets only pack where `s * ctx` is at
/// most the longest context (see `deployment::Buckets::packed_seqs`), so a packed step never
/// attends wider than one full-context prefill does.
pub fn build_prefill(
    cfg: &ModelConfig,
    specs: &WeightSpecs,
    cache: &CacheLayout,
    spec: &GraphSpec,
) -> Result<Graph> {
    check_spec(spec, cache)?;
    let (t, seqs, ctx) = (spec.rows, spec.seqs.max(1), spec.ctx);
    if seqs > t {
        return Err(Error::shape(
            "bucket",
            format!("a prefill of {t} tokens cannot carry {seqs} sequences"),
        ));
    }
    let verify = matches!(spec.sampler, Sampler::Greedy | Sampler::Rejection);
    let name = match (verify, seqs) {
        (true, s) => format!("verify_t{t}_s{s}_c{ctx}"),
        (false, 1) => format!("prefill_t{t}_c{ctx}"),
        (false, s) => format!("prefill_t{t}_s{s}_c{ctx}"),
    };
    let b = GraphBuilder::new(name);
    let w = Weights::new(&b, specs);
    let s = step_inputs(&b, cfg, cache, t, seqs, ctx)?;
    let last_index = metadata(&b, inputs::LAST_INDEX, vec![seqs], DType::I32)?;
    let (visible, seq_ids) = chunk_visibility(&b, &s.positions, seqs, ctx)?;
    let (x, new_roots) = s.forward(cfg, &w, &visible, attention::prefill, spec.moe)?;
    output_hidden(&b, cfg, &x)?;
    if verify {
        let logits = lm_logits(cfg, &w, &x)?;
        let vocab = w.vocab_slice()?;
        let (next, state) = match spec.sampler {
            // Every position's argmax, the token counts left alone (as a greedy decode step).
            Sampler::Greedy => (vocab.argmax(&logits)?, s.state.clone()),
            _ => {
                let fed = (&s.input_ids, &s.positions, &s.state);
                verify_tail(&b, &logits, &vocab, fed, &last_index, seq_ids.as_ref())?
            }
        };
        b.output("next_tokens", &next)?;
        if spec.logits != LogitsOutput::None {
            b.output(STEP_LOGITS, &logits)?;
        }
        output_roots(&b, &new_roots, &s.roots, (&state, &s.state))?;
        return b.finish();
    }
    let last_logits = lm_logits(cfg, &w, &x.index_select(&last_index, 0)?)?;
    let vocab = w.vocab_slice()?;
    let (next, state) = prefill_tail(
        &b,
        &last_logits,
        &vocab,
        &s.state,
        &s.input_ids,
        &s.positions,
        &last_index,
        seq_ids.as_ref(),
    )?;
    b.output("next_tokens", &next)?;
    match spec.logits {
        LogitsOutput::None => {}
        LogitsOutput::Sampled => b.output("logits", &last_logits)?,
        LogitsOutput::AllPositions => b.output("logits", &lm_logits(cfg, &w, &x)?)?,
    }
    output_roots(&b, &new_roots, &s.roots, (&state, &s.state))?;
    b.finish()
}

/// The rejection sampler at the end of a verify graph ([`Sampler::Rejection`]) over every
/// position's `logits` (`[t, this rank's vocabulary slice]`) of the tokens fed (their ids,
/// positions, and the sampling-state root before the step) in chunks that end at rows
/// `last_index`, token `i` being chunk `seq_ids[i]`'s (all the one chunk's without
/// `seq_ids`): each position's token, verifying the token fed after it in its chunk as a draft
/// ([`sampling::verify`]), and the sampling-state root's new value.
///
/// Position `i` is penalised as the decode step that fed its token would have been: its
/// chunk's counts (the `state_rows` input has a row per position, each its chunk's) plus the
/// chunk's tokens up to `i`, every one generated (a verify chunk is a decoding sequence's last
/// token and its drafts). Each chunk's row is then written back as it stands after the
/// drafts the step accepts: through the first position whose token is not the draft after it
/// (every position of a chunk writes the same row, so the duplicates agree).
fn verify_tail(
    b: &GraphBuilder,
    logits: &Tensor,
    vocab: &VocabSlice,
    (ids, positions, state): (&Tensor, &Tensor, &Tensor),
    last_index: &Tensor,
    seq_ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let t = ids.dim(0);
    let chunk = match seq_ids {
        Some(c) => c.clone(),
        None => b.full(0.0, [t], DType::I32)?,
    };
    let last = last_index.index_select(&chunk, 0)?;
    let i = b.iota([t], DType::I32, 0)?;
    // Each position's draft: the token fed after it in its chunk (none at a chunk's last).
    let has_draft = i.lt(&last)?;
    let after = match t {
        1 => ids.clone(),
        _ => b.cat(&[&ids.narrow(0, 1, t - 1)?, &ids.narrow(0, 0, 1)?], 0)?,
    };
    let drafts = has_draft.where_cond(&after, &after.full_like(-1.0)?)?;
    // upto[i, j]: j is a real token of i's chunk, not after i.
    let (row, col) = (
        b.iota([t, t], DType::I32, 0)?,
        b.iota([t, t], DType::I32, 1)?,
    );
    let own = chunk
        .unsqueeze(1)?
        .broadcast_as([t, t])?
        .eq(&chunk.unsqueeze(0)?.broadcast_as([t, t])?)?;
    let real = col.le(&last.unsqueeze(0)?.broadcast_as([t, t])?)?;
    let own = own.where_cond(&real, &own)?;
    let upto = own.where_cond(&col.le(&row)?, &own)?;
    let width = state.dim(1) / 2;
    let state_rows = b.metadata(inputs::STATE_ROWS, [t], DType::I32)?;
    let old = state.index_select(&state_rows, 0)?;
    let one = b.full(1.0, [t, t], DType::F32)?;
    let fed = upto
        .where_cond(&one, &one.full_like(0.0)?)?
        .matmul(&logits::one_hot(ids, width)?)?;
    let counts = old.narrow(1, 0, width)?.add(&fed)?;
    let prompt = old.narrow(1, width, width)?;
    let next = sample_rows(b, logits, vocab, positions, &counts, &prompt, Some(&drafts))?;
    // Each chunk's first position whose token is not its draft: where the chunk stops.
    let accepted = has_draft.where_cond(&next.eq(&drafts)?, &has_draft)?;
    let never = col.lt(&col)?;
    let stops = accepted
        .unsqueeze(0)?
        .broadcast_as([t, t])?
        .where_cond(&never, &own)?;
    let end = stops.where_cond(&col, &col.full_like(t as f64)?)?.min(1)?;
    let rows = b.cat(&[&counts, &prompt], 1)?.index_select(&end, 0)?;
    Ok((next, state.scatter_rows(&state_rows, 0, &rows)?))
}

/// Returns the rows' last hidden states `x` as [`mtp::HIDDEN`] when the model drafts with an
/// MTP layer, which reads them (see [`mtp`]).
fn output_hidden(b: &GraphBuilder, cfg: &ModelConfig, x: &Tensor) -> Result<()> {
    match cfg.draft_layers {
        0 => Ok(()),
        _ => b.output(mtp::HIDDEN, x),
    }
}

/// What each token of a prefill-shaped step of `seqs` chunks sees: its own sequence's positions
/// up to its own (causal within a sequence). With several chunks (a packed step) it declares
/// `seq_ids` (each token's chunk) and returns it with the `[t, seqs * ctx]` mask; with one, the
/// mask is `[t, ctx]`.
fn chunk_visibility(
    b: &GraphBuilder,
    positions: &Tensor,
    seqs: usize,
    ctx: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let t = positions.dim(0);
    if seqs == 1 {
        let j = b.iota([t, ctx], DType::I32, 1)?;
        return Ok((j.le(&positions.unsqueeze(1)?)?, None));
    }
    let seq_ids = metadata(b, inputs::SEQ_IDS, vec![t], DType::I32)?;
    let pos = b.iota([t, seqs, ctx], DType::I32, 2)?;
    let owner = b.iota([t, seqs, ctx], DType::I32, 1)?;
    let causal = pos.le(&positions.reshape([t, 1, 1])?)?;
    let own = owner.eq(&seq_ids.reshape([t, 1, 1])?)?;
    let visible = own.where_cond(&causal, &own)?.reshape([t, seqs * ctx])?;
    Ok((visible, Some(seq_ids)))
}

/// The sampler at the end of a prefill graph of `t` tokens (`input_ids` at `positions`) in
/// chunks that end at rows `last_index` (`[seqs]`), token `i` being chunk `seq_ids[i]`'s (all
/// the one chunk's without `seq_ids`): each chunk's next token, drawn from `last_logits`
/// (`[seqs, this rank's vocabulary slice]`), and the sampling-state root's new value, the
/// chunks' tokens counted in their rows. Every model's prefill graph ends in it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_tail(
    b: &GraphBuilder,
    last_logits: &Tensor,
    vocab: &VocabSlice,
    state: &Tensor,
    input_ids: &Tensor,
    positions: &Tensor,
    last_index: &Tensor,
    seq_ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (t, seqs) = (input_ids.dim(0), last_index.dim(0));
    let last_pos = positions.index_select(last_index, 0)?;
    // Token i feeds chunk c when it is c's (seq_ids) and not past c's last token (padding).
    let token = b.iota([seqs, t], DType::I32, 1)?;
    let upto = token.le(&last_index.unsqueeze(1)?.broadcast_as([seqs, t])?)?;
    let member = match seq_ids {
        None => upto,
        Some(ids) => {
            let chunk = b.iota([seqs, t], DType::I32, 0)?;
            let own = chunk.eq(&ids.unsqueeze(0)?.broadcast_as([seqs, t])?)?;
            own.where_cond(&upto, &own)?
        }
    };
    let state_rows = b.metadata(inputs::STATE_ROWS, [seqs], DType::I32)?;
    let prompt_lens = metadata(b, inputs::PROMPT_LENS, vec![seqs], DType::I32)?;
    let (new_state, counts, prompt) = logits::prefill_state(
        state,
        &state_rows,
        &member,
        positions,
        &prompt_lens,
        input_ids,
    )?;
    let next = sample_rows(b, last_logits, vocab, &last_pos, &counts, &prompt, None)?;
    Ok((next, new_state))
}
