//! f32 values in the order of their *keys*, the 32-bit patterns that sort like the values: the
//! bits with the sign bit flipped for positives, every bit flipped for negatives. A threshold
//! search builds a key from its top bit down ([`crate::graph::Op::MassThreshold`]'s bisection,
//! and the vocabulary-split search in `model::vocab`), so it needs each key's value.
//!
//! The value is computed, not reinterpreted (no `bitcast-convert`, which no public source shows
//! neuronx-cc accepting): exponent and mantissa are cut out with shifts and masks and the value
//! is `(1 + mantissa / 2^23) * 2^(exponent - 127)`, the power of two read from
//! [`exponent_scales`]. Every step is exact. Exponent 0 (zero and the subnormals) maps to 0 and
//! exponent 255 (infinities and NaNs) to infinity, so every key has a value and the values never
//! decrease as the key grows: key 0 is `-inf`, the all-ones key `+inf`.

use super::{DType, Literal, Tensor};
use crate::error::Result;

/// `2^(e - 127)` for each biased exponent `e`: 0 for `e = 0` (zero and subnormals, which are
/// flushed) and infinity for `e = 255` (infinities and NaNs).
pub fn exponent_scales() -> Vec<f32> {
    (0..256)
        .map(|e| match e {
            0 => 0.0,
            255 => f32::INFINITY,
            e => f32::from_bits((e as u32) << 23),
        })
        .collect()
}

/// The value (f32) of each key (u32, any shape), by the exact arithmetic of the module docs.
pub fn key_value(key: &Tensor) -> Result<Tensor> {
    let b = key.builder();
    let c = |v: u32| key.full_like(f64::from(v));
    let positive = key.shr(&c(31)?)?.eq(&c(1)?)?;
    let bits = positive.where_cond(&key.bitand(&c(0x7fff_ffff)?)?, &key.bitxor(&c(u32::MAX)?)?)?;
    let exponent = bits.shr(&c(23)?)?.bitand(&c(0xff)?)?.to_dtype(DType::I32)?;
    let table = b.constant(Literal::F32(exponent_scales()), [256])?;
    let n = key.shape().elem_count();
    let scale = table
        .index_select(&exponent.reshape([n])?, 0)?
        .reshape(key.shape().clone())?;
    let significand = bits
        .bitand(&c((1 << 23) - 1)?)?
        .to_dtype(DType::F32)?
        .affine(1.0 / f64::from(1u32 << 23), 1.0)?;
    let magnitude = significand.mul(&scale)?;
    positive.where_cond(&magnitude, &magnitude.neg()?)
}
