//! Products of weights in GGML's block formats ([`QuantizedWeight`], `--quantize q8_0|q4_k`) by
//! candle-core's quantized kernels: what CPU users of llama.cpp run.
//!
//! The plan (`Plan` in the parent module) fuses a graph's `matmul(x, convert_f32(w)^T)` of a
//! quantized weight `w` into one of these products; the weights themselves, and how they are
//! made, are host values ([`crate::host::QuantizedWeight`]).
//!
//! candle's kernels quantize the activations too (to `Q8_0`/`Q8_K` blocks, as ggml does) and
//! multiply in integers: with AVX-512 VNNI (or AVX-VNNI / AVX2) on x86 and repacked weight tiles,
//! dispatched at run time. That is the arithmetic llama.cpp does, so its accuracy is
//! llama.cpp's, not f32's: `tests/quantized.rs` measures it as perplexity against
//! transformers in f32.

use candle_core::{DType as CDType, Device, Tensor as CTensor};

use crate::error::{Error, Result};
use crate::host::{BlockMatrix, QuantizedWeight};

impl QuantizedWeight {
    /// `x @ w^T` for `x: [.., m, in]` (f32) and a matrix `w`: `[.., m, out]`.
    pub fn linear(&self, x: &CTensor) -> Result<CTensor> {
        let QuantizedWeight::Matrix(q) = self else {
            return Err(Error::Internal(
                "a linear product with stacked experts".into(),
            ));
        };
        q.matmul(x)
    }

    /// `out[e] = x[e] @ w[e]^T` for `x: [experts, m, in]`: every expert on its own rows (the
    /// dense MoE strategy).
    pub fn per_expert(&self, x: &CTensor) -> Result<CTensor> {
        let qs = self.experts()?;
        let outs = qs
            .iter()
            .enumerate()
            .map(|(e, q)| q.matmul(&x.get(e)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(CTensor::stack(&outs, 0)?)
    }

    /// `out[i] = x[i] @ w[ids[i]]^T` for `x: [n, m, in]` and `ids: [n]` (checked by the caller):
    /// the gathered MoE matmul, grouped: the rows routed to one expert are multiplied by its
    /// matrix in one call, so each selected expert is read once per step.
    pub fn gathered(&self, x: &CTensor, ids: &[usize]) -> Result<CTensor> {
        let qs = self.experts()?;
        let (n, m, k) = x.dims3()?;
        let out_n = qs.first().map_or(0, |q| q.dims()[0]);
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
            let y = q.matmul(&lhs)?.flatten_all()?.to_vec1::<f32>()?;
            for (r, &i) in rows.iter().enumerate() {
                let (src, dst) = (r * m * out_n, i as usize * m * out_n);
                out[dst..dst + m * out_n].copy_from_slice(&y[src..src + m * out_n]);
            }
        }
        Ok(CTensor::from_vec(out, (n, m, out_n), &Device::Cpu)?)
    }

    fn experts(&self) -> Result<&[BlockMatrix]> {
        match self {
            QuantizedWeight::Experts(qs) => Ok(qs),
            QuantizedWeight::Matrix(_) => Err(Error::Internal(
                "an expert product with a single matrix".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::AMX_MIN_ROWS;
    use crate::test_util::{max_abs, max_abs_diff_tensors, seeded_values, values};
    use candle_core::quantized::{GgmlDType, QTensor};

    /// `w` quantized by candle on its own and restored (candle's own dequantization): the
    /// weights a quantized product multiplies, whatever its matrices hold.
    fn dequantized(w: &CTensor, format: GgmlDType) -> CTensor {
        QTensor::quantize(w, format)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
    }

    /// The quantized products against f32 products with the weights quantized and restored:
    /// what is left is the activations' 8-bit rounding. Row counts from one to past
    /// [`AMX_MIN_ROWS`] (expert matrices whose blocks were released take at most that many
    /// less one per candle call), for a single matrix and an expert.
    #[test]
    fn products_match_the_dequantized_weights() {
        for (format, k) in [
            (GgmlDType::Q8_0, 32),
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q8_0, 96),
            (GgmlDType::Q8_0, 256),
            (GgmlDType::Q8_0, 1408),
            (GgmlDType::Q5_0, 96),
            (GgmlDType::Q5_0, 1408),
            (GgmlDType::Q4K, 256),
            (GgmlDType::Q4K, 512),
        ] {
            let n = 48;
            let w = CTensor::from_vec(seeded_values(n * k, 7), (n, k), &Device::Cpu).unwrap();
            let dq = dequantized(&w, format);
            let single = QuantizedWeight::quantize(&w, format).unwrap();
            let expert = QuantizedWeight::quantize(&w.unsqueeze(0).unwrap(), format).unwrap();
            for m in [
                1usize,
                3,
                8,
                AMX_MIN_ROWS - 1,
                AMX_MIN_ROWS,
                2 * AMX_MIN_ROWS + 5,
            ] {
                let x = CTensor::from_vec(seeded_values(m * k, 11), (m, k), &Device::Cpu).unwrap();
                let want = x.matmul(&dq.t().unwrap()).unwrap();
                let scale = max_abs(&values(&want));
                let got = single.linear(&x).unwrap();
                let diff = max_abs_diff_tensors(&got, &want);
                assert!(
                    diff < 0.02 * scale,
                    "{format:?} k {k} m {m}: {diff} of {scale}"
                );
                let got = expert.per_expert(&x.unsqueeze(0).unwrap()).unwrap();
                let diff = max_abs_diff_tensors(&got.get(0).unwrap(), &want);
                assert!(
                    diff < 0.02 * scale,
                    "{format:?} k {k} m {m}, expert: {diff} of {scale}"
                );
            }
        }
    }

    /// Where candle's x86 kernels repack a matrix (with AVX-512 VNNI, checked; 16-row tiles of
    /// 256-wide blocks), an expert holds only the tiles, and so does a single `Q8_0` matrix, also
    /// one whose rows are 1,408 wide (held padded to 1,536) and a `Q5_0` one (held as `Q8_0`);
    /// a single `Q4_K` matrix keeps its blocks for candle's AMX prefill. Without the tiles, a
    /// matrix keeps its blocks.
    #[test]
    fn blocks_are_dropped_only_where_candle_reads_its_tiles() {
        #[cfg(target_arch = "x86_64")]
        let repacks = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni");
        #[cfg(not(target_arch = "x86_64"))]
        let repacks = false;
        let holds = |format, k, stacked: bool| {
            let w = CTensor::from_vec(seeded_values(32 * k, 3), (32, k), &Device::Cpu).unwrap();
            let w = if stacked { w.unsqueeze(0).unwrap() } else { w };
            let q = QuantizedWeight::quantize(&w, format).unwrap();
            q.matrices()[0].holds_blocks()
        };
        for (format, k, stacked) in [
            (GgmlDType::Q8_0, 256, true),
            (GgmlDType::Q8_0, 256, false),
            (GgmlDType::Q8_0, 1408, true),
            (GgmlDType::Q5_0, 1408, true),
            (GgmlDType::Q5_0, 1408, false),
        ] {
            assert_eq!(
                holds(format, k, stacked),
                !repacks,
                "{format:?} {k} {stacked}"
            );
        }
        // Padding 96 to 256 would cost more than the tiles save.
        assert!(holds(GgmlDType::Q8_0, 96, true));
        assert!(holds(GgmlDType::Q5_0, 96, true));
        if repacks {
            assert!(!holds(GgmlDType::Q4K, 256, true));
        }
        assert!(holds(GgmlDType::Q4K, 256, false));
    }

    /// The grouped and per-expert products against one linear product per row.
    #[test]
    fn expert_products_match_row_by_row_products() {
        for (format, k) in [
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q8_0, 256),
            (GgmlDType::Q4K, 256),
        ] {
            let (e, out, m) = (4, 32, 1);
            let data = seeded_values(e * out * k, 3);
            let w = CTensor::from_vec(data.clone(), (e, out, k), &Device::Cpu).unwrap();
            let q = QuantizedWeight::quantize(&w, format).unwrap();
            let ids = [2usize, 0, 2, 3, 2, 1];
            let x = CTensor::from_vec(
                seeded_values(ids.len() * m * k, 5),
                (ids.len(), m, k),
                &Device::Cpu,
            )
            .unwrap();
            let got = q.gathered(&x, &ids).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                // The expert's matrix made on its own, not as a view of the stacked tensor.
                let own = data[id * out * k..(id + 1) * out * k].to_vec();
                let own = CTensor::from_vec(own, (out, k), &Device::Cpu).unwrap();
                let one = QuantizedWeight::quantize(&own, format).unwrap();
                let want = one.linear(&x.get(i).unwrap()).unwrap();
                let d = max_abs_diff_tensors(&got.get(i).unwrap(), &want);
                assert!(d < 1e-5, "{format:?} row {i} (expert {id}): {d}");
            }
            let all = x.narrow(0, 0, e).unwrap();
            let per = q.per_expert(&all).unwrap();
            for (j, qe) in q.matrices().iter().enumerate() {
                let want = qe.matmul(&all.get(j).unwrap()).unwrap();
                let d = max_abs_diff_tensors(&per.get(j).unwrap(), &want);
                assert!(d < 1e-6, "{format:?} expert {j}: {d}");
            }
        }
    }
}
