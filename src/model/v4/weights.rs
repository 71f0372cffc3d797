//! What every V4 graph shares below the blocks: the weights as graph inputs by published name,
//! the linear layer, and the partial interleaved RoPE on the trailing channels of a head.

use std::collections::HashMap;

use crate::config::v4::V4Config;
use crate::config::RopeConfig;
use crate::error::{Error, Result};
use crate::graph::{DType, GraphBuilder, InputRole, Tensor};
use crate::model::precision::Dots;
use crate::model::{ops, rope};

use super::tensors::{self, V4TensorKind};

/// The model's weights as graph inputs, by published name (the first of a tensor's names).
pub(super) struct Weights {
    inputs: HashMap<String, Tensor>,
}

impl Weights {
    /// Declares every weight of `cfg` on `b`: f32, and `tid2eid` i32.
    pub(super) fn declare(b: &GraphBuilder, cfg: &V4Config) -> Result<Self> {
        let mut inputs = HashMap::new();
        for t in tensors::expected(cfg) {
            let name = t.names[0].clone();
            let dtype = match t.kind {
                V4TensorKind::Float => DType::F32,
                V4TensorKind::ExpertIds => DType::I32,
            };
            let x = b.input(name.clone(), InputRole::Weight, t.shape, dtype)?;
            inputs.insert(name, x);
        }
        Ok(Weights { inputs })
    }

    /// The input of weight `name`.
    pub(super) fn get(&self, name: &str) -> Result<&Tensor> {
        self.inputs
            .get(name)
            .ok_or_else(|| Error::shape("weight", format!("no V4 weight `{name}`")))
    }
}

/// `x @ w^T` ([`ops::linear`]); the weights are f32 so far, so every product is an f32 one.
pub(super) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    ops::linear(Dots::Widen, x, w)
}

/// cos and sin (`[n, rope_dim / 2]`) of one RoPE at some positions (`[n]` i32).
pub(super) struct Rope {
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
}

impl Rope {
    /// The angles of RoPE `cfg` over `dim` channels at `positions`.
    pub(super) fn new(dim: usize, cfg: &RopeConfig, positions: &Tensor) -> Result<Self> {
        let (cos, sin) = rope::cos_sin_of(rope::inv_freq(dim, cfg), positions)?;
        Ok(Rope { cos, sin })
    }

    /// Rotates the trailing `rope_dim` channels of `x` (`[n, heads, width]`, one position a
    /// row), by `-angle` when `inverse`.
    pub(super) fn apply(&self, x: &Tensor, inverse: bool) -> Result<Tensor> {
        rotate_tail(x, &self.cos, &self.sin, inverse)
    }
}

/// Interleaved RoPE on the trailing `2 x cos.dim(1)` channels of `x` (`[n, heads, width]`).
fn rotate_tail(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let (n, heads, width) = (x.dim(0), x.dim(1), x.dim(2));
    let r = 2 * cos.dim(1);
    let sin = match inverse {
        true => sin.neg()?,
        false => sin.clone(),
    };
    let tail = rope::apply(&x.narrow(2, width - r, r)?, cos, &sin)?;
    if r == width {
        return Ok(tail);
    }
    let b = x.builder();
    b.cat(&[&x.narrow(2, 0, width - r)?, &tail], 2)
        .and_then(|y| y.reshape([n, heads, width]))
}
