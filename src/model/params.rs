//! The model's parameters: what each graph input named after a weight holds, how it is read
//! from an HF checkpoint, and the once-at-load preparation of derived weights.
//!
//! Names follow the HF checkpoint wherever a tensor is used as stored. Two kinds of weights are
//! derived at load so that no graph re-derives them per step:
//! - MLA absorption: `kv_b_proj` viewed as `[heads, nope + v, kv_lora_rank]` is split into
//!   `self_attn.w_uk` (`[heads, nope, kv_lora_rank]`) and `self_attn.w_uv`
//!   (`[heads, v, kv_lora_rank]`), which decode multiplies into the query and the output.
//! - Stacked experts: the per-expert `mlp.experts.E.{gate,up,down}_proj.weight` become one
//!   `[experts, out, in]` tensor each (`mlp.experts.gate_proj`, ...), which both MoE strategies
//!   index.

use std::collections::HashMap;

use candle_core::{Device, Tensor as CTensor};

use crate::config::{Architecture, ModelConfig};
use crate::error::{Error, Result};
use crate::weights::Checkpoint;

/// Shapes of every parameter a graph may reference, by name.
#[derive(Debug, Clone)]
pub struct WeightSpecs(HashMap<String, Vec<usize>>);

impl WeightSpecs {
    /// Every parameter of `cfg`, prepared names included.
    pub fn new(cfg: &ModelConfig) -> Self {
        let mut m = HashMap::new();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let heads = cfg.num_attention_heads;
        m.insert("model.embed_tokens.weight".into(), vec![v, h]);
        m.insert("model.norm.weight".into(), vec![h]);
        if !cfg.tie_word_embeddings {
            m.insert("lm_head.weight".into(), vec![v, h]);
        }
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            m.insert(format!("{p}.input_layernorm.weight"), vec![h]);
            m.insert(format!("{p}.post_attention_layernorm.weight"), vec![h]);
            let a = format!("{p}.self_attn");
            match cfg.q_lora_rank {
                Some(r) => {
                    m.insert(format!("{a}.q_a_proj.weight"), vec![r, h]);
                    m.insert(format!("{a}.q_a_layernorm.weight"), vec![r]);
                    m.insert(
                        format!("{a}.q_b_proj.weight"),
                        vec![heads * cfg.qk_head_dim(), r],
                    );
                }
                None => {
                    m.insert(
                        format!("{a}.q_proj.weight"),
                        vec![heads * cfg.qk_head_dim(), h],
                    );
                }
            }
            m.insert(
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![cfg.kv_cache_width(), h],
            );
            m.insert(format!("{a}.kv_a_layernorm.weight"), vec![cfg.kv_lora_rank]);
            m.insert(
                format!("{a}.kv_b_proj.weight"),
                vec![
                    heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                    cfg.kv_lora_rank,
                ],
            );
            m.insert(
                format!("{a}.w_uk"),
                vec![heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank],
            );
            m.insert(
                format!("{a}.w_uv"),
                vec![heads, cfg.v_head_dim, cfg.kv_lora_rank],
            );
            m.insert(
                format!("{a}.o_proj.weight"),
                vec![h, heads * cfg.v_head_dim],
            );
            let mp = format!("{p}.mlp");
            match &cfg.routing {
                Some(r) if cfg.is_moe_layer(l) => {
                    let (e, i) = (r.n_routed_experts, cfg.moe_intermediate_size);
                    m.insert(format!("{mp}.gate.weight"), vec![e, h]);
                    if cfg.architecture == Architecture::DeepseekV3 {
                        m.insert(format!("{mp}.gate.e_score_correction_bias"), vec![e]);
                    }
                    m.insert(format!("{mp}.experts.gate_proj"), vec![e, i, h]);
                    m.insert(format!("{mp}.experts.up_proj"), vec![e, i, h]);
                    m.insert(format!("{mp}.experts.down_proj"), vec![e, h, i]);
                    if cfg.n_shared_experts > 0 {
                        let s = i * cfg.n_shared_experts;
                        m.insert(format!("{mp}.shared_experts.gate_proj.weight"), vec![s, h]);
                        m.insert(format!("{mp}.shared_experts.up_proj.weight"), vec![s, h]);
                        m.insert(format!("{mp}.shared_experts.down_proj.weight"), vec![h, s]);
                    }
                }
                _ => {
                    let i = cfg.intermediate_size;
                    m.insert(format!("{mp}.gate_proj.weight"), vec![i, h]);
                    m.insert(format!("{mp}.up_proj.weight"), vec![i, h]);
                    m.insert(format!("{mp}.down_proj.weight"), vec![h, i]);
                }
            }
        }
        WeightSpecs(m)
    }

    /// The shape of a parameter, if the model has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.0.get(name).map(|v| v.as_slice())
    }

    /// All parameter names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.0.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Total number of parameters (derived weights counted too).
    pub fn param_count(&self) -> usize {
        self.0.values().map(|s| s.iter().product::<usize>()).sum()
    }
}

/// The model's parameters as f32 host tensors, ready to bind to graph inputs by name.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    tensors: HashMap<String, CTensor>,
}

impl ModelWeights {
    /// Loads and prepares every parameter from a checkpoint, checking each shape.
    pub fn load(cfg: &ModelConfig, ckpt: &Checkpoint) -> Result<Self> {
        let specs = WeightSpecs::new(cfg);
        let mut tensors = HashMap::new();
        for name in specs.names() {
            let shape = specs.shape(name).unwrap_or_default();
            let t = if let Some(a) = name.strip_suffix(".w_uk").or(name.strip_suffix(".w_uv")) {
                let kv_b = ckpt.tensor_f32(
                    &format!("{a}.kv_b_proj.weight"),
                    specs
                        .shape(&format!("{a}.kv_b_proj.weight"))
                        .unwrap_or_default(),
                )?;
                split_kv_b(cfg, &kv_b, name.ends_with(".w_uk"))?
            } else if let Some((prefix, proj)) = stacked_expert(name) {
                let r = cfg
                    .routing
                    .as_ref()
                    .ok_or_else(|| Error::Config("routing".into()))?;
                let per: Vec<CTensor> = (0..r.n_routed_experts)
                    .map(|e| ckpt.tensor_f32(&format!("{prefix}.{e}.{proj}.weight"), &shape[1..]))
                    .collect::<Result<_>>()?;
                CTensor::stack(&per, 0)?
            } else if name == "lm_head.weight" && !ckpt.contains(name) {
                return Err(Error::Weights(format!(
                    "tensor `lm_head.weight` is missing (expected shape {shape:?}; config.json says tie_word_embeddings is false)"
                )));
            } else {
                ckpt.tensor_f32(name, shape)?
            };
            tensors.insert(name.to_string(), t);
        }
        Ok(ModelWeights { tensors })
    }

    /// Random weights (deterministic in `seed`) for benchmarks and tests of configs that have
    /// no checkpoint. Values are scaled like a trained model's (norm weights near 1).
    pub fn random(cfg: &ModelConfig, seed: u64) -> Result<Self> {
        let specs = WeightSpecs::new(cfg);
        let mut tensors = HashMap::new();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for name in specs.names() {
            let shape = specs.shape(name).unwrap_or_default();
            let n: usize = shape.iter().product();
            let is_norm = name.ends_with("norm.weight");
            let scale = if is_norm { 0.1 } else { 0.05 };
            let data: Vec<f32> = (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    if is_norm {
                        1.0 + u * scale
                    } else if name.ends_with("correction_bias") {
                        0.0
                    } else {
                        u * scale * 2.0
                    }
                })
                .collect();
            tensors.insert(
                name.to_string(),
                CTensor::from_vec(data, shape, &Device::Cpu)?,
            );
        }
        // The absorbed matrices are views of kv_b_proj, as at load: prefill (which reads
        // kv_b_proj) and decode (which reads w_uk / w_uv) must compute the same function.
        for l in 0..cfg.num_hidden_layers {
            let a = format!("model.layers.{l}.self_attn");
            let kv_b = tensors[&format!("{a}.kv_b_proj.weight")].clone();
            tensors.insert(format!("{a}.w_uk"), split_kv_b(cfg, &kv_b, true)?);
            tensors.insert(format!("{a}.w_uv"), split_kv_b(cfg, &kv_b, false)?);
        }
        Ok(ModelWeights { tensors })
    }

    /// The prepared tensor bound to the graph input `name`.
    pub fn get(&self, name: &str) -> Result<&CTensor> {
        self.tensors.get(name).ok_or_else(|| Error::Binding {
            name: name.to_string(),
            msg: "no such weight".into(),
        })
    }

    /// The embedding weight used by the LM head when embeddings are tied.
    pub fn lm_head_name(cfg: &ModelConfig) -> &'static str {
        if cfg.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        }
    }
}

/// `(prefix, proj)` for a stacked expert name like `model.layers.3.mlp.experts.gate_proj`.
fn stacked_expert(name: &str) -> Option<(&str, &str)> {
    let (prefix, proj) = name.rsplit_once('.')?;
    (prefix.ends_with(".mlp.experts") && proj.ends_with("_proj")).then_some((prefix, proj))
}

fn split_kv_b(cfg: &ModelConfig, kv_b: &CTensor, uk: bool) -> Result<CTensor> {
    let heads = cfg.num_attention_heads;
    let per = cfg.qk_nope_head_dim + cfg.v_head_dim;
    let w = kv_b.reshape((heads, per, cfg.kv_lora_rank))?;
    let part = if uk {
        w.narrow(1, 0, cfg.qk_nope_head_dim)?
    } else {
        w.narrow(1, cfg.qk_nope_head_dim, cfg.v_head_dim)?
    };
    Ok(part.contiguous()?)
}
