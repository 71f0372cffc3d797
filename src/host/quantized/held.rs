//! The block format a matrix is held in, where candle has no fast kernel for the stored one.
//!
//! llama.cpp's `Q4_K_M` stores some matrices of every DeepSeek MoE layer in formats candle-core
//! 0.11 multiplies slowly. A routed expert's down-projection is 1,408 inputs wide in V2-Lite
//! (10,944 for the dense layer's), not whole 256-wide super-blocks, so `llama-quantize` falls
//! back from `Q4_K` to `Q5_0` and from `Q6_K` to `Q8_0` for it. candle multiplies `Q5_0` with a
//! scalar loop on every x86 level, and repacks `Q8_0` into its VNNI tiles only for rows of
//! whole super-blocks. On the V2-Lite-shaped `Q4_K_M`, by `benches/quantized.rs`'s times per
//! product (1.38 ms for a `Q5_0` one, 0.39 ms for `Q8_0`, 0.12 ms for a `Q4_K` gate), they were
//! about 140 ms of a 236 ms batch-1 decode step. So a matrix is held:
//!
//! - `Q5_0` as `Q8_0`, which is exact: a `Q5_0` weight is `d * (q - 16)` for a 5-bit `q`, a
//!   `Q8_0` one `d * c` for an 8-bit `c`, over the same blocks of 32 with the same scale `d`, and
//!   both multiply activations quantized to `Q8_0`. It costs 34 bytes a block instead of 22.
//! - `Q8_0` (stored or so converted) whose rows are not whole super-blocks, padded with zero
//!   blocks to the next whole one, where candle tiles `Q8_0` at all (asked of candle itself,
//!   once: [`candle_tiles`]) and the padding adds at most an eighth: 1,408 becomes 1,536
//!   (9% more bytes). The products' inputs are padded with zeros to match. The sums are then
//!   candle's tiled ones: it quantizes the activations with one scale per 256 values (`Q8_K`),
//!   as it does for every `Q8_0` matrix of whole super-blocks, where its block kernels (and
//!   llama.cpp) use one per 32: a little coarser (`tests/gguf_v2lite.rs` bounds the logits
//!   against llama.cpp's on V2-Lite's shapes).
//!
//! Rejected: our own `Q5_0` kernel (the crate forbids `unsafe`, which SIMD intrinsics need; a
//! safe loop is what candle already runs), and requantizing to `Q4_K` (other numbers than the
//! file's).

use std::borrow::Cow;

use candle_core::quantized::{k_quants::QK_K, GgmlDType, QStorage, QTensor, QuantizedType};

use super::matrix::candle_tiles;
use crate::error::{Error, Result};

/// The most zero padding a row is given, as a fraction (`1 / MAX_PADDING`) of its width: more
/// would cost more than candle's tiles save (they multiplied a 1,408-wide row padded to 1,536
/// 2.6 times as fast as its blocks; a 96-wide row would be read as 256).
const MAX_PADDING: usize = 8;

/// The format and row width a matrix stored in `format` blocks with rows `cols` wide is held
/// in (see the module docs): decided from the format and shape alone, so what a checkpoint
/// will hold can be told before its tensors are read ([`super::QuantizedWeight::predicted_bytes`]).
pub(super) fn held_shape(format: GgmlDType, cols: usize) -> (GgmlDType, usize) {
    let to_q8_0 = format == GgmlDType::Q5_0;
    let whole = cols.next_multiple_of(QK_K);
    let held_cols = if (to_q8_0 || format == GgmlDType::Q8_0)
        && whole > cols
        && whole - cols <= cols / MAX_PADDING
        && candle_tiles(GgmlDType::Q8_0)
    {
        whole
    } else {
        cols
    };
    (if to_q8_0 { GgmlDType::Q8_0 } else { format }, held_cols)
}

/// `blocks` (an `[out, in]` matrix, `dims`) in the form it is held in, with the width of its
/// held rows ([`held_shape`]).
pub(super) fn held_form(
    blocks: Box<dyn QuantizedType>,
    dims: [usize; 2],
) -> Result<(Box<dyn QuantizedType>, usize)> {
    let format = blocks.dtype();
    let [rows, cols] = dims;
    let (held_format, held_cols) = held_shape(format, cols);
    if held_format == format && held_cols == cols {
        return Ok((blocks, cols));
    }
    let stored = QTensor::new(QStorage::Cpu(blocks), dims.to_vec())?;
    let held = q8_0_rows(&stored.data()?, format, rows, cols, held_cols)?;
    Ok((
        GgmlDType::Q8_0.from_data(Cow::Borrowed(bytemuck::cast_slice(&held))),
        held_cols,
    ))
}

/// The `rows` rows of `cols` values in `format` blocks (`bytes`) as `Q8_0` rows of
/// `held_cols` values, zero blocks after the stored ones: the bytes, in a buffer aligned for
/// candle's block types (which it checks), rounded up to whole `u64`s.
fn q8_0_rows(
    bytes: &[u8],
    format: GgmlDType,
    rows: usize,
    cols: usize,
    held_cols: usize,
) -> Result<Vec<u64>> {
    let block = GgmlDType::Q8_0.block_size();
    let (src_size, dst_size) = (format.type_size(), GgmlDType::Q8_0.type_size());
    let (src_row, dst_row) = (cols / block * src_size, held_cols / block * dst_size);
    if bytes.len() != rows * src_row {
        return Err(Error::Internal(format!(
            "{} bytes of {format:?} blocks for a [{rows}, {cols}] matrix",
            bytes.len()
        )));
    }
    let convert: fn(&[u8], &mut [u8]) = match format {
        GgmlDType::Q5_0 => q5_0_as_q8_0,
        GgmlDType::Q8_0 => |s, d| d.copy_from_slice(s),
        other => return Err(Error::Internal(format!("{other:?} blocks held as Q8_0"))),
    };
    let mut held = vec![0u64; (rows * dst_row).div_ceil(8)];
    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut held);
    for (src, dst) in bytes
        .chunks_exact(src_row)
        .zip(dst.chunks_exact_mut(dst_row))
    {
        for (s, d) in src
            .chunks_exact(src_size)
            .zip(dst.chunks_exact_mut(dst_size))
        {
            convert(s, d);
        }
        // The blocks past `cols` stay zero: a scale of +0.0 and codes of 0.
    }
    Ok(held)
}

/// One `Q5_0` block (`d: f16`, the codes' fifth bits `qh: u32` LE, their low nibbles `qs:
/// [u8; 16]`; value `i` < 16 is nibble `i`'s low half, value `16 + i` its high half) as a
/// `Q8_0` block (`d: f16`, `qs: [i8; 32]`) of the same values.
fn q5_0_as_q8_0(src: &[u8], dst: &mut [u8]) {
    let (scale, rest) = src.split_at(2);
    let (high_bits, nibbles) = rest.split_at(4);
    let high = u32::from_le_bytes([high_bits[0], high_bits[1], high_bits[2], high_bits[3]]);
    dst[..2].copy_from_slice(scale);
    let code = |low: u8, bit: usize| (i16::from(low) | (((high >> bit) & 1) as i16) << 4) - 16;
    for (i, &n) in nibbles.iter().enumerate() {
        dst[2 + i] = code(n & 0x0F, i) as i8 as u8;
        dst[2 + 16 + i] = code(n >> 4, 16 + i) as i8 as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::seeded_values;
    use candle_core::{Device, Tensor as CTensor};

    fn dequantized(q: &QTensor) -> Vec<f32> {
        q.dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// `Q5_0` blocks held as `Q8_0` (padded or not) restore, by candle's own dequantizers, to
    /// exactly the stored values, and the padding to zeros.
    #[test]
    fn q5_0_rows_become_the_same_q8_0_values() {
        let (rows, cols) = (3, 96);
        let w =
            CTensor::from_vec(seeded_values(rows * cols, 5), (rows, cols), &Device::Cpu).unwrap();
        let stored = QTensor::quantize(&w, GgmlDType::Q5_0).unwrap();
        let want = dequantized(&stored);
        for held_cols in [cols, 256] {
            let held = q8_0_rows(
                &stored.data().unwrap(),
                GgmlDType::Q5_0,
                rows,
                cols,
                held_cols,
            )
            .unwrap();
            let bytes = &bytemuck::cast_slice(&held)[..rows * held_cols / 32 * 34];
            let held = QTensor::new(
                QStorage::Cpu(GgmlDType::Q8_0.from_data(Cow::Borrowed(bytes))),
                (rows, held_cols),
            )
            .unwrap();
            let got = dequantized(&held);
            for r in 0..rows {
                let row = &got[r * held_cols..(r + 1) * held_cols];
                assert_eq!(row[..cols], want[r * cols..(r + 1) * cols], "row {r}");
                assert!(row[cols..].iter().all(|&v| v == 0.0), "row {r}'s padding");
            }
        }
    }
}
