//! Comparisons the unit tests bound a numeric error with, which cannot pass on a NaN or an
//! infinity.
//!
//! The obvious ways to take "the largest difference" are NaN-blind: `f64::max(0.0, NaN)` is
//! `0.0`, so a fold with `f64::max` over an all-NaN result reports 0; candle's `max` reduction
//! keeps a NaN only when it comes first. A kernel that writes NaN would then pass every
//! tolerance check. These helpers panic instead, naming the index and both values; a test that
//! expects a non-finite value compares it exactly. `tests/common/compare.rs` holds the same
//! rule for the integration tests (which cannot reach `#[cfg(test)]` code).
//!
//! Also [`seeded_values`], the arbitrary but reproducible values several unit tests quantize
//! and compare.

use candle_core::{DType, Tensor};

/// The largest `|got[i] - want[i]|`, in f64.
///
/// Panics when the lengths differ (a short result never passes vacuously), or when either side
/// holds a NaN or an infinity.
pub(crate) fn max_abs_diff<A, B>(got: &[A], want: &[B]) -> f64
where
    A: Copy + Into<f64>,
    B: Copy + Into<f64>,
{
    assert_eq!(
        got.len(),
        want.len(),
        "compared results differ in length (left {}, right {})",
        got.len(),
        want.len()
    );
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.into(), w.into());
        assert!(
            g.is_finite() && w.is_finite(),
            "index {i}: non-finite value (left {g}, right {w})"
        );
        // Never NaN: both sides are finite, so the difference is finite or +inf.
        worst = worst.max((g - w).abs());
    }
    worst
}

/// [`max_abs_diff`] of two tensors' elements (any float dtype, widened to f64), after checking
/// that their shapes agree.
pub(crate) fn max_abs_diff_tensors(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "compared tensors differ in shape");
    max_abs_diff(&values(got), &values(want))
}

/// The largest `|x|`: the scale a relative tolerance is taken of. Panics on a NaN or an
/// infinity (which would make any tolerance meaningless), naming the index.
pub(crate) fn max_abs<A: Copy + Into<f64>>(xs: &[A]) -> f64 {
    let mut largest = 0.0f64;
    for (i, &x) in xs.iter().enumerate() {
        let x = x.into();
        assert!(x.is_finite(), "index {i}: non-finite value {x}");
        largest = largest.max(x.abs());
    }
    largest
}

/// A tensor's elements in row-major order, widened to f64.
pub(crate) fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a float tensor's elements")
}

/// `n` seeded values uniform in `[-0.5, 0.5)` (a 64-bit LCG's top bits), for unit tests that
/// need the same arbitrary weights on every run.
pub(crate) fn seeded_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn finite_inputs_give_the_largest_difference() {
        assert_eq!(
            max_abs_diff(&[1.0f32, -2.0, 3.0], &[1.5f64, -2.0, 0.0]),
            3.0
        );
        assert_eq!(max_abs_diff::<f32, f32>(&[], &[]), 0.0);
        assert_eq!(max_abs(&[0.5f32, -4.0, 2.0]), 4.0);
        let a = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[1.0f64, 2.5], [3.0, 3.0]], &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff_tensors(&a, &b), 1.0);
    }

    #[test]
    #[should_panic(expected = "index 1: non-finite value (left NaN, right 2)")]
    fn a_nan_on_the_left_fails() {
        max_abs_diff(&[1.0f32, f32::NAN, 3.0], &[1.0f32, 2.0, 3.0]);
    }

    #[test]
    #[should_panic(expected = "index 2: non-finite value (left 3, right NaN)")]
    fn a_nan_on_the_right_fails() {
        max_abs_diff(&[1.0f64, 2.0, 3.0], &[1.0f64, 2.0, f64::NAN]);
    }

    #[test]
    #[should_panic(expected = "index 0: non-finite value (left NaN, right NaN)")]
    fn nan_on_both_sides_fails() {
        // What an all-NaN result looked like to a fold with `f64::max`: a difference of 0.
        max_abs_diff(&[f32::NAN; 3], &[f32::NAN; 3]);
    }

    #[test]
    #[should_panic(expected = "index 0: non-finite value (left inf, right inf)")]
    fn equal_infinities_fail() {
        max_abs_diff(&[f32::INFINITY], &[f32::INFINITY]);
    }

    #[test]
    #[should_panic(expected = "differ in length")]
    fn a_short_result_fails() {
        max_abs_diff(&[1.0f32], &[1.0f32, 2.0]);
    }

    #[test]
    #[should_panic(expected = "index 2: non-finite value (left NaN, right 0)")]
    fn a_nan_past_the_first_element_of_a_tensor_fails() {
        // candle's `max` reduction skips this NaN (only a NaN in first place survives it).
        let got = Tensor::new(&[0.0f32, 0.0, f32::NAN, 0.0], &Device::Cpu).unwrap();
        let want = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        max_abs_diff_tensors(&got, &want);
    }

    #[test]
    #[should_panic(expected = "differ in shape")]
    fn tensors_of_other_shapes_fail() {
        let a = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        max_abs_diff_tensors(&a, &b);
    }

    #[test]
    #[should_panic(expected = "index 1: non-finite value NaN")]
    fn a_nan_in_a_scale_fails() {
        max_abs(&[1.0f32, f32::NAN, 3.0]);
    }

    #[test]
    #[should_panic(expected = "index 0: non-finite value -inf")]
    fn an_infinite_scale_fails() {
        max_abs(&[f64::NEG_INFINITY]);
    }
}
