//! DeepSeek-V4 (`docs/deepseek-v4.md`): its checkpoint's tensors ([`tensors`]), its forward
//! pass over a whole sequence without a cache ([`forward`], the reference), and its step graph
//! over typed cache roots ([`step`]: chunked, packed prefill and decode, ending in the sampler
//! every model's steps share), which the runners drive as they drive MLA's; and its
//! multi-token-prediction layer ([`mtp`]), the draft model its checkpoints ship.

mod attention;
pub mod forward;
mod hyper;
mod moe;
pub mod mtp;
pub mod shard;
pub mod step;
pub mod tensors;
mod weights;

use crate::config::v4::V4Config;
use crate::error::Result;
use crate::graph::Tensor;
use crate::model::{ops, MoeStrategy};

use weights::Weights;

/// The final hidden states (`[n, hidden]`) of tokens `ids` (`[n]` i32): [`streams`], then the
/// hyper-head and the final norm. [`head`] turns them into logits.
fn hidden(
    cfg: &V4Config,
    w: &Weights,
    ids: &Tensor,
    moe: MoeStrategy,
    attention: impl FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    collapse(cfg, w, &streams(cfg, w, ids, moe, attention)?)
}

/// The final hidden states of the decoder's output streams: the hyper-head, then the final
/// norm.
fn collapse(cfg: &V4Config, w: &Weights, streams: &Tensor) -> Result<Tensor> {
    let x = hyper::hyper_head(cfg, w, "hc_head", streams)?;
    ops::rms_norm(&x, w.get("norm.weight")?, cfg.rms_norm_eps)
}

/// The residual streams (`[n, hc_mult, hidden]`) after the decoder's last layer, before the
/// hyper-head, of tokens `ids` (`[n]` i32): the embedding copied into the `hc_mult` streams,
/// then every layer's [`block`]. What an MTP layer reads ([`mtp`]).
fn streams(
    cfg: &V4Config,
    w: &Weights,
    ids: &Tensor,
    moe: MoeStrategy,
    mut attention: impl FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (n, streams, h) = (ids.dim(0), cfg.hc_mult, cfg.hidden_size);
    let x = w.embed(ids)?;
    let mut s = x.unsqueeze(1)?.broadcast_as([n, streams, h])?;
    for l in 0..cfg.num_hidden_layers {
        s = block(cfg, w, l, &s, ids, moe, &mut attention)?;
    }
    Ok(s)
}

/// Layer `l` over streams `s` (`[n, hc_mult, hidden]`) of tokens `ids`: its attention
/// (`attention(layer, x)`, on the normalised block input) and MoE (its routed experts as `moe`
/// says) inside their hyper-connections, each all-reduced when split.
fn block(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    s: &Tensor,
    ids: &Tensor,
    moe: MoeStrategy,
    mut attention: impl FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let p = cfg.layer_prefix(l);
    let (post, comb, x) = hyper::hyper_connection(cfg, w, &format!("{p}.hc_attn"), s)?;
    let x = ops::rms_norm(
        &x,
        w.get(&format!("{p}.attn_norm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    let s = hyper::expand(&post, &comb, &w.complete(attention(l, &x)?)?, s)?;
    let (post, comb, x) = hyper::hyper_connection(cfg, w, &format!("{p}.hc_ffn"), &s)?;
    let x = ops::rms_norm(
        &x,
        w.get(&format!("{p}.ffn_norm.weight"))?,
        cfg.rms_norm_eps,
    )?;
    let y = w.complete(moe::moe(cfg, w, l, &x, ids, moe)?)?;
    hyper::expand(&post, &comb, &y, &s)
}

/// The logits of final hidden states `x` (`[n, vocab]`, or a rank's vocabulary rows' columns
/// under tensor parallelism).
fn head(w: &Weights, x: &Tensor) -> Result<Tensor> {
    w.linear(x, "head.weight")
}
