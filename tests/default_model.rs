//! The embedded default model (`fixtures/default-model`, trained by `scripts/train_tiny.py`):
//! held-out perplexity through `score` agrees with transformers', and the CLI uses it when no
//! `--model` is given.

mod common;

use common::fixture_dir;
use deepinfer::deployment::Limits;
use deepinfer::engine;
use deepinfer::runner::{self, Backend};
use serde::Deserialize;

#[derive(Deserialize)]
struct Heldout {
    token_ids: Vec<u32>,
    perplexity: f64,
}

#[test]
fn heldout_perplexity_matches_transformers_within_a_tenth_of_a_percent() {
    let dir = fixture_dir("default-model");
    let h: Heldout =
        serde_json::from_str(&std::fs::read_to_string(dir.join("heldout.json")).unwrap()).unwrap();
    let mut runner = runner::open(Backend::Cpu, &dir, &Limits::new(1, h.token_ids.len())).unwrap();
    let logits = engine::score(&mut runner, &h.token_ids).unwrap();
    // A row per token: each but the last predicts the next token.
    assert_eq!(logits.len(), h.token_ids.len(), "rows of logits vs tokens");
    let mut nll = 0.0f64;
    for (row, &next) in logits.iter().zip(&h.token_ids[1..]) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        nll += lse - row[next as usize] as f64;
    }
    let ppl = (nll / (h.token_ids.len() - 1) as f64).exp();
    let rel = (ppl - h.perplexity).abs() / h.perplexity;
    eprintln!(
        "perplexity: deepinfer {ppl:.6}, transformers {:.6}, relative difference {rel:.2e}",
        h.perplexity
    );
    assert!(rel < 1e-3, "{ppl} vs {}", h.perplexity);
}

#[test]
fn generate_without_model_uses_the_default_model() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args([
            "generate",
            "--prompt",
            "ROMEO:",
            "--max-tokens",
            "12",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = v["text"].as_str().unwrap();
    assert!(
        text.chars().filter(|c| c.is_ascii_alphabetic()).count() > 10,
        "{text:?}"
    );
}
