//! The comparison helpers the parity tests use reject NaN and infinities on either side,
//! mismatched lengths and missing rows, instead of reporting them as "close".

#[path = "common/compare.rs"]
mod compare;

use compare::{max_abs, max_abs_diff, max_abs_diff_f64, max_abs_diff_rows};

#[test]
fn finite_inputs_give_the_largest_difference() {
    assert_eq!(max_abs_diff(&[1.0, -2.0, 3.0], &[1.5, -2.0, 0.0]), 3.0);
    assert_eq!(max_abs_diff(&[], &[]), 0.0);
    let a = vec![vec![0.0, 1.0], vec![2.0]];
    let b = vec![vec![0.0, 1.25], vec![4.0]];
    assert_eq!(max_abs_diff_rows(&a, &b), 2.0);
    assert_eq!(max_abs_diff_f64(&[1.0, -2.0], &[1.0, 0.5]), 2.5);
    assert_eq!(max_abs(&a), 2.0);
    assert_eq!(max_abs(&[vec![-3.0], vec![]]), 3.0);
}

#[test]
#[should_panic(expected = "index 1: non-finite value (left NaN, right 2)")]
fn nan_on_the_left_fails() {
    max_abs_diff(&[1.0, f32::NAN, 3.0], &[1.0, 2.0, 3.0]);
}

#[test]
#[should_panic(expected = "index 2: non-finite value (left 3, right NaN)")]
fn nan_on_the_right_fails() {
    max_abs_diff(&[1.0, 2.0, 3.0], &[1.0, 2.0, f32::NAN]);
}

#[test]
#[should_panic(expected = "index 0: non-finite value (left NaN, right NaN)")]
fn nan_on_both_sides_fails() {
    // What all-NaN logits against all-NaN logits looked like to the old `f32::max` fold: 0.
    max_abs_diff(&[f32::NAN; 4], &[f32::NAN; 4]);
}

#[test]
#[should_panic(expected = "index 1: non-finite value (left inf, right 2)")]
fn positive_infinity_fails() {
    max_abs_diff(&[1.0, f32::INFINITY], &[1.0, 2.0]);
}

#[test]
#[should_panic(expected = "index 0: non-finite value (left -inf, right -inf)")]
fn equal_infinities_fail_too() {
    max_abs_diff(&[f32::NEG_INFINITY], &[f32::NEG_INFINITY]);
}

#[test]
#[should_panic(expected = "row 1, index 0: non-finite value (left 2, right NaN)")]
fn rows_name_the_row_of_a_nan() {
    max_abs_diff_rows(&[vec![1.0], vec![2.0]], &[vec![1.0], vec![f32::NAN]]);
}

#[test]
#[should_panic(expected = "differ in row count")]
fn a_missing_row_fails() {
    max_abs_diff_rows(&[vec![1.0], vec![2.0]], &[vec![1.0]]);
}

#[test]
#[should_panic(expected = "differ in length")]
fn a_short_row_fails() {
    max_abs_diff(&[1.0, 2.0], &[1.0]);
}

#[test]
#[should_panic(expected = "index 1: non-finite value (left 2, right NaN)")]
fn a_nan_among_f64_values_fails() {
    max_abs_diff_f64(&[1.0, 2.0], &[1.0, f64::NAN]);
}

#[test]
#[should_panic(expected = "index 0: non-finite value (left inf, right inf)")]
fn equal_f64_infinities_fail() {
    max_abs_diff_f64(&[f64::INFINITY], &[f64::INFINITY]);
}

#[test]
#[should_panic(expected = "differ in length")]
fn a_short_f64_slice_fails() {
    max_abs_diff_f64(&[1.0], &[]);
}

#[test]
#[should_panic(expected = "row 1, index 1: non-finite value NaN")]
fn a_nan_in_a_scale_fails() {
    // A fold with `f32::max` gives 3 here: the NaN row would set no scale at all.
    max_abs(&[vec![3.0], vec![1.0, f32::NAN]]);
}

#[test]
#[should_panic(expected = "row 0, index 0: non-finite value -inf")]
fn an_infinite_scale_fails() {
    max_abs(&[vec![f32::NEG_INFINITY]]);
}
