//! The precision policy: which dtype weights and the KV cache are held in, and where the
//! forward widens to f32.
//!
//! Weights are held in one dtype (by default the checkpoint's own: `--dtype auto`), on the
//! device and on the CPU, and the KV cache in one dtype (`--kv-dtype`, by default the weights').
//! Activations are f32 between ops: the residual stream, RMSNorm, softmax, the router's scores,
//! the RoPE tables and sampling all run in f32. A matmul whose operand is reduced-precision
//! (a bf16 weight, a bf16 cache) rounds its other operand to that dtype and accumulates in f32
//! with an f32 result ([`super::ops::matmul`]); that rounding of the matmul inputs is the only
//! place activations are bf16. This is the Neuron (and cuBLAS) practice: bf16 operands for the
//! matrix units, f32 accumulation and f32 everywhere precision is cheap. It is more accurate
//! than running the whole model in bf16, as transformers does with `torch_dtype=bfloat16`
//! (tests/precision.rs holds the measurement).

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
