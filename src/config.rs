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

use std::path::Path;

use crate::error::{Error, Result};

/// Which DeepSeek generation the checkpoint declares (`model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `deepseek_v2`: DeepSeek-V2 and V2-Lite (softmax routing).
    DeepseekV2,
    /// `deepseek_v3`: DeepSeek-V3, R1 and relatives (sigmoid routing with a correction bias).
    DeepseekV3,
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
    pub fn from_json_str(text: &str) -> Result<Self> {
        let _ = text;
        Err(Error::Config("parser not written yet".into()))
    }

    /// Width of one head's query/key: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values cached per token and layer: the latent `c_kv` and the shared rotated `k_pe`.
    pub fn kv_cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Whether layer `layer` uses the routed-expert MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.routing.is_some()
            && layer >= self.first_k_dense_replace
            && layer % self.moe_layer_freq.max(1) == 0
    }
}
