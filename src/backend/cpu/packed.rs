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
//! output column.

use pulp::Simd;

/// Lane positions of one group of a split row are padded to this many floats (the widest
/// vector, AVX-512's 16), so every group starts on a vector boundary and ends on zeros.
const GROUP_ALIGN: usize = 16;

/// A weight element the packed dot can read in place. The defaults say it cannot (f16, f8,
/// int8: the widening kernel reads those).
pub(super) trait Packed: Copy + Sized {
    /// Elements in one `u32` lane; 0 when the type has no packed form.
    const PER_LANE: usize = 0;

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
/// int8 experts slower than widening each row with the CPU's own convert (`matmul.rs`;
/// benches/README.md).
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
            for (c, &v) in row.iter().enumerate() {
                out[(c % per_lane) * group + c / per_lane] = v;
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
/// one weight row as lanes of `T` ([`Packed::as_lanes`]).
///
/// Rows go eight at a time where the CPU has 32 vector registers (AVX-512), else four, so each
/// unpacked weight vector feeds that many FMAs; the last few rows go one at a time.
#[inline(always)]
pub(super) fn dots<S: Simd, T: Packed>(
    simd: S,
    w: &[u32],
    split: &SplitRows,
    rows: impl Iterator<Item = usize>,
    mut put: impl FnMut(usize, f32),
) {
    debug_assert_eq!(split.per_lane, T::PER_LANE);
    let wide = S::REGISTER_COUNT >= 32;
    let mut rows = rows.enumerate();
    loop {
        let mut block = [(0, 0); 8];
        let mut count = 0;
        for slot in block.iter_mut() {
            match rows.next() {
                Some(r) => *slot = r,
                None => break,
            }
            count += 1;
        }
        let mut done = 0;
        if wide && count == 8 {
            let got = dot_block::<S, T, 8>(simd, w, split, block.map(|(_, r)| r));
            for ((i, _), v) in block.into_iter().zip(got) {
                put(i, v);
            }
            done = 8;
        }
        while count - done >= 4 {
            let four: [(usize, usize); 4] = std::array::from_fn(|t| block[done + t]);
            let got = dot_block::<S, T, 4>(simd, w, split, four.map(|(_, r)| r));
            for ((i, _), v) in four.into_iter().zip(got) {
                put(i, v);
            }
            done += 4;
        }
        for &(i, r) in &block[done..count] {
            put(i, dot_block::<S, T, 1>(simd, w, split, [r])[0]);
        }
        if count < 8 {
            return;
        }
    }
}

/// The dot products of `R` left rows with one weight row.
///
/// Two accumulators a row, even and odd weight vectors, so consecutive FMAs do not wait on
/// each other; every index into them is static once the loops over `p` and `r` unroll, so
/// they stay in registers.
#[inline(always)]
fn dot_block<S: Simd, T: Packed, const R: usize>(
    simd: S,
    w: &[u32],
    split: &SplitRows,
    rows: [usize; R],
) -> [f32; R] {
    let (head, tail) = S::as_simd_u32s(w);
    let per_group = split.group / S::F32_LANES;
    let xs: [&[S::f32s]; R] = rows.map(|r| S::as_simd_f32s(split.row(r)).0);
    let mut even = [simd.splat_f32s(0.0); R];
    let mut odd = even;
    let pairs = head.len() / 2;
    for t in 0..pairs {
        step::<S, T, R>(simd, &mut even, &xs, head[2 * t], 2 * t, per_group);
        step::<S, T, R>(simd, &mut odd, &xs, head[2 * t + 1], 2 * t + 1, per_group);
    }
    if head.len() % 2 == 1 {
        let last = head.len() - 1;
        step::<S, T, R>(simd, &mut even, &xs, head[last], last, per_group);
    }
    if !tail.is_empty() {
        // Zero-filled: unpacks to zeros, and the split rows are zero there too.
        let lanes = simd.partial_load_u32s(tail);
        step::<S, T, R>(simd, &mut odd, &xs, lanes, head.len(), per_group);
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = simd.reduce_sum_f32s(simd.add_f32s(even[r], odd[r]));
    }
    out
}

/// One weight vector (`lanes`, vector `i` of the row) into each row's accumulator. A plain
/// function, not a closure: closures do not inherit the SIMD target features.
#[inline(always)]
fn step<S: Simd, T: Packed, const R: usize>(
    simd: S,
    acc: &mut [S::f32s; R],
    xs: &[&[S::f32s]; R],
    lanes: S::u32s,
    i: usize,
    per_group: usize,
) {
    for p in 0..T::PER_LANE {
        let wv = T::unpack(simd, lanes, p);
        for r in 0..R {
            acc[r] = simd.mul_add_f32s(xs[r][p * per_group + i], wv, acc[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulp::{Arch, WithSimd};

    struct Dots<'a, T> {
        w: &'a [T],
        a: &'a [f32],
        k: usize,
    }

    impl<T: Packed> WithSimd for Dots<'_, T> {
        type Output = Vec<f32>;

        fn with_simd<S: Simd>(self, simd: S) -> Vec<f32> {
            let split = SplitRows::new(self.a, self.k, T::PER_LANE);
            let rows = self.a.len() / self.k;
            let lanes = T::as_lanes(self.w).expect("aligned test data");
            let mut out = vec![f32::NAN; rows];
            dots::<S, T>(simd, lanes, &split, 0..rows, |i, v| out[i] = v);
            out
        }
    }

    fn check<T: Packed>(w: &[T], value: impl Fn(T) -> f64, k: usize, rows: usize) {
        let a: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        // What the machine picks, and each width it has (scalar, AVX2, AVX-512).
        let mut runs = vec![Arch::new().dispatch(Dots { w, a: &a, k })];
        runs.push(Dots { w, a: &a, k }.with_simd(pulp::Scalar::new()));
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(simd) = pulp::x86::V3::try_new() {
                runs.push(Dots { w, a: &a, k }.with_simd(simd));
            }
            if let Some(simd) = pulp::x86::V4::try_new() {
                runs.push(Dots { w, a: &a, k }.with_simd(simd));
            }
        }
        for (r, g) in runs
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, g)| (i % rows, g))
        {
            let want: f64 = (0..k).map(|c| f64::from(a[r * k + c]) * value(w[c])).sum();
            assert!(
                (f64::from(*g) - want).abs() < 1e-4,
                "k {k}, row {r} of {rows}: {g} vs {want}"
            );
        }
    }

    /// Every lane position, vector tails (k not a multiple of any vector width) and row
    /// counts that use the 4-row block, the single rows and both.
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
