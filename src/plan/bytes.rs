//! Per-tensor accounting: every weight a rank holds under tensor parallelism, its shard's shape
//! and stored dtype, and the bytes that makes.
//!
//! The tensors are the runner's own: [`crate::model::WeightSpecs::new`]'s parameters, each
//! divided as [`crate::model::shard::split_of`] divides it (the module docs of
//! [`crate::model::shard`] give the layout and its reasons), plus the per-rank
//! [`crate::model::shard::SHARD_OFFSETS`] input when N > 1. That input is not a model
//! parameter; it is counted with the weights (replicated) so that the identity "sum over ranks =
//! total + (N - 1) x replicated" holds exactly. The multi-token-prediction layers of V3
//! checkpoints (`num_nextn_predict_layers`, `model.layers.61.*` in the published files) are
//! not loaded by the engine and are not counted.
//!
//! # FP8
//!
//! [`WeightFormat::Fp8Block`] is the published DeepSeek-V3/R1 storage: every linear weight of
//! attention and the MLPs (the `*_proj.weight` tensors, dense, shared and routed) in
//! `float8_e4m3fn` (and V3.2's indexer `wq_b` / `wk`), each with one f32 scale per `block` (128 x 128 in the published files:
//! `weight_scale_inv`, `[ceil(out/128), ceil(in/128)]`); embeddings, `lm_head` and norms in bf16;
//! the router in f32 as always. A sharded fp8 weight keeps the scale blocks its rows or columns
//! touch, `ceil(shard/128)` of them: where a shard boundary cuts a block (V3's dense MLP at
//! N = 64: 18432 / 64 = 288 rows), both ranks hold that block's scale, so the sum over ranks can
//! exceed the total by those few scales. The runner today dequantizes fp8 to bf16 at load
//! (`--dtype auto` plans that); `--dtype fp8` plans the storage the device would need to keep
//! fp8 as published.

use crate::config::v4::V4Config;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::graph::DType;
use crate::model::v4::shard::{self as shard_v4, V4Split, FP4_SCALE_SUFFIX};
use crate::model::v4::tensors::V4TensorKind;
use crate::model::{shard, Precision, Quantize, WeightSpecs};

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
    /// Dimension `dim` is divided `min(N, ways)` ways, ranks beyond `ways` sharing a slice:
    /// DeepSeek-V4's `wo_b`, whose columns follow the `o_groups` output groups.
    DimUpTo {
        /// The divided dimension.
        dim: usize,
        /// The most slices it is cut into.
        ways: usize,
    },
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
    /// scales, [`shard::SHARD_OFFSETS`] for the rank's offsets).
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
    /// expert of a stacked tensor); 0 for tensors made at load (int8 scales, the shard offsets).
    pub checkpoint_bytes: u64,
}

impl Entry {
    /// The shape of rank `rank`'s shard of N = `tp` (every rank's is the same: `tp` divides
    /// every split dimension, checked by the plan, but the vocabulary, whose last shard is
    /// padded to the others' size: see [`shard`]).
    pub fn shard_shape(&self, tp: usize, _rank: usize) -> Vec<usize> {
        let mut s = self.shape.clone();
        match self.split {
            Split::Dim(d) => s[d] = shard::rows_per_rank(s[d], tp),
            Split::DimUpTo { dim, ways } => s[dim] = shard::rows_per_rank(s[dim], tp.min(ways)),
            Split::Replicated => {}
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

    /// Parameters one stored element holds: two for int4 experts' packed bytes.
    fn params_per_elem(&self) -> u64 {
        if self.dtype == DType::U8 {
            2
        } else {
            1
        }
    }
}

/// Every weight a rank holds for `cfg` stored as `format` with `quantize`, at tensor
/// parallelism `tp` (only the shard offsets' presence depends on it). `checkpoint` is how the
/// checkpoint stores its tensors (for the host's staging peak).
pub fn entries(
    cfg: &ModelConfig,
    format: WeightFormat,
    quantize: Quantize,
    checkpoint: WeightFormat,
    tp: usize,
) -> Vec<Entry> {
    let precision = Precision {
        quantize,
        ..Precision::all(format.float())
    };
    let specs = WeightSpecs::new(cfg, &precision);
    let elems = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
    let mut out = Vec::new();
    for name in specs.names() {
        let shape = specs.shape(name).unwrap_or_default().to_vec();
        let split = match shard::split_of(name) {
            shard::Split::Replicated => Split::Replicated,
            shard::Split::Rows => Split::Dim(0),
            shard::Split::Cols => Split::Dim(shape.len() - 1),
        };
        let stored = specs.dtype(name);
        // A linear weight `[out, in]` or stacked experts `[E, out, in]`: fp8 in the published
        // V3 format, read from the checkpoint one `[out, in]` matrix at a time. V3.2 publishes
        // its indexer's query and key projections in fp8 too (`weights_proj` stays f32 here).
        let linear = name.ends_with("_proj.weight")
            || name.ends_with("_proj_with_mqa.weight")
            || name.ends_with(".indexer.wq_b.weight")
            || name.ends_with(".indexer.wk.weight")
            || name.ends_with("_proj") && name.contains(".mlp.experts.");
        let one = if linear {
            &shape[shape.len() - 2..]
        } else {
            &shape[..]
        };
        let (dtype, checkpoint_bytes) = match stored {
            // Made at load: int8 experts' scales.
            DType::F32 if name.ends_with("_scale") => (stored, 0),
            // The router (always f32, in the checkpoint too).
            DType::F32 => (stored, elems(&shape) * 4),
            // int8 experts, quantized at load from the checkpoint's linear weights.
            DType::I8 => (
                stored,
                elems(one) * checkpoint.linear().size_in_bytes() as u64,
            ),
            // int4 experts: two values a byte.
            DType::U8 => (
                stored,
                2 * elems(one) * checkpoint.linear().size_in_bytes() as u64,
            ),
            _ if linear => (
                format.linear(),
                elems(one) * checkpoint.linear().size_in_bytes() as u64,
            ),
            _ => (
                format.other(),
                elems(&shape) * checkpoint.other().size_in_bytes() as u64,
            ),
        };
        out.push(Entry {
            name: name.to_string(),
            shape: shape.clone(),
            dtype,
            split,
            kind: Kind::Values,
            checkpoint_bytes,
        });
        if let (WeightFormat::Fp8Block(block), DType::F8E4M3) = (format, dtype) {
            out.push(Entry {
                name: format!("{name}_scale_inv"),
                shape,
                dtype: DType::F32,
                split,
                kind: Kind::BlockScales(block),
                checkpoint_bytes: 0,
            });
        }
    }
    if tp > 1 {
        out.push(shard_offsets());
    }
    out
}

/// Every weight a rank of DeepSeek-V4 model `cfg` holds at tensor parallelism `tp`, as its
/// runner holds them (`model::v4::shard`'s tensors) with its matrices in `matrices`: those in
/// it, other floats in f32 (FP8 weights dequantized at load), `tid2eid` i32, and FP4 experts
/// as stored, codes two a byte with one f32 scale per 32.
/// `checkpoint_bytes` is each entry's largest tensor as a published checkpoint stores it: one
/// expert's codes or scales (a byte each), FP8 (a byte) or bf16 for the rest of a quantized
/// checkpoint, f32 otherwise.
pub fn entries_v4(cfg: &V4Config, tp: usize, matrices: DType) -> Result<Vec<Entry>> {
    let elems = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
    let stored = if cfg.fp8_block.is_some() { 2 } else { 4 };
    let mut out = Vec::new();
    for t in shard_v4::rank_tensors(cfg, 1)? {
        let (split, checkpoint_bytes) = match t.split {
            V4Split::Whole => (Split::Replicated, elems(&t.shape) * stored),
            V4Split::Rows | V4Split::OutputA => (Split::Dim(0), elems(&t.shape) * stored),
            V4Split::Cols => (Split::Dim(1), elems(&t.shape) * stored),
            V4Split::OutputB => (
                Split::DimUpTo {
                    dim: 1,
                    ways: cfg.o_groups,
                },
                elems(&t.shape) * stored,
            ),
            V4Split::Experts { .. } => {
                let per = if t.kind == V4TensorKind::Fp4 || t.name.ends_with(FP4_SCALE_SUFFIX) {
                    1
                } else {
                    stored
                };
                (Split::Dim(0), elems(&t.shape[1..]) * per)
            }
        };
        out.push(Entry {
            dtype: t.kind.dtype(matrices),
            name: t.name,
            shape: t.shape,
            split,
            kind: Kind::Values,
            checkpoint_bytes,
        });
    }
    if tp > 1 {
        out.push(shard_offsets());
    }
    Ok(out)
}

/// A split model's [`shard::SHARD_OFFSETS`] input, counted with the weights (replicated).
fn shard_offsets() -> Entry {
    Entry {
        name: shard::SHARD_OFFSETS.into(),
        shape: vec![2],
        dtype: DType::I32,
        split: Split::Replicated,
        kind: Kind::Values,
        checkpoint_bytes: 0,
    }
}

/// Parameters in `entries` (values of weights; scales and the shard offsets excluded).
pub fn param_count(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .filter(|e| e.is_param())
        .map(|e| e.shard_elems(1, 0) * e.params_per_elem())
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

    /// What the plan charges a rank is what the runner's sharded specs hold, a padded
    /// vocabulary included (V2-Lite's 102,400 tokens cut to 102,401: at N = 4 each rank holds
    /// 25,601 rows of the embedding and of the LM head, the last one padding).
    #[test]
    fn a_rank_holds_what_the_sharded_specs_hold_with_a_padded_vocabulary() {
        use crate::model::{Precision, WeightSpecs};
        let mut c = cfg("deepseek-v2-lite.json");
        c.vocab_size = 102_401;
        let precision = Precision::all(DType::BF16);
        let f = WeightFormat::Float(DType::BF16);
        for tp in [1, 2, 4] {
            let specs = WeightSpecs::sharded(&c, &precision, tp).unwrap();
            let e = entries(&c, f, Quantize::None, f, tp);
            assert_eq!(rank_bytes(&e, tp, tp - 1), specs.bytes(), "tp {tp}");
            let rows = specs.shape("model.embed_tokens.weight").unwrap()[0];
            assert_eq!(rows, 102_401usize.div_ceil(tp), "tp {tp}");
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

    /// DeepSeek-V4-Flash as published (FP8 weights, FP4 experts): 284B parameters, DeepSeek's
    /// own count; and at every degree, its matrices in f32 or bf16, a rank's bytes are exactly
    /// what the runner's sharded specs hold (the plan counts what the device runner uploads),
    /// `wo_b`'s shared columns past 8 ranks included.
    #[test]
    fn a_v4_flash_rank_holds_what_the_runner_holds() {
        use crate::model::{Precision, WeightSpecs};
        let c = cfg("deepseek-v4-flash.json");
        let v4 = c.v4.clone().expect("a V4 config");
        let whole = entries_v4(&v4, 1, DType::F32).unwrap();
        let params = param_count(&whole) as f64 / 1e9;
        assert!((284.0..284.6).contains(&params), "{params}B");
        for (tp, dtype) in [1, 2, 8, 16, 32, 64]
            .into_iter()
            .flat_map(|tp| [(tp, DType::F32), (tp, DType::BF16)])
        {
            let e = entries_v4(&v4, tp, dtype).unwrap();
            let precision = Precision::all(dtype);
            let specs = WeightSpecs::sharded(&c, &precision, tp).unwrap();
            for rank in [0, tp - 1] {
                assert_eq!(rank_bytes(&e, tp, rank), specs.bytes(), "tp {tp} {dtype}");
            }
        }
        // A routed expert's projection: codes a byte per two values, a scale per 32.
        let w1 = whole
            .iter()
            .find(|e| e.name == "layers.3.ffn.experts.w1")
            .unwrap();
        assert_eq!(
            (w1.dtype, w1.shape.clone()),
            (DType::U8, vec![256, 2048, 2048])
        );
    }
}
