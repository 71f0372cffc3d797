//! The widening matmul: bf16 / f16 / f8 / f32 operands (int8 with per-column scales), f32
//! accumulation and result.
//!
//! The model multiplies in f32 and holds weights and the cache in bf16 (`model::precision`):
//! the graph says `matmul(x, convert_f32(w))`. Executed literally, the convert would copy a
//! whole weight (tens of MB) to f32 on every call, as candle's own bf16 matmul also does. Here
//! the matmul reads the bf16 values and widens them as it goes: each weight row (an output
//! column) is read once per call, in place by the packed dot (`packed.rs`, f32 and bf16) or
//! widened into a `k`-float buffer that stays in L1, and serves every left row. Decode is bound
//! by reading the weights, so reading half the bytes is the point.
//!
//! Every left-operand row count takes the same kernels, whose sum for one output adds the same
//! products in the same order whatever the other rows: a row's result does not depend on its
//! batch (`tests/batch_invariance.rs`). A prefill chunk packed with other prompts therefore
//! gives each prompt the bits it gets alone. Handing prefill-sized operands to candle's f32
//! GEMM, as this kernel once did from 64 rows, broke that (its blocking sums in another
//! order) and was no faster: on `benches/prefill.rs` a 64-token chunk took 163 / 170 ms in
//! f32 / bf16 through the GEMM against 142 / 119 here (benches/README.md).
//!
//! Layouts: `b` is `[.., k, n]` with any strides. The weight of a linear layer arrives as the
//! transposed view of its `[n, k]` rows (`k` contiguous); a slice of `kv_b_proj` arrives with
//! `n` contiguous; both are read in their own order, never copied whole.

use super::packed::{dots, panel_dots, Packed, Panels, SplitRows, PANEL, PANEL_COLS};
use super::pool::{for_each_chunk, parallel_map};
use candle_core::{backend::BackendStorage, CpuStorage, CustomOp2, CustomOp3, Layout, Shape};
use pulp::{Arch, Simd, WithSimd};

use crate::graph::FourBit;

/// The most output columns (weight rows) a parallel task takes ([`column_tile`]). A task reads
/// its weight rows as one stream, and each costs the pool a hand-off (and a gathered-expert
/// task its result buffer): 128 made decode steps 4-8% faster than 32 on the medium checkpoint
/// (f32 and bf16, batch 1 and 8; 256 was no faster, benches/LOG.md, "Wider matmul tasks").
const TILE: usize = 128;

/// Output columns per task of [`run`] for `columns` columns on `threads` threads: at most
/// [`TILE`], in a number of tasks that the threads share evenly. With tasks of [`TILE`], a
/// product of 384 columns (the medium model's `q_a_proj`) made three tasks, so one thread read
/// two thirds of its weights while the other waited, and a router of 64 columns one task on one
/// thread: four tasks of 96 and two of 32 took about 60 us off each of their 425 and 115 us a
/// batch-1 f32 step (benches/LOG.md, "Tasks the threads share evenly"). Every column runs
/// the same kernel whatever its task, so the bits do not change.
fn column_tile(columns: usize, threads: usize) -> usize {
    let tasks = columns.div_ceil(TILE).next_multiple_of(threads.max(1));
    columns.div_ceil(tasks.max(1)).max(1)
}

/// The threads that run [`run`]'s tasks: candle's pool workers and the calling thread.
fn pool_threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// Weight values per task of the gathered experts ([`expert_tile`]).
const EXPERT_TASK_VALUES: usize = 256 * 1024;

/// Output columns (weight rows, `k` values each) per task of [`gathered`]: at least [`TILE`],
/// and as many more as make [`EXPERT_TASK_VALUES`], up to the whole expert. A task starts a
/// new weight stream at another expert's address and costs a result buffer and a hand-off;
/// the medium model's down projections (`k` 256) made tasks of 64 KB at 128 rows, and whole
/// experts a task took the gathered experts from 12.0-12.3 to 11.1-11.5 ms a batch-8 bf16
/// step, and 2.2-2.3 to 1.9-2.1 ms at batch 1 (benches/LOG.md, "Whole experts a task").
/// Larger models' experts (`k` 2,048 and up) keep 128-row tasks.
fn expert_tile(k: usize, out_n: usize) -> usize {
    (EXPERT_TASK_VALUES / k.max(1)).clamp(TILE, out_n.max(TILE))
}

/// Left rows from which the packed dot takes them in panels ([`Panels`]). Fewer go in the split
/// layout, a row at a time: a panel takes the room of eight rows in L1 whatever the count
/// (zeros included), and a weight vector shared by one to three rows saves little.
const PANEL_MIN_ROWS: usize = 4;

/// An element the kernel can widen to f32 (and, where [`Packed`] says so, read in place).
trait Widen: Packed + Send + Sync {
    fn widen(self) -> f32;

    /// `out[i] = dot(left[i], row) * scale` for a contiguous weight row and up to
    /// [`FUSED_ROWS`] left rows, reading the row in place, where the type and the CPU have such
    /// a kernel; `false` (nothing written) where not, and the caller widens the row.
    #[inline(always)]
    fn fused_dots(_row: &[Self], _scale: f32, _left: &[&[f32]], _out: &mut [f32]) -> bool {
        false
    }

    /// The values themselves when they already are f32 (read in place, nothing widened).
    #[inline(always)]
    fn as_f32(_values: &[Self]) -> Option<&[f32]> {
        None
    }

    /// Appends `row` widened to f32, each value times `scale` when given.
    #[inline(always)]
    fn widen_row(row: &[Self], scale: Option<f32>, out: &mut Vec<f32>) {
        widen_scaled(row.iter().copied(), scale, out);
    }
}

/// Appends `values` widened to f32, each times `scale` when given: the one generic widening
/// loop ([`Widen::widen_row`] and the strided columns of [`push_widened`]).
#[inline(always)]
fn widen_scaled<T: Widen>(values: impl Iterator<Item = T>, scale: Option<f32>, out: &mut Vec<f32>) {
    let from = out.len();
    out.extend(values.map(T::widen));
    if let Some(s) = scale {
        out[from..].iter_mut().for_each(|v| *v *= s);
    }
}

impl Widen for f32 {
    fn widen(self) -> f32 {
        self
    }

    fn as_f32(values: &[Self]) -> Option<&[f32]> {
        Some(values)
    }
}

impl Widen for half::bf16 {
    fn widen(self) -> f32 {
        // A bf16 is the top half of an f32 (exact, NaN payloads included); a plain shift,
        // unlike `to_f32`'s NaN branch, vectorizes.
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

impl Widen for half::f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Widen for float8::F8E4M3 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Widen for i8 {
    fn widen(self) -> f32 {
        f32::from(self)
    }

    /// With AVX-512: sixteen codes at a time sign-extended and converted in registers, each
    /// vector feeding every left row's FMA, the scale applied once to each sum. Widening the
    /// row into a buffer first stored and reloaded every value: the int8 experts took 10.7
    /// ms a batch-8 step that way and 8.6 ms this way (benches/LOG.md, "Two weight rows at
    /// a time, prefetched").
    #[inline(always)]
    fn fused_dots(row: &[Self], scale: f32, left: &[&[f32]], out: &mut [f32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Some(simd) = pulp::x86::V4::try_new() {
            let rows = match left.len() {
                1 => int8_dots_into::<1>(simd, row, left, out),
                2 => int8_dots_into::<2>(simd, row, left, out),
                3 => int8_dots_into::<3>(simd, row, left, out),
                4 => int8_dots_into::<4>(simd, row, left, out),
                _ => return false,
            };
            out[..rows].iter_mut().for_each(|o| *o *= scale);
            return true;
        }
        let _ = (row, scale, left, out);
        false
    }

    /// Where [`Widen::fused_dots`] does not run (a weight column that is not contiguous). With
    /// AVX-512, sixteen codes at a time by the CPU's own sign extension and convert, the scale
    /// applied in the same pass, the weight stream prefetched: the portable `Simd` trait has no
    /// byte-to-float convert, and the generic loop (widen, then scale in a second pass) took
    /// 15.1 ms of a batch-8 step where this took 12.5 (benches/LOG.md, "Two weight rows at a
    /// time, prefetched").
    #[inline(always)]
    fn widen_row(row: &[Self], scale: Option<f32>, out: &mut Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if let Some(simd) = pulp::x86::V4::try_new() {
            return simd.vectorize(|| widen_int8_avx512(simd, row, scale.unwrap_or(1.0), out));
        }
        widen_scaled(row.iter().copied(), scale, out);
    }
}

/// The most left rows one call of [`Widen::fused_dots`] takes: its accumulators, two a row,
/// stay in registers. More rows go in groups of this many; each row's arithmetic is its own,
/// so its product is the same in any group (a request's tokens must not depend on the batch).
const FUSED_ROWS: usize = 4;

/// `out[r] = dot(left[r], row)` for `R` left rows (`left.len()`) by [`int8_dots_avx512`];
/// returns `R`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn int8_dots_into<const R: usize>(
    simd: pulp::x86::V4,
    row: &[i8],
    left: &[&[f32]],
    out: &mut [f32],
) -> usize {
    let left: [&[f32]; R] = std::array::from_fn(|r| left[r]);
    out[..R].copy_from_slice(&simd.vectorize(|| int8_dots_avx512(simd, row, left)));
    R
}

/// `dot(left[r], row)` for each left row, the int8 codes converted sixteen at a time in
/// registers (see [`Widen::fused_dots`] for `i8`); two accumulators a row hide the FMA latency.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn int8_dots_avx512<const R: usize>(
    simd: pulp::x86::V4,
    row: &[i8],
    left: [&[f32]; R],
) -> [f32; R] {
    use core::arch::x86_64::__m512;
    use pulp::Simd;
    let fetch = super::packed::Prefetch::new();
    let f = simd.avx512f;
    let zero = f._mm512_setzero_ps();
    let mut acc = [[zero; 2]; R];
    let (codes, tail) = row.as_chunks::<16>();
    let mut xs = [&[][..]; R];
    for r in 0..R {
        xs[r] = left[r].as_chunks::<16>().0;
    }
    let widen = |c: [i8; 16]| f._mm512_cvtepi32_ps(f._mm512_cvtepi8_epi32(pulp::cast(c)));
    for t in 0..codes.len() / 2 {
        let (i, j) = (2 * t, 2 * t + 1);
        if t % 2 == 0 {
            fetch.ahead::<{ super::packed::PREFETCH_ONE_ROW }, _>(&row[i * 16..]);
        }
        let (wi, wj) = (widen(codes[i]), widen(codes[j]));
        for r in 0..R {
            acc[r][0] = f._mm512_fmadd_ps(pulp::cast(xs[r][i]), wi, acc[r][0]);
            acc[r][1] = f._mm512_fmadd_ps(pulp::cast(xs[r][j]), wj, acc[r][1]);
        }
    }
    if codes.len() % 2 == 1 {
        let i = codes.len() - 1;
        let wi = widen(codes[i]);
        for r in 0..R {
            acc[r][0] = f._mm512_fmadd_ps(pulp::cast(xs[r][i]), wi, acc[r][0]);
        }
    }
    let mut out = [0f32; R];
    let at = codes.len() * 16;
    for r in 0..R {
        let sum: __m512 = f._mm512_add_ps(acc[r][0], acc[r][1]);
        let tail_sum: f32 = tail
            .iter()
            .zip(&left[r][at..])
            .map(|(&q, &x)| f32::from(q) * x)
            .sum();
        out[r] = simd.reduce_sum_f32s(pulp::cast(sum)) + tail_sum;
    }
    out
}

/// `out.extend(row[i] as f32 * scale)` in AVX-512 (see [`Widen::widen_row`] for `i8`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn widen_int8_avx512(simd: pulp::x86::V4, row: &[i8], scale: f32, out: &mut Vec<f32>) {
    use core::arch::x86_64::{__m128i, __m512};
    let fetch = super::packed::Prefetch::new();
    let s = simd.avx512f._mm512_set1_ps(scale);
    let from = out.len();
    out.resize(from + row.len(), 0.0);
    let (chunks, tail) = row.as_chunks::<16>();
    let (dst, dst_tail) = out[from..].as_chunks_mut::<16>();
    for (i, (&codes, dst)) in chunks.iter().zip(dst).enumerate() {
        if i % 4 == 0 {
            fetch.ahead::<{ super::packed::PREFETCH_ONE_ROW }, _>(&row[i * 16..]);
        }
        let codes: __m128i = pulp::cast(codes);
        let wide = simd.avx512f._mm512_cvtepi8_epi32(codes);
        let v: __m512 = simd
            .avx512f
            ._mm512_mul_ps(simd.avx512f._mm512_cvtepi32_ps(wide), s);
        *dst = pulp::cast(v);
    }
    for (d, &v) in dst_tail.iter_mut().zip(tail) {
        *d = f32::from(v) * scale;
    }
}

/// `[.., m, k] x [.., k, n] -> [.., m, n]` in f32 for float operands of any (equal or not)
/// dtypes.
pub(crate) struct WidenMatMul;

/// The shape and strides of one operand, split into batch and matrix parts.
struct Operand<'a> {
    layout: &'a Layout,
    batch: Vec<usize>,
    rows: usize,
    cols: usize,
}

impl<'a> Operand<'a> {
    fn new(layout: &'a Layout) -> candle_core::Result<Self> {
        let dims = layout.dims();
        if dims.len() < 2 {
            return Err(candle_core::Error::Msg("matmul operand of rank < 2".into()));
        }
        let r = dims.len();
        Ok(Operand {
            layout,
            batch: dims[..r - 2].to_vec(),
            rows: dims[r - 2],
            cols: dims[r - 1],
        })
    }

    /// Offset of batch entry `bi` (row-major over the batch dims).
    fn batch_offset(&self, mut bi: usize) -> usize {
        let stride = self.layout.stride();
        let mut off = self.layout.start_offset();
        for d in (0..self.batch.len()).rev() {
            off += (bi % self.batch[d]) * stride[d];
            bi /= self.batch[d];
        }
        off
    }

    /// Strides of the matrix dims `(rows, cols)`.
    fn strides(&self) -> (usize, usize) {
        let s = self.layout.stride();
        (s[s.len() - 2], s[s.len() - 1])
    }
}

/// The left operand widened to a contiguous f32 `[batch, m, k]`.
fn widen_all<T: Widen>(data: &[T], op: &Operand) -> Vec<f32> {
    let batch: usize = op.batch.iter().product();
    let (sr, sc) = op.strides();
    let mut out = Vec::with_capacity(batch * op.rows * op.cols);
    for bi in 0..batch {
        let base = op.batch_offset(bi);
        for r in 0..op.rows {
            let row = base + r * sr;
            if sc == 1 {
                out.extend(data[row..row + op.cols].iter().map(|v| v.widen()));
            } else {
                out.extend((0..op.cols).map(|c| data[row + c * sc].widen()));
            }
        }
    }
    out
}

/// Appends the `k` values of one weight column (an output column: from `at`, `sk` apart)
/// widened to f32, each times `scale` when given (int8 weights: `q as f32 * scale`, the
/// graph's dequantization in the same f32 arithmetic).
#[inline(always)]
fn push_widened<T: Widen>(
    out: &mut Vec<f32>,
    b: &[T],
    (at, k, sk): (usize, usize, usize),
    scale: Option<f32>,
) {
    if sk == 1 {
        return T::widen_row(&b[at..at + k], scale, out);
    }
    widen_scaled((0..k).map(|kk| b[at + kk * sk]), scale, out);
}

/// Weight column `(at, k, sk)` as lanes of `T` for the packed dot: in place when it is
/// contiguous and 4-byte aligned, else packed into `buf`. Both give the same values in the same
/// lanes, so a product is bit for bit the same whatever the weight's layout or alignment.
#[inline(always)]
fn column_lanes<'a, T: Widen>(
    b: &'a [T],
    (at, k, sk): (usize, usize, usize),
    buf: &'a mut Vec<u32>,
) -> &'a [u32] {
    if sk == 1 {
        if let Some(lanes) = T::as_lanes(&b[at..at + k]) {
            return lanes;
        }
    }
    buf.clear();
    T::pack((0..k).map(|kk| b[at + kk * sk]), buf);
    buf
}

/// Per-task buffers: a weight column widened to f32, or weight columns packed into lanes (as
/// many as the panel kernel takes at once).
#[derive(Default)]
struct Scratch {
    widened: Vec<f32>,
    lanes: [Vec<u32>; PANEL_COLS],
}

/// `put(i, dot(a[r], column))` for the `i`-th left row `r` of `rows` (rows of `a`, `k` long, or
/// of `split`, the same rows in the packed layout), where the column is weight column `col`
/// times `scale`: by the packed dot when `split` is given, else widened into `scratch`. Both
/// matmul kernels multiply a column this way.
#[inline(always)]
fn column_dots<S: Simd, T: Widen>(
    simd: S,
    (b, col, scale): (&[T], (usize, usize, usize), Option<f32>),
    a: &[f32],
    split: Option<&SplitRows>,
    scratch: &mut Scratch,
    rows: impl Iterator<Item = usize> + Clone,
    mut put: impl FnMut(usize, f32),
) {
    if let Some(split) = split {
        let lanes = column_lanes(b, col, &mut scratch.lanes[0]);
        let s = scale.unwrap_or(1.0);
        return dots::<S, T>(simd, lanes, split, rows, |i, v| put(i, v * s));
    }
    let (at, k, sk) = col;
    if sk == 1 && fused_in_groups(&b[at..at + k], scale, a, rows.clone(), &mut put) {
        return;
    }
    let row = &mut scratch.widened;
    row.clear();
    push_widened(row, b, col, scale);
    for (i, r) in rows.enumerate() {
        put(i, simd_dot(simd, &a[r * k..][..k], row));
    }
}

/// `put(i, dot(a[r], row) * scale)` for the `i`-th left row `r` of `rows`, by
/// [`Widen::fused_dots`] in groups of [`FUSED_ROWS`]; `false` (nothing put) where the type or
/// the CPU has no fused kernel. Every row goes through the same kernel whatever the count, so
/// a row's product does not depend on how many rows chose the weight (see [`FUSED_ROWS`]).
#[inline(always)]
fn fused_in_groups<T: Widen>(
    row: &[T],
    scale: Option<f32>,
    a: &[f32],
    rows: impl Iterator<Item = usize>,
    put: &mut impl FnMut(usize, f32),
) -> bool {
    let k = row.len();
    let mut rows = rows.enumerate().peekable();
    while rows.peek().is_some() {
        let (mut at, mut left, mut n) = ([0; FUSED_ROWS], [&[][..]; FUSED_ROWS], 0);
        for (i, r) in rows.by_ref().take(FUSED_ROWS) {
            (at[n], left[n]) = (i, &a[r * k..][..k]);
            n += 1;
        }
        let mut got = [0f32; FUSED_ROWS];
        if !T::fused_dots(row, scale.unwrap_or(1.0), &left[..n], &mut got[..n]) {
            return false;
        }
        (0..n).for_each(|j| put(at[j], got[j]));
    }
    true
}

/// `put(c, r, dot(row r, column c) * scales[c])` for every left row `r` of `panels` (`rows` in
/// all) and each of the `C` weight columns `ws` (lanes of `T`, one length): the panel kernel's
/// products, shared by both matmul kernels.
#[inline(always)]
fn panel_products<S: Simd, T: Widen, const C: usize>(
    simd: S,
    (ws, scales): ([&[u32]; C], [f32; C]),
    panels: &Panels,
    rows: usize,
    mut put: impl FnMut(usize, usize, f32),
) {
    for p in 0..rows.div_ceil(PANEL) {
        let live = PANEL.min(rows - p * PANEL);
        let got = panel_dots::<S, T, C>(simd, ws, panels, p, live);
        for (c, (got, s)) in got.iter().zip(scales).enumerate() {
            for (r, v) in got[..live].iter().enumerate() {
                put(c, p * PANEL + r, v * s);
            }
        }
    }
}

/// `put(jj, r, dot(row r, column jj) * scale)` for columns `0..columns` through the panel
/// kernel, two at a time where consecutive columns multiply the same panels. `column(jj)` says
/// which panels, where the weight column lies (`(at, k, sk)`) and its scale; `bufs` hold a
/// column's lanes when it cannot be read in place. Both matmul kernels take panels this way.
#[inline(always)]
fn panel_columns<'p, S: Simd, T: Widen>(
    simd: S,
    (b, bufs): (&[T], &mut [Vec<u32>; PANEL_COLS]),
    (rows, columns): (usize, usize),
    column: impl Fn(usize) -> (&'p Panels, (usize, usize, usize), f32),
    mut put: impl FnMut(usize, usize, f32),
) {
    let [l0, l1] = bufs;
    let mut jj = 0;
    while jj < columns {
        let (panels, at, s) = column(jj);
        let w0 = column_lanes(b, at, l0);
        let next = (jj + 1 < columns)
            .then(|| column(jj + 1))
            .filter(|(p, ..)| std::ptr::eq(*p, panels));
        if let Some((_, at1, s1)) = next {
            let w1 = column_lanes(b, at1, l1);
            let ws = ([w0, w1], [s, s1]);
            panel_products::<S, T, 2>(simd, ws, panels, rows, |c, r, v| put(jj + c, r, v));
            jj += 2;
        } else {
            panel_products::<S, T, 1>(simd, ([w0], [s]), panels, rows, |_, r, v| put(jj, r, v));
            jj += 1;
        }
    }
}

/// The left rows in the packed dot's layout, when `T` has one and `k` fits it.
fn split_rows<T: Widen>(a: &[f32], k: usize) -> Option<SplitRows> {
    packs::<T>(k).then(|| SplitRows::new(a, k, T::PER_LANE))
}

/// Whether `T` has a packed dot and rows of `k` fit it (whole lanes).
fn packs<T: Widen>(k: usize) -> bool {
    let p = T::PER_LANE;
    p > 0 && k > 0 && k.is_multiple_of(p)
}

/// `sum(x[i] * y[i])` in the widest vectors the CPU has (pulp picks AVX-512, AVX2+FMA or
/// falls back at run time), with four independent accumulators to hide the FMA latency.
#[inline(always)]
fn simd_dot<S: Simd>(simd: S, x: &[f32], y: &[f32]) -> f32 {
    let (xh, xt) = S::as_simd_f32s(x);
    let (yh, yt) = S::as_simd_f32s(y);
    let mut acc = [simd.splat_f32s(0.0); 4];
    let (xc, yc) = (xh.chunks_exact(4), yh.chunks_exact(4));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for l in 0..4 {
            acc[l] = simd.mul_add_f32s(xs[l], ys[l], acc[l]);
        }
    }
    for (x, y) in xr.iter().zip(yr) {
        acc[0] = simd.mul_add_f32s(*x, *y, acc[0]);
    }
    let sum = simd.add_f32s(simd.add_f32s(acc[0], acc[1]), simd.add_f32s(acc[2], acc[3]));
    simd.reduce_sum_f32s(sum) + xt.iter().zip(yt).map(|(a, b)| a * b).sum::<f32>()
}

/// One parallel task: output columns `g0..` (numbered over batch x n), each column's `m`
/// values into `out` as a tile of `m` rows (`[m, columns]`), copied into place by [`run`].
///
/// Each weight column (a weight row of a linear layer) is read once and multiplied with every
/// left row: by the packed dot where the type has one and `k` fits it (`packed.rs`), else
/// widened once into a `k`-float buffer that stays in L1.
struct Columns<'a, T> {
    a: &'a [f32],
    split: Option<&'a SplitRows>,
    /// The left rows of each batch entry in panels, for the packed dot of many rows.
    panels: Option<&'a [Panels]>,
    b: &'a [T],
    bop: &'a Operand<'a>,
    scales: Option<&'a [f32]>,
    g0: usize,
    m: usize,
    scratch: &'a mut Scratch,
    out: &'a mut [f32],
}

impl<T: Widen> WithSimd for Columns<'_, T> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        if let Some(panels) = self.panels {
            return self.in_panels(simd, panels);
        }
        let (k, n, m) = (self.bop.rows, self.bop.cols, self.m);
        let (sk, sn) = self.bop.strides();
        let columns = self.out.len() / m.max(1);
        for jj in 0..columns {
            let g = self.g0 + jj;
            let (bi, j) = (g / n, g % n);
            let at = self.bop.batch_offset(bi) + j * sn;
            let out = &mut *self.out;
            column_dots(
                simd,
                (self.b, (at, k, sk), self.scales.map(|s| s[bi * n + j])),
                self.a,
                self.split,
                self.scratch,
                bi * m..(bi + 1) * m,
                |i, v| out[i * columns + jj] = v,
            );
        }
    }
}

impl<T: Widen> Columns<'_, T> {
    /// The task's columns through the panel kernel ([`panel_columns`]).
    #[inline(always)]
    fn in_panels<S: Simd>(self, simd: S, panels: &[Panels]) {
        let (k, n, m) = (self.bop.rows, self.bop.cols, self.m);
        let (sk, sn) = self.bop.strides();
        let columns = self.out.len() / m.max(1);
        let column = |jj: usize| {
            let (bi, j) = ((self.g0 + jj) / n, (self.g0 + jj) % n);
            let at = (self.bop.batch_offset(bi) + j * sn, k, sk);
            (&panels[bi], at, self.scales.map_or(1.0, |s| s[bi * n + j]))
        };
        let out = self.out;
        panel_columns::<S, T>(
            simd,
            (self.b, &mut self.scratch.lanes),
            (m, columns),
            column,
            |jj, r, v| out[r * columns + jj] = v,
        );
    }
}

/// Output columns per task of the row-tile kernel ([`RowTile`]).
const ROW_TILE: usize = 64;

/// One parallel task for a `b` whose `n` is contiguous: columns `j0..j0 + tn` of batch entry
/// `bi` for every left row, as `[m, ROW_TILE]` in `out`.
///
/// Each left row accumulates `a[i, kk] * row(kk)` over `kk`, in order, into its `tn` outputs:
/// the layout's own order, where the column kernel would read every value `sk` apart. The
/// tile's `k` rows of `tn` weights are read in place when they are f32 (the attention values
/// of an f32 cache, `sk` apart), else widened once into `wbuf`. Where `tn` is a whole number
/// of vectors that fit the registers (a full 64-column tile), the outputs stay in registers
/// for the whole sum, two rows at a time with AVX-512 ([`row_tile_sums`]): the same FMAs in
/// the same order as the loop over memory kept for other tiles, which reloads and stores every
/// output vector for every `kk` (2.0-2.9x slower on MLA's attention values, benches/LOG.md,
/// "Attention values in registers").
struct RowTile<'a, T> {
    a: &'a [f32],
    b: &'a [T],
    bop: &'a Operand<'a>,
    scales: Option<&'a [f32]>,
    bi: usize,
    j0: usize,
    tn: usize,
    m: usize,
    wbuf: &'a mut Vec<f32>,
    out: &'a mut [f32],
}

impl<T: Widen> WithSimd for RowTile<'_, T> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let (k, n, m, tn) = (self.bop.rows, self.bop.cols, self.m, self.tn);
        let (sk, _) = self.bop.strides();
        let base = self.bop.batch_offset(self.bi) + self.j0;
        let in_place = T::as_f32(self.b).filter(|_| self.scales.is_none());
        let wbuf = self.wbuf;
        if in_place.is_none() {
            wbuf.clear();
            for kk in 0..k {
                let at = base + kk * sk;
                wbuf.extend(self.b[at..at + tn].iter().map(|v| v.widen()));
            }
            if let Some(s) = self.scales {
                let s = &s[self.bi * n + self.j0..][..tn];
                for row in wbuf.chunks_exact_mut(tn) {
                    row.iter_mut().zip(s).for_each(|(w, s)| *w *= s);
                }
            }
        }
        let (rows, first, stride) = match in_place {
            Some(b) => (b, base, sk),
            None => (wbuf.as_slice(), 0, tn),
        };
        let weights = (rows, first, stride);
        let x = |i: usize| &self.a[(self.bi * m + i) * k..][..k];
        let out = self.out;
        // Whole vectors that fit the registers: the sums stay there (two rows at a time when
        // a row takes four vectors, sharing each weight vector's load).
        let vectors = (tn % S::F32_LANES == 0).then_some(tn / S::F32_LANES);
        if let Some(v @ (4 | 8)) = vectors {
            let put = |out: &mut [f32], r: usize, acc: &[S::f32s]| {
                let o = &mut out[r * ROW_TILE..][..tn];
                S::as_mut_simd_f32s(o).0.copy_from_slice(acc);
            };
            let mut i = 0;
            while i < m {
                if v == 4 && i + 1 < m {
                    let acc = row_tile_sums::<S, 4, 2>(simd, [x(i), x(i + 1)], weights);
                    put(out, i, &acc[0]);
                    put(out, i + 1, &acc[1]);
                    i += 2;
                } else if v == 4 {
                    put(out, i, &row_tile_sums::<S, 4, 1>(simd, [x(i)], weights)[0]);
                    i += 1;
                } else {
                    put(out, i, &row_tile_sums::<S, 8, 1>(simd, [x(i)], weights)[0]);
                    i += 1;
                }
            }
            return;
        }
        for i in 0..m {
            let o = &mut out[i * ROW_TILE..][..tn];
            o.fill(0.0);
            let (oh, ot) = S::as_mut_simd_f32s(o);
            for (kk, &xv) in x(i).iter().enumerate() {
                let (wh, wt) = S::as_simd_f32s(&rows[first + kk * stride..][..tn]);
                let xs = simd.splat_f32s(xv);
                for (o, w) in oh.iter_mut().zip(wh) {
                    *o = simd.mul_add_f32s(xs, *w, *o);
                }
                for (o, w) in ot.iter_mut().zip(wt) {
                    *o += xv * w;
                }
            }
        }
    }
}

/// The sums of [`RowTile`] for `R` left rows `x` and `V` whole weight vectors a row
/// (`rows[first + kk * stride..]`), kept in registers: for each `kk` in order, one FMA per
/// vector and row, the same operations in the same order as the loop over memory, so the
/// same bits. Each weight vector is loaded once for the `R` rows.
#[inline(always)]
fn row_tile_sums<S: Simd, const V: usize, const R: usize>(
    simd: S,
    x: [&[f32]; R],
    (rows, first, stride): (&[f32], usize, usize),
) -> [[S::f32s; V]; R] {
    let mut acc = [[simd.splat_f32s(0.0); V]; R];
    for kk in 0..x[0].len() {
        let (wh, _) = S::as_simd_f32s(&rows[first + kk * stride..][..V * S::F32_LANES]);
        for (acc, x) in acc.iter_mut().zip(x) {
            let xs = simd.splat_f32s(x[kk]);
            for (acc, w) in acc.iter_mut().zip(wh) {
                *acc = simd.mul_add_f32s(xs, *w, *acc);
            }
        }
    }
    acc
}

/// Where one task of [`gathered`] works: columns `j0..j0 + tn` of expert `e` (of `out_n`) for
/// the left rows that chose it (each `m` rows of `k`), as `[rows, m, tn]`.
#[derive(Clone, Copy)]
struct ExpertTile<'a> {
    rows: &'a [usize],
    e: usize,
    j0: usize,
    tn: usize,
    m: usize,
    k: usize,
    out_n: usize,
}

impl<'a> ExpertTile<'a> {
    /// The tile of task `(group, j0)` of [`gathered`], whose tasks are `tile` columns wide.
    fn of(
        (g, j0): (usize, usize),
        groups: &'a [(usize, Vec<usize>)],
        (m, k, out_n, tile): (usize, usize, usize, usize),
    ) -> Self {
        ExpertTile {
            rows: &groups[g].1,
            e: groups[g].0,
            j0,
            tn: tile.min(out_n - j0),
            m,
            k,
            out_n,
        }
    }

    /// How many left rows the tile multiplies.
    fn left_rows(&self) -> usize {
        self.rows.len() * self.m
    }

    /// The left rows' indices into the whole left operand, in output order.
    fn left(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        let m = self.m;
        self.rows
            .iter()
            .flat_map(move |&r| (0..m).map(move |mi| r * m + mi))
    }

    /// The stacked weight row of the tile's `jj`-th column.
    fn weight_row(&self, jj: usize) -> usize {
        self.e * self.out_n + self.j0 + jj
    }
}

/// One task of [`gathered`] on float or int8 experts.
struct ExpertTask<'a, T> {
    a: &'a [f32],
    split: Option<&'a SplitRows>,
    /// This expert's left rows in panels, when it has [`PANEL_MIN_ROWS`] or more.
    panels: Option<&'a Panels>,
    w: &'a [T],
    scales: Option<&'a [f32]>,
    tile: ExpertTile<'a>,
}

impl<T: Widen> WithSimd for ExpertTask<'_, T> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> Vec<f32> {
        let tile = self.tile;
        let (k, tn, left) = (tile.k, tile.tn, tile.left_rows());
        let mut res = vec![0f32; left * tn];
        let mut scratch = Scratch::default();
        if let Some(panels) = self.panels {
            let column = |jj: usize| {
                let j = tile.weight_row(jj);
                (panels, (j * k, k, 1), self.scales.map_or(1.0, |s| s[j]))
            };
            panel_columns::<S, T>(
                simd,
                (self.w, &mut scratch.lanes),
                (left, tn),
                column,
                |jj, r, v| res[r * tn + jj] = v,
            );
            return res;
        }
        for jj in 0..tn {
            let j = tile.weight_row(jj);
            column_dots(
                simd,
                (self.w, (j * k, k, 1), self.scales.map(|s| s[j])),
                self.a,
                self.split,
                &mut scratch,
                tile.left(),
                |i, v| res[i * tn + jj] = v,
            );
        }
        res
    }
}

/// One task of [`gathered`] on 4-bit experts: as [`ExpertTask`], each weight row widened from
/// its packed codes and group scales (`four_bit::widen_row`) and dotted with the left rows.
struct FourBitExpertTask<'a> {
    a: &'a [f32],
    codes: &'a [u8],
    scales: &'a [f32],
    group: usize,
    format: FourBit,
    tile: ExpertTile<'a>,
}

impl WithSimd for FourBitExpertTask<'_> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> Vec<f32> {
        let tile = self.tile;
        let (k, tn) = (tile.k, tile.tn);
        let (half, groups) = (k / 2, k.div_ceil(self.group));
        let mut res = vec![0f32; tile.left_rows() * tn];
        let mut row = Vec::with_capacity(k);
        for jj in 0..tn {
            let j = tile.weight_row(jj);
            row.clear();
            super::four_bit::widen_row(
                &self.codes[j * half..(j + 1) * half],
                &self.scales[j * groups..(j + 1) * groups],
                self.group,
                self.format,
                &mut row,
            );
            for (i, r) in tile.left().enumerate() {
                res[i * tn + jj] = simd_dot(simd, &self.a[r * k..][..k], &row);
            }
        }
        res
    }
}

/// How [`gathered`]'s stacked expert weights hold their values.
#[derive(Clone, Copy)]
pub(crate) enum Experts<'a> {
    /// Floats of any dtype, `[experts, out, k]`.
    Float,
    /// int8 codes (held as u8 bytes), `[experts, out, k]`, with one f32 scale per output row
    /// (`[experts, out]`).
    Int8(&'a candle_core::Tensor),
    /// 4-bit codes of a [`FourBit`] format two a byte, `[experts, out, k / 2]`, with one f32
    /// scale per `group` inputs of each output row (`[experts, out, ceil(k / group)]`).
    FourBit(&'a candle_core::Tensor, usize, FourBit),
}

/// `out[i] = a[i] @ w[ids[i]]^T` for `a: [n, m, k]`, stacked contiguous expert weights `w`
/// (see [`Experts`]) and `ids: [n]` (checked by the caller): the gathered MoE matmul without
/// copying a weight. With `ids = 0..experts` it is the dense strategy's matmul too.
///
/// Rows that chose the same expert are multiplied together, so each selected expert's weights
/// are read once per call (as a grouped MoE kernel would), and all (expert, column chunk) pairs
/// run as one parallel loop.
pub(crate) fn gathered(
    a: &candle_core::Tensor,
    w: &candle_core::Tensor,
    ids: &[usize],
    experts: Experts,
) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::{DType, Storage};
    let (n, m, k) = a.dims3()?;
    let (_, out_n, wk) = w.dims3()?;
    let (scales, four_bit) = match experts {
        Experts::Float => (None, None),
        Experts::Int8(s) => (Some(s), None),
        Experts::FourBit(s, group, format) => (Some(s), Some((group, format))),
    };
    let stored_k = if four_bit.is_some() { k / 2 } else { k };
    if wk != stored_k || (four_bit.is_some() && k % 2 == 1) || ids.len() != n {
        return Err(candle_core::Error::Msg(format!(
            "gathered matmul of {:?} by {:?} with {} ids",
            a.dims(),
            w.dims(),
            ids.len()
        )));
    }
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for (i, &e) in ids.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == e) {
            Some((_, rows)) => rows.push(i),
            None => groups.push((e, vec![i])),
        }
    }
    let tile = expert_tile(k, out_n);
    let tasks: Vec<(usize, usize)> = (0..groups.len())
        .flat_map(|g| (0..out_n).step_by(tile).map(move |j0| (g, j0)))
        .collect();
    let (w_st, w_l) = w.storage_and_layout();
    let Some((w0, w1)) = w_l.contiguous_offsets() else {
        return Err(candle_core::Error::Msg(
            "gathered matmul: stacked weights must be contiguous".into(),
        ));
    };
    let scale_guard = scales.map(|s| s.storage_and_layout());
    let scales: Option<&[f32]> = match &scale_guard {
        None => None,
        Some((st, l)) => match (&**st, l.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((s0, s1))) => Some(&v[s0..s1]),
            _ => {
                return Err(candle_core::Error::Msg(
                    "gathered matmul: scales must be contiguous f32".into(),
                ))
            }
        },
    };
    let arch = Arch::new();
    fn all<T: Widen>(
        arch: Arch,
        tasks: &[(usize, usize)],
        groups: &[(usize, Vec<usize>)],
        a: &[f32],
        w: &[T],
        scales: Option<&[f32]>,
        (m, k, out_n, tile): (usize, usize, usize, usize),
    ) -> candle_core::Result<Vec<Vec<f32>>> {
        // An expert chosen by several left rows multiplies them in panels (its rows gathered),
        // the others read the split layout, made only when some expert needs it.
        let in_panels = |rows: &[usize]| packs::<T>(k) && rows.len() * m >= PANEL_MIN_ROWS;
        let panels: Vec<Option<Panels>> = groups
            .iter()
            .map(|(_, rows)| {
                in_panels(rows).then(|| {
                    let left = rows.iter().flat_map(|&r| a[r * m * k..][..m * k].chunks(k));
                    Panels::new(left, k, T::PER_LANE)
                })
            })
            .collect();
        let split = groups
            .iter()
            .any(|(_, rows)| !in_panels(rows))
            .then(|| split_rows::<T>(a, k))
            .flatten();
        parallel_map(tasks.len(), |t| {
            arch.dispatch(ExpertTask {
                a,
                split: split.as_ref(),
                panels: panels[tasks[t].0].as_ref(),
                w,
                scales,
                tile: ExpertTile::of(tasks[t], groups, (m, k, out_n, tile)),
            })
        })
    }
    let dims = (m, k, out_n, tile);
    let Storage::Cpu(w_cpu) = &*w_st else {
        return Err(candle_core::Error::Msg(
            "gathered matmul on a non-CPU tensor".into(),
        ));
    };
    let done = match (w_cpu, scales) {
        (CpuStorage::U8(v), Some(scales)) if four_bit.is_some() => {
            let (group, format) = four_bit.unwrap_or((1, FourBit::Int4));
            let codes = &v[w0..w1];
            parallel_map(tasks.len(), |t| {
                arch.dispatch(FourBitExpertTask {
                    a: &a,
                    codes,
                    scales,
                    group,
                    format,
                    tile: ExpertTile::of(tasks[t], &groups, dims),
                })
            })?
        }
        (CpuStorage::F32(v), _) => all(arch, &tasks, &groups, &a, &v[w0..w1], scales, dims)?,
        (CpuStorage::BF16(v), _) => all(arch, &tasks, &groups, &a, &v[w0..w1], scales, dims)?,
        (CpuStorage::F16(v), _) => all(arch, &tasks, &groups, &a, &v[w0..w1], scales, dims)?,
        (CpuStorage::F8E4M3(v), _) => all(arch, &tasks, &groups, &a, &v[w0..w1], scales, dims)?,
        (CpuStorage::U8(v), Some(_)) => {
            let q: &[i8] = bytemuck::cast_slice(&v[w0..w1]);
            all(arch, &tasks, &groups, &a, q, scales, dims)?
        }
        (other, _) => {
            return Err(candle_core::Error::Msg(format!(
                "gathered matmul of dtype {:?}",
                other.dtype()
            )))
        }
    };
    let mut out = vec![0f32; n * m * out_n];
    for (&(g, j0), res) in tasks.iter().zip(done) {
        let tn = tile.min(out_n - j0);
        for (ri, &r) in groups[g].1.iter().enumerate() {
            for mi in 0..m {
                let at = (r * m + mi) * out_n + j0;
                out[at..at + tn].copy_from_slice(&res[(ri * m + mi) * tn..][..tn]);
            }
        }
    }
    candle_core::Tensor::from_vec(out, (n, m, out_n), &candle_core::Device::Cpu)
}

/// The product of the widened `a` (`[batch, m, k]`) and `b`, with `b`'s column `j` of batch
/// entry `bi` scaled by `scales[bi * n + j]` when given.
fn run<T: Widen>(
    a: &[f32],
    b: &[T],
    bop: &Operand,
    scales: Option<&[f32]>,
    batch: usize,
    m: usize,
) -> candle_core::Result<Vec<f32>> {
    let (k, n) = (bop.rows, bop.cols);
    if batch * m * n == 0 {
        return Ok(Vec::new());
    }
    // The result is appended row by row from the tasks' tiles (never zeroed first).
    let mut out = Vec::new();
    let (sk, sn) = bop.strides();
    if sn == 1 && sk != 1 && n > 1 {
        // `n` contiguous (MLA's absorbed slices of `kv_b_proj`, the latent cache as values):
        // a column would be read `sk` apart, so whole rows of a tile are widened instead.
        let arch = Arch::new();
        let tiles = n.div_ceil(ROW_TILE);
        let mut tiled = vec![0f32; batch * tiles * m * ROW_TILE];
        let scratch = || Vec::with_capacity(k * ROW_TILE);
        for_each_chunk(&mut tiled, m * ROW_TILE, scratch, |wbuf, t, chunk| {
            let (bi, j0) = (t / tiles, (t % tiles) * ROW_TILE);
            arch.dispatch(RowTile {
                a,
                b,
                bop,
                scales,
                bi,
                j0,
                tn: ROW_TILE.min(n - j0),
                m,
                wbuf,
                out: chunk,
            })
        });
        out.reserve_exact(batch * m * n);
        for entry in tiled.chunks_exact(tiles * m * ROW_TILE) {
            for i in 0..m {
                for (t, chunk) in entry.chunks_exact(m * ROW_TILE).enumerate() {
                    let tn = ROW_TILE.min(n - t * ROW_TILE);
                    out.extend_from_slice(&chunk[i * ROW_TILE..][..tn]);
                }
            }
        }
        return Ok(out);
    }
    // Each parallel task's output columns as one contiguous tile of `m` rows (`[m, width]`),
    // copied into place below a row at a time (a no-op for one left row). A column-major
    // buffer transposed value by value cost more than some small matmuls' products.
    let mut tiles = vec![0f32; batch * n * m];
    let width = column_tile(batch * n, pool_threads());
    let arch = Arch::new();
    // The packed dot takes PANEL_MIN_ROWS left rows or more in panels (per batch entry), fewer
    // in the split layout; a type without one, the widening loop.
    let (split, panels) = if m >= PANEL_MIN_ROWS {
        let panels = packs::<T>(k).then(|| {
            a.chunks_exact(m * k)
                .map(|entry| Panels::new(entry.chunks_exact(k), k, T::PER_LANE))
                .collect::<Vec<_>>()
        });
        (None, panels)
    } else {
        (split_rows::<T>(a, k), None)
    };
    for_each_chunk(
        &mut tiles,
        width * m.max(1),
        Scratch::default,
        |scratch, c, chunk| {
            arch.dispatch(Columns {
                a,
                split: split.as_ref(),
                panels: panels.as_deref(),
                b,
                bop,
                scales,
                g0: c * width,
                m,
                scratch,
                out: chunk,
            })
        },
    );
    if m == 1 {
        return Ok(tiles);
    }
    out.reserve_exact(batch * m * n);
    // Row `i` of batch entry `bi` is columns `bi * n..(bi + 1) * n` of the tiles' row `i`:
    // whole tiles, and parts of the first and last where a tile straddles two entries.
    for bi in 0..batch {
        let (g0, g1) = (bi * n, (bi + 1) * n);
        for i in 0..m {
            for c in g0 / width..g1.div_ceil(width) {
                let tile = &tiles[c * width * m..((c + 1) * width).min(batch * n) * m];
                let columns = tile.len() / m;
                let (from, to) = (
                    g0.max(c * width) - c * width,
                    g1.min(c * width + columns) - c * width,
                );
                out.extend_from_slice(&tile[i * columns + from..i * columns + to]);
            }
        }
    }
    Ok(out)
}

/// The left operand as a contiguous f32 `[batch, m, k]`: borrowed when it already is one (a
/// decode step's activations, most of the time), else widened and laid out afresh.
fn widen_lhs<'a>(
    s: &'a CpuStorage,
    op: &Operand,
) -> candle_core::Result<std::borrow::Cow<'a, [f32]>> {
    if let (CpuStorage::F32(v), Some((from, to))) = (s, op.layout.contiguous_offsets()) {
        return Ok(std::borrow::Cow::Borrowed(&v[from..to]));
    }
    Ok(std::borrow::Cow::Owned(match s {
        CpuStorage::F32(v) => widen_all(v, op),
        CpuStorage::BF16(v) => widen_all(v, op),
        CpuStorage::F16(v) => widen_all(v, op),
        CpuStorage::F8E4M3(v) => widen_all(v, op),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "widening matmul of dtype {:?}",
                other.dtype()
            )))
        }
    }))
}

/// The shared body of [`WidenMatMul`] and [`ScaledMatMul`].
fn forward(
    a_s: &CpuStorage,
    a_l: &Layout,
    b_s: &CpuStorage,
    b_l: &Layout,
    scales: Option<&[f32]>,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (aop, bop) = (Operand::new(a_l)?, Operand::new(b_l)?);
    if aop.batch != bop.batch || aop.cols != bop.rows {
        return Err(candle_core::Error::Msg(format!(
            "widening matmul of {:?} and {:?}",
            a_l.dims(),
            b_l.dims()
        )));
    }
    let batch: usize = aop.batch.iter().product();
    let m = aop.rows;
    if scales.is_some_and(|s| s.len() != batch * bop.cols) {
        return Err(candle_core::Error::Msg(
            "scaled matmul: one scale per output column".into(),
        ));
    }
    let a = widen_lhs(a_s, &aop)?;
    let out = match (b_s, scales) {
        (CpuStorage::F32(v), _) => run(&a, v, &bop, scales, batch, m)?,
        (CpuStorage::BF16(v), _) => run(&a, v, &bop, scales, batch, m)?,
        (CpuStorage::F16(v), _) => run(&a, v, &bop, scales, batch, m)?,
        (CpuStorage::F8E4M3(v), _) => run(&a, v, &bop, scales, batch, m)?,
        // int8 weights are held as u8 bytes; only meaningful with their scales.
        (CpuStorage::U8(v), Some(_)) => {
            let q: &[i8] = bytemuck::cast_slice(v);
            run(&a, q, &bop, scales, batch, m)?
        }
        (other, _) => {
            return Err(candle_core::Error::Msg(format!(
                "widening matmul of dtype {:?}",
                other.dtype()
            )))
        }
    };
    let mut dims = aop.batch.clone();
    dims.extend([m, bop.cols]);
    Ok((CpuStorage::F32(out), Shape::from(dims)))
}

impl CustomOp2 for WidenMatMul {
    fn name(&self) -> &'static str {
        "widen-matmul"
    }

    fn cpu_fwd(
        &self,
        a_s: &CpuStorage,
        a_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        forward(a_s, a_l, b_s, b_l, None)
    }
}

/// `a @ dequant(q)` for int8 `q` (`[.., k, n]`, held as u8 bytes) with one f32 scale per output
/// column (`[.., n]`, contiguous): the weight-only int8 experts, dequantized tile by tile.
pub(crate) struct ScaledMatMul;

impl CustomOp3 for ScaledMatMul {
    fn name(&self) -> &'static str {
        "scaled-matmul"
    }

    fn cpu_fwd(
        &self,
        a_s: &CpuStorage,
        a_l: &Layout,
        q_s: &CpuStorage,
        q_l: &Layout,
        s_s: &CpuStorage,
        s_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(s), Some((s0, s1))) = (s_s, s_l.contiguous_offsets()) else {
            return Err(candle_core::Error::Msg(
                "scaled matmul: scales must be contiguous f32".into(),
            ));
        };
        forward(a_s, a_l, q_s, q_l, Some(&s[s0..s1]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff_tensors;
    use candle_core::{DType, Device, Tensor};

    /// The kernel against f64 arithmetic on the widened values, for each layout it reads
    /// (`k`-contiguous weight rows, `n`-contiguous slices, batched) and both row regimes.
    #[test]
    fn matches_f64_reference_on_every_layout() {
        let dev = &Device::Cpu;
        // k = 70, 96 and 200: the packed dot (1 and 3 rows: the split layout; 9 and 17 rows:
        // panels of 8, the last one partial; vector tails at k = 70 and 200); odd k (33, 19):
        // the widening loop, at 40 and 70 rows; n = 130 and 300 with n contiguous: the row-tile
        // kernel's whole 64-column tiles (sums in registers, rows in pairs and one alone; f32
        // read in place, bf16 widened) and its partial ones.
        let shapes = [
            (1, 1, 70, 45),
            (2, 9, 96, 37),
            (1, 3, 70, 45),
            (2, 17, 200, 33),
            (3, 5, 33, 40),
            (1, 40, 19, 300),
            (1, 70, 19, 300),
            (2, 7, 50, 130),
            // 300 columns in tasks of 75 (two threads) or 100 (one or three): tasks that
            // straddle batch entries of 100 or 150 columns.
            (3, 2, 64, 100),
            (3, 5, 64, 100),
            (2, 3, 64, 150),
        ];
        for (&(batch, m, k, n), dtype) in shapes
            .iter()
            .flat_map(|s| [(s, DType::BF16), (s, DType::F32)])
        {
            let a: Vec<f32> = (0..batch * m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                .collect();
            let w: Vec<f32> = (0..batch * n * k)
                .map(|i| ((i * 5 % 17) as f32 - 8.0) / 16.0)
                .collect();
            let a = Tensor::from_vec(a, (batch, m, k), dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let w = Tensor::from_vec(w, (batch, n, k), dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let a64 = a.to_dtype(DType::F64).unwrap();
            let w64 = w.to_dtype(DType::F64).unwrap();
            let want = a64.matmul(&w64.t().unwrap()).unwrap();
            // Weight rows read along k (the linear-layer layout) ...
            let got = a.apply_op2_no_bwd(&w.t().unwrap(), &WidenMatMul).unwrap();
            // ... and a contiguous [k, n] operand read along n.
            let wt = w.t().unwrap().contiguous().unwrap();
            let got2 = a.apply_op2_no_bwd(&wt, &WidenMatMul).unwrap();
            for g in [got, got2] {
                assert_eq!(g.dtype(), DType::F32);
                let d = max_abs_diff_tensors(&g, &want);
                assert!(d < 1e-4, "{dtype:?} {batch}x{m}x{k}x{n}: {d}");
            }
        }
    }

    /// The same weights read in place (contiguous, aligned), from an odd offset and strided
    /// give bit-identical products: the packed dot's sums must not depend on the layout (an HLO
    /// round trip or a different allocation may change it).
    #[test]
    fn products_do_not_depend_on_the_weights_layout() {
        let dev = &Device::Cpu;
        let (m, k, n) = (5, 64, 24);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.1) / 8.3)
            .collect();
        let a = Tensor::from_vec(a, (m, k), dev).unwrap();
        let w: Vec<f32> = (0..2 * n * k + 1)
            .map(|i| ((i * 5 % 17) as f32 - 8.2) / 16.7)
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let all = Tensor::from_vec(w.clone(), 2 * n * k + 1, dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let aligned = all.narrow(0, 0, n * k).unwrap().reshape((n, k)).unwrap();
            let odd = all.narrow(0, 1, n * k).unwrap().reshape((n, k)).unwrap();
            let odd_copy = odd.contiguous().unwrap();
            // Every other element of [n, k, 2]: k strided by 2.
            let strided = all
                .narrow(0, 0, 2 * n * k)
                .unwrap()
                .reshape((n, k, 2))
                .unwrap()
                .narrow(2, 0, 1)
                .unwrap()
                .squeeze(2)
                .unwrap();
            let strided_copy = strided.contiguous().unwrap();
            let product = |w: &Tensor| -> Vec<u32> {
                a.apply_op2_no_bwd(&w.t().unwrap(), &WidenMatMul)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect()
            };
            assert_eq!(product(&odd), product(&odd_copy), "{dtype:?} odd offset");
            assert_eq!(
                product(&strided),
                product(&strided_copy),
                "{dtype:?} strided"
            );
            assert_ne!(product(&aligned), product(&odd_copy), "distinct weights");
        }
    }

    /// A left row's products are the same bits whatever rows are multiplied with it: one row
    /// alone (the split layout), a few, panels of many, prefill-sized counts (up to 300 rows,
    /// where this kernel once handed over to candle's GEMM), for `k`-contiguous weights (the
    /// packed dot, and at odd `k` the widening loop) and `n`-contiguous ones (the row tile).
    /// Packed prefill and batched decode rely on it.
    #[test]
    fn a_rows_products_do_not_depend_on_the_row_count() {
        let dev = &Device::Cpu;
        // n = 104: one whole 64-column tile of the row-tile kernel (sums in registers, rows in
        // pairs) and a partial one.
        let (n, most) = (104, 300);
        for (k, dtype) in [(96, DType::F32), (96, DType::BF16), (33, DType::BF16)] {
            let a: Vec<f32> = (0..most * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.1) / 8.3)
                .collect();
            let a = Tensor::from_vec(a, (most, k), dev).unwrap();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5 % 17) as f32 - 8.2) / 16.7)
                .collect();
            let w = Tensor::from_vec(w, (n, k), dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            // `w^T` read along k (a linear layer's weight) and a copy with n contiguous.
            let k_major = w.t().unwrap();
            let n_major = k_major.contiguous().unwrap();
            for (name, b) in [("k-contiguous", &k_major), ("n-contiguous", &n_major)] {
                let rows = |m: usize| -> Vec<Vec<u32>> {
                    let out = a
                        .narrow(0, most - m, m)
                        .unwrap()
                        .apply_op2_no_bwd(b, &WidenMatMul)
                        .unwrap()
                        .to_vec2::<f32>()
                        .unwrap();
                    out.iter()
                        .map(|r| r.iter().map(|v| v.to_bits()).collect())
                        .collect()
                };
                // The last row of `a`, as the last of `m` rows.
                let alone = rows(1).remove(0);
                for m in [2, 3, 4, 9, 63, 64, 65, 130, most] {
                    let got = rows(m).pop().unwrap();
                    assert_eq!(got, alone, "{dtype:?} k={k} {name}: the row among {m}");
                }
            }
        }
    }

    /// int8 codes with one scale per output column (the `ScaledMatMul` of int8 experts)
    /// against f64 on the dequantized values, one and several left rows.
    #[test]
    fn scaled_int8_matches_f64_reference() {
        let dev = &Device::Cpu;
        for &(m, k, n) in &[(1, 64, 40), (6, 64, 33), (3, 30, 20)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                .collect();
            let q: Vec<u8> = (0..n * k).map(|i| (i * 37 % 256) as u8).collect();
            let scales: Vec<f32> = (0..n).map(|j| 0.02 + j as f32 * 1e-3).collect();
            let deq: Vec<f64> = (0..k * n)
                .map(|i| {
                    let (kk, j) = (i / n, i % n);
                    f64::from(q[j * k + kk] as i8) * f64::from(scales[j])
                })
                .collect();
            let a = Tensor::from_vec(a, (m, k), dev).unwrap();
            let q = Tensor::from_vec(q, (n, k), dev).unwrap();
            let s = Tensor::from_vec(scales, n, dev).unwrap();
            let got = a
                .apply_op3_no_bwd(&q.t().unwrap(), &s, &ScaledMatMul)
                .unwrap();
            let want = a
                .to_dtype(DType::F64)
                .unwrap()
                .matmul(&Tensor::from_vec(deq, (k, n), dev).unwrap())
                .unwrap();
            let d = max_abs_diff_tensors(&got, &want);
            assert!(d < 1e-4, "{m}x{k}x{n}: {d}");
        }
    }

    /// The gathered matmul against f64 arithmetic on each row's own expert, for bf16 weights
    /// and for int8 codes with per-row scales (repeated and unused experts, ragged tiles); bf16
    /// through the packed dot (k = 36) and the widening loop (odd k = 37). With 7,300 output
    /// columns of 36 values, a task takes 7,281 of them ([`expert_tile`]) and a second the
    /// ragged 19.
    #[test]
    fn gathered_matches_f64_reference() {
        assert_eq!(expert_tile(36, 7300), 7281);
        for (k, out) in [(36, 70), (37, 70), (36, 7300)] {
            gathered_case(k, out);
        }
    }

    /// Tasks no wider than TILE, covering every column, in a number the threads share evenly.
    #[test]
    fn column_tasks_are_shared_evenly() {
        assert_eq!(column_tile(384, 2), 96);
        assert_eq!(column_tile(64, 2), 32);
        assert_eq!(column_tile(32_000, 2), TILE);
        assert_eq!(column_tile(1, 2), 1);
        assert_eq!(column_tile(0, 2), 1);
        for columns in 1..1_000 {
            for threads in 1..5 {
                let width = column_tile(columns, threads);
                let tasks = columns.div_ceil(width);
                assert!(width <= TILE, "{columns} on {threads}");
                // Every thread gets the same number of tasks, or each of the few a task.
                let even = tasks % threads == 0 || columns < threads * TILE;
                assert!(
                    even,
                    "{columns} columns on {threads}: {tasks} tasks of {width}"
                );
            }
        }
    }

    /// Tasks of whole experts where their weights are small, of [`TILE`] rows where large.
    #[test]
    fn expert_tasks_grow_to_whole_small_experts() {
        assert_eq!(expert_tile(256, 1024), 1024);
        assert_eq!(expert_tile(1024, 256), 256);
        assert_eq!(expert_tile(7168, 2048), TILE);
        assert_eq!(expert_tile(36, 70), TILE);
    }

    fn gathered_case(k: usize, out: usize) {
        let dev = &Device::Cpu;
        let (n, m, e) = (5, 2, 4);
        let a: Vec<f32> = (0..n * m * k)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let a = Tensor::from_vec(a, (n, m, k), dev).unwrap();
        let w: Vec<f32> = (0..e * out * k)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let w = Tensor::from_vec(w, (e, out, k), dev).unwrap();
        let ids = [2usize, 0, 2, 3, 2];
        let q: Vec<u8> = (0..e * out * k)
            .map(|i| ((i * 3 % 255) as i32 - 127) as i8 as u8)
            .collect();
        let q8 = Tensor::from_vec(q.clone(), (e, out, k), dev).unwrap();
        // Scales that vary by row but stay small, so sums of any width stay near 1e2 (the
        // tolerance below is absolute).
        let scales: Vec<f32> = (0..e * out)
            .map(|i| 0.01 + (i % 97) as f32 * 1e-3)
            .collect();
        let s = Tensor::from_vec(scales.clone(), (e, out), dev).unwrap();
        let deq: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(i, &b)| f32::from(b as i8) * scales[i / k])
            .collect();
        let deq = Tensor::from_vec(deq, (e, out, k), dev).unwrap();
        let mut cases = vec![
            (
                w.to_dtype(DType::BF16).unwrap(),
                Experts::Float,
                w.to_dtype(DType::BF16).unwrap(),
            ),
            (q8, Experts::Int8(&s), deq),
        ];
        // int4: two codes a byte (low nibble first, stored +8), one scale per `group` inputs;
        // a group of 8 leaves a ragged last group when k = 36.
        let group = 8;
        let groups = k.div_ceil(group);
        let nibbles: Vec<u8> = (0..e * out * k).map(|i| (i * 7 % 16) as u8).collect();
        let packed: Vec<u8> = nibbles.chunks(2).map(|p| p[0] | p[1] << 4).collect();
        let s4: Vec<f32> = (0..e * out * groups)
            .map(|i| 0.02 + (i % 97) as f32 * 1e-3)
            .collect();
        let deq4: Vec<f32> = nibbles
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let (row, col) = (i / k, i % k);
                (i32::from(c) - 8) as f32 * s4[row * groups + col / group]
            })
            .collect();
        // FP4 E2M1 from its definition: sign, two exponent bits (bias 1), one mantissa bit.
        let e2m1 = |c: u8| {
            let (exp, man) = (i32::from(c >> 1 & 3), f32::from(c & 1));
            let magnitude = match exp {
                0 => 0.5 * man,
                _ => 2f32.powi(exp - 1) * (1.0 + 0.5 * man),
            };
            if c & 8 == 0 {
                magnitude
            } else {
                -magnitude
            }
        };
        let deq_fp4: Vec<f32> = nibbles
            .iter()
            .enumerate()
            .map(|(i, &c)| e2m1(c) * s4[i / k * groups + i % k / group])
            .collect();
        let s4 = Tensor::from_vec(s4, (e, out, groups), dev).unwrap();
        if k.is_multiple_of(2) {
            for (format, dense) in [(FourBit::Int4, deq4), (FourBit::E2m1, deq_fp4)] {
                cases.push((
                    Tensor::from_vec(packed.clone(), (e, out, k / 2), dev).unwrap(),
                    Experts::FourBit(&s4, group, format),
                    Tensor::from_vec(dense, (e, out, k), dev).unwrap(),
                ));
            }
        }
        for (weights, experts, dense) in cases {
            let got = gathered(&a, &weights, &ids, experts).unwrap();
            let dense = dense.to_dtype(DType::F64).unwrap();
            for (i, &ei) in ids.iter().enumerate() {
                let want = a
                    .get(i)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .matmul(&dense.get(ei).unwrap().t().unwrap())
                    .unwrap();
                let d = max_abs_diff_tensors(&got.get(i).unwrap(), &want);
                assert!(d < 1e-4, "row {i}: {d}");
                // The same bits when the row is multiplied alone (expert 2 has six left rows
                // here, so panels or groups of fused rows; alone, two): a request's tokens must
                // not depend on what else is in the batch.
                let alone = gathered(&a.narrow(0, i, 1).unwrap(), &weights, &[ei], experts);
                let alone = alone.unwrap().get(0).unwrap().flatten_all().unwrap();
                let row = got.get(i).unwrap().flatten_all().unwrap();
                assert_eq!(
                    row.to_vec1::<f32>().unwrap(),
                    alone.to_vec1::<f32>().unwrap(),
                    "row {i} alone"
                );
            }
        }
    }
}
