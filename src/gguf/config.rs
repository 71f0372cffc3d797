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

use serde_json::{json, Map, Value};

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

        let mut c = Map::new();
        let experts = m.opt_usize(&key("expert_count"))?.filter(|&n| n > 0);
        let gating = m.opt_u64(&key("expert_gating_func"))?;
        let groups = m.opt_usize(&key("expert_group_count"))?.unwrap_or(1);
        let sigmoid = match gating {
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
        c.insert(
            "model_type".into(),
            json!(if sigmoid {
                "deepseek_v3"
            } else {
                "deepseek_v2"
            }),
        );
        c.insert("vocab_size".into(), json!(vocab));
        c.insert(
            "hidden_size".into(),
            json!(m.usize(&key("embedding_length"))?),
        );
        c.insert(
            "intermediate_size".into(),
            json!(m.usize(&key("feed_forward_length"))?),
        );
        c.insert(
            "num_hidden_layers".into(),
            json!(m.usize(&key("block_count"))?),
        );
        c.insert("num_attention_heads".into(), json!(heads));
        c.insert("num_key_value_heads".into(), json!(heads));
        c.insert(
            "q_lora_rank".into(),
            json!(m.opt_usize(&key("attention.q_lora_rank"))?),
        );
        c.insert(
            "kv_lora_rank".into(),
            json!(m.usize(&key("attention.kv_lora_rank"))?),
        );
        c.insert("qk_nope_head_dim".into(), json!(qk_nope));
        c.insert("qk_rope_head_dim".into(), json!(rope_dim));
        c.insert("v_head_dim".into(), json!(v_head));
        c.insert("rope_interleave".into(), json!(true));
        c.insert(
            "rms_norm_eps".into(),
            json!(m.f64(&key("attention.layer_norm_rms_epsilon"))?),
        );
        c.insert(
            "max_position_embeddings".into(),
            json!(m.usize(&key("context_length"))?),
        );
        c.insert(
            "rope_theta".into(),
            json!(m.opt_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0)),
        );
        if let Some(scaling) = self.rope_scaling()? {
            c.insert("rope_scaling".into(), scaling);
        }
        c.insert("n_routed_experts".into(), json!(experts));
        if experts.is_some() {
            c.insert(
                "moe_intermediate_size".into(),
                json!(m.usize(&key("expert_feed_forward_length"))?),
            );
            c.insert(
                "n_shared_experts".into(),
                json!(m.opt_usize(&key("expert_shared_count"))?.unwrap_or(0)),
            );
            c.insert(
                "num_experts_per_tok".into(),
                json!(m.usize(&key("expert_used_count"))?),
            );
            c.insert(
                "first_k_dense_replace".into(),
                json!(m.opt_usize(&key("leading_dense_block_count"))?.unwrap_or(0)),
            );
            c.insert("moe_layer_freq".into(), json!(1));
            c.insert(
                "scoring_func".into(),
                json!(if sigmoid { "sigmoid" } else { "softmax" }),
            );
            let method = match (sigmoid, groups > 1) {
                (true, _) => "noaux_tc",
                (false, true) => "group_limited_greedy",
                (false, false) => "greedy",
            };
            c.insert("topk_method".into(), json!(method));
            c.insert("n_group".into(), json!(groups));
            c.insert(
                "topk_group".into(),
                json!(m.opt_usize(&key("expert_group_used_count"))?.unwrap_or(1)),
            );
            c.insert(
                "norm_topk_prob".into(),
                json!(m.opt_bool(&key("expert_weights_norm"))?.unwrap_or(false)),
            );
            c.insert(
                "routed_scaling_factor".into(),
                json!(m.opt_f64(&key("expert_weights_scale"))?.unwrap_or(1.0)),
            );
        }
        let tied = !self.tensor_infos().contains_key("output.weight");
        c.insert("tie_word_embeddings".into(), json!(tied));
        c.insert("torch_dtype".into(), json!(self.saved_dtype()));
        for (hf, gguf) in [
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ] {
            if let Some(id) = m.opt_u64(gguf)? {
                c.insert(hf.into(), json!(id));
            }
        }
        Ok(Value::Object(c))
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
