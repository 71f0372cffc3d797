//! DeepSeek-V4's forward pass over one whole sequence with no cache: transformers' stateless
//! mode (`cache=None`), every compressed entry pooled from the sequence itself. It is the first
//! V4 graph, checked against transformers on `fixtures/tiny-v4`, and the reference the cached
//! step graphs (which pool from cache roots, `docs/deepseek-v4.md`) will be checked against.
//!
//! Weights are inputs under their published names ([`super::tensors`]), in f32; `tid2eid`
//! as i32. The one metadata input is `input_ids` (`[t]` i32); positions are `0..t`. The
//! output is `logits` (`[t, vocab]`).

use crate::config::v4::{V4Attention, V4Config, V4Routing, V4Scoring};
use crate::config::RopeConfig;
use crate::error::Result;
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Literal, Tensor};
use crate::model::precision::Dots;
use crate::model::{ops, rope};

use super::tensors::{self, V4TensorKind};

/// The graph of a cache-free forward over `t` tokens.
pub fn build_stateless(cfg: &V4Config, t: usize) -> Result<Graph> {
    let b = GraphBuilder::new(format!("v4_stateless_t{t}"));
    let w = Weights::declare(&b, cfg)?;
    let ids = b.input("input_ids", InputRole::Metadata, [t], DType::I32)?;
    let positions = b.iota([t], DType::I32, 0)?;
    let main = Rope::new(cfg.rope_dim, &cfg.main_rope, &positions)?;
    let compress = Rope::new(cfg.rope_dim, &cfg.compress_rope, &positions)?;
    let n = cfg.hc_mult;
    let h = cfg.hidden_size;
    let x = w.get("embed.weight")?.index_select(&ids, 0)?;
    let mut streams = x.unsqueeze(1)?.broadcast_as([t, n, h])?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("layers.{l}");
        let (post, comb, collapsed) = hyper_connection(cfg, &w, &format!("{p}.hc_attn"), &streams)?;
        let x = ops::rms_norm(
            &collapsed,
            w.get(&format!("{p}.attn_norm.weight"))?,
            cfg.rms_norm_eps,
        )?;
        let rope = match cfg.attention[l] {
            V4Attention::Sliding => &main,
            _ => &compress,
        };
        let a = attention(cfg, &w, l, &x, rope, &compress)?;
        streams = expand(&post, &comb, &a, &streams)?;
        let (post, comb, collapsed) = hyper_connection(cfg, &w, &format!("{p}.hc_ffn"), &streams)?;
        let x = ops::rms_norm(
            &collapsed,
            w.get(&format!("{p}.ffn_norm.weight"))?,
            cfg.rms_norm_eps,
        )?;
        let m = moe(cfg, &w, l, &x, &ids)?;
        streams = expand(&post, &comb, &m, &streams)?;
    }
    let collapsed = hyper_head(cfg, &w, &streams)?;
    let x = ops::rms_norm(&collapsed, w.get("norm.weight")?, cfg.rms_norm_eps)?;
    let logits = x.matmul(&w.get("head.weight")?.t()?)?;
    b.output("logits", &logits)?;
    b.finish()
}

/// The model's weights as graph inputs, by published name (the first of a tensor's names).
struct Weights {
    inputs: std::collections::HashMap<String, Tensor>,
}

impl Weights {
    fn declare(b: &GraphBuilder, cfg: &V4Config) -> Result<Self> {
        let mut inputs = std::collections::HashMap::new();
        for t in tensors::expected(cfg) {
            let name = t.names[0].clone();
            let dtype = match t.kind {
                V4TensorKind::Float => DType::F32,
                V4TensorKind::ExpertIds => DType::I32,
            };
            let x = b.input(name.clone(), InputRole::Weight, t.shape, dtype)?;
            inputs.insert(name, x);
        }
        Ok(Weights { inputs })
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        self.inputs
            .get(name)
            .ok_or_else(|| crate::error::Error::shape("weight", format!("no V4 weight `{name}`")))
    }
}

/// cos and sin (`[t, rope_dim / 2]`) of one RoPE at the sequence's positions.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(dim: usize, cfg: &RopeConfig, positions: &Tensor) -> Result<Self> {
        let (cos, sin) = rope::cos_sin_of(rope::inv_freq(dim, cfg), positions)?;
        Ok(Rope { cos, sin })
    }

    /// Rotates the trailing `rope_dim` channels of `x` (`[t, heads, width]`), by `-angle`
    /// when `inverse`.
    fn apply(&self, x: &Tensor, inverse: bool) -> Result<Tensor> {
        rotate_tail(x, &self.cos, &self.sin, inverse)
    }
}

/// Interleaved RoPE on the trailing `2 x cos.dim(1)` channels of `x` (`[n, heads, width]`).
fn rotate_tail(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let (n, heads, width) = (x.dim(0), x.dim(1), x.dim(2));
    let r = 2 * cos.dim(1);
    let sin = match inverse {
        true => sin.neg()?,
        false => sin.clone(),
    };
    let tail = rope::apply(&x.narrow(2, width - r, r)?, cos, &sin)?;
    if r == width {
        return Ok(tail);
    }
    let b = x.builder();
    b.cat(&[&x.narrow(2, 0, width - r)?, &tail], 2)
        .and_then(|y| y.reshape([n, heads, width]))
}

/// A hyper-connection (`{prefix}_fn`, `_base`, `_scale`) over `streams` (`[t, n, h]`): its
/// `post` (`[t, n]`) and Sinkhorn-projected `comb` (`[t, n, n]`) weights, and the block input
/// the `pre` weights collapse the streams to (`[t, h]`).
fn hyper_connection(
    cfg: &V4Config,
    w: &Weights,
    prefix: &str,
    streams: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (t, n, h) = (streams.dim(0), cfg.hc_mult, cfg.hidden_size);
    let eps = cfg.hc_eps;
    let flat = ops::rms_norm_unweighted(&streams.reshape([t, n * h])?, cfg.rms_norm_eps)?;
    let mixes = flat.matmul(&w.get(&format!("{prefix}_fn"))?.t()?)?;
    let base = w.get(&format!("{prefix}_base"))?;
    let scale = w.get(&format!("{prefix}_scale"))?;
    let part = |start: usize, len: usize, s: usize| -> Result<Tensor> {
        mixes
            .narrow(1, start, len)?
            .broadcast_mul(&scale.narrow(0, s, 1)?.reshape([1, 1])?)?
            .broadcast_add(&base.narrow(0, start, len)?.reshape([1, len])?)
    };
    let pre = part(0, n, 0)?.sigmoid()?.affine(1.0, eps)?;
    let post = part(n, n, 1)?.sigmoid()?.affine(2.0, 0.0)?;
    let comb = ops::softmax(&part(2 * n, n * n, 2)?.reshape([t, n, n])?, 2)?.affine(1.0, eps)?;
    // Sinkhorn: columns, then rows and columns `iters - 1` times.
    let normalize = |x: &Tensor, dim: usize| -> Result<Tensor> {
        x.broadcast_div(&x.sum_keepdim(dim)?.affine(1.0, eps)?)
    };
    let mut comb = normalize(&comb, 1)?;
    for _ in 1..cfg.hc_sinkhorn_iters {
        comb = normalize(&normalize(&comb, 2)?, 1)?;
    }
    let collapsed = pre.unsqueeze(2)?.broadcast_mul(streams)?.sum(1)?;
    Ok((post, comb, collapsed))
}

/// The streams after a block: `post_k y + sum_j comb[j, k] x_j`.
fn expand(post: &Tensor, comb: &Tensor, y: &Tensor, streams: &Tensor) -> Result<Tensor> {
    let (t, n, h) = (streams.dim(0), streams.dim(1), streams.dim(2));
    let out = post.unsqueeze(2)?.broadcast_mul(&y.unsqueeze(1)?)?;
    let mixed = comb.transpose(1, 2)?.matmul(streams)?;
    out.broadcast_as([t, n, h])?.add(&mixed)
}

/// The final collapse of the streams (`hc_head_*`: a `pre` only).
fn hyper_head(cfg: &V4Config, w: &Weights, streams: &Tensor) -> Result<Tensor> {
    let (t, n, h) = (streams.dim(0), cfg.hc_mult, cfg.hidden_size);
    let flat = ops::rms_norm_unweighted(&streams.reshape([t, n * h])?, cfg.rms_norm_eps)?;
    let mixes = flat.matmul(&w.get("hc_head_fn")?.t()?)?;
    let pre = mixes
        .broadcast_mul(&w.get("hc_head_scale")?.reshape([1, 1])?)?
        .broadcast_add(&w.get("hc_head_base")?.reshape([1, n])?)?
        .sigmoid()?
        .affine(1.0, cfg.hc_eps)?;
    pre.unsqueeze(2)?.broadcast_mul(streams)?.sum(1)
}

/// `x @ w^T` ([`ops::linear`]); the weights are f32 so far, so every product is an f32 one.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    ops::linear(Dots::Widen, x, w)
}

/// One layer's attention over the whole sequence (`x`: `[t, h]`, normalised).
fn attention(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    rope: &Rope,
    compress_rope: &Rope,
) -> Result<Tensor> {
    let b = x.builder();
    let a = format!("layers.{l}.attn");
    let (t, heads, d) = (x.dim(0), cfg.num_attention_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let q_res = ops::rms_norm(
        &linear(x, w.get(&format!("{a}.wq_a.weight"))?)?,
        w.get(&format!("{a}.q_norm.weight"))?,
        eps,
    )?;
    let q = ops::rms_norm_unweighted(
        &linear(&q_res, w.get(&format!("{a}.wq_b.weight"))?)?.reshape([t, heads, d])?,
        eps,
    )?;
    let q = rope.apply(&q, false)?;
    let kv = ops::rms_norm(
        &linear(x, w.get(&format!("{a}.wkv.weight"))?)?,
        w.get(&format!("{a}.kv_norm.weight"))?,
        eps,
    )?;
    let kv = rope
        .apply(&kv.reshape([t, 1, d])?, false)?
        .reshape([t, d])?;

    // The window: query i sees keys j with i - W < j <= i.
    let i = b.iota([t, t], DType::I32, 0)?;
    let j = b.iota([t, t], DType::I32, 1)?;
    let oldest = i.sub(&b.full(cfg.sliding_window as f64, [t, t], DType::I32)?)?;
    let zeros = b.full(0.0, [t, t], DType::F32)?;
    let neg = b.full(f64::NEG_INFINITY, [t, t], DType::F32)?;
    let window = j
        .le(&i)?
        .where_cond(&j.gt(&oldest)?.where_cond(&zeros, &neg)?, &neg)?;
    let mut keys = vec![kv.clone()];
    let mut masks = vec![window];
    if cfg.attention[l] != V4Attention::Sliding {
        let (entries, mask) = compressed(cfg, w, l, x, &q_res, compress_rope)?;
        if let Some(entries) = entries {
            keys.push(entries);
            masks.push(mask);
        }
    }
    let keys = b.cat(&keys.iter().collect::<Vec<_>>(), 0)?;
    let mask = b.cat(&masks.iter().collect::<Vec<_>>(), 1)?;
    let s = keys.dim(0);
    // Scores [heads, t, s], the sink logit appended as one more column, dropped after.
    let qh = q.transpose(0, 1)?;
    let kh = keys.t()?.unsqueeze(0)?.broadcast_as([heads, d, s])?;
    let scores = qh
        .matmul(&kh)?
        .affine((d as f64).powf(-0.5), 0.0)?
        .broadcast_add(&mask.unsqueeze(0)?)?;
    let sinks = w
        .get(&format!("{a}.attn_sink"))?
        .reshape([heads, 1, 1])?
        .broadcast_as([heads, t, 1])?;
    let probs = ops::softmax(&b.cat(&[&scores, &sinks], 2)?, 2)?.narrow(2, 0, s)?;
    let vh = keys.unsqueeze(0)?.broadcast_as([heads, s, d])?;
    let out = probs.matmul(&vh)?.transpose(0, 1)?;
    // V carried RoPE: rotate the output back by the query's position.
    let out = rope.apply(&out, true)?;
    // Grouped output projection: each group of heads by its own block of wo_a.
    let g = cfg.o_groups;
    let per = heads * d / g;
    let r = cfg.o_lora_rank;
    let grouped = out.reshape([t, g, per])?.transpose(0, 1)?;
    let wa = w
        .get(&format!("{a}.wo_a.weight"))?
        .reshape([g, r, per])?
        .transpose(1, 2)?;
    let y = grouped.matmul(&wa)?.transpose(0, 1)?.reshape([t, g * r])?;
    linear(&y, w.get(&format!("{a}.wo_b.weight"))?)
}

/// A layer's compressed entries (`[windows, d]`, `None` when the sequence completes no
/// window) and the mask (`[t, windows]`, 0 or `-inf`) of what each query sees of them: all the
/// completed windows before it (HCA), or those the lightning indexer selects among them (CSA).
fn compressed(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    q_res: &Tensor,
    rope: &Rope,
) -> Result<(Option<Tensor>, Tensor)> {
    let b = x.builder();
    let t = x.dim(0);
    let a = format!("layers.{l}.attn");
    let csa = cfg.attention[l] == V4Attention::CompressedSparse;
    let rate = if csa { cfg.csa_rate } else { cfg.hca_rate };
    let windows = t / rate;
    if windows == 0 {
        return Ok((None, b.full(0.0, [t, 0], DType::F32)?));
    }
    let entries = pool(
        cfg,
        w,
        &format!("{a}.compressor"),
        x,
        cfg.head_dim,
        rate,
        csa,
        rope,
    )?;
    // Query i sees window w when w < (i + 1) / rate.
    let qi = b.iota([t, windows], DType::I32, 0)?;
    let wi = b.iota([t, windows], DType::I32, 1)?;
    let full = |v: usize| b.full(v as f64, [t, windows], DType::I32);
    let ready = wi.lt(&qi.add(&full(1)?)?.div(&full(rate)?)?)?;
    let zeros = b.full(0.0, [t, windows], DType::F32)?;
    let neg = b.full(f64::NEG_INFINITY, [t, windows], DType::F32)?;
    if !csa {
        return Ok((Some(entries), ready.where_cond(&zeros, &neg)?));
    }
    // The lightning indexer: its own compressor's keys, scored by its query heads.
    let ix = cfg
        .indexer
        .ok_or_else(|| crate::error::Error::shape("indexer", "a CSA layer without an indexer"))?;
    let i = format!("{a}.indexer");
    let keys = pool(
        cfg,
        w,
        &format!("{i}.compressor"),
        x,
        ix.head_dim,
        rate,
        true,
        rope,
    )?;
    let q =
        linear(q_res, w.get(&format!("{i}.wq_b.weight"))?)?.reshape([t, ix.heads, ix.head_dim])?;
    let q = rope.apply(&q, false)?;
    let kk = keys
        .t()?
        .unsqueeze(0)?
        .broadcast_as([t, ix.head_dim, windows])?;
    let per_head = q
        .matmul(&kk)?
        .maximum(&b.full(0.0, [t, ix.heads, windows], DType::F32)?)?
        .affine((ix.head_dim as f64).powf(-0.5), 0.0)?;
    let weights = linear(x, w.get(&format!("{i}.weights_proj.weight"))?)?
        .affine((ix.heads as f64).powf(-0.5), 0.0)?;
    let scores = weights.unsqueeze(2)?.broadcast_mul(&per_head)?.sum(1)?;
    let scores = ready.where_cond(&scores, &neg)?;
    let k = ix.topk.min(windows);
    let top = scores.topk(k)?;
    // Selected and visible: a one-hot of the picks over the windows, and `ready`.
    let picked = top.unsqueeze(2)?.broadcast_as([t, k, windows])?;
    let wk = b.iota([t, k, windows], DType::I32, 2)?;
    let hit = picked.eq(&wk)?.to_dtype(DType::F32)?.sum(1)?;
    let chosen = hit
        .gt(&zeros)?
        .where_cond(&ready.where_cond(&zeros, &neg)?, &neg)?;
    Ok((Some(entries), chosen))
}

/// A compressor's entries (`[windows, width]`): each window's tokens (CSA: the previous
/// window's first series and this window's second, over `2 x rate` slots) pooled by a softmax
/// of their gates plus `ape`, normalised, rotated at the window's first position.
#[allow(clippy::too_many_arguments)]
fn pool(
    cfg: &V4Config,
    w: &Weights,
    prefix: &str,
    x: &Tensor,
    width: usize,
    rate: usize,
    overlap: bool,
    rope: &Rope,
) -> Result<Tensor> {
    let b = x.builder();
    let windows = x.dim(0) / rate;
    let used = windows * rate;
    let series = if overlap { 2 } else { 1 };
    let kv = linear(x, w.get(&format!("{prefix}.wkv.weight"))?)?.narrow(0, 0, used)?;
    let gate = linear(x, w.get(&format!("{prefix}.wgate.weight"))?)?.narrow(0, 0, used)?;
    let kv = kv.reshape([windows, rate, series * width])?;
    let gate = gate
        .reshape([windows, rate, series * width])?
        .broadcast_add(&w.get(&format!("{prefix}.ape"))?.unsqueeze(0)?)?;
    let (kv, gate) = match overlap {
        false => (kv, gate),
        true => {
            // Slots 0..rate: the previous window's first series (none before window 0: a zero
            // value with a -inf gate); slots rate..2 rate: this window's second series.
            let first = |x: &Tensor, fill: f64| -> Result<Tensor> {
                let own = x.narrow(2, 0, width)?;
                let pad = b.full(fill, [1, rate, width], DType::F32)?;
                match windows {
                    1 => Ok(pad),
                    _ => b.cat(&[&pad, &own.narrow(0, 0, windows - 1)?], 0),
                }
            };
            let kv2 = b.cat(&[&first(&kv, 0.0)?, &kv.narrow(2, width, width)?], 1)?;
            let gate2 = b.cat(
                &[
                    &first(&gate, f64::NEG_INFINITY)?,
                    &gate.narrow(2, width, width)?,
                ],
                1,
            )?;
            (kv2, gate2)
        }
    };
    let pooled = kv.mul(&ops::softmax(&gate, 1)?)?.sum(1)?;
    let pooled = ops::rms_norm(
        &pooled,
        w.get(&format!("{prefix}.norm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    // Rotated at position w x rate: the rows of the sequence's tables at those positions.
    let starts: Vec<i32> = (0..windows).map(|w| (w * rate) as i32).collect();
    let at = b.constant(Literal::I32(starts), [windows])?;
    let cos = rope.cos.index_select(&at, 0)?;
    let sin = rope.sin.index_select(&at, 0)?;
    rotate_tail(&pooled.reshape([windows, 1, width])?, &cos, &sin, false)?.reshape([windows, width])
}

/// One layer's MoE over `x` (`[t, h]`): the routed experts (by score or by token id) and the
/// shared expert, each `down(silu(min(gate, L)) * clamp(up, -L, L))`.
fn moe(cfg: &V4Config, w: &Weights, l: usize, x: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let b = x.builder();
    let f = format!("layers.{l}.ffn");
    let t = x.dim(0);
    let (e, k) = (cfg.n_routed_experts, cfg.num_experts_per_tok);
    let logits = linear(x, w.get(&format!("{f}.gate.weight"))?)?;
    let scores = match cfg.scoring {
        // sqrt(softplus(l)), softplus as max(l, 0) + log(1 + exp(-|l|)).
        V4Scoring::SqrtSoftplus => {
            let zero = b.full(0.0, [t, e], DType::F32)?;
            logits
                .maximum(&zero)?
                .add(&logits.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?)?
                .sqrt()?
        }
        V4Scoring::Sigmoid => logits.sigmoid()?,
    };
    let chosen = match cfg.routing[l] {
        V4Routing::TopK => scores
            .broadcast_add(&w.get(&format!("{f}.gate.bias"))?.reshape([1, e])?)?
            .topk(k)?,
        V4Routing::Hash => w.get(&format!("{f}.gate.tid2eid"))?.index_select(ids, 0)?,
    };
    let picked = scores.gather(&chosen, 1)?;
    let weights = picked
        .broadcast_div(&picked.sum_keepdim(1)?.affine(1.0, 1e-20)?)?
        .affine(cfg.routed_scaling_factor, 0.0)?;
    let limit = cfg.swiglu_limit;
    let expert = |prefix: &str| -> Result<Tensor> {
        let gate = linear(x, w.get(&format!("{prefix}.w1.weight"))?)?;
        let up = linear(x, w.get(&format!("{prefix}.w3.weight"))?)?;
        let gate = gate.minimum(&gate.full_like(limit)?)?;
        let up = up
            .minimum(&up.full_like(limit)?)?
            .maximum(&up.full_like(-limit)?)?;
        linear(
            &gate.silu()?.mul(&up)?,
            w.get(&format!("{prefix}.w2.weight"))?,
        )
    };
    let mut out = expert(&format!("{f}.shared_experts"))?;
    for x_e in 0..e {
        let id = b.full(x_e as f64, [t, k], DType::I32)?;
        let weight = chosen
            .eq(&id)?
            .where_cond(&weights, &weights.full_like(0.0)?)?
            .sum_keepdim(1)?;
        out = out.add(&expert(&format!("{f}.experts.{x_e}"))?.broadcast_mul(&weight)?)?;
    }
    Ok(out)
}
