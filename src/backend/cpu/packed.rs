//! Dot products that read a weight row in place, several values to a 32-bit lane.
//!
//! The widening matmul (`matmul.rs`) used to widen each weight row into an f32 buffer and then
//! take its dot products with the left rows: for a decode step (one to eight left rows) that
//! is a store and a reload of every weight value on top of the read, about half the
//! instructions of the kernel. Here the row is loaded as `u32` lanes and unpacked in
//! registers: a lane holds one f32 or two bf16 (the low half is the even element, the high
//! half the odd one). Unpacking needs only a shift or a mask, which `pulp`'s portable `Simd`
//! trait has, so the same code runs as AVX-512, AVX2 or scalar (picked at run time), with no
//! `unsafe`.
//!
//! The left rows are laid out to match ([`SplitRows`]): element `c` of a row goes to group
//! `c % P` at position `c / P`, so the `p`-th value of every lane meets its left operand in
//! one vector. Each row costs one copy per call, against a weight read of `k` values per
//! output column. From four rows on (a batched decode step, an expert chosen by several rows)
//! the rows go in [`Panels`] of eight, interleaved so that each unpacked weight vector feeds
//! eight FMAs whose operands are adjacent in memory, two weight rows at a time. Both kernels
//! prefetch the weight stream ahead of them ([`Prefetch`]).

use pulp::Simd;

/// Lane positions of one group of a split row are padded to this many floats (the widest
/// vector, AVX-512's 16), so every group starts on a vector boundary and ends on zeros.
const GROUP_ALIGN: usize = 16;

/// A weight element the packed dot can read in place. The defaults say it cannot (f16, f8,
/// int8: the widening kernel reads those).
pub(super) trait Packed: Copy + Sized {
    /// Elements in one `u32` lane; 0 when the type has no packed form.
    const PER_LANE: usize = 0;

    /// Whether the one-row dot asks for this type's rows ahead of use ([`Prefetch`]). f32
    /// rows, one FMA a vector, are consumed at the memory's pace and go faster with the
    /// hardware prefetcher alone: the software prefetch made a batch-1 f32 step about 5%
    /// slower, where bf16 was up to 20% slower without it (benches/LOG.md, "Whole experts a
    /// task").
    const PREFETCH: bool = true;

    /// The row's elements as `u32` lanes, or `None` (no packed form, or the slice is not
    /// 4-byte aligned).
    fn as_lanes(_row: &[Self]) -> Option<&[u32]> {
        None
    }

    /// Element `p` (`< PER_LANE`) of every lane, as f32, exactly.
    #[inline(always)]
    fn unpack<S: Simd>(simd: S, _lanes: S::u32s, _p: usize) -> S::f32s {
        simd.splat_f32s(0.0)
    }

    /// Appends `row`'s elements as lanes, as [`Packed::as_lanes`] would see them in memory (for
    /// a row that cannot be read in place: strided, or not aligned).
    fn pack(_row: impl Iterator<Item = Self>, _out: &mut Vec<u32>) {}
}

impl Packed for half::f16 {}

impl Packed for float8::F8E4M3 {}

impl Packed for f32 {
    const PER_LANE: usize = 1;
    const PREFETCH: bool = false;

    fn as_lanes(row: &[Self]) -> Option<&[u32]> {
        Some(bytemuck::cast_slice(row))
    }

    fn pack(row: impl Iterator<Item = Self>, out: &mut Vec<u32>) {
        out.extend(row.map(f32::to_bits));
    }

    #[inline(always)]
    fn unpack<S: Simd>(simd: S, lanes: S::u32s, _: usize) -> S::f32s {
        simd.transmute_f32s_u32s(lanes)
    }
}

impl Packed for half::bf16 {
    const PER_LANE: usize = 2;

    fn as_lanes(row: &[Self]) -> Option<&[u32]> {
        bytemuck::try_cast_slice(row).ok()
    }

    /// Little-endian pairs: the even element in the low half.
    fn pack(mut row: impl Iterator<Item = Self>, out: &mut Vec<u32>) {
        while let Some(lo) = row.next() {
            let hi = row.next().map_or(0, |h| h.to_bits());
            out.push(u32::from(lo.to_bits()) | (u32::from(hi) << 16));
        }
    }

    /// A bf16 is the top half of an f32: the low element shifted up, the high one masked.
    #[inline(always)]
    fn unpack<S: Simd>(simd: S, lanes: S::u32s, p: usize) -> S::f32s {
        let bits = if p == 0 {
            simd.wrapping_dyn_shl_u32s(lanes, simd.splat_u32s(16))
        } else {
            simd.and_u32s(lanes, simd.splat_u32s(0xFFFF_0000))
        };
        simd.transmute_f32s_u32s(bits)
    }
}

/// int8 has no packed form: the portable trait has no byte-to-float convert, and the
/// biasing trick that stands in for it (xor, shift, mask, or and subtract per byte) made the
/// int8 experts slower than the CPU's own convert, which `matmul.rs` uses through `pulp`'s
/// AVX-512 token (benches/README.md).
impl Packed for i8 {}

/// Left rows (`[rows, k]`, f32) in the packed dot's layout for `per_lane` values a lane.
pub(super) struct SplitRows {
    data: Vec<f32>,
    /// Floats per group (`k / per_lane`, padded to [`GROUP_ALIGN`]).
    group: usize,
    per_lane: usize,
}

impl SplitRows {
    /// `a` is `rows` rows of `k` values; `k` must be a multiple of `per_lane`.
    pub(super) fn new(a: &[f32], k: usize, per_lane: usize) -> Self {
        debug_assert!(per_lane > 0 && k.is_multiple_of(per_lane));
        let group = (k / per_lane).div_ceil(GROUP_ALIGN) * GROUP_ALIGN;
        let rows = a.len() / k.max(1);
        let mut data = vec![0f32; rows * per_lane * group];
        for (row, out) in a
            .chunks_exact(k.max(1))
            .zip(data.chunks_exact_mut(per_lane * group))
        {
            for (p, group) in out.chunks_exact_mut(group).enumerate() {
                let values = row.iter().skip(p).step_by(per_lane);
                group.iter_mut().zip(values).for_each(|(o, &v)| *o = v);
            }
        }
        SplitRows {
            data,
            group,
            per_lane,
        }
    }

    /// Row `r`'s groups, one after another.
    fn row(&self, r: usize) -> &[f32] {
        let len = self.per_lane * self.group;
        &self.data[r * len..(r + 1) * len]
    }
}

/// `dot(row(i), w)` for the left rows `rows` yields, passed to `put(i, dot)` in order; `w` is
/// one weight row as lanes of `T` ([`Packed::as_lanes`]). For one to a few rows: more go in
/// [`Panels`].
#[inline(always)]
pub(super) fn dots<S: Simd, T: Packed>(
    simd: S,
    w: &[u32],
    split: &SplitRows,
    rows: impl Iterator<Item = usize>,
    mut put: impl FnMut(usize, f32),
) {
    debug_assert_eq!(split.per_lane, T::PER_LANE);
    for (i, r) in rows.enumerate() {
        put(i, dot_row::<S, T>(simd, w, split, r));
    }
}

/// The dot product of left row `r` with one weight row.
///
/// One accumulator, in the order the panel kernel sums each row ([`panel_block`]), so a row's
/// product is bit for bit the same whether it is multiplied alone or with others: a request's
/// tokens must not depend on what else is in the batch (the server suite checks it). The
/// FMA chain this makes (one vector at a time) still outruns the weights' arrival from memory.
#[inline(always)]
fn dot_row<S: Simd, T: Packed>(simd: S, w: &[u32], split: &SplitRows, r: usize) -> f32 {
    let (head, tail) = S::as_simd_u32s(w);
    let per_group = split.group / S::F32_LANES;
    let x = S::as_simd_f32s(split.row(r)).0;
    let mut acc = simd.splat_f32s(0.0);
    let fetch = Prefetch::new();
    for (i, &lanes) in head.iter().enumerate() {
        if T::PREFETCH && i % 2 == 0 {
            fetch.ahead::<PREFETCH_ONE_ROW, _>(&head[i..]);
        }
        acc = step::<S, T>(simd, acc, x, lanes, i, per_group);
    }
    if !tail.is_empty() {
        // Zero-filled: unpacks to zeros, and the split rows are zero there too.
        let lanes = simd.partial_load_u32s(tail);
        acc = step::<S, T>(simd, acc, x, lanes, head.len(), per_group);
    }
    simd.reduce_sum_f32s(acc)
}

/// One weight vector (`lanes`, vector `i` of the row) into the accumulator. A plain function,
/// not a closure: closures do not inherit the SIMD target features.
#[inline(always)]
fn step<S: Simd, T: Packed>(
    simd: S,
    mut acc: S::f32s,
    x: &[S::f32s],
    lanes: S::u32s,
    i: usize,
    per_group: usize,
) -> S::f32s {
    for p in 0..T::PER_LANE {
        acc = simd.mul_add_f32s(x[p * per_group + i], T::unpack(simd, lanes, p), acc);
    }
    acc
}

/// Left rows per panel ([`Panels`]): eight accumulators (sixteen, even and odd) and one
/// unpacked weight vector fit AVX-512's 32 registers with room; AVX2's 16 take four rows at a
/// time within a panel.
pub(super) const PANEL: usize = 8;

/// Left rows (`[rows, k]`, f32) in panels of [`PANEL`] rows for [`panel_dots`], interleaved so
/// that a weight vector's operands are adjacent in memory: for each block of 16 lane
/// positions, each lane position `p` of a `u32` lane and each row `r` of the panel, 16 floats
/// (element `c` of a row goes to lane position `c % per_lane`, lane `c / per_lane`, as in
/// [`SplitRows`]).
///
/// Why not [`SplitRows`] for many rows: there each row's groups lie `k` floats apart, so eight
/// bf16 rows are sixteen streams, one pointer each; the kernel ran out of general registers and
/// reloaded about a dozen pointers from the stack for every weight vector (perf), and took
/// 1.6 to 3.9 times as long at eight rows (benches/LOG.md, "Left rows in panels"). Here one
/// pointer walks the panel from start to end. Rows past the last one are zeros.
pub(super) struct Panels {
    data: Vec<f32>,
    /// Blocks of 16 lane positions (`ceil(k / per_lane / 16)`).
    blocks: usize,
    per_lane: usize,
}

impl Panels {
    /// The left rows `rows` yields (each `k` values; `k` a multiple of `per_lane`), laid out
    /// as they come: a caller that picks rows (an expert's) copies each once, here.
    pub(super) fn new<'a>(
        rows: impl Iterator<Item = &'a [f32]>,
        k: usize,
        per_lane: usize,
    ) -> Self {
        debug_assert!(per_lane > 0 && k.is_multiple_of(per_lane));
        let blocks = (k / per_lane).div_ceil(GROUP_ALIGN);
        let panel = blocks * per_lane * PANEL * GROUP_ALIGN;
        let mut data = Vec::new();
        for (i, row) in rows.enumerate() {
            debug_assert_eq!(row.len(), k);
            let (base, r) = ((i / PANEL) * panel, i % PANEL);
            if r == 0 {
                data.resize(base + panel, 0f32);
            }
            // Block `b` of 16 lanes holds row values `b * 16 * per_lane ..`, lane position `p`
            // of them every `per_lane`-th from `p`.
            for (b, values) in row.chunks(GROUP_ALIGN * per_lane).enumerate() {
                let at = |p: usize| base + ((b * per_lane + p) * PANEL + r) * GROUP_ALIGN;
                for (lane, elements) in values.chunks_exact(per_lane).enumerate() {
                    for (p, &v) in elements.iter().enumerate() {
                        data[at(p) + lane] = v;
                    }
                }
            }
        }
        Panels {
            data,
            blocks,
            per_lane,
        }
    }

    fn panel(&self, i: usize) -> &[f32] {
        let len = self.blocks * self.per_lane * PANEL * GROUP_ALIGN;
        &self.data[i * len..(i + 1) * len]
    }
}

/// Weight rows a panel kernel takes at once ([`panel_dots`]): each left vector it loads feeds
/// this many FMAs, one per weight row.
pub(super) const PANEL_COLS: usize = 2;

/// The dot products of panel `panel`'s first `live` rows with each of `C` weight rows (`ws`,
/// lanes of `T`, all of one length); the rest of the [`PANEL`] values are zero. A panel of one
/// to four live rows runs a narrower block, so a few rows cost no more FMAs than they need.
#[inline(always)]
pub(super) fn panel_dots<S: Simd, T: Packed, const C: usize>(
    simd: S,
    ws: [&[u32]; C],
    panels: &Panels,
    panel: usize,
    live: usize,
) -> [[f32; PANEL]; C] {
    debug_assert_eq!(panels.per_lane, T::PER_LANE);
    let x = panels.panel(panel);
    let pad = |got: [[f32; 4]; C]| {
        got.map(|col| std::array::from_fn(|r| col.get(r).copied().unwrap_or(0.0)))
    };
    match live {
        0..=4 => pad(panel_block::<S, T, 4, C>(simd, ws, x, 0)),
        _ if S::REGISTER_COUNT >= 32 => panel_block::<S, T, PANEL, C>(simd, ws, x, 0),
        _ => {
            let lo = panel_block::<S, T, 4, C>(simd, ws, x, 0);
            let hi = panel_block::<S, T, 4, C>(simd, ws, x, 4);
            std::array::from_fn(|c| {
                std::array::from_fn(|r| if r < 4 { lo[c][r] } else { hi[c][r - 4] })
            })
        }
    }
}

/// Rows `r0..r0 + R` of one panel (`x`) dotted with each of the weight rows `ws`: each vector
/// of a weight row is loaded and unpacked once and feeds `R` FMAs per lane position, whose
/// operands sit one after another in `x`, and each left vector loaded feeds `C` FMAs. The
/// `R x C` accumulators are independent chains that hide the FMA latency; each sums its row in
/// the one-row dot's order ([`dot_row`]), so results do not depend on the rows' count.
///
/// Why several weight rows: with one, every FMA needed its own load of a left vector (sixteen
/// loads for sixteen FMAs a weight vector), and the batch-8 LM head took 4.7 ms where one
/// row took 2.1 (benches/LOG.md, "Two weight rows at a time, prefetched").
#[inline(always)]
fn panel_block<S: Simd, T: Packed, const R: usize, const C: usize>(
    simd: S,
    ws: [&[u32]; C],
    x: &[f32],
    r0: usize,
) -> [[f32; R]; C] {
    let rows = ws.map(S::as_simd_u32s);
    let xs = S::as_simd_f32s(x).0;
    let mut acc = [[simd.splat_f32s(0.0); R]; C];
    let vectors = rows[0].0.len();
    let mut lanes = [simd.splat_u32s(0); C];
    let fetch = Prefetch::new();
    for v in 0..vectors {
        for c in 0..C {
            fetch.ahead::<PREFETCH_PANEL, _>(&rows[c].0[v..]);
            lanes[c] = rows[c].0[v];
        }
        panel_step::<S, T, R, C>(simd, &mut acc, xs, lanes, v, r0);
    }
    if !rows[0].1.is_empty() {
        // Zero-filled: unpacks to zeros, and the panel is zero there too.
        for c in 0..C {
            lanes[c] = simd.partial_load_u32s(rows[c].1);
        }
        panel_step::<S, T, R, C>(simd, &mut acc, xs, lanes, vectors, r0);
    }
    let mut out = [[0f32; R]; C];
    for c in 0..C {
        for r in 0..R {
            out[c][r] = simd.reduce_sum_f32s(acc[c][r]);
        }
    }
    out
}

/// How far ahead of the weight vector being multiplied the kernels ask for memory
/// ([`Prefetch::ahead`]), in bytes: the one-row dot (a decode step of one row, the gathered
/// experts) and the panel kernel (several rows; it consumes the stream more slowly). Tuned on
/// the medium model's decode steps (benches/LOG.md, "Two weight rows at a time,
/// prefetched"): further ahead made batch 1 slower, nearer made the batch-8 LM head slower.
pub(super) const PREFETCH_ONE_ROW: usize = 1024;
pub(super) const PREFETCH_PANEL: usize = 4096;

/// Software prefetch of the weight stream, where the CPU has it (x86-64: SSE's `prefetcht0`,
/// which `pulp` exposes as a safe call since a prefetch never faults).
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    #[cfg(target_arch = "x86_64")]
    sse: Option<pulp::core_arch::x86::Sse>,
}

impl Prefetch {
    #[inline(always)]
    pub(super) fn new() -> Self {
        Prefetch {
            #[cfg(target_arch = "x86_64")]
            sse: pulp::core_arch::x86::Sse::try_new(),
        }
    }

    /// Asks for the cache line `BYTES` past the start of `from` (past its end is fine:
    /// nothing is read).
    #[inline(always)]
    pub(super) fn ahead<const BYTES: usize, V>(self, from: &[V]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(sse) = self.sse {
            let at = from.as_ptr().cast::<i8>().wrapping_add(BYTES);
            sse._mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(at);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = from;
    }
}

/// Weight vector `v` of each weight row (`lanes`) into rows `r0..r0 + R`'s accumulators (a
/// plain function, as [`step`]).
#[inline(always)]
fn panel_step<S: Simd, T: Packed, const R: usize, const C: usize>(
    simd: S,
    acc: &mut [[S::f32s; R]; C],
    xs: &[S::f32s],
    lanes: [S::u32s; C],
    v: usize,
    r0: usize,
) {
    let per = GROUP_ALIGN / S::F32_LANES;
    let block = T::PER_LANE * PANEL * per;
    let xb = &xs[(v / per) * block..][..block];
    let mut wv = [simd.splat_f32s(0.0); C];
    for p in 0..T::PER_LANE {
        for c in 0..C {
            wv[c] = T::unpack(simd, lanes[c], p);
        }
        for r in 0..R {
            let xv = xb[(p * PANEL + r0 + r) * per + v % per];
            for c in 0..C {
                acc[c][r] = simd.mul_add_f32s(xv, wv[c], acc[c][r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulp::{Arch, WithSimd};

    /// Every kernel's products of the left rows `a` with the weight row `w`, and the
    /// two-column panel kernel's with `w` and `w2` together.
    struct Dots<'a, T> {
        w: &'a [T],
        w2: &'a [T],
        a: &'a [f32],
        k: usize,
    }

    impl<T: Packed> WithSimd for Dots<'_, T> {
        type Output = Vec<f32>;

        fn with_simd<S: Simd>(self, simd: S) -> Vec<f32> {
            let split = SplitRows::new(self.a, self.k, T::PER_LANE);
            let rows = self.a.len() / self.k;
            let lanes = T::as_lanes(self.w).expect("aligned test data");
            let lanes2 = T::as_lanes(self.w2).expect("aligned test data");
            let mut out = vec![f32::NAN; rows];
            dots::<S, T>(simd, lanes, &split, 0..rows, |i, v| out[i] = v);
            // The same rows in panels, by `w` alone, then by `w` and `w2` together.
            let panels = Panels::new(self.a.chunks_exact(self.k), self.k, T::PER_LANE);
            let (mut first, mut second) = (vec![], vec![]);
            for p in 0..rows.div_ceil(PANEL) {
                let live = PANEL.min(rows - p * PANEL);
                let [got] = panel_dots::<S, T, 1>(simd, [lanes], &panels, p, live);
                out.extend_from_slice(&got[..live]);
                let [a, b] = panel_dots::<S, T, 2>(simd, [lanes, lanes2], &panels, p, live);
                first.extend_from_slice(&a[..live]);
                second.extend_from_slice(&b[..live]);
            }
            out.extend(first);
            out.extend(second);
            out
        }
    }

    fn check<T: Packed>(w: &[T], value: impl Fn(T) -> f64, k: usize, rows: usize) {
        let a: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let w2: Vec<T> = w.iter().rev().copied().collect();
        let dots = || Dots {
            w,
            w2: &w2,
            a: &a,
            k,
        };
        // What the machine picks, and each width it has (scalar, AVX2, AVX-512).
        let mut runs = vec![Arch::new().dispatch(dots())];
        runs.push(dots().with_simd(pulp::Scalar::new()));
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(simd) = pulp::x86::V3::try_new() {
                runs.push(dots().with_simd(simd));
            }
            if let Some(simd) = pulp::x86::V4::try_new() {
                runs.push(dots().with_simd(simd));
            }
        }
        assert!(runs.iter().all(|r| r.len() == 4 * rows));
        for run in &runs {
            // A row's product is the same bits alone, in a panel, and beside a second weight
            // row: a request's tokens must not depend on the rest of the batch.
            let (split, rest) = run.split_at(rows);
            assert_eq!(split, &rest[..rows], "k {k}, {rows} rows: split vs panel");
            assert_eq!(
                split,
                &rest[rows..2 * rows],
                "k {k}, {rows} rows: one vs two columns"
            );
            for (i, g) in run.iter().enumerate() {
                // The last quarter is the products with `w2`.
                let (r, weights) = (i % rows, if i < 3 * rows { w } else { &w2[..] });
                let want: f64 = (0..k)
                    .map(|c| f64::from(a[r * k + c]) * value(weights[c]))
                    .sum();
                assert!(
                    (f64::from(*g) - want).abs() < 1e-4,
                    "k {k}, output {i} (row {r} of {rows}): {g} vs {want}"
                );
            }
        }
    }

    /// Every lane position, vector tails (k not a multiple of any vector width), and row
    /// counts that fill panels, leave the last one partial, or use each of its block widths
    /// (one, four and eight rows), in both layouts.
    #[test]
    fn packed_dots_match_f64_for_each_element_type() {
        for k in [4, 12, 36, 68, 200, 1024] {
            for rows in [1, 3, 4, 8, 9, 13, 32] {
                let f: Vec<f32> = (0..k).map(|i| ((i * 5 % 17) as f32 - 8.0) / 16.0).collect();
                check(&f, f64::from, k, rows);
                let b: Vec<half::bf16> = f.iter().map(|&v| half::bf16::from_f32(v)).collect();
                check(&b, |v| f64::from(v.to_f32()), k, rows);
            }
        }
    }
}
