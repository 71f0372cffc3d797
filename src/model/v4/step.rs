//! DeepSeek-V4's step graph over typed cache roots: a chunked, packed prefill or a decode step,
//! the same contract as MLA's steps (`input_ids`, `positions`, `slot_mapping`, `block_tables`,
//! and `seq_ids` for a packed prefill). Every state a later step needs lives in a root, so any
//! split of a prompt into chunks computes what one forward over the whole sequence computes
//! ([`super::forward`]); `docs/deepseek-v4.md` has the design.
//!
//! | root | rows | per row, for each layer that has it |
//! |---|---|---|
//! | [`SWA_ROOT`] | token slots | the token's shared K=V (`head_dim`), every layer |
//! | [`SOURCE_ROOT`] | token slots | compressed layers: the compressor's value and gate (`ape` added) per token, CSA's indexer's too |
//! | [`CSA_ROOT`] / [`HCA_ROOT`] | entry rows, one per `min(rate, block)` slots, plus a dump row | the pooled entry (`head_dim`) and, for CSA, the indexer's key |
//!
//! **Entries.** Window `w` of a sequence (positions `[w m, (w + 1) m)`, `m` the layer's rate)
//! is pooled by the step that feeds its last token, from the source rows of its tokens (CSA: of
//! the window before it too), whichever steps wrote them. Its entry goes to the entry row
//! `slot / min(m, block)` of that last token's slot: one row per window, within the blocks the
//! sequence owns (the rate and the block size must divide one another). Every token pools the
//! latest window (the graph is the same every step); a token that completes none writes its
//! pool to the dump row, the root's last, which nothing reads.
//!
//! **Reads.** A query at position `p` attends to the window's `sliding_window` positions up to
//! its own (gathered per query through its block table), and to the entries `w < (p + 1) / m`
//! of its sequence (HCA: all; CSA: those the lightning indexer picks). A decode row gathers its
//! own sequence's `ctx / m` entries; a packed prefill scores its tokens against every chunk's
//! entries side by side and masks the other sequences', as MLA's prefill does.
//!
//! Outputs: `logits` (`[n, vocab]`, every fed token's) and the updated roots under their
//! input names, aliased. Weights are f32 inputs by published name, as in [`super::forward`].

use crate::config::v4::{V4Attention, V4Config};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Literal, Tensor};
use crate::model::{inputs, slots_at, CacheLayout, RootSpec};

use super::attention::{self as attn, and, Keys};
use super::weights::{linear, Rope, Weights};

/// Every layer's shared K=V per token slot.
pub const SWA_ROOT: &str = "swa_kv";
/// The compressed layers' compressor inputs per token slot.
pub const SOURCE_ROOT: &str = "compressor_src";
/// The CSA layers' pooled entries and index keys.
pub const CSA_ROOT: &str = "csa_entries";
/// The HCA layers' pooled entries.
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
}

/// Where one layer keeps its cache: first columns in the roots.
#[derive(Debug, Clone, Copy)]
struct LayerCache {
    /// Its K=V in [`SWA_ROOT`] (`head_dim` wide).
    swa: usize,
    /// Compressed layers: its compressor inputs in [`SOURCE_ROOT`].
    source: usize,
    /// Compressed layers: its entries in its rate's entry root.
    entries: usize,
}

/// The roots' columns per layer, and their specs.
struct Layout {
    layers: Vec<LayerCache>,
    roots: Vec<RootSpec>,
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

/// The rate of a compressed layer kind.
fn rate(cfg: &V4Config, kind: V4Attention) -> usize {
    match kind {
        V4Attention::CompressedSparse => cfg.csa_rate,
        _ => cfg.hca_rate,
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

impl Layout {
    fn new(cfg: &V4Config, cache: &CacheLayout) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let (mut source, mut csa, mut hca) = (0, 0, 0);
        for (l, &kind) in cfg.attention.iter().enumerate() {
            let entries = match kind {
                V4Attention::Sliding => 0,
                V4Attention::CompressedSparse => csa,
                V4Attention::HeavilyCompressed => hca,
            };
            layers.push(LayerCache {
                swa: l * cfg.head_dim,
                source,
                entries,
            });
            source += source_width(cfg, kind);
            match kind {
                V4Attention::Sliding => {}
                V4Attention::CompressedSparse => csa += entry_width(cfg, kind),
                V4Attention::HeavilyCompressed => hca += entry_width(cfg, kind),
            }
        }
        let slots = cache.num_slots;
        let mut roots = vec![RootSpec {
            name: SWA_ROOT,
            rows: slots,
            cols: cfg.num_hidden_layers * cfg.head_dim,
            dtype: cache.dtype,
        }];
        if source > 0 {
            roots.push(RootSpec {
                name: SOURCE_ROOT,
                rows: slots,
                cols: source,
                dtype: cache.dtype,
            });
        }
        for (name, cols, rate) in [(CSA_ROOT, csa, cfg.csa_rate), (HCA_ROOT, hca, cfg.hca_rate)] {
            if cols > 0 {
                roots.push(RootSpec {
                    name,
                    rows: slots / entry_stride(rate, cache.block_size)? + 1,
                    cols,
                    dtype: cache.dtype,
                });
            }
        }
        Ok(Layout { layers, roots })
    }
}

/// The cache roots of `cfg` under `cache`, in the order the step graphs declare them.
pub fn cache_roots(cfg: &V4Config, cache: &CacheLayout) -> Result<Vec<RootSpec>> {
    Ok(Layout::new(cfg, cache)?.roots)
}

/// The roots as a step sees them, updated as its layers write.
struct Roots {
    swa: Tensor,
    source: Option<Tensor>,
    csa: Option<Tensor>,
    hca: Option<Tensor>,
}

impl Roots {
    fn root(&mut self, name: &'static str) -> Result<&mut Tensor> {
        let root = match name {
            SOURCE_ROOT => self.source.as_mut(),
            CSA_ROOT => self.csa.as_mut(),
            HCA_ROOT => self.hca.as_mut(),
            _ => Some(&mut self.swa),
        };
        root.ok_or_else(|| Error::shape("cache", format!("no `{name}` root")))
    }
}

/// What every layer reads from the step's metadata.
struct Step {
    positions: Tensor,
    slots: Tensor,
    /// Each fed token's sequence's block table, `[n, ctx / block]`.
    tables: Tensor,
    /// The sequences' block tables, `[seqs, ctx / block]`.
    seq_tables: Tensor,
    /// Each fed token's sequence (its row of `seq_tables`), `[n]`.
    seq_ids: Tensor,
    block: usize,
    ctx: usize,
    decode: bool,
    main: Rope,
    compress: Rope,
}

/// The step graph of `spec` over `cfg`'s cache roots under `cache`.
pub fn build_step(cfg: &V4Config, cache: &CacheLayout, spec: &V4Step) -> Result<Graph> {
    let V4Step {
        rows: n,
        seqs,
        ctx,
        decode,
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
    let name = match decode {
        true => format!("v4_decode_b{n}_c{ctx}"),
        false => format!("v4_prefill_t{n}_s{seqs}_c{ctx}"),
    };
    let b = GraphBuilder::new(name);
    let w = Weights::declare(&b, cfg)?;
    let meta =
        |name: &str, shape: Vec<usize>| b.input(name, InputRole::Metadata, shape, DType::I32);
    let ids = meta(inputs::INPUT_IDS, vec![n])?;
    let positions = meta(inputs::POSITIONS, vec![n])?;
    let slots = meta(inputs::SLOT_MAPPING, vec![n])?;
    let seq_tables = meta(inputs::BLOCK_TABLES, vec![seqs, ctx / block])?;
    let mut old = Vec::with_capacity(layout.roots.len());
    for r in &layout.roots {
        old.push((
            r.name,
            b.input(r.name, InputRole::CacheRoot, r.shape().to_vec(), r.dtype)?,
        ));
    }
    let find = |name: &str| old.iter().find(|(n, _)| *n == name).map(|(_, t)| t.clone());
    let mut roots = Roots {
        swa: find(SWA_ROOT).ok_or_else(|| Error::shape("cache", "no window root"))?,
        source: find(SOURCE_ROOT),
        csa: find(CSA_ROOT),
        hca: find(HCA_ROOT),
    };
    let seq_ids = match (decode, seqs) {
        (true, _) => b.iota([n], DType::I32, 0)?,
        (false, 1) => b.full(0.0, [n], DType::I32)?,
        (false, _) => meta(inputs::SEQ_IDS, vec![n])?,
    };
    let step = Step {
        tables: seq_tables.index_select(&seq_ids, 0)?,
        seq_tables,
        seq_ids,
        block,
        ctx,
        decode,
        main: Rope::new(cfg.rope_dim, &cfg.main_rope, &positions)?,
        compress: Rope::new(cfg.rope_dim, &cfg.compress_rope, &positions)?,
        positions,
        slots,
    };
    let logits = super::logits(cfg, &w, &ids, |l, x| {
        attention(cfg, &w, l, layout.layers[l], x, &step, &mut roots)
    })?;
    b.output("logits", &logits)?;
    for (name, input) in &old {
        let new = roots.root(name)?.clone();
        b.output_aliased(*name, &new, input)?;
    }
    b.finish()
}

/// `x / k` for a positive constant `k`: a shift when `k` is a power of two (a NeuronCore
/// computes integer arithmetic in fp32; a shift is exact at any size).
fn div_const(x: &Tensor, k: usize) -> Result<Tensor> {
    match k.is_power_of_two() {
        true => x.shr(&x.full_like(f64::from(k.trailing_zeros()))?),
        false => x.div(&x.full_like(k as f64)?),
    }
}

/// Reads rows `slots` (`[r, k]`) of `width` columns from `col` of `root`, as f32 `[r, k,
/// width]`.
fn read_rows(root: &Tensor, col: usize, width: usize, slots: &Tensor) -> Result<Tensor> {
    let (r, k) = (slots.dim(0), slots.dim(1));
    root.narrow(1, col, width)?
        .index_select(&slots.reshape([r * k])?, 0)?
        .reshape([r, k, width])?
        .to_dtype(DType::F32)
}

/// Writes `rows` (`[n, width]`, f32) at `slots` from column `col` of `root`.
fn write_rows(root: &Tensor, slots: &Tensor, col: usize, rows: &Tensor) -> Result<Tensor> {
    root.scatter_rows(slots, col, &rows.to_dtype(root.dtype())?)
}

/// Layer `l`'s attention for the step's tokens (`x`: `[n, hidden]`, normalised), writing its
/// cache rows into `roots` first.
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
    roots.swa = write_rows(&roots.swa, &step.slots, at.swa, &kv)?;
    let mut sets = vec![window(cfg, step, &roots.swa, at.swa)?];
    if kind != V4Attention::Sliding {
        if let Some(set) = compressed(cfg, w, l, at, x, &q_res, step, roots)? {
            sets.push(set);
        }
    }
    let out = attn::attend(cfg, w, l, &q, &sets)?;
    attn::output(cfg, w, l, &out, rope)
}

/// The sliding window of each query: its sequence's last `sliding_window` positions up to its
/// own (`[n, W, head_dim]`), and which of them exist (`[n, W]`).
fn window(cfg: &V4Config, step: &Step, swa: &Tensor, col: usize) -> Result<(Keys, Tensor)> {
    let (n, span) = (step.positions.dim(0), cfg.sliding_window);
    let pos = positions_before(&step.positions, span)?;
    let exists = pos.ge(&pos.full_like(0.0)?)?;
    let pos = pos.maximum(&pos.full_like(0.0)?)?;
    let slots = slots_at(&step.tables, &pos, step.block)?;
    let keys = read_rows(swa, col, cfg.head_dim, &slots)?;
    debug_assert_eq!(keys.dims(), [n, span, cfg.head_dim]);
    Ok((Keys::PerRow(keys), exists))
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
    let m = rate(cfg, kind);
    let stride = entry_stride(m, step.block)?;
    let (d, ci) = (
        cfg.head_dim,
        cfg.indexer.map(|ix| ix.head_dim).unwrap_or_default(),
    );
    let a = attn::prefix(l);
    let compressor = format!("{a}.compressor");
    let index_compressor = format!("{a}.indexer.compressor");
    let mut compressors = vec![(compressor.as_str(), d)];
    if csa {
        compressors.push((index_compressor.as_str(), ci));
    }
    let series = if csa { 2 } else { 1 };

    // Each token's compressor inputs: value and gate (+ ape at its place in its window).
    let p = &step.positions;
    let place = p.rem(&p.full_like(m as f64)?)?;
    let mut source = Vec::new();
    for (prefix, _) in &compressors {
        source.push(linear(x, w.get(&format!("{prefix}.wkv.weight"))?)?);
        let ape = w.get(&format!("{prefix}.ape"))?.index_select(&place, 0)?;
        source.push(linear(x, w.get(&format!("{prefix}.wgate.weight"))?)?.add(&ape)?);
    }
    let src = roots.root(SOURCE_ROOT)?;
    *src = write_rows(
        src,
        &step.slots,
        at.source,
        &b.cat(&source.iter().collect::<Vec<_>>(), 1)?,
    )?;

    // Each token pools the latest window that has begun to complete: the one it completes, or
    // an earlier one (written to the dump row). Its first position is `start`.
    let next = p.affine(1.0, 1.0)?;
    let start = next
        .sub(&next.rem(&next.full_like(m as f64)?)?)?
        .affine(1.0, -(m as f64))?;
    let start = start.maximum(&start.full_like(0.0)?)?;
    let span = series * m;
    let pos = positions_before(&start.affine(1.0, (m - 1) as f64)?, span)?;
    let exists = pos.ge(&pos.full_like(0.0)?)?;
    let width = source_width(cfg, kind);
    let rows = read_rows(
        src,
        at.source,
        width,
        &slots_at(
            &step.tables,
            &pos.maximum(&pos.full_like(0.0)?)?,
            step.block,
        )?,
    )?;
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
    let root = roots.root(name)?;
    let dump = root.dim(0) - 1;
    let completes = next
        .rem(&next.full_like(m as f64)?)?
        .eq(&next.full_like(0.0)?)?;
    let target = completes.where_cond(
        &div_const(&step.slots, stride)?,
        &step.slots.full_like(dump as f64)?,
    )?;
    *root = write_rows(
        root,
        &target,
        at.entries,
        &b.cat(&entry.iter().collect::<Vec<_>>(), 1)?,
    )?;

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
    let read = read_rows(root, at.entries, entry_width(cfg, kind), &rows)?;
    let kv = read.narrow(2, 0, d)?;
    let ready = div_const(&next, m)?;
    let n = p.dim(0);
    let (keys, visible) = match step.decode {
        true => {
            let e = b.iota([n, entries], DType::I32, 1)?;
            (Keys::PerRow(kv), e.lt(&ready.unsqueeze(1)?)?)
        }
        false => {
            let seqs = r;
            let e = b.iota([n, seqs, entries], DType::I32, 2)?;
            let owner = b.iota([n, seqs, entries], DType::I32, 1)?;
            let own = owner.eq(&step.seq_ids.reshape([n, 1, 1])?)?;
            let visible = and(&own, &e.lt(&ready.reshape([n, 1, 1])?)?)?;
            (
                Keys::Shared(kv.reshape([seqs * entries, d])?),
                visible.reshape([n, seqs * entries])?,
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

/// One compressor quantity (value or gate) of a window's slots (`rows`: `[n, series x m,
/// source width]`, the quantity at column `col`, `series x width` wide): `[n, series x m,
/// width]`. With two series (CSA), the first `m` slots (the previous window) contribute the
/// first series and the last `m` the second.
fn series_of(rows: &Tensor, col: usize, width: usize, series: usize, m: usize) -> Result<Tensor> {
    if series == 1 {
        return rows.narrow(2, col, width);
    }
    let first = rows.narrow(1, 0, m)?.narrow(2, col, width)?;
    let second = rows.narrow(1, m, m)?.narrow(2, col + width, width)?;
    rows.builder().cat(&[&first, &second], 1)
}
