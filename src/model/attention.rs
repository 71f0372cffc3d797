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
//! over the latents directly: MQA with one 576-wide key head for V2-Lite/V3. Prefill picks, by
//! multiply-adds, between that and decompressing the context's keys and values (`kv_b_proj`)
//! for ordinary attention, which costs fewer per (query, key) pair but up-projects every context
//! row: a chunk of prefill redoes it for the whole context, so chunked prefill of a long prompt
//! grew quadratically in it (`prefill_absorbs` says which is cheaper). Decode and prefill
//! logits agree; the tests check it.

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

/// The absorbed up-projections `(w_uk, w_uv)` of layer prefix `p`: slices of `kv_b_proj`
/// viewed as `[heads, nope + v, rank]`, `w_uk[h]` its first `nope` rows and `w_uv[h]` the `v`
/// after them.
fn absorbed_projections(
    cfg: &ModelConfig,
    w: &Weights,
    p: &str,
    heads: usize,
) -> Result<(Tensor, Tensor)> {
    let (nope, vdim) = (cfg.qk_nope_head_dim, cfg.v_head_dim);
    let kv_b =
        w.get(&format!("{p}.kv_b_proj.weight"))?
            .reshape([heads, nope + vdim, cfg.kv_lora_rank])?;
    Ok((kv_b.narrow(1, 0, nope)?, kv_b.narrow(1, nope, vdim)?))
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

    let (w_uk, w_uv) = absorbed_projections(cfg, w, &p, heads)?;
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

/// Prefill attention for `n` tokens of one or more sequences (MLA decompressed, or absorbed
/// over a long context: see `prefill_absorbs`; the mask keeps each token to its own
/// sequence's context). Returns the attention output `[n, hidden]` (this rank's heads' share
/// under tensor parallelism) and the updated root.
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
    let o = if prefill_absorbs(cfg, n, ctx) {
        absorbed(cfg, w, &p, q_nope, q_pe, &kv, &visible)?
    } else {
        decompressed(cfg, w, &p, q_nope, q_pe, &kv, &visible)?
    };
    let roots = Roots {
        kv: root,
        index: index.map(|(_, r)| r),
    };
    Ok((
        linear(w.dots(), &o, &w.get(&format!("{p}.o_proj.weight"))?)?,
        roots,
    ))
}

/// Decompressed attention of `n` prefill queries (`q_nope: [n, heads, nope]`, `q_pe: [n,
/// heads, rope]`) over the context's latents `kv: [ctx, width]` under `visible: [n, ctx]`:
/// every context row up-projected through `kv_b_proj` into keys and values, then ordinary
/// attention; the output `[n, heads * v]`, before `o_proj`.
fn decompressed(
    cfg: &ModelConfig,
    w: &Weights,
    p: &str,
    q_nope: &Tensor,
    q_pe: &Tensor,
    kv: &Tensor,
    visible: &Tensor,
) -> Result<Tensor> {
    let (n, heads) = (q_nope.dim(0), q_nope.dim(1));
    let (nope, rdim, vdim, rank) = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    );
    let ctx = kv.dim(0);
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
    matmul(w.dots(), &probs, &v)? // [heads, n, v]
        .permute(&[1, 0, 2])?
        .reshape([n, heads * vdim])
}

/// How many times fewer multiply-adds absorbed prefill attention must cost than decompressed
/// for prefill to take it. Its products run slower per multiply-add (a `[heads x n, 576]` by
/// `[576, ctx]` score product and per-head absorptions, against decompressed attention's one
/// large `kv_b_proj` product): on the 27-layer V2-Lite-shaped Q4_K_M, absorbing every chunk
/// whose multiply-adds it lowered made a 512-token prefill (64-token chunks) 8% slower (22.6
/// to 20.9 tok/s), while a 2,048-token one on the 4-layer file went from 93 to 138 tok/s.
/// Two is the smallest whole factor under which the first keeps decompressing (a 64-token
/// V2-Lite chunk absorbs from about 1,366 context rows).
const ABSORBED_PREFILL_ADVANTAGE: usize = 2;

/// Whether prefill attention of `n` queries over `ctx` context rows is to be absorbed (the
/// query into the latent space, as decode does) rather than decompressed (every context row
/// up-projected through `kv_b_proj`): when it costs [`ABSORBED_PREFILL_ADVANTAGE`] times fewer
/// multiply-adds. Per head, absorbed costs `n * (nope + v) * rank` for the two absorptions and
/// `n * ctx * (width + rank)` for the scores and the latent output; decompressed `ctx * rank *
/// (nope + v)` for the up-projection and `n * ctx * (nope + rope + v)` for the scores and
/// output. The up-projection is what grows: each chunk of a long prompt redoes it for the
/// whole context, so decompressed chunked prefill is quadratic in the prompt's length with a
/// large constant.
fn prefill_absorbs(cfg: &ModelConfig, n: usize, ctx: usize) -> bool {
    let (nope, rope, v, rank) = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    );
    let absorbed = n * (nope + v) * rank + n * ctx * (rank + rope + rank);
    let decompressed = ctx * rank * (nope + v) + n * ctx * (nope + rope + v);
    ABSORBED_PREFILL_ADVANTAGE * absorbed < decompressed
}

/// Absorbed attention of `n` prefill queries (`q_nope: [n, heads, nope]`, `q_pe: [n, heads,
/// rope]`) over the context's latents `kv: [ctx, width]` under `visible: [n, ctx]`: the
/// attention output `[n, heads * v]`, before `o_proj`.
fn absorbed(
    cfg: &ModelConfig,
    w: &Weights,
    p: &str,
    q_nope: &Tensor,
    q_pe: &Tensor,
    kv: &Tensor,
    visible: &Tensor,
) -> Result<Tensor> {
    let (n, heads) = (q_nope.dim(0), q_nope.dim(1));
    let (rank, vdim) = (cfg.kv_lora_rank, cfg.v_head_dim);
    let (width, ctx) = (cfg.kv_cache_width(), kv.dim(0));
    let (w_uk, w_uv) = absorbed_projections(cfg, w, p, heads)?;
    let q_lat = matmul(w.dots(), &q_nope.permute(&[1, 0, 2])?, &w_uk)?; // [heads, n, rank]
    let q = q_nope
        .builder()
        .cat(&[&q_lat, &q_pe.permute(&[1, 0, 2])?], 2)?
        .reshape([heads * n, width])?;
    let scores = matmul(w.dots(), &q, &kv.t()?)? // [heads * n, ctx]
        .reshape([heads, n, ctx])?
        .affine(rope::softmax_scale(cfg), 0.0)?;
    let probs = masked_softmax(&scores, &visible.unsqueeze(0)?)?.reshape([heads * n, ctx])?;
    let o_lat = matmul(w.dots(), &probs, &kv.narrow(1, 0, rank)?)?.reshape([heads, n, rank])?;
    matmul(w.dots(), &o_lat, &w_uv.t()?)? // [heads, n, v]
        .permute(&[1, 0, 2])?
        .reshape([n, heads * vdim])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(path: &str) -> ModelConfig {
        ModelConfig::from_file(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
            .expect("a fixture config")
    }

    /// Where prefill switches between absorbed and decompressed attention: for the published
    /// V2-Lite shape, 64-token chunks absorb only over long contexts and whole 512-token prompts
    /// never; the default model's 16-token chunks absorb past 171 context rows, which
    /// `tests/default_model.rs` checks against transformers; the tiny fixtures' chunks of 16
    /// decompress and their one-token ones absorb (the parity tests check both).
    #[test]
    fn prefill_absorbs_small_chunks_over_long_contexts() {
        let v2_lite = config("fixtures/configs/deepseek-v2-lite.json");
        assert!(!prefill_absorbs(&v2_lite, 64, 528));
        assert!(!prefill_absorbs(&v2_lite, 64, 1360));
        assert!(prefill_absorbs(&v2_lite, 64, 1376));
        assert!(prefill_absorbs(&v2_lite, 64, 16384));
        assert!(!prefill_absorbs(&v2_lite, 512, 4096));
        let default = config("fixtures/default-model/config.json");
        assert!(!prefill_absorbs(&default, 16, 160));
        assert!(prefill_absorbs(&default, 16, 176));
        assert!(!prefill_absorbs(&default, 64, 4096));
        let tiny = config("fixtures/tiny-v3/config.json");
        assert!(!prefill_absorbs(&tiny, 16, 64));
        assert!(prefill_absorbs(&tiny, 1, 64));
    }
}
