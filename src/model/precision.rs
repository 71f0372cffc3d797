//! The precision policy: which dtype weights and the KV cache are held in, and where the
//! forward widens to f32.
//!
//! Weights are held in one dtype (by default the checkpoint's own: `--dtype auto`), on the
//! device and on the CPU, and the KV cache in one dtype (`--kv-dtype`, by default the weights').
//! The router's weights stay f32 (see [`super::params`]).
//!
//! Activations are never rounded to bf16: the residual stream, RMSNorm, softmax, the router's
//! scores, the RoPE tables and sampling run in f32, and a matmul with a bf16 operand (a weight,
//! the cache) widens that operand to f32, exactly, and multiplies in f32
//! ([`super::ops::matmul`]). So the only rounding is the storage's. Backends read the bf16
//! operand through the widening: the CPU widens weight tiles inside the matmul; on Neuron the
//! weights move from HBM as bf16, which is what bounds decode.
//!
//! Why not bf16 matmul inputs (an HLO `dot` of bf16 operands with an f32 result), as Neuron
//! practice does for throughput? Measured on the fixtures (`tests/precision.rs`, against
//! transformers in f32, max |logit difference|): rounding the activations to bf16 before every
//! matmul gave 5.3e-2, 3.0e-2 and 2.9e-1 on tiny-v3, tiny-v2-lite and tiny-v2-group (the last a
//! routing decision flipped at one position), against transformers-bf16's own 5.3e-2, 4.6e-2
//! and 6.0e-2; widening instead gives 4.4e-2, 1.2e-2 and 3.3e-2, ahead of transformers-bf16 on
//! every fixture. Decode is bound by reading the weights, not by the matmul units' rate, so the
//! f32 arithmetic costs decode little; for compute-bound prefill on trn1, neuronx-cc's
//! `--auto-cast matmult --auto-cast-type bf16` turns the f32 matmuls back into bf16 ones, the
//! trade made explicitly.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::graph::DType;

/// A dtype asked for on the command line: `auto` or a float type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DTypeChoice {
    /// The checkpoint's own dtype (weights), or the weights' dtype (KV cache).
    #[default]
    Auto,
    /// This dtype.
    Exactly(DType),
}

impl FromStr for DTypeChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => DTypeChoice::Auto,
            "f32" | "float32" => DTypeChoice::Exactly(DType::F32),
            "bf16" | "bfloat16" => DTypeChoice::Exactly(DType::BF16),
            "f16" | "float16" => DTypeChoice::Exactly(DType::F16),
            other => {
                return Err(Error::InvalidInput(format!(
                    "dtype `{other}`: expected auto, bf16, f16 or f32"
                )))
            }
        })
    }
}

impl fmt::Display for DTypeChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DTypeChoice::Auto => f.write_str("auto"),
            DTypeChoice::Exactly(d) => write!(f, "{d}"),
        }
    }
}

/// The dtypes a model is served in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Every weight (V3's router bias excepted, see [`super::params`]).
    pub weights: DType,
    /// The KV cache.
    pub kv_cache: DType,
}

impl Precision {
    /// Everything in f32.
    pub const F32: Precision = Precision {
        weights: DType::F32,
        kv_cache: DType::F32,
    };

    /// Resolves the command line's choices against the checkpoint's dtype (`None` when it
    /// has no float tensor, which only an empty checkpoint lacks).
    pub fn resolve(
        weights: DTypeChoice,
        kv_cache: DTypeChoice,
        checkpoint: Option<DType>,
    ) -> Result<Self> {
        let weights = match weights {
            DTypeChoice::Exactly(d) => d,
            DTypeChoice::Auto => checkpoint.unwrap_or(DType::F32),
        };
        let kv_cache = match kv_cache {
            DTypeChoice::Exactly(d) => d,
            DTypeChoice::Auto => weights,
        };
        for (flag, d) in [("--dtype", weights), ("--kv-dtype", kv_cache)] {
            if !matches!(d, DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::InvalidInput(format!(
                    "{flag} {d}: weights and caches are held in f32, bf16 or f16"
                )));
            }
        }
        Ok(Precision { weights, kv_cache })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_checkpoint_and_the_cache_follows_the_weights() {
        let auto = DTypeChoice::Auto;
        let p = Precision::resolve(auto, auto, Some(DType::BF16)).unwrap();
        assert_eq!((p.weights, p.kv_cache), (DType::BF16, DType::BF16));
        let f32 = "f32".parse().unwrap();
        let p = Precision::resolve(auto, f32, Some(DType::BF16)).unwrap();
        assert_eq!((p.weights, p.kv_cache), (DType::BF16, DType::F32));
        let p = Precision::resolve(f32, auto, Some(DType::BF16)).unwrap();
        assert_eq!(p, Precision::F32);
        assert!("int4".parse::<DTypeChoice>().is_err());
    }
}
