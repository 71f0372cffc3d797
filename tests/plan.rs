//! `deepinfer plan` on the published configs: the fit facts issue 14 requires, the totals
//! against independent counts from the model cards, the per-rank identity, bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn config(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/configs")
        .join(name)
        .display()
        .to_string()
}

fn deepinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(args)
        .output()
        .expect("run deepinfer")
}

/// `deepinfer plan --config FILE ARGS --json`, parsed; checks the exit status agrees with `fits`.
fn plan(file: &str, args: &[&str]) -> Value {
    let cfg = config(file);
    let mut all = vec!["plan", "--config", cfg.as_str(), "--json"];
    all.extend_from_slice(args);
    let out = deepinfer(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let fits = v["fits"].as_bool().expect("fits is a bool");
    assert_eq!(out.status.code(), Some(if fits { 0 } else { 1 }), "{v}");
    v
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing: {v}"))
}

/// Fails unless the command exited 2 with one stderr line containing every needle.
fn assert_bad_input(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected: {err}"
    );
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn json_has_the_required_keys() {
    let v = plan("deepseek-v2-lite.json", &["--tp", "2"]);
    for key in [
        "fits",
        "weights_bytes_total",
        "per_core",
        "tp",
        "instance",
        "suggestion",
        "host",
        "kv_blocks",
    ] {
        assert!(v.get(key).is_some(), "{key} missing: {v}");
    }
    assert_eq!(v["tp"], 2);
    assert_eq!(v["instance"], "trn1.2xlarge");
    let cores = v["per_core"].as_array().expect("per_core is an array");
    assert_eq!(cores.len(), 2);
    for c in cores {
        let parts = [
            "weights",
            "kv_cache",
            "metadata",
            "outputs",
            "neff_code_estimate",
            "scratchpad_estimate",
        ];
        let sum: u64 = parts.iter().map(|k| u(c, k)).sum();
        assert_eq!(sum, u(c, "total"), "{c}");
    }
}

/// DeepSeek-V2-Lite in bf16 (31.4 GB of weights) cannot sit on one 16 GiB core, and fits the
/// two cores of a trn1.2xlarge with int8 experts; the suggestion from `--tp 1` says so.
#[test]
fn v2_lite_on_trn1_2xlarge() {
    let tp1 = plan("deepseek-v2-lite.json", &["--tp", "1", "--dtype", "bf16"]);
    assert_eq!(tp1["fits"], false, "{tp1}");
    let s = tp1["suggestion"].as_str().expect("a suggestion");
    assert!(s.contains("--tp 2 --quantize experts-int8"), "{s}");

    let tp2_bf16 = plan("deepseek-v2-lite.json", &["--tp", "2", "--dtype", "bf16"]);
    assert_eq!(tp2_bf16["fits"], false, "{tp2_bf16}");

    let tp2 = plan(
        "deepseek-v2-lite.json",
        &["--tp", "2", "--dtype", "bf16", "--quantize", "experts-int8"],
    );
    assert_eq!(tp2["fits"], true, "{tp2}");
    assert!(tp2["suggestion"].is_null());

    // int4 experts: 9.57 GiB of weights, but at the serve defaults the 28 NEFFs' code
    // (2.85 GiB) and the largest one's scratchpad (1.43 GiB: the Dense MoE path's experts
    // dequantized to bf16) leave no room on one core; with a quarter of the batch (eight
    // sequences' cache, NEFFs up to batch 8) one core of the two is enough.
    let int4 = plan(
        "deepseek-v2-lite.json",
        &["--tp", "1", "--dtype", "bf16", "--quantize", "experts-int4"],
    );
    assert_eq!(int4["fits"], false, "{int4}");
    let weights = int4["weights_bytes_total"].as_f64().unwrap();
    assert!((9.0e9..11.0e9).contains(&weights), "{int4}");
    let core = &int4["per_core"][0];
    assert!(u(core, "neff_code_estimate") > 2 << 30, "{core}");
    assert!(u(core, "scratchpad_estimate") > 1 << 30, "{core}");
    let small = plan(
        "deepseek-v2-lite.json",
        &[
            "--tp",
            "1",
            "--dtype",
            "bf16",
            "--quantize",
            "experts-int4",
            "--max-batch",
            "8",
        ],
    );
    assert_eq!(small["fits"], true, "{small}");
}

/// Each NEFF the plan counts is a graph the capture builds, with its estimate: every NEFF
/// name once, decode and prefill for every context bucket, the code growing with the batch,
/// and the per-core code the sum of the NEFFs' plus the runtime's 96 MiB micro-code.
#[test]
fn neff_figures_come_from_each_bucket_s_graph() {
    let v = plan("deepseek-v2-lite.json", &["--tp", "2", "--dtype", "bf16"]);
    let neffs = v["neffs"].as_array().expect("neffs");
    assert_eq!(neffs.len() as u64, u(&v, "graphs"), "{v}");
    let name = |g: &Value| g["name"].as_str().unwrap().to_string();
    let mut names: Vec<String> = neffs.iter().map(name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), neffs.len());
    for want in ["decode_b1_c128", "decode_b32_c2048", "prefill_t64_c2048"] {
        assert!(names.iter().any(|n| n == want), "{want}: {names:?}");
    }
    let code = |n: &str| {
        let g = neffs.iter().find(|g| name(g) == n).unwrap();
        u(g, "code_estimate") + u(g, "collectives_estimate")
    };
    assert!(code("decode_b1_c2048") < code("decode_b32_c2048"));
    let private: u64 = neffs.iter().map(|g| code(&name(g))).sum();
    let core = &v["per_core"][0];
    assert_eq!(
        u(core, "neff_code_estimate"),
        private + (96 << 20),
        "{core}"
    );
    let scratch = neffs
        .iter()
        .map(|g| u(g, "scratch_computed"))
        .max()
        .unwrap();
    assert_eq!(u(core, "scratchpad_estimate"), scratch);
}

/// DeepSeek-V2 (236B) on a trn1.32xlarge at `--tp 32`, at the default 0.9 utilization:
/// - bf16 does not fit: a rank's weights alone (472 GB / 32 = 14.7 GB of shards plus 1.5 GB
///   replicated: 15.07 GiB) exceed the 14.4 GiB budget;
/// - int8 experts fit at the serve defaults (32 sequences of 2048 tokens: 4.2 GiB of latent
///   cache on every rank), at 14.34 GiB: a rank's graphs are narrow, so its 28 NEFFs' code
///   estimate is 1.07 GiB; the bf16 plan suggests int8;
/// - `--kv-blocks auto` fills the rest (4157 blocks: 32 whole sequences of 2048 tokens), and
///   without packed prefill (four fewer NEFFs) a few more.
#[test]
fn v2_on_trn1_32xlarge_at_tp32() {
    let base = [
        "--instance",
        "trn1.32xlarge",
        "--tp",
        "32",
        "--dtype",
        "bf16",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        plan("deepseek-v2.json", &a)
    };
    let bf16 = with(&[]);
    assert_eq!(bf16["fits"], false, "{bf16}");
    assert!(u(&bf16["per_core"][0], "weights") > u(&bf16, "budget_per_core"));
    let s = bf16["suggestion"].as_str().expect("a suggestion");
    assert!(s.contains("--tp 32 --quantize experts-int8 ("), "{s}");
    // Even auto KV blocks cannot save bf16: no cache left at all.
    assert_eq!(u(&with(&["--kv-blocks", "auto"]), "kv_blocks"), 0);

    let int8 = with(&["--quantize", "experts-int8"]);
    assert_eq!(int8["fits"], true, "{int8}");

    let auto = with(&["--quantize", "experts-int8", "--kv-blocks", "auto"]);
    assert_eq!(auto["fits"], true, "{auto}");
    // 32 sequences of 2048 tokens in blocks of 16, plus the scratch block.
    let needed = 32 * 2048 / 16 + 1;
    assert!(u(&auto, "kv_blocks") >= needed, "{auto}");
    // Without packing, four fewer NEFFs: more room for cache.
    let unpacked = with(&[
        "--quantize",
        "experts-int8",
        "--kv-blocks",
        "auto",
        "--max-prefill-seqs",
        "1",
    ]);
    assert!(
        u(&unpacked, "kv_blocks") > u(&auto, "kv_blocks"),
        "{unpacked}"
    );
}

/// DeepSeek-V3 in its published fp8 (about 672 GB) exceeds a trn1.32xlarge's 512 GiB of HBM at
/// any `--tp`; the suggestion names two instances at `--tp 64` (with the cache cut to what
/// fits: every rank holds the whole latent cache) and one trn2.48xlarge.
#[test]
fn v3_fp8_does_not_fit_one_trn1_32xlarge() {
    let v = plan(
        "deepseek-v3.json",
        &[
            "--instance",
            "trn1.32xlarge",
            "--tp",
            "32",
            "--dtype",
            "fp8",
        ],
    );
    assert_eq!(v["fits"], false, "{v}");
    let s = v["suggestion"].as_str().expect("a suggestion");
    assert!(s.contains("does not fit one trn1.32xlarge"), "{s}");
    assert!(s.contains("2 x trn1.32xlarge"), "{s}");
    assert!(s.contains("--tp 64"), "{s}");
    // What the suggestion says fits, does.
    let two = plan(
        "deepseek-v3.json",
        &[
            "--instance",
            "trn1.32xlarge",
            "--instances",
            "2",
            "--tp",
            "64",
            "--dtype",
            "fp8",
            "--kv-blocks",
            "auto",
        ],
    );
    assert_eq!(two["fits"], true, "{two}");
    // What the runner serves it in over two instances (README): fp8 dequantized to bf16 at
    // load, int4 experts.
    let served = plan(
        "deepseek-v3.json",
        &[
            "--instance",
            "trn1.32xlarge",
            "--instances",
            "2",
            "--tp",
            "64",
            "--quantize",
            "experts-int4",
            "--kv-blocks",
            "auto",
        ],
    );
    assert_eq!(served["fits"], true, "{served}");
    // One trn2.48xlarge (64 logical cores of 24 GiB) holds it at the serve defaults.
    assert!(s.contains("one trn2.48xlarge"), "{s}");
    let trn2 = plan(
        "deepseek-v3.json",
        &[
            "--instance",
            "trn2.48xlarge",
            "--tp",
            "64",
            "--dtype",
            "fp8",
        ],
    );
    assert_eq!(trn2["fits"], true, "{trn2}");
}

/// `weights_bytes_total` against the published parameter counts times bytes per parameter,
/// within 2%. Model cards (Hugging Face):
/// - deepseek-ai/DeepSeek-V2-Lite: "Total Params 15.7B";
/// - deepseek-ai/DeepSeek-V2: "236B total parameters";
/// - deepseek-ai/DeepSeek-V3: "685B ... 671B of the Main Model weights and 14B of the
///   Multi-Token Prediction (MTP) Module weights"; the engine does not load the MTP module, so
///   671B.
#[test]
fn totals_agree_with_published_parameter_counts() {
    let cases: [(&str, &str, f64, f64); 5] = [
        ("deepseek-v2-lite.json", "bf16", 15.7e9, 2.0),
        ("deepseek-v2.json", "bf16", 236e9, 2.0),
        ("deepseek-v3.json", "bf16", 671e9, 2.0),
        // fp8: one byte per parameter (scales, bf16 embeddings and the f32 router add <0.5%).
        ("deepseek-v3.json", "fp8", 671e9, 1.0),
        ("deepseek-v2-lite.json", "f32", 15.7e9, 4.0),
    ];
    for (file, dtype, params, bytes_per_param) in cases {
        let v = plan(file, &["--dtype", dtype]);
        let got = u(&v, "weights_bytes_total") as f64;
        let want = params * bytes_per_param;
        let err = (got - want).abs() / want;
        assert!(
            err < 0.02,
            "{file} {dtype}: {got:.4e} vs {want:.4e} ({:.2}%)",
            err * 100.0
        );
    }
    // int8 experts: routed experts at one byte, the rest at two. DeepSeek-V2-Lite's routed
    // experts, from the model card's architecture (26 MoE layers x 64 experts x 3 matrices of
    // 2048 x 1408), are 14.39B of its 15.7B.
    let experts = 26.0 * 64.0 * 3.0 * 2048.0 * 1408.0;
    let want = experts + (15.7e9 - experts) * 2.0;
    let v = plan(
        "deepseek-v2-lite.json",
        &["--dtype", "bf16", "--quantize", "experts-int8"],
    );
    let got = u(&v, "weights_bytes_total") as f64;
    assert!((got - want).abs() / want < 0.02, "{got:.4e} vs {want:.4e}");
}

/// Sum over ranks = total + (N - 1) x replicated, with the replicated bytes counted here by
/// hand from DeepSeek-V2-Lite's config (bf16): per layer two RMSNorms of 2048, the kv_a
/// projection 576 x 2048 and its norm of 512 (V2-Lite has no q LoRA), the f32 router 64 x 2048
/// on the 26 MoE layers, the final norm, and the rank's two i32 shard offsets.
#[test]
fn per_rank_sum_identity() {
    let replicated: u64 =
        27 * (2 * 2048 * 2 + 576 * 2048 * 2 + 512 * 2) + 26 * 64 * 2048 * 4 + 2048 * 2 + 8;
    for tp in [2u64, 4, 8, 16] {
        let t = tp.to_string();
        let v = plan(
            "deepseek-v2-lite.json",
            &["--dtype", "bf16", "--instance", "trn1.32xlarge", "--tp", &t],
        );
        assert_eq!(u(&v, "replicated_bytes"), replicated);
        let sum: u64 = v["per_core"]
            .as_array()
            .expect("per_core")
            .iter()
            .map(|c| u(c, "weights"))
            .sum();
        assert_eq!(sum, u(&v, "weights_bytes_total") + (tp - 1) * replicated);
    }
}

/// `--kv-blocks auto` fills the budget of the fullest rank to within one block.
#[test]
fn auto_kv_blocks_fill_the_budget() {
    let v = plan(
        "deepseek-v2-lite.json",
        &[
            "--dtype",
            "bf16",
            "--tp",
            "2",
            "--quantize",
            "experts-int8",
            "--kv-blocks",
            "auto",
        ],
    );
    assert_eq!(v["kv_blocks_auto"], true);
    let block = 16 * 27 * 576 * 2;
    let budget = u(&v, "budget_per_core");
    for c in v["per_core"].as_array().expect("per_core") {
        let total = u(c, "total");
        assert!(total <= budget && budget - total < block, "{c}");
    }
    assert!(u(&v, "kv_blocks") > u(&v, "min_kv_blocks"));
}

#[test]
fn bad_tp_is_one_clear_line() {
    let lite = config("deepseek-v2-lite.json");
    let v2 = config("deepseek-v2.json");
    assert_bad_input(
        &deepinfer(&["plan", "--config", &lite, "--tp", "3"]),
        &["--tp 3", "expected one of 1, 2, 4, 8, 16, 32, 64"],
    );
    assert_bad_input(
        &deepinfer(&[
            "plan",
            "--config",
            &lite,
            "--instance",
            "trn1.32xlarge",
            "--tp",
            "32",
        ]),
        &["num_attention_heads = 16", "use --tp 1, 2, 4, 8, 16"],
    );
    assert_bad_input(
        &deepinfer(&[
            "plan",
            "--config",
            &v2,
            "--instance",
            "trn1.32xlarge",
            "--instances",
            "2",
            "--tp",
            "64",
        ]),
        &["n_routed_experts = 160", "use --tp"],
    );
    assert_bad_input(
        &deepinfer(&["plan", "--config", &lite, "--tp", "4"]),
        &[
            "needs 4 NeuronCores",
            "trn1.2xlarge has 2",
            "--instance trn1.32xlarge",
        ],
    );
    assert_bad_input(
        &deepinfer(&["plan", "--config", &lite, "--hbm-utilization", "1.5"]),
        &["--hbm-utilization"],
    );
}

#[test]
fn human_output_is_a_table() {
    let lite = config("deepseek-v2-lite.json");
    let out = deepinfer(&[
        "plan",
        "--config",
        &lite,
        "--tp",
        "2",
        "--quantize",
        "experts-int8",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("rank"), "{text}");
    assert!(text.contains("0-1"), "{text}");
    assert!(text.contains("fits: yes"), "{text}");
    assert!(text.contains("host RAM while loading"), "{text}");
}

/// DeepSeek-V4-Flash as published (FP8 weights, FP4 experts) on one trn1.32xlarge at its
/// deployment degree, as the runner holds it (FP4 experts as stored, each rank's share read
/// one tensor at a time): with its matrices in f32 it does not fit its HBM; in bf16 (weights
/// and cache, the default) it fits at 16 sequences; a dtype the V4 graphs do not compute in is
/// refused.
#[test]
fn v4_flash_as_published_on_trn1_32xlarge() {
    let v = plan(
        "deepseek-v4-flash.json",
        &[
            "--instance",
            "trn1.32xlarge",
            "--tp",
            "32",
            "--dtype",
            "f32",
        ],
    );
    assert_eq!(v["quantize"], "fp4", "{v}");
    assert_eq!(v["fits"], false, "{v}");
    let params = u(&v, "params") as f64 / 1e9;
    assert!((284.0..284.6).contains(&params), "{params}B");
    let short = v["shortfalls"].to_string();
    assert!(
        short.contains("of HBM") && !short.contains("host RAM"),
        "{short}"
    );
    // Streamed: 32 ranks at once, each holding one published tensor and its cut of it (the
    // largest, the embedding or the LM head whole in f32, about 2 GiB), not the model.
    let host = &v["host"];
    assert!(u(host, "peak") < 80 << 30, "{host}");
    // Its matrices and caches in bf16 (what `auto` holds a bf16 checkpoint in, as
    // config.json's torch_dtype says V4-Flash is), 16 sequences (fewer buckets, a smaller
    // cache): it fits, host RAM while loading included.
    let v = plan(
        "deepseek-v4-flash.json",
        &[
            "--instance",
            "trn1.32xlarge",
            "--tp",
            "32",
            "--max-batch",
            "16",
        ],
    );
    assert_eq!(v["fits"], true, "{v}");
    assert_eq!(
        (&v["dtype"], &v["kv_dtype"]),
        (&"bf16".into(), &"bf16".into()),
        "{v}"
    );
    let flash = config("deepseek-v4-flash.json");
    for (flag, dtype, why) in [
        ("--dtype", "f16", "weights are held in f32 or bf16"),
        ("--dtype", "fp8", "dequantized at load"),
        ("--kv-dtype", "f16", "caches are held in f32 or bf16"),
        ("--quantize", "experts-int4", "read as published"),
    ] {
        assert_bad_input(
            &deepinfer(&["plan", "--config", &flash, flag, dtype]),
            &["DeepSeek-V4", why],
        );
    }
}

/// DeepSeek-V4-Pro as published (1.6T parameters: model card; the MTP layer is not loaded)
/// does not fit one trn2.48xlarge at its most ranks, `--tp 64`, even in bf16 at one sequence
/// and 16-token prefill chunks: its weights alone take over 90% of a core's budget (FP4
/// experts as stored, plus the per-token tensors every rank holds whole). More ranks than 64
/// are not offered (`--tp` stops there), and its FP4 experts take no `--quantize`, so nothing
/// is suggested.
#[test]
fn v4_pro_does_not_fit_one_trn2_48xlarge() {
    let v = plan(
        "deepseek-v4-pro.json",
        &[
            "--instance",
            "trn2.48xlarge",
            "--tp",
            "64",
            "--dtype",
            "bf16",
            "--kv-dtype",
            "bf16",
            "--max-batch",
            "1",
            "--prefill-chunk",
            "16",
        ],
    );
    assert_eq!(v["fits"], false, "{v}");
    let params = u(&v, "params") as f64 / 1e12;
    assert!((1.55..1.62).contains(&params), "{params}T");
    let rank = &v["per_core"][0];
    assert!(
        u(rank, "weights") as f64 > 0.9 * u(rank, "budget") as f64,
        "{rank}"
    );
    assert!(v["shortfalls"].to_string().contains("of HBM"), "{v}");
    assert_eq!(v["host"]["fits"], true, "{v}");
    assert!(
        v["suggestions"].as_array().is_some_and(Vec::is_empty),
        "{v}"
    );
    // Its experts are FP4 as published: no `--quantize` is tried or offered.
    let s = v["suggestion"].as_str().expect("a suggestion");
    assert!(
        s.contains("does not fit one trn2.48xlarge at any --tp,"),
        "{s}"
    );
    assert!(!s.contains("int8") && !s.contains("4-bit"), "{s}");
}
