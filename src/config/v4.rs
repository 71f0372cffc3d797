//! `config.json` of a DeepSeek-V4 checkpoint (`model_type: deepseek_v4`), read into a
//! [`V4Config`].
//!
//! V4 is not MLA (no `kv_lora_rank`, no dense layers; see `docs/deepseek-v4.md`), so it has a
//! config of its own. Both spellings transformers 5.25 reads are accepted, as its
//! `DeepseekV4Config.__post_init__` folds them:
//!
//! | modern key | legacy key(s) |
//! |---|---|
//! | `layer_types` (`sliding_attention`, `compressed_sparse_attention`, `heavily_compressed_attention`) | `compress_ratios` (0, 4, 128 per layer: the rate picks the type) |
//! | `compress_rates` (`{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}`) | `compress_rate_csa`, `compress_rate_hca` (they override the object's entries) |
//! | `mlp_layer_types` (`hash_moe`, `moe`) | `num_hash_layers` (that many `hash_moe` first, default 3) |
//! | `partial_rotary_factor` | `qk_rope_head_dim` (`/ head_dim`); default 64 / 512 |
//! | `rope_parameters: {"main": {...}, "compress": {...}}` | a flat `rope_parameters` / `rope_scaling` (its YaRN keys apply to the compressed layers' RoPE, whose theta is `compress_rope_theta`) |
//!
//! Without `layer_types` or `compress_ratios`, transformers' default schedule applies (two HCA
//! layers, then CSA and HCA alternating). YaRN on the compressed layers' RoPE takes
//! `attention_factor` 1 (transformers forces it: V4 does not scale cos/sin); any other value is
//! refused. As for V2/V3, the keys that fix a tensor's shape are required; the rest take
//! transformers' class defaults.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::messages::{invalid, missing_because, unsupported};
use super::quantization;
use super::raw::{self, RawRope};
use super::resolve::{required_positive, saved_dtype};
use super::{value, Architecture, ModelConfig, RopeConfig, YarnConfig};
use crate::error::{Error, Result};
use crate::graph::DType;

/// A layer's attention (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Attention {
    /// `sliding_attention`: the sliding window only.
    Sliding,
    /// `compressed_sparse_attention` (CSA): the window plus the compressed entries the
    /// lightning indexer selects.
    CompressedSparse,
    /// `heavily_compressed_attention` (HCA): the window plus every compressed entry.
    HeavilyCompressed,
}

impl V4Attention {
    /// The name transformers' `layer_types` uses.
    pub fn name(self) -> &'static str {
        match self {
            V4Attention::Sliding => "sliding_attention",
            V4Attention::CompressedSparse => "compressed_sparse_attention",
            V4Attention::HeavilyCompressed => "heavily_compressed_attention",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [
            V4Attention::Sliding,
            V4Attention::CompressedSparse,
            V4Attention::HeavilyCompressed,
        ]
        .into_iter()
        .find(|a| a.name() == name)
    }
}

/// How a layer's MoE picks its experts (`mlp_layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Routing {
    /// `hash_moe`: the checkpoint's `tid2eid[token_id]` table.
    Hash,
    /// `moe`: the top `k` of the scores plus the correction bias.
    TopK,
}

/// The router's score function (`scoring_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Scoring {
    /// `sqrtsoftplus`: `sqrt(softplus(logit))`, V4's.
    SqrtSoftplus,
    /// `sigmoid`.
    Sigmoid,
}

/// How a checkpoint stores its routed experts (`expert_dtype`, at the top level as V4-Flash
/// publishes it or inside `quantization_config` as V4.1 does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Experts {
    /// As the other linear weights: floats, or FP8 with block scales (`expert_dtype: fp8`,
    /// V4-Flash-Base), dequantized when read.
    Float,
    /// FP4 E2M1 codes two a byte (I8 `[out, in / 2]`, the even value in the low nibble) with
    /// one power-of-two scale per [`FP4_GROUP`] inputs (`<name>.scale`, F8_E8M0 `[out, in /
    /// 32]`): `expert_dtype: fp4`, V4-Flash's. Held as stored and dequantized in the graph
    /// where an expert is used.
    Fp4,
}

/// Inputs of an output channel that share one scale in an FP4 expert (OCP MX's block).
pub const FP4_GROUP: usize = 32;

/// CSA's lightning indexer (`index_n_heads`, `index_head_dim`, `index_topk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V4Indexer {
    /// `index_n_heads`.
    pub heads: usize,
    /// `index_head_dim`.
    pub head_dim: usize,
    /// `index_topk`: compressed entries each query keeps.
    pub topk: usize,
}

/// A DeepSeek-V4 model's shape and behaviour, resolved from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct V4Config {
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `head_dim`: the width of each query head and of the one shared K=V head.
    pub head_dim: usize,
    /// The rotated (trailing) channels of a head: `head_dim x partial_rotary_factor`.
    pub rope_dim: usize,
    /// `q_lora_rank`.
    pub q_lora_rank: usize,
    /// Each layer's attention: the decoder's, then the MTP layers in use ([`V4Config::with_draft_layer`]).
    pub attention: Vec<V4Attention>,
    /// Each layer's expert selection, as [`V4Config::attention`].
    pub routing: Vec<V4Routing>,
    /// CSA's compress rate.
    pub csa_rate: usize,
    /// HCA's compress rate.
    pub hca_rate: usize,
    /// `sliding_window`.
    pub sliding_window: usize,
    /// `o_groups`.
    pub o_groups: usize,
    /// `o_lora_rank`.
    pub o_lora_rank: usize,
    /// The indexer; `None` when no layer is CSA.
    pub indexer: Option<V4Indexer>,
    /// `n_routed_experts`.
    pub n_routed_experts: usize,
    /// `num_experts_per_tok`.
    pub num_experts_per_tok: usize,
    /// `moe_intermediate_size`: one expert's width (the shared expert's too).
    pub moe_intermediate_size: usize,
    /// `scoring_func`.
    pub scoring: V4Scoring,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f64,
    /// `swiglu_limit`: the clamp of the experts' gate and up projections.
    pub swiglu_limit: f64,
    /// `hc_mult`: residual streams.
    pub hc_mult: usize,
    /// `hc_sinkhorn_iters`.
    pub hc_sinkhorn_iters: usize,
    /// `hc_eps`.
    pub hc_eps: f64,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// The sliding-only layers' RoPE (`rope_parameters.main`: `rope_theta`, never YaRN).
    pub main_rope: RopeConfig,
    /// The compressed layers' and compressors' RoPE (`compress_rope_theta`, YaRN when given).
    pub compress_rope: RopeConfig,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `num_nextn_predict_layers`: MTP layers in the checkpoint.
    pub num_nextn_predict_layers: usize,
    /// The MTP layers in use (0 or 1): the layers after the decoder's in
    /// [`V4Config::attention`] and [`V4Config::routing`], published as `mtp.{k}.*`.
    pub draft_layers: usize,
    /// `quantization_config.weight_block_size`: the `[rows, cols]` block of an FP8
    /// checkpoint's weight scales, `None` for a checkpoint without FP8 weights.
    pub fp8_block: Option<[usize; 2]>,
    /// How the routed experts are stored.
    pub experts: V4Experts,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// `bos_token_id`, when set.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`, empty when absent.
    pub eos_token_ids: Vec<u32>,
    /// `dtype` (or `torch_dtype`) when it names f32, bf16 or f16: what the unquantized weights
    /// were saved in (bf16 in the published checkpoints), which `--dtype auto` follows when
    /// only config.json is at hand.
    pub saved_dtype: Option<DType>,
}

/// The keys of a V4 `config.json` deepinfer reads (see [`super::raw`] for the conventions).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawV4 {
    #[serde(deserialize_with = "value::string")]
    hidden_act: Option<String>,
    #[serde(deserialize_with = "value::flag")]
    attention_bias: Option<bool>,
    #[serde(deserialize_with = "value::flag")]
    mlp_bias: Option<bool>,
    #[serde(deserialize_with = "value::size_or_null")]
    vocab_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    hidden_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    num_hidden_layers: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    num_attention_heads: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size")]
    num_key_value_heads: Option<usize>,
    #[serde(deserialize_with = "value::size_or_null")]
    head_dim: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    q_lora_rank: Option<Option<usize>>,
    #[serde(deserialize_with = "value::number")]
    partial_rotary_factor: Option<f64>,
    #[serde(deserialize_with = "value::size")]
    qk_rope_head_dim: Option<usize>,
    layer_types: Option<Vec<String>>,
    compress_ratios: Option<Vec<usize>>,
    #[serde(deserialize_with = "value::object")]
    compress_rates: Option<Map<String, Value>>,
    #[serde(deserialize_with = "value::size")]
    compress_rate_csa: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    compress_rate_hca: Option<usize>,
    mlp_layer_types: Option<Vec<String>>,
    #[serde(deserialize_with = "value::size")]
    num_hash_layers: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    sliding_window: Option<usize>,
    #[serde(deserialize_with = "value::size_or_null")]
    o_groups: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    o_lora_rank: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size")]
    index_n_heads: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    index_head_dim: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    index_topk: Option<usize>,
    #[serde(deserialize_with = "value::size_or_null")]
    n_routed_experts: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    num_experts_per_tok: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size")]
    n_shared_experts: Option<usize>,
    #[serde(deserialize_with = "value::size_or_null")]
    moe_intermediate_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::string")]
    scoring_func: Option<String>,
    #[serde(deserialize_with = "value::number")]
    routed_scaling_factor: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    swiglu_limit: Option<f64>,
    #[serde(deserialize_with = "value::size")]
    hc_mult: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    hc_sinkhorn_iters: Option<usize>,
    #[serde(deserialize_with = "value::number")]
    hc_eps: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    rms_norm_eps: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    rope_theta: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    compress_rope_theta: Option<f64>,
    #[serde(deserialize_with = "value::object")]
    rope_parameters: Option<Map<String, Value>>,
    #[serde(deserialize_with = "value::object")]
    rope_scaling: Option<Map<String, Value>>,
    #[serde(deserialize_with = "value::size")]
    max_position_embeddings: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    num_nextn_predict_layers: Option<usize>,
    #[serde(deserialize_with = "value::object")]
    quantization_config: Option<Map<String, Value>>,
    #[serde(deserialize_with = "value::string")]
    expert_dtype: Option<String>,
    #[serde(deserialize_with = "value::flag")]
    tie_word_embeddings: Option<bool>,
    #[serde(deserialize_with = "value::token_id")]
    bos_token_id: Option<u32>,
    #[serde(deserialize_with = "value::token_ids")]
    eos_token_id: Option<Vec<u32>>,
    #[serde(deserialize_with = "value::string")]
    torch_dtype: Option<String>,
    #[serde(deserialize_with = "value::string")]
    dtype: Option<String>,
}

/// transformers 5.25's `DeepseekV4Config` defaults for the keys that do not fix a shape.
const DEFAULT_NUM_HASH_LAYERS: usize = 3;
const DEFAULT_CSA_RATE: usize = 4;
const DEFAULT_HCA_RATE: usize = 128;
const DEFAULT_ROPE_FACTOR: f64 = 64.0 / 512.0;

impl V4Config {
    /// Parses and checks the text of a V4 `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("not valid JSON: {e}")))?;
        let object = json.as_object().ok_or_else(|| {
            Error::Config(format!(
                "expected a JSON object at the top level, got {}",
                value::kind(&json)
            ))
        })?;
        Self::from_object(object)
    }

    /// Reads `path` when it is a DeepSeek-V4 `config.json` (`model_type: deepseek_v4`);
    /// `None` for any other model (whose errors [`super::ModelConfig::from_file`] reports).
    pub fn from_file_if_v4(path: &std::path::Path) -> Result<Option<Self>> {
        let Ok(text) = std::fs::read_to_string(path) else {
            return Ok(None);
        };
        let Ok(Value::Object(object)) = serde_json::from_str::<Value>(&text) else {
            return Ok(None);
        };
        match object.get("model_type").and_then(Value::as_str) {
            Some("deepseek_v4") => Self::from_object(&object).map(Some),
            _ => Ok(None),
        }
    }

    /// Reads a V4 `config.json` already parsed (its `model_type` is the caller's business).
    pub(super) fn from_object(object: &Map<String, Value>) -> Result<Self> {
        let raw: RawV4 = raw::read(object, "")?;
        resolve(&raw)
    }

    /// The decoder's layers whose attention is `kind`.
    pub fn layers_of(&self, kind: V4Attention) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_hidden_layers).filter(move |&l| self.attention[l] == kind)
    }

    /// `self` with its first MTP layer in use, as layer `num_hidden_layers`: a full V4 block
    /// with sliding-window attention only (its `compress_ratios` entry is 0: DeepSeek's
    /// inference code, vLLM's and SGLang's V4 MTP modules) and scored top-k routing (it is never
    /// among the first `num_hash_layers`). Fails when the checkpoint ships no MTP layer.
    pub fn with_draft_layer(&self) -> Result<Self> {
        if self.num_nextn_predict_layers == 0 {
            return Err(Error::Config(
                "this checkpoint has no multi-token-prediction layer to draft with                  (`num_nextn_predict_layers` is 0 in config.json, so there are no `mtp.0.*`                  tensors); serve it without speculative decoding"
                    .into(),
            ));
        }
        let mut cfg = self.clone();
        if cfg.draft_layers == 0 {
            cfg.draft_layers = 1;
            cfg.attention.push(V4Attention::Sliding);
            cfg.routing.push(V4Routing::TopK);
        }
        Ok(cfg)
    }

    /// Layer `l`'s published prefix: `layers.{l}` for the decoder's, `mtp.{k}` for the `k`-th
    /// MTP layer (layer `num_hidden_layers + k`).
    pub fn layer_prefix(&self, l: usize) -> String {
        match l.checked_sub(self.num_hidden_layers) {
            Some(k) => format!("mtp.{k}"),
            None => format!("layers.{l}"),
        }
    }
}

fn resolve(raw: &RawV4) -> Result<V4Config> {
    if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
        return Err(unsupported(
            "hidden_act",
            format!("{act:?}"),
            "deepinfer implements silu",
        ));
    }
    for (key, set) in [
        ("attention_bias", raw.attention_bias),
        ("mlp_bias", raw.mlp_bias),
    ] {
        if set == Some(true) {
            return Err(unsupported(key, true, "DeepSeek-V4 has no biases"));
        }
    }
    let vocab_size = required_positive("vocab_size", raw.vocab_size)?;
    let hidden_size = required_positive("hidden_size", raw.hidden_size)?;
    let num_hidden_layers = required_positive("num_hidden_layers", raw.num_hidden_layers)?;
    let num_attention_heads = required_positive("num_attention_heads", raw.num_attention_heads)?;
    let head_dim = required_positive("head_dim", raw.head_dim)?;
    let q_lora_rank = required_positive("q_lora_rank", raw.q_lora_rank)?;
    if let Some(kv) = raw.num_key_value_heads.filter(|&n| n != 1) {
        return Err(unsupported(
            "num_key_value_heads",
            kv,
            "DeepSeek-V4 shares one K=V head",
        ));
    }
    let rope_dim = rope_dim(raw, head_dim)?;
    let attention = attention_types(raw, num_hidden_layers)?;
    let routing = routing_types(raw, num_hidden_layers)?;
    let (csa_rate, hca_rate) = compress_rates(raw)?;

    let sliding_window = raw.sliding_window.unwrap_or(128);
    if sliding_window == 0 {
        return Err(invalid("sliding_window", 0, "must be at least 1"));
    }
    let o_groups = required_positive("o_groups", raw.o_groups)?;
    if !num_attention_heads.is_multiple_of(o_groups) {
        return Err(invalid(
            "o_groups",
            o_groups,
            &format!("must divide num_attention_heads ({num_attention_heads})"),
        ));
    }
    let o_lora_rank = required_positive("o_lora_rank", raw.o_lora_rank)?;
    let indexer = match attention.contains(&V4Attention::CompressedSparse) {
        false => None,
        true => Some(indexer(raw)?),
    };

    let n_routed_experts = required_positive("n_routed_experts", raw.n_routed_experts)?;
    let num_experts_per_tok = required_positive("num_experts_per_tok", raw.num_experts_per_tok)?;
    if num_experts_per_tok > n_routed_experts {
        return Err(invalid(
            "num_experts_per_tok",
            num_experts_per_tok,
            &format!("exceeds n_routed_experts ({n_routed_experts})"),
        ));
    }
    let moe_intermediate_size =
        required_positive("moe_intermediate_size", raw.moe_intermediate_size)?;
    let n_shared_experts = raw.n_shared_experts.unwrap_or(1);
    if n_shared_experts != 1 {
        return Err(unsupported(
            "n_shared_experts",
            n_shared_experts,
            "DeepSeek-V4 has one shared expert as wide as a routed one (transformers builds one \
             whatever this says)",
        ));
    }
    let scoring = match raw.scoring_func.as_deref().unwrap_or("sqrtsoftplus") {
        "sqrtsoftplus" => V4Scoring::SqrtSoftplus,
        "sigmoid" => V4Scoring::Sigmoid,
        other => {
            return Err(unsupported(
                "scoring_func",
                format!("{other:?}"),
                "deepinfer implements sqrtsoftplus and sigmoid for DeepSeek-V4",
            ))
        }
    };
    let routed_scaling_factor = positive("routed_scaling_factor", raw.routed_scaling_factor, 1.5)?;
    let swiglu_limit = positive("swiglu_limit", raw.swiglu_limit, 10.0)?;
    let hc_mult = raw.hc_mult.unwrap_or(4);
    if hc_mult == 0 {
        return Err(invalid("hc_mult", 0, "must be at least 1"));
    }
    let hc_sinkhorn_iters = raw.hc_sinkhorn_iters.unwrap_or(20);
    if hc_sinkhorn_iters == 0 {
        return Err(invalid("hc_sinkhorn_iters", 0, "must be at least 1"));
    }
    let hc_eps = non_negative("hc_eps", raw.hc_eps, 1e-6)?;
    let rms_norm_eps = non_negative("rms_norm_eps", raw.rms_norm_eps, 1e-6)?;
    let max_position_embeddings = raw.max_position_embeddings.unwrap_or(1 << 20);
    let (main_rope, compress_rope) = ropes(raw, max_position_embeddings)?;
    let fp8_block = quantization::fp8_block(raw.quantization_config.as_ref())?;
    let experts = expert_storage(raw, hidden_size, moe_intermediate_size)?;
    Ok(V4Config {
        vocab_size,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        head_dim,
        rope_dim,
        q_lora_rank,
        attention,
        routing,
        csa_rate,
        hca_rate,
        sliding_window,
        o_groups,
        o_lora_rank,
        indexer,
        n_routed_experts,
        num_experts_per_tok,
        moe_intermediate_size,
        scoring,
        routed_scaling_factor,
        swiglu_limit,
        hc_mult,
        hc_sinkhorn_iters,
        hc_eps,
        rms_norm_eps,
        main_rope,
        compress_rope,
        max_position_embeddings,
        num_nextn_predict_layers: raw.num_nextn_predict_layers.unwrap_or(1),
        draft_layers: 0,
        fp8_block,
        experts,
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        bos_token_id: raw.bos_token_id,
        eos_token_ids: raw.eos_token_id.clone().unwrap_or_default(),
        saved_dtype: saved_dtype(raw.dtype.as_deref().or(raw.torch_dtype.as_deref())),
    })
}

/// How the routed experts are stored: `expert_dtype` at the top level (V4-Flash) or in
/// `quantization_config` (V4.1). Without it, a quantized checkpoint's experts are FP4, as
/// V4-Flash's first published config.json says nothing and vLLM assumes the same; the check of
/// the checkpoint's tensors names an expert stored otherwise.
fn expert_storage(raw: &RawV4, hidden: usize, width: usize) -> Result<V4Experts> {
    let quantization = raw.quantization_config.as_ref();
    let nested = quantization
        .and_then(|q| q.get("expert_dtype"))
        .and_then(Value::as_str);
    let storage = match raw.expert_dtype.as_deref().or(nested) {
        Some("fp4") => V4Experts::Fp4,
        Some("fp8" | "bf16" | "float32") => V4Experts::Float,
        Some(other) => {
            return Err(unsupported(
                "expert_dtype",
                format!("{other:?}"),
                "deepinfer reads DeepSeek-V4's routed experts as fp4 or fp8",
            ))
        }
        None if quantization.is_some() => V4Experts::Fp4,
        None => V4Experts::Float,
    };
    if storage == V4Experts::Fp4 {
        for (key, n) in [("hidden_size", hidden), ("moe_intermediate_size", width)] {
            if !n.is_multiple_of(FP4_GROUP) {
                return Err(invalid(
                    key,
                    n,
                    "FP4 experts hold one scale per 32 inputs, so their input widths are \
                     multiples of 32",
                ));
            }
        }
    }
    Ok(storage)
}

/// The rotated channels: `partial_rotary_factor` (top level, or in a RoPE object), else the
/// legacy `qk_rope_head_dim / head_dim`, else 64 / 512; even, at least 2 and at most `head_dim`.
fn rope_dim(raw: &RawV4, head_dim: usize) -> Result<usize> {
    let (key, factor) = match (raw.partial_rotary_factor, raw.qk_rope_head_dim) {
        (Some(f), _) => ("partial_rotary_factor", f),
        (None, Some(d)) => ("qk_rope_head_dim", d as f64 / head_dim as f64),
        (None, None) => ("partial_rotary_factor", DEFAULT_ROPE_FACTOR),
    };
    // transformers: `int(head_dim * partial_rotary_factor)`.
    let dim = (head_dim as f64 * factor).floor();
    if !(2.0..=head_dim as f64).contains(&dim) || !(dim as usize).is_multiple_of(2) {
        return Err(invalid(
            key,
            if key == "qk_rope_head_dim" {
                dim
            } else {
                factor
            },
            &format!(
                "the rotated channels ({dim} of head_dim {head_dim}) must be even, at least 2 \
                 and at most head_dim"
            ),
        ));
    }
    Ok(dim as usize)
}

/// `layer_types`, else the legacy `compress_ratios`, else transformers' default schedule.
fn attention_types(raw: &RawV4, layers: usize) -> Result<Vec<V4Attention>> {
    let types = match (&raw.layer_types, &raw.compress_ratios) {
        (Some(names), _) => names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                V4Attention::from_name(n).ok_or_else(|| {
                    unsupported(
                        &format!("layer_types[{i}]"),
                        format!("{n:?}"),
                        "DeepSeek-V4's are sliding_attention, compressed_sparse_attention and \
                         heavily_compressed_attention",
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?,
        (None, Some(ratios)) => ratios
            .iter()
            .enumerate()
            .map(|(i, &r)| match r {
                0 => Ok(V4Attention::Sliding),
                4 => Ok(V4Attention::CompressedSparse),
                128 => Ok(V4Attention::HeavilyCompressed),
                other => Err(unsupported(
                    &format!("compress_ratios[{i}]"),
                    other,
                    "the legacy ratios are 0 (sliding), 4 (CSA) and 128 (HCA)",
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        (None, None) => (0..layers)
            .map(|i| match (i < 2, i % 2) {
                (true, _) | (false, 0) => V4Attention::HeavilyCompressed,
                (false, _) => V4Attention::CompressedSparse,
            })
            .collect(),
    };
    let key = match raw.layer_types {
        Some(_) => "layer_types",
        None => "compress_ratios",
    };
    // transformers refuses a `layer_types` of another length (validate_layer_type) and cuts a
    // longer legacy list to the layers (`[:n]`): the MTP layers' entries follow the model's.
    if types.len() < layers || (raw.layer_types.is_some() && types.len() != layers) {
        return Err(invalid(
            key,
            format!("of {} entries", types.len()),
            &format!("needs one per layer (num_hidden_layers {layers})"),
        ));
    }
    Ok(types.into_iter().take(layers).collect())
}

/// `mlp_layer_types`, else `num_hash_layers` (default 3) `hash_moe` layers and then `moe`.
fn routing_types(raw: &RawV4, layers: usize) -> Result<Vec<V4Routing>> {
    let Some(names) = &raw.mlp_layer_types else {
        let hash = raw.num_hash_layers.unwrap_or(DEFAULT_NUM_HASH_LAYERS);
        return Ok((0..layers)
            .map(|l| match l < hash {
                true => V4Routing::Hash,
                false => V4Routing::TopK,
            })
            .collect());
    };
    if names.len() != layers {
        return Err(invalid(
            "mlp_layer_types",
            format!("of {} entries", names.len()),
            &format!("needs one per layer (num_hidden_layers {layers})"),
        ));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, n)| match n.as_str() {
            "hash_moe" => Ok(V4Routing::Hash),
            "moe" => Ok(V4Routing::TopK),
            other => Err(unsupported(
                &format!("mlp_layer_types[{i}]"),
                format!("{other:?}"),
                "DeepSeek-V4's are hash_moe and moe",
            )),
        })
        .collect()
}

/// CSA's and HCA's rates: `compress_rates`' entries, overridden by the legacy scalars.
fn compress_rates(raw: &RawV4) -> Result<(usize, usize)> {
    let entry = |name: &str, default: usize| -> Result<usize> {
        match raw.compress_rates.as_ref().and_then(|m| m.get(name)) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                Error::Config(format!(
                    "compress_rates.{name} {}",
                    value::must_be(value::SIZE, v)
                ))
            }),
        }
    };
    let csa = raw.compress_rate_csa.map_or_else(
        || entry("compressed_sparse_attention", DEFAULT_CSA_RATE),
        Ok,
    )?;
    let hca = raw.compress_rate_hca.map_or_else(
        || entry("heavily_compressed_attention", DEFAULT_HCA_RATE),
        Ok,
    )?;
    for (key, rate) in [
        ("compress_rates.compressed_sparse_attention", csa),
        ("compress_rates.heavily_compressed_attention", hca),
    ] {
        if rate < 2 {
            return Err(invalid(key, rate, "must be at least 2"));
        }
    }
    Ok((csa, hca))
}

/// The indexer of a model with CSA layers: its three keys fix shapes, so they are required.
fn indexer(raw: &RawV4) -> Result<V4Indexer> {
    let why = "the model has compressed_sparse_attention layers";
    let get = |key: &str, v: Option<usize>| -> Result<usize> {
        let n = v.ok_or_else(|| missing_because(key, why))?;
        if n == 0 {
            return Err(invalid(key, 0, "must be at least 1"));
        }
        Ok(n)
    };
    Ok(V4Indexer {
        heads: get("index_n_heads", raw.index_n_heads)?,
        head_dim: get("index_head_dim", raw.index_head_dim)?,
        topk: get("index_topk", raw.index_topk)?,
    })
}

/// The two RoPEs. transformers nests them as `rope_parameters.main` / `.compress`; a flat object
/// (`rope_parameters`, else a non-empty `rope_scaling`) holds the compressed layers' YaRN, with
/// `compress_rope_theta` as their base and `rope_theta` as the sliding layers'.
fn ropes(raw: &RawV4, max_position_embeddings: usize) -> Result<(RopeConfig, RopeConfig)> {
    let main_theta = raw.rope_theta.unwrap_or(10_000.0);
    let compress_theta = raw.compress_rope_theta.unwrap_or(160_000.0);
    let nested = raw.rope_parameters.as_ref().and_then(|p| {
        match (p.get("main").and_then(Value::as_object), p.get("compress")) {
            (Some(main), Some(Value::Object(compress))) => Some((main, compress)),
            _ => None,
        }
    });
    if let Some((main, compress)) = nested {
        let main = rope_object(
            "rope_parameters.main",
            main,
            main_theta,
            max_position_embeddings,
        )?;
        if main.yarn.is_some() {
            return Err(unsupported(
                "rope_parameters.main.rope_type",
                "\"yarn\"",
                "DeepSeek-V4's sliding layers use plain RoPE",
            ));
        }
        let compress = rope_object(
            "rope_parameters.compress",
            compress,
            compress_theta,
            max_position_embeddings,
        )?;
        return Ok((main, compress));
    }
    let flat = match &raw.rope_scaling {
        Some(o) if !o.is_empty() => Some(("rope_scaling", o)),
        _ => raw.rope_parameters.as_ref().map(|o| ("rope_parameters", o)),
    };
    let main = RopeConfig {
        theta: main_theta,
        yarn: None,
    };
    let compress = match flat {
        None => RopeConfig {
            theta: compress_theta,
            yarn: None,
        },
        // The flat object's own rope_theta is the main one in transformers (`rope_theta` is
        // copied in); the compressed layers take compress_rope_theta whatever it says.
        Some((name, object)) => {
            let mut object = object.clone();
            object.remove("rope_theta");
            rope_object(name, &object, compress_theta, max_position_embeddings)?
        }
    };
    if main.theta <= 0.0 {
        return Err(invalid("rope_theta", main.theta, "must be positive"));
    }
    Ok((main, compress))
}

/// One RoPE object (`name` for errors): `default` or `yarn` (with `attention_factor` 1 or
/// absent), its `rope_theta` else `theta`.
fn rope_object(
    name: &str,
    object: &Map<String, Value>,
    theta: f64,
    max_position_embeddings: usize,
) -> Result<RopeConfig> {
    let keys: RawRope = raw::read(object, &format!("{name}."))?;
    let theta = keys.rope_theta.unwrap_or(theta);
    if theta <= 0.0 {
        return Err(invalid(
            &format!("{name}.rope_theta"),
            theta,
            "must be positive",
        ));
    }
    let rope_type = keys
        .rope_type
        .as_deref()
        .or(keys.type_.as_deref())
        .unwrap_or("default");
    match rope_type {
        "default" => Ok(RopeConfig { theta, yarn: None }),
        "yarn" => {
            if let Some(v) = keys
                .attention_factor
                .as_ref()
                .filter(|v| v.as_f64() != Some(1.0))
            {
                return Err(unsupported(
                    &format!("{name}.attention_factor"),
                    v,
                    "DeepSeek-V4 does not scale its RoPE (transformers forces 1.0)",
                ));
            }
            let path = |key: &str| format!("{name}.{key}");
            let yarn = super::rope::yarn_keys(&keys, &path, None, max_position_embeddings)?;
            Ok(RopeConfig {
                theta,
                // attention_factor 1: cos and sin are not scaled, whatever mscale says.
                yarn: Some(YarnConfig {
                    mscale: None,
                    mscale_all_dim: None,
                    ..yarn
                }),
            })
        }
        other => Err(unsupported(
            &format!("{name}.rope_type"),
            format!("{other:?}"),
            "deepinfer implements \"default\" and \"yarn\"",
        )),
    }
}

/// A positive number, `default` when absent.
fn positive(key: &str, v: Option<f64>, default: f64) -> Result<f64> {
    let x = v.unwrap_or(default);
    if x <= 0.0 {
        return Err(invalid(key, x, "must be positive"));
    }
    Ok(x)
}

/// A number at least 0, `default` when absent.
fn non_negative(key: &str, v: Option<f64>, default: f64) -> Result<f64> {
    let x = v.unwrap_or(default);
    if x < 0.0 {
        return Err(invalid(key, x, "must not be negative"));
    }
    Ok(x)
}

impl V4Config {
    /// The [`ModelConfig`] the runners, the engine and the server read: what every model has
    /// (vocabulary, layers, heads, context, special tokens) from this config, the MLA-only
    /// widths at what V4's heads are (`head_dim`, its rotated tail), no MLA router, and this
    /// config itself in [`ModelConfig::v4`], which the graph builders, cache roots and weights
    /// dispatch on.
    pub fn into_model_config(self) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::DeepseekV4,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.moe_intermediate_size,
            moe_intermediate_size: self.moe_intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            q_lora_rank: Some(self.q_lora_rank),
            kv_lora_rank: 0,
            qk_nope_head_dim: self.head_dim - self.rope_dim,
            qk_rope_head_dim: self.rope_dim,
            v_head_dim: self.head_dim,
            routing: None,
            n_shared_experts: 1,
            first_k_dense_replace: 0,
            moe_layer_freq: 1,
            rms_norm_eps: self.rms_norm_eps,
            rope: self.main_rope.clone(),
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
            fp8_block: None,
            indexer: None,
            saved_dtype: self.saved_dtype,
            num_nextn_predict_layers: self.num_nextn_predict_layers,
            draft_layers: 0,
            draft_shares_embeddings: false,
            v4: Some(std::sync::Arc::new(self)),
        }
    }
}

#[cfg(test)]
mod tests;
