//! DeepSeek-V4 under tensor parallelism: which of its tensors split across the ranks and how.
//! Every rank runs one and the same graph (one NEFF per bucket), so a rank's tensors take
//! rank-independent names (each projection of a layer's routed experts is one stacked tensor,
//! `layers.N.ffn.experts.w1` of `[experts a rank, out, in]`, the rank's experts in order) and
//! the rank's offsets come in as an input ([`SHARD_OFFSETS`]: its first vocabulary row, then
//! its first routed expert, as for MLA).
//!
//! Split: the attention heads (`wq_b` and `attn_sink` by head, `wo_a` by output group, `wo_b`
//! by its groups' columns; with more ranks than groups, as V4-Flash's 8 groups at `--tp 32`, a
//! rank projects its heads' part of its group, a partial sum like the rest), the routed
//! experts (whole experts, `n_routed_experts / ranks` a rank), the shared expert (by
//! intermediate channel), and the embedding and the LM head (by vocabulary row: a rank looks
//! up the ids its rows hold, and the all-reduce fills in the others). The single K=V head, the
//! compressors, the indexer, the router, the hyper-connections and the norms are the same on
//! every rank: they are per token, not per head. A rank's attention output and expert sum are
//! partial; the graph all-reduces them.
//!
//! A device runner reads a rank's share straight from the checkpoint ([`RankReader`]); the
//! CPU runner and `lower` cut it from the model read whole ([`rank_weights`]).

use std::collections::HashMap;

use candle_core::Tensor as CTensor;

use crate::config::v4::{V4Config, FP4_GROUP};
use crate::error::{Error, Result};
use crate::graph::DType;
use crate::model::shard::SHARD_OFFSETS;
use crate::weights::{scale_name, Checkpoint};

use super::tensors::{self, V4Tensor, V4TensorKind};

/// What a stacked FP4 expert projection's scales are named after it (`layers.N.ffn.experts.w1`
/// and `layers.N.ffn.experts.w1_scale`), as MLA's quantized experts' are.
pub const FP4_SCALE_SUFFIX: &str = "_scale";

/// How a rank's copy of a tensor is cut from the published one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum V4Split {
    /// The whole tensor.
    Whole,
    /// Rank `r`'s `1 / ranks` of the rows (dim 0).
    Rows,
    /// Rank `r`'s `1 / ranks` of the columns (dim 1).
    Cols,
    /// `wo_a` (`[groups x rank_o, heads x head_dim / groups]`): the rank's groups' rows, or,
    /// with more ranks than groups, its group's rows and its heads' columns.
    OutputA,
    /// `wo_b` (`[hidden, groups x rank_o]`): the columns of the rank's groups (of its group,
    /// with more ranks than groups, which the ranks sharing that group all hold).
    OutputB,
    /// One projection of a layer's routed experts, stacked: rank `r`'s experts `r x per_rank`
    /// onward, each whole, read under `published` with the expert's index in place of `{}`.
    Experts {
        /// The published name of one expert's tensor, `{}` for its index.
        published: String,
    },
}

/// One tensor of a rank: its graph input name and shape, and how it is cut.
#[derive(Debug, Clone)]
pub struct RankTensor {
    /// The graph input's name (the published name, but stacked routed experts').
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
        ("n_routed_experts", cfg.n_routed_experts),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ];
    let mut bad: Vec<String> = counts
        .iter()
        .filter(|(_, n)| ranks == 0 || !n.is_multiple_of(ranks))
        .map(|(key, n)| format!("{key} {n}"))
        .collect();
    let g = cfg.o_groups;
    if ranks > 0 && !g.is_multiple_of(ranks) && !ranks.is_multiple_of(g) {
        bad.push(format!("o_groups {g} (nor does it divide {ranks})"));
    }
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
            // Stacked once, where the layer's first expert is listed.
            if index > 0 {
                continue;
            }
            let proj = rest.strip_suffix(".weight").unwrap_or(rest);
            let stacked = stacked_experts(layer, proj);
            let published = format!("{layer}.ffn.experts.{{}}.{rest}");
            if kind == V4TensorKind::Fp4 {
                // Codes two a byte and one scale per 32 inputs, each stacked.
                let (rows, inputs) = (shape[0], shape[1]);
                out.push(RankTensor {
                    name: format!("{stacked}{FP4_SCALE_SUFFIX}"),
                    shape: vec![per_rank, rows, inputs / FP4_GROUP],
                    kind: V4TensorKind::Float,
                    split: V4Split::Experts {
                        published: scale_name(&published),
                    },
                });
                out.push(RankTensor {
                    name: stacked,
                    shape: vec![per_rank, rows, inputs / 2],
                    kind,
                    split: V4Split::Experts { published },
                });
                continue;
            }
            out.push(RankTensor {
                name: stacked,
                shape: [vec![per_rank], shape].concat(),
                kind,
                split: V4Split::Experts { published },
            });
            continue;
        }
        let split = split_of(&name);
        let mut shape = shape;
        let groups = local_groups(cfg, ranks);
        let rows_o = groups * cfg.o_lora_rank;
        match split {
            V4Split::Rows => shape[0] /= ranks,
            V4Split::Cols => shape[1] /= ranks,
            V4Split::OutputA => {
                shape = vec![
                    rows_o,
                    cfg.num_attention_heads / ranks * cfg.head_dim / groups,
                ]
            }
            V4Split::OutputB => shape[1] = rows_o,
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

/// Output groups a rank projects: its share of them, or the one group its heads belong to when
/// the ranks outnumber the groups.
pub fn local_groups(cfg: &V4Config, ranks: usize) -> usize {
    (cfg.o_groups / ranks).max(1)
}

/// The graph input of projection `proj` (`w1`, `w2`, `w3`) of the routed experts of layer
/// `layer` (`layers.N`): a rank's experts stacked, `[experts a rank, out, in]`.
pub fn stacked_experts(layer: &str, proj: &str) -> String {
    format!("{layer}.ffn.experts.{proj}")
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
        ".shared_experts.w1.weight",
        ".shared_experts.w3.weight",
    ];
    let cols = [".shared_experts.w2.weight"];
    match name {
        "head.weight" | "embed.weight" => V4Split::Rows,
        _ if name.ends_with(".attn.wo_a.weight") => V4Split::OutputA,
        _ if name.ends_with(".attn.wo_b.weight") => V4Split::OutputB,
        _ if rows.iter().any(|s| name.ends_with(s)) => V4Split::Rows,
        _ if cols.iter().any(|s| name.ends_with(s)) => V4Split::Cols,
        _ => V4Split::Whole,
    }
}

/// Which block of `wo_a` rank `rank` holds: its first group (in units of its
/// [`local_groups`]), and its heads' place within the group.
fn group_of(cfg: &V4Config, ranks: usize, rank: usize) -> (usize, usize) {
    match ranks <= cfg.o_groups {
        true => (rank, 0),
        false => {
            let share = ranks / cfg.o_groups;
            (rank / share, rank % share)
        }
    }
}

/// Rank `rank`'s tensors of a `ranks`-way split, cut from the whole model's `full`: by published
/// name, as [`tensors::load`] reads them, or an unsplit rank's (this with `ranks` 1: the
/// routed experts already stacked, as a runner holds them). With its offsets input.
pub fn rank_weights(
    cfg: &V4Config,
    full: &HashMap<String, CTensor>,
    ranks: usize,
    rank: usize,
) -> Result<HashMap<String, CTensor>> {
    let per_rank = cfg.n_routed_experts / ranks.max(1);
    let mut get = |name: &str| {
        full.get(name)
            .cloned()
            .ok_or_else(|| Error::Weights(format!("tensor `{name}` is missing")))
    };
    let mut out = HashMap::new();
    for t in rank_tensors(cfg, ranks)? {
        let value = match full.get(&t.name) {
            // Stacked already (`full` is an unsplit rank's tensors): the rank's experts.
            Some(stacked) if matches!(t.split, V4Split::Experts { .. }) => {
                stacked.narrow(0, rank * per_rank, per_rank)?
            }
            _ => cut(cfg, &t, ranks, rank, &mut get)?,
        };
        out.insert(t.name, value.contiguous()?);
    }
    if ranks > 1 {
        out.insert(SHARD_OFFSETS.to_string(), offsets(cfg, ranks, rank)?);
    }
    Ok(out)
}

/// Rank `rank`'s copy of `t` (one of [`rank_tensors`]' for `ranks`), cut from the published
/// tensors `get` gives by name.
fn cut(
    cfg: &V4Config,
    t: &RankTensor,
    ranks: usize,
    rank: usize,
    get: &mut dyn FnMut(&str) -> Result<CTensor>,
) -> Result<CTensor> {
    Ok(match &t.split {
        V4Split::Whole => get(&t.name)?,
        V4Split::Rows => get(&t.name)?.narrow(0, rank * t.shape[0], t.shape[0])?,
        V4Split::Cols => get(&t.name)?.narrow(1, rank * t.shape[1], t.shape[1])?,
        // With more ranks than groups, `ranks / groups` ranks share a group: rank r has
        // group r / share, and within it the columns of its heads, r % share.
        V4Split::OutputA => {
            let (group, within) = group_of(cfg, ranks, rank);
            get(&t.name)?
                .narrow(0, group * t.shape[0], t.shape[0])?
                .narrow(1, within * t.shape[1], t.shape[1])?
        }
        V4Split::OutputB => {
            let (group, _) = group_of(cfg, ranks, rank);
            get(&t.name)?.narrow(1, group * t.shape[1], t.shape[1])?
        }
        V4Split::Experts { published } => {
            let per_rank = t.shape[0];
            let experts = (rank * per_rank..(rank + 1) * per_rank)
                .map(|e| get(&published.replace("{}", &e.to_string())))
                .collect::<Result<Vec<_>>>()?;
            CTensor::stack(&experts, 0)?
        }
    })
}

/// Rank `rank`'s [`SHARD_OFFSETS`] input in a `ranks`-way split: MLA's order, its first
/// vocabulary row, then its first routed expert.
fn offsets(cfg: &V4Config, ranks: usize, rank: usize) -> Result<CTensor> {
    let first_row = rank * cfg.vocab_size / ranks;
    let first_expert = rank * cfg.n_routed_experts / ranks;
    let offsets = vec![first_row as i32, first_expert as i32];
    Ok(CTensor::from_vec(offsets, 2, &candle_core::Device::Cpu)?)
}

/// Reads one rank's tensors from a checkpoint one graph input at a time, as a device runner
/// uploads them: the host holds the published tensors of one input (one tensor, or the rank's
/// experts of one projection) and the rank's cut of them, never the model. Built once per rank
/// (it indexes the model's tensors by name).
#[derive(Debug)]
pub struct RankReader {
    cfg: V4Config,
    ranks: usize,
    rank: usize,
    /// The rank's graph inputs, by name.
    inputs: HashMap<String, RankTensor>,
    /// Every published tensor, by each of its names (and an FP4 expert's by its scales').
    published: HashMap<String, usize>,
    tensors: Vec<V4Tensor>,
    /// The dtype the rank's matrices are held in.
    weights: DType,
}

impl RankReader {
    /// The reader of rank `rank` of a `ranks`-way split of `cfg`, its matrices held in
    /// `weights`. Fails on a degree that does not divide the model.
    pub fn new(cfg: &V4Config, ranks: usize, rank: usize, weights: DType) -> Result<Self> {
        let inputs = rank_tensors(cfg, ranks)?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        let tensors = tensors::expected(cfg);
        let mut published = HashMap::new();
        for (i, t) in tensors.iter().enumerate() {
            for name in &t.names {
                published.insert(name.clone(), i);
            }
            if t.kind == V4TensorKind::Fp4 {
                published.insert(scale_name(&t.names[0]), i);
            }
        }
        Ok(RankReader {
            cfg: cfg.clone(),
            ranks,
            rank,
            inputs,
            published,
            tensors,
            weights,
        })
    }

    /// Graph input `name` of this rank, read from `ckpt` (checked by [`tensors::check`])
    /// now, with the input made together with it: an FP4 expert projection's codes and its
    /// scales (`..._scale`) come together, whichever is asked for. `None` if the rank has no
    /// such input.
    pub fn read(&self, ckpt: &Checkpoint, name: &str) -> Result<Option<Vec<(String, CTensor)>>> {
        if name == SHARD_OFFSETS {
            return match self.ranks {
                1 => Ok(None),
                _ => Ok(Some(vec![(
                    name.to_string(),
                    offsets(&self.cfg, self.ranks, self.rank)?,
                )])),
            };
        }
        let param = name.strip_suffix(FP4_SCALE_SUFFIX).unwrap_or(name);
        let scales = format!("{param}{FP4_SCALE_SUFFIX}");
        let made: Vec<&RankTensor> = [param, scales.as_str()]
            .into_iter()
            .filter_map(|n| self.inputs.get(n))
            .collect();
        if !made.iter().any(|t| t.name == name) {
            return Ok(None);
        }
        // What a read gives beside what was asked (an FP4 expert's scales with its codes).
        let mut read: HashMap<String, CTensor> = HashMap::new();
        let mut get = |published: &str| -> Result<CTensor> {
            if let Some(t) = read.remove(published) {
                return Ok(t);
            }
            let t = self
                .published
                .get(published)
                .map(|&i| &self.tensors[i])
                .ok_or_else(|| Error::Weights(format!("tensor `{published}` is missing")))?;
            read.extend(tensors::read(&self.cfg, ckpt, t, self.weights)?);
            read.remove(published)
                .ok_or_else(|| Error::Weights(format!("tensor `{published}` is missing")))
        };
        made.into_iter()
            .map(|t| {
                let value = cut(&self.cfg, t, self.ranks, self.rank, &mut get)?.contiguous()?;
                Ok((t.name.clone(), value))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> V4Config {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-v4");
        let text = std::fs::read_to_string(path.join("config.json")).unwrap();
        V4Config::from_json_str(&text).unwrap()
    }

    #[test]
    fn a_degree_that_does_not_divide_the_model_is_named() {
        let cfg = tiny();
        assert_eq!(indivisible(&cfg, 2), None);
        assert_eq!(indivisible(&cfg, 4), None, "4 ranks share the 2 groups");
        let why = indivisible(&cfg, 3).unwrap();
        for key in ["num_attention_heads 4", "n_routed_experts 8", "o_groups 2"] {
            assert!(why.contains(key), "{why}");
        }
        assert!(rank_tensors(&cfg, 3).is_err());
    }

    #[test]
    fn each_rank_holds_its_share_of_the_split_tensors() {
        let cfg = tiny();
        let shapes = |ranks| -> HashMap<String, Vec<usize>> {
            rank_tensors(&cfg, ranks)
                .unwrap()
                .into_iter()
                .map(|t| (t.name, t.shape))
                .collect()
        };
        let (one, four) = (shapes(1), shapes(4));
        // Heads: 4 of 32 channels; wo_a: one group's 16 rows, one head's 32 columns.
        assert_eq!(four["layers.0.attn.wq_b.weight"], [32, 32]);
        assert_eq!(four["layers.0.attn.wo_a.weight"], [16, 32]);
        assert_eq!(one["layers.0.attn.wo_a.weight"], [32, 64]);
        assert_eq!(four["layers.0.attn.wo_b.weight"], [64, 16]);
        // Two of the eight experts, stacked per projection (w1: [experts, moe width, hidden]).
        assert_eq!(four["layers.2.ffn.experts.w1"], [2, 32, 64]);
        assert_eq!(one["layers.2.ffn.experts.w2"], [8, 64, 32]);
        assert!(!four.keys().any(|k| k.contains(".experts.0.")));
        assert_eq!(four["head.weight"], [128, 64]);
        assert_eq!(four["embed.weight"], [128, 64]);
        assert_eq!(
            four["layers.1.attn.wkv.weight"],
            one["layers.1.attn.wkv.weight"]
        );
    }
}
