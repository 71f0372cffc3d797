//! Comparisons of float outputs that cannot pass on a NaN or an infinity.
//!
//! A fold of `|a - b|` with `f32::max` skips NaN (`f32::max(0.0, NaN)` is `0.0`), so all-NaN
//! logits would have passed "within 1e-4 of transformers". These helpers panic instead, naming
//! the row and index, so a kernel that produces NaN or inf fails every tolerance check.

/// The largest `|a[i] - b[i]|`.
///
/// Panics when the lengths differ, or when either side holds a NaN or an infinity (naming the
/// index and both values): a non-finite output is never "close" to anything.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    max_abs_diff_in(a, b, "")
}

/// The largest `|a[r][i] - b[r][i]|` over rows (e.g. logits per position).
///
/// Panics when the row counts or a row's lengths differ, or on a NaN or an infinity on either
/// side (naming the row and index), so a short or empty output never passes vacuously.
pub fn max_abs_diff_rows(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared outputs differ in row count");
    let mut worst = 0.0f32;
    for (r, (x, y)) in a.iter().zip(b).enumerate() {
        // Never NaN: `max_abs_diff_in` panics on non-finite inputs, and the difference of two
        // finite floats is finite or +inf.
        worst = worst.max(max_abs_diff_in(x, y, &format!("row {r}, ")));
    }
    worst
}

/// [`max_abs_diff`] for values read as f64 (e.g. a tensor of any dtype widened to compare it
/// exactly), with the same refusals.
pub fn max_abs_diff_f64(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    let mut worst = 0.0f64;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.is_finite() && y.is_finite(),
            "index {i}: non-finite value (left {x}, right {y})"
        );
        worst = worst.max((x - y).abs());
    }
    worst
}

/// The largest `|x|` over rows: the scale a relative tolerance is taken of.
///
/// Panics on a NaN or an infinity (naming the row and index): a fold with `f32::max` would
/// skip a NaN, and an infinite scale would make any tolerance pass.
pub fn max_abs(rows: &[Vec<f32>]) -> f32 {
    let mut largest = 0.0f32;
    for (r, row) in rows.iter().enumerate() {
        for (i, &x) in row.iter().enumerate() {
            assert!(x.is_finite(), "row {r}, index {i}: non-finite value {x}");
            largest = largest.max(x.abs());
        }
    }
    largest
}

fn max_abs_diff_in(a: &[f32], b: &[f32], row: &str) -> f32 {
    assert_eq!(a.len(), b.len(), "{row}compared slices differ in length");
    let mut worst = 0.0f32;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.is_finite() && y.is_finite(),
            "{row}index {i}: non-finite value (left {x}, right {y})"
        );
        worst = worst.max((x - y).abs());
    }
    worst
}
