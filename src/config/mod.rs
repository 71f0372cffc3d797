//! `config.json` of a DeepSeek-V2/V3 checkpoint, normalized into one [`ModelConfig`].
//!
//! Two spellings exist in the wild and both are accepted:
//! - the published checkpoints' (`rope_scaling: {"type": "yarn", ...}`, `rope_theta`,
//!   `scoring_func`, `topk_method`), and
//! - transformers 5's (`rope_parameters: {"rope_type": "yarn", "rope_theta": ..., ...}`).
//!
//! Everything the forward needs is resolved here, once; the model builders never look at JSON.
//! Anything deepinfer does not implement is rejected with an error naming the key and its value,
//! rather than silently computing something else.
//!
//! # Required keys
//!
//! Keys that fix a tensor's shape are required: `model_type`, `vocab_size`, `hidden_size`,
//! `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `q_lora_rank` (`null` for a
//! plain `q_proj`), `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
//! `n_routed_experts` (`null` for a dense model), and `moe_intermediate_size` when there are
//! routed experts. transformers has class defaults for them, but those describe one particular
//! model (V3's defaults are the 671B model), and `save_pretrained` always writes these keys, so a
//! file without them was written by hand; guessing its shapes would only turn a clear config error
//! into a confusing weight-loading one.
//!
//! # Defaults of the other keys
//!
//! An absent (or `null`) behavioural key takes transformers 5.24's default for that
//! `model_type` (`models/deepseek_v{2,3}/configuration_deepseek_v{2,3}.py`, the routers in
//! `modeling_deepseek_v{2,3}.py`, and `modeling_rope_utils.py`):
//!
//! | key | `deepseek_v2` | `deepseek_v3` | where transformers says so |
//! |---|---|---|---|
//! | `scoring_func` | `softmax` | `sigmoid` | no such key in HF: `DeepseekV2TopkRouter.forward` always applies `softmax`, `DeepseekV3TopkRouter.forward` always `sigmoid` |
//! | `topk_method` | `greedy` | `noaux_tc` | V2 `topk_method = "greedy"`; V3 has no key and always adds `e_score_correction_bias` and selects groups |
//! | `n_group`, `topk_group` | required by `group_limited_greedy`, else 1 | 8, 4 | V2 `None` (the router would crash on it), V3 `n_group = 8`, `topk_group = 4` |
//! | `num_experts_per_tok` | required | 8 | V2 `None`, V3 `8` |
//! | `norm_topk_prob` | `false` | `true` | V2 `False`, V3 `True` |
//! | `routed_scaling_factor` | 1.0 | 2.5 | same |
//! | `first_k_dense_replace` | 0 | 3 | same |
//! | `max_position_embeddings` | 2048 | 4096 | same |
//! | `rms_norm_eps` | 1e-6 | 1e-6 | same |
//! | `hidden_act` | `silu` | `silu` | same |
//! | `tie_word_embeddings` | `false` | `false` | same |
//! | `moe_layer_freq` | 1 | 1 | not an HF key (HF ignores it); the original remote code's default |
//! | `n_shared_experts` | 0 | 0 | the original remote code's `None` (HF 5 says 2 / 1, but always writes the key) |
//! | `bos_token_id`, `eos_token_id` | none | none | left to the tokenizer, which knows them too |
//!
//! RoPE (`modeling_rope_utils.py`):
//! - the parameters come from `rope_scaling` when it is a non-empty object, else from
//!   `rope_parameters` (HF's `rope_scaling or self.rope_parameters`);
//! - the type is `rope_type`, else `type`, else `"default"` (`standardize_rope_params`);
//! - `rope_theta` is read inside that object, else at the top level, else 10000
//!   (`RotaryEmbeddingConfigMixin.default_theta`);
//! - YaRN's `original_max_position_embeddings` defaults to `max_position_embeddings` (a top-level
//!   `original_max_position_embeddings` wins, as in `standardize_rope_params`), `factor` to
//!   `max_position_embeddings / original_max_position_embeddings`, and `beta_fast` / `beta_slow`
//!   to 32 / 1, also when they are 0 (HF's `get("beta_fast") or 32`), in
//!   `_compute_yarn_parameters`.
//!
//! # Rejected
//!
//! An unknown `model_type`; a RoPE type other than `default` or `yarn`; YaRN's `attention_factor`
//! or `truncate: false`; a `partial_rotary_factor` other than 1; `rope_interleave: false`;
//! `scoring_func` other than `softmax`/`sigmoid`; an unknown `topk_method`; `noaux_tc` with
//! `softmax`; `n_group` not dividing `n_routed_experts`; `topk_group > n_group`;
//! `num_experts_per_tok` larger than the experts it may choose from; `attention_bias` or
//! `mlp_bias` true; `hidden_act` other than `silu`; an odd `qk_rope_head_dim`; zero sizes.
//!
//! # Ignored
//!
//! `num_key_value_heads` and `head_dim` (MLA has its own head widths), everything about
//! training, and any other key deepinfer does not read, whatever it holds.
//! `num_nextn_predict_layers` (0 when absent) is read, but the multi-token-prediction layers it
//! counts are skipped, as HF does, unless speculative decoding asks for one
//! ([`ModelConfig::with_draft_layer`]). `quantization_config` is read for
//! FP8 checkpoints' `weight_block_size` (any other `quant_method` is refused).
//!
//! # How it is read
//!
//! In two phases, as [`ModelConfig::from_json_str`] shows: `raw` deserializes the keys deepinfer
//! reads into typed fields (serde, with `serde_path_to_error` naming the key of a wrong type),
//! then `resolve` applies the defaults and rejections listed above, with the router in
//! `routing`, RoPE and YaRN in `rope`, the per-`model_type` defaults in `defaults`, and every
//! error's wording in `messages`. A key deepinfer reads must have the right JSON type wherever
//! it appears, also where its value goes unused (`n_group` under greedy routing, YaRN's keys
//! under plain RoPE); a key it does not read may hold anything.

use std::path::Path;

use serde_json::Value;

use self::raw::RawConfig;
use crate::error::{Error, Result};
use crate::graph::DType;

mod defaults;
mod messages;
mod quantization;
mod raw;
mod resolve;
mod rope;
mod routing;
#[cfg(test)]
mod tests;
pub mod v4;
mod value;

/// Which DeepSeek generation the checkpoint declares (`model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `deepseek_v2`: DeepSeek-V2 and V2-Lite (softmax routing).
    DeepseekV2,
    /// `deepseek_v3`: DeepSeek-V3, R1 and relatives (sigmoid routing with a correction bias).
    DeepseekV3,
    /// `deepseek_v32`: DeepSeek-V3.2: V3 plus DeepSeek Sparse Attention (a lightning indexer
    /// that picks the tokens MLA attends to).
    DeepseekV32,
    /// `deepseek_v4`: DeepSeek-V4 (hybrid compressed attention, hash-routed MoE,
    /// hyper-connections); its shape is [`ModelConfig::v4`].
    DeepseekV4,
}

impl Architecture {
    /// V3's router (sigmoid scores with `e_score_correction_bias`, normalize then scale), which
    /// V3.2 keeps unchanged.
    pub fn routes_like_v3(self) -> bool {
        matches!(self, Architecture::DeepseekV3 | Architecture::DeepseekV32)
    }
}

/// DeepSeek Sparse Attention's lightning indexer (`deepseek_v32` only): per layer it scores every
/// query against its own cached key per token and keeps the `topk` best tokens for MLA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerConfig {
    /// `index_n_heads`: query heads of the indexer.
    pub n_heads: usize,
    /// `index_head_dim`: width of an index query head and of the cached index key (its first
    /// `qk_rope_head_dim` values are rotated).
    pub head_dim: usize,
    /// `index_topk`: tokens each query attends to once its context is longer.
    pub topk: usize,
}

/// How router logits become expert affinities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoringFunc {
    /// `softmax` over all routed experts (V2).
    Softmax,
    /// Elementwise `sigmoid` (V3).
    Sigmoid,
}

/// How the top-k experts are chosen from the affinities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkMethod {
    /// Plain top-k over all experts.
    Greedy,
    /// Keep the `topk_group` groups with the largest per-group **max**, then top-k (V2).
    GroupLimitedGreedy,
    /// Add `e_score_correction_bias`, keep the `topk_group` groups with the largest **sum of the
    /// top two** biased scores, then top-k on the biased scores; weights come from the unbiased
    /// scores (V3).
    NoauxTc,
}

/// The MoE router's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    /// Number of routed experts.
    pub n_routed_experts: usize,
    /// Experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Affinity function.
    pub scoring_func: ScoringFunc,
    /// Expert selection method.
    pub topk_method: TopkMethod,
    /// Number of expert groups (1 when grouping is not used).
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Whether the selected weights are renormalized to sum to one.
    pub norm_topk_prob: bool,
    /// Factor applied to the routed experts' weights.
    pub routed_scaling_factor: f64,
}

/// YaRN context extension (`rope_scaling.type == "yarn"`).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnConfig {
    /// `factor`: the context extension ratio.
    pub factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
    /// `beta_fast` (default 32).
    pub beta_fast: f64,
    /// `beta_slow` (default 1).
    pub beta_slow: f64,
    /// `mscale` (None when the key is absent).
    pub mscale: Option<f64>,
    /// `mscale_all_dim` (None when the key is absent).
    pub mscale_all_dim: Option<f64>,
}

/// Rotary position embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`, the base of the inverse frequencies.
    pub theta: f64,
    /// `None` for plain RoPE, `Some` for YaRN.
    pub yarn: Option<YarnConfig>,
}

/// A DeepSeek-V2/V3 model's shape and behaviour, resolved from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model_type`.
    pub architecture: Architecture,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`: width of the dense MLP layers.
    pub intermediate_size: usize,
    /// `moe_intermediate_size`: width of one routed expert.
    pub moe_intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `q_lora_rank`: `None` means a plain `q_proj` (V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`: width of the cached latent `c_kv`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`: width of the rotated part, and of the shared cached `k_pe`.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// The MoE router; `None` when the model has no routed experts (every layer dense).
    pub routing: Option<RoutingConfig>,
    /// `n_shared_experts` (0 when absent).
    pub n_shared_experts: usize,
    /// `first_k_dense_replace`: layers below this index use the dense MLP.
    pub first_k_dense_replace: usize,
    /// `moe_layer_freq`: a layer at or past `first_k_dense_replace` is MoE when
    /// `layer % moe_layer_freq == 0`.
    pub moe_layer_freq: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// RoPE settings.
    pub rope: RopeConfig,
    /// `max_position_embeddings`: the longest context the model accepts.
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings`: the LM head reuses `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// `bos_token_id`, when set.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (a number or a list in the wild), empty when absent.
    pub eos_token_ids: Vec<u32>,
    /// `quantization_config.weight_block_size` of an FP8 checkpoint: `[rows, cols]` of one
    /// `weight_scale_inv` block.
    pub fp8_block: Option<[usize; 2]>,
    /// The sparse-attention indexer (`deepseek_v32`); `None` for dense MLA.
    pub indexer: Option<IndexerConfig>,
    /// `torch_dtype` (or transformers 5's `dtype`) when it names f32, bf16 or f16: what
    /// `--dtype auto` means when only config.json is at hand (`lower --stats`).
    pub saved_dtype: Option<DType>,
    /// `num_nextn_predict_layers`: the multi-token-prediction (MTP) layers the checkpoint
    /// ships after its decoder layers (`model.layers.{num_hidden_layers}.*` on), which
    /// speculative decoding drafts with (see [`crate::model::mtp`]).
    pub num_nextn_predict_layers: usize,
    /// The MTP layers this run loads, caches and runs: 0 (the default: the checkpoint's MTP
    /// tensors are not read, as transformers skips them) unless speculative decoding asks for
    /// them ([`ModelConfig::with_draft_layer`]). The weights, the KV root and the step graphs
    /// all follow it.
    pub draft_layers: usize,
    /// Whether the MTP layers draft with the main model's embedding and LM head rather than
    /// their own copies (`model.layers.{L}.embed_tokens` / `shared_head.head`): the report's
    /// design ("shared with the main model"), for checkpoints that do not ship the copies (see
    /// [`crate::model::mtp::share_absent_embeddings`]). Published DeepSeek-V3 and R1 files
    /// ship them, so by default they are read.
    pub draft_shares_embeddings: bool,
    /// A DeepSeek-V4 model's own configuration (its layers are not MLA's); `None` for the MLA
    /// family. The graph builders, cache roots and weights dispatch on it.
    pub v4: Option<std::sync::Arc<v4::V4Config>>,
}

impl ModelConfig {
    /// Reads and normalizes `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Parses and normalizes the text of a `config.json`.
    ///
    /// See the module docs for which keys are required, the defaults of the others, and what is
    /// rejected.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("not valid JSON: {e}")))?;
        let Some(object) = json.as_object() else {
            return Err(Error::Config(format!(
                "expected a JSON object at the top level, got {}",
                value::kind(&json)
            )));
        };
        // DeepSeek-V4 has a config of its own.
        if object.get("model_type").and_then(Value::as_str) == Some("deepseek_v4") {
            return Ok(v4::V4Config::from_object(object)?.into_model_config());
        }
        let keys: RawConfig = raw::read(object, "")?;
        resolve::model_config(&keys)
    }

    /// This config with its first MTP layer in use (`draft_layers` 1): what speculative
    /// decoding loads. One layer drafts any number of tokens by chaining itself, as SGLang
    /// and vLLM chain DeepSeek-V3's single published layer. Fails, naming the key, for a
    /// checkpoint that ships none, and for DeepSeek-V4 (its MTP layer is not read yet).
    pub fn with_draft_layer(&self) -> Result<Self> {
        if self.v4.is_some() {
            return Err(Error::Config(
                "speculative decoding with DeepSeek-V4's MTP layer is not supported yet".into(),
            ));
        }
        if self.num_nextn_predict_layers == 0 {
            return Err(Error::Config(format!(
                "this checkpoint has no multi-token-prediction layer to draft with \
                 (`num_nextn_predict_layers` is 0 or absent in config.json, so there are no \
                 `model.layers.{}.eh_proj` / `enorm` / `hnorm` / `shared_head` tensors); serve \
                 it without speculative decoding",
                self.num_hidden_layers
            )));
        }
        Ok(ModelConfig {
            draft_layers: 1,
            ..self.clone()
        })
    }

    /// The layers whose KV the cache holds: the decoder's, then the MTP layers in use.
    pub fn cached_layers(&self) -> usize {
        self.num_hidden_layers + self.draft_layers
    }

    /// Width of one head's query/key: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values cached per token and layer: the latent `c_kv` and the shared rotated `k_pe`.
    pub fn kv_cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Values of the state root per token and layer: the indexer's key (0 without an indexer).
    pub fn index_cache_width(&self) -> usize {
        self.indexer.map_or(0, |i| i.head_dim)
    }

    /// Whether layer `layer` uses the routed-expert MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.routing.is_some()
            && layer >= self.first_k_dense_replace
            && layer.is_multiple_of(self.moe_layer_freq.max(1))
    }
}
