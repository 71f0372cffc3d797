//! Tensor parallelism against transformers and against `tp = 1`: every fixture split over 2 and
//! 4 ranks (each rank a thread of the CPU backend running its shards, collectives meeting in
//! one group) gives transformers' logits at every position, its greedy continuation, and
//! decode logits within 1e-4 of the unsplit model's, for both MoE strategies, and draws the
//! unsplit model's sampled tokens.

mod common;

use std::path::Path;

use common::{fixture_dir, max_abs_diff, max_abs_diff_rows, reference, FIXTURES, ODD_VOCAB};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Limits, RunnerConfig};
use deepinfer::engine::{self, StopConditions};
use deepinfer::model::{ModelWeights, MoeStrategy, Precision};
use deepinfer::runner::step::SamplingParams;
use deepinfer::runner::{self, Backend, Runner};
use deepinfer::weights::Checkpoint;

const TOL: f32 = 1e-4;

fn tp_runner(name: &str, tp: usize, max_batch: usize, moe: Option<MoeStrategy>) -> Box<dyn Runner> {
    tp_runner_at(&fixture_dir(name), tp, max_batch, moe)
}

fn tp_runner_at(
    dir: &Path,
    tp: usize,
    max_batch: usize,
    moe: Option<MoeStrategy>,
) -> Box<dyn Runner> {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let weights = ModelWeights::load(&cfg, &ckpt, &Precision::F32).unwrap();
    let mut rc = RunnerConfig::for_limits(max_batch, 128);
    rc.moe = moe;
    rc.tp = tp;
    runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap()
}

#[test]
fn split_models_match_transformers_at_every_position_and_greedily() {
    for name in FIXTURES {
        let r = reference(name);
        for tp in [2, 4] {
            let mut run = tp_runner(name, tp, 1, None);
            let logits = engine::score(&mut run, &r.token_ids).unwrap();
            let worst = max_abs_diff_rows(&logits, &r.logits);
            eprintln!("{name} tp {tp}: max |logit - transformers| = {worst:e}");
            assert!(worst < TOL, "{name} tp {tp}: {worst}");
            let stop = StopConditions {
                max_tokens: r.greedy.generated_token_ids.len(),
                stop_token_ids: vec![],
            };
            let got = engine::generate(
                &mut run,
                &r.greedy.prompt_token_ids,
                SamplingParams::GREEDY,
                &stop,
            )
            .unwrap();
            assert_eq!(got, r.greedy.generated_token_ids, "{name} tp {tp}");
        }
    }
}

/// Four sequences decode the reference tokens in one batch, joining a step apart; every
/// row's logits at `tp` must be within `TOL` of `tp = 1`'s and of transformers'.
fn decode_batch_matches(name: &str, tp: usize, moe: MoeStrategy) {
    let r = reference(name);
    let mut one = tp_runner(name, 1, 4, Some(moe));
    let mut split = tp_runner(name, tp, 4, Some(moe));
    let rows = 4;
    let unsplit = common::decode_staggered_steps(one.as_mut(), &r.token_ids, rows);
    let steps = common::decode_staggered_steps(split.as_mut(), &r.token_ids, rows);
    let (mut vs_one, mut vs_hf) = (0.0f32, 0.0f32);
    assert_eq!(unsplit.len(), steps.len(), "{name} tp {tp}: steps");
    for (step, (a, b)) in unsplit.iter().zip(&steps).enumerate() {
        assert_eq!(a.next_tokens, b.next_tokens, "{name} tp {tp} step {step}");
        // Each step holds a row of logits per position (checked where it was made).
        assert_eq!(a.positions, b.positions, "{name} tp {tp} step {step}");
        for ((a, b), &position) in a.logits.iter().zip(&b.logits).zip(&b.positions) {
            vs_one = vs_one.max(max_abs_diff(a, b));
            vs_hf = vs_hf.max(max_abs_diff(b, &r.logits[position]));
        }
    }
    eprintln!("{name} tp {tp} {moe:?}: vs tp 1 {vs_one:e}, vs transformers {vs_hf:e}");
    assert!(
        vs_one < TOL && vs_hf < TOL,
        "{name} tp {tp} {moe:?}: {vs_one} / {vs_hf}"
    );
}

#[test]
fn split_decode_batches_match_the_unsplit_model_with_both_moe_strategies() {
    for name in FIXTURES {
        for tp in [2, 4] {
            for moe in [MoeStrategy::Gather, MoeStrategy::Dense] {
                decode_batch_matches(name, tp, moe);
            }
        }
    }
}

/// Sampled rows draw from each rank's vocabulary slice, never the gathered logits: with the
/// same seeds, every split model draws the unsplit model's tokens (itself checked against the
/// exact distribution in tests/sampling.rs), through top-k, top-p, min-p and the penalties.
#[test]
fn split_models_draw_the_unsplit_models_sampled_tokens() {
    let params = [
        SamplingParams {
            temperature: 0.9,
            top_k: 8,
            top_p: 0.9,
            seed: 11,
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            ..SamplingParams::GREEDY
        },
        SamplingParams {
            temperature: 1.3,
            min_p: 0.02,
            seed: 12,
            repetition_penalty: 1.3,
            ..SamplingParams::GREEDY
        },
        SamplingParams {
            temperature: 0.7,
            top_p: 0.5,
            seed: 13,
            ..SamplingParams::GREEDY
        },
    ];
    for name in FIXTURES {
        let r = reference(name);
        let stop = StopConditions {
            max_tokens: 16,
            stop_token_ids: vec![],
        };
        let mut one = tp_runner(name, 1, 1, None);
        let want: Vec<Vec<u32>> = params
            .iter()
            .map(|p| engine::generate(&mut one, &r.greedy.prompt_token_ids, *p, &stop).unwrap())
            .collect();
        for tp in [2, 4] {
            let mut run = tp_runner(name, tp, 1, None);
            for (p, want) in params.iter().zip(&want) {
                let got =
                    engine::generate(&mut run, &r.greedy.prompt_token_ids, *p, &stop).unwrap();
                assert_eq!(&got, want, "{name} tp {tp} {p:?}");
            }
        }
    }
}

/// vLLM pads a vocabulary the degree does not divide; so do we (`model::shard`). The padding
/// is never returned (every logits row is `vocab` wide and transformers' at every position,
/// through prefill and batched decode) and never drawn: a hot sampler, where a padding
/// column's zero logit would be among the likeliest, draws the unsplit model's tokens, every
/// one in the vocabulary.
#[test]
fn a_vocabulary_the_degree_does_not_divide_is_padded_never_returned_or_drawn() {
    let hot = common::HOT;
    let stop = StopConditions {
        max_tokens: 32,
        stop_token_ids: vec![],
    };
    // An untied LM head and a tied one (tiny-v2-group's is the embedding).
    for name in ["tiny-v3", "tiny-v2-group"] {
        let dir = common::fixture_with_vocab(name, ODD_VOCAB);
        let r = reference(name);
        assert!(r.token_ids.iter().all(|&t| (t as usize) < ODD_VOCAB));
        let want: Vec<Vec<f32>> = r
            .logits
            .iter()
            .map(|row| row[..ODD_VOCAB].to_vec())
            .collect();
        let mut one = tp_runner_at(&dir, 1, 4, None);
        let drawn = engine::generate(&mut one, &r.token_ids, hot, &stop).unwrap();
        for tp in [2, 4] {
            let mut run = tp_runner_at(&dir, tp, 4, None);
            let logits = engine::score(&mut run, &r.token_ids).unwrap();
            assert!(
                logits.iter().all(|row| row.len() == ODD_VOCAB),
                "{name} tp {tp}"
            );
            let prefill = max_abs_diff_rows(&logits, &want);
            let decode = common::decode_staggered(run.as_mut(), &r.token_ids, 4, &want);
            eprintln!("{name} tp {tp} vocab {ODD_VOCAB}: prefill {prefill:e}, decode {decode:e}");
            assert!(
                prefill < TOL && decode < TOL,
                "{name} tp {tp}: {prefill} / {decode}"
            );
            let got = engine::generate(&mut run, &r.token_ids, hot, &stop).unwrap();
            assert!(
                got.iter().all(|&t| (t as usize) < ODD_VOCAB),
                "{name} tp {tp}: {got:?}"
            );
            assert_eq!(got, drawn, "{name} tp {tp}");
        }
    }
}

#[test]
fn a_degree_that_does_not_divide_the_model_is_refused_with_the_degrees_that_do() {
    let dir = fixture_dir("tiny-v3");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let mut limits = Limits::new(1, 64);
    for (tp, want) in [(8, "num_attention_heads (4)"), (3, "must be one of")] {
        limits.tp = tp;
        let err = limits.runner_config(&cfg).unwrap_err().to_string();
        assert!(err.contains(want), "--tp {tp}: {err}");
    }
}

/// What a device runner uploads (each rank's shards streamed from the checkpoint, one tensor at
/// a time) is bit for bit what the CPU runner computes on (the whole model loaded, then
/// sharded), for every dtype policy and every rank.
#[test]
fn streamed_shards_are_the_loaded_shards() {
    use deepinfer::model::Quantize;
    use std::sync::Arc;
    for name in ["tiny-v3", "tiny-v2-lite", "tiny-v3-fp8"] {
        let dir = fixture_dir(name);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
        for precision in [
            Precision::F32,
            Precision {
                quantize: Quantize::ExpertsInt8,
                ..Precision::all(deepinfer::graph::DType::BF16)
            },
            Precision {
                quantize: Quantize::ExpertsInt4,
                ..Precision::all(deepinfer::graph::DType::BF16)
            },
        ] {
            let loaded = ModelWeights::load(&cfg, &ckpt, &precision).unwrap();
            let streamed = ModelWeights::stream(&cfg, Arc::clone(&ckpt), &precision).unwrap();
            for tp in [1, 2, 4] {
                for rank in 0..tp {
                    let (a, b) = if tp == 1 {
                        (loaded.clone(), streamed.clone())
                    } else {
                        (
                            loaded.shard(&cfg, rank, tp).unwrap(),
                            streamed.shard(&cfg, rank, tp).unwrap(),
                        )
                    };
                    for param in a.specs().names() {
                        let want = a.get(param).unwrap();
                        let got = b
                            .fetch(param)
                            .unwrap()
                            .into_iter()
                            .find(|(n, _)| n == param)
                            .unwrap()
                            .1;
                        assert_eq!(got.dims(), want.dims(), "{name} {param}");
                        let same = got
                            .flatten_all()
                            .unwrap()
                            .to_dtype(candle_core::DType::F32)
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                            == want
                                .flatten_all()
                                .unwrap()
                                .to_dtype(candle_core::DType::F32)
                                .unwrap()
                                .to_vec1::<f32>()
                                .unwrap();
                        assert!(same, "{name} tp {tp} rank {rank} {param}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_streamed_checkpoint_missing_a_tensor_is_refused_up_front_naming_it() {
    let dir = fixture_dir("tiny-v3");
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    // One layer more than the checkpoint holds.
    let missing = cfg.num_hidden_layers;
    cfg.num_hidden_layers += 1;
    let ckpt = std::sync::Arc::new(Checkpoint::open(&dir).unwrap());
    let err = ModelWeights::stream(&cfg, ckpt, &Precision::F32)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("model.layers.{missing}.")) && err.contains("is missing"),
        "{err}"
    );
}
