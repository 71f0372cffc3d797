//! The precision policy: which dtype weights and the KV cache are held in, and in which dtype
//! a matmul multiplies ([`Dots`]).
//!
//! Weights are held in one dtype (by default the checkpoint's own: `--dtype auto`), on the
//! device and on the CPU, and the KV cache in one dtype (`--kv-dtype`, by default the weights').
//! The router's weights stay f32 (see [`super::params`]). The residual stream, RMSNorm,
//! softmax, the router's scores, the RoPE tables and sampling are f32 under either policy.
//!
//! Where they part is the matmul with a reduced-precision operand (a bf16 weight, the cache,
//! quantized experts), [`super::ops::matmul`]. Measured on the fixtures (`tests/precision.rs`,
//! max |logit difference| against transformers in f32, bf16 weights and cache; the yardstick
//! is transformers-bf16's own 5.3e-2, 4.6e-2 and 6.0e-2 on tiny-v3, tiny-v2-lite and
//! tiny-v2-group):
//!
//! - [`Dots::Widen`] (the CPU backend's): the operand is widened to f32, exactly, and the
//!   product computed in f32, so the only rounding is the storage's. The CPU widens weight
//!   tiles inside its kernel, so this costs it nothing. 4.4e-2, 1.2e-2 and 3.3e-2.
//! - [`Dots::Split`] (a NeuronCore's, so nrt-sim's and `lower`'s by default): the f32
//!   activation is split into two bf16 parts (its rounding and the rounding of the
//!   remainder), stacked along the rows and multiplied by the bf16 operand in one dot with an
//!   f32 result (HLO's `dot` with a wider result type, the form JAX emits for
//!   `preferred_element_type=float32`), the two halves of the result added. 4.4e-2, 1.2e-2 and
//!   3.3e-2: the activation keeps about 16 of f32's 24 bits, and nothing measurable is lost.
//!   No weight is converted to f32 in HBM (`lower --check neuron` refuses a graph that does:
//!   rule `narrow-dots`), the matmul units run at their bf16 rate (a trn1 chip: 190 TFLOPS
//!   against 47.5 in f32) on twice the rows, and the weights, which bound decode, are read
//!   once.
//! - [`Dots::Narrow`]: the activation rounded once to bf16, one dot. Half Split's arithmetic,
//!   but 5.3e-2, 3.0e-2 and 2.9e-1: past the yardstick on tiny-v3 and on tiny-v2-group, where
//!   the rounding flips an expert choice (and a greedy argmax). Only on request (`lower --dots
//!   narrow`), for measuring it.
//!
//! Under Split and Narrow quantized experts multiply in the weights' dtype: int8 codes are
//! exact in bf16, so the dot reads them converted and their per-output-channel scale multiplies
//! the dot's f32 output; int4 codes dequantize with their group scales to bf16 (the group runs
//! along the dot's inputs), never to f32.
//!
//! One graph builder serves every policy: the policy is part of [`Precision`], so the device
//! and the simulator build the same graph, and the CPU backend runs a Split graph as written
//! when it stands in for a NeuronCore (nrt-sim).

use std::fmt;
use std::str::FromStr;

use crate::config::ModelConfig;
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

/// `--quantize`: a weight-only quantization applied at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quantize {
    /// Every weight in the weights' dtype.
    #[default]
    None,
    /// Routed experts in int8 with one f32 scale per output channel (symmetric, computed at
    /// load), dequantized in the graph right before the expert matmuls. Routed experts are
    /// ~90% of a DeepSeek model's parameters, so this nearly halves a bf16 model.
    ExpertsInt8,
    /// Routed experts in 4 bits, two to a byte, with one f32 scale per
    /// [`INT4_GROUP`] inputs of each output channel (symmetric, computed at load; GPTQ's and
    /// AWQ's usual group), dequantized in the graph like int8. A quarter of a bf16 expert's
    /// bytes plus 1/32 for the scales: what lets DeepSeek-V3/R1 fit one trn1.32xlarge and
    /// V2-Lite one NeuronCore (`deepinfer plan`). Both the hidden and the expert widths must be
    /// even (two codes a byte along the input).
    ExpertsInt4,
    /// GGML's `Q8_0` (blocks of 32 int8 values with one f16 scale: 8.5 bits a weight) for
    /// every linear layer's weight, multiplied by candle's quantized kernels (the activations
    /// quantized to 8 bits per block, as llama.cpp does). CPU backend only: see
    /// [`Quantize::is_cpu_only`].
    Q8_0,
    /// GGML's `Q4_K` (super-blocks of 256 4-bit values with 6-bit block scales and mins: 4.5
    /// bits a weight) for every linear layer's weight whose input width is a multiple of 256,
    /// `Q8_0` for the others. CPU backend only.
    Q4K,
}

/// Inputs of an output channel that share one scale under [`Quantize::ExpertsInt4`].
pub const INT4_GROUP: usize = 128;

impl Quantize {
    /// Whether routed experts are held quantized (int8 or int4 codes with f32 scales,
    /// dequantized in the graph).
    pub fn quantizes_experts(self) -> bool {
        matches!(self, Quantize::ExpertsInt8 | Quantize::ExpertsInt4)
    }

    /// Whether this is one of GGML's block formats, which only the CPU backend computes on
    /// (candle's quantized kernels): no HLO lowering exists for them, so a Neuron capture,
    /// `lower` and `plan` refuse them, and so does tensor parallelism (a block-quantized matrix
    /// is not split).
    pub fn is_cpu_only(self) -> bool {
        matches!(self, Quantize::Q8_0 | Quantize::Q4K)
    }

    /// The refusal of a CPU-only format where `what` cannot use it.
    pub fn cpu_only_error(self, what: &str) -> Error {
        Error::InvalidInput(format!(
            "--quantize {self} is a CPU format (GGML blocks, computed by candle's quantized \
             kernels) and {what} cannot use it; on a NeuronCore use --quantize experts-int8"
        ))
    }
}

impl FromStr for Quantize {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Quantize::None),
            "experts-int8" => Ok(Quantize::ExpertsInt8),
            "experts-int4" => Ok(Quantize::ExpertsInt4),
            "q8_0" | "Q8_0" => Ok(Quantize::Q8_0),
            "q4_k" | "Q4_K" => Ok(Quantize::Q4K),
            other => Err(Error::InvalidInput(format!(
                "--quantize `{other}`: expected none, experts-int8, experts-int4, q8_0 or q4_k"
            ))),
        }
    }
}

impl fmt::Display for Quantize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Quantize::None => "none",
            Quantize::ExpertsInt8 => "experts-int8",
            Quantize::ExpertsInt4 => "experts-int4",
            Quantize::Q8_0 => "q8_0",
            Quantize::Q4K => "q4_k",
        })
    }
}

/// What the command line asked for: `--dtype`, `--kv-dtype`, `--quantize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrecisionChoice {
    /// The weights' dtype.
    pub dtype: DTypeChoice,
    /// The KV cache's dtype.
    pub kv_dtype: DTypeChoice,
    /// Weight-only quantization.
    pub quantize: Quantize,
}

impl PrecisionChoice {
    /// The dtypes to serve a DeepSeek-V4 model saved in `saved` (its unquantized weights'
    /// dtype, `None` if unknown) in: its matrices in f32 or bf16, everything else in f32 (see
    /// [`crate::model::v4::tensors::V4TensorKind`]), its caches in f32 or bf16. `auto` holds
    /// the matrices in bf16 when the checkpoint saved them so (as the published ones do: their
    /// FP8 matrices, a power-of-two scale times an E4M3 value, are exact in bf16), else in f32,
    /// and the caches in the matrices' dtype, as MLA models' `auto` does. Other choices are
    /// refused: f16, and `--quantize` (FP4 experts are read as published).
    pub fn v4(&self, saved: Option<DType>) -> Result<Precision> {
        let auto_weights = match saved {
            Some(DType::BF16) => DType::BF16,
            _ => DType::F32,
        };
        let f32_or_bf16 = |choice: DTypeChoice, auto: DType, flag: &str, what: &str| match choice {
            DTypeChoice::Auto => Ok(auto),
            DTypeChoice::Exactly(d @ (DType::F32 | DType::BF16)) => Ok(d),
            DTypeChoice::Exactly(other) => Err(Error::InvalidInput(format!(
                "{flag} {other}: DeepSeek-V4's {what} are held in f32 or bf16"
            ))),
        };
        let weights = f32_or_bf16(self.dtype, auto_weights, "--dtype", "weights")?;
        let kv_cache = f32_or_bf16(self.kv_dtype, weights, "--kv-dtype", "caches")?;
        if self.quantize != Quantize::None {
            return Err(Error::InvalidInput(format!(
                "--quantize {}: DeepSeek-V4's routed experts are read as published (FP4 or \
                 float); no other quantization applies to it",
                self.quantize
            )));
        }
        Ok(Precision {
            kv_cache,
            ..Precision::all(weights)
        })
    }

    /// The dtypes to serve a model of `cfg`, saved in `saved` (the checkpoint's float dtype,
    /// `None` if unknown), in. Fails on a dtype weights cannot be held in and on
    /// `--quantize experts-int8|experts-int4` for a model without routed experts (and int4 with
    /// an odd expert width).
    pub fn resolve(&self, saved: Option<DType>, cfg: &ModelConfig) -> Result<Precision> {
        if cfg.v4.is_some() {
            return self.v4(saved);
        }
        let weights = match self.dtype {
            DTypeChoice::Exactly(d) => d,
            DTypeChoice::Auto => saved.unwrap_or(DType::F32),
        };
        let kv_cache = match self.kv_dtype {
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
        if self.quantize.quantizes_experts() && cfg.routing.is_none() {
            return Err(Error::InvalidInput(format!(
                "--quantize {}: this model has no routed experts (config.json sets no \
                 n_routed_experts)",
                self.quantize
            )));
        }
        if self.quantize == Quantize::ExpertsInt4 {
            for (key, width) in [
                ("hidden_size", cfg.hidden_size),
                ("moe_intermediate_size", cfg.moe_intermediate_size),
            ] {
                if width % 2 == 1 {
                    return Err(Error::InvalidInput(format!(
                        "--quantize experts-int4 packs two codes a byte along each expert's \
                         input, and config.json's {key} is odd ({width}); use experts-int8"
                    )));
                }
            }
        }
        Ok(Precision {
            weights,
            kv_cache,
            quantize: self.quantize,
            dots: Dots::Widen,
        })
    }
}

/// In which dtype a matmul with a reduced-precision operand multiplies (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dots {
    /// Reduced-precision operands widened to f32, the product in f32: the CPU backend's policy,
    /// free for it (its kernels widen tiles as they read them) and the most accurate.
    #[default]
    Widen,
    /// The f32 operand split into two parts of the other's reduced dtype, both multiplied in
    /// one dot of narrow operands into f32: a NeuronCore's matmul units at their bf16 rate
    /// with f32's accuracy to within what the fixtures measure; every device graph's policy.
    Split,
    /// The f32 operand rounded once to the other's reduced dtype, one dot of narrow operands
    /// into f32: half Split's arithmetic, at a measured cost in accuracy (module docs).
    Narrow,
}

impl Dots {
    /// The policy of every graph a NeuronCore runs (and so nrt-sim's and `lower`'s default).
    pub const DEVICE: Dots = Dots::Split;
}

impl FromStr for Dots {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "widen" => Ok(Dots::Widen),
            "split" => Ok(Dots::Split),
            "narrow" => Ok(Dots::Narrow),
            other => Err(Error::InvalidInput(format!(
                "dots `{other}`: expected widen (f32 products, the CPU's), split (bf16 products \
                 of a two-part activation, a NeuronCore's) or narrow (one bf16 product)"
            ))),
        }
    }
}

impl fmt::Display for Dots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dots::Widen => "widen",
            Dots::Split => "split",
            Dots::Narrow => "narrow",
        })
    }
}

/// The dtypes a model is served in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Every weight (the router's and quantized experts excepted, see [`super::params`]).
    pub weights: DType,
    /// The KV cache.
    pub kv_cache: DType,
    /// Weight-only quantization.
    pub quantize: Quantize,
    /// In which dtype matmuls with reduced-precision operands multiply.
    pub dots: Dots,
}

impl Precision {
    /// Everything in f32.
    pub const F32: Precision = Precision::all(DType::F32);

    /// Weights and cache in `dtype`, nothing quantized.
    pub const fn all(dtype: DType) -> Self {
        Precision {
            weights: dtype,
            kv_cache: dtype,
            quantize: Quantize::None,
            dots: Dots::Widen,
        }
    }

    /// This precision with matmuls multiplying in `dots`.
    pub const fn with_dots(self, dots: Dots) -> Self {
        Precision { dots, ..self }
    }

    /// The dtype quantized experts' codes are converted to for their matmul: the weights'
    /// dtype under [`Dots::Split`] and [`Dots::Narrow`], f32 under [`Dots::Widen`].
    pub fn expert_dot_dtype(&self) -> DType {
        match self.dots {
            Dots::Split | Dots::Narrow => self.weights,
            Dots::Widen => DType::F32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(dtype: &str, kv: &str, quantize: &str, saved: DType) -> Result<Precision> {
        let cfg = crate::config::ModelConfig::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-v3/config.json"),
        )?;
        PrecisionChoice {
            dtype: dtype.parse()?,
            kv_dtype: kv.parse()?,
            quantize: quantize.parse()?,
        }
        .resolve(Some(saved), &cfg)
    }

    /// DeepSeek-V4's `auto`: its matrices in bf16 from a bf16 checkpoint (the published FP8
    /// ones included), else f32 (an f16 one too: V4 holds no f16); the caches as the matrices.
    #[test]
    fn v4_auto_follows_a_bf16_checkpoint_and_the_cache_follows_the_matrices() {
        let choice = |dtype: &str, kv: &str| PrecisionChoice {
            dtype: dtype.parse().unwrap(),
            kv_dtype: kv.parse().unwrap(),
            quantize: Quantize::None,
        };
        let auto = choice("auto", "auto");
        for (saved, held) in [
            (Some(DType::BF16), DType::BF16),
            (Some(DType::F32), DType::F32),
            (Some(DType::F16), DType::F32),
            (None, DType::F32),
        ] {
            assert_eq!(auto.v4(saved).unwrap(), Precision::all(held), "{saved:?}");
        }
        let p = choice("auto", "f32").v4(Some(DType::BF16)).unwrap();
        assert_eq!((p.weights, p.kv_cache), (DType::BF16, DType::F32));
        let p = choice("f32", "auto").v4(Some(DType::BF16)).unwrap();
        assert_eq!(p, Precision::all(DType::F32));
        let err = choice("f16", "auto").v4(None).unwrap_err().to_string();
        assert!(err.contains("--dtype f16"), "{err}");
    }

    #[test]
    fn auto_follows_the_checkpoint_and_the_cache_follows_the_weights() {
        let p = resolve("auto", "auto", "none", DType::BF16).unwrap();
        assert_eq!(p, Precision::all(DType::BF16));
        let p = resolve("auto", "f32", "none", DType::BF16).unwrap();
        assert_eq!((p.weights, p.kv_cache), (DType::BF16, DType::F32));
        assert_eq!(
            resolve("f32", "auto", "none", DType::BF16).unwrap(),
            Precision::F32
        );
        let p = resolve("auto", "auto", "experts-int8", DType::BF16).unwrap();
        assert_eq!(p.quantize, Quantize::ExpertsInt8);
        assert!("int4".parse::<DTypeChoice>().is_err());
        assert!("int4".parse::<Quantize>().is_err());
    }
}
