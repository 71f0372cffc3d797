//! [`Op::MassThreshold`](crate::graph::Op::MassThreshold) on the CPU: a weighted radix select.
//!
//! The answer is always one of the row's values (or ±inf at the edges), and a value's
//! *order-preserving key* (its f32 bits with the sign bit flipped for positives and every bit
//! flipped for negatives) sorts like the value. So the threshold is found digit by digit of
//! its key, most significant first: a histogram of the weights over the next 11 bits (10 for
//! the last digit), scanned from the top until the mass above plus the bin reaches the target,
//! picks the digit; the next pass only looks at that bin's members. Three passes, the first over
//! the whole row and the others over ever smaller subsets, instead of the 32 passes of the
//! bisection the HLO lowering uses on the device: the same answer, since both find the largest
//! key whose mass reaches the target. Masses are summed in f64 here and in f32 by the device, so
//! a target within rounding of a step of the mass can land on the neighbouring value.

/// The key of `v` (not NaN): `a < b` as floats iff `key(a) < key(b)` as integers (with
/// `-0.0 < +0.0`).
fn key(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The value whose key is `k`.
fn value(k: u32) -> f32 {
    f32::from_bits(if k >> 31 == 1 { k & 0x7fff_ffff } else { !k })
}

/// The digits of a key, most significant first: (shift, width).
const DIGITS: [(u32, u32); 3] = [(21, 11), (10, 11), (0, 10)];

/// The threshold of every row: `x` and `w` are `[rows, n]` row-major, `target` is `[rows]`.
pub(super) fn mass_threshold_rows(
    x: &[f32],
    w: &[f32],
    target: &[f32],
    n: usize,
) -> candle_core::Result<Vec<f32>> {
    super::pool::parallel_map(target.len(), |r| {
        row(&x[r * n..(r + 1) * n], &w[r * n..(r + 1) * n], target[r])
    })
}

/// One row's threshold (see [`crate::graph::Op::MassThreshold`] for the edge cases).
fn row(x: &[f32], w: &[f32], target: f32) -> f32 {
    if target.is_nan() {
        return f32::NEG_INFINITY;
    }
    if target <= 0.0 {
        return f32::INFINITY;
    }
    let target = f64::from(target);
    // Mass of every key above the bin being refined.
    let mut above = 0.0f64;
    let mut prefix = 0u32;
    // The chosen bin's members (key, weight), once a digit is fixed.
    let mut members: Option<Vec<(u32, f64)>> = None;
    for (shift, width) in DIGITS {
        let mask = (1u32 << width) - 1;
        let mut hist = vec![0.0f64; 1 << width];
        match &members {
            None => {
                for (&v, &wv) in x.iter().zip(w) {
                    if !v.is_nan() {
                        hist[((key(v) >> shift) & mask) as usize] += f64::from(wv);
                    }
                }
            }
            Some(m) => {
                for &(k, wv) in m {
                    hist[((k >> shift) & mask) as usize] += wv;
                }
            }
        }
        let mut chosen = None;
        for (digit, &mass) in hist.iter().enumerate().rev() {
            if above + mass >= target {
                chosen = Some(digit as u32);
                break;
            }
            above += mass;
        }
        // Only the first digit can fall short: later ones refine a bin that reached it.
        let Some(digit) = chosen else {
            return f32::NEG_INFINITY;
        };
        prefix |= digit << shift;
        if shift > 0 {
            let high = !((1u32 << shift) - 1);
            members = Some(match members {
                None => x
                    .iter()
                    .zip(w)
                    .filter(|(v, _)| !v.is_nan())
                    .map(|(&v, &wv)| (key(v), f64::from(wv)))
                    .filter(|&(k, _)| k & high == prefix)
                    .collect(),
                Some(m) => m.into_iter().filter(|&(k, _)| k & high == prefix).collect(),
            });
        }
    }
    // Engines that flush subnormals cannot tell a subnormal answer from 0 (see the op's doc).
    let t = value(prefix);
    if t.is_subnormal() {
        0.0
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, by sorting: the largest value whose mass at or above reaches the target.
    fn by_sorting(x: &[f32], w: &[f32], target: f32) -> f32 {
        assert_eq!(x.len(), w.len(), "a weight per value");
        if target.is_nan() {
            return f32::NEG_INFINITY;
        }
        if target <= 0.0 {
            return f32::INFINITY;
        }
        let mut vals: Vec<f32> = x.iter().copied().filter(|v| !v.is_nan()).collect();
        vals.sort_by(|a, b| b.total_cmp(a));
        for &t in &vals {
            let t = if t.is_subnormal() { 0.0 } else { t };
            let mass: f64 = x
                .iter()
                .zip(w)
                .filter(|(v, _)| **v >= t)
                .map(|(_, &wv)| f64::from(wv))
                .sum();
            if mass >= f64::from(target) {
                return t;
            }
        }
        f32::NEG_INFINITY
    }

    #[test]
    fn keys_sort_like_values() {
        let vals = [
            f32::NEG_INFINITY,
            -f32::MAX,
            -1.5,
            -f32::MIN_POSITIVE,
            -1e-45,
            -0.0,
            0.0,
            1e-45,
            1.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for pair in vals.windows(2) {
            assert!(key(pair[0]) < key(pair[1]), "{pair:?}");
        }
        for v in vals {
            assert_eq!(value(key(v)).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn matches_the_sorting_definition() {
        // Values with ties, both zeros, infinities and a NaN; unit and uneven weights; targets
        // at, between and beyond the steps of the mass.
        let x = [
            3.0,
            -1.0,
            3.0,
            0.0,
            -0.0,
            f32::NAN,
            f32::NEG_INFINITY,
            7.5,
            -1.0,
            2.0,
            f32::INFINITY,
            1e-30,
        ];
        let unit = [1.0; 12];
        let uneven = [
            0.5, 0.25, 0.125, 2.0, 1.0, 9.0, 0.75, 0.0, 3.0, 0.5, 0.0625, 1.5,
        ];
        for w in [unit, uneven] {
            for target in [
                -1.0,
                0.0,
                0.01,
                0.0625,
                1.0,
                2.0,
                2.5,
                3.0,
                5.0,
                8.0,
                9.75,
                11.0,
                100.0,
                f32::NAN,
            ] {
                let got = row(&x, &w, target);
                let want = by_sorting(&x, &w, target);
                assert!(
                    got == want || (got.is_nan() && want.is_nan()),
                    "target {target}, weights {w:?}: {got} != {want}"
                );
            }
        }
    }

    #[test]
    fn kth_largest_of_a_long_row() {
        // 50,000 values, many sharing high digits: the k-th largest for several k.
        let x: Vec<f32> = (0..50_000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / 65_536.0) - 128.0)
            .collect();
        let w = vec![1.0f32; x.len()];
        let mut sorted = x.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for k in [1usize, 2, 1000, 16_385, 49_999, 50_000] {
            assert_eq!(row(&x, &w, k as f32), sorted[k - 1], "k = {k}");
        }
        assert_eq!(row(&x, &w, 50_001.0), f32::NEG_INFINITY);
    }
}
