//! llama.cpp's `deepseek2` tensor names, mapped to the HF names the model reads.
//!
//! `convert_hf_to_gguf.py` (gguf-py's `TENSOR_MAPPING` and its `DeepseekV2Model`) renames every
//! tensor, stacks each layer's routed experts into one `ffn_{gate,up,down}_exps` tensor, and
//! splits `kv_b_proj` into `attn_k_b` (transposed per head) and `attn_v_b` for llama.cpp's
//! absorbed attention. Shapes are otherwise the HF ones: GGUF lists dimensions innermost first
//! and candle's reader reverses them, so an HF `[out, in]` matrix reads back as `[out, in]`
//! with the same row-major bytes.

/// What one GGUF tensor is in HF terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mapped {
    /// The HF tensor of this name, as stored.
    Same(String),
    /// Layer `layer`'s stacked routed experts of projection `proj` (`gate_proj`, `up_proj` or
    /// `down_proj`), `[experts, out, in]`: each expert is HF's
    /// `model.layers.{layer}.mlp.experts.{e}.{proj}.weight`.
    Experts {
        /// The decoder layer.
        layer: usize,
        /// The projection's HF name.
        proj: &'static str,
    },
    /// Layer `layer`'s `attn_k_b`: the key half of `kv_b_proj`, `[heads, kv_lora_rank,
    /// qk_nope_head_dim]` (each head's rows transposed).
    KeyHalf(usize),
    /// Layer `layer`'s `attn_v_b`: the value half of `kv_b_proj`, `[heads, v_head_dim,
    /// kv_lora_rank]`.
    ValueHalf(usize),
}

/// The HF name of layer `layer`'s `kv_b_proj`, which [`Mapped::KeyHalf`] and
/// [`Mapped::ValueHalf`] together make.
pub fn kv_b_name(layer: usize) -> String {
    format!("model.layers.{layer}.self_attn.kv_b_proj.weight")
}

/// What the GGUF tensor `name` is, or `None` for a tensor the model does not read (llama.cpp's
/// precomputed `rope_freqs`, multi-token-prediction layers, anything unknown).
pub fn map(name: &str) -> Option<Mapped> {
    let global = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(hf) = global {
        return Some(Mapped::Same(hf.to_string()));
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = rest.rsplit_once('.')?;
    match (base, suffix) {
        ("ffn_gate_exps", "weight") => {
            return Some(Mapped::Experts {
                layer,
                proj: "gate_proj",
            })
        }
        ("ffn_up_exps", "weight") => {
            return Some(Mapped::Experts {
                layer,
                proj: "up_proj",
            })
        }
        ("ffn_down_exps", "weight") => {
            return Some(Mapped::Experts {
                layer,
                proj: "down_proj",
            })
        }
        ("attn_k_b", "weight") => return Some(Mapped::KeyHalf(layer)),
        ("attn_v_b", "weight") => return Some(Mapped::ValueHalf(layer)),
        // gguf-py names V3's router bias `exp_probs_b.bias`.
        ("exp_probs_b", "bias") => {
            return Some(Mapped::Same(format!(
                "model.layers.{layer}.mlp.gate.e_score_correction_bias"
            )))
        }
        (_, "weight") => {}
        _ => return None,
    }
    let hf = match base {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_q_a" => "self_attn.q_a_proj",
        "attn_q_a_norm" => "self_attn.q_a_layernorm",
        "attn_q_b" => "self_attn.q_b_proj",
        "attn_kv_a_mqa" => "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm" => "self_attn.kv_a_layernorm",
        "attn_kv_b" => "self_attn.kv_b_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_shexp" => "mlp.shared_experts.gate_proj",
        "ffn_up_shexp" => "mlp.shared_experts.up_proj",
        "ffn_down_shexp" => "mlp.shared_experts.down_proj",
        _ => return None,
    };
    Some(Mapped::Same(format!("model.layers.{layer}.{hf}.weight")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_names_map_to_hf_names() {
        let same = |s: &str| Some(Mapped::Same(s.to_string()));
        assert_eq!(map("token_embd.weight"), same("model.embed_tokens.weight"));
        assert_eq!(map("output.weight"), same("lm_head.weight"));
        assert_eq!(
            map("blk.3.attn_kv_a_mqa.weight"),
            same("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
        );
        assert_eq!(
            map("blk.12.ffn_down_shexp.weight"),
            same("model.layers.12.mlp.shared_experts.down_proj.weight")
        );
        assert_eq!(
            map("blk.1.exp_probs_b.bias"),
            same("model.layers.1.mlp.gate.e_score_correction_bias")
        );
        assert_eq!(
            map("blk.2.ffn_up_exps.weight"),
            Some(Mapped::Experts {
                layer: 2,
                proj: "up_proj"
            })
        );
        assert_eq!(map("blk.0.attn_k_b.weight"), Some(Mapped::KeyHalf(0)));
        assert_eq!(map("rope_freqs.weight"), None);
        assert_eq!(map("blk.x.attn_q.weight"), None);
        assert_eq!(map("blk.0.nextn.eh_proj.weight"), None);
    }
}
