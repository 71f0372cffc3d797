//! Per-tensor accounting: every weight a rank holds under tensor parallelism, its shard's shape
//! and stored dtype, and the bytes that makes.
//!
//! The parameter set is [`crate::model::WeightSpecs::new`]'s (at one rank), re-listed here with
//! each tensor's sharding rule, because the runner's tensor-parallel layout is being built while
//! this is written and `params.rs` must not depend on it. The rules (tensor parallelism degree N):
//!
//! | tensor | shard per rank |
//! |---|---|
//! | `model.embed_tokens.weight`, `lm_head.weight` | vocabulary rows: `[V/N, hidden]` |
//! | RMSNorm weights, `q_a_proj`, `kv_a_proj_with_mqa`, the router (`mlp.gate.weight`, f32) and V3's `e_score_correction_bias` (f32), `tp_rank` (i32, N > 1 only) | replicated whole |
//! | `q_b_proj` / `q_proj`, `kv_b_proj` | heads: `[heads/N * width, in]` |
//! | `o_proj` | heads, columns: `[hidden, heads/N * v_head_dim]` |
//! | dense MLP, shared experts: `gate_proj`, `up_proj` / `down_proj` | columns / rows of the intermediate: `[I/N, hidden]` / `[hidden, I/N]` |
//! | routed experts, stacked | expert-parallel, whole experts: `[E/N, out, in]` (int8: plus `[E/N, out]` f32 scales) |
//!
//! `tp_rank` is a 4-byte per-rank constant input, not a model parameter; it is counted with the
//! weights (replicated) so that the identity "sum over ranks = total + (N - 1) x replicated"
//! holds exactly. The multi-token-prediction layers of V3 checkpoints
//! (`num_nextn_predict_layers`, `model.layers.61.*` in the published files) are not loaded by the
//! engine and are not counted.
//!
//! # FP8
//!
//! [`WeightFormat::Fp8Block`] is the published DeepSeek-V3/R1 storage: every linear weight of
//! attention and the MLPs (the `*_proj.weight` tensors, dense, shared and routed) in
//! `float8_e4m3fn`, each with one f32 scale per `block` (128 x 128 in the published files:
//! `weight_scale_inv`, `[ceil(out/128), ceil(in/128)]`); embeddings, `lm_head` and norms in bf16;
//! the router in f32 as always. A sharded fp8 weight keeps the scale blocks its rows or columns
//! touch, `ceil(shard/128)` of them: where a shard boundary cuts a block (V3's dense MLP at
//! N = 64: 18432 / 64 = 288 rows), both ranks hold that block's scale, so the sum over ranks can
//! exceed the total by those few scales. The runner today dequantizes fp8 to bf16 at load
//! (`--dtype auto` plans that); `--dtype fp8` plans the storage the device would need to keep
//! fp8 as published.

use crate::config::{Architecture, ModelConfig};
use crate::graph::DType;
use crate::model::Quantize;

/// How the model's weights are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Every weight in this float dtype (the router excepted, which is f32).
    Float(DType),
    /// The published V3 format: linear weights in f8e4m3 with one f32 scale per
    /// `[rows, cols]` block, the rest in bf16 (see the module docs).
    Fp8Block([usize; 2]),
}

impl WeightFormat {
    /// The dtype of the linear (`*_proj`) weights.
    fn linear(self) -> DType {
        match self {
            WeightFormat::Float(d) => d,
            WeightFormat::Fp8Block(_) => DType::F8E4M3,
        }
    }

    /// The dtype of embeddings, `lm_head` and norms.
    fn other(self) -> DType {
        match self {
            WeightFormat::Float(d) => d,
            WeightFormat::Fp8Block(_) => DType::BF16,
        }
    }

    /// The float dtype the rest of the model computes with and, by default, caches in: bf16
    /// for fp8 weights.
    pub fn float(self) -> DType {
        self.other()
    }
}

/// How a tensor is divided over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Dimension `d` is divided evenly: rank r holds the r-th of N equal slices.
    Dim(usize),
}

/// What the elements of an entry are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The tensor's own values, `shape` elements.
    Values,
    /// One f32 scale per `block` of the last two dimensions of `shape` (the weight's shape),
    /// rounded up: fp8 `weight_scale_inv`.
    BlockScales([usize; 2]),
}

/// One tensor a rank holds (at N = 1, the whole model's tensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The graph input's name (as in [`crate::model::WeightSpecs`]; `_scale_inv` for fp8
    /// scales, `tp_rank` for the rank's index).
    pub name: String,
    /// The whole tensor's shape (for block scales: the weight's shape they scale).
    pub shape: Vec<usize>,
    /// The stored element type.
    pub dtype: DType,
    /// How it is divided over ranks.
    pub split: Split,
    /// Values or block scales.
    pub kind: Kind,
    /// The largest tensor the checkpoint holds for this entry, in bytes as stored there (one
    /// expert of a stacked tensor); 0 for tensors made at load (int8 scales, `tp_rank`).
    pub checkpoint_bytes: u64,
}

impl Entry {
    /// The shape of rank `rank`'s shard of N = `tp` (every rank's is the same: `tp` divides
    /// every split dimension, checked by the plan).
    pub fn shard_shape(&self, tp: usize, _rank: usize) -> Vec<usize> {
        let mut s = self.shape.clone();
        if let Split::Dim(d) = self.split {
            s[d] /= tp.max(1);
        }
        s
    }

    /// Elements of rank `rank`'s shard.
    pub fn shard_elems(&self, tp: usize, rank: usize) -> u64 {
        let s = self.shard_shape(tp, rank);
        match self.kind {
            Kind::Values => s.iter().map(|&d| d as u64).product(),
            Kind::BlockScales([b0, b1]) => {
                let r = s.len();
                let lead: u64 = s[..r - 2].iter().map(|&d| d as u64).product();
                lead * s[r - 2].div_ceil(b0) as u64 * s[r - 1].div_ceil(b1) as u64
            }
        }
    }

    /// Bytes of rank `rank`'s shard.
    pub fn shard_bytes(&self, tp: usize, rank: usize) -> u64 {
        self.shard_elems(tp, rank) * self.dtype.size_in_bytes() as u64
    }

    /// Bytes of the whole tensor, counted once.
    pub fn total_bytes(&self) -> u64 {
        self.shard_bytes(1, 0)
    }

    /// Whether this entry holds parameters (not scales, not the rank index): what
    /// [`param_count`] counts.
    fn is_param(&self) -> bool {
        self.kind == Kind::Values && self.dtype != DType::I32 && !self.name.ends_with("_scale")
    }
}

/// Every weight a rank holds for `cfg` stored as `format` with `quantize`, at tensor
/// parallelism `tp` (only `tp_rank`'s presence depends on it). `checkpoint` is how the
/// checkpoint stores its tensors (for the host's staging peak).
pub fn entries(
    cfg: &ModelConfig,
    format: WeightFormat,
    quantize: Quantize,
    checkpoint: WeightFormat,
    tp: usize,
) -> Vec<Entry> {
    let mut out = Vec::new();
    let (h, v, heads) = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads);
    let size = |d: DType| d.size_in_bytes() as u64;
    let elems = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
    // Embeddings, lm_head, norms: the non-linear float tensors.
    let other = |out: &mut Vec<Entry>, name: String, shape: Vec<usize>, split| {
        let checkpoint_bytes = elems(&shape) * size(checkpoint.other());
        out.push(Entry {
            name,
            shape,
            dtype: format.other(),
            split,
            kind: Kind::Values,
            checkpoint_bytes,
        });
    };
    // A linear weight `[out, in]` (or stacked experts `[E, out, in]`), and its fp8 scales.
    let linear = |out: &mut Vec<Entry>, name: String, shape: Vec<usize>, split| {
        let one = &shape[shape.len() - 2..];
        let checkpoint_bytes = elems(one) * size(checkpoint.linear());
        out.push(Entry {
            name: name.clone(),
            shape: shape.clone(),
            dtype: format.linear(),
            split,
            kind: Kind::Values,
            checkpoint_bytes,
        });
        if let WeightFormat::Fp8Block(block) = format {
            out.push(Entry {
                name: format!("{name}_scale_inv"),
                shape,
                dtype: DType::F32,
                split,
                kind: Kind::BlockScales(block),
                checkpoint_bytes: 0,
            });
        }
    };
    let f32_replicated = |out: &mut Vec<Entry>, name: String, shape: Vec<usize>| {
        let checkpoint_bytes = elems(&shape) * 4;
        out.push(Entry {
            name,
            shape,
            dtype: DType::F32,
            split: Split::Replicated,
            kind: Kind::Values,
            checkpoint_bytes,
        });
    };

    other(
        &mut out,
        "model.embed_tokens.weight".into(),
        vec![v, h],
        Split::Dim(0),
    );
    other(
        &mut out,
        "model.norm.weight".into(),
        vec![h],
        Split::Replicated,
    );
    if !cfg.tie_word_embeddings {
        other(&mut out, "lm_head.weight".into(), vec![v, h], Split::Dim(0));
    }
    if tp > 1 {
        out.push(Entry {
            name: "tp_rank".into(),
            shape: vec![1],
            dtype: DType::I32,
            split: Split::Replicated,
            kind: Kind::Values,
            checkpoint_bytes: 0,
        });
    }
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            other(
                &mut out,
                format!("{p}.{norm}.weight"),
                vec![h],
                Split::Replicated,
            );
        }
        let a = format!("{p}.self_attn");
        match cfg.q_lora_rank {
            Some(r) => {
                linear(
                    &mut out,
                    format!("{a}.q_a_proj.weight"),
                    vec![r, h],
                    Split::Replicated,
                );
                other(
                    &mut out,
                    format!("{a}.q_a_layernorm.weight"),
                    vec![r],
                    Split::Replicated,
                );
                linear(
                    &mut out,
                    format!("{a}.q_b_proj.weight"),
                    vec![heads * cfg.qk_head_dim(), r],
                    Split::Dim(0),
                );
            }
            None => {
                linear(
                    &mut out,
                    format!("{a}.q_proj.weight"),
                    vec![heads * cfg.qk_head_dim(), h],
                    Split::Dim(0),
                );
            }
        }
        linear(
            &mut out,
            format!("{a}.kv_a_proj_with_mqa.weight"),
            vec![cfg.kv_cache_width(), h],
            Split::Replicated,
        );
        other(
            &mut out,
            format!("{a}.kv_a_layernorm.weight"),
            vec![cfg.kv_lora_rank],
            Split::Replicated,
        );
        linear(
            &mut out,
            format!("{a}.kv_b_proj.weight"),
            vec![
                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                cfg.kv_lora_rank,
            ],
            Split::Dim(0),
        );
        linear(
            &mut out,
            format!("{a}.o_proj.weight"),
            vec![h, heads * cfg.v_head_dim],
            Split::Dim(1),
        );
        let mp = format!("{p}.mlp");
        let mlp = |out: &mut Vec<Entry>, prefix: &str, i: usize| {
            for proj in ["gate_proj", "up_proj"] {
                linear(
                    out,
                    format!("{prefix}.{proj}.weight"),
                    vec![i, h],
                    Split::Dim(0),
                );
            }
            linear(
                out,
                format!("{prefix}.down_proj.weight"),
                vec![h, i],
                Split::Dim(1),
            );
        };
        match &cfg.routing {
            Some(r) if cfg.is_moe_layer(l) => {
                let (e, i) = (r.n_routed_experts, cfg.moe_intermediate_size);
                f32_replicated(&mut out, format!("{mp}.gate.weight"), vec![e, h]);
                if cfg.architecture == Architecture::DeepseekV3 {
                    f32_replicated(
                        &mut out,
                        format!("{mp}.gate.e_score_correction_bias"),
                        vec![e],
                    );
                }
                for (proj, shape) in [
                    ("gate_proj", vec![e, i, h]),
                    ("up_proj", vec![e, i, h]),
                    ("down_proj", vec![e, h, i]),
                ] {
                    let name = format!("{mp}.experts.{proj}");
                    if quantize == Quantize::ExpertsInt8 {
                        let one = elems(&shape[1..]) * size(checkpoint.linear());
                        out.push(Entry {
                            name: name.clone(),
                            shape: shape.clone(),
                            dtype: DType::I8,
                            split: Split::Dim(0),
                            kind: Kind::Values,
                            checkpoint_bytes: one,
                        });
                        out.push(Entry {
                            name: format!("{name}_scale"),
                            shape: shape[..2].to_vec(),
                            dtype: DType::F32,
                            split: Split::Dim(0),
                            kind: Kind::Values,
                            checkpoint_bytes: 0,
                        });
                    } else {
                        linear(&mut out, name, shape, Split::Dim(0));
                    }
                }
                if cfg.n_shared_experts > 0 {
                    mlp(
                        &mut out,
                        &format!("{mp}.shared_experts"),
                        i * cfg.n_shared_experts,
                    );
                }
            }
            _ => mlp(&mut out, &mp, cfg.intermediate_size),
        }
    }
    out
}

/// Parameters in `entries` (values of weights; scales and `tp_rank` excluded).
pub fn param_count(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .filter(|e| e.is_param())
        .map(|e| e.shard_elems(1, 0))
        .sum()
}

/// Bytes of every entry, each counted once.
pub fn total_bytes(entries: &[Entry]) -> u64 {
    entries.iter().map(Entry::total_bytes).sum()
}

/// Bytes rank `rank` of `tp` holds.
pub fn rank_bytes(entries: &[Entry], tp: usize, rank: usize) -> u64 {
    entries.iter().map(|e| e.shard_bytes(tp, rank)).sum()
}

/// Bytes every rank holds whole (the replicated entries).
pub fn replicated_bytes(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .filter(|e| e.split == Split::Replicated)
        .map(Entry::total_bytes)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(name: &str) -> ModelConfig {
        ModelConfig::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/configs")
                .join(name),
        )
        .unwrap()
    }

    /// At N = 1 the entries are exactly `WeightSpecs::new`'s parameters, same shapes, same
    /// bytes: the plan counts what the runner loads.
    #[test]
    fn one_rank_matches_weight_specs() {
        use crate::model::{Precision, WeightSpecs};
        for (file, quantize) in [
            ("deepseek-v2-lite.json", Quantize::None),
            ("deepseek-v2-lite.json", Quantize::ExpertsInt8),
            ("deepseek-v3.json", Quantize::None),
        ] {
            let c = cfg(file);
            let precision = Precision {
                quantize,
                ..Precision::all(DType::BF16)
            };
            let specs = WeightSpecs::new(&c, &precision);
            let f = WeightFormat::Float(DType::BF16);
            let e = entries(&c, f, quantize, f, 1);
            assert_eq!(e.len(), specs.names().len(), "{file}");
            for entry in &e {
                assert_eq!(
                    specs.shape(&entry.name),
                    Some(entry.shape.as_slice()),
                    "{}",
                    entry.name
                );
                assert_eq!(specs.dtype(&entry.name), entry.dtype, "{}", entry.name);
            }
            assert_eq!(total_bytes(&e), specs.bytes(), "{file}");
        }
    }

    #[test]
    fn fp8_block_scales_round_up_per_shard() {
        let e = Entry {
            name: "w_scale_inv".into(),
            shape: vec![18432, 7168],
            dtype: DType::F32,
            split: Split::Dim(0),
            kind: Kind::BlockScales([128, 128]),
            checkpoint_bytes: 0,
        };
        assert_eq!(e.total_bytes(), 144 * 56 * 4);
        // 18432 / 64 = 288 rows: three blocks of scales per rank.
        assert_eq!(e.shard_bytes(64, 0), 3 * 56 * 4);
    }
}
