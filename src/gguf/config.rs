//! A GGUF file's `deepseek2.*` hyperparameters as the HF `config.json` they were converted
//! from, parsed by [`ModelConfig::from_json_str`] so a GGUF model passes exactly the checks and
//! defaults a checkpoint directory does.
//!
//! What the file does not say directly is inferred as llama.cpp runs it:
//! - `topk_method`: sigmoid gating is V3's `noaux_tc` (llama.cpp adds the `exp_probs_b` bias
//!   and ranks groups by their top-two sum); softmax gating with expert groups is V2's
//!   `group_limited_greedy`, without groups plain `greedy`.
//! - YaRN's `mscale` and `mscale_all_dim`: the converter stores only
//!   `yarn_log_multiplier = 0.1 * mscale_all_dim`, and llama.cpp scales attention as if
//!   `mscale == mscale_all_dim` (true of every published DeepSeek config), so both are read
//!   back from it.
//! - `num_key_value_heads`: the file says 1 (llama.cpp runs MLA as multi-query attention over
//!   the latent); HF's configs say the head count, which is what MLA's up-projection has.

use serde_json::{json, Value};

use super::{GgufFile, ARCHITECTURE};
use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// llama.cpp's `expert_gating_func` values (`LLAMA_EXPERT_GATING_FUNC_TYPE_*`).
const GATING_SOFTMAX: u64 = 1;
const GATING_SIGMOID: u64 = 2;

impl GgufFile {
    /// The model's configuration, from the file's metadata (see the module docs).
    pub fn model_config(&self) -> Result<ModelConfig> {
        let json = self.hf_config()?;
        ModelConfig::from_json_str(&json.to_string()).map_err(|e| match e {
            Error::Config(msg) => Error::Gguf(format!(
                "{}: its metadata, read as config.json, is refused: {msg}",
                self.path().display()
            )),
            other => other,
        })
    }

    /// The HF `config.json` the metadata stands for.
    pub fn hf_config(&self) -> Result<Value> {
        let m = self.metadata();
        m.architecture()?;
        let key = |k: &str| format!("{ARCHITECTURE}.{k}");
        let rope_dim = m.usize(&key("rope.dimension_count"))?;
        // Files converted before llama.cpp's MLA rework carry only key/value_length, then the
        // per-head dimensions of multi-head attention.
        let qk_head = match m.opt_usize(&key("attention.key_length_mla"))? {
            Some(k) => k,
            None => m.usize(&key("attention.key_length"))?,
        };
        let v_head = match m.opt_usize(&key("attention.value_length_mla"))? {
            Some(v) => v,
            None => m.usize(&key("attention.value_length"))?,
        };
        let Some(qk_nope) = qk_head.checked_sub(rope_dim) else {
            return Err(Error::Gguf(format!(
                "{}: attention.key_length_mla {qk_head} is smaller than rope.dimension_count \
                 {rope_dim}",
                self.path().display()
            )));
        };
        let heads = m.usize(&key("attention.head_count"))?;
        let vocab = match m.opt_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => m.strings("tokenizer.ggml.tokens")?.len(),
        };

        let experts = m.opt_usize(&key("expert_count"))?.filter(|&n| n > 0);
        let sigmoid = match m.opt_u64(&key("expert_gating_func"))? {
            None | Some(GATING_SOFTMAX) => false,
            Some(GATING_SIGMOID) => true,
            Some(other) => {
                return Err(Error::Gguf(format!(
                    "{}: expert_gating_func {other} is not one deepinfer implements (1: softmax, \
                     2: sigmoid)",
                    self.path().display()
                )))
            }
        };
        let mut c = json!({
            "model_type": if sigmoid { "deepseek_v3" } else { "deepseek_v2" },
            "vocab_size": vocab,
            "hidden_size": m.usize(&key("embedding_length"))?,
            "intermediate_size": m.usize(&key("feed_forward_length"))?,
            "num_hidden_layers": m.usize(&key("block_count"))?,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            // llama.cpp's own writer (llama-model-saver) stores 0 for "no query compression",
            // and its loader reads 0 so (attn_q instead of attn_q_a/attn_q_b): null here.
            "q_lora_rank": m.opt_usize(&key("attention.q_lora_rank"))?.filter(|&r| r > 0),
            "kv_lora_rank": m.usize(&key("attention.kv_lora_rank"))?,
            "qk_nope_head_dim": qk_nope,
            "qk_rope_head_dim": rope_dim,
            "v_head_dim": v_head,
            "rope_interleave": true,
            "rms_norm_eps": m.f64(&key("attention.layer_norm_rms_epsilon"))?,
            "max_position_embeddings": m.usize(&key("context_length"))?,
            "rope_theta": m.opt_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            "rope_scaling": self.rope_scaling()?,
            "n_routed_experts": experts,
            "tie_word_embeddings": !self.tensor_infos().contains_key("output.weight"),
            "torch_dtype": self.saved_dtype(),
            "bos_token_id": m.opt_u64("tokenizer.ggml.bos_token_id")?,
            "eos_token_id": m.opt_u64("tokenizer.ggml.eos_token_id")?,
        });
        if experts.is_some() {
            let groups = m.opt_usize(&key("expert_group_count"))?.unwrap_or(1);
            let method = match (sigmoid, groups > 1) {
                (true, _) => "noaux_tc",
                (false, true) => "group_limited_greedy",
                (false, false) => "greedy",
            };
            let moe = json!({
                "moe_intermediate_size": m.usize(&key("expert_feed_forward_length"))?,
                "n_shared_experts": m.opt_usize(&key("expert_shared_count"))?.unwrap_or(0),
                "num_experts_per_tok": m.usize(&key("expert_used_count"))?,
                "first_k_dense_replace":
                    m.opt_usize(&key("leading_dense_block_count"))?.unwrap_or(0),
                "moe_layer_freq": 1,
                "scoring_func": if sigmoid { "sigmoid" } else { "softmax" },
                "topk_method": method,
                "n_group": groups,
                "topk_group": m.opt_usize(&key("expert_group_used_count"))?.unwrap_or(1),
                "norm_topk_prob": m.opt_bool(&key("expert_weights_norm"))?.unwrap_or(false),
                "routed_scaling_factor":
                    m.opt_f64(&key("expert_weights_scale"))?.unwrap_or(1.0),
            });
            if let (Some(c), Value::Object(moe)) = (c.as_object_mut(), moe) {
                c.extend(moe);
            }
        }
        // A key the file lacks is left out (its default applies), except where null says
        // something: `q_lora_rank` (no query compression, V2-Lite) and `n_routed_experts` (a
        // dense model).
        if let Some(c) = c.as_object_mut() {
            c.retain(|k, v| !v.is_null() || k == "q_lora_rank" || k == "n_routed_experts");
        }
        Ok(c)
    }

    /// `rope_scaling` for a YaRN file, `None` without scaling.
    fn rope_scaling(&self) -> Result<Option<Value>> {
        let m = self.metadata();
        let key = |k: &str| format!("{ARCHITECTURE}.rope.scaling.{k}");
        match m.opt_str(&key("type"))? {
            None | Some("none") => Ok(None),
            Some("yarn") => {
                // In f32, as stored: 0.1 * 1.0 reads back as exactly 1.0.
                let log_mul = m.opt_f64(&key("yarn_log_multiplier"))?.unwrap_or(0.0) as f32;
                let mscale = super::f32_decimal(log_mul / 0.1);
                Ok(Some(json!({
                    "type": "yarn",
                    "factor": m.f64(&key("factor"))?,
                    "original_max_position_embeddings": m.usize(&key("original_context_length"))?,
                    "beta_fast": m.opt_f64(&key("yarn_beta_fast"))?.unwrap_or(32.0),
                    "beta_slow": m.opt_f64(&key("yarn_beta_slow"))?.unwrap_or(1.0),
                    "mscale": mscale,
                    "mscale_all_dim": mscale,
                })))
            }
            Some("linear") => Ok(Some(json!({
                "type": "linear",
                "factor": m.f64(&key("factor"))?,
            }))),
            Some(other) => Err(Error::Gguf(format!(
                "{}: rope.scaling.type `{other}` is not one deepinfer implements for DeepSeek \
                 models (yarn, linear)",
                self.path().display()
            ))),
        }
    }

    /// What `torch_dtype` the weights have: that of the token embedding when it is a float
    /// type; a block-quantized file's dequantized weights are served in bf16.
    fn saved_dtype(&self) -> &'static str {
        use candle_core::quantized::GgmlDType;
        match self
            .tensor_infos()
            .get("token_embd.weight")
            .map(|i| i.ggml_dtype)
        {
            Some(GgmlDType::F32) => "float32",
            Some(GgmlDType::F16) => "float16",
            _ => "bfloat16",
        }
    }
}
