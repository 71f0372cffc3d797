//! What every V4 graph shares below the blocks: the weights as graph inputs by published name,
//! the linear layer, and the partial interleaved RoPE on the trailing channels of a head.

use std::collections::HashMap;

use crate::config::v4::V4Config;
use crate::config::RopeConfig;
use crate::error::{Error, Result};
use crate::graph::{DType, GraphBuilder, InputRole, ReduceOp, Tensor};
use crate::model::precision::Dots;
use crate::model::shard::SHARD_OFFSETS;
use crate::model::vocab::VocabSlice;
use crate::model::{embed_rows, ops, rope};

use super::shard;

/// One rank's weights as graph inputs, by published name (a routed expert by its place among
/// the rank's, see [`super::shard`]).
pub(super) struct Weights {
    inputs: HashMap<String, Tensor>,
    ranks: usize,
    dots: Dots,
}

impl Weights {
    /// Declares every weight a rank of a `ranks`-way split of `cfg` holds on `b` (matrices in
    /// `dtype`, other floats f32, `tid2eid` i32, FP4 experts' codes u8: see
    /// [`super::tensors::V4TensorKind::dtype`]), and with more than one rank the rank's
    /// offsets; reduced-precision matrices (bf16 ones, FP4 experts) multiply as `dots` says.
    pub(super) fn declare(
        b: &GraphBuilder,
        cfg: &V4Config,
        ranks: usize,
        dtype: DType,
        dots: Dots,
    ) -> Result<Self> {
        let mut inputs = HashMap::new();
        for t in shard::rank_tensors(cfg, ranks)? {
            let dtype = t.kind.dtype(dtype);
            let x = b.input(t.name.clone(), InputRole::Weight, t.shape, dtype)?;
            inputs.insert(t.name, x);
        }
        if ranks > 1 {
            let offsets = b.input(SHARD_OFFSETS, InputRole::Weight, [2], DType::I32)?;
            inputs.insert(SHARD_OFFSETS.to_string(), offsets);
        }
        Ok(Weights {
            inputs,
            ranks,
            dots,
        })
    }

    /// How a matmul with a reduced-precision weight (a bf16 matrix, an FP4 expert) multiplies.
    pub(super) fn dots(&self) -> Dots {
        self.dots
    }

    /// `x @ w^T` for weight `name` ([`ops::linear`] under [`Weights::dots`]): an f32 product
    /// for an f32 weight, and for a bf16 one the CPU's widened or a device's split dot.
    pub(super) fn linear(&self, x: &Tensor, name: &str) -> Result<Tensor> {
        ops::linear(self.dots, x, self.get(name)?)
    }

    /// The tensor-parallel degree.
    pub(super) fn ranks(&self) -> usize {
        self.ranks
    }

    /// The rank's first routed expert (`[1]` i32); `None` unsplit.
    pub(super) fn first_expert(&self) -> Result<Option<Tensor>> {
        match self.ranks {
            1 => Ok(None),
            _ => self.get(SHARD_OFFSETS)?.narrow(0, 1, 1).map(Some),
        }
    }

    /// The f32 embeddings of `ids` (`[n]` i32). Split by vocabulary, a rank looks up the ids
    /// its rows hold and the all-reduce fills in the others.
    pub(super) fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let table = self.get("embed.weight")?;
        match self.ranks {
            1 => embed_rows(table, ids, None),
            _ => {
                let first = self.get(SHARD_OFFSETS)?.narrow(0, 0, 1)?;
                self.complete(embed_rows(table, ids, Some(&first))?)
            }
        }
    }

    /// The part of the vocabulary this rank's embedding and LM head rows cover.
    pub(super) fn vocab_slice(&self, cfg: &V4Config) -> Result<VocabSlice> {
        Ok(match self.ranks {
            1 => VocabSlice::Whole,
            ranks => VocabSlice::Shard {
                ranks,
                first: self.get(SHARD_OFFSETS)?.narrow(0, 0, 1)?,
                vocab: cfg.vocab_size,
            },
        })
    }

    /// A rank's partial sum (its heads' attention output, its experts' contribution) summed
    /// over the ranks; the value itself unsplit.
    pub(super) fn complete(&self, partial: Tensor) -> Result<Tensor> {
        match self.ranks {
            1 => Ok(partial),
            n => partial.all_reduce(ReduceOp::Sum, n),
        }
    }

    /// The input of weight `name`.
    pub(super) fn get(&self, name: &str) -> Result<&Tensor> {
        self.inputs
            .get(name)
            .ok_or_else(|| Error::shape("weight", format!("no V4 weight `{name}`")))
    }
}

/// cos and sin (`[n, rope_dim / 2]`) of one RoPE at some positions (`[n]` i32).
pub(super) struct Rope {
    cos: Tensor,
    sin: Tensor,
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
