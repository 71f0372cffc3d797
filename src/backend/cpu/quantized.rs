//! Weights in GGML's block formats (`Q8_0`, `Q4_K`), multiplied by candle-core's quantized
//! kernels: what CPU users of llama.cpp run, and why `--quantize q8_0|q4_k` exists.
//!
//! A quantized weight is not a tensor the graph computes on: the graph still says
//! `matmul(x, convert_f32(w)^T)` for a weight `w` of the policy's dtype, and the CPU backend's
//! plan fuses that chain into one quantized matmul (see `Plan` in the parent module). So one
//! graph serves every precision, and the HLO a Neuron capture lowers never sees these formats.
//!
//! candle's kernels quantize the activations too (to `Q8_0`/`Q8_K` blocks, as ggml does) and
//! multiply in integers: with AVX-512 VNNI (or AVX-VNNI / AVX2) on x86 and repacked weight tiles,
//! dispatched at run time. That is the arithmetic llama.cpp does, so its accuracy is
//! llama.cpp's, not f32's: `tests/quantized.rs` measures it as perplexity against
//! transformers in f32.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType as CDType, Device, Tensor as CTensor};

use crate::error::{Error, Result};

/// A weight held in a GGML block format. Cheap to clone (shared).
#[derive(Clone)]
pub enum QuantizedWeight {
    /// A linear layer's `[out, in]` matrix.
    Matrix(Arc<QTensor>),
    /// Stacked routed experts, `[experts, out, in]`: one matrix per expert, so the tokens routed
    /// to an expert multiply its matrix together (a grouped matmul).
    Experts(Arc<[QTensor]>),
}

impl std::fmt::Debug for QuantizedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantizedWeight({:?}, {:?})", self.format(), self.dims())
    }
}

impl QuantizedWeight {
    /// `w` (`[out, in]`, or stacked `[experts, out, in]`, any float dtype) in `format`. The
    /// input width must be a multiple of the format's block (32 for `Q8_0`, 256 for `Q4_K`):
    /// see [`QuantizedWeight::fits`].
    pub fn quantize(w: &CTensor, format: GgmlDType) -> Result<Self> {
        let quantize = |m: &CTensor| -> Result<QTensor> {
            // candle quantizes the tensor's storage from its start, whatever the layout (and
            // `copy` keeps the layout): a view (an expert of the stacked tensor) would quantize
            // someone else's values. So the values are read out into storage of their own.
            let values = m.to_dtype(CDType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let own = CTensor::from_vec(values, m.dims(), &Device::Cpu)?;
            let q = QTensor::quantize(&own, format)?;
            warm(&q)?;
            Ok(q)
        };
        match w.rank() {
            2 => Ok(QuantizedWeight::Matrix(Arc::new(quantize(w)?))),
            3 => {
                let experts = (0..w.dim(0)?)
                    .map(|e| quantize(&w.get(e)?))
                    .collect::<Result<Vec<_>>>()?;
                Ok(QuantizedWeight::Experts(experts.into()))
            }
            r => Err(Error::Internal(format!(
                "a quantized weight of rank {r} (expected a matrix or stacked experts)"
            ))),
        }
    }

    /// A weight already in GGML blocks (a GGUF file's, as stored): one `[out, in]` matrix, or
    /// with `experts` each expert's matrix in order. Repacked for candle's kernels now, as
    /// [`QuantizedWeight::quantize`] does.
    pub fn from_blocks(mut blocks: Vec<QTensor>, experts: bool) -> Result<Self> {
        for q in &blocks {
            warm(q)?;
        }
        match (experts, blocks.len()) {
            (true, _) => Ok(QuantizedWeight::Experts(blocks.into())),
            (false, 1) => Ok(QuantizedWeight::Matrix(Arc::new(blocks.remove(0)))),
            (false, n) => Err(Error::Internal(format!(
                "one matrix made of {n} block tensors"
            ))),
        }
    }

    /// Whether a weight whose rows are `cols` wide can be held in `format`.
    pub fn fits(cols: usize, format: GgmlDType) -> bool {
        cols.is_multiple_of(format.block_size())
    }

    /// The block format.
    pub fn format(&self) -> GgmlDType {
        match self {
            QuantizedWeight::Matrix(q) => q.dtype(),
            QuantizedWeight::Experts(qs) => qs.first().map_or(GgmlDType::Q8_0, |q| q.dtype()),
        }
    }

    /// The logical shape: `[out, in]` or `[experts, out, in]`.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            QuantizedWeight::Matrix(q) => q.shape().dims().to_vec(),
            QuantizedWeight::Experts(qs) => {
                let mut d = vec![qs.len()];
                d.extend(qs.first().map_or(&[][..], |q| q.shape().dims()));
                d
            }
        }
    }

    /// `x @ w^T` for `x: [.., m, in]` (f32) and a matrix `w`: `[.., m, out]`.
    pub fn linear(&self, x: &CTensor) -> Result<CTensor> {
        let QuantizedWeight::Matrix(q) = self else {
            return Err(Error::Internal(
                "a linear product with stacked experts".into(),
            ));
        };
        Ok(apply(q, &x.contiguous()?)?)
    }

    /// `out[e] = x[e] @ w[e]^T` for `x: [experts, m, in]`: every expert on its own rows (the
    /// dense MoE strategy).
    pub fn per_expert(&self, x: &CTensor) -> Result<CTensor> {
        let qs = self.experts()?;
        let outs = qs
            .iter()
            .enumerate()
            .map(|(e, q)| apply(q, &x.get(e)?.contiguous()?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(CTensor::stack(&outs, 0)?)
    }

    /// `out[i] = x[i] @ w[ids[i]]^T` for `x: [n, m, in]` and `ids: [n]` (checked by the caller):
    /// the gathered MoE matmul, grouped: the rows routed to one expert are multiplied by its
    /// matrix in one call, so each selected expert is read once per step.
    pub fn gathered(&self, x: &CTensor, ids: &[usize]) -> Result<CTensor> {
        let qs = self.experts()?;
        let (n, m, k) = x.dims3()?;
        let out_n = qs.first().map_or(0, |q| q.shape().dims()[0]);
        let x = x.to_dtype(CDType::F32)?.contiguous()?;
        let mut out = vec![0f32; n * m * out_n];
        let mut rows: Vec<u32> = Vec::with_capacity(n);
        for (e, q) in qs.iter().enumerate() {
            rows.clear();
            rows.extend((0..n).filter(|&i| ids[i] == e).map(|i| i as u32));
            if rows.is_empty() {
                continue;
            }
            let picked = CTensor::from_slice(&rows, rows.len(), &Device::Cpu)?;
            let lhs = x.index_select(&picked, 0)?.reshape((rows.len() * m, k))?;
            let y = apply(q, &lhs)?.flatten_all()?.to_vec1::<f32>()?;
            for (r, &i) in rows.iter().enumerate() {
                let (src, dst) = (r * m * out_n, i as usize * m * out_n);
                out[dst..dst + m * out_n].copy_from_slice(&y[src..src + m * out_n]);
            }
        }
        Ok(CTensor::from_vec(out, (n, m, out_n), &Device::Cpu)?)
    }

    fn experts(&self) -> Result<&[QTensor]> {
        match self {
            QuantizedWeight::Experts(qs) => Ok(qs),
            QuantizedWeight::Matrix(_) => Err(Error::Internal(
                "an expert product with a single matrix".into(),
            )),
        }
    }
}

/// Multiplies one zero row by `q`, so candle repacks its tiles now, at load.
///
/// candle's x86 kernels repack a matrix into their own tile layout the first time it is
/// multiplied, and keep that copy. Left to the first step that uses it, every expert's first
/// selection costs a repack: the medium model's first eight decode steps at batch 1 took 7.5 ms
/// each against 5.3 later (13 ms with transparent huge pages, whose fresh memory the copies
/// fault in), so a server's first requests, and any short benchmark, paid for it.
fn warm(q: &QTensor) -> candle_core::Result<()> {
    let k = q.shape().dims().last().copied().unwrap_or(0);
    let zero = CTensor::zeros((1, k), CDType::F32, &Device::Cpu)?;
    apply(q, &zero).map(|_| ())
}

/// candle's quantized matmul of a contiguous f32 `x` by `q` (`x @ q^T`).
fn apply(q: &QTensor, x: &CTensor) -> candle_core::Result<CTensor> {
    x.apply_op1_no_bwd(q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs, max_abs_diff_tensors, values};

    fn lcg(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// The quantized products against f32 products with the weights quantized and restored
    /// (candle's own dequantization): what is left is the activations' 8-bit rounding.
    #[test]
    fn products_match_the_dequantized_weights() {
        for (format, k) in [
            (GgmlDType::Q8_0, 32),
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q8_0, 96),
            (GgmlDType::Q8_0, 256),
            (GgmlDType::Q4K, 256),
            (GgmlDType::Q4K, 512),
        ] {
            for m in [1usize, 3, 8] {
                let n = 48;
                let w = CTensor::from_vec(lcg(n * k, 7), (n, k), &Device::Cpu).unwrap();
                let x = CTensor::from_vec(lcg(m * k, 11), (m, k), &Device::Cpu).unwrap();
                let q = QuantizedWeight::quantize(&w, format).unwrap();
                let QuantizedWeight::Matrix(qt) = &q else {
                    panic!()
                };
                let dq = qt.dequantize(&Device::Cpu).unwrap();
                let want = x.matmul(&dq.t().unwrap()).unwrap();
                let got = q.linear(&x).unwrap();
                let diff = max_abs_diff_tensors(&got, &want);
                let scale = max_abs(&values(&want));
                assert!(
                    diff < 0.02 * scale,
                    "{format:?} k {k} m {m}: {diff} of {scale}"
                );
            }
        }
    }

    /// The grouped and per-expert products against one linear product per row.
    #[test]
    fn expert_products_match_row_by_row_products() {
        let (e, out, k, m) = (4, 32, 64, 1);
        let w = CTensor::from_vec(lcg(e * out * k, 3), (e, out, k), &Device::Cpu).unwrap();
        let q = QuantizedWeight::quantize(&w, GgmlDType::Q8_0).unwrap();
        let ids = [2usize, 0, 2, 3, 2, 1];
        let x =
            CTensor::from_vec(lcg(ids.len() * m * k, 5), (ids.len(), m, k), &Device::Cpu).unwrap();
        let got = q.gathered(&x, &ids).unwrap();
        let QuantizedWeight::Experts(qs) = &q else {
            panic!()
        };
        let data = lcg(e * out * k, 3);
        for (i, &id) in ids.iter().enumerate() {
            // The expert's matrix made on its own, not as a view of the stacked tensor.
            let own = data[id * out * k..(id + 1) * out * k].to_vec();
            let own = CTensor::from_vec(own, (out, k), &Device::Cpu).unwrap();
            let one = QuantizedWeight::quantize(&own, GgmlDType::Q8_0).unwrap();
            let want = one.linear(&x.get(i).unwrap()).unwrap();
            let d = max_abs_diff_tensors(&got.get(i).unwrap(), &want);
            assert!(d < 1e-5, "row {i} (expert {id}): {d}");
        }
        let all = x.narrow(0, 0, e).unwrap();
        let per = q.per_expert(&all).unwrap();
        for (j, qe) in qs.iter().enumerate() {
            let want = apply(qe, &all.get(j).unwrap().contiguous().unwrap()).unwrap();
            let d = max_abs_diff_tensors(&per.get(j).unwrap(), &want);
            assert!(d < 1e-6, "expert {j}: {d}");
        }
    }
}
