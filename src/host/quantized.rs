//! Weights in GGML's block formats (`Q8_0`, `Q4_K`): what CPU users of llama.cpp run, and why
//! `--quantize q8_0|q4_k` exists. This module holds the weights (made from a tensor, or read as
//! stored from a GGUF file); the CPU backend multiplies them with candle-core's quantized
//! kernels (`backend::cpu`'s `quantized` module, which also says how accurate that is).
//!
//! A quantized weight is not a tensor the graph computes on: the graph still says
//! `matmul(x, convert_f32(w)^T)` for a weight `w` of the policy's dtype, and the CPU backend's
//! plan fuses that chain into one quantized matmul (see its `Plan`). So one graph serves every
//! precision, and the HLO a Neuron capture lowers never sees these formats.

mod held;
mod matrix;
mod storage;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor, QuantizedType};
use candle_core::{DType as CDType, Device, Tensor as CTensor};

pub use matrix::{BlockMatrix, Role, AMX_MIN_ROWS};

use crate::error::{Error, Result};

/// A weight held in a GGML block format. Cheap to clone (shared).
#[derive(Clone)]
pub enum QuantizedWeight {
    /// A linear layer's `[out, in]` matrix.
    Matrix(Arc<BlockMatrix>),
    /// Stacked routed experts, `[experts, out, in]`: one matrix per expert, so the tokens routed
    /// to an expert multiply its matrix together (a grouped matmul).
    Experts(Arc<[BlockMatrix]>),
}

impl std::fmt::Debug for QuantizedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantizedWeight({:?}, {:?})", self.format(), self.dims())
    }
}

impl QuantizedWeight {
    /// `w` (`[out, in]`, or stacked `[experts, out, in]`, any float dtype) in `format`. The
    /// input width must be a multiple of the format's block (32 for `Q8_0`, 256 for `Q4_K`):
    /// see [`QuantizedWeight::fits`]. Held as a GGUF's blocks are ([`BlockMatrix`]).
    pub fn quantize(w: &CTensor, format: GgmlDType) -> Result<Self> {
        let quantize = |m: &CTensor, role: Role| -> Result<BlockMatrix> {
            // candle quantizes the tensor's storage from its start, whatever the layout (and
            // `copy` keeps the layout): a view (an expert of the stacked tensor) would quantize
            // someone else's values. So the values are read out into storage of their own.
            let values = m.to_dtype(CDType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let dims = matrix_dims(m.dims())?;
            let own = CTensor::from_vec(values, m.dims(), &Device::Cpu)?;
            let q = QTensor::quantize(&own, format)?;
            // candle's quantizer makes a `QTensor` of its own storage; its bytes become one
            // a `BlockMatrix` can release (one matrix's copy at a time).
            let blocks = format.from_data(q.data()?);
            BlockMatrix::new(blocks, dims, role)
        };
        match w.rank() {
            2 => Ok(QuantizedWeight::Matrix(Arc::new(quantize(
                w,
                Role::Single,
            )?))),
            3 => {
                let experts = (0..w.dim(0)?)
                    .map(|e| quantize(&w.get(e)?, Role::Expert))
                    .collect::<Result<Vec<_>>>()?;
                Ok(QuantizedWeight::Experts(experts.into()))
            }
            r => Err(Error::Internal(format!(
                "a quantized weight of rank {r} (expected a matrix or stacked experts)"
            ))),
        }
    }

    /// A weight already in GGML blocks (a GGUF file's, as stored): one `[out, in]` matrix, or
    /// with `experts` each expert's matrix in order, each as candle's block storage of it
    /// (`GgmlDType::from_data`) with its dims. Repacked for candle's kernels now, as
    /// [`QuantizedWeight::quantize`] does.
    pub fn from_blocks(
        blocks: Vec<(Box<dyn QuantizedType>, Vec<usize>)>,
        experts: bool,
    ) -> Result<Self> {
        use rayon::prelude::*;
        let role = if experts { Role::Expert } else { Role::Single };
        // Each matrix is built on its own (converted, copied, repacked by candle into fresh
        // memory the kernel must fault in and zero): a stacked expert weight's 64 are built on
        // rayon's threads, in order.
        let mut matrices = blocks
            .into_par_iter()
            .map(|(b, dims)| BlockMatrix::new(b, matrix_dims(&dims)?, role))
            .collect::<Result<Vec<_>>>()?;
        match (experts, matrices.len()) {
            (true, _) => Ok(QuantizedWeight::Experts(matrices.into())),
            (false, 1) => Ok(QuantizedWeight::Matrix(Arc::new(matrices.remove(0)))),
            (false, n) => Err(Error::Internal(format!(
                "one matrix made of {n} block tensors"
            ))),
        }
    }

    /// The bytes of RAM a weight stored in `format` blocks with logical shape `dims` (`[out,
    /// in]`, or stacked `[experts, out, in]`) will be held in, told before its blocks are read:
    /// what [`QuantizedWeight::from_blocks`] and [`QuantizedWeight::quantize`] keep after
    /// candle's repacking (see [`BlockMatrix`] and the `held` module), not counting copies candle
    /// makes for later products.
    pub fn predicted_bytes(format: GgmlDType, dims: &[usize]) -> Result<u64> {
        let (count, role, matrix) = match *dims {
            [out, cols] => (1, Role::Single, [out, cols]),
            [experts, out, cols] => (experts, Role::Expert, [out, cols]),
            _ => {
                return Err(Error::Internal(format!(
                    "the held size of a quantized weight of shape {dims:?}"
                )))
            }
        };
        Ok(count as u64 * matrix::Layout::predict(format, matrix, role).bytes(matrix[0]))
    }

    /// Whether a weight whose rows are `cols` wide can be held in `format`.
    pub fn fits(cols: usize, format: GgmlDType) -> bool {
        cols.is_multiple_of(format.block_size())
    }

    /// The block format.
    pub fn format(&self) -> GgmlDType {
        match self {
            QuantizedWeight::Matrix(q) => q.format(),
            QuantizedWeight::Experts(qs) => qs.first().map_or(GgmlDType::Q8_0, |q| q.format()),
        }
    }

    /// The logical shape: `[out, in]` or `[experts, out, in]`.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            QuantizedWeight::Matrix(q) => q.dims().to_vec(),
            QuantizedWeight::Experts(qs) => {
                let mut d = vec![qs.len()];
                d.extend(qs.first().map_or(&[][..], |q| q.dims()));
                d
            }
        }
    }

    /// The bytes of RAM its matrices hold ([`BlockMatrix::held_bytes`]).
    pub fn held_bytes(&self) -> u64 {
        self.matrices().iter().map(BlockMatrix::held_bytes).sum()
    }

    /// Every matrix: the one, or each expert's in order.
    pub fn matrices(&self) -> &[BlockMatrix] {
        match self {
            QuantizedWeight::Matrix(q) => std::slice::from_ref(q.as_ref()),
            QuantizedWeight::Experts(qs) => qs,
        }
    }
}

/// `dims` as a matrix's `[out, in]`.
fn matrix_dims(dims: &[usize]) -> Result<[usize; 2]> {
    match *dims {
        [out, cols] => Ok([out, cols]),
        _ => Err(Error::Internal(format!(
            "GGML blocks of shape {dims:?} held as one matrix (expected [out, in])"
        ))),
    }
}
