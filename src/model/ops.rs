//! Small composite layers shared by the model builders: linear, RMSNorm, softmax, SwiGLU MLP.

use crate::error::Result;
use crate::graph::{DType, Tensor};

/// `a @ b` under the precision policy ([`super::precision`]): a reduced-precision operand (a
/// bf16 weight or cache) is widened to f32 and the product computed in f32. The widening is
/// exact, so only the storage rounding remains; backends fuse the convert into the matmul
/// (the CPU widens weight tiles as it reads them) rather than converting a weight whole.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)
}

/// `x @ w^T` for a `[rows, in]` input and an HF-layout `[out, in]` weight.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    matmul(x, &w.t()?)
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
pub fn mlp(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let g = linear(x, gate)?.silu()?;
    linear(&g.mul(&linear(x, up)?)?, down)
}
