//! Host tensors: values held in host memory as candle tensors, whichever backend runs them.
//!
//! The model's weights ([`crate::model::params`]) are held here before any backend sees them;
//! the CPU backend ([`crate::backend::cpu`]) runs graphs on these values directly, the device
//! runner uploads them as bytes ([`with_tensor_bytes`]). So the model names no backend, and both backends
//! read one definition of a host value.

mod bytes;
mod quantized;

pub use bytes::{tensor_from_bytes, with_tensor_bytes};
pub use quantized::{BlockMatrix, QuantizedWeight, Role, AMX_MIN_ROWS};

use candle_core::{DType as CDType, Tensor as CTensor};

use crate::graph::DType;

/// The candle dtype that holds values of a graph dtype.
pub fn candle_dtype(dtype: DType) -> CDType {
    match dtype {
        DType::F32 => CDType::F32,
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        DType::F8E4M3 => CDType::F8E4M3,
        DType::I32 => CDType::I32,
        DType::U32 => CDType::U32,
        // candle has no i8: the bytes are held as u8 and read as i8 where it matters (casts).
        DType::I8 | DType::U8 | DType::Bool => CDType::U8,
    }
}

/// A graph input's value on the host, as the CPU backend takes it and the model's weights
/// hold it: a tensor, or a weight in a GGML block format.
#[derive(Debug, Clone)]
pub enum Value {
    /// A tensor of the declared shape and dtype.
    Tensor(CTensor),
    /// A weight held in a GGML block format (`--quantize q8_0|q4_k`) in place of the declared
    /// tensor: only matmuls read it (fused, see the CPU backend's `Plan`), so the graph is the one every other
    /// precision runs.
    Quantized(QuantizedWeight),
}
