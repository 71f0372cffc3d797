//! Configs that do not parse, and what their errors name.

use serde_json::{json, Value};

use super::*;

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
        "config.json: unsupported model_type \"llama\" (deepinfer serves deepseek_v2, deepseek_v3 \
         and deepseek_v32, and reads deepseek_v4)"
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

/// A V3.2 config is V3's with the indexer's three keys; each is required and checked.
#[test]
fn v32_indexer_keys_are_required_and_checked() {
    let v32 = edited(
        V3,
        &[
            ("model_type", Some(json!("deepseek_v32"))),
            ("index_n_heads", Some(json!(64))),
            ("index_head_dim", Some(json!(128))),
            ("index_topk", Some(json!(2048))),
        ],
    );
    let ix = ModelConfig::from_json_str(&v32).unwrap().indexer.unwrap();
    assert_eq!((ix.n_heads, ix.head_dim, ix.topk), (64, 128, 2048));
    for key in ["index_n_heads", "index_head_dim", "index_topk"] {
        let msg = error(&v32, &[(key, None)]);
        assert_eq!(msg, format!("config.json: missing required key {key}"));
        let msg = error(&v32, &[(key, Some(json!(0)))]);
        assert_mentions(&msg, &[&format!("{key} 0"), "at least 1"]);
        let msg = error(&v32, &[(key, Some(json!("many")))]);
        assert_mentions(&msg, &[key, "\"many\""]);
    }
    let msg = error(&v32, &[("index_head_dim", Some(json!(32)))]);
    assert_mentions(&msg, &["index_head_dim 32", "qk_rope_head_dim (64)"]);
    let msg = error(&v32, &[("q_lora_rank", Some(Value::Null))]);
    assert_mentions(&msg, &["q_lora_rank", "indexer"]);
    // The keys mean nothing to V3, which ignores them.
    let v3 = edited(V3, &[("index_topk", Some(json!(0)))]);
    assert!(ModelConfig::from_json_str(&v3).unwrap().indexer.is_none());
}
