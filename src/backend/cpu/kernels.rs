//! CPU kernels candle-core does not have in the form the graph needs.
//!
//! - [`RowGather`]: rows of a 2-D *strided* view picked by ids. A layer's cache view is a column
//!   slice of the KV root; candle's `index_select` would first make the whole view contiguous,
//!   copying every layer's cache on every step. This reads only the rows asked for.
//! - [`RowSum`]: a sum over the last dim whose bits do not depend on trailing zeros.
//! - [`AxisSum`]: a sum over any other dim, whole rows at a time.
//! - [`ScatterRowsInPlace`]: writes rows into a column range of a cache root without copying it.
//! - integer arithmetic with HLO's wrapping semantics (candle's integer ops are not wrapping, and
//!   have no bitwise ops), and top-k.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, InplaceOp3, Layout, Shape,
};

use super::pool::for_each_chunk;
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

/// Values from which [`RowGather`] copies its rows on the thread pool. A decode step's cache
/// gather (every context row of every sequence, per layer: 17 sequences of 192 positions of
/// the default model are 313 K values) is scattered reads of short rows, bound by the memory
/// latency one core hides; on two cores the gather took about a quarter less (benches/LOG.md,
/// "Step overhead outside the matmuls"). Small gathers (an embedding lookup) stay on the caller.
const PARALLEL_GATHER: usize = 1 << 15;

/// Rows one task of a parallel [`RowGather`] copies.
const GATHER_TASK_ROWS: usize = 256;

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
        fn pick<T: Copy + Default + Send + Sync>(
            data: &[T],
            ids: &[usize],
            start: usize,
            stride: usize,
            cols: usize,
        ) -> Vec<T> {
            if ids.len() * cols < PARALLEL_GATHER || cols == 0 {
                let mut out = Vec::with_capacity(ids.len() * cols);
                for &r in ids {
                    let at = start + r * stride;
                    out.extend_from_slice(&data[at..at + cols]);
                }
                return out;
            }
            let mut out = vec![T::default(); ids.len() * cols];
            let rows = GATHER_TASK_ROWS;
            for_each_chunk(
                &mut out,
                rows * cols,
                || (),
                |_, t, chunk| {
                    for (i, row) in chunk.chunks_exact_mut(cols).enumerate() {
                        let at = start + ids[t * rows + i] * stride;
                        row.copy_from_slice(&data[at..at + cols]);
                    }
                },
            );
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

/// Lanes of [`RowSum`]: a divisor of every cache block size the runner uses, so a sequence's
/// positions keep their lanes wherever a packed step puts its context.
const SUM_LANES: usize = 16;

/// A contiguous f32 tensor of rank 1 or more as its values, its last dim and the dims before
/// it: what the row-wise kernels ([`RowSum`], [`RowArgMax`]) take. `op` names the kernel in
/// the error.
fn f32_rows<'a, 'l>(
    op: &str,
    x: &'a CpuStorage,
    l: &'l Layout,
) -> candle_core::Result<(&'a [f32], usize, &'l [usize])> {
    let (CpuStorage::F32(data), Some((start, end)), Some((&n, outer))) =
        (x, l.contiguous_offsets(), l.dims().split_last())
    else {
        return Err(candle_core::Error::Msg(format!(
            "{op} needs a contiguous f32 tensor of rank 1 or more"
        )));
    };
    Ok((&data[start..end], n, outer))
}

/// The sum of each row of a contiguous f32 tensor over its last dim, in the same bits for the
/// same values whatever zeros follow them.
///
/// A CPU step runs on a context of its own length (`runner::cpu`), so one sequence's attention
/// row is longer or shorter with the company it keeps, the extra positions masked to zero. A
/// sum whose order depends on the length (candle's: SIMD over multiples of 32, then the rest
/// in a chain) then rounds differently, and a sampled stream changes with the batch. Here value
/// `j` always goes to lane `j % 16`, each lane sums in order, and the lanes meet in one fixed
/// tree: zeros past the end leave every lane as it was.
pub(crate) struct RowSum;

impl RowSum {
    fn row(row: &[f32]) -> f32 {
        let mut acc = [0f32; SUM_LANES];
        let mut chunks = row.chunks_exact(SUM_LANES);
        for c in &mut chunks {
            acc.iter_mut().zip(c).for_each(|(a, v)| *a += v);
        }
        acc.iter_mut()
            .zip(chunks.remainder())
            .for_each(|(a, v)| *a += v);
        let mut width = SUM_LANES;
        while width > 1 {
            width /= 2;
            for l in 0..width {
                acc[l] += acc[l + width];
            }
        }
        acc[0]
    }
}

impl CustomOp1 for RowSum {
    fn name(&self) -> &'static str {
        "row-sum"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (data, n, outer) = f32_rows(self.name(), x, l)?;
        let sums = match n {
            0 => vec![0f32; outer.iter().product()],
            n => data.chunks_exact(n).map(Self::row).collect(),
        };
        Ok((CpuStorage::F32(sums), Shape::from(outer)))
    }
}

/// The index of each row's largest value (`i32`), for a contiguous f32 tensor over its last
/// dim: the greedy sampler's argmax over the vocabulary.
///
/// The first index of the largest value, a NaN counting as the largest (the first NaN's
/// index), as `torch.argmax`, numpy and XLA's lowering here (`hlo::emit`) answer. candle's
/// `argmax` walked each row one compare-and-branch at a time (0.35 ms of a batch-8 step at
/// 32,000 tokens) and passed NaNs over; here the largest value is found sixteen lanes at a
/// time, with whether any lane saw a NaN, then its first index: 0.12 ms there.
pub(crate) struct RowArgMax;

impl RowArgMax {
    fn row(row: &[f32]) -> i32 {
        let Some(&first) = row.first() else {
            return 0;
        };
        let mut lanes = [first; SUM_LANES];
        let mut nan = [false; SUM_LANES];
        let mut chunks = row.chunks_exact(SUM_LANES);
        for c in &mut chunks {
            for ((m, n), &v) in lanes.iter_mut().zip(&mut nan).zip(c) {
                *m = if v > *m { v } else { *m };
                *n |= v.is_nan();
            }
        }
        let rest = chunks.remainder();
        let any_nan = first.is_nan() || nan.contains(&true) || rest.iter().any(|v| v.is_nan());
        let found = if any_nan {
            row.iter().position(|v| v.is_nan())
        } else {
            let largest = rest
                .iter()
                .chain(&lanes)
                .fold(first, |m, &v| if v > m { v } else { m });
            row.iter().position(|&v| v == largest)
        };
        found.map_or(0, |i| i as i32)
    }
}

impl CustomOp1 for RowArgMax {
    fn name(&self) -> &'static str {
        "row-argmax"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (data, n, outer) = f32_rows(self.name(), x, l)?;
        if n == 0 {
            return Err(candle_core::Error::Msg("row-argmax of empty rows".into()));
        }
        let index = data.chunks_exact(n).map(Self::row).collect();
        Ok((CpuStorage::I32(index), Shape::from(outer)))
    }
}

/// The sum of a contiguous f32 tensor over one dim that is not its last: for each outer index,
/// the dim's inner rows added element by element, in order (the first row to a zero).
///
/// The graph's MoE adds each token's weighted experts this way (`[tokens, top_k, hidden]` over
/// `top_k`). candle reduces a middle dim through its generic strided loop: 0.19 ms a node for
/// `[8, 6, 1024]`, 0.95 ms of a batch-8 step on the medium model (benches/LOG.md, "Step
/// overhead outside the matmuls"); adding whole rows is a few microseconds.
pub(crate) struct AxisSum {
    /// The dim summed over (not the last).
    pub dim: usize,
}

impl CustomOp1 for AxisSum {
    fn name(&self) -> &'static str {
        "axis-sum"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.dims();
        let (CpuStorage::F32(data), Some((start, end)), true) =
            (x, l.contiguous_offsets(), self.dim + 1 < dims.len())
        else {
            return Err(candle_core::Error::Msg(
                "axis-sum needs a contiguous f32 tensor and a dim before its last".into(),
            ));
        };
        let (n, inner) = (
            dims[self.dim],
            dims[self.dim + 1..].iter().product::<usize>(),
        );
        let outer: usize = dims[..self.dim].iter().product();
        let data = &data[start..end];
        let mut sums = vec![0f32; outer * inner];
        if inner > 0 {
            for (block, out) in data
                .chunks_exact(n * inner)
                .zip(sums.chunks_exact_mut(inner))
            {
                for row in block.chunks_exact(inner) {
                    out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
                }
            }
        }
        let mut shape = dims.to_vec();
        shape.remove(self.dim);
        Ok((CpuStorage::F32(sums), Shape::from(shape)))
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

/// An integer sum over one dimension that wraps on overflow, as HLO's integer `add` does.
/// candle sums integers with `+`, which panics on overflow where overflow checks are on (debug
/// and test builds) and wraps only in release builds: a graph's result must not depend on the
/// build profile.
pub(crate) struct IntSum {
    /// The dimension summed away.
    pub dim: usize,
}

impl IntSum {
    fn apply<T: WrappingInt + Default>(&self, data: &[T], l: &Layout) -> Vec<T> {
        // A contiguous operand (the usual case) is read where it is, not copied.
        let owned;
        let values: &[T] = match IntOperand::new(data, l) {
            IntOperand::Slice(s) => s,
            other => {
                owned = other.into_vec(l.shape().elem_count());
                &owned
            }
        };
        let dims = l.dims();
        let n = dims[self.dim];
        let inner: usize = dims[self.dim + 1..].iter().product();
        let outer: usize = dims[..self.dim].iter().product();
        let mut out = vec![T::default(); outer * inner];
        for o in 0..outer {
            for k in 0..n {
                let row = &values[(o * n + k) * inner..][..inner];
                let acc = &mut out[o * inner..][..inner];
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a = T::apply(BinaryOp::Add, *a, v);
                }
            }
        }
        out
    }
}

impl CustomOp1 for IntSum {
    fn name(&self) -> &'static str {
        "int-sum"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        if self.dim >= l.dims().len() {
            return Err(candle_core::Error::Msg(format!(
                "int-sum over dim {} of a rank-{} value",
                self.dim,
                l.dims().len()
            )));
        }
        let out = match x {
            CpuStorage::I32(v) => CpuStorage::I32(self.apply(v, l)),
            CpuStorage::U32(v) => CpuStorage::U32(self.apply(v, l)),
            x => {
                return Err(candle_core::Error::Msg(format!(
                    "int-sum of {:?}",
                    x.dtype()
                )))
            }
        };
        let mut dims = l.dims().to_vec();
        dims.remove(self.dim);
        Ok((out, Shape::from(dims)))
    }
}

/// An operand of [`IntBinary`] as stored: contiguous, one value broadcast everywhere (a
/// constant, the common case), or anything else (gathered through its layout).
enum IntOperand<'a, T> {
    Slice(&'a [T]),
    Scalar(T),
    Owned(Vec<T>),
}

impl<'a, T: Copy> IntOperand<'a, T> {
    fn new(data: &'a [T], l: &Layout) -> Self {
        if let Some((start, end)) = l.contiguous_offsets() {
            return IntOperand::Slice(&data[start..end]);
        }
        if l.stride().iter().all(|&s| s == 0) {
            return IntOperand::Scalar(data[l.start_offset()]);
        }
        IntOperand::Owned(strided_offsets(l).into_iter().map(|i| data[i]).collect())
    }
}

/// The storage offset of every element of `l`, in row-major order.
fn strided_offsets(l: &Layout) -> Vec<usize> {
    let (dims, stride) = (l.dims(), l.stride());
    let n = l.shape().elem_count();
    let mut out = Vec::with_capacity(n);
    let mut index = vec![0usize; dims.len()];
    let mut offset = l.start_offset();
    for _ in 0..n {
        out.push(offset);
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            offset += stride[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= stride[d] * dims[d];
            index[d] = 0;
        }
    }
    out
}

/// [`int_binary`] on candle storage, reading operands in place (no copy of a contiguous or
/// broadcast-constant operand): the sampler's hashing runs several of these over the whole
/// vocabulary every step.
pub(crate) struct IntBinary(pub BinaryOp);

impl IntBinary {
    fn apply<T: WrappingInt>(&self, a: &[T], al: &Layout, b: &[T], bl: &Layout) -> Vec<T> {
        let op = self.0;
        match (IntOperand::new(a, al), IntOperand::new(b, bl)) {
            (IntOperand::Scalar(x), IntOperand::Scalar(y)) => {
                vec![T::apply(op, x, y); al.shape().elem_count()]
            }
            (IntOperand::Scalar(x), IntOperand::Slice(y)) => {
                y.iter().map(|&y| T::apply(op, x, y)).collect()
            }
            (IntOperand::Slice(x), IntOperand::Scalar(y)) => {
                x.iter().map(|&x| T::apply(op, x, y)).collect()
            }
            (x, y) => {
                let x = x.into_vec(al.shape().elem_count());
                let y = y.into_vec(bl.shape().elem_count());
                int_binary(op, &x, &y)
            }
        }
    }
}

impl<T: Copy> IntOperand<'_, T> {
    fn into_vec(self, n: usize) -> Vec<T> {
        match self {
            IntOperand::Slice(s) => s.to_vec(),
            IntOperand::Scalar(v) => vec![v; n],
            IntOperand::Owned(v) => v,
        }
    }
}

impl CustomOp2 for IntBinary {
    fn name(&self) -> &'static str {
        "int-binary"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if al.shape() != bl.shape() {
            return Err(candle_core::Error::Msg("int-binary shape mismatch".into()));
        }
        let out = match (a, b) {
            (CpuStorage::I32(x), CpuStorage::I32(y)) => CpuStorage::I32(self.apply(x, al, y, bl)),
            (CpuStorage::U32(x), CpuStorage::U32(y)) => CpuStorage::U32(self.apply(x, al, y, bl)),
            (x, y) => {
                return Err(candle_core::Error::Msg(format!(
                    "int-binary of {:?} and {:?}",
                    x.dtype(),
                    y.dtype()
                )))
            }
        };
        Ok((out, al.shape().clone()))
    }
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
    fn a_row_sum_ignores_trailing_zeros_bit_for_bit() {
        // Values of mixed magnitude, so the order of the additions shows in the bits.
        let values: Vec<f32> = (0..100)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 + if i % 3 == 0 { 1e4 } else { 0.0 })
            .collect();
        for len in 1..values.len() {
            let row = &values[..len];
            let exact: f64 = row.iter().map(|&v| f64::from(v)).sum();
            let sum = RowSum::row(row);
            assert!(
                (f64::from(sum) - exact).abs() <= exact.abs() * 1e-6,
                "{len}: {sum} vs {exact}"
            );
            for pad in [1, 15, 16, 17, 48, 300] {
                let mut padded = row.to_vec();
                padded.resize(len + pad, 0.0);
                assert_eq!(
                    RowSum::row(&padded).to_bits(),
                    sum.to_bits(),
                    "{len} + {pad} zeros"
                );
            }
        }
    }

    /// Rows of a column slice (a layer's view of a cache root), gathered on one thread and on
    /// the pool, against candle's `index_select` of the same view made contiguous.
    #[test]
    fn a_row_gather_matches_index_select_small_and_large() {
        use candle_core::{DType, Device, Tensor};
        let (rows, width) = (700usize, 4 * 96);
        let root = Tensor::arange(0f32, (rows * width) as f32, &Device::Cpu)
            .and_then(|t| t.reshape((rows, width)))
            .expect("root");
        for dtype in [DType::F32, DType::BF16] {
            let view = root
                .to_dtype(dtype)
                .and_then(|t| t.narrow(1, 96, 96))
                .expect("view");
            // 10 rows stay on the caller; 900 rows (86,400 values) go to the pool.
            for n in [10usize, 900] {
                let ids: Vec<u32> = (0..n).map(|i| ((i * 7919) % rows) as u32).collect();
                let ids = Tensor::new(ids.as_slice(), &Device::Cpu).expect("ids");
                let got = view.apply_op2_no_bwd(&ids, &RowGather).expect("gather");
                let want = view
                    .contiguous()
                    .and_then(|v| v.index_select(&ids, 0))
                    .expect("index_select");
                let flat = |t: &Tensor| {
                    t.to_dtype(DType::F32)
                        .and_then(|t| t.flatten_all())
                        .and_then(|t| t.to_vec1::<f32>())
                        .expect("values")
                };
                assert_eq!(got.dims(), want.dims(), "{dtype:?}, {n} rows");
                assert_eq!(flat(&got), flat(&want), "{dtype:?}, {n} rows");
            }
        }
    }

    /// candle's answer where a row has no NaN; the first NaN's index where it has one (what
    /// `torch.argmax` and numpy return, and candle does not: it skips NaNs).
    #[test]
    fn a_row_argmax_agrees_with_candles_and_a_nan_wins() {
        let mut rows: Vec<Vec<f32>> = vec![
            vec![1.0],
            vec![f32::NEG_INFINITY; 37],
            vec![f32::NAN, 3.0, 5.0],
            vec![0.0, -0.0, 0.0],
            vec![-0.0, 0.0],
        ];
        for len in [15, 16, 17, 33, 100, 1000] {
            // Ties on purpose: values repeat every 97 positions.
            let mut row: Vec<f32> = (0..len).map(|i| ((i * 7919) % 97) as f32 - 40.0).collect();
            rows.push(row.clone());
            row[len / 2] = f32::NAN;
            row[len - 1] = f32::INFINITY;
            rows.push(row);
        }
        for row in rows {
            let x =
                candle_core::Tensor::from_vec(row.clone(), row.len(), &candle_core::Device::Cpu)
                    .expect("tensor");
            let want = match row.iter().position(|v| v.is_nan()) {
                Some(first_nan) => first_nan as u32,
                None => x
                    .argmax(0)
                    .and_then(|t| t.to_scalar::<u32>())
                    .expect("argmax"),
            };
            let got = x
                .unsqueeze(0)
                .and_then(|t| t.apply_op1_no_bwd(&RowArgMax))
                .and_then(|t| t.to_vec1::<i32>())
                .expect("row-argmax");
            assert_eq!(got, [want as i32], "{row:?}");
        }
    }

    #[test]
    fn an_axis_sum_adds_every_dim_before_the_last() {
        let dims = [3usize, 5, 4, 7];
        let values: Vec<f32> = (0..dims.iter().product::<usize>())
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-2 - 5.0)
            .collect();
        let x = candle_core::Tensor::from_vec(values.clone(), &dims[..], &candle_core::Device::Cpu)
            .expect("tensor");
        for dim in 0..dims.len() - 1 {
            let got = x.apply_op1_no_bwd(&AxisSum { dim }).expect("axis-sum");
            let mut want_dims = dims.to_vec();
            want_dims.remove(dim);
            assert_eq!(got.dims(), &want_dims[..], "dim {dim}");
            let got = got
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values");
            // Output (o, i) in the order of `want_dims` sums values (o, j, i) over j.
            let (outer, n) = (dims[..dim].iter().product::<usize>(), dims[dim]);
            let inner: usize = dims[dim + 1..].iter().product();
            for o in 0..outer {
                for i in 0..inner {
                    let exact: f64 = (0..n)
                        .map(|j| f64::from(values[(o * n + j) * inner + i]))
                        .sum();
                    let g = f64::from(got[o * inner + i]);
                    assert!(
                        (g - exact).abs() < 1e-4,
                        "dim {dim} at ({o}, {i}): {g} vs {exact}"
                    );
                }
            }
        }
        assert!(
            x.apply_op1_no_bwd(&AxisSum { dim: 3 }).is_err(),
            "the last dim is RowSum's"
        );
    }

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

    /// The in-place int op agrees with the slice op for contiguous, broadcast-constant and
    /// transposed operands.
    #[test]
    fn int_binary_reads_every_layout() {
        use candle_core::{Device, Tensor};
        let dev = &Device::Cpu;
        let a = Tensor::from_vec(
            (0..12u32)
                .map(|v| v.wrapping_mul(0x9E37_79B9))
                .collect::<Vec<_>>(),
            (3, 4),
            dev,
        )
        .unwrap();
        let c = Tensor::new(7u32, dev)
            .unwrap()
            .broadcast_as((3, 4))
            .unwrap();
        let t = Tensor::from_vec((0..12u32).collect::<Vec<_>>(), (4, 3), dev)
            .unwrap()
            .t()
            .unwrap();
        let flat = |x: &Tensor| {
            x.contiguous()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<u32>()
                .unwrap()
        };
        for op in [
            BinaryOp::Mul,
            BinaryOp::Shr,
            BinaryOp::BitXor,
            BinaryOp::Add,
        ] {
            for (x, y) in [(&a, &c), (&c, &a), (&a, &t), (&t, &c), (&c, &c)] {
                let got = x.apply_op2_no_bwd(y, &IntBinary(op)).unwrap();
                assert_eq!(flat(&got), int_binary(op, &flat(x), &flat(y)), "{op:?}");
            }
        }
    }
}
