//! V4's feed-forward: every layer is MoE, routed by `sqrtsoftplus` scores with a correction
//! bias or by a frozen token-id table (`tid2eid`), with a shared expert and the SwiGLU clamp.
//! Per token, shared by the cache-free forward and the cached step.

use crate::config::v4::{V4Config, V4Routing, V4Scoring, FP4_GROUP};
use crate::error::Result;
use crate::graph::{DType, FourBit, Tensor};

use crate::model::moe::routing_matrix;
use crate::model::ops;
use crate::model::precision::Dots;
use crate::model::MoeStrategy;

use super::shard::{self, FP4_SCALE_SUFFIX};
use super::weights::Weights;

/// One layer's MoE over `x` (`[t, h]`): the routed experts (by score or by token id, evaluated
/// as `strategy` says) and the shared expert, each `down(silu(min(gate, L)) * clamp(up, -L,
/// L))`.
pub(super) fn moe(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    ids: &Tensor,
    strategy: MoeStrategy,
) -> Result<Tensor> {
    let b = x.builder();
    let f = format!("{}.ffn", cfg.layer_prefix(l));
    let t = x.dim(0);
    let (e, k) = (cfg.n_routed_experts, cfg.num_experts_per_tok);
    let logits = w.linear(x, &format!("{f}.gate.weight"))?;
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
    let shared = format!("{f}.shared_experts");
    let gate = w.linear(x, &format!("{shared}.w1.weight"))?;
    let up = w.linear(x, &format!("{shared}.w3.weight"))?;
    // A rank's shared expert is its share of the channels, its routed experts its `e /
    // ranks` from its first (an input, see `super::shard`): both sums are partial. Another
    // rank's expert runs here as the rank's first, with weight 0.
    let shared = w.linear(
        &clamped_swiglu(&gate, &up, limit)?,
        &format!("{shared}.w2.weight"),
    )?;
    let local = e / w.ranks();
    let (chosen, weights) = match w.first_expert()? {
        None => (chosen, weights),
        Some(first) => {
            let id = chosen.broadcast_sub(&first.reshape([1, 1])?)?;
            let zero = id.full_like(0.0)?;
            let mine = id.ge(&zero)?;
            let mine = mine.where_cond(&id.lt(&id.full_like(local as f64)?)?, &mine)?;
            (
                mine.where_cond(&id, &zero)?,
                mine.where_cond(&weights, &weights.full_like(0.0)?)?,
            )
        }
    };
    let experts = Experts {
        layer: cfg.layer_prefix(l),
        limit,
    };
    let routed = match strategy {
        MoeStrategy::Gather => experts.gathered(w, x, &chosen, &weights)?,
        MoeStrategy::Dense => experts.dense(w, x, &chosen, &weights, local)?,
    };
    shared.add(&routed)
}

/// `silu(min(gate, limit)) * clamp(up, -limit, limit)`: V4's SwiGLU, clamped.
fn clamped_swiglu(gate: &Tensor, up: &Tensor, limit: f64) -> Result<Tensor> {
    let gate = gate.minimum(&gate.full_like(limit)?)?;
    let up = up
        .minimum(&up.full_like(limit)?)?
        .maximum(&up.full_like(-limit)?)?;
    gate.silu()?.mul(&up)
}

/// A layer's routed experts, stacked per projection ([`shard::stacked_experts`]).
struct Experts {
    layer: String,
    limit: f64,
}

impl Experts {
    /// Projection `proj` of the experts `ids` selects (all of the rank's with `ids` `None`),
    /// `[n, out, in]`: float experts as held, FP4 codes dequantized with their scales right
    /// here, where the experts are used, to f32 under [`Dots::Widen`] (the CPU fuses this into
    /// its expert matmul) or to bf16 on a device (which reads a selected expert's bytes, never
    /// an f32 copy).
    fn weights(&self, w: &Weights, proj: &str, ids: Option<&Tensor>) -> Result<Tensor> {
        let name = shard::stacked_experts(&self.layer, proj);
        let pick = |t: &Tensor| match ids {
            Some(ids) => t.index_select(ids, 0),
            None => Ok(t.clone()),
        };
        let stored = pick(w.get(&name)?)?;
        if stored.dtype() != DType::U8 {
            return Ok(stored);
        }
        let scales = pick(w.get(&format!("{name}{FP4_SCALE_SUFFIX}"))?)?;
        // E2M1 values times power-of-two scales are exact in bf16: a device multiplies them
        // there, never holding an f32 copy.
        let dtype = match w.dots() {
            Dots::Widen => DType::F32,
            Dots::Split | Dots::Narrow => DType::BF16,
        };
        stored.dequantize_4bit_to(&scales, FP4_GROUP, FourBit::E2m1, dtype)
    }

    /// The selected experts only: each token's row multiplied by each of its `k` experts'
    /// matrices, gathered (`[t x k, out, in]`), then weighted and summed. Reads `t x k`
    /// experts: what a CPU (and a small decode batch anywhere) wants.
    fn gathered(&self, w: &Weights, x: &Tensor, ids: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let (t, h, k) = (x.dim(0), x.dim(1), ids.dim(1));
        let flat = ids.reshape([t * k])?;
        let xs = x
            .unsqueeze(1)?
            .broadcast_as([t, k, h])?
            .reshape([t * k, 1, h])?;
        let project = |proj: &str, input: &Tensor| -> Result<Tensor> {
            ops::matmul(w.dots(), input, &self.weights(w, proj, Some(&flat))?.t()?)
        };
        let act = clamped_swiglu(&project("w1", &xs)?, &project("w3", &xs)?, self.limit)?;
        project("w2", &act)?
            .reshape([t, k, h])?
            .broadcast_mul(&weights.unsqueeze(2)?)?
            .sum(1)
    }

    /// Every one of the rank's `local` experts on every token, weighted by a routing matrix that
    /// is zero outside each token's selection. Reads each expert once: cheaper once `t x k`
    /// passes the experts a rank holds (a long prefill chunk on a device).
    fn dense(
        &self,
        w: &Weights,
        x: &Tensor,
        ids: &Tensor,
        weights: &Tensor,
        local: usize,
    ) -> Result<Tensor> {
        let (t, h) = (x.dim(0), x.dim(1));
        let routing = routing_matrix(ids, weights, local)?; // [t, local]
        let xs = x.unsqueeze(0)?.broadcast_as([local, t, h])?;
        let project = |proj: &str, input: &Tensor| -> Result<Tensor> {
            ops::matmul(w.dots(), input, &self.weights(w, proj, None)?.t()?)
        };
        let act = clamped_swiglu(&project("w1", &xs)?, &project("w3", &xs)?, self.limit)?;
        project("w2", &act)?
            .broadcast_mul(&routing.t()?.unsqueeze(2)?)?
            .sum(0)
    }
}
