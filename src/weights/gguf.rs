//! A GGUF file indexed as a checkpoint under HF names (see [`crate::gguf::tensors`] for the
//! names): the rest of the loader reads it like a safetensors checkpoint.
//!
//! Two of llama.cpp's tensors are not HF's: the stacked routed experts are indexed per expert
//! (each expert's rows are one contiguous byte range of the stacked tensor, in any format), and
//! `kv_b_proj`, which the converter splits into `attn_k_b` and `attn_v_b`, is joined back when
//! read ([`KvHalves`]).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use safetensors::Dtype;

use super::{Checkpoint, Encoding, TensorEntry};
use crate::error::{Error, Result};
use crate::gguf::tensors::{self, Mapped};
use crate::gguf::GgufFile;

/// The two halves of a GGUF's `kv_b_proj`.
#[derive(Debug, Clone)]
pub(super) struct KvHalves {
    /// `attn_k_b`: `[heads, kv_lora_rank, qk_nope_head_dim]`.
    pub key: TensorEntry,
    /// `attn_v_b`: `[heads, v_head_dim, kv_lora_rank]`.
    pub value: TensorEntry,
}

impl KvHalves {
    /// HF's `kv_b_proj` (`[heads * (qk_nope + v_head), kv_lora_rank]`: per head, its key rows
    /// then its value rows) from the halves' values.
    pub fn join(&self, key: &[f32], value: &[f32]) -> Vec<f32> {
        let &[heads, rank, nope] = self.key.shape.as_slice() else {
            return Vec::new();
        };
        let v_dim = self.value.shape[1];
        let mut out = Vec::with_capacity(heads * (nope + v_dim) * rank);
        for h in 0..heads {
            let k = &key[h * rank * nope..(h + 1) * rank * nope];
            for n in 0..nope {
                out.extend((0..rank).map(|r| k[r * nope + n]));
            }
            out.extend_from_slice(&value[h * v_dim * rank..(h + 1) * v_dim * rank]);
        }
        out
    }
}

impl Checkpoint {
    /// Opens a GGUF file as a checkpoint: its header is read and checked, and its tensors are
    /// indexed under HF names (data is read when asked for, like a safetensors checkpoint's).
    pub fn open_gguf(path: &Path) -> Result<Self> {
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// Indexes an opened GGUF file's tensors under HF names.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let path = file.path();
        let bad = |what: String| Error::Weights(format!("{}: {what}", path.display()));
        let mut tensors = BTreeMap::new();
        let mut insert = |name: String, entry: TensorEntry, from: &str| {
            if tensors.insert(name.clone(), entry).is_some() {
                return Err(bad(format!(
                    "tensor `{from}` makes `{name}`, which another tensor made already"
                )));
            }
            Ok(())
        };
        let mut halves: BTreeMap<usize, [Option<TensorEntry>; 2]> = BTreeMap::new();
        // Sorted, so errors (and which of two duplicates wins) do not depend on hash order.
        let infos: BTreeMap<_, _> = file.tensor_infos().iter().collect();
        for (name, info) in infos {
            let Some(mapped) = tensors::map(name) else {
                continue;
            };
            let (offset, len) = file.byte_range(name, info)?;
            let entry = TensorEntry {
                shard: 0,
                encoding: match info.ggml_dtype {
                    GgmlDType::F32 => Encoding::Plain(Dtype::F32),
                    GgmlDType::F16 => Encoding::Plain(Dtype::F16),
                    GgmlDType::BF16 => Encoding::Plain(Dtype::BF16),
                    blocks => Encoding::Blocks(blocks),
                },
                shape: info.shape.dims().to_vec(),
                offset,
                len: len as usize,
            };
            match mapped {
                Mapped::Same(hf) => insert(hf, entry, name)?,
                Mapped::Experts { layer, proj } => {
                    let &[experts, out, cols] = entry.shape.as_slice() else {
                        return Err(bad(format!(
                            "tensor `{name}` has shape {:?}; stacked experts are [experts, \
                             out, in]",
                            entry.shape
                        )));
                    };
                    let per = entry.len / experts.max(1);
                    for e in 0..experts {
                        let expert = TensorEntry {
                            shape: vec![out, cols],
                            offset: entry.offset + (e * per) as u64,
                            len: per,
                            ..entry.clone()
                        };
                        let hf = format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight");
                        insert(hf, expert, name)?;
                    }
                }
                Mapped::KeyHalf(layer) => halves.entry(layer).or_default()[0] = Some(entry),
                Mapped::ValueHalf(layer) => halves.entry(layer).or_default()[1] = Some(entry),
            }
        }
        for (layer, [key, value]) in halves {
            let (Some(key), Some(value)) = (key, value) else {
                return Err(bad(format!(
                    "layer {layer} has only one of `blk.{layer}.attn_k_b.weight` and \
                     `blk.{layer}.attn_v_b.weight`, the halves of its kv_b_proj"
                )));
            };
            let (&[heads, rank, nope], &[v_heads, v_dim, v_rank]) =
                (key.shape.as_slice(), value.shape.as_slice())
            else {
                return Err(bad(format!(
                    "layer {layer}: attn_k_b {:?} and attn_v_b {:?} should be [heads, \
                     kv_lora_rank, qk_nope_head_dim] and [heads, v_head_dim, kv_lora_rank]",
                    key.shape, value.shape
                )));
            };
            if (v_heads, v_rank) != (heads, rank) {
                return Err(bad(format!(
                    "layer {layer}: attn_k_b {:?} and attn_v_b {:?} disagree on heads or \
                     kv_lora_rank",
                    key.shape, value.shape
                )));
            }
            let joined = TensorEntry {
                shard: 0,
                shape: vec![heads * (nope + v_dim), rank],
                offset: 0,
                len: 0,
                encoding: Encoding::KvB(Box::new(KvHalves { key, value })),
            };
            insert(tensors::kv_b_name(layer), joined, "attn_k_b")?;
        }
        Ok(Checkpoint {
            shards: vec![path.to_path_buf()],
            tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_b_halves_join_into_hf_rows() {
        // 2 heads, rank 3, nope 2, v_dim 1. HF row (h, i) for i < nope is key column i of head h.
        let entry = |shape: Vec<usize>| TensorEntry {
            shard: 0,
            encoding: Encoding::Plain(Dtype::F32),
            shape,
            offset: 0,
            len: 0,
        };
        let halves = KvHalves {
            key: entry(vec![2, 3, 2]),
            value: entry(vec![2, 1, 3]),
        };
        // key[h][r][n] = 100h + 10r + n; value[h][0][r] = -(100h + r).
        let key: Vec<f32> = (0..2)
            .flat_map(|h| {
                (0..3).flat_map(move |r| (0..2).map(move |n| (100 * h + 10 * r + n) as f32))
            })
            .collect();
        let value: Vec<f32> = (0..2)
            .flat_map(|h| (0..3).map(move |r| -((100 * h + r) as f32)))
            .collect();
        let joined = halves.join(&key, &value);
        assert_eq!(
            joined,
            vec![
                0., 10., 20., 1., 11., 21., -0., -1., -2., //
                100., 110., 120., 101., 111., 121., -100., -101., -102.
            ]
        );
    }
}
