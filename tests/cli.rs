//! The `deepinfer` binary: output formats, and one clear line on stderr with a non-zero exit
//! for every kind of bad input (never a panic).

#[path = "common/compare.rs"]
#[allow(dead_code)] // only the rows' comparison is used here
mod compare;

use std::path::PathBuf;
use std::process::{Command, Output};

use compare::max_abs_diff_rows;

fn deepinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(args)
        .output()
        .expect("run deepinfer")
}

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
        .display()
        .to_string()
}

/// A model directory holding `files`, removed when the returned guard drops.
fn temp_model(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("deepinfer-cli-")
        .tempdir()
        .unwrap();
    for (f, data) in files {
        std::fs::write(dir.path().join(f), data).unwrap();
    }
    dir
}

/// A temporary directory's path as a command-line argument.
fn arg(dir: &tempfile::TempDir) -> String {
    dir.path().display().to_string()
}

/// Fails unless the command exited non-zero with exactly one stderr line containing `needle`.
fn assert_clean_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected: {err}"
    );
    assert!(err.contains(needle), "`{needle}` not in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn generate_json_prints_generated_ids_and_text() {
    let out = deepinfer(&[
        "generate",
        "--model",
        &fixture("tiny-v3"),
        "--token-ids",
        "1,5,9",
        "--max-tokens",
        "6",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 6);
    assert!(v["text"].is_string());
}

/// `bench` prefills a prompt longer than the prefill chunk (64) in chunks, as `serve` does
/// (before, a 100-token prompt was refused as one over-long chunk), and reports the prefill's
/// throughput beside decode's; a prompt of no tokens is one clear error.
#[test]
fn bench_prefills_a_long_prompt_in_chunks_and_reports_both_rates() {
    let model = fixture("tiny-v3");
    let out = deepinfer(&[
        "bench",
        "--model",
        &model,
        "--batch",
        "2",
        "--prompt-len",
        "100",
        "--steps",
        "2",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(v["batch"], 2, "{v}");
    assert_eq!(v["prompt_len"], 100, "{v}");
    for key in ["tokens_per_s", "prefill_tokens_per_s", "ms_per_step"] {
        let x = v[key].as_f64().unwrap_or(f64::NAN);
        assert!(x.is_finite() && x > 0.0, "{key}: {v}");
    }
    let out = deepinfer(&["bench", "--model", &model, "--prompt-len", "0"]);
    assert_clean_error(&out, "--prompt-len must be at least 1");
}

/// A DeepSeek-V4 checkpoint (fixtures/tiny-v4): `score` gives transformers' logits at every
/// position of its reference prompt (prefilled in the default 64-token chunk); a precision
/// its f32 graphs do not have, and a checkpoint missing a tensor, are refused in one line.
#[test]
fn a_deepseek_v4_checkpoint_scores_as_transformers_and_bad_ones_are_named() {
    #[derive(serde::Deserialize)]
    struct Reference {
        token_ids: Vec<u32>,
        logits: Vec<Vec<f32>>,
    }
    let model = fixture("tiny-v4");
    let text = std::fs::read_to_string(format!("{model}/reference.json")).unwrap();
    let r: Reference = serde_json::from_str(&text).unwrap();
    let ids: Vec<String> = r.token_ids.iter().map(u32::to_string).collect();
    let out = deepinfer(&["score", "--model", &model, "--token-ids", &ids.join(",")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
    assert_eq!(got.len(), r.logits.len());
    for (p, (g, w)) in got.iter().zip(&r.logits).enumerate() {
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-4, "position {p}: {worst}");
    }

    let out = deepinfer(&[
        "generate",
        "--model",
        &model,
        "--dtype",
        "f16",
        "--token-ids",
        "1",
    ]);
    assert_clean_error(
        &out,
        "--dtype f16: DeepSeek-V4's weights are held in f32 or bf16",
    );
    // A config whose o_lora_rank is not the checkpoint's: the first tensor it shapes is named.
    let config = std::fs::read_to_string(format!("{model}/config.json")).unwrap();
    let weights = std::fs::read(format!("{model}/model.safetensors")).unwrap();
    let other = config.replace("\"o_lora_rank\": 16", "\"o_lora_rank\": 8");
    assert_ne!(other, config);
    let dir = temp_model(&[
        ("config.json", other.as_bytes()),
        ("model.safetensors", &weights),
    ]);
    let out = deepinfer(&["generate", "--model", &arg(&dir), "--token-ids", "1"]);
    assert_clean_error(&out, "layers.0.attn.wo_a.weight");
}

#[test]
fn score_prints_one_logit_row_per_position() {
    let out = deepinfer(&[
        "score",
        "--model",
        &fixture("tiny-v2-lite"),
        "--token-ids",
        "1,2,3,4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["logits"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0].as_array().unwrap().len(), 512);
}

#[test]
fn bad_inputs_fail_with_one_clear_line() {
    let v3 = fixture("tiny-v3");
    let config = std::fs::read(format!("{v3}/config.json")).unwrap();
    let weights = std::fs::read(format!("{v3}/model.safetensors")).unwrap();
    let llama = String::from_utf8(config.clone())
        .unwrap()
        .replace("deepseek_v3", "llama");

    let badjson = temp_model(&[("config.json", b"{not json")]);
    let llama = temp_model(&[("config.json", llama.as_bytes())]);
    let truncated = temp_model(&[
        ("config.json", &config),
        ("model.safetensors", &weights[..weights.len() / 2]),
    ]);
    let notok = temp_model(&[("config.json", &config), ("model.safetensors", &weights)]);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--model".into(),
                "/nonexistent/model".into(),
                "--token-ids".into(),
                "1".into(),
            ],
            "/nonexistent/model",
        ),
        (
            vec![
                "--model".into(),
                v3.clone(),
                "--token-ids".into(),
                "1,99999".into(),
            ],
            "token id 99999",
        ),
        (
            vec![
                "--model".into(),
                v3.clone(),
                "--token-ids".into(),
                "1,2".into(),
                "--max-tokens".into(),
                "100000".into(),
            ],
            "exceeds the context",
        ),
        (
            vec![
                "--model".into(),
                arg(&badjson),
                "--token-ids".into(),
                "1".into(),
            ],
            "config.json",
        ),
        (
            vec![
                "--model".into(),
                arg(&llama),
                "--token-ids".into(),
                "1".into(),
            ],
            "llama",
        ),
        (
            vec![
                "--model".into(),
                arg(&truncated),
                "--token-ids".into(),
                "1".into(),
            ],
            "model.safetensors",
        ),
        (
            vec![
                "--model".into(),
                arg(&notok),
                "--prompt".into(),
                "hi".into(),
            ],
            "tokenizer.json",
        ),
    ];
    for (args, needle) in cases {
        let mut full = vec!["generate".to_string()];
        full.extend(args);
        let refs: Vec<&str> = full.iter().map(|s| s.as_str()).collect();
        assert_clean_error(&deepinfer(&refs), needle);
    }
}

#[test]
fn checkpoints_without_tokenizer_work_with_token_ids() {
    let v3 = fixture("tiny-v3");
    let config = std::fs::read(format!("{v3}/config.json")).unwrap();
    let weights = std::fs::read(format!("{v3}/model.safetensors")).unwrap();
    let model = temp_model(&[("config.json", &config), ("model.safetensors", &weights)]);
    let dir = arg(&model);
    let out = deepinfer(&[
        "generate",
        "--model",
        &dir,
        "--token-ids",
        "1,2,3",
        "--max-tokens",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(',')
            .count(),
        3
    );
}

/// The simulator `cargo test --workspace` builds (nrt-sim's cdylib).
fn nrt_sim_library() -> PathBuf {
    let target = PathBuf::from(env!("CARGO_BIN_EXE_deepinfer"));
    let profile_dir = target.parent().unwrap();
    [
        profile_dir.join("deps/libnrt_sim.so"),
        profile_dir.join("libnrt_sim.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("libnrt_sim.so not built: run `cargo test --workspace` (or `cargo build -p nrt-sim`)")
}

#[test]
fn doctor_reports_missing_runtime_and_finds_nrt_sim_through_neuron_rt_lib() {
    let missing = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .arg("doctor")
        .env("NEURON_RT_LIB", "/nonexistent/libnrt.so.1")
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&missing.stdout);
    assert!(!missing.status.success());
    assert!(
        text.contains("libnrt")
            && text.contains("MISSING")
            && text.contains("aws-neuronx-runtime-lib"),
        "{text}"
    );
    assert!(
        text.contains("neuronx-cc") && text.contains("pip install neuronx-cc"),
        "{text}"
    );

    let sim = nrt_sim_library();
    let found = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .arg("doctor")
        .env("NEURON_RT_LIB", &sim)
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&found.stdout);
    let libnrt_line = text
        .lines()
        .find(|l| l.starts_with("libnrt"))
        .unwrap_or_default();
    assert!(
        libnrt_line.contains("ok") && libnrt_line.contains("nrt-sim"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("NeuronCores") && l.contains("2 visible")),
        "{text}"
    );
    assert!(
        !found.status.success(),
        "neuronx-cc is still missing, so the backend cannot run"
    );
}

/// tests/fake-neuronx-cc in a fresh directory, reporting `version`.
fn fake_compiler_dir(tag: &str, version: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deepinfer-cli-cc-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake-neuronx-cc/neuronx-cc");
    std::fs::copy(script, dir.join("neuronx-cc")).unwrap();
    std::fs::write(dir.join("version"), version).unwrap();
    dir
}

#[test]
fn doctor_checks_versions_against_the_minimums() {
    let sim = nrt_sim_library();
    let run = |cc: &PathBuf| {
        // The fake compiler is a shell script: it needs the usual tools on PATH after it.
        let path = format!("{}:/usr/bin:/bin", cc.display());
        Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .arg("doctor")
            .env("NEURON_RT_LIB", &sim)
            .env("PATH", path)
            .output()
            .unwrap()
    };
    let line = |text: &str, label: &str| {
        text.lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_default()
            .to_string()
    };

    // nrt-sim reports runtime 2.34.0.0 (>= 2.30.50); a compiler older than 2.18.121 gets the
    // upgrade command, and the backend is not ready.
    let old = fake_compiler_dir("old", "2.17.194.0+0ab0e1b4");
    let out = run(&old);
    let text = String::from_utf8_lossy(&out.stdout);
    let libnrt = line(&text, "libnrt");
    assert!(
        libnrt.contains("ok") && libnrt.contains("2.34.0.0") && libnrt.contains("2.30.50"),
        "{text}"
    );
    let cc = line(&text, "neuronx-cc");
    assert!(
        cc.contains("UPGRADE")
            && cc.contains("2.17.194.0")
            && cc.contains("2.18.121")
            && cc.contains("pip install --upgrade neuronx-cc"),
        "{text}"
    );
    assert!(!out.status.success(), "{text}");

    // A new enough compiler: everything is ok, exit 0.
    let new = fake_compiler_dir("new", "2.21.18209.0+043b1bf7");
    let out = run(&new);
    let text = String::from_utf8_lossy(&out.stdout);
    let cc = line(&text, "neuronx-cc");
    assert!(cc.contains("ok") && cc.contains("2.21.18209.0"), "{text}");
    assert!(!text.contains("UPGRADE"), "{text}");
    assert!(out.status.success(), "{text}");
    let _ = std::fs::remove_dir_all(&old);
    let _ = std::fs::remove_dir_all(&new);
}

#[test]
fn a_neuron_capture_says_how_many_neffs_it_compiles_before_it_starts() {
    // No libnrt here: the capture fails after the announcement. Limits of one sequence of 4
    // tokens: batch bucket 1, context 16, prefill chunk 16: one decode and one prefill NEFF.
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args([
            "generate",
            "--backend",
            "neuron",
            "--model",
            &fixture("tiny-v3"),
        ])
        .args([
            "--token-ids",
            "1,2",
            "--max-tokens",
            "2",
            "--compile-timeout",
            "600",
        ])
        .env("NEURON_RT_LIB", "/nonexistent/libnrt.so.1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let first = err.lines().next().unwrap_or_default();
    assert!(
        first.contains("capture compiles 2 NEFFs")
            && first.contains("batch 1 x context 16")
            && first.contains("chunk 16 x context 16"),
        "{err}"
    );
    assert!(
        err.lines().nth(1).unwrap_or_default().starts_with("error:"),
        "{err}"
    );

    let out = deepinfer(&[
        "generate",
        "--model",
        &fixture("tiny-v3"),
        "--token-ids",
        "1",
        "--compile-timeout",
        "0",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 1"));
}

/// `--compile-timeout` reaches the compile driver: `--backend neuron` over nrt-sim with the fake
/// compiler hanging is killed after the given second, and the error says so.
#[test]
fn compile_timeout_reaches_the_compiler_at_capture() {
    let cc = fake_compiler_dir("hang", "2.21.18209.0+043b1bf7");
    std::fs::write(cc.join("mode"), "hang").unwrap();
    let cache = cc.join("neff-cache");
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args([
            "generate",
            "--backend",
            "neuron",
            "--model",
            &fixture("tiny-v3"),
        ])
        .args([
            "--token-ids",
            "1,2",
            "--max-tokens",
            "1",
            "--compile-timeout",
            "1",
        ])
        .env("NEURON_RT_LIB", nrt_sim_library())
        .env("PATH", format!("{}:/usr/bin:/bin", cc.display()))
        .env("DEEPINFER_NEFF_CACHE", &cache)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("capture compiles 2 NEFFs"), "{err}");
    assert!(err.contains("timed out after 1 s"), "{err}");
    let _ = std::fs::remove_dir_all(&cc);
}

#[test]
fn a_model_too_large_for_the_cores_is_refused_before_anything_is_read_or_compiled() {
    // Only config.json: the refusal must come from the memory plan, before the checkpoint is
    // opened (which would fail on the missing weights) and before any graph is compiled.
    let config = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/deepseek-v2-lite.json"),
    )
    .unwrap();
    let model = temp_model(&[("config.json", &config)]);
    let dir = arg(&model);
    let out = deepinfer(&[
        "generate",
        "--backend",
        "sim",
        "--model",
        &dir,
        "--token-ids",
        "1,2",
    ]);
    assert_clean_error(&out, "the model does not fit a trn1.2xlarge at --tp 1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tp 2 --quantize experts-int8"), "{err}");
}

/// `generate` and `score` on nrt-sim with the model split over 2 and 4 simulated NeuronCores
/// give transformers' greedy tokens and logits (`fixtures/tiny-v3/reference.json`).
#[test]
fn generate_and_score_split_over_neuron_cores_match_transformers() {
    #[derive(serde::Deserialize)]
    struct Greedy {
        prompt_token_ids: Vec<u32>,
        generated_token_ids: Vec<u32>,
    }
    #[derive(serde::Deserialize)]
    struct Reference {
        token_ids: Vec<u32>,
        logits: Vec<Vec<f32>>,
        greedy: Greedy,
    }
    let model = fixture("tiny-v3");
    let r: Reference = serde_json::from_str(
        &std::fs::read_to_string(PathBuf::from(&model).join("reference.json")).unwrap(),
    )
    .unwrap();
    let ids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    for tp in ["2", "4"] {
        let run = |args: &[&str]| {
            let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
                .args(args)
                .args(["--backend", "sim", "--tp", tp, "--model", &model])
                .env("NRT_SIM_NC_COUNT", "4")
                .output()
                .expect("run deepinfer");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "--tp {tp}: {err}");
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
        };
        let max = r.greedy.generated_token_ids.len().to_string();
        let g = run(&[
            "generate",
            "--token-ids",
            &ids(&r.greedy.prompt_token_ids),
            "--max-tokens",
            &max,
            "--json",
        ]);
        let got: Vec<u32> = serde_json::from_value(g["token_ids"].clone()).unwrap();
        assert_eq!(got, r.greedy.generated_token_ids, "--tp {tp}");
        let s = run(&["score", "--token-ids", &ids(&r.token_ids)]);
        let logits: Vec<Vec<f32>> = serde_json::from_value(s["logits"].clone()).unwrap();
        assert_eq!(logits.len(), r.logits.len(), "--tp {tp}: rows of logits");
        // Checks each row's length too, and fails on a non-finite logit on either side.
        let worst = max_abs_diff_rows(&logits, &r.logits);
        assert!(worst < 1e-4, "--tp {tp}: {worst}");
    }
}

/// Two processes, as on two instances: `deepinfer follow` and a leader (`generate --ranks
/// --followers`) started on another model. The leader refuses in one line naming the follower
/// and what differs; the follower ends with an error too. (A leader and follower that match
/// cannot step across processes here: nrt-sim's collectives meet inside one process; see
/// tests/instances_sim.rs for those.)
#[test]
fn a_leader_refuses_a_follower_started_on_another_model() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let env = [
        ("NEURON_RT_LIB", nrt_sim_library().display().to_string()),
        ("NRT_SIM_NC_COUNT", "2".to_string()),
        ("NEURON_RT_ROOT_COMM_ID", "127.0.0.1:61997".to_string()),
        (
            "DEEPINFER_INSTANCE_SECRET",
            "cli-test-shared-secret".to_string(),
        ),
    ];
    let mut follower = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args([
            "follow",
            "--backend",
            "sim",
            "--ranks",
            "2..4",
            "--listen",
            &addr,
        ])
        .args(["--model", &fixture("tiny-v2-lite")])
        .envs(env.clone())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The leader starts once the follower listens (else it would also say, on a second line,
    // that it waits for it).
    let mut follower_err = std::io::BufReader::new(follower.stderr.take().unwrap());
    let mut listening = String::new();
    std::io::BufRead::read_line(&mut follower_err, &mut listening).unwrap();
    assert!(
        listening.contains("waiting for its leader on 127.0.0.1"),
        "{listening}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args([
            "generate",
            "--backend",
            "sim",
            "--tp",
            "4",
            "--ranks",
            "0..2",
        ])
        .args([
            "--followers",
            &addr,
            "--token-ids",
            "3,4,5",
            "--max-tokens",
            "2",
        ])
        .args(["--model", &fixture("tiny-v3")])
        .envs(env)
        .output()
        .unwrap();
    assert_clean_error(
        &out,
        &format!(
            "the follower at {addr} cannot run this model with the leader: its model \
             (config.json) is not the leader's"
        ),
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut follower_err, &mut rest).unwrap();
    assert!(!follower.wait().unwrap().success(), "{rest}");
    assert!(rest.contains("error:"), "{rest}");
}

#[test]
fn follow_refuses_what_cannot_follow() {
    let tiny = fixture("tiny-v3");
    let out = deepinfer(&[
        "follow",
        "--model",
        &tiny,
        "--backend",
        "cpu",
        "--ranks",
        "0..2",
    ]);
    assert_clean_error(&out, "a follower runs NeuronCores");
    let out = deepinfer(&["follow", "--model", &tiny, "--ranks", "3..1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("expected FIRST..END with FIRST below END"),
        "{err}"
    );
    let out = deepinfer(&[
        "follow",
        "--model",
        &tiny,
        "--backend",
        "sim",
        "--ranks",
        "0..2",
        "--listen",
        "nowhere",
    ]);
    assert_clean_error(&out, "cannot listen on nowhere");
    // No shared secret: nothing could prove to be its leader.
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["follow", "--model", &tiny, "--backend", "sim"])
        .args(["--ranks", "0..2", "--listen", "127.0.0.1:0"])
        .env_remove("DEEPINFER_INSTANCE_SECRET")
        .output()
        .unwrap();
    assert_clean_error(&out, "deepinfer follow needs DEEPINFER_INSTANCE_SECRET");
}

/// `serve --fair-decode-slowdown` below 1 (a step cheaper than one row per request) or not a
/// number is refused by name before anything is loaded.
#[test]
fn a_fair_decode_slowdown_below_one_is_refused() {
    for bad in ["0.5", "nan", "fast"] {
        let out = deepinfer(&["serve", "--fair-decode-slowdown", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}: {err}");
        assert!(err.contains("--fair-decode-slowdown"), "{bad}: {err}");
        assert!(err.contains("at least 1"), "{bad}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
