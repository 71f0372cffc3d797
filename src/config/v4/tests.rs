//! `V4Config` against transformers 5.25's `DeepseekV4Config`: both spellings of V4-Flash's
//! configuration give the same model, and what deepinfer cannot run is refused by key.

use serde_json::{json, Value};

use super::*;
use crate::config::ModelConfig;

/// V4-Flash as transformers 5.25's `save_pretrained` writes it (its class defaults, which
/// `configuration_deepseek_v4.py` documents as DeepSeek-V4-Flash-Base's), with YaRN on the
/// compressed layers.
fn flash_modern() -> Value {
    let layers = 43;
    let mut layer_types = vec!["heavily_compressed_attention"; 2];
    layer_types.extend((0..layers - 2).map(|i| match i % 2 {
        1 => "compressed_sparse_attention",
        _ => "heavily_compressed_attention",
    }));
    let mut mlp = vec!["hash_moe"; 3];
    mlp.extend(vec!["moe"; layers - 3]);
    let mut v = json!({
        "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "q_lora_rank": 1024, "partial_rotary_factor": 0.125,
        "layer_types": layer_types, "mlp_layer_types": mlp,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0
    });
    let rest = json!({
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "max_position_embeddings": 1048576,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                         "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1, "attention_factor": 1.0, "partial_rotary_factor": 0.125}
        },
        "num_nextn_predict_layers": 1, "tie_word_embeddings": false,
        "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu"
    });
    if let (Some(v), Value::Object(rest)) = (v.as_object_mut(), rest) {
        v.extend(rest);
    }
    v
}

/// The same model in the legacy spelling transformers folds in: `compress_ratios`,
/// `num_hash_layers`, `qk_rope_head_dim` and a flat `rope_scaling`.
fn flash_legacy() -> Value {
    let mut ratios = vec![128; 2];
    ratios.extend((0..41).map(|i| if i % 2 == 1 { 4 } else { 128 }));
    // The MTP layer's entry follows the model's (transformers keeps the first 43).
    ratios.push(0);
    json!({
        "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
        "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024,
        "qk_rope_head_dim": 64, "compress_ratios": ratios, "num_hash_layers": 3,
        "o_groups": 8, "o_lora_rank": 1024,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "bos_token_id": 0, "eos_token_id": 1
    })
}

fn read(v: &Value) -> Result<V4Config> {
    V4Config::from_json_str(&v.to_string())
}

fn err(v: &Value) -> String {
    read(v).unwrap_err().to_string()
}

#[test]
fn both_spellings_of_v4_flash_read_as_one_model() {
    let modern = read(&flash_modern()).unwrap();
    assert_eq!(modern, read(&flash_legacy()).unwrap());
    assert_eq!(modern.rope_dim, 64);
    assert_eq!((modern.csa_rate, modern.hca_rate), (4, 128));
    // Two HCA layers, then CSA and HCA alternating from layer 3.
    assert_eq!(
        modern.attention[..4],
        [
            V4Attention::HeavilyCompressed,
            V4Attention::HeavilyCompressed,
            V4Attention::HeavilyCompressed,
            V4Attention::CompressedSparse,
        ]
    );
    assert_eq!(modern.layers_of(V4Attention::CompressedSparse).count(), 20);
    assert_eq!(modern.layers_of(V4Attention::HeavilyCompressed).count(), 23);
    assert_eq!(
        modern.routing[..4],
        [
            V4Routing::Hash,
            V4Routing::Hash,
            V4Routing::Hash,
            V4Routing::TopK
        ]
    );
    assert_eq!(
        modern.indexer,
        Some(V4Indexer {
            heads: 64,
            head_dim: 128,
            topk: 512
        })
    );
    assert_eq!(
        modern.main_rope,
        RopeConfig {
            theta: 10000.0,
            yarn: None
        }
    );
    let yarn = modern.compress_rope.yarn.as_ref().unwrap();
    assert_eq!(modern.compress_rope.theta, 160000.0);
    assert_eq!(
        (yarn.factor, yarn.original_max_position_embeddings),
        (16.0, 65536)
    );
    assert_eq!((yarn.mscale, yarn.mscale_all_dim), (None, None));
    assert_eq!(modern.scoring, V4Scoring::SqrtSoftplus);
    assert_eq!((modern.hc_mult, modern.hc_sinkhorn_iters), (4, 20));
    assert_eq!(modern.eos_token_ids, [1]);
}

#[test]
fn without_a_schedule_transformers_default_applies() {
    let mut v = flash_modern();
    let o = v.as_object_mut().unwrap();
    o.remove("layer_types");
    o.remove("mlp_layer_types");
    o.remove("compress_rates");
    let cfg = read(&v).unwrap();
    assert_eq!(cfg, read(&flash_modern()).unwrap());
}

#[test]
fn what_deepinfer_cannot_run_is_refused_by_key() {
    let with = |key: &str, val: Value| {
        let mut v = flash_modern();
        v[key] = val;
        err(&v)
    };
    let cases = [
        (
            with("layer_types", json!(vec!["sliding_attention"; 3])),
            "layer_types of 3 entries",
        ),
        (
            with("layer_types", json!(vec!["dense"; 43])),
            "layer_types[0] \"dense\"",
        ),
        (
            with("mlp_layer_types", json!(vec!["moe"; 42])),
            "mlp_layer_types of 42 entries",
        ),
        (
            with("o_groups", json!(7)),
            "o_groups 7: must divide num_attention_heads (64)",
        ),
        (
            with("num_key_value_heads", json!(2)),
            "unsupported num_key_value_heads 2",
        ),
        (
            with("scoring_func", json!("softmax")),
            "unsupported scoring_func \"softmax\"",
        ),
        (
            with("partial_rotary_factor", json!(0.001)),
            "partial_rotary_factor 0.001",
        ),
        (
            with("head_dim", Value::Null),
            "head_dim must be a non-negative integer, got null",
        ),
        (
            with("index_topk", Value::Null),
            "missing required key index_topk",
        ),
        (
            with("hidden_act", json!("gelu")),
            "unsupported hidden_act \"gelu\"",
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains(want), "{got:?} lacks {want:?}");
    }
    let mut v = flash_modern();
    v["rope_parameters"]["compress"]["attention_factor"] = json!(1.277);
    assert!(
        err(&v).contains("rope_parameters.compress.attention_factor 1.277"),
        "{}",
        err(&v)
    );
    let mut v = flash_legacy();
    v["compress_ratios"][5] = json!(16);
    assert!(err(&v).contains("compress_ratios[5] 16"), "{}", err(&v));
    // No CSA layer: the indexer's keys are not needed.
    let mut v = flash_modern();
    v["layer_types"] = json!(vec!["heavily_compressed_attention"; 43]);
    v.as_object_mut().unwrap().remove("index_topk");
    assert_eq!(read(&v).unwrap().indexer, None);
}

#[test]
fn a_v4_config_is_read_into_the_model_config_the_runners_take() {
    let c = ModelConfig::from_json_str(&flash_modern().to_string()).unwrap();
    assert_eq!(c.architecture, crate::config::Architecture::DeepseekV4);
    let v4 = c.v4.as_deref().unwrap();
    assert_eq!(v4.layers_of(V4Attention::CompressedSparse).count(), 20);
    assert_eq!(v4.layers_of(V4Attention::HeavilyCompressed).count(), 23);
    assert_eq!(
        (c.vocab_size, c.num_hidden_layers, c.hidden_size),
        (v4.vocab_size, v4.num_hidden_layers, v4.hidden_size)
    );
    assert_eq!(c.eos_token_ids, v4.eos_token_ids);
    // A broken V4 file is named for what is broken, not for being V4.
    let mut v = flash_modern();
    v["o_groups"] = json!(7);
    let msg = ModelConfig::from_json_str(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("o_groups 7"), "{msg}");
}

/// fixtures/tiny-v4's config.json, as transformers 5.25's `save_pretrained` wrote it
/// (scripts/make_v4_fixture.py): every mechanism at a tiny size, YaRN on the compressed layers.
#[test]
fn the_tiny_v4_fixture_reads_as_written() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-v4/config.json");
    let text = std::fs::read_to_string(path).unwrap();
    let cfg = V4Config::from_json_str(&text).unwrap();
    use V4Attention::{CompressedSparse as Csa, HeavilyCompressed as Hca, Sliding};
    assert_eq!(cfg.attention, [Hca, Csa, Sliding, Csa, Hca]);
    assert_eq!(
        cfg.routing,
        [
            V4Routing::Hash,
            V4Routing::Hash,
            V4Routing::TopK,
            V4Routing::TopK,
            V4Routing::TopK
        ]
    );
    assert_eq!((cfg.csa_rate, cfg.hca_rate, cfg.sliding_window), (4, 8, 8));
    assert_eq!(
        (cfg.head_dim, cfg.rope_dim, cfg.num_attention_heads),
        (32, 8, 4)
    );
    assert_eq!(
        (cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank),
        (2, 16, 32)
    );
    assert_eq!(
        cfg.indexer,
        Some(V4Indexer {
            heads: 4,
            head_dim: 16,
            topk: 4
        })
    );
    assert_eq!(
        (
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size
        ),
        (8, 2, 32)
    );
    assert_eq!((cfg.swiglu_limit, cfg.routed_scaling_factor), (3.0, 1.5));
    assert_eq!(
        cfg.main_rope,
        RopeConfig {
            theta: 10000.0,
            yarn: None
        }
    );
    let yarn = cfg.compress_rope.yarn.clone().unwrap();
    assert_eq!(cfg.compress_rope.theta, 160000.0);
    assert_eq!(
        (yarn.factor, yarn.original_max_position_embeddings),
        (4.0, 256)
    );
    assert_eq!((yarn.beta_fast, yarn.beta_slow), (32.0, 1.0));
    assert_eq!(cfg.num_nextn_predict_layers, 0);
}
