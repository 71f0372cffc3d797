//! DeepSeek-V4's multi-token-prediction (MTP) layer: the draft model its checkpoints ship as
//! `mtp.0.*` (`num_nextn_predict_layers`), after DeepSeek's inference code (`MTPBlock`), which
//! vLLM's `deepseek_v4_mtp.py` and SGLang's `deepseek_v4_nextn.py` follow.
//!
//! Where DeepSeek-V3's MTP layer reads the main model's hidden state after its final norm, V4's
//! reads the residual streams after the last decoder layer, before the hyper-head (`[hc_mult,
//! hidden]` a token), and keeps them as streams: for position `i`, with `e` the embedding of
//! the token at `i + 1` (the main model's table),
//!
//! ```text
//! x = e_proj(enorm(e)) + h_proj(hnorm(streams_i))    (hnorm and h_proj per stream; e_proj added to each)
//! x = block(x)                                       (a full V4 block: sliding attention, top-k MoE)
//! logits = head(norm(hc_head(x)))                    (its own hyper-head and norm, the main model's head)
//! ```
//!
//! The two projections are summed where V3 concatenates and projects once. The block is layer
//! `num_hidden_layers` of [`V4Config::with_draft_layer`]: sliding-window attention only (its
//! `compress_ratios` entry is 0) at the main RoPE, routed by score (never by hash). Chaining
//! feeds the block's output streams back as the next draft's input, as vLLM and SGLang do.

use crate::config::v4::V4Config;
use crate::error::{Error, Result};
use crate::graph::Tensor;
use crate::model::{ops, MoeStrategy};

use super::weights::Weights;
use super::{block, hyper};

/// The MTP layer over `streams` (`[t, hc_mult, hidden]`, the main model's streams at the rows'
/// positions) and `next_ids` (`[t]` i32, the token after each row), its attention
/// (`attention(layer, x)`) at the rows' positions: what its head reads (`[t, hidden]`, after its
/// norm) and its output streams (`[t, hc_mult, hidden]`, what a chained draft reads next).
pub(super) fn draft(
    cfg: &V4Config,
    w: &Weights,
    streams: &Tensor,
    next_ids: &Tensor,
    moe: MoeStrategy,
    attention: impl FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<(Tensor, Tensor)> {
    if cfg.draft_layers == 0 {
        return Err(Error::Internal(
            "an MTP graph of a DeepSeek-V4 config without its MTP layer in use".into(),
        ));
    }
    let l = cfg.num_hidden_layers;
    let p = cfg.layer_prefix(l);
    let (t, n, h) = (streams.dim(0), cfg.hc_mult, cfg.hidden_size);
    let eps = cfg.rms_norm_eps;
    let e = ops::rms_norm(
        &w.embed(next_ids)?,
        w.get(&format!("{p}.enorm.weight"))?,
        eps,
    )?;
    let s = ops::rms_norm(streams, w.get(&format!("{p}.hnorm.weight"))?, eps)?;
    let s = w
        .linear(&s.reshape([t * n, h])?, &format!("{p}.h_proj.weight"))?
        .reshape([t, n, h])?;
    let x = s.broadcast_add(&w.linear(&e, &format!("{p}.e_proj.weight"))?.unsqueeze(1)?)?;
    let out = block(cfg, w, l, &x, next_ids, moe, attention)?;
    let y = hyper::hyper_head(cfg, w, &format!("{p}.hc_head"), &out)?;
    let normed = ops::rms_norm(&y, w.get(&format!("{p}.norm.weight"))?, eps)?;
    Ok((normed, out))
}
