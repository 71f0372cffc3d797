//! [`Op::DequantizeInt4`](crate::graph::Op::DequantizeInt4) on the CPU: 4-bit codes, two a
//! byte, back to f32 with one scale per group of a row.
//!
//! The op alone (a graph whose dequantized experts something else reads) is one pass over the
//! codes ([`dequantize`]). Under an expert matmul the plan fuses it (`Plan`): the gathered
//! kernel (`matmul::gathered`) widens one weight row at a time with [`widen_row`] into a buffer
//! that stays in L1, so the f32 experts are never materialised. Both compute each value as the
//! HLO lowering does, `(code - 8) * scale` in f32 (exact up to the one rounding of the product),
//! so the fused and unfused forms, and XLA, agree bit for bit on the weights.

use candle_core::{Device, Tensor as CTensor};

/// `code - 8` of the low and high nibble of every byte.
const NIBBLES: [[f32; 2]; 256] = {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [(b & 15) as f32 - 8.0, (b >> 4) as f32 - 8.0];
        b += 1;
    }
    t
};

/// Appends the `2 * bytes.len()` values of one row: byte `j` holds values `2j` (low nibble) and
/// `2j + 1` (high nibble), each `code - 8` times `scales[value / group]`.
#[inline]
pub(super) fn widen_row(bytes: &[u8], scales: &[f32], group: usize, out: &mut Vec<f32>) {
    if group.is_multiple_of(2) {
        // A group is whole bytes: one scale per run of `group / 2` bytes.
        for (run, &s) in bytes.chunks(group / 2).zip(scales) {
            for &b in run {
                let [lo, hi] = NIBBLES[usize::from(b)];
                out.extend_from_slice(&[lo * s, hi * s]);
            }
        }
        return;
    }
    for (j, &b) in bytes.iter().enumerate() {
        let [lo, hi] = NIBBLES[usize::from(b)];
        out.push(lo * scales[2 * j / group]);
        out.push(hi * scales[(2 * j + 1) / group]);
    }
}

/// The whole op: `codes` (u8 `[.., half]`) and `scales` (f32 `[.., groups]`) to f32
/// `[.., 2 half]`.
pub(super) fn dequantize(
    codes: &CTensor,
    scales: &CTensor,
    group: usize,
) -> candle_core::Result<CTensor> {
    let dims = codes.dims();
    let half = dims.last().copied().unwrap_or(0);
    let groups = scales.dims().last().copied().unwrap_or(0);
    let bytes = codes.flatten_all()?.to_vec1::<u8>()?;
    let scales = scales.flatten_all()?.to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(2 * bytes.len());
    if half > 0 {
        for (row, s) in bytes
            .chunks_exact(half)
            .zip(scales.chunks_exact(groups.max(1)))
        {
            widen_row(row, s, group, &mut out);
        }
    }
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last *= 2;
    }
    CTensor::from_vec(out, shape, &Device::Cpu)
}
