//! The "device": bytes in, [`deepinfer::backend::cpu::run`], bytes out.
//!
//! Input bytes are copied into candle tensors (candle owns its storage, so wrapping the
//! caller's buffer without a copy is not possible), the CPU backend runs the imported graph,
//! and each output is copied into the tensor bound to it. A cache root bound as both input
//! and output is therefore updated in place *as the caller sees it*: the one buffer the
//! caller allocated holds the new value afterwards, and the transient copy lives only inside
//! this call. The price is one extra copy of each root per execution, which a test
//! simulator can afford.

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use deepinfer::backend::cpu;
use deepinfer::graph::{DType, Graph};
use neuron_sys::sys;

use crate::fail::{Fail, Res};
use crate::model_io::IoDesc;

/// Copies little-endian bytes into a `Vec<T>`. A copy rather than a cast: the storage
/// bytes carry no alignment guarantee for `T`. Trailing bytes that do not fill a `T` are
/// ignored (the caller checked the length).
fn collect<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    let n = v.len() * std::mem::size_of::<T>();
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes[..n]);
    v
}

/// Builds a candle tensor of `desc`'s dtype and shape from little-endian `bytes` (whose
/// length the caller checked against `desc.size`).
fn to_candle(desc: &IoDesc, bytes: &[u8]) -> Res<CTensor> {
    let dims: Vec<usize> = desc.shape.iter().map(|&d| d as usize).collect();
    let dev = &Device::Cpu;
    let t = match desc.dtype {
        DType::F32 => CTensor::from_vec(collect::<f32>(bytes), dims, dev),
        DType::BF16 => CTensor::from_vec(collect::<half::bf16>(bytes), dims, dev),
        DType::F16 => CTensor::from_vec(collect::<half::f16>(bytes), dims, dev),
        DType::I32 => CTensor::from_vec(collect::<i32>(bytes), dims, dev),
        DType::U32 => CTensor::from_vec(collect::<u32>(bytes), dims, dev),
        DType::U8 | DType::Bool => CTensor::from_vec(bytes.to_vec(), dims, dev),
    };
    t.map_err(|e| {
        Fail::new(
            sys::NRT_FAILURE,
            format!("input `{}`: cannot build a tensor: {e}", desc.name),
        )
    })
}

/// The little-endian bytes of an output tensor, checked against its declared dtype and size.
fn to_bytes(desc: &IoDesc, t: &CTensor) -> Res<Vec<u8>> {
    let fail = |msg: String| Fail::new(sys::NRT_FAILURE, format!("output `{}`: {msg}", desc.name));
    let want = cpu::candle_dtype(desc.dtype);
    if t.dtype() != want {
        return Err(fail(format!(
            "the CPU backend produced {:?}, the model declares {want:?}",
            t.dtype()
        )));
    }
    let flat = t.flatten_all().map_err(|e| fail(e.to_string()))?;
    let bytes = match want {
        CDType::F32 => flat
            .to_vec1::<f32>()
            .map(|v| bytemuck::cast_slice(&v).to_vec()),
        CDType::BF16 => flat
            .to_vec1::<half::bf16>()
            .map(|v| bytemuck::cast_slice(&v).to_vec()),
        CDType::F16 => flat
            .to_vec1::<half::f16>()
            .map(|v| bytemuck::cast_slice(&v).to_vec()),
        CDType::I32 => flat
            .to_vec1::<i32>()
            .map(|v| bytemuck::cast_slice(&v).to_vec()),
        CDType::U32 => flat
            .to_vec1::<u32>()
            .map(|v| bytemuck::cast_slice(&v).to_vec()),
        CDType::U8 => flat.to_vec1::<u8>(),
        other => return Err(fail(format!("unsupported dtype {other:?}"))),
    }
    .map_err(|e| fail(e.to_string()))?;
    if bytes.len() != desc.size {
        return Err(fail(format!(
            "the CPU backend produced {} bytes, the model declares {}",
            bytes.len(),
            desc.size
        )));
    }
    Ok(bytes)
}

/// Runs `graph` on the input bytes (one per declared input, in order) and returns the
/// output bytes (one per declared output, in order).
///
/// An error from the CPU backend (say, a token id outside the vocabulary reaching an
/// embedding lookup) is `NRT_EXEC_BAD_INPUT`: on a device, that is input the NEFF cannot
/// execute correctly on.
pub(crate) fn run(
    graph: &Graph,
    inputs: &[IoDesc],
    outputs: &[IoDesc],
    input_bytes: &[Vec<u8>],
) -> Res<Vec<Vec<u8>>> {
    let tensors = inputs
        .iter()
        .zip(input_bytes)
        .map(|(d, b)| to_candle(d, b))
        .collect::<Res<Vec<_>>>()?;
    let results = cpu::run(graph, &tensors).map_err(|e| {
        Fail::new(
            sys::NRT_EXEC_BAD_INPUT,
            format!("the CPU backend failed on model `{}`: {e}", graph.name()),
        )
    })?;
    if results.len() != outputs.len() {
        return Err(Fail::new(
            sys::NRT_FAILURE,
            format!(
                "the CPU backend returned {} outputs for {} declared",
                results.len(),
                outputs.len()
            ),
        ));
    }
    outputs
        .iter()
        .zip(&results)
        .map(|(d, t)| to_bytes(d, t))
        .collect()
}
