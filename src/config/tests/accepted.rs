//! Configs that parse: both spellings, every default, the keys that are not read.

use serde_json::{json, Value};

use super::*;

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
