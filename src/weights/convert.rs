//! Converting stored tensor bytes into the dtype the weights are held in.
//!
//! Values are converted chunk by chunk as they are read, into a buffer of the target dtype, so
//! loading a bf16 checkpoint in bf16 never holds an f32 copy. Narrowing is checked where it
//! can lose range (f16 holds at most 65504; bf16 has f32's range, so only precision is lost);
//! a value beyond the target's range is an error naming the tensor, never a silent infinity.

use candle_core::{Device, Tensor};
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::graph::DType;

/// Values of one target dtype, growing as chunks are converted.
pub(super) enum Buffer {
    F32(Vec<f32>),
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl Buffer {
    /// An empty buffer for `n` values of `dtype` (f32, bf16 or f16).
    pub(super) fn new(dtype: DType, n: usize, name: &str) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => Buffer::F32(Vec::with_capacity(n)),
            DType::BF16 => Buffer::BF16(Vec::with_capacity(n)),
            DType::F16 => Buffer::F16(Vec::with_capacity(n)),
            other => {
                return Err(Error::Weights(format!(
                    "tensor `{name}`: weights cannot be held in {other} (f32, bf16 or f16)"
                )))
            }
        })
    }

    /// Appends `values`, failing (naming `name`) on a value beyond the target's range.
    pub(super) fn extend(&mut self, values: &[f32], name: &str) -> Result<()> {
        match self {
            Buffer::F32(v) => v.extend_from_slice(values),
            Buffer::BF16(v) => v.extend(values.iter().map(|&x| half::bf16::from_f32(x))),
            Buffer::F16(v) => {
                let max = half::f16::MAX.to_f32();
                if let Some(big) = values.iter().find(|x| x.is_finite() && x.abs() > max) {
                    return Err(Error::Weights(format!(
                        "tensor `{name}` holds {big}, beyond f16's range (±{max}): load it with \
                         --dtype bf16 or f32"
                    )));
                }
                v.extend(values.iter().map(|&x| half::f16::from_f32(x)));
            }
        }
        Ok(())
    }

    /// The values as a tensor of `shape`.
    pub(super) fn into_tensor(self, shape: &[usize]) -> Result<Tensor> {
        let dev = &Device::Cpu;
        Ok(match self {
            Buffer::F32(v) => Tensor::from_vec(v, shape, dev)?,
            Buffer::BF16(v) => Tensor::from_vec(v, shape, dev)?,
            Buffer::F16(v) => Tensor::from_vec(v, shape, dev)?,
        })
    }
}

/// Whether [`decode`] reads stored dtype `dtype`.
pub(super) fn readable(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F8_E4M3 | Dtype::F8_E8M0
    )
}

/// Decodes little-endian `bytes` of stored dtype `dtype` into f32 values appended to `out`
/// (exact for every dtype here). `None` for a dtype deepinfer does not read.
pub(super) fn decode(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> Option<()> {
    match dtype {
        Dtype::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        // A bf16 is the top half of an f32's bits.
        Dtype::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
        ),
        Dtype::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        // `float8_e4m3fn`: no infinities, the largest finite value 448 (OCP FP8).
        Dtype::F8_E4M3 => out.extend(bytes.iter().map(|&b| float8::F8E4M3::from_bits(b).to_f32())),
        // `float8_e8m0fnu` (OCP MX scales): the exponent alone, 2^(b - 127); 0xff is NaN.
        Dtype::F8_E8M0 => out.extend(bytes.iter().map(|&b| e8m0(b))),
        _ => return None,
    }
    Some(())
}

/// The value of an `float8_e8m0fnu` byte: `2^(b - 127)` (2^-127, the smallest, is an f32
/// subnormal, exact), NaN for 0xff.
pub(super) fn e8m0(b: u8) -> f32 {
    match b {
        0xff => f32::NAN,
        0 => f32::from_bits(1 << 22),
        b => f32::from_bits(u32::from(b) << 23),
    }
}

/// Multiplies an `[rows, cols]` f32 matrix by its block scales in place: element `(r, c)` by
/// `scales[r / block[0], c / block[1]]` (DeepSeek-V3's `weight_scale_inv`, whose last blocks
/// may be partial).
pub(super) fn apply_block_scales(
    values: &mut [f32],
    cols: usize,
    scales: &[f32],
    block: [usize; 2],
) {
    let scale_cols = cols.div_ceil(block[1]);
    for (r, row) in values.chunks_exact_mut(cols).enumerate() {
        let srow = &scales[(r / block[0]) * scale_cols..][..scale_cols];
        for (c, v) in row.iter_mut().enumerate() {
            *v *= srow[c / block[1]];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// float8's e4m3 is the `fn` variant DeepSeek's checkpoints use (OCP FP8 table).
    #[test]
    fn e4m3fn_decodes_the_ocp_table() {
        let f = |bits: &[u8]| {
            let mut out = Vec::new();
            decode(Dtype::F8_E4M3, bits, &mut out).unwrap();
            out
        };
        let got = f(&[0x00, 0x38, 0x7e, 0xfe, 0x01, 0x08]);
        let want = [0.0, 1.0, 448.0, -448.0, 2f32.powi(-9), 2f32.powi(-6)];
        assert_eq!(got, want);
        assert!(f(&[0x7f])[0].is_nan());
    }

    /// E8M0 is a bare exponent: 127 is 1, each step doubles, 0xff is NaN (OCP MX).
    #[test]
    fn e8m0_decodes_powers_of_two() {
        let mut out = Vec::new();
        decode(Dtype::F8_E8M0, &[127, 128, 120, 254, 1, 0], &mut out).unwrap();
        let want = [1.0, 2.0, 2f32.powi(-7), 2f32.powi(127), 2f32.powi(-126)];
        assert_eq!(&out[..5], &want);
        assert_eq!(out[5], 2f64.powi(-127) as f32);
        assert!(e8m0(0xff).is_nan());
    }

    #[test]
    fn block_scales_cover_ragged_last_blocks() {
        // 3 x 5 matrix, blocks of 2 x 2: scales are 2 x 3.
        let mut v = vec![1.0f32; 15];
        let scales = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        apply_block_scales(&mut v, 5, &scales, [2, 2]);
        assert_eq!(
            v,
            vec![
                1.0, 1.0, 2.0, 2.0, 3.0, //
                1.0, 1.0, 2.0, 2.0, 3.0, //
                4.0, 4.0, 5.0, 5.0, 6.0,
            ]
        );
    }

    /// Narrowing to f16 refuses a value beyond its range, naming the tensor and the way out;
    /// bf16 (f32's range) takes it.
    #[test]
    fn f16_overflow_is_an_error_naming_the_tensor() {
        let mut b = Buffer::new(DType::F16, 2, "w").unwrap();
        let err = b
            .extend(&[1.0, 1.0e5], "model.layers.0.mlp.down_proj.weight")
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("model.layers.0.mlp.down_proj.weight") && msg.contains("--dtype bf16"),
            "{msg}"
        );
        let mut b = Buffer::new(DType::BF16, 2, "w").unwrap();
        b.extend(&[1.0, 1.0e5], "w").unwrap();
        assert!(Buffer::new(DType::I8, 1, "w").is_err());
    }
}
