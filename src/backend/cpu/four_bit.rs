//! [`Op::Dequantize4Bit`](crate::graph::Op::Dequantize4Bit) on the CPU: 4-bit codes, two a
//! byte, back to f32 with one scale per group of a row.
//!
//! The op alone (a graph whose dequantized experts something else reads) is one pass over the
//! codes ([`dequantize`]). Under an expert matmul the plan fuses it (`Plan`): the gathered
//! kernel (`matmul::gathered`) widens one weight row at a time with [`widen_row`] into a buffer
//! that stays in L1, so the f32 experts are never materialised. Both compute each value as the
//! HLO lowering does, the code's value (exact) times its scale in f32 (one rounding), so the
//! fused and unfused forms, and XLA, agree bit for bit on the weights.

use candle_core::{Device, Tensor as CTensor};

use crate::graph::FourBit;

/// The values of the low and the high nibble of every byte, per format.
struct Nibbles([[f32; 2]; 256]);

impl Nibbles {
    const fn of(format: FourBit) -> Self {
        let values = format.values();
        let mut t = [[0f32; 2]; 256];
        let mut b = 0;
        while b < 256 {
            t[b] = [values[b & 15], values[b >> 4]];
            b += 1;
        }
        Nibbles(t)
    }

    fn table(format: FourBit) -> &'static [[f32; 2]; 256] {
        static INT4: Nibbles = Nibbles::of(FourBit::Int4);
        static E2M1: Nibbles = Nibbles::of(FourBit::E2m1);
        match format {
            FourBit::Int4 => &INT4.0,
            FourBit::E2m1 => &E2M1.0,
        }
    }
}

/// Appends the `2 * bytes.len()` values of one row: byte `j` holds values `2j` (low nibble) and
/// `2j + 1` (high nibble), each the code's value under `format` times `scales[value / group]`.
#[inline]
pub(super) fn widen_row(
    bytes: &[u8],
    scales: &[f32],
    group: usize,
    format: FourBit,
    out: &mut Vec<f32>,
) {
    let nibbles = Nibbles::table(format);
    if group.is_multiple_of(2) {
        // A group is whole bytes: one scale per run of `group / 2` bytes.
        for (run, &s) in bytes.chunks(group / 2).zip(scales) {
            for &b in run {
                let [lo, hi] = nibbles[usize::from(b)];
                out.extend_from_slice(&[lo * s, hi * s]);
            }
        }
        return;
    }
    for (j, &b) in bytes.iter().enumerate() {
        let [lo, hi] = nibbles[usize::from(b)];
        out.push(lo * scales[2 * j / group]);
        out.push(hi * scales[(2 * j + 1) / group]);
    }
}

/// The whole op: `codes` (u8 `[.., half]`) of `format` and `scales` (f32 `[.., groups]`) to
/// f32 `[.., 2 half]`.
pub(super) fn dequantize(
    codes: &CTensor,
    scales: &CTensor,
    group: usize,
    format: FourBit,
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
            widen_row(row, s, group, format, &mut out);
        }
    }
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last *= 2;
    }
    CTensor::from_vec(out, shape, &Device::Cpu)
}
