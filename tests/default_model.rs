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
    /// transformers' most likely next token at each position.
    argmax_next_ids: Vec<u32>,
}

/// Held-out perplexity through `score`, prefilled in chunks of `prefill_chunk` tokens (the
/// runner's default when `None`), against transformers': within a tenth of a percent, and the
/// same most likely next token at every position.
fn heldout_matches_transformers(prefill_chunk: Option<usize>) {
    let dir = fixture_dir("default-model");
    let h: Heldout =
        serde_json::from_str(&std::fs::read_to_string(dir.join("heldout.json")).unwrap()).unwrap();
    let mut limits = Limits::new(1, h.token_ids.len());
    limits.prefill_chunk = prefill_chunk;
    let mut runner = runner::open(Backend::Cpu, &dir, &limits).unwrap();
    let logits = engine::score(&mut runner, &h.token_ids).unwrap();
    // A row per token: each but the last predicts the next token.
    assert_eq!(logits.len(), h.token_ids.len(), "rows of logits vs tokens");
    let mut nll = 0.0f64;
    for (row, &next) in logits.iter().zip(&h.token_ids[1..]) {
        assert!(row.iter().all(|x| x.is_finite()), "a logit is not finite");
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        nll += lse - row[next as usize] as f64;
    }
    let ppl = (nll / (h.token_ids.len() - 1) as f64).exp();
    let rel = (ppl - h.perplexity).abs() / h.perplexity;
    eprintln!(
        "chunk {prefill_chunk:?}: perplexity deepinfer {ppl:.6}, transformers {:.6}, relative \
         difference {rel:.2e}",
        h.perplexity
    );
    assert!(rel < 1e-3, "{ppl} vs {}", h.perplexity);
    for (pos, (row, &want)) in logits.iter().zip(&h.argmax_next_ids).enumerate() {
        let got = (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best });
        assert_eq!(
            got as u32, want,
            "the most likely next token at position {pos}"
        );
    }
}

#[test]
fn heldout_perplexity_matches_transformers_within_a_tenth_of_a_percent() {
    heldout_matches_transformers(None);
}

/// In 16-token chunks, prefill attention over more than 171 context rows is absorbed (as
/// decode's is) rather than decompressed (`model::attention`'s `prefill_absorbs`): the last
/// chunks of the 256 held-out tokens take that path.
#[test]
fn heldout_in_small_chunks_matches_transformers_where_prefill_attention_is_absorbed() {
    heldout_matches_transformers(Some(16));
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
