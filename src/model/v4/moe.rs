//! V4's feed-forward: every layer is MoE, routed by `sqrtsoftplus` scores with a correction
//! bias or by a frozen token-id table (`tid2eid`), with a shared expert and the SwiGLU clamp.
//! Per token, shared by the cache-free forward and the cached step.

use crate::config::v4::{V4Config, V4Routing, V4Scoring};
use crate::error::Result;
use crate::graph::{DType, Tensor};

use super::weights::{linear, Weights};

/// One layer's MoE over `x` (`[t, h]`): the routed experts (by score or by token id) and the
/// shared expert, each `down(silu(min(gate, L)) * clamp(up, -L, L))`.
pub(super) fn moe(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    ids: &Tensor,
) -> Result<Tensor> {
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
    // A rank's experts are its `e / ranks`, from its first (an input, see `super::shard`);
    // its shared expert is its share of the channels: the sum is partial.
    let mut out = expert(&format!("{f}.shared_experts"))?;
    let first = w.first_expert()?;
    for x_e in 0..e / w.ranks() {
        let mut id = b.full(x_e as f64, [t, k], DType::I32)?;
        if let Some(first) = &first {
            id = id.broadcast_add(&first.reshape([1, 1])?)?;
        }
        let weight = chosen
            .eq(&id)?
            .where_cond(&weights, &weights.full_like(0.0)?)?
            .sum_keepdim(1)?;
        out = out.add(&expert(&format!("{f}.experts.{x_e}"))?.broadcast_mul(&weight)?)?;
    }
    Ok(out)
}
