//! Rotary position embeddings, plain and YaRN, in DeepSeek's interleaved pair layout.
//!
//! The inverse frequencies depend only on the config, so they are graph constants. The angles
//! depend on the step's positions, so they are computed in the graph every step (positions are
//! metadata; nothing derived from them is kept on the host).
//!
//! DeepSeek's weights expect pairs `(x0, x1), (x2, x3), ...` rotated as complex numbers (HF
//! DeepSeek-V2's `apply_rotary_emb`; HF V3 de-interleaves first, which permutes the output but
//! gives the same dot products). The same layout is applied to `q_pe` and to the cached `k_pe`.
//! DeepSeek-V3.2's indexer is the exception: it rotates the first and second halves of its rope
//! dims as pairs ([`apply_half_split`]), with the same angles.

use crate::config::{ModelConfig, RopeConfig, YarnConfig};
use crate::error::Result;
use crate::graph::{Literal, Tensor};

/// YaRN's magnitude correction `0.1 * m * ln(factor) + 1` (1 when `factor <= 1`).
pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

/// The attention softmax scale: `qk_head_dim^-0.5`, times `mscale(factor, mscale_all_dim)^2`
/// under YaRN when `mscale_all_dim` is set. (The cos/sin factor is a separate correction, see
/// [`rope_tables`]; mixing the two up is a known bug.)
pub fn softmax_scale(cfg: &ModelConfig) -> f64 {
    let base = (cfg.qk_head_dim() as f64).powf(-0.5);
    match &cfg.rope.yarn {
        Some(y) => match y.mscale_all_dim {
            Some(m) if m != 0.0 => {
                let s = yarn_mscale(y.factor, m);
                base * s * s
            }
            _ => base,
        },
        None => base,
    }
}

/// The inverse frequencies (`rope_dim / 2` of them) and the cos/sin magnitude factor, computed
/// in f32 as transformers does so that the angles match bit for bit where possible.
pub fn rope_tables(cfg: &ModelConfig) -> (Vec<f32>, f32) {
    let factor = cfg.rope.yarn.as_ref().map_or(1.0, yarn_attention_factor);
    (inv_freq(cfg.qk_rope_head_dim, &cfg.rope), factor)
}

/// The inverse frequencies of a `dim`-channel rotation under `rope` (YaRN's interpolated ones
/// when set), in f32 as transformers computes them. DeepSeek-V4 uses them without a magnitude
/// factor (its YaRN's `attention_factor` is 1).
pub fn inv_freq(dim: usize, rope: &RopeConfig) -> Vec<f32> {
    let base = rope.theta as f32;
    let pos_freqs: Vec<f32> = (0..dim / 2)
        .map(|i| base.powf((2 * i) as f32 / dim as f32))
        .collect();
    match &rope.yarn {
        None => pos_freqs.iter().map(|p| 1.0 / p).collect(),
        Some(y) => yarn_inv_freq(y, dim, rope.theta, &pos_freqs),
    }
}

fn yarn_attention_factor(y: &YarnConfig) -> f32 {
    match (y.mscale, y.mscale_all_dim) {
        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
            (yarn_mscale(y.factor, m) / yarn_mscale(y.factor, a)) as f32
        }
        _ => yarn_mscale(y.factor, 1.0) as f32,
    }
}

fn yarn_inv_freq(y: &YarnConfig, dim: usize, base: f64, pos_freqs: &[f32]) -> Vec<f32> {
    let orig = y.original_max_position_embeddings as f64;
    let correction_dim = |rot: f64| {
        (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let low = correction_dim(y.beta_fast).floor().max(0.0);
    let mut high = correction_dim(y.beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    let factor = y.factor as f32;
    pos_freqs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            let inter = 1.0 / (factor * p);
            let extra = 1.0 / p;
            inter * (1.0 - extrapolation_factor) + extra * extrapolation_factor
        })
        .collect()
}

/// cos and sin of `positions * inv_freq`, each `[n, rope_dim / 2]`, times the magnitude factor.
pub fn cos_sin(cfg: &ModelConfig, positions: &Tensor) -> Result<(Tensor, Tensor)> {
    let (inv_freq, factor) = rope_tables(cfg);
    let (mut cos, mut sin) = cos_sin_of(inv_freq, positions)?;
    if factor != 1.0 {
        cos = cos.affine(factor as f64, 0.0)?;
        sin = sin.affine(factor as f64, 0.0)?;
    }
    Ok((cos, sin))
}

/// cos and sin of `positions * inv_freq` (`[n, inv_freq.len()]`), with no magnitude factor.
pub fn cos_sin_of(inv_freq: Vec<f32>, positions: &Tensor) -> Result<(Tensor, Tensor)> {
    let b = positions.builder();
    let half = inv_freq.len();
    let n = positions.dim(0);
    let inv = b.constant(Literal::F32(inv_freq), [1, half])?;
    let angles = positions
        .to_dtype(crate::graph::DType::F32)?
        .reshape([n, 1])?
        .broadcast_mul(&inv)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// Rotates `x` (`[n, heads, rope_dim]`) by the per-row `cos`/`sin` (`[n, rope_dim / 2]`),
/// pairing interleaved elements.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (n, h, d) = (x.dim(0), x.dim(1), x.dim(2));
    let pairs = x.reshape([n, h, d / 2, 2])?;
    let x0 = pairs.narrow(3, 0, 1)?.squeeze(3)?;
    let x1 = pairs.narrow(3, 1, 1)?.squeeze(3)?;
    let c = cos.unsqueeze(1)?;
    let s = sin.unsqueeze(1)?;
    let r0 = x0.broadcast_mul(&c)?.sub(&x1.broadcast_mul(&s)?)?;
    let r1 = x0.broadcast_mul(&s)?.add(&x1.broadcast_mul(&c)?)?;
    let b = x.builder();
    b.cat(&[&r0.unsqueeze(3)?, &r1.unsqueeze(3)?], 3)?
        .reshape([n, h, d])
}

/// Rotates `x` (`[n, heads, rope_dim]`) by the per-row `cos`/`sin` (`[n, rope_dim / 2]`),
/// pairing element `i` with element `i + rope_dim / 2` (transformers' `rotate_half` layout,
/// which V3.2's indexer uses: its weights were trained so, unlike MLA's interleaved pairs).
pub fn apply_half_split(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(2) / 2;
    let x0 = x.narrow(2, 0, half)?;
    let x1 = x.narrow(2, half, half)?;
    let c = cos.unsqueeze(1)?;
    let s = sin.unsqueeze(1)?;
    let r0 = x0.broadcast_mul(&c)?.sub(&x1.broadcast_mul(&s)?)?;
    let r1 = x1.broadcast_mul(&c)?.add(&x0.broadcast_mul(&s)?)?;
    x.builder().cat(&[&r0, &r1], 2)
}
