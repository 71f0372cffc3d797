//! Small composite layers shared by the model builders: linear, RMSNorm, softmax, SwiGLU MLP.

use super::precision::Dots;
use crate::error::Result;
use crate::graph::{DType, Tensor};

/// `a @ b` under the precision policy `dots` ([`super::precision`]), with an f32 result.
///
/// When exactly one operand is of a reduced float type `d` (bf16 or f16: a weight, the
/// cache) and the other is f32 (an activation):
/// - [`Dots::Widen`]: the reduced operand is widened to f32, exactly, and the product computed
///   in f32; backends fuse the convert into the matmul (the CPU widens weight tiles as it
///   reads them) rather than converting a weight whole.
/// - [`Dots::Split`]: the f32 operand is split into its rounding to `d` and the rounding of
///   the remainder ([`split`]), both multiplied in one dot of `d` operands (stacked along the
///   rows, so the weight is read once) into f32, and the two halves of the result added.
/// - [`Dots::Narrow`]: the f32 operand is rounded to `d` and one dot of `d` operands
///   accumulates into f32.
///
/// Two operands of the same reduced type multiply into f32 under Split and Narrow; anything
/// else (two f32 operands, two reduced types that differ, an f8 operand) as under Widen.
pub fn matmul(dots: Dots, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    // bf16 and f16 are what a matmul unit multiplies; an f8 operand is never the activation's
    // dtype.
    let narrow_float = |d: DType| matches!(d, DType::BF16 | DType::F16);
    let (da, db) = (a.dtype(), b.dtype());
    let narrow = match (narrow_float(da), narrow_float(db)) {
        (true, false) if db == DType::F32 => Some(da),
        (false, true) if da == DType::F32 => Some(db),
        (true, true) if da == db => Some(da),
        _ => None,
    };
    let Some(d) = narrow.filter(|_| dots != Dots::Widen) else {
        return a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?);
    };
    let split_side = match dots {
        Dots::Split if da == DType::F32 => Some(a.rank() - 2),
        Dots::Split if db == DType::F32 => Some(b.rank() - 1),
        _ => None,
    };
    let Some(dim) = split_side else {
        return a.to_dtype(d)?.matmul_to(&b.to_dtype(d)?, DType::F32);
    };
    // The f32 side stacked as [hi; lo] along `dim` (its rows, or a right operand's columns):
    // one dot, whose result holds the two partial products side by side along `dim`.
    let (f32_side, narrow_side) = if da == DType::F32 { (a, b) } else { (b, a) };
    let (hi, lo) = split(f32_side, d)?;
    let stacked = a.builder().cat(&[&hi, &lo], dim)?;
    let n = f32_side.dim(dim);
    let y = if da == DType::F32 {
        stacked.matmul_to(narrow_side, DType::F32)?
    } else {
        narrow_side.matmul_to(&stacked, DType::F32)?
    };
    y.narrow(dim, 0, n)?.add(&y.narrow(dim, n, n)?)
}

/// `x` (f32) as `hi + lo` with `hi` its rounding to `d` and `lo` the rounding of what is left:
/// together about twice `d`'s significant bits (16 for bf16, against f32's 24), so a dot of
/// both against a `d` weight loses almost nothing to the activation's rounding.
pub fn split(x: &Tensor, d: DType) -> Result<(Tensor, Tensor)> {
    let hi = x.to_dtype(d)?;
    let lo = x.sub(&hi.to_dtype(DType::F32)?)?.to_dtype(d)?;
    Ok((hi, lo))
}

/// `x @ w^T` for a `[rows, in]` input and an HF-layout `[out, in]` weight, under `dots`.
pub fn linear(dots: Dots, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    matmul(dots, x, &w.t()?)
}

/// RMSNorm over the last dim, in f32: `x * rsqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_unweighted(x, eps)?.broadcast_mul(&w.to_dtype(DType::F32)?)
}

/// RMSNorm over the last dim with no weight: `x * rsqrt(mean(x^2) + eps)` (DeepSeek-V4's
/// query heads and hyper-connection inputs).
pub fn rms_norm_unweighted(x: &Tensor, eps: f64) -> Result<Tensor> {
    let last = x.rank() - 1;
    let n = x.dim(last) as f64;
    let var = x.mul(x)?.sum_keepdim(last)?.affine(1.0 / n, eps)?;
    x.broadcast_mul(&var.rsqrt()?)
}

/// LayerNorm over the last dim, in f32: `(x - mean) * rsqrt(var + eps) * w + b`, with the
/// biased variance (PyTorch's `nn.LayerNorm`). DeepSeek-V3.2's indexer normalizes its key so.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let last = x.rank() - 1;
    let n = x.dim(last) as f64;
    let centered = x.broadcast_sub(&x.sum_keepdim(last)?.affine(1.0 / n, 0.0)?)?;
    let var = centered
        .mul(&centered)?
        .sum_keepdim(last)?
        .affine(1.0 / n, eps)?;
    centered
        .broadcast_mul(&var.rsqrt()?)?
        .broadcast_mul(&w.to_dtype(DType::F32)?)?
        .broadcast_add(&b.to_dtype(DType::F32)?)
}

/// Softmax over `dim`, max-subtracted. Rows that are all `-inf` are not produced by the model
/// (every query sees at least one key).
pub fn softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    let m = x.max_keepdim(dim)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(dim)?)
}

/// The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub fn mlp(dots: Dots, x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let g = linear(dots, x, gate)?.silu()?;
    linear(dots, &g.mul(&linear(dots, x, up)?)?, down)
}

/// `x / k` (integers) for a positive constant `k`: a right shift when `k` is a power of two.
/// NeuronCore vector engines compute integer arithmetic in fp32, exact only below 2^24; a
/// shift is a bit operation, exact at any size.
pub fn div_const(x: &Tensor, k: usize) -> Result<Tensor> {
    match k.is_power_of_two() {
        true => x.shr(&x.full_like(f64::from(k.trailing_zeros()))?),
        false => x.div(&x.full_like(k as f64)?),
    }
}

/// `x * k` (integers) for a constant `k`: a left shift when `k` is a power of two (see
/// [`div_const`]; `backend::neuron::check` flags integer multiplies).
pub fn mul_const(x: &Tensor, k: usize) -> Result<Tensor> {
    match k.is_power_of_two() {
        true => x.shl(&x.full_like(f64::from(k.trailing_zeros()))?),
        false => x.mul(&x.full_like(k as f64)?),
    }
}
