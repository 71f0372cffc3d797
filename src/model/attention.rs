//! Multi-head latent attention (MLA) over the paged latent cache.
//!
//! Per token and layer the cache holds the normalized latent `c_kv` (`kv_lora_rank`) and the
//! rotated shared key `k_pe` (`qk_rope_head_dim`): one row of `kv_cache_width` values in the
//! layer's column range of the KV root. New rows are scattered into the root at their slots
//! first; the context is then gathered back through the block table, so a token always sees
//! itself and everything before it, whether it came from this step or an earlier one.
//!
//! DeepSeek-V3.2 adds a second cache root, the indexer's keys, and attends only to the tokens
//! its lightning indexer selects ([`super::indexer`]): decode gathers just those latents,
//! prefill masks the rest.
//!
//! Decode absorbs the up-projection (`w_uk` into the query, `w_uv` into the output), so it runs
//! over the latents directly: MQA with one 576-wide key head for V2-Lite/V3. Prefill, where many
//! queries share each key, decompresses keys and values once (`kv_b_proj`) and runs ordinary
//! attention: fewer multiply-adds per (query, key) pair. Decode and prefill logits agree; the
//! tests check it.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::graph::Tensor;

use super::attn_step::AttnStep;
use super::ops::{linear, matmul, rms_norm, softmax};
use super::{indexer, rope, Weights};

/// The cache roots a layer reads and updates: the KV root's latents and, for a model with a
/// sparse-attention indexer (V3.2), the state root's index keys.
#[derive(Debug, Clone)]
pub struct Roots {
    /// `[slots, layers * kv_cache_width]`.
    pub kv: Tensor,
    /// `[slots, layers * index_head_dim]` (V3.2 only).
    pub index: Option<Tensor>,
}

/// This layer's queries: the non-rotated part `[n, heads, nope]`, the rotated part
/// `[n, heads, rope]`, and the normalized query latent `[n, q_lora_rank]` (`None` for a plain
/// `q_proj`), which V3.2's indexer reads too.
struct Queries {
    nope: Tensor,
    pe: Tensor,
    latent: Option<Tensor>,
}

fn queries(
    cfg: &ModelConfig,
    w: &Weights,
    p: &str,
    x: &Tensor,
    step: &AttnStep<'_>,
) -> Result<Queries> {
    let n = x.dim(0);
    let heads = w.heads(cfg);
    let (q, latent) = match cfg.q_lora_rank {
        Some(_) => {
            let qa = linear(w.dots(), x, &w.get(&format!("{p}.q_a_proj.weight"))?)?;
            let qa = rms_norm(
                &qa,
                &w.get(&format!("{p}.q_a_layernorm.weight"))?,
                cfg.rms_norm_eps,
            )?;
            (
                linear(w.dots(), &qa, &w.get(&format!("{p}.q_b_proj.weight"))?)?,
                Some(qa),
            )
        }
        None => (
            linear(w.dots(), x, &w.get(&format!("{p}.q_proj.weight"))?)?,
            None,
        ),
    };
    let q = q.reshape([n, heads, cfg.qk_head_dim()])?;
    let pe = q.narrow(2, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)?;
    Ok(Queries {
        nope: q.narrow(2, 0, cfg.qk_nope_head_dim)?,
        pe: rope::apply(&pe, step.cos, step.sin)?,
        latent,
    })
}

/// V3.2's index scores of this step's queries (`[n, cols]`, `-inf` where not visible) and the
/// updated state root; `None` for a model without an indexer.
fn index_scores(
    cfg: &ModelConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
    q: &Queries,
    roots: &Roots,
    step: &AttnStep<'_>,
) -> Result<Option<(Tensor, Tensor)>> {
    let (Some(root), Some(latent)) = (&roots.index, &q.latent) else {
        return Ok(None);
    };
    indexer::scores(cfg, w, layer, x, latent, root, step).map(Some)
}

/// Computes this step's cache rows (`[n, width]`) and writes them into the layer's columns of
/// the root; returns the updated root.
fn write_cache(
    cfg: &ModelConfig,
    w: &Weights,
    p: &str,
    layer: usize,
    x: &Tensor,
    root: &Tensor,
    step: &AttnStep<'_>,
) -> Result<Tensor> {
    let n = x.dim(0);
    let kv = linear(
        w.dots(),
        x,
        &w.get(&format!("{p}.kv_a_proj_with_mqa.weight"))?,
    )?;
    let c_kv = rms_norm(
        &kv.narrow(1, 0, cfg.kv_lora_rank)?,
        &w.get(&format!("{p}.kv_a_layernorm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    let k_pe = kv
        .narrow(1, cfg.kv_lora_rank, cfg.qk_rope_head_dim)?
        .reshape([n, 1, cfg.qk_rope_head_dim])?;
    let k_pe = rope::apply(&k_pe, step.cos, step.sin)?.reshape([n, cfg.qk_rope_head_dim])?;
    let row = x
        .builder()
        .cat(&[&c_kv, &k_pe], 1)?
        .to_dtype(root.dtype())?;
    root.scatter_rows(step.slots, layer * cfg.kv_cache_width(), &row)
}

/// Every context row of this layer, `[seqs * ctx, width]`.
fn read_cache(
    cfg: &ModelConfig,
    layer: usize,
    root: &Tensor,
    step: &AttnStep<'_>,
) -> Result<Tensor> {
    let width = cfg.kv_cache_width();
    root.narrow(1, layer * width, width)?
        .index_select(step.ctx_slots, 0)
}

fn masked_softmax(scores: &Tensor, visible: &Tensor) -> Result<Tensor> {
    let neg = scores.full_like(f64::NEG_INFINITY)?;
    let last = scores.rank() - 1;
    softmax(
        &visible
            .broadcast_as(scores.shape().clone())?
            .where_cond(scores, &neg)?,
        last,
    )
}

/// Decode attention for `b` sequences, one new token each (absorbed MLA). Returns the
/// attention output `[b, hidden]` (this rank's heads' share of it under tensor parallelism)
/// and the updated root.
pub fn decode(
    cfg: &ModelConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
    roots: &Roots,
    step: &AttnStep<'_>,
) -> Result<(Tensor, Roots)> {
    let p = format!("model.layers.{layer}.self_attn");
    let b = x.dim(0);
    let heads = w.heads(cfg);
    let (width, rank) = (cfg.kv_cache_width(), cfg.kv_lora_rank);
    let q = queries(cfg, w, &p, x, step)?;
    let (q_nope, q_pe) = (&q.nope, &q.pe);
    let root = write_cache(cfg, w, &p, layer, x, &roots.kv, step)?;
    let ctx = step.visible.dim(1);
    let index = index_scores(cfg, w, layer, x, &q, roots, step)?;
    // With an indexer and a context wider than its top-k, attend to the selected latents only:
    // gather their slots, and keep those that are visible (a short sequence in a wide bucket
    // selects hidden positions too; their score is -inf).
    let (kv, visible) = match (&index, cfg.indexer) {
        (Some((scores, _)), Some(ix)) if ix.topk < ctx => {
            let picked = indexer::top_k_indices(scores, ix.topk)?; // [b, topk]
            let slots = step
                .ctx_slots
                .reshape([b, ctx])?
                .gather(&picked, 1)?
                .reshape([b * ix.topk])?;
            let kv = root
                .narrow(1, layer * width, width)?
                .index_select(&slots, 0)?
                .reshape([b, ix.topk, width])?;
            let picked_scores = scores.gather(&picked, 1)?;
            let visible = picked_scores.gt(&picked_scores.full_like(f64::NEG_INFINITY)?)?;
            (kv, visible)
        }
        _ => (
            read_cache(cfg, layer, &root, step)?.reshape([b, ctx, width])?,
            step.visible.clone(),
        ),
    };

    // The absorbed up-projections are slices of kv_b_proj viewed as [heads, nope + v, rank]:
    // w_uk[h] = its first nope rows, w_uv[h] the v after them.
    let nope = cfg.qk_nope_head_dim;
    let kv_b =
        w.get(&format!("{p}.kv_b_proj.weight"))?
            .reshape([heads, nope + cfg.v_head_dim, rank])?;
    let w_uk = kv_b.narrow(1, 0, nope)?;
    let w_uv = kv_b.narrow(1, nope, cfg.v_head_dim)?;
    // q_lat[b, h] = q_nope[b, h] @ w_uk[h]: heads as the batch dimension.
    let q_lat = matmul(w.dots(), &q_nope.permute(&[1, 0, 2])?, &w_uk)?.permute(&[1, 0, 2])?; // [b, heads, rank]
    let q = x.builder().cat(&[&q_lat, q_pe], 2)?; // [b, heads, width]
    let scores = matmul(w.dots(), &q, &kv.t()?)? // [b, heads, ctx or topk]
        .affine(rope::softmax_scale(cfg), 0.0)?;
    let probs = masked_softmax(&scores, &visible.unsqueeze(1)?)?;
    let o_lat = matmul(w.dots(), &probs, &kv.narrow(2, 0, rank)?)?; // [b, heads, rank]
    let o = matmul(w.dots(), &o_lat.permute(&[1, 0, 2])?, &w_uv.t()?)? // [heads, b, v]
        .permute(&[1, 0, 2])?
        .reshape([b, heads * cfg.v_head_dim])?;
    let roots = Roots {
        kv: root,
        index: index.map(|(_, r)| r),
    };
    Ok((
        linear(w.dots(), &o, &w.get(&format!("{p}.o_proj.weight"))?)?,
        roots,
    ))
}

/// Prefill attention for `n` tokens of one or more sequences (decompressed MLA; the mask keeps
/// each token to its own sequence's context). Returns the attention
/// output `[n, hidden]` (this rank's heads' share under tensor parallelism) and the updated
/// root.
pub fn prefill(
    cfg: &ModelConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
    roots: &Roots,
    step: &AttnStep<'_>,
) -> Result<(Tensor, Roots)> {
    let p = format!("model.layers.{layer}.self_attn");
    let n = x.dim(0);
    let heads = w.heads(cfg);
    let (nope, rdim, vdim, rank) = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    );
    let q = queries(cfg, w, &p, x, step)?;
    let (q_nope, q_pe) = (&q.nope, &q.pe);
    let root = write_cache(cfg, w, &p, layer, x, &roots.kv, step)?;
    let ctx = step.visible.dim(1);
    let index = index_scores(cfg, w, layer, x, &q, roots, step)?;
    // With an indexer and a sequence context wider than its top-k, mask all but the selected.
    let visible = match (&index, cfg.indexer) {
        (Some((scores, _)), Some(ix)) if ix.topk < step.seq_ctx => {
            let selected = indexer::top_k_mask(scores, ix.topk)?;
            selected.where_cond(step.visible, &selected)?
        }
        _ => step.visible.clone(),
    };
    let kv = read_cache(cfg, layer, &root, step)?; // [ctx, width]
    let kv_up = linear(
        w.dots(),
        &kv.narrow(1, 0, rank)?,
        &w.get(&format!("{p}.kv_b_proj.weight"))?,
    )?
    .reshape([ctx, heads, nope + vdim])?
    .permute(&[1, 0, 2])?; // [heads, ctx, nope + v]
    let k_nope = kv_up.narrow(2, 0, nope)?;
    let v = kv_up.narrow(2, nope, vdim)?;
    let k_pe = kv.narrow(1, rank, rdim)?; // [ctx, rope]

    let qn = q_nope.permute(&[1, 0, 2])?; // [heads, n, nope]
    let qp = q_pe.permute(&[1, 0, 2])?.reshape([heads * n, rdim])?;
    let s_nope = matmul(w.dots(), &qn, &k_nope.t()?)?; // [heads, n, ctx]
    let s_pe = matmul(w.dots(), &qp, &k_pe.t()?)?.reshape([heads, n, ctx])?;
    let scores = s_nope.add(&s_pe)?.affine(rope::softmax_scale(cfg), 0.0)?;
    let probs = masked_softmax(&scores, &visible.unsqueeze(0)?)?;
    let o = matmul(w.dots(), &probs, &v)? // [heads, n, v]
        .permute(&[1, 0, 2])?
        .reshape([n, heads * vdim])?;
    let roots = Roots {
        kv: root,
        index: index.map(|(_, r)| r),
    };
    Ok((
        linear(w.dots(), &o, &w.get(&format!("{p}.o_proj.weight"))?)?,
        roots,
    ))
}
