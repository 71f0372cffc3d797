//! DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer and its token selection.
//!
//! Every layer keeps, per token, one extra cached vector: the indexer's key (`index_head_dim`
//! values, LayerNorm-ed and rotated), in the layer's column range of the *state root* (the
//! second cache root, beside the KV root's latents). A query scores each visible token `j` as
//! `sum_h w_h * relu(q_h . k_j / sqrt(d))` with `index_n_heads` small query heads `q_h` (from
//! the query latent) and per-head weights `w_h` (from the hidden state, times
//! `index_n_heads^-0.5`), and MLA then attends only to the `index_topk` best-scoring tokens.
//! Where a context bucket holds no more than `index_topk` positions every visible token is
//! selected, so the graph skips the selection (the keys are still written).
//!
//! The selection is exact and the same in both graphs: the `k` largest scores, a tie broken
//! towards the lower position. transformers' `torch.topk` leaves the order of ties unspecified;
//! the V3.2 fixture is made with a margin at every selection boundary (see
//! `scripts/make_fixtures.py`), so no test depends on it.
//!
//! - Decode ([`top_k_indices`]) gathers the selected latents, so a long-context step reads
//!   `index_topk` latents per layer instead of the whole context. Its top-k is a `sort`, which
//!   neuronx-cc caps at [`MAX_SORT_WIDTH`]; a wider context is cut into tiles of that width,
//!   each tile's top-k found, and the top-k of those candidates taken.
//! - Prefill ([`top_k_mask`]) has many queries per key and computes every score anyway, so it
//!   masks: a per-row threshold found by bisection ([`Tensor::mass_threshold`], no sort), then
//!   the ties at the threshold admitted lowest position first by a second threshold over the
//!   negated positions.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::graph::{DType, Tensor};

use super::attn_step::AttnStep;
use super::ops::{layer_norm, linear, matmul};
use super::{rope, Weights};

/// The widest `sort` neuronx-cc compiles (its `AwsNeuronTopK` rewrite takes k <= 16,384; see
/// `backend::neuron::check::accepted::MAX_SORT_WIDTH`, which the Neuron check enforces).
pub const MAX_SORT_WIDTH: usize = 16_384;

/// `transformers`' `nn.LayerNorm(index_head_dim, eps=1e-6)` of the index key.
const K_NORM_EPS: f64 = 1e-6;

/// Rotates the first `rope_dim` values of each head of `x` (`[n, heads, dim]`) in the
/// half-split layout and keeps the rest.
fn rotate(x: &Tensor, rope_dim: usize, step: &AttnStep<'_>) -> Result<Tensor> {
    let dim = x.dim(2);
    let rotated = rope::apply_half_split(&x.narrow(2, 0, rope_dim)?, step.cos, step.sin)?;
    if dim == rope_dim {
        return Ok(rotated);
    }
    x.builder()
        .cat(&[&rotated, &x.narrow(2, rope_dim, dim - rope_dim)?], 2)
}

/// The index scores of this step's `n` queries, `[n, cols]` f32 with `-inf` where
/// `step.visible` is false, and the state root with the new tokens' index keys written into
/// layer `layer`'s columns.
///
/// `x` is the layer's normalized hidden state (`[n, hidden]`), `q_latent` the normalized query
/// latent (`q_a_layernorm(q_a_proj(x))`, `[n, q_lora_rank]`). In decode (`visible` `[n, ctx]`
/// with one sequence per row) each row is scored against its own sequence's `ctx` positions;
/// in prefill (`visible` `[n, seqs * ctx]`) every row against every packed position, as MLA's
/// prefill does.
pub fn scores(
    cfg: &ModelConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
    q_latent: &Tensor,
    root: &Tensor,
    step: &AttnStep<'_>,
) -> Result<(Tensor, Tensor)> {
    let ix = cfg
        .indexer
        .ok_or_else(|| Error::shape("indexer", "the model has no sparse-attention indexer"))?;
    let p = format!("model.layers.{layer}.self_attn.indexer");
    let (n, heads, dim, rope_dim) = (x.dim(0), ix.n_heads, ix.head_dim, cfg.qk_rope_head_dim);
    let q = linear(w.dots(), q_latent, &w.get(&format!("{p}.wq_b.weight"))?)?
        .reshape([n, heads, dim])?;
    let q = rotate(&q, rope_dim, step)?;
    let k = layer_norm(
        &linear(w.dots(), x, &w.get(&format!("{p}.wk.weight"))?)?,
        &w.get(&format!("{p}.k_norm.weight"))?,
        &w.get(&format!("{p}.k_norm.bias"))?,
        K_NORM_EPS,
    )?
    .reshape([n, 1, dim])?;
    let k = rotate(&k, rope_dim, step)?.reshape([n, dim])?;
    let root = root.scatter_rows(step.slots, layer * dim, &k.to_dtype(root.dtype())?)?;
    let keys = root
        .narrow(1, layer * dim, dim)?
        .index_select(step.ctx_slots, 0)?;
    let cols = step.visible.dim(1);
    let per_head = if keys.dim(0) == cols {
        // Every row against the same positions (prefill, or one decoding sequence).
        matmul(w.dots(), &q.reshape([n * heads, dim])?, &keys.t()?)?.reshape([n, heads, cols])?
    } else {
        // Decode: row i against its own sequence's `cols` positions.
        matmul(w.dots(), &q, &keys.reshape([n, cols, dim])?.t()?)?
    };
    let per_head = per_head.affine((dim as f64).powf(-0.5), 0.0)?;
    let per_head = per_head.maximum(&per_head.full_like(0.0)?)?; // ReLU
    let weights = linear(w.dots(), x, &w.get(&format!("{p}.weights_proj.weight"))?)?
        .affine((heads as f64).powf(-0.5), 0.0)?
        .reshape([n, 1, heads])?;
    let total = matmul(w.dots(), &weights, &per_head)?.reshape([n, cols])?;
    let hidden = total.full_like(f64::NEG_INFINITY)?;
    Ok((step.visible.where_cond(&total, &hidden)?, root))
}

/// The positions (`[rows, k]` i32) of the `k` largest values of each row of `x` (`[rows, n]`
/// f32), largest first, a tie going to the lower position; no `sort` wider than
/// [`MAX_SORT_WIDTH`].
pub fn top_k_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    top_k_indices_within(x, k, MAX_SORT_WIDTH)
}

/// [`top_k_indices`] with no sort wider than `width` (a power of two; tests use small ones to
/// exercise the tiling).
pub fn top_k_indices_within(x: &Tensor, k: usize, width: usize) -> Result<Tensor> {
    let (rows, n) = (x.dim(0), x.dim(1));
    if n <= width {
        return x.topk(k);
    }
    if k > width / 2 || !width.is_power_of_two() {
        return Err(Error::shape(
            "index_topk",
            format!(
                "{k} tokens over a context of {n}: a selection wider than {} cannot be tiled \
                 under a sort limit of {width}",
                width / 2
            ),
        ));
    }
    let tile = width;
    let tiles = n.div_ceil(tile);
    let x = match tiles * tile - n {
        0 => x.clone(),
        pad => {
            let filler = x.narrow(1, 0, pad)?.full_like(f64::NEG_INFINITY)?;
            x.builder().cat(&[x, &filler], 1)?
        }
    };
    let tiled = x.reshape([rows, tiles, tile])?;
    let local = tiled.topk(k)?; // [rows, tiles, k]
    let values = tiled.gather(&local, 2)?.reshape([rows, tiles * k])?;
    // Tile t's first position is t * tile: a shift, since tile is a power of two.
    let tile_no = x.builder().iota([rows, tiles, k], DType::I32, 1)?;
    let first = super::ops::mul_const(&tile_no, tile)?;
    let global = local.add(&first)?.reshape([rows, tiles * k])?;
    // Candidates are in (tile, value, position) order, so among equal values the lower
    // position still comes first: the candidates' own top-k keeps the tie rule.
    let pick = top_k_indices_within(&values, k, width)?;
    global.gather(&pick, 1)
}

/// Which entries of each row of `x` (`[rows, n]` f32) are among its `k` largest (bool
/// `[rows, n]`, exactly `min(k, n)` per row), a tie at the boundary admitted lowest position
/// first; no sort.
pub fn top_k_mask(x: &Tensor, k: usize) -> Result<Tensor> {
    let (rows, n) = (x.dim(0), x.dim(1));
    let b = x.builder();
    let ones = x.full_like(1.0)?;
    let target = b.full(k.min(n) as f64, [rows], DType::F32)?;
    // The k-th largest value, ties included: everything above it is in, some ties are.
    let kth = x
        .mass_threshold(&ones, &target)?
        .unsqueeze(1)?
        .broadcast_as([rows, n])?;
    let above = x.gt(&kth)?;
    let tied = x.eq(&kth)?;
    let zeros = x.full_like(0.0)?;
    let need = target.sub(&above.where_cond(&ones, &zeros)?.sum(1)?)?;
    // Among the ties, the `need` lowest positions: a threshold over the negated positions,
    // weighted by tie membership.
    let neg_pos = b.iota([rows, n], DType::F32, 1)?.neg()?;
    let cut = neg_pos
        .mass_threshold(&tied.where_cond(&ones, &zeros)?, &need)?
        .unsqueeze(1)?
        .broadcast_as([rows, n])?;
    let first_ties = tied.where_cond(&neg_pos.ge(&cut)?, &tied)?;
    above.where_cond(&above, &first_ties)
}
