//! The keys of `config.json` deepinfer reads, as typed values: the first of two phases.
//!
//! [`RawConfig`] (the top level) and [`RawRope`] (inside `rope_scaling` / `rope_parameters`)
//! mirror config.json's spelling, one field per key, each an `Option` because any key may be
//! absent. Reading them checks each value's JSON type and nothing else; the second phase
//! ([`super::resolve`], [`super::routing`], [`super::rope`]) applies defaults and rejects what
//! deepinfer does not implement, with every key already typed.
//!
//! Keys not listed here are ignored (published configs carry many: `auto_map`,
//! `quantization_config`, training settings). A listed key with the wrong type is an error even
//! where its value would not be used (`n_group` under greedy routing, YaRN's keys under plain
//! RoPE): a wrong type there is a broken file, and saying so early beats a surprise later.
//!
//! Reading goes through `serde_path_to_error`, so an error names the key's path
//! (`rope_scaling.factor`) before [`super::value`]'s description of the value.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::value;
use crate::error::{Error, Result};

/// Every top-level key of `config.json` that deepinfer reads.
///
/// Required keys are `Option`s too: [`super::resolve`] names a missing one. `size_or_null`
/// fields are `None` when absent and `Some(None)` when `null`, so that a required size can be
/// told apart from one set to `null`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawConfig {
    // === Which model ===
    #[serde(deserialize_with = "value::string")]
    pub model_type: Option<String>,

    // === Flags deepinfer implements one way only ===
    #[serde(deserialize_with = "value::string")]
    pub hidden_act: Option<String>,
    #[serde(deserialize_with = "value::flag")]
    pub attention_bias: Option<bool>,
    #[serde(deserialize_with = "value::flag")]
    pub mlp_bias: Option<bool>,
    #[serde(deserialize_with = "value::flag")]
    pub rope_interleave: Option<bool>,

    // === Shapes ===
    #[serde(deserialize_with = "value::size_or_null")]
    pub vocab_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub hidden_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub intermediate_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub num_hidden_layers: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub num_attention_heads: Option<Option<usize>>,
    /// `q_lora_rank` (`null` for a plain `q_proj`).
    #[serde(deserialize_with = "value::size_or_null")]
    pub q_lora_rank: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub kv_lora_rank: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub qk_nope_head_dim: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub qk_rope_head_dim: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub v_head_dim: Option<Option<usize>>,
    /// `n_routed_experts` (`null` for a dense model).
    #[serde(deserialize_with = "value::size_or_null")]
    pub n_routed_experts: Option<Option<usize>>,
    /// `moe_intermediate_size` (required only when there are routed experts).
    #[serde(deserialize_with = "value::size_or_null")]
    pub moe_intermediate_size: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size")]
    pub n_shared_experts: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    pub first_k_dense_replace: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    pub moe_layer_freq: Option<usize>,
    #[serde(deserialize_with = "value::number")]
    pub rms_norm_eps: Option<f64>,
    #[serde(deserialize_with = "value::size")]
    pub max_position_embeddings: Option<usize>,
    /// `num_nextn_predict_layers`: the multi-token-prediction layers the checkpoint ships.
    #[serde(deserialize_with = "value::size")]
    pub num_nextn_predict_layers: Option<usize>,

    // === Routing (used when there are routed experts) ===
    #[serde(deserialize_with = "value::string")]
    pub scoring_func: Option<String>,
    #[serde(deserialize_with = "value::string")]
    pub topk_method: Option<String>,
    #[serde(deserialize_with = "value::size")]
    pub num_experts_per_tok: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    pub n_group: Option<usize>,
    #[serde(deserialize_with = "value::size")]
    pub topk_group: Option<usize>,
    #[serde(deserialize_with = "value::flag")]
    pub norm_topk_prob: Option<bool>,
    #[serde(deserialize_with = "value::number")]
    pub routed_scaling_factor: Option<f64>,

    // === RoPE at the top level ===
    /// `rope_scaling`: the published spelling's RoPE object.
    #[serde(deserialize_with = "value::object")]
    pub rope_scaling: Option<Map<String, Value>>,
    /// `rope_parameters`: transformers 5's RoPE object.
    #[serde(deserialize_with = "value::object")]
    pub rope_parameters: Option<Map<String, Value>>,
    /// `rope_theta`, used when the RoPE object has none.
    #[serde(deserialize_with = "value::number")]
    pub rope_theta: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    pub partial_rotary_factor: Option<f64>,
    /// `original_max_position_embeddings`, which wins over the RoPE object's.
    #[serde(deserialize_with = "value::size")]
    pub original_max_position_embeddings: Option<usize>,

    /// `torch_dtype` (transformers 4) or `dtype` (transformers 5): what the weights were saved in.
    #[serde(deserialize_with = "value::string")]
    pub torch_dtype: Option<String>,
    #[serde(deserialize_with = "value::string")]
    pub dtype: Option<String>,
    // === DeepSeek Sparse Attention's indexer (`deepseek_v32`) ===
    #[serde(deserialize_with = "value::size_or_null")]
    pub index_n_heads: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub index_head_dim: Option<Option<usize>>,
    #[serde(deserialize_with = "value::size_or_null")]
    pub index_topk: Option<Option<usize>>,

    /// `quantization_config`: an FP8 checkpoint's scale blocks (see `quantization`).
    #[serde(deserialize_with = "value::object")]
    pub quantization_config: Option<Map<String, Value>>,

    // === Vocabulary ===
    #[serde(deserialize_with = "value::flag")]
    pub tie_word_embeddings: Option<bool>,
    #[serde(deserialize_with = "value::token_id")]
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: one id or a list.
    #[serde(deserialize_with = "value::token_ids")]
    pub eos_token_id: Option<Vec<u32>>,
}

/// The keys of a RoPE object (`rope_scaling` or `rope_parameters`) that deepinfer reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawRope {
    /// `rope_type` (transformers 5), which wins over `type`.
    #[serde(deserialize_with = "value::string")]
    pub rope_type: Option<String>,
    /// `type` (the published spelling).
    #[serde(rename = "type", deserialize_with = "value::string")]
    pub type_: Option<String>,
    /// `rope_theta` (transformers 5 keeps it here).
    #[serde(deserialize_with = "value::number")]
    pub rope_theta: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    pub partial_rotary_factor: Option<f64>,

    // === YaRN ===
    /// `attention_factor`: any value is rejected, so it is kept as the JSON it was.
    pub attention_factor: Option<Value>,
    #[serde(deserialize_with = "value::flag")]
    pub truncate: Option<bool>,
    #[serde(deserialize_with = "value::size")]
    pub original_max_position_embeddings: Option<usize>,
    #[serde(deserialize_with = "value::number")]
    pub factor: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    pub beta_fast: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    pub beta_slow: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    pub mscale: Option<f64>,
    #[serde(deserialize_with = "value::number")]
    pub mscale_all_dim: Option<f64>,
}

/// Reads `T` from a JSON object whose keys are named `{prefix}{key}` in errors (`prefix` is
/// empty at the top level, `rope_scaling.` inside it).
pub(super) fn read<'de, T: Deserialize<'de>>(
    object: &'de Map<String, Value>,
    prefix: &str,
) -> Result<T> {
    serde_path_to_error::deserialize(object).map_err(|e| {
        let path = e.path().to_string();
        let what = e.inner();
        // Every field error has a path; "." (none) is left for a fault of the object as a
        // whole, which a struct of defaulted fields never raises: print the message alone.
        Error::Config(if path == "." {
            what.to_string()
        } else {
            format!("{prefix}{path} {what}")
        })
    })
}
