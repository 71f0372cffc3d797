//! Weights in GGML's block formats (`Q8_0`, `Q4_K`): what CPU users of llama.cpp run, and why
//! `--quantize q8_0|q4_k` exists. This module holds the weights (made from a tensor, or read as
//! stored from a GGUF file); the CPU backend multiplies them with candle-core's quantized
//! kernels (`backend::cpu`'s `quantized` module, which also says how accurate that is).
//!
//! A quantized weight is not a tensor the graph computes on: the graph still says
//! `matmul(x, convert_f32(w)^T)` for a weight `w` of the policy's dtype, and the CPU backend's
//! plan fuses that chain into one quantized matmul (see its `Plan`). So one graph serves every
//! precision, and the HLO a Neuron capture lowers never sees these formats.

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
    zero.apply_op1_no_bwd(q).map(|_| ())
}
