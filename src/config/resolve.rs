//! The second phase: typed keys become a [`ModelConfig`], with defaults applied and anything
//! deepinfer does not implement rejected.
//!
//! The order of the checks is the order a reader fixes a file in: what model this is, the flags
//! deepinfer implements one way only, the shapes, then the router ([`super::routing`]), the
//! position embedding ([`super::rope`]) and the vocabulary.

use serde_json::Value;

use super::defaults::Defaults;
use super::messages::{invalid, missing, unsupported, wrong_type};
use super::raw::RawConfig;
use super::{quantization, rope, routing, value, Architecture, IndexerConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::graph::DType;

/// Resolves every field of [`ModelConfig`] from the keys of one `config.json`.
pub(super) fn model_config(raw: &RawConfig) -> Result<ModelConfig> {
    let architecture = match raw.model_type.as_deref() {
        None => return Err(missing("model_type")),
        Some("deepseek_v2") => Architecture::DeepseekV2,
        Some("deepseek_v3") => Architecture::DeepseekV3,
        Some("deepseek_v32") => Architecture::DeepseekV32,
        Some(other) => {
            return Err(Error::Config(format!(
                "unsupported model_type {other:?} (deepinfer serves deepseek_v2, deepseek_v3 \
                 and deepseek_v32, and reads deepseek_v4)"
            )))
        }
    };
    let defaults = Defaults::of(architecture);

    reject_unsupported_flags(raw)?;

    let vocab_size = required_positive("vocab_size", raw.vocab_size)?;
    let hidden_size = required_positive("hidden_size", raw.hidden_size)?;
    let intermediate_size = required_positive("intermediate_size", raw.intermediate_size)?;
    let num_hidden_layers = required_positive("num_hidden_layers", raw.num_hidden_layers)?;
    let num_attention_heads = required_positive("num_attention_heads", raw.num_attention_heads)?;
    let q_lora_rank = raw.q_lora_rank.ok_or_else(|| missing("q_lora_rank"))?;
    if q_lora_rank == Some(0) {
        return Err(invalid(
            "q_lora_rank",
            0,
            "must be at least 1, or null for a plain q_proj",
        ));
    }
    let kv_lora_rank = required_positive("kv_lora_rank", raw.kv_lora_rank)?;
    let qk_nope_head_dim = required("qk_nope_head_dim", raw.qk_nope_head_dim)?;
    let qk_rope_head_dim = required_positive("qk_rope_head_dim", raw.qk_rope_head_dim)?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(invalid(
            "qk_rope_head_dim",
            qk_rope_head_dim,
            "must be even (RoPE rotates pairs)",
        ));
    }
    let v_head_dim = required_positive("v_head_dim", raw.v_head_dim)?;

    let n_routed_experts = raw
        .n_routed_experts
        .ok_or_else(|| missing("n_routed_experts"))?;
    let routing = match n_routed_experts {
        None => None,
        Some(n) => Some(routing::routing(raw, &defaults, n)?),
    };
    let moe_intermediate_size = match routing {
        Some(_) => required_positive("moe_intermediate_size", raw.moe_intermediate_size)?,
        None => raw.moe_intermediate_size.flatten().unwrap_or(0),
    };
    let n_shared_experts = raw.n_shared_experts.unwrap_or(0);
    let first_k_dense_replace = raw
        .first_k_dense_replace
        .unwrap_or(defaults.first_k_dense_replace);
    let moe_layer_freq = raw.moe_layer_freq.unwrap_or(1);
    if moe_layer_freq == 0 {
        return Err(invalid("moe_layer_freq", 0, "must be at least 1"));
    }

    let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
    if rms_norm_eps <= 0.0 {
        return Err(invalid("rms_norm_eps", rms_norm_eps, "must be positive"));
    }
    let max_position_embeddings = raw
        .max_position_embeddings
        .unwrap_or(defaults.max_position_embeddings);
    if max_position_embeddings == 0 {
        return Err(invalid("max_position_embeddings", 0, "must be at least 1"));
    }
    let rope = rope::rope(raw, max_position_embeddings)?;
    let indexer = match architecture {
        Architecture::DeepseekV32 => Some(indexer(raw, q_lora_rank, qk_rope_head_dim)?),
        _ => None,
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
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        bos_token_id: raw.bos_token_id,
        eos_token_ids: raw.eos_token_id.clone().unwrap_or_default(),
        fp8_block: quantization::fp8_block(raw.quantization_config.as_ref())?,
        indexer,
        saved_dtype: saved_dtype(raw.dtype.as_deref().or(raw.torch_dtype.as_deref())),
        num_nextn_predict_layers: raw.num_nextn_predict_layers.unwrap_or(0),
        draft_layers: 0,
        draft_shares_embeddings: false,
        v4: None,
    })
}

/// The indexer of a `deepseek_v32` config. Its three keys are required: two fix the index
/// weights' shapes, and `index_topk` decides which tokens every layer attends to, so a default
/// (transformers' 64 / 128 / 2048 describe the 671B model) would only hide a broken file.
fn indexer(
    raw: &RawConfig,
    q_lora_rank: Option<usize>,
    qk_rope_head_dim: usize,
) -> Result<IndexerConfig> {
    let n_heads = required_positive("index_n_heads", raw.index_n_heads)?;
    let head_dim = required_positive("index_head_dim", raw.index_head_dim)?;
    let topk = required_positive("index_topk", raw.index_topk)?;
    if head_dim < qk_rope_head_dim {
        return Err(invalid(
            "index_head_dim",
            head_dim,
            &format!("must be at least qk_rope_head_dim ({qk_rope_head_dim}): RoPE rotates its first dims"),
        ));
    }
    if q_lora_rank.is_none() {
        return Err(invalid(
            "q_lora_rank",
            "null",
            "deepseek_v32's indexer projects the query latent, so q_lora_rank must be set",
        ));
    }
    Ok(IndexerConfig {
        n_heads,
        head_dim,
        topk,
    })
}

/// Flags whose non-default value changes the math in a way deepinfer does not implement.
fn reject_unsupported_flags(raw: &RawConfig) -> Result<()> {
    let hidden_act = raw.hidden_act.as_deref().unwrap_or("silu");
    if hidden_act != "silu" {
        return Err(unsupported(
            "hidden_act",
            format!("{hidden_act:?}"),
            "deepinfer implements \"silu\"",
        ));
    }
    for (key, value) in [
        ("attention_bias", raw.attention_bias),
        ("mlp_bias", raw.mlp_bias),
    ] {
        if value == Some(true) {
            return Err(unsupported(
                key,
                true,
                "DeepSeek's projections have no bias; deepinfer loads none",
            ));
        }
    }
    if raw.rope_interleave == Some(false) {
        return Err(unsupported(
            "rope_interleave",
            false,
            "deepinfer rotates DeepSeek's interleaved pairs",
        ));
    }
    Ok(())
}

/// A size that must be present and not `null` (`size` as [`RawConfig`] holds it).
pub(super) fn required(key: &str, size: Option<Option<usize>>) -> Result<usize> {
    match size {
        None => Err(missing(key)),
        Some(None) => Err(wrong_type(key, value::SIZE, &Value::Null)),
        Some(Some(n)) => Ok(n),
    }
}

/// A [`required`] size that must also be at least 1.
pub(super) fn required_positive(key: &str, size: Option<Option<usize>>) -> Result<usize> {
    let n = required(key, size)?;
    if n == 0 {
        return Err(invalid(key, n, "must be at least 1"));
    }
    Ok(n)
}

/// The float dtype `dtype` (transformers 5) or `torch_dtype` (transformers 4) names, when it
/// is f32, bf16 or f16: what the weights were saved in.
pub(super) fn saved_dtype(name: Option<&str>) -> Option<DType> {
    match name {
        Some("float32") => Some(DType::F32),
        Some("bfloat16") => Some(DType::BF16),
        Some("float16") => Some(DType::F16),
        _ => None,
    }
}
