//! Small composite layers shared by the model builders: linear, RMSNorm, softmax, SwiGLU MLP.

use super::precision::Dots;
use crate::error::Result;
use crate::graph::{DType, Tensor};

/// `a @ b` under the precision policy `dots` ([`super::precision`]), with an f32 result.
///
/// - [`Dots::Widen`]: a reduced-precision operand (a bf16 weight or cache) is widened to f32,
///   exactly, and the product computed in f32; backends fuse the convert into the matmul (the
///   CPU widens weight tiles as it reads them) rather than converting a weight whole.
/// - [`Dots::Narrow`]: when one operand is reduced, the other is rounded to its dtype and the
///   dot of the two narrow operands accumulates into f32. Two f32 operands, or two reduced
///   ones of different dtypes (a bf16 weight beside an f16 cache), multiply as under Widen,
///   and so does an f8 operand.
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
    match (dots, narrow) {
        (Dots::Narrow, Some(d)) => a.to_dtype(d)?.matmul_to(&b.to_dtype(d)?, DType::F32),
        _ => a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?),
    }
}

/// `x @ w^T` for a `[rows, in]` input and an HF-layout `[out, in]` weight, under `dots`.
pub fn linear(dots: Dots, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    matmul(dots, x, &w.t()?)
}

/// RMSNorm over the last dim, in f32: `x * rsqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let last = x.rank() - 1;
    let n = x.dim(last) as f64;
    let var = x.mul(x)?.sum_keepdim(last)?.affine(1.0 / n, eps)?;
    x.broadcast_mul(&var.rsqrt()?)?
        .broadcast_mul(&w.to_dtype(DType::F32)?)
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
