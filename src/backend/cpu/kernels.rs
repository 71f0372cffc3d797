//! CPU kernels candle-core does not have in the form the graph needs.
//!
//! - [`RowGather`]: rows of a 2-D *strided* view picked by ids. A layer's cache view is a column
//!   slice of the KV root; candle's `index_select` would first make the whole view contiguous,
//!   copying every layer's cache on every step. This reads only the rows asked for.
//! - [`ScatterRowsInPlace`]: writes rows into a column range of a cache root without copying it.
//! - integer arithmetic with HLO's wrapping semantics (candle's integer ops are not wrapping, and
//!   have no bitwise ops), and top-k.

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp2, InplaceOp3, Layout, Shape};

use crate::graph::BinaryOp;

fn ids_as_usize(
    ids: &CpuStorage,
    layout: &Layout,
    bound: usize,
) -> candle_core::Result<Vec<usize>> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("row ids must be contiguous".into()))?;
    let check = |i: i64| {
        if i < 0 || i as usize >= bound {
            Err(candle_core::Error::Msg(format!(
                "row index {i} out of range 0..{bound}"
            )))
        } else {
            Ok(i as usize)
        }
    };
    match ids {
        CpuStorage::I32(v) => v[start..end].iter().map(|&i| check(i as i64)).collect(),
        CpuStorage::U32(v) => v[start..end].iter().map(|&i| check(i as i64)).collect(),
        other => Err(candle_core::Error::Msg(format!(
            "row ids of dtype {:?}",
            other.dtype()
        ))),
    }
}

/// Gathers rows of a 2-D view whose columns are contiguous (any row stride, any offset).
pub(crate) struct RowGather;

impl CustomOp2 for RowGather {
    fn name(&self) -> &'static str {
        "row-gather"
    }

    fn cpu_fwd(
        &self,
        src: &CpuStorage,
        src_l: &Layout,
        ids: &CpuStorage,
        ids_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = src_l.shape().dims2()?;
        let stride = src_l.stride();
        if cols > 1 && stride[1] != 1 {
            return Err(candle_core::Error::Msg(
                "row-gather needs unit column stride".into(),
            ));
        }
        let ids = ids_as_usize(ids, ids_l, rows)?;
        let (start, row_stride) = (src_l.start_offset(), stride[0]);
        fn pick<T: Copy>(
            data: &[T],
            ids: &[usize],
            start: usize,
            stride: usize,
            cols: usize,
        ) -> Vec<T> {
            let mut out = Vec::with_capacity(ids.len() * cols);
            for &r in ids {
                let at = start + r * stride;
                out.extend_from_slice(&data[at..at + cols]);
            }
            out
        }
        let out = match src {
            CpuStorage::F32(d) => CpuStorage::F32(pick(d, &ids, start, row_stride, cols)),
            CpuStorage::BF16(d) => CpuStorage::BF16(pick(d, &ids, start, row_stride, cols)),
            CpuStorage::F16(d) => CpuStorage::F16(pick(d, &ids, start, row_stride, cols)),
            CpuStorage::F8E4M3(d) => CpuStorage::F8E4M3(pick(d, &ids, start, row_stride, cols)),
            CpuStorage::I32(d) => CpuStorage::I32(pick(d, &ids, start, row_stride, cols)),
            CpuStorage::U32(d) => CpuStorage::U32(pick(d, &ids, start, row_stride, cols)),
            CpuStorage::U8(d) => CpuStorage::U8(pick(d, &ids, start, row_stride, cols)),
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "row-gather of dtype {:?}",
                    other.dtype()
                )))
            }
        };
        Ok((out, Shape::from((ids.len(), cols))))
    }
}

/// `dst[rows[i], col..col + w] = src[i]`, in place, for a contiguous 2-D `dst`.
pub(crate) struct ScatterRowsInPlace {
    /// First destination column.
    pub col: usize,
}

impl InplaceOp3 for ScatterRowsInPlace {
    fn name(&self) -> &'static str {
        "scatter-rows"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        ids: &CpuStorage,
        ids_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (rows, cols) = dst_l.shape().dims2()?;
        let (n, w) = src_l.shape().dims2()?;
        let (Some((d0, _)), Some((s0, s1))) =
            (dst_l.contiguous_offsets(), src_l.contiguous_offsets())
        else {
            return Err(candle_core::Error::Msg(
                "scatter-rows needs contiguous operands".into(),
            ));
        };
        let ids = ids_as_usize(ids, ids_l, rows)?;
        if ids.len() != n || self.col + w > cols {
            return Err(candle_core::Error::Msg(
                "scatter-rows shape mismatch".into(),
            ));
        }
        let col = self.col;
        fn put<T: Copy>(d: &mut [T], s: &[T], ids: &[usize], d0: usize, cols: usize, col: usize) {
            let w = if ids.is_empty() {
                0
            } else {
                s.len() / ids.len()
            };
            for (i, &r) in ids.iter().enumerate() {
                let at = d0 + r * cols + col;
                d[at..at + w].copy_from_slice(&s[i * w..(i + 1) * w]);
            }
        }
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => put(d, &s[s0..s1], &ids, d0, cols, col),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => put(d, &s[s0..s1], &ids, d0, cols, col),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => put(d, &s[s0..s1], &ids, d0, cols, col),
            (CpuStorage::F8E4M3(d), CpuStorage::F8E4M3(s)) => {
                put(d, &s[s0..s1], &ids, d0, cols, col)
            }
            (CpuStorage::I32(d), CpuStorage::I32(s)) => put(d, &s[s0..s1], &ids, d0, cols, col),
            (CpuStorage::U32(d), CpuStorage::U32(s)) => put(d, &s[s0..s1], &ids, d0, cols, col),
            (CpuStorage::U8(d), CpuStorage::U8(s)) => put(d, &s[s0..s1], &ids, d0, cols, col),
            (d, s) => {
                return Err(candle_core::Error::Msg(format!(
                    "scatter-rows of {:?} into {:?}",
                    s.dtype(),
                    d.dtype()
                )))
            }
        }
        Ok(())
    }
}

/// An integer type with HLO's wrapping arithmetic.
pub(crate) trait WrappingInt: Copy {
    fn apply(op: BinaryOp, a: Self, b: Self) -> Self;
}

impl WrappingInt for i32 {
    fn apply(op: BinaryOp, a: i32, b: i32) -> i32 {
        match op {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            // HLO defines x/0 = -1 and x%0 = x for integers.
            BinaryOp::Div => {
                if b == 0 {
                    -1
                } else {
                    a.wrapping_div(b)
                }
            }
            BinaryOp::Rem => {
                if b == 0 {
                    a
                } else {
                    a.wrapping_rem(b)
                }
            }
            BinaryOp::Max => a.max(b),
            BinaryOp::Min => a.min(b),
            BinaryOp::BitXor => a ^ b,
            BinaryOp::BitAnd => a & b,
            BinaryOp::Shr => {
                if (b as u32) >= 32 {
                    0
                } else {
                    ((a as u32) >> b) as i32
                }
            }
            BinaryOp::Shl => {
                if (b as u32) >= 32 {
                    0
                } else {
                    a << b
                }
            }
        }
    }
}

impl WrappingInt for u32 {
    fn apply(op: BinaryOp, a: u32, b: u32) -> u32 {
        match op {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            BinaryOp::Div => a.checked_div(b).unwrap_or(u32::MAX),
            BinaryOp::Rem => a.checked_rem(b).unwrap_or(a),
            BinaryOp::Max => a.max(b),
            BinaryOp::Min => a.min(b),
            BinaryOp::BitXor => a ^ b,
            BinaryOp::BitAnd => a & b,
            BinaryOp::Shr => a.checked_shr(b).unwrap_or(0),
            BinaryOp::Shl => a.checked_shl(b).unwrap_or(0),
        }
    }
}

/// Elementwise wrapping integer op on equal-length slices.
pub(crate) fn int_binary<T: WrappingInt>(op: BinaryOp, a: &[T], b: &[T]) -> Vec<T> {
    a.iter().zip(b).map(|(&x, &y)| T::apply(op, x, y)).collect()
}

/// Indices of the `k` largest values of each row of `n` values, largest first; ties go to the
/// lower index (a stable descending sort, as the HLO lowering does).
pub(crate) fn topk_rows(x: &[f32], n: usize, k: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(x.len() / n.max(1) * k);
    let mut idx: Vec<usize> = Vec::with_capacity(n);
    // NaN sorts as the largest value, as in XLA's total order for descending sorts.
    let key = |v: f32| if v.is_nan() { f32::INFINITY } else { v };
    for row in x.chunks_exact(n) {
        idx.clear();
        idx.extend(0..n);
        let cmp = |a: &usize, b: &usize| {
            key(row[*b])
                .partial_cmp(&key(row[*a]))
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(b))
        };
        if k < n {
            idx.select_nth_unstable_by(k - 1, cmp);
            idx.truncate(k);
        }
        idx.sort_by(cmp);
        out.extend(idx.iter().map(|&i| i as i32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_orders_and_breaks_ties_low_index_first() {
        let x = [1.0, 3.0, 3.0, -1.0, 2.0, 0.0, 5.0, 5.0];
        assert_eq!(topk_rows(&x, 4, 3), vec![1, 2, 0, 2, 3, 0]);
    }

    #[test]
    fn int_ops_wrap_like_hlo() {
        assert_eq!(
            int_binary(BinaryOp::Mul, &[u32::MAX], &[3]),
            vec![u32::MAX - 2]
        );
        assert_eq!(int_binary(BinaryOp::Shr, &[-8i32], &[28]), vec![15]);
        assert_eq!(int_binary(BinaryOp::Div, &[7i32], &[0]), vec![-1]);
    }
}
