//! Reduced precision against transformers: bf16 weights and cache measured against
//! transformers running the same checkpoint in bf16 (the peer's own drift from the f32
//! reference is the yardstick), and FP8 block-scaled checkpoints against transformers on the
//! dequantized weights (`scripts/make_precision_references.py` writes both references).

mod common;

use common::{max_abs_diff_rows, reference, reference_file, runner_in, Reference, FIXTURES};
use deepinfer::engine::{self, StopConditions};
use deepinfer::graph::DType;
use deepinfer::model::Precision;
use deepinfer::runner::step::SamplingParams;
use deepinfer::runner::Runner;
use serde::Deserialize;

/// `reference-bf16.json`: transformers in bf16 and how far it drifts from its f32 run.
#[derive(Deserialize)]
struct PeerBf16 {
    logits: Vec<Vec<f32>>,
    max_abs_diff_vs_f32: f32,
    argmax_agreement_vs_f32: f64,
    greedy_agreement_vs_f32: GreedyAgreement,
}

#[derive(Deserialize)]
struct GreedyAgreement {
    leading_tokens_equal: usize,
}

const BF16: Precision = Precision {
    weights: DType::BF16,
    kv_cache: DType::BF16,
};

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        assert!(v.is_finite(), "a logit is {v}");
        if *v > row[best] {
            best = i;
        }
    }
    best
}

fn argmax_agreement(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let same = a
        .iter()
        .zip(b)
        .filter(|(x, y)| argmax(x) == argmax(y))
        .count();
    same as f64 / a.len() as f64
}

fn greedy(run: &mut dyn Runner, r: &Reference) -> Vec<u32> {
    let stop = StopConditions {
        max_tokens: r.greedy.generated_token_ids.len(),
        stop_token_ids: vec![],
    };
    engine::generate(run, &r.greedy.prompt_token_ids, SamplingParams::GREEDY, &stop).unwrap()
}

fn leading_equal(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn bf16_drifts_from_f32_no_more_than_transformers_bf16() {
    let mut failures = Vec::new();
    for name in FIXTURES {
        let f32_ref = reference(name);
        let peer: PeerBf16 = reference_file(name, "reference-bf16.json");
        let mut run = runner_in(name, 1, None, BF16);
        let ours = engine::score(&mut run, &f32_ref.token_ids).unwrap();
        let drift = max_abs_diff_rows(&ours, &f32_ref.logits);
        let agree = argmax_agreement(&ours, &f32_ref.logits);
        let lead = leading_equal(
            &greedy(&mut run, &f32_ref),
            &f32_ref.greedy.generated_token_ids,
        );
        // The peer's own numbers, recomputed from its logits rather than trusted.
        let peer_drift = max_abs_diff_rows(&peer.logits, &f32_ref.logits);
        assert!((peer_drift - peer.max_abs_diff_vs_f32).abs() < 1e-6);
        let peer_agree = argmax_agreement(&peer.logits, &f32_ref.logits);
        assert!((peer_agree - peer.argmax_agreement_vs_f32).abs() < 1e-9);
        let peer_lead = peer.greedy_agreement_vs_f32.leading_tokens_equal;
        let total = f32_ref.greedy.generated_token_ids.len();
        eprintln!(
            "{name}: max |logit - f32| ours {drift:.3e} vs transformers-bf16 {peer_drift:.3e}; \
             argmax agreement {agree:.4} vs {peer_agree:.4}; greedy {lead}/{total} vs \
             {peer_lead}/{total}"
        );
        if drift > peer_drift {
            failures.push(format!("{name}: max drift {drift} > {peer_drift}"));
        }
        if agree < peer_agree {
            failures.push(format!("{name}: argmax agreement {agree} < {peer_agree}"));
        }
        if lead < peer_lead {
            failures.push(format!("{name}: greedy {lead} < {peer_lead}"));
        }
        // Not vacuous: bf16 storage does change the numbers.
        if drift <= 1e-5 {
            failures.push(format!("{name}: bf16 matched f32 exactly ({drift})"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn fp8_checkpoint_matches_transformers_on_its_dequantized_weights() {
    let name = "tiny-v3-fp8";
    let r = reference(name);
    let mut run = runner_in(name, 1, None, Precision::F32);
    let logits = engine::score(&mut run, &r.token_ids).unwrap();
    let worst = max_abs_diff_rows(&logits, &r.logits);
    eprintln!("{name}: max |logit - transformers| = {worst:e}");
    assert!(worst < 1e-4, "{worst}");
    assert_eq!(greedy(&mut run, &r), r.greedy.generated_token_ids);
}
