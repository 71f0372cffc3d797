//! The MoE block: router, routed experts, shared experts. Dropless: every token gets exactly its
//! `num_experts_per_tok` experts, whatever the batch.
//!
//! Two static strategies compute the same function:
//! - [`MoeStrategy::Gather`] indexes the stacked expert weights by the selected ids and runs
//!   only those (reads `tokens * top_k` experts: cheap for small batches);
//! - [`MoeStrategy::Dense`] runs every expert on every token and weights the results with a
//!   routing matrix that is zero outside the selection (reads each expert once: cheaper once
//!   `tokens * top_k` exceeds the number of experts).

use crate::config::{ModelConfig, RoutingConfig, ScoringFunc, TopkMethod};
use crate::error::Result;
use crate::graph::{DType, Tensor};

use super::ops::{linear, matmul, mlp, softmax};
use super::precision::{Dots, INT4_GROUP};
use super::Weights;

/// How a graph evaluates the routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MoeStrategy {
    /// Gather the selected experts' weights (small batches).
    Gather,
    /// All experts under a routing mask (large batches).
    Dense,
}

impl MoeStrategy {
    /// The cheaper strategy for `tokens` tokens on a rank of a `ranks`-way tensor-parallel
    /// model: gather while it reads fewer experts than the rank owns.
    pub fn for_tokens(routing: &RoutingConfig, tokens: usize, ranks: usize) -> Self {
        Self::cheaper(
            tokens * routing.num_experts_per_tok,
            routing.n_routed_experts,
            ranks,
        )
    }

    /// [`MoeStrategy::for_tokens`] with `cfg`'s router (a DeepSeek-V4 model's too); dense for a
    /// model without routed experts, where it does not matter.
    pub fn for_model(cfg: &ModelConfig, tokens: usize, ranks: usize) -> Self {
        match (&cfg.v4, &cfg.routing) {
            (Some(v4), _) => {
                Self::cheaper(tokens * v4.num_experts_per_tok, v4.n_routed_experts, ranks)
            }
            (None, Some(r)) => Self::for_tokens(r, tokens, ranks),
            (None, None) => MoeStrategy::Dense,
        }
    }

    /// Gather while `selected` expert evaluations are fewer than the `experts / ranks` a rank
    /// owns.
    fn cheaper(selected: usize, experts: usize, ranks: usize) -> Self {
        match selected <= experts / ranks.max(1) {
            true => MoeStrategy::Gather,
            false => MoeStrategy::Dense,
        }
    }
}

/// Expert ids (`[T, k]`, i32) and their weights (`[T, k]`) for each token of `x` (`[T, H]`).
pub fn route(
    cfg: &ModelConfig,
    r: &RoutingConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let p = format!("model.layers.{layer}.mlp.gate");
    let b = x.builder();
    let t = x.dim(0);
    let e = r.n_routed_experts;
    // The router runs in f32 on an f32 weight whatever the policy (see `params`): its scores
    // decide which experts run.
    let logits = linear(w.dots(), x, &w.get(&format!("{p}.weight"))?)?;
    let scores = match r.scoring_func {
        ScoringFunc::Softmax => softmax(&logits, 1)?,
        ScoringFunc::Sigmoid => logits.sigmoid()?,
    };
    let mut choice = if r.topk_method == TopkMethod::NoauxTc {
        scores.broadcast_add(&w.get(&format!("{p}.e_score_correction_bias"))?)?
    } else {
        scores.clone()
    };
    if r.topk_method != TopkMethod::Greedy && r.n_group > 1 {
        let (g, per) = (r.n_group, e / r.n_group);
        let grouped = choice.reshape([t * g, per])?;
        let group_score = if r.topk_method == TopkMethod::NoauxTc {
            // Sum of the two best experts of each group.
            let top2 = grouped.topk(2.min(per))?;
            grouped.gather(&top2, 1)?.sum(1)?
        } else {
            grouped.max(1)?
        }
        .reshape([t, g])?;
        let kept = group_score.topk(r.topk_group)?; // [t, topk_group]
        let group_ids = b.iota([t, r.topk_group, g], DType::I32, 2)?;
        let hit = kept
            .unsqueeze(2)?
            .broadcast_as([t, r.topk_group, g])?
            .eq(&group_ids)?
            .to_dtype(DType::F32)?
            .sum(1)?; // [t, g]: 1 for kept groups
        let keep = hit
            .gt(&hit.full_like(0.5)?)?
            .unsqueeze(2)?
            .broadcast_as([t, g, per])?
            .reshape([t, e])?;
        choice = keep.where_cond(&choice, &choice.full_like(f64::NEG_INFINITY)?)?;
    }
    let ids = choice.topk(r.num_experts_per_tok)?;
    let mut weights = scores.gather(&ids, 1)?;
    let k = r.num_experts_per_tok;
    // V3 normalizes (when asked) and then always scales. V2's reference code normalizes when
    // asked and top_k > 1, and scales only otherwise. (HF's V2 port always scales and never
    // normalizes; the published V2 configs have norm_topk_prob = false, where all agree.)
    let normalize = r.norm_topk_prob && (cfg.architecture.routes_like_v3() || k > 1);
    if normalize {
        let denom = weights.sum_keepdim(1)?.affine(1.0, 1e-20)?;
        weights = weights.broadcast_div(&denom)?;
    }
    if cfg.architecture.routes_like_v3() || !normalize {
        weights = weights.affine(r.routed_scaling_factor, 0.0)?;
    }
    Ok((ids, weights))
}

/// The MoE block on normalized hidden states `x` (`[T, H]`). Under tensor parallelism a rank
/// evaluates the selected experts it owns (routing is computed whole on every rank) and the
/// shared experts' slice: its share of the block's output.
pub fn moe(
    cfg: &ModelConfig,
    r: &RoutingConfig,
    w: &Weights,
    layer: usize,
    x: &Tensor,
    strategy: MoeStrategy,
) -> Result<Tensor> {
    let (ids, weights) = route(cfg, r, w, layer, x)?;
    let p = format!("model.layers.{layer}.mlp");
    let gate = Experts::new(w, &format!("{p}.experts.gate_proj"))?;
    // Another rank's expert runs here as this rank's first one, with weight 0.
    let (ids, weights) = match w.ranks() {
        1 => (ids, weights),
        _ => {
            let (local, mine) = w.local_ids(&ids, 1, gate.dim(0))?;
            (local, mine.where_cond(&weights, &weights.full_like(0.0)?)?)
        }
    };
    let up = Experts::new(w, &format!("{p}.experts.up_proj"))?;
    let down = Experts::new(w, &format!("{p}.experts.down_proj"))?;
    let routed = match strategy {
        MoeStrategy::Gather => gathered_experts(w, x, &ids, &weights, &gate, &up, &down)?,
        MoeStrategy::Dense => dense_experts(w, x, &ids, &weights, &gate, &up, &down)?,
    };
    if cfg.n_shared_experts == 0 {
        return Ok(routed);
    }
    let s = format!("{p}.shared_experts");
    let shared = mlp(
        w.dots(),
        x,
        &w.get(&format!("{s}.gate_proj.weight"))?,
        &w.get(&format!("{s}.up_proj.weight"))?,
        &w.get(&format!("{s}.down_proj.weight"))?,
    )?;
    routed.add(&shared)
}

/// One stacked expert projection (`[experts, out, in]`), with its scales when quantized:
/// int8 codes with one scale per output channel, or int4 codes two a byte with one scale per
/// [`INT4_GROUP`] inputs of each output channel (`params::quantize_rows_int4`).
struct Experts {
    w: Tensor,
    scale: Option<Tensor>,
}

impl Experts {
    fn new(w: &Weights, name: &str) -> Result<Self> {
        let weight = w.get(name)?;
        let scale = match weight.dtype() {
            DType::I8 | DType::U8 => Some(w.get(&format!("{name}_scale"))?),
            _ => None,
        };
        Ok(Experts { w: weight, scale })
    }

    /// `x @ W^T` for the experts `ids` selects (one row block of `x` per selected expert:
    /// `x` is `[n, rows, in]` for `ids` of `[n]`) or, with `ids` `None`, for every expert (`x`
    /// is `[experts, rows, in]`): `[.., rows, out]` in f32. Quantized experts are dequantized
    /// only where selected, right before their matmul, in the form the precision policy asks
    /// for (module docs of [`super::precision`]):
    /// - [`Dots::Widen`]: the codes times their scales in f32 ([`dequantize`]), the form the
    ///   CPU backend fuses into its expert matmul kernels;
    /// - [`Dots::Split`] and [`Dots::Narrow`]: int8 codes converted (exactly) to the weights'
    ///   dtype, multiplied, and the dot's f32 output scaled per output channel; int4 codes
    ///   dequantized with their group scales straight to the weights' dtype.
    fn apply(&self, w: &Weights, x: &Tensor, ids: Option<&Tensor>) -> Result<Tensor> {
        let pick = |t: &Tensor| match ids {
            Some(ids) => t.index_select(ids, 0),
            None => Ok(t.clone()),
        };
        let codes = pick(&self.w)?;
        let dots = w.dots();
        let Some(scale) = &self.scale else {
            return matmul(dots, x, &codes.t()?);
        };
        let scale = pick(scale)?;
        let dtype = w.precision().expert_dot_dtype();
        match dots {
            Dots::Widen => matmul(dots, x, &dequantize(&codes, &scale)?.t()?),
            Dots::Split | Dots::Narrow if codes.dtype() == DType::U8 => {
                let weight = codes.dequantize_int4_to(&scale, INT4_GROUP, dtype)?;
                matmul(dots, x, &weight.t()?)
            }
            Dots::Split | Dots::Narrow => {
                matmul(dots, x, &codes.to_dtype(dtype)?.t()?)?.broadcast_mul(&scale.unsqueeze(1)?)
            }
        }
    }

    fn dim(&self, d: usize) -> usize {
        self.w.dim(d)
    }
}

/// `q * scale` in f32 for stacked expert codes `q` and their scales `s` (`--quantize
/// experts-int8|experts-int4`): how a [`Dots::Widen`] graph turns the selected experts (or all
/// of them) back into f32 weights right before their matmul.
///
/// - int8 (`q: [n, out, in]`, `s: [n, out]`): `q as f32 * s` (the form the CPU backend fuses
///   into its matmul kernel).
/// - int4 (`q: [n, out, in / 2]` bytes, `s: [n, out, groups]`): one
///   [`Tensor::dequantize_int4`] (the CPU fuses both forms into its expert matmul kernel).
pub fn dequantize(q: &Tensor, s: &Tensor) -> Result<Tensor> {
    if q.dtype() != DType::U8 {
        return q.to_dtype(DType::F32)?.broadcast_mul(&s.unsqueeze(2)?);
    }
    q.dequantize_int4(s, INT4_GROUP)
}

fn gathered_experts(
    w: &Weights,
    x: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    gate: &Experts,
    up: &Experts,
    down: &Experts,
) -> Result<Tensor> {
    let (t, h) = (x.dim(0), x.dim(1));
    let k = ids.dim(1);
    let flat = ids.reshape([t * k])?;
    let xs = x
        .unsqueeze(1)?
        .broadcast_as([t, k, h])?
        .reshape([t * k, 1, h])?;
    let g = gate.apply(w, &xs, Some(&flat))?.silu()?;
    let u = up.apply(w, &xs, Some(&flat))?;
    let y = down.apply(w, &g.mul(&u)?, Some(&flat))?; // [t*k, 1, h]
    y.reshape([t, k, h])?
        .broadcast_mul(&weights.unsqueeze(2)?)?
        .sum(1)
}

fn dense_experts(
    w: &Weights,
    x: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    gate: &Experts,
    up: &Experts,
    down: &Experts,
) -> Result<Tensor> {
    let (t, h) = (x.dim(0), x.dim(1));
    let e = gate.dim(0);
    let routing = routing_matrix(ids, weights, e)?;
    let xs = x.unsqueeze(0)?.broadcast_as([e, t, h])?;
    let g = gate.apply(w, &xs, None)?.silu()?;
    let u = up.apply(w, &xs, None)?;
    let y = down.apply(w, &g.mul(&u)?, None)?; // [e, t, h]
    y.broadcast_mul(&routing.t()?.unsqueeze(2)?)?.sum(0)
}

/// The dense strategy's routing matrix (`[t, experts]`): the weight of expert `e` for token
/// `t` where `ids` (`[t, k]`) selects it, 0 elsewhere.
pub(crate) fn routing_matrix(ids: &Tensor, weights: &Tensor, experts: usize) -> Result<Tensor> {
    let (t, k) = (ids.dim(0), ids.dim(1));
    let b = ids.builder();
    let expert_ids = b.iota([t, k, experts], DType::I32, 2)?;
    let onehot = ids
        .unsqueeze(2)?
        .broadcast_as([t, k, experts])?
        .eq(&expert_ids)?;
    onehot
        .where_cond(
            &weights.unsqueeze(2)?.broadcast_as([t, k, experts])?,
            &b.full(0.0, [t, k, experts], DType::F32)?,
        )?
        .sum(1)
}
