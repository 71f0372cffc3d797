//! The `deepinfer` binary: output formats, and one clear line on stderr with a non-zero exit
//! for every kind of bad input (never a panic).

use std::path::PathBuf;
use std::process::{Command, Output};

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

fn temp_model(name: &str, files: &[(&str, &[u8])]) -> String {
    let dir = std::env::temp_dir().join(format!("deepinfer-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (f, data) in files {
        std::fs::write(dir.join(f), data).unwrap();
    }
    dir.display().to_string()
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
                temp_model("badjson", &[("config.json", b"{not json")]),
                "--token-ids".into(),
                "1".into(),
            ],
            "config.json",
        ),
        (
            vec![
                "--model".into(),
                temp_model("llama", &[("config.json", llama.as_bytes())]),
                "--token-ids".into(),
                "1".into(),
            ],
            "llama",
        ),
        (
            vec![
                "--model".into(),
                temp_model(
                    "truncated",
                    &[
                        ("config.json", &config),
                        ("model.safetensors", &weights[..weights.len() / 2]),
                    ],
                ),
                "--token-ids".into(),
                "1".into(),
            ],
            "model.safetensors",
        ),
        (
            vec![
                "--model".into(),
                temp_model(
                    "notok",
                    &[("config.json", &config), ("model.safetensors", &weights)],
                ),
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
    let dir = temp_model(
        "ids-only",
        &[("config.json", &config), ("model.safetensors", &weights)],
    );
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
