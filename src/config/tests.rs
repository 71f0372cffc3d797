//! `config.json` parsing: the published and transformers 5 spellings, every default, and every
//! rejection, each error checked for the key and the value it names.
//!
//! The whole configs are fixtures (`fixtures/configs/`); each test edits one or a few keys.

use serde_json::{json, Value};

use super::*;
use crate::error::Result;

/// deepseek-ai/DeepSeek-V2-Lite `config.json`, as published (remote-code spelling).
const V2_LITE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/deepseek-v2-lite.json"
));

/// deepseek-ai/DeepSeek-V3 `config.json`, as published (FP8 weights, one MTP layer).
const V3: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/deepseek-v3.json"
));

/// A tiny V3 written by transformers 5.24's `DeepseekV3Config.save_pretrained`: no
/// `scoring_func`/`topk_method`, RoPE under `rope_parameters`.
const HF5_TINY_V3: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/transformers5-tiny-v3.json"
));

/// A tiny V2 written by transformers 5.24's `DeepseekV2Config.save_pretrained`.
const HF5_TINY_V2: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/transformers5-tiny-v2.json"
));

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

#[test]
fn type_errors_name_the_key_path_and_the_value() {
    let msg = error(V2_LITE, &[("rope_scaling.factor", Some(json!("x")))]);
    assert_eq!(
        msg,
        "config.json: rope_scaling.factor must be a finite number, got \"x\""
    );
    let msg = error(V2_LITE, &[("rope_scaling", Some(json!([1])))]);
    assert_eq!(msg, "config.json: rope_scaling must be an object, got [1]");
    let msg = error(
        HF5_TINY_V3,
        &[("rope_parameters.rope_type", Some(json!(3)))],
    );
    assert_eq!(
        msg,
        "config.json: rope_parameters.rope_type must be a string, got 3"
    );
    let msg = error(V2_LITE, &[("eos_token_id", Some(json!(-1)))]);
    assert_eq!(
        msg,
        "config.json: eos_token_id must be a token id (a non-negative 32-bit integer), got -1"
    );
    let msg = error(V2_LITE, &[("bos_token_id", Some(json!(5_000_000_000u64)))]);
    assert_mentions(&msg, &["bos_token_id", "5000000000"]);
}

#[test]
fn moe_intermediate_size_is_required_only_with_routed_experts() {
    let c = parse_edited(
        V2_LITE,
        &[
            ("n_routed_experts", Some(Value::Null)),
            ("moe_intermediate_size", Some(Value::Null)),
        ],
    )
    .unwrap();
    assert_eq!(c.moe_intermediate_size, 0);
    let msg = error(V2_LITE, &[("moe_intermediate_size", Some(Value::Null))]);
    assert_eq!(
        msg,
        "config.json: moe_intermediate_size must be a non-negative integer, got null"
    );
}

#[test]
fn unknown_keys_may_hold_anything() {
    let plain = ModelConfig::from_json_str(V2_LITE).unwrap();
    let c = parse_edited(
        V2_LITE,
        &[
            ("some_future_key", Some(json!({"nested": [1, "x", null]}))),
            ("rope_scaling.some_future_key", Some(json!([true]))),
        ],
    )
    .unwrap();
    assert_eq!(c, plain);
}

#[test]
fn only_the_chosen_rope_object_is_read() {
    // rope_scaling wins, so rope_parameters is not read at all (HF: `rope_scaling or
    // rope_parameters`)...
    let bad_params = json!({"rope_type": 3});
    let c = parse_edited(V2_LITE, &[("rope_parameters", Some(bad_params.clone()))]).unwrap();
    assert_eq!(c, ModelConfig::from_json_str(V2_LITE).unwrap());
    // ...but it is when rope_scaling is empty.
    let msg = error(
        V2_LITE,
        &[
            ("rope_scaling", Some(json!({}))),
            ("rope_parameters", Some(bad_params)),
        ],
    );
    assert_eq!(
        msg,
        "config.json: rope_parameters.rope_type must be a string, got 3"
    );
}

#[test]
fn a_key_deepinfer_reads_is_type_checked_even_where_unused() {
    // Greedy routing ignores the groups, and plain RoPE ignores YaRN's keys; a wrong type there
    // is still a broken file.
    let msg = error(V2_LITE, &[("n_group", Some(json!("x")))]);
    assert_eq!(
        msg,
        "config.json: n_group must be a non-negative integer, got \"x\""
    );
    let msg = error(HF5_TINY_V2, &[("rope_parameters.factor", Some(json!("x")))]);
    assert_eq!(
        msg,
        "config.json: rope_parameters.factor must be a finite number, got \"x\""
    );
}
