//! The pieces of V4's attention that the cache-free forward ([`super::forward`]) and the
//! cached step ([`super::step`]) share: the queries, the shared K=V row, the compressors'
//! pooling, the lightning indexer's scores and pick, the attention with sinks over several
//! key sets, and the grouped output projection. Where the keys come from (the sequence itself,
//! or the cache roots) is the callers' business.

use crate::config::v4::V4Config;
use crate::error::{Error, Result};
use crate::graph::Tensor;
use crate::model::{indexer, ops};

use super::weights::{Rope, Weights};

/// Layer `l`'s attention prefix in the published names ([`V4Config::layer_prefix`]).
pub(super) fn prefix(cfg: &V4Config, l: usize) -> String {
    format!("{}.attn", cfg.layer_prefix(l))
}

/// A layer's queries: the normalised latent `q_res` (`[n, q_lora_rank]`, which the indexer
/// reads too) and the heads (`[n, heads, head_dim]`), normalised per head and rotated.
pub(super) fn queries(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    rope: &Rope,
) -> Result<(Tensor, Tensor)> {
    let a = prefix(cfg, l);
    let (n, heads, d) = (x.dim(0), cfg.num_attention_heads / w.ranks(), cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let q_res = ops::rms_norm(
        &w.linear(x, &format!("{a}.wq_a.weight"))?,
        w.get(&format!("{a}.q_norm.weight"))?,
        eps,
    )?;
    let q = ops::rms_norm_unweighted(
        &w.linear(&q_res, &format!("{a}.wq_b.weight"))?
            .reshape([n, heads, d])?,
        eps,
    )?;
    Ok((q_res, rope.apply(&q, false)?))
}

/// Each token's shared key and value (`[n, head_dim]`): `kv_norm(wkv x)`, rotated.
pub(super) fn key_value(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    rope: &Rope,
) -> Result<Tensor> {
    let a = prefix(cfg, l);
    let (n, d) = (x.dim(0), cfg.head_dim);
    let kv = ops::rms_norm(
        &w.linear(x, &format!("{a}.wkv.weight"))?,
        w.get(&format!("{a}.kv_norm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    rope.apply(&kv.reshape([n, 1, d])?, false)?.reshape([n, d])
}

/// One compressor's pooled entries (`[k, width]`) from `k` windows of slots: their values and
/// gates (`[k, slots, width]`, the gates with `ape` added), pooled by a softmax of the gates
/// over the slots, normalised (`{prefix}.norm`) and rotated at each window's first position
/// (`rope`, one row per window).
pub(super) fn pool(
    cfg: &V4Config,
    w: &Weights,
    prefix: &str,
    values: &Tensor,
    gates: &Tensor,
    rope: &Rope,
) -> Result<Tensor> {
    let (k, width) = (values.dim(0), values.dim(2));
    let pooled = values.mul(&ops::softmax(gates, 1)?)?.sum(1)?;
    let pooled = ops::rms_norm(
        &pooled,
        w.get(&format!("{prefix}.norm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    rope.apply(&pooled.reshape([k, 1, width])?, false)?
        .reshape([k, width])
}

/// Keys (which are also the values) a query attends to.
pub(super) enum Keys {
    /// `[k, width]`, the same for every query.
    Shared(Tensor),
    /// `[n, k, width]`, each query its own.
    PerRow(Tensor),
}

impl Keys {
    /// How many keys each query sees.
    fn len(&self) -> usize {
        match self {
            Keys::Shared(k) => k.dim(0),
            Keys::PerRow(k) => k.dim(1),
        }
    }

    /// `q` (`[n, heads, width]`) against every key: `[n, heads, k]`.
    fn scores(&self, q: &Tensor) -> Result<Tensor> {
        let (n, heads, width) = (q.dim(0), q.dim(1), q.dim(2));
        match self {
            Keys::Shared(k) => {
                q.reshape([n * heads, width])?
                    .matmul(&k.t()?)?
                    .reshape([n, heads, k.dim(0)])
            }
            Keys::PerRow(k) => q.matmul(&k.transpose(1, 2)?),
        }
    }

    /// The keys as values, weighted by `probs` (`[n, heads, k]`): `[n, heads, width]`.
    fn weigh(&self, probs: &Tensor) -> Result<Tensor> {
        let (n, heads, k) = (probs.dim(0), probs.dim(1), probs.dim(2));
        match self {
            Keys::Shared(v) => {
                probs
                    .reshape([n * heads, k])?
                    .matmul(v)?
                    .reshape([n, heads, v.dim(1)])
            }
            Keys::PerRow(v) => probs.matmul(v),
        }
    }
}

/// Logical and of two bool tensors of one shape.
pub(super) fn and(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.where_cond(b, a)
}

/// The lightning indexer's score of each key for each query (`[n, k]`): `sum_h w_h
/// relu(q_h . k) / sqrt(c_I)`, `w = weights_proj(x) / sqrt(n_I)`, the query heads from
/// `q_res` rotated by `rope`.
pub(super) fn index_scores(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    q_res: &Tensor,
    rope: &Rope,
    keys: &Keys,
) -> Result<Tensor> {
    let ix = cfg
        .indexer
        .ok_or_else(|| Error::shape("indexer", "a CSA layer without an indexer"))?;
    let i = format!("{}.indexer", prefix(cfg, l));
    let n = x.dim(0);
    let q = w
        .linear(q_res, &format!("{i}.wq_b.weight"))?
        .reshape([n, ix.heads, ix.head_dim])?;
    let q = rope.apply(&q, false)?;
    let s = keys.scores(&q)?;
    let per_head = s
        .maximum(&s.full_like(0.0)?)?
        .affine((ix.head_dim as f64).powf(-0.5), 0.0)?;
    let weights = w
        .linear(x, &format!("{i}.weights_proj.weight"))?
        .affine((ix.heads as f64).powf(-0.5), 0.0)?;
    weights.unsqueeze(2)?.broadcast_mul(&per_head)?.sum(1)
}

/// Which keys each query attends to (`[n, k]` bool): the `index_topk` best of `scores`
/// among the `visible` ones (fewer when fewer are visible), a tie going to the lower index as
/// `torch.topk` breaks it.
///
/// A mask by threshold ([`indexer::top_k_mask`], V3.2's prefill selection), not a sort: no
/// `sort` at all, so no limit on the compressed context (neuronx-cc compiles none wider than
/// 16,384 entries, a quarter of a 64k context at CSA's rate), and `O(n k)` values rather than a
/// comparison of every pick with every key.
pub(super) fn select(cfg: &V4Config, scores: &Tensor, visible: &Tensor) -> Result<Tensor> {
    let ix = cfg
        .indexer
        .ok_or_else(|| Error::shape("indexer", "a CSA layer without an indexer"))?;
    let k = scores.dim(1);
    let scores = visible.where_cond(scores, &scores.full_like(f64::NEG_INFINITY)?)?;
    and(&indexer::top_k_mask(&scores, ix.topk.min(k))?, visible)
}

/// Attention of `q` (`[n, heads, head_dim]`) over key sets, each with the keys every query may
/// see (`[n, k]` bool), and each head's learned sink logit, which joins the softmax and is
/// dropped after it: `[n, heads, head_dim]`.
pub(super) fn attend(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    q: &Tensor,
    sets: &[(Keys, Tensor)],
) -> Result<Tensor> {
    let b = q.builder();
    let (n, heads) = (q.dim(0), q.dim(1));
    let scale = (cfg.head_dim as f64).powf(-0.5);
    let mut scores = Vec::with_capacity(sets.len() + 1);
    for (keys, visible) in sets {
        let s = keys.scores(q)?.affine(scale, 0.0)?;
        let visible = visible.unsqueeze(1)?.broadcast_as(s.shape().clone())?;
        scores.push(visible.where_cond(&s, &s.full_like(f64::NEG_INFINITY)?)?);
    }
    scores.push(
        w.get(&format!("{}.attn_sink", prefix(cfg, l)))?
            .reshape([1, heads, 1])?
            .broadcast_as([n, heads, 1])?,
    );
    let probs = ops::softmax(&b.cat(&scores.iter().collect::<Vec<_>>(), 2)?, 2)?;
    let mut out: Option<Tensor> = None;
    let mut at = 0;
    for (keys, _) in sets {
        let k = keys.len();
        let part = keys.weigh(&probs.narrow(2, at, k)?)?;
        at += k;
        out = Some(match out {
            None => part,
            Some(o) => o.add(&part)?,
        });
    }
    out.ok_or_else(|| Error::shape("attention", "no keys"))
}

/// The attention output (`[n, heads, head_dim]`, the rank's heads) rotated back by the
/// query's position (V carried RoPE) and projected: each group of heads by its own block of
/// `wo_a`, then `wo_b` (a rank's groups' columns: a partial sum under tensor parallelism).
pub(super) fn output(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    out: &Tensor,
    rope: &Rope,
) -> Result<Tensor> {
    let a = prefix(cfg, l);
    let (n, heads, d) = (out.dim(0), out.dim(1), cfg.head_dim);
    let out = rope.apply(out, true)?;
    let g = super::shard::local_groups(cfg, w.ranks());
    let per = heads * d / g;
    let r = cfg.o_lora_rank;
    let grouped = out.reshape([n, g, per])?.transpose(0, 1)?;
    let wa = w
        .get(&format!("{a}.wo_a.weight"))?
        .reshape([g, r, per])?
        .transpose(1, 2)?;
    let y = ops::matmul(w.dots(), &grouped, &wa)?
        .transpose(0, 1)?
        .reshape([n, g * r])?;
    w.linear(&y, &format!("{a}.wo_b.weight"))
}
