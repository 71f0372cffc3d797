//! Host tensors to and from the little-endian bytes a device buffer holds.
//!
//! The device runner uploads weights and reads outputs as bytes, and nrt-sim rebuilds tensors
//! from them; both go through here so each dtype's byte layout is written once. `i8` values
//! are held by candle as `u8` storage (candle has no `i8`) with the same bits, and `bool` as one
//! byte, so both copy through unchanged.

use candle_core::{backend::BackendStorage, CpuStorage, Device, Storage, Tensor as CTensor};

use super::candle_dtype;
use crate::error::{Error, Result};
use crate::graph::DType;

/// Copies `bytes` into a `Vec<T>` (the source has no alignment guarantee for `T`); trailing
/// bytes that do not fill a `T` are ignored.
fn collect<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    let n = v.len() * std::mem::size_of::<T>();
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes[..n]);
    v
}

/// A host tensor of `dtype` and `dims` holding `bytes`, which must be exactly its size.
pub fn tensor_from_bytes(dtype: DType, dims: &[usize], bytes: &[u8]) -> Result<CTensor> {
    let want = dims.iter().product::<usize>() * dtype.size_in_bytes();
    if bytes.len() != want {
        return Err(Error::shape(
            "tensor bytes",
            format!(
                "{} bytes for a {dtype} tensor of shape {dims:?} ({want} expected)",
                bytes.len()
            ),
        ));
    }
    let dev = &Device::Cpu;
    Ok(match dtype {
        DType::F32 => CTensor::from_vec(collect::<f32>(bytes), dims, dev)?,
        DType::BF16 => CTensor::from_vec(collect::<half::bf16>(bytes), dims, dev)?,
        DType::F16 => CTensor::from_vec(collect::<half::f16>(bytes), dims, dev)?,
        DType::F8E4M3 => CTensor::from_vec(
            bytes
                .iter()
                .map(|&b| float8::F8E4M3::from_bits(b))
                .collect::<Vec<_>>(),
            dims,
            dev,
        )?,
        DType::I32 => CTensor::from_vec(collect::<i32>(bytes), dims, dev)?,
        DType::U32 => CTensor::from_vec(collect::<u32>(bytes), dims, dev)?,
        DType::I8 | DType::U8 | DType::Bool => CTensor::from_vec(bytes.to_vec(), dims, dev)?,
    })
}

/// Calls `f` with the little-endian bytes of a host tensor that holds values of graph dtype
/// `dtype`. A contiguous tensor's storage is lent as is (no copy: weights are uploaded from
/// it, up to hundreds of MB at a time); any other layout is made contiguous first.
pub fn with_tensor_bytes<R>(t: &CTensor, dtype: DType, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let want = candle_dtype(dtype);
    if t.dtype() != want {
        return Err(Error::shape(
            "tensor bytes",
            format!("a {:?} tensor read as {dtype}", t.dtype()),
        ));
    }
    let t = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return Err(Error::Internal(
            "tensor bytes of a non-CPU or strided tensor".into(),
        ));
    };
    Ok(match cpu {
        CpuStorage::F32(v) => f(bytemuck::cast_slice(&v[start..end])),
        CpuStorage::BF16(v) => f(bytemuck::cast_slice(&v[start..end])),
        CpuStorage::F16(v) => f(bytemuck::cast_slice(&v[start..end])),
        CpuStorage::I32(v) => f(bytemuck::cast_slice(&v[start..end])),
        CpuStorage::U32(v) => f(bytemuck::cast_slice(&v[start..end])),
        CpuStorage::U8(v) => f(&v[start..end]),
        CpuStorage::F8E4M3(v) => {
            let bits: Vec<u8> = v[start..end].iter().map(|x| x.to_bits()).collect();
            f(&bits)
        }
        other => {
            return Err(Error::Internal(format!(
                "a host tensor of candle dtype {:?}",
                other.dtype()
            )))
        }
    })
}
