//! DeepSeek-V4 under tensor parallelism: which of its tensors split across the ranks and how.
//! Every rank runs one and the same graph (one NEFF per bucket), so a rank's tensors take
//! rank-independent names (a routed expert is named by its place among the rank's experts) and
//! the rank's offsets come in as an input ([`crate::model::shard::SHARD_OFFSETS`]: its first
//! routed expert, then its first vocabulary row).
//!
//! Split: the attention heads (`wq_b` and `attn_sink` by head, `wo_a` by output group, `wo_b`
//! by its groups' columns), the routed experts (whole experts, `n_routed_experts / ranks` a
//! rank), the shared expert (by intermediate channel) and the LM head (by vocabulary row). The
//! single K=V head, the compressors, the indexer, the router, the hyper-connections, the norms
//! and the embedding are the same on every rank: they are per token, not per head. A rank's
//! attention output and expert sum are partial; the graph all-reduces them.

use std::collections::HashMap;

use candle_core::Tensor as CTensor;

use crate::config::v4::V4Config;
use crate::error::{Error, Result};

use super::tensors::{self, V4Tensor, V4TensorKind};

/// How a rank's copy of a tensor is cut from the published one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum V4Split {
    /// The whole tensor.
    Whole,
    /// Rank `r`'s `1 / ranks` of the rows (dim 0).
    Rows,
    /// Rank `r`'s `1 / ranks` of the columns (dim 1).
    Cols,
    /// Routed expert `r x experts_per_rank + index` of its layer, whole: the published name is
    /// the tensor's `published`, with the expert's global index in place of `{}`.
    Expert {
        /// The published name with `{}` for the expert index.
        published: String,
        /// The expert's place among the rank's.
        index: usize,
    },
}

/// One tensor of a rank: its graph input name and shape, and how it is cut.
#[derive(Debug, Clone)]
pub struct RankTensor {
    /// The graph input's name (the published name, but a routed expert's local index).
    pub name: String,
    /// The rank's shape.
    pub shape: Vec<usize>,
    /// What it holds.
    pub kind: V4TensorKind,
    /// How it is cut.
    pub split: V4Split,
}

/// Why `cfg` cannot split `ranks` ways (a count `ranks` does not divide), or `None`.
pub fn indivisible(cfg: &V4Config, ranks: usize) -> Option<String> {
    let counts = [
        ("num_attention_heads", cfg.num_attention_heads),
        ("o_groups", cfg.o_groups),
        ("n_routed_experts", cfg.n_routed_experts),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ];
    let bad: Vec<String> = counts
        .iter()
        .filter(|(_, n)| ranks == 0 || !n.is_multiple_of(ranks))
        .map(|(key, n)| format!("{key} {n}"))
        .collect();
    (!bad.is_empty()).then(|| {
        format!(
            "DeepSeek-V4 splits its heads, output groups, experts, expert channels and \
             vocabulary across the ranks, and {ranks} does not divide {}",
            bad.join(", ")
        )
    })
}

/// Every tensor a rank of a `ranks`-way split holds, in [`tensors::expected`]'s order.
pub fn rank_tensors(cfg: &V4Config, ranks: usize) -> Result<Vec<RankTensor>> {
    if let Some(why) = indivisible(cfg, ranks) {
        return Err(Error::InvalidInput(why));
    }
    let per_rank = cfg.n_routed_experts / ranks;
    let mut out = Vec::new();
    for t in tensors::expected(cfg) {
        let V4Tensor { names, shape, kind } = t;
        let name = names[0].clone();
        if let Some((layer, (index, rest))) = expert_of(&name) {
            if index >= per_rank {
                continue;
            }
            let published = format!("{layer}.ffn.experts.{{}}.{rest}");
            out.push(RankTensor {
                name: name.clone(),
                shape,
                kind,
                split: V4Split::Expert { published, index },
            });
            continue;
        }
        let split = split_of(&name);
        let mut shape = shape;
        match split {
            V4Split::Rows => shape[0] /= ranks,
            V4Split::Cols => shape[1] /= ranks,
            _ => {}
        }
        out.push(RankTensor {
            name,
            shape,
            kind,
            split,
        });
    }
    Ok(out)
}

/// `(layer prefix, (expert index, rest of the name))` of a routed expert's tensor.
fn expert_of(name: &str) -> Option<(&str, (usize, &str))> {
    let (layer, tail) = name.split_once(".ffn.experts.")?;
    let (index, rest) = tail.split_once('.')?;
    Some((layer, (index.parse().ok()?, rest)))
}

/// How a tensor that is not a routed expert's splits.
fn split_of(name: &str) -> V4Split {
    let rows = [
        ".attn.wq_b.weight",
        ".attn.attn_sink",
        ".attn.wo_a.weight",
        ".shared_experts.w1.weight",
        ".shared_experts.w3.weight",
    ];
    let cols = [".attn.wo_b.weight", ".shared_experts.w2.weight"];
    match name {
        "head.weight" => V4Split::Rows,
        _ if rows.iter().any(|s| name.ends_with(s)) => V4Split::Rows,
        _ if cols.iter().any(|s| name.ends_with(s)) => V4Split::Cols,
        _ => V4Split::Whole,
    }
}

/// Rank `rank`'s tensors of a `ranks`-way split, cut from the whole model's `full` (by
/// published name, as [`tensors::load_f32`] reads them), with its offsets input.
pub fn rank_weights(
    cfg: &V4Config,
    full: &HashMap<String, CTensor>,
    ranks: usize,
    rank: usize,
) -> Result<HashMap<String, CTensor>> {
    let per_rank = cfg.n_routed_experts / ranks.max(1);
    let get = |name: &str| {
        full.get(name)
            .ok_or_else(|| Error::Weights(format!("tensor `{name}` is missing")))
    };
    let mut out = HashMap::new();
    for t in rank_tensors(cfg, ranks)? {
        let value = match &t.split {
            V4Split::Whole => get(&t.name)?.clone(),
            V4Split::Rows => get(&t.name)?.narrow(0, rank * t.shape[0], t.shape[0])?,
            V4Split::Cols => get(&t.name)?.narrow(1, rank * t.shape[1], t.shape[1])?,
            V4Split::Expert { published, index } => {
                let global = (rank * per_rank + index).to_string();
                get(&published.replace("{}", &global))?.clone()
            }
        };
        out.insert(t.name, value.contiguous()?);
    }
    if ranks > 1 {
        let first_row = rank * cfg.vocab_size / ranks;
        let offsets = vec![(rank * per_rank) as i32, first_row as i32];
        let offsets = CTensor::from_vec(offsets, 2, &candle_core::Device::Cpu)?;
        out.insert(crate::model::shard::SHARD_OFFSETS.to_string(), offsets);
    }
    Ok(out)
}
