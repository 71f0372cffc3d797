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
//! `num_key_value_heads` and `head_dim` (MLA has its own head widths), `num_nextn_predict_layers`
//! (the multi-token-prediction layers are skipped, as HF does), `quantization_config` (the weight
//! loader names any tensor whose dtype it cannot read), and everything about training.

use std::path::Path;

use serde_json::{Map, Value};

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
    ///
    /// See the module docs for which keys are required, the defaults of the others, and what is
    /// rejected.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("not valid JSON: {e}")))?;
        let Some(map) = value.as_object() else {
            return Err(Error::Config(format!(
                "expected a JSON object at the top level, got {}",
                type_name(&value)
            )));
        };
        parse(&Obj::top(map))
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
            && layer.is_multiple_of(self.moe_layer_freq.max(1))
    }
}

// === Parsing ===

/// Which keys were looked up under which prefix, so errors can name `rope_scaling.factor`.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Obj<'a> {
    fn top(map: &'a Map<String, Value>) -> Self {
        Obj {
            map,
            prefix: String::new(),
        }
    }

    /// The nested object at `key`, named `key.` in errors; `None` when absent or `null`.
    fn object(&self, key: &str) -> Result<Option<Obj<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Obj {
                map,
                prefix: format!("{}.", self.name(key)),
            })),
            Some(other) => Err(self.wrong(key, "an object", other)),
        }
    }

    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value at `key`; `None` when the key is absent or `null`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn missing(&self, key: &str) -> Error {
        Error::Config(format!("missing required key {}", self.name(key)))
    }

    fn wrong(&self, key: &str, expected: &str, got: &Value) -> Error {
        Error::Config(format!("{} must be {expected}, got {got}", self.name(key)))
    }

    fn invalid(&self, key: &str, got: impl std::fmt::Display, why: &str) -> Error {
        Error::Config(format!("{} {got}: {why}", self.name(key)))
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    /// A required size; absent and `null` are both errors.
    fn required_usize(&self, key: &str) -> Result<usize> {
        match self.map.get(key) {
            None => Err(self.missing(key)),
            Some(Value::Null) => Err(self.wrong(key, "a non-negative integer", &Value::Null)),
            Some(_) => self.usize(key)?.ok_or_else(|| self.missing(key)),
        }
    }

    /// A required size that must be at least 1.
    fn required_positive(&self, key: &str) -> Result<usize> {
        let n = self.required_usize(key)?;
        if n == 0 {
            return Err(self.invalid(key, n, "must be at least 1"));
        }
        Ok(n)
    }

    /// A key that must be present but may be `null`.
    fn required_nullable_usize(&self, key: &str) -> Result<Option<usize>> {
        if !self.map.contains_key(key) {
            return Err(self.missing(key));
        }
        self.usize(key)
    }

    fn u32(&self, key: &str) -> Result<Option<u32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a token id (a non-negative 32-bit integer)", v))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(self.wrong(key, "a finite number", v)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "true or false", v))
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a string", v))
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// "unsupported `key` `value` (`why`)": the one shape of every rejection.
fn unsupported(key: &str, value: impl std::fmt::Display, why: &str) -> Error {
    Error::Config(format!("unsupported {key} {value} ({why})"))
}

/// transformers 5.24's class defaults for one `model_type` (see the module docs' table).
struct Defaults {
    scoring_func: ScoringFunc,
    topk_method: TopkMethod,
    /// `(n_group, topk_group)`; `None` where HF's default is `None`.
    groups: Option<(usize, usize)>,
    num_experts_per_tok: Option<usize>,
    norm_topk_prob: bool,
    routed_scaling_factor: f64,
    first_k_dense_replace: usize,
    max_position_embeddings: usize,
}

impl Defaults {
    fn of(architecture: Architecture) -> Self {
        match architecture {
            // configuration_deepseek_v2.py: topk_method="greedy", n_group=None, topk_group=None,
            // num_experts_per_tok=None, norm_topk_prob=False, routed_scaling_factor=1.0,
            // first_k_dense_replace=0, max_position_embeddings=2048; the router is softmax.
            Architecture::DeepseekV2 => Defaults {
                scoring_func: ScoringFunc::Softmax,
                topk_method: TopkMethod::Greedy,
                groups: None,
                num_experts_per_tok: None,
                norm_topk_prob: false,
                routed_scaling_factor: 1.0,
                first_k_dense_replace: 0,
                max_position_embeddings: 2048,
            },
            // configuration_deepseek_v3.py: n_group=8, topk_group=4, num_experts_per_tok=8,
            // norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
            // max_position_embeddings=4096; the router is sigmoid + noaux_tc.
            Architecture::DeepseekV3 => Defaults {
                scoring_func: ScoringFunc::Sigmoid,
                topk_method: TopkMethod::NoauxTc,
                groups: Some((8, 4)),
                num_experts_per_tok: Some(8),
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
                first_k_dense_replace: 3,
                max_position_embeddings: 4096,
            },
        }
    }
}

fn parse(top: &Obj<'_>) -> Result<ModelConfig> {
    let architecture = match top.str("model_type")? {
        None => return Err(top.missing("model_type")),
        Some("deepseek_v2") => Architecture::DeepseekV2,
        Some("deepseek_v3") => Architecture::DeepseekV3,
        Some(other) => {
            return Err(Error::Config(format!(
                "unsupported model_type {other:?} (deepinfer serves deepseek_v2 and deepseek_v3)"
            )))
        }
    };
    let defaults = Defaults::of(architecture);

    reject_unsupported_flags(top)?;

    let vocab_size = top.required_positive("vocab_size")?;
    let hidden_size = top.required_positive("hidden_size")?;
    let intermediate_size = top.required_positive("intermediate_size")?;
    let num_hidden_layers = top.required_positive("num_hidden_layers")?;
    let num_attention_heads = top.required_positive("num_attention_heads")?;
    let q_lora_rank = top.required_nullable_usize("q_lora_rank")?;
    if q_lora_rank == Some(0) {
        return Err(top.invalid(
            "q_lora_rank",
            0,
            "must be at least 1, or null for a plain q_proj",
        ));
    }
    let kv_lora_rank = top.required_positive("kv_lora_rank")?;
    let qk_nope_head_dim = top.required_usize("qk_nope_head_dim")?;
    let qk_rope_head_dim = top.required_positive("qk_rope_head_dim")?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(top.invalid(
            "qk_rope_head_dim",
            qk_rope_head_dim,
            "must be even (RoPE rotates pairs)",
        ));
    }
    let v_head_dim = top.required_positive("v_head_dim")?;

    let n_routed_experts = top.required_nullable_usize("n_routed_experts")?;
    let routing = match n_routed_experts {
        None => None,
        Some(n) => Some(parse_routing(top, &defaults, n)?),
    };
    let moe_intermediate_size = match routing {
        Some(_) => top.required_positive("moe_intermediate_size")?,
        None => top.usize("moe_intermediate_size")?.unwrap_or(0),
    };
    let n_shared_experts = top.usize("n_shared_experts")?.unwrap_or(0);
    let first_k_dense_replace = top
        .usize("first_k_dense_replace")?
        .unwrap_or(defaults.first_k_dense_replace);
    let moe_layer_freq = top.usize("moe_layer_freq")?.unwrap_or(1);
    if moe_layer_freq == 0 {
        return Err(top.invalid("moe_layer_freq", 0, "must be at least 1"));
    }

    let rms_norm_eps = top.f64("rms_norm_eps")?.unwrap_or(1e-6);
    if rms_norm_eps <= 0.0 {
        return Err(top.invalid("rms_norm_eps", rms_norm_eps, "must be positive"));
    }
    let max_position_embeddings = top
        .usize("max_position_embeddings")?
        .unwrap_or(defaults.max_position_embeddings);
    if max_position_embeddings == 0 {
        return Err(top.invalid("max_position_embeddings", 0, "must be at least 1"));
    }
    let rope = parse_rope(top, max_position_embeddings)?;

    let tie_word_embeddings = top.bool("tie_word_embeddings")?.unwrap_or(false);
    let bos_token_id = top.u32("bos_token_id")?;
    let eos_token_ids = match top.get("eos_token_id") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        top.wrong("eos_token_id", "a token id or a list of token ids", v)
                    })
            })
            .collect::<Result<Vec<u32>>>()?,
        Some(_) => vec![top.u32("eos_token_id")?.unwrap_or_default()],
    };

    Ok(ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size,
        moe_intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        routing,
        n_shared_experts,
        first_k_dense_replace,
        moe_layer_freq,
        rms_norm_eps,
        rope,
        max_position_embeddings,
        tie_word_embeddings,
        bos_token_id,
        eos_token_ids,
    })
}

/// Flags whose non-default value changes the math in a way deepinfer does not implement.
fn reject_unsupported_flags(top: &Obj<'_>) -> Result<()> {
    let hidden_act = top.str("hidden_act")?.unwrap_or("silu");
    if hidden_act != "silu" {
        return Err(unsupported(
            "hidden_act",
            format!("{hidden_act:?}"),
            "deepinfer implements \"silu\"",
        ));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if top.bool(key)? == Some(true) {
            return Err(unsupported(
                key,
                true,
                "DeepSeek's projections have no bias; deepinfer loads none",
            ));
        }
    }
    if top.bool("rope_interleave")? == Some(false) {
        return Err(unsupported(
            "rope_interleave",
            false,
            "deepinfer rotates DeepSeek's interleaved pairs",
        ));
    }
    Ok(())
}

fn parse_routing(
    top: &Obj<'_>,
    defaults: &Defaults,
    n_routed_experts: usize,
) -> Result<RoutingConfig> {
    if n_routed_experts == 0 {
        return Err(top.invalid(
            "n_routed_experts",
            0,
            "must be at least 1, or null for a dense model",
        ));
    }
    let scoring_func = match top.str("scoring_func")? {
        None => defaults.scoring_func,
        Some("softmax") => ScoringFunc::Softmax,
        Some("sigmoid") => ScoringFunc::Sigmoid,
        Some(other) => {
            return Err(unsupported(
                "scoring_func",
                format!("{other:?}"),
                "deepinfer implements \"softmax\" and \"sigmoid\"",
            ))
        }
    };
    let topk_method = match top.str("topk_method")? {
        None => defaults.topk_method,
        // "gready" is the original remote code's default spelling.
        Some("greedy" | "gready") => TopkMethod::Greedy,
        Some("group_limited_greedy") => TopkMethod::GroupLimitedGreedy,
        Some("noaux_tc") => TopkMethod::NoauxTc,
        Some(other) => {
            return Err(unsupported(
                "topk_method",
                format!("{other:?}"),
                "deepinfer implements \"greedy\", \"group_limited_greedy\" and \"noaux_tc\"",
            ))
        }
    };
    if topk_method == TopkMethod::NoauxTc && scoring_func == ScoringFunc::Softmax {
        return Err(unsupported(
            "topk_method",
            "\"noaux_tc\" with scoring_func \"softmax\"",
            "noaux_tc is defined on sigmoid scores",
        ));
    }

    let num_experts_per_tok = match top.usize("num_experts_per_tok")? {
        Some(k) => k,
        None => defaults
            .num_experts_per_tok
            .ok_or_else(|| top.missing("num_experts_per_tok"))?,
    };
    if num_experts_per_tok == 0 || num_experts_per_tok > n_routed_experts {
        return Err(top.invalid(
            "num_experts_per_tok",
            num_experts_per_tok,
            &format!("must be between 1 and n_routed_experts ({n_routed_experts})"),
        ));
    }

    let (n_group, topk_group) = if topk_method == TopkMethod::Greedy {
        // Plain top-k ignores groups; RoutingConfig records "no grouping" as 1 / 1.
        (1, 1)
    } else {
        let method = if topk_method == TopkMethod::NoauxTc {
            "noaux_tc"
        } else {
            "group_limited_greedy"
        };
        let default_group = |key: &str, pick: fn((usize, usize)) -> usize| {
            defaults.groups.map(pick).ok_or_else(|| {
                Error::Config(format!(
                    "missing required key {key} (topk_method {method:?} groups the experts)"
                ))
            })
        };
        let n_group = match top.usize("n_group")? {
            Some(g) => g,
            None => default_group("n_group", |g| g.0)?,
        };
        let topk_group = match top.usize("topk_group")? {
            Some(g) => g,
            None => default_group("topk_group", |g| g.1)?,
        };
        if n_group == 0 || !n_routed_experts.is_multiple_of(n_group) {
            return Err(top.invalid(
                "n_group",
                n_group,
                &format!("must divide n_routed_experts ({n_routed_experts})"),
            ));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(top.invalid(
                "topk_group",
                topk_group,
                &format!("must be between 1 and n_group ({n_group})"),
            ));
        }
        let group_size = n_routed_experts / n_group;
        if topk_method == TopkMethod::NoauxTc && group_size < 2 {
            return Err(top.invalid(
                "n_group",
                n_group,
                &format!(
                    "noaux_tc scores a group by its top two experts, so each group needs at \
                     least 2 (n_routed_experts is {n_routed_experts})"
                ),
            ));
        }
        if num_experts_per_tok > topk_group * group_size {
            return Err(top.invalid(
                "num_experts_per_tok",
                num_experts_per_tok,
                &format!(
                    "exceeds the {} experts in the topk_group ({topk_group}) groups it may \
                     choose from",
                    topk_group * group_size
                ),
            ));
        }
        (n_group, topk_group)
    };

    let norm_topk_prob = top
        .bool("norm_topk_prob")?
        .unwrap_or(defaults.norm_topk_prob);
    let routed_scaling_factor = top
        .f64("routed_scaling_factor")?
        .unwrap_or(defaults.routed_scaling_factor);

    Ok(RoutingConfig {
        n_routed_experts,
        num_experts_per_tok,
        scoring_func,
        topk_method,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
    })
}

fn parse_rope(top: &Obj<'_>, max_position_embeddings: usize) -> Result<RopeConfig> {
    // HF: `rope_parameters = rope_scaling or rope_parameters` (an empty object counts as absent).
    let scaling = top.object("rope_scaling")?.filter(|o| !o.map.is_empty());
    let params = match scaling {
        Some(o) => Some(o),
        None => top.object("rope_parameters")?,
    };

    let (theta_key, theta) = match &params {
        Some(p) if p.get("rope_theta").is_some() => (p.name("rope_theta"), p.f64("rope_theta")?),
        _ => ("rope_theta".to_string(), top.f64("rope_theta")?),
    };
    let theta = theta.unwrap_or(10_000.0);
    if theta <= 0.0 {
        return Err(Error::Config(format!(
            "{theta_key} {theta}: must be positive"
        )));
    }

    for obj in params.iter().chain(std::iter::once(top)) {
        if let Some(f) = obj.f64("partial_rotary_factor")? {
            if f != 1.0 {
                return Err(unsupported(
                    &obj.name("partial_rotary_factor"),
                    f,
                    "deepinfer rotates the whole qk_rope_head_dim",
                ));
            }
        }
    }

    let Some(params) = params else {
        return Ok(RopeConfig { theta, yarn: None });
    };
    let (type_key, rope_type) = match params.str("rope_type")? {
        Some(t) => ("rope_type", t),
        None => match params.str("type")? {
            Some(t) => ("type", t),
            None => ("rope_type", "default"),
        },
    };
    match rope_type {
        "default" => Ok(RopeConfig { theta, yarn: None }),
        "yarn" => Ok(RopeConfig {
            theta,
            yarn: Some(parse_yarn(top, &params, max_position_embeddings)?),
        }),
        other => Err(unsupported(
            &params.name(type_key),
            format!("{other:?}"),
            "deepinfer implements \"default\" and \"yarn\"",
        )),
    }
}

fn parse_yarn(top: &Obj<'_>, p: &Obj<'_>, max_position_embeddings: usize) -> Result<YarnConfig> {
    if let Some(v) = p.get("attention_factor") {
        return Err(unsupported(
            &p.name("attention_factor"),
            v,
            "deepinfer derives YaRN's attention scaling from mscale and mscale_all_dim",
        ));
    }
    if p.bool("truncate")? == Some(false) {
        return Err(unsupported(
            &p.name("truncate"),
            false,
            "deepinfer rounds YaRN's correction range like DeepSeek",
        ));
    }
    // standardize_rope_params: a top-level original_max_position_embeddings wins, else the one in
    // the rope object, else max_position_embeddings.
    let original = match top.usize("original_max_position_embeddings")? {
        Some(n) => n,
        None => p
            .usize("original_max_position_embeddings")?
            .unwrap_or(max_position_embeddings),
    };
    if original == 0 {
        return Err(p.invalid("original_max_position_embeddings", 0, "must be at least 1"));
    }
    // _compute_yarn_parameters: a missing factor is the context extension ratio.
    let factor = p
        .f64("factor")?
        .unwrap_or(max_position_embeddings as f64 / original as f64);
    if factor < 1.0 {
        return Err(p.invalid("factor", factor, "must be at least 1"));
    }
    // _compute_yarn_parameters: `get("beta_fast") or 32`, `get("beta_slow") or 1`.
    let beta_fast = p.f64("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0);
    let beta_slow = p.f64("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0);
    Ok(YarnConfig {
        factor,
        original_max_position_embeddings: original,
        beta_fast,
        beta_slow,
        mscale: p.f64("mscale")?,
        mscale_all_dim: p.f64("mscale_all_dim")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// deepseek-ai/DeepSeek-V2-Lite `config.json`, as published (remote-code spelling).
    const V2_LITE: &str = r#"{
      "architectures": ["DeepseekV2ForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"
      },
      "aux_loss_alpha": 0.001,
      "bos_token_id": 100000,
      "eos_token_id": 100001,
      "first_k_dense_replace": 1,
      "hidden_act": "silu",
      "hidden_size": 2048,
      "initializer_range": 0.02,
      "intermediate_size": 10944,
      "kv_lora_rank": 512,
      "max_position_embeddings": 163840,
      "model_type": "deepseek_v2",
      "moe_intermediate_size": 1408,
      "moe_layer_freq": 1,
      "n_group": 1,
      "n_routed_experts": 64,
      "n_shared_experts": 2,
      "norm_topk_prob": false,
      "num_attention_heads": 16,
      "num_experts_per_tok": 6,
      "num_hidden_layers": 27,
      "num_key_value_heads": 16,
      "pretraining_tp": 1,
      "q_lora_rank": null,
      "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64,
      "rms_norm_eps": 1e-06,
      "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn"
      },
      "rope_theta": 10000,
      "routed_scaling_factor": 1.0,
      "scoring_func": "softmax",
      "seq_aux": true,
      "tie_word_embeddings": false,
      "topk_group": 1,
      "topk_method": "greedy",
      "torch_dtype": "bfloat16",
      "transformers_version": "4.33.1",
      "use_cache": true,
      "v_head_dim": 128,
      "vocab_size": 102400
    }"#;

    /// deepseek-ai/DeepSeek-V3 `config.json`, as published (FP8 weights, one MTP layer).
    const V3: &str = r#"{
      "architectures": ["DeepseekV3ForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
      },
      "aux_loss_alpha": 0.001,
      "bos_token_id": 0,
      "eos_token_id": 1,
      "ep_size": 1,
      "first_k_dense_replace": 3,
      "hidden_act": "silu",
      "hidden_size": 7168,
      "initializer_range": 0.02,
      "intermediate_size": 18432,
      "kv_lora_rank": 512,
      "max_position_embeddings": 163840,
      "model_type": "deepseek_v3",
      "moe_intermediate_size": 2048,
      "moe_layer_freq": 1,
      "n_group": 8,
      "n_routed_experts": 256,
      "n_shared_experts": 1,
      "norm_topk_prob": true,
      "num_attention_heads": 128,
      "num_experts_per_tok": 8,
      "num_hidden_layers": 61,
      "num_key_value_heads": 128,
      "num_nextn_predict_layers": 1,
      "q_lora_rank": 1536,
      "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64,
      "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128]
      },
      "rms_norm_eps": 1e-06,
      "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn"
      },
      "rope_theta": 10000,
      "routed_scaling_factor": 2.5,
      "scoring_func": "sigmoid",
      "seq_aux": true,
      "tie_word_embeddings": false,
      "topk_group": 4,
      "topk_method": "noaux_tc",
      "torch_dtype": "bfloat16",
      "transformers_version": "4.33.1",
      "use_cache": true,
      "v_head_dim": 128,
      "vocab_size": 129280
    }"#;

    /// A tiny V3 written by transformers 5.24's `DeepseekV3Config.save_pretrained`: no
    /// `scoring_func`/`topk_method`, RoPE under `rope_parameters`.
    const HF5_TINY_V3: &str = r#"{
      "attention_bias": false,
      "attention_dropout": 0.0,
      "bos_token_id": 0,
      "eos_token_id": 1,
      "first_k_dense_replace": 1,
      "head_dim": 8,
      "hidden_act": "silu",
      "hidden_size": 64,
      "initializer_range": 0.02,
      "intermediate_size": 128,
      "kv_lora_rank": 16,
      "max_position_embeddings": 163840,
      "model_type": "deepseek_v3",
      "moe_intermediate_size": 32,
      "n_group": 4,
      "n_routed_experts": 16,
      "n_shared_experts": 1,
      "norm_topk_prob": true,
      "num_attention_heads": 4,
      "num_experts_per_tok": 4,
      "num_hidden_layers": 2,
      "num_key_value_heads": 128,
      "num_nextn_predict_layers": 1,
      "output_router_logits": false,
      "pad_token_id": null,
      "pretraining_tp": 1,
      "q_lora_rank": 32,
      "qk_head_dim": 16,
      "qk_nope_head_dim": 8,
      "qk_rope_head_dim": 8,
      "rms_norm_eps": 1e-06,
      "rope_interleave": true,
      "rope_parameters": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_type": "yarn"
      },
      "routed_scaling_factor": 2.5,
      "tie_word_embeddings": false,
      "topk_group": 2,
      "transformers_version": "5.24.0",
      "use_cache": true,
      "v_head_dim": 8,
      "vocab_size": 256
    }"#;

    /// A tiny V2 written by transformers 5.24's `DeepseekV2Config.save_pretrained`.
    const HF5_TINY_V2: &str = r#"{
      "attention_bias": false,
      "bos_token_id": 1,
      "eos_token_id": 2,
      "first_k_dense_replace": 1,
      "head_dim": 8,
      "hidden_act": "silu",
      "hidden_size": 64,
      "intermediate_size": 128,
      "kv_lora_rank": 16,
      "max_position_embeddings": 2048,
      "mlp_bias": false,
      "model_type": "deepseek_v2",
      "moe_intermediate_size": 32,
      "n_group": null,
      "n_routed_experts": 16,
      "n_shared_experts": 2,
      "norm_topk_prob": false,
      "num_attention_heads": 4,
      "num_experts_per_tok": 4,
      "num_hidden_layers": 2,
      "num_key_value_heads": 4,
      "q_lora_rank": null,
      "qk_nope_head_dim": 8,
      "qk_rope_head_dim": 8,
      "rms_norm_eps": 1e-06,
      "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
      "routed_scaling_factor": 1.0,
      "tie_word_embeddings": false,
      "topk_group": null,
      "topk_method": "greedy",
      "transformers_version": "5.24.0",
      "v_head_dim": 8,
      "vocab_size": 256
    }"#;

    /// `base` with `edits` applied: `Some(v)` sets a (possibly dotted) key, `None` removes it.
    fn edited(base: &str, edits: &[(&str, Option<Value>)]) -> String {
        let mut v: Value = serde_json::from_str(base).unwrap();
        for (path, new) in edits {
            let mut target = &mut v;
            let parts: Vec<&str> = path.split('.').collect();
            for part in &parts[..parts.len() - 1] {
                target = target.get_mut(*part).unwrap();
            }
            let obj = target.as_object_mut().unwrap();
            let last = parts[parts.len() - 1];
            match new {
                Some(x) => {
                    obj.insert(last.to_string(), x.clone());
                }
                None => {
                    obj.remove(last);
                }
            }
        }
        v.to_string()
    }

    fn parse_edited(base: &str, edits: &[(&str, Option<Value>)]) -> Result<ModelConfig> {
        ModelConfig::from_json_str(&edited(base, edits))
    }

    /// The error message for `base` with `edits`; panics if it parses.
    fn error(base: &str, edits: &[(&str, Option<Value>)]) -> String {
        match parse_edited(base, edits) {
            Ok(c) => panic!("expected an error for {edits:?}, parsed {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn assert_mentions(msg: &str, needles: &[&str]) {
        for n in needles {
            assert!(msg.contains(n), "{msg:?} does not mention {n:?}");
        }
        assert!(msg.starts_with("config.json: "), "{msg:?}");
    }

    #[test]
    fn published_v2_lite() {
        let c = ModelConfig::from_json_str(V2_LITE).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV2);
        assert_eq!(c.vocab_size, 102400);
        assert_eq!(c.hidden_size, 2048);
        assert_eq!(c.intermediate_size, 10944);
        assert_eq!(c.moe_intermediate_size, 1408);
        assert_eq!(c.num_hidden_layers, 27);
        assert_eq!(c.num_attention_heads, 16);
        assert_eq!(c.q_lora_rank, None);
        assert_eq!(c.kv_lora_rank, 512);
        assert_eq!(c.qk_head_dim(), 192);
        assert_eq!(c.kv_cache_width(), 576);
        assert_eq!(c.v_head_dim, 128);
        assert_eq!(
            c.routing,
            Some(RoutingConfig {
                n_routed_experts: 64,
                num_experts_per_tok: 6,
                scoring_func: ScoringFunc::Softmax,
                topk_method: TopkMethod::Greedy,
                n_group: 1,
                topk_group: 1,
                norm_topk_prob: false,
                routed_scaling_factor: 1.0,
            })
        );
        assert_eq!(c.n_shared_experts, 2);
        assert_eq!(c.first_k_dense_replace, 1);
        assert!(!c.is_moe_layer(0));
        assert!(c.is_moe_layer(1) && c.is_moe_layer(26));
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(
            c.rope,
            RopeConfig {
                theta: 10000.0,
                yarn: Some(YarnConfig {
                    factor: 40.0,
                    original_max_position_embeddings: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: Some(0.707),
                    mscale_all_dim: Some(0.707),
                }),
            }
        );
        assert_eq!(c.max_position_embeddings, 163840);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.bos_token_id, Some(100000));
        assert_eq!(c.eos_token_ids, vec![100001]);
    }

    #[test]
    fn published_v3() {
        let c = ModelConfig::from_json_str(V3).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV3);
        assert_eq!(c.vocab_size, 129280);
        assert_eq!(c.hidden_size, 7168);
        assert_eq!(c.num_hidden_layers, 61);
        assert_eq!(c.q_lora_rank, Some(1536));
        assert_eq!(
            c.routing,
            Some(RoutingConfig {
                n_routed_experts: 256,
                num_experts_per_tok: 8,
                scoring_func: ScoringFunc::Sigmoid,
                topk_method: TopkMethod::NoauxTc,
                n_group: 8,
                topk_group: 4,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
            })
        );
        assert_eq!(c.n_shared_experts, 1);
        assert_eq!(c.first_k_dense_replace, 3);
        assert!(!c.is_moe_layer(2) && c.is_moe_layer(3) && c.is_moe_layer(60));
        let yarn = c.rope.yarn.unwrap();
        assert_eq!(yarn.factor, 40.0);
        assert_eq!(yarn.mscale, Some(1.0));
        assert_eq!(yarn.mscale_all_dim, Some(1.0));
        assert_eq!(c.bos_token_id, Some(0));
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn transformers5_v3_takes_hf_defaults_for_router() {
        let c = ModelConfig::from_json_str(HF5_TINY_V3).unwrap();
        let r = c.routing.unwrap();
        assert_eq!(r.scoring_func, ScoringFunc::Sigmoid);
        assert_eq!(r.topk_method, TopkMethod::NoauxTc);
        assert_eq!((r.n_group, r.topk_group), (4, 2));
        assert_eq!(c.q_lora_rank, Some(32));
        assert_eq!(
            c.rope,
            RopeConfig {
                theta: 10000.0,
                yarn: Some(YarnConfig {
                    factor: 40.0,
                    original_max_position_embeddings: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: Some(1.0),
                    mscale_all_dim: Some(1.0),
                }),
            }
        );
    }

    #[test]
    fn transformers5_v2_default_rope_and_null_groups() {
        let c = ModelConfig::from_json_str(HF5_TINY_V2).unwrap();
        assert_eq!(
            c.rope,
            RopeConfig {
                theta: 10000.0,
                yarn: None
            }
        );
        let r = c.routing.unwrap();
        assert_eq!(r.topk_method, TopkMethod::Greedy);
        assert_eq!((r.n_group, r.topk_group), (1, 1));
        assert_eq!(r.scoring_func, ScoringFunc::Softmax);
        assert_eq!(c.bos_token_id, Some(1));
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn transformers5_converted_v2_lite_with_both_type_keys() {
        // transformers 5 rewrites a published config with both `rope_type` and `type`, and
        // `rope_theta` inside `rope_parameters` only.
        let c = parse_edited(
            V2_LITE,
            &[
                ("rope_scaling", None),
                ("rope_theta", None),
                (
                    "rope_parameters",
                    Some(json!({
                        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                        "rope_theta": 50000, "rope_type": "yarn", "type": "yarn"
                    })),
                ),
            ],
        )
        .unwrap();
        assert_eq!(c.rope.theta, 50000.0);
        assert_eq!(c.rope.yarn.unwrap().mscale_all_dim, Some(0.707));
    }

    #[test]
    fn rope_defaults_mirror_transformers() {
        // No RoPE keys at all: plain RoPE with theta 10000.
        let c = parse_edited(V2_LITE, &[("rope_scaling", None), ("rope_theta", None)]).unwrap();
        assert_eq!(
            c.rope,
            RopeConfig {
                theta: 10000.0,
                yarn: None
            }
        );
        // rope_scaling null: plain RoPE with the top-level theta.
        let c = parse_edited(
            V2_LITE,
            &[
                ("rope_scaling", Some(Value::Null)),
                ("rope_theta", Some(json!(5e5))),
            ],
        )
        .unwrap();
        assert_eq!(
            c.rope,
            RopeConfig {
                theta: 5e5,
                yarn: None
            }
        );
        // rope_scaling wins over rope_parameters when both are given.
        let c = parse_edited(
            V2_LITE,
            &[(
                "rope_parameters",
                Some(json!({"rope_type": "default", "rope_theta": 7.0})),
            )],
        )
        .unwrap();
        assert!(c.rope.yarn.is_some());
        assert_eq!(c.rope.theta, 10000.0);
        // `rope_type` inside rope_scaling is accepted too, and wins over `type`.
        let c = parse_edited(
            V2_LITE,
            &[("rope_scaling.rope_type", Some(json!("default")))],
        )
        .unwrap();
        assert_eq!(c.rope.yarn, None);
        // Absent YaRN details: factor from the context ratio, betas 32/1, no mscales.
        let c = parse_edited(
            V2_LITE,
            &[(
                "rope_scaling",
                Some(json!({"type": "yarn", "original_max_position_embeddings": 4096})),
            )],
        )
        .unwrap();
        assert_eq!(
            c.rope.yarn,
            Some(YarnConfig {
                factor: 40.0,
                original_max_position_embeddings: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: None,
                mscale_all_dim: None,
            })
        );
    }

    #[test]
    fn router_defaults_mirror_transformers() {
        // V3 without any router keys: sigmoid + noaux_tc, 8 groups keep 4, top 8, norm, 2.5.
        let c = parse_edited(
            V3,
            &[
                ("scoring_func", None),
                ("topk_method", None),
                ("n_group", None),
                ("topk_group", None),
                ("num_experts_per_tok", None),
                ("norm_topk_prob", None),
                ("routed_scaling_factor", None),
                ("first_k_dense_replace", None),
            ],
        )
        .unwrap();
        assert_eq!(
            c.routing,
            Some(RoutingConfig {
                n_routed_experts: 256,
                num_experts_per_tok: 8,
                scoring_func: ScoringFunc::Sigmoid,
                topk_method: TopkMethod::NoauxTc,
                n_group: 8,
                topk_group: 4,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
            })
        );
        assert_eq!(c.first_k_dense_replace, 3);
        // V2 without them: softmax + greedy, no renormalization, factor 1, all layers MoE.
        let c = parse_edited(
            V2_LITE,
            &[
                ("scoring_func", None),
                ("topk_method", None),
                ("n_group", None),
                ("topk_group", None),
                ("norm_topk_prob", None),
                ("routed_scaling_factor", None),
                ("first_k_dense_replace", None),
                ("moe_layer_freq", None),
                ("n_shared_experts", None),
                ("max_position_embeddings", None),
                ("bos_token_id", None),
                ("eos_token_id", None),
            ],
        )
        .unwrap();
        let r = c.routing.as_ref().unwrap();
        assert_eq!(r.scoring_func, ScoringFunc::Softmax);
        assert_eq!(r.topk_method, TopkMethod::Greedy);
        assert!(!r.norm_topk_prob);
        assert_eq!(r.routed_scaling_factor, 1.0);
        assert_eq!(c.first_k_dense_replace, 0);
        assert_eq!(c.moe_layer_freq, 1);
        assert_eq!(c.n_shared_experts, 0);
        assert_eq!(c.max_position_embeddings, 2048);
        assert_eq!(c.bos_token_id, None);
        assert!(c.eos_token_ids.is_empty());
        assert!(c.is_moe_layer(0));
        // The remote code's "gready" spelling means greedy.
        let c = parse_edited(V2_LITE, &[("topk_method", Some(json!("gready")))]).unwrap();
        assert_eq!(c.routing.unwrap().topk_method, TopkMethod::Greedy);
    }

    #[test]
    fn v2_full_group_limited_greedy() {
        let c = parse_edited(
            V2_LITE,
            &[
                ("n_routed_experts", Some(json!(160))),
                ("n_group", Some(json!(8))),
                ("topk_group", Some(json!(3))),
                ("topk_method", Some(json!("group_limited_greedy"))),
                ("routed_scaling_factor", Some(json!(16.0))),
                ("q_lora_rank", Some(json!(1536))),
            ],
        )
        .unwrap();
        let r = c.routing.unwrap();
        assert_eq!(r.topk_method, TopkMethod::GroupLimitedGreedy);
        assert_eq!((r.n_group, r.topk_group), (8, 3));
        assert_eq!(r.routed_scaling_factor, 16.0);
        // V2 has no default groups: group_limited_greedy without n_group is an error.
        let msg = error(
            V2_LITE,
            &[
                ("topk_method", Some(json!("group_limited_greedy"))),
                ("n_group", None),
            ],
        );
        assert_mentions(
            &msg,
            &["missing required key n_group", "group_limited_greedy"],
        );
    }

    #[test]
    fn dense_model_and_eos_list() {
        let c = parse_edited(
            V2_LITE,
            &[
                ("n_routed_experts", Some(Value::Null)),
                ("eos_token_id", Some(json!([100001, 100008]))),
            ],
        )
        .unwrap();
        assert_eq!(c.routing, None);
        assert!(!c.is_moe_layer(5));
        assert_eq!(c.eos_token_ids, vec![100001, 100008]);
    }

    #[test]
    fn malformed_json_names_line_and_column() {
        let msg = ModelConfig::from_json_str("{\n  \"model_type\": \"deepseek_v2\",\n  oops\n}")
            .unwrap_err()
            .to_string();
        assert_mentions(&msg, &["not valid JSON", "line 3", "column"]);
        let msg = ModelConfig::from_json_str("[1, 2]")
            .unwrap_err()
            .to_string();
        assert_mentions(&msg, &["object", "an array"]);
    }

    #[test]
    fn unsupported_model_type() {
        let msg = error(V2_LITE, &[("model_type", Some(json!("llama")))]);
        assert_eq!(
            msg,
            "config.json: unsupported model_type \"llama\" (deepinfer serves deepseek_v2 and deepseek_v3)"
        );
        let msg = error(V2_LITE, &[("model_type", None)]);
        assert_mentions(&msg, &["missing required key model_type"]);
    }

    #[test]
    fn unsupported_rope_types() {
        for t in ["linear", "dynamic", "llama3", "longrope"] {
            let msg = error(V2_LITE, &[("rope_scaling.type", Some(json!(t)))]);
            assert_mentions(&msg, &["rope_scaling.type", &format!("{t:?}")]);
        }
        let msg = error(
            HF5_TINY_V3,
            &[("rope_parameters.rope_type", Some(json!("dynamic")))],
        );
        assert_mentions(&msg, &["rope_parameters.rope_type", "\"dynamic\""]);
        let msg = error(
            V2_LITE,
            &[("rope_scaling.attention_factor", Some(json!(1.2)))],
        );
        assert_mentions(&msg, &["rope_scaling.attention_factor", "1.2"]);
        let msg = error(V2_LITE, &[("rope_scaling.truncate", Some(json!(false)))]);
        assert_mentions(&msg, &["rope_scaling.truncate", "false"]);
        let msg = error(V2_LITE, &[("partial_rotary_factor", Some(json!(0.5)))]);
        assert_mentions(&msg, &["partial_rotary_factor", "0.5"]);
        let msg = error(V2_LITE, &[("rope_scaling.factor", Some(json!(0.5)))]);
        assert_mentions(&msg, &["rope_scaling.factor", "0.5"]);
        let msg = error(HF5_TINY_V3, &[("rope_interleave", Some(json!(false)))]);
        assert_mentions(&msg, &["rope_interleave", "false"]);
        let msg = error(V2_LITE, &[("rope_theta", Some(json!("big")))]);
        assert_mentions(&msg, &["rope_theta", "\"big\""]);
    }

    #[test]
    fn unsupported_routing() {
        let msg = error(V2_LITE, &[("scoring_func", Some(json!("sqrtsoftplus")))]);
        assert_mentions(&msg, &["scoring_func", "\"sqrtsoftplus\""]);
        let msg = error(V2_LITE, &[("topk_method", Some(json!("random")))]);
        assert_mentions(&msg, &["topk_method", "\"random\""]);
        let msg = error(V3, &[("scoring_func", Some(json!("softmax")))]);
        assert_mentions(&msg, &["noaux_tc", "softmax"]);
        let msg = error(V3, &[("n_group", Some(json!(7)))]);
        assert_mentions(&msg, &["n_group 7", "256"]);
        let msg = error(V3, &[("topk_group", Some(json!(9)))]);
        assert_mentions(&msg, &["topk_group 9", "n_group (8)"]);
        let msg = error(V3, &[("num_experts_per_tok", Some(json!(300)))]);
        assert_mentions(&msg, &["num_experts_per_tok 300", "256"]);
        let msg = error(
            V3,
            &[("n_group", Some(json!(64))), ("topk_group", Some(json!(1)))],
        );
        assert_mentions(&msg, &["num_experts_per_tok 8", "4 experts"]);
        let msg = error(
            V3,
            &[
                ("n_group", Some(json!(256))),
                ("topk_group", Some(json!(8))),
            ],
        );
        assert_mentions(&msg, &["n_group 256", "at least 2"]);
        let msg = error(V2_LITE, &[("num_experts_per_tok", None)]);
        assert_mentions(&msg, &["missing required key num_experts_per_tok"]);
        let msg = error(V2_LITE, &[("n_routed_experts", Some(json!(0)))]);
        assert_mentions(&msg, &["n_routed_experts 0"]);
        let msg = error(V2_LITE, &[("moe_layer_freq", Some(json!(0)))]);
        assert_mentions(&msg, &["moe_layer_freq 0"]);
    }

    #[test]
    fn unsupported_flags() {
        let msg = error(V2_LITE, &[("attention_bias", Some(json!(true)))]);
        assert_mentions(&msg, &["attention_bias true"]);
        let msg = error(HF5_TINY_V2, &[("mlp_bias", Some(json!(true)))]);
        assert_mentions(&msg, &["mlp_bias true"]);
        let msg = error(V2_LITE, &[("hidden_act", Some(json!("gelu")))]);
        assert_mentions(&msg, &["hidden_act \"gelu\""]);
        let msg = error(V2_LITE, &[("qk_rope_head_dim", Some(json!(63)))]);
        assert_mentions(&msg, &["qk_rope_head_dim 63", "even"]);
        let msg = error(V2_LITE, &[("q_lora_rank", Some(json!(0)))]);
        assert_mentions(&msg, &["q_lora_rank 0"]);
        // num_nextn_predict_layers and quantization_config are accepted (see published_v3).
    }

    #[test]
    fn missing_and_mistyped_required_keys() {
        for key in [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "moe_intermediate_size",
        ] {
            let msg = error(V2_LITE, &[(key, None)]);
            assert_eq!(msg, format!("config.json: missing required key {key}"));
        }
        let msg = error(V2_LITE, &[("hidden_size", Some(json!(-3)))]);
        assert_mentions(&msg, &["hidden_size", "non-negative integer", "-3"]);
        let msg = error(V2_LITE, &[("hidden_size", Some(json!(2048.5)))]);
        assert_mentions(&msg, &["hidden_size", "2048.5"]);
        let msg = error(V2_LITE, &[("hidden_size", Some(Value::Null))]);
        assert_mentions(&msg, &["hidden_size", "null"]);
        let msg = error(V2_LITE, &[("vocab_size", Some(json!(0)))]);
        assert_mentions(&msg, &["vocab_size 0"]);
        let msg = error(V2_LITE, &[("eos_token_id", Some(json!(["x"])))]);
        assert_mentions(&msg, &["eos_token_id", "\"x\""]);
        let msg = error(V2_LITE, &[("tie_word_embeddings", Some(json!("no")))]);
        assert_mentions(&msg, &["tie_word_embeddings", "\"no\""]);
        let msg = error(V2_LITE, &[("rope_scaling", Some(json!("yarn")))]);
        assert_mentions(&msg, &["rope_scaling", "an object"]);
    }

    #[test]
    fn from_file_names_a_missing_path() {
        let path = std::env::temp_dir().join("deepinfer-no-such-dir/config.json");
        let msg = ModelConfig::from_file(&path).unwrap_err().to_string();
        assert!(msg.contains("deepinfer-no-such-dir"), "{msg}");
    }
}
