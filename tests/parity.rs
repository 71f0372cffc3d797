//! The CPU backend against HF transformers on the tiny fixtures: logits at every position,
//! greedy continuations, decode vs prefill at several batch sizes, both MoE strategies, and
//! seeded sampling.

mod common;

use common::{max_abs_diff_rows, reference, runner, FIXTURES};
use deepinfer::engine::{self, StopConditions};
use deepinfer::model::{LogitsOutput, MoeStrategy};
use deepinfer::runner::step::{DecodeRow, LogitControls, SamplingParams};
use deepinfer::runner::Step;

const TOL: f32 = 1e-4;

#[test]
fn prefill_logits_match_transformers_at_every_position() {
    for name in FIXTURES {
        let r = reference(name);
        let mut run = runner(name, 1, None);
        let logits = engine::score(&mut run, &r.token_ids).unwrap();
        let worst = max_abs_diff_rows(&logits, &r.logits);
        eprintln!("{name}: max |logit - transformers| = {worst:e}");
        assert!(worst < TOL, "{name}: {worst}");
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    for name in FIXTURES {
        let r = reference(name);
        let mut run = runner(name, 1, None);
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
        assert_eq!(got, r.greedy.generated_token_ids, "{name}");
    }
}

/// `rows` sequences decode the reference tokens one at a time through the decode graph only,
/// row `i` joining `i` steps late (so positions differ within a batch); every row's logits at
/// every position must match transformers' prefill logits.
fn decode_matches_prefill(name: &str, rows: usize) {
    let r = reference(name);
    let mut run = runner(name, 8, None);
    let worst = common::decode_staggered(run.as_mut(), &r.token_ids, rows, &r.logits);
    eprintln!("{name} batch {rows}: max |decode - transformers| = {worst:e}");
    assert!(worst < TOL, "{name} batch {rows}: {worst}");
}

#[test]
fn decode_one_token_at_a_time_matches_at_batch_1_3_and_8() {
    for name in FIXTURES {
        for rows in [1, 3, 8] {
            decode_matches_prefill(name, rows);
        }
    }
}

#[test]
fn both_moe_strategies_agree() {
    for name in FIXTURES {
        let r = reference(name);
        let a = engine::score(
            &mut runner(name, 1, Some(MoeStrategy::Gather)),
            &r.token_ids,
        )
        .unwrap();
        let b =
            engine::score(&mut runner(name, 1, Some(MoeStrategy::Dense)), &r.token_ids).unwrap();
        let worst = max_abs_diff_rows(&a, &b);
        assert!(worst < 1e-5, "{name}: {worst}");
    }
}

#[test]
fn same_seed_reproduces_and_different_seeds_differ() {
    let name = "tiny-v3";
    let r = reference(name);
    let stop = StopConditions {
        max_tokens: 24,
        stop_token_ids: vec![],
    };
    let params = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.95,
        seed,
        ..deepinfer::runner::step::SamplingParams::GREEDY
    };
    let mut run = runner(name, 1, None);
    let a = engine::generate(&mut run, &r.greedy.prompt_token_ids, params(7), &stop).unwrap();
    let b = engine::generate(&mut run, &r.greedy.prompt_token_ids, params(7), &stop).unwrap();
    let c = engine::generate(&mut run, &r.greedy.prompt_token_ids, params(8), &stop).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(
        a, r.greedy.generated_token_ids,
        "sampling at temperature 1 should not be greedy"
    );
}

/// A packed prefill step (three sequences' chunks side by side: two fresh prompts of different
/// lengths and the second half of a prompt whose first half is already cached) gives every
/// position the logits transformers gives it, samples each chunk's next token from its own
/// last position, and leaves each sequence's cache as a decode step expects.
#[test]
fn packed_prefill_matches_transformers_at_every_position() {
    use deepinfer::config::ModelConfig;
    use deepinfer::deployment::RunnerConfig;
    use deepinfer::model::{ModelWeights, Precision};
    use deepinfer::runner::step::PrefillChunk;
    use deepinfer::runner::{self, Backend};
    use deepinfer::weights::Checkpoint;

    for name in FIXTURES {
        let r = reference(name);
        let dir = common::fixture_dir(name);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let weights =
            ModelWeights::load(&cfg, &Checkpoint::open(&dir).unwrap(), &Precision::F32).unwrap();
        // Contexts 64 and 256: the 64 bucket packs up to 4 sequences.
        let rc = RunnerConfig::for_limits(4, 256);
        assert_eq!(rc.buckets.packed_seqs(64, 64), 4);
        let mut run = runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap();
        let ids = &r.token_ids;
        let n = ids.len() - 1; // the last token is fed by decode below
        let (a, b, c) = ([1u32, 2], [3u32, 4], [5u32, 6]);
        // Sequence c's first part goes in alone first.
        let split = n / 2;
        let first = PrefillChunk {
            tokens: &ids[..split],
            start: 0,
            blocks: &c,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        };
        run.replay(&Step::Prefill {
            chunks: &[first],
            logits: LogitsOutput::None,
        })
        .unwrap();
        let short = 3;
        let chunks = [
            PrefillChunk {
                tokens: &ids[..n],
                start: 0,
                blocks: &a,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            },
            PrefillChunk {
                tokens: &ids[..short],
                start: 0,
                blocks: &b,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            },
            PrefillChunk {
                tokens: &ids[split..n],
                start: split,
                blocks: &c,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            },
        ];
        let out = run
            .replay(&Step::Prefill {
                chunks: &chunks,
                logits: LogitsOutput::AllPositions,
            })
            .unwrap();
        let want: Vec<Vec<f32>> = (0..n)
            .chain(0..short)
            .chain(split..n)
            .map(|p| r.logits[p].clone())
            .collect();
        let got = out.logits.expect("logits");
        let worst = max_abs_diff_rows(&got, &want);
        eprintln!("{name}: packed prefill, max |logit - transformers| = {worst:e}");
        assert!(worst < TOL, "{name}: {worst}");
        let argmax = |row: &[f32]| {
            (0..row.len())
                .max_by(|&i, &j| row[i].total_cmp(&row[j]))
                .unwrap() as u32
        };
        let expect: Vec<u32> = [n - 1, short - 1, n - 1]
            .iter()
            .map(|&p| argmax(&r.logits[p]))
            .collect();
        assert_eq!(out.next_tokens, expect, "{name}: each chunk's sample");

        // Decoding the last token after each full-length sequence sees what the packed step
        // cached.
        let rows: Vec<DecodeRow> = [&a[..], &c[..]]
            .iter()
            .map(|blocks| DecodeRow {
                token: ids[n],
                position: n,
                blocks,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            })
            .collect();
        let dec = run
            .replay(&Step::Decode {
                rows: &rows,
                logits: LogitsOutput::Sampled,
            })
            .unwrap();
        let worst = max_abs_diff_rows(
            &dec.logits.unwrap(),
            &[r.logits[n].clone(), r.logits[n].clone()],
        );
        assert!(worst < TOL, "{name}: decode after packed prefill: {worst}");
    }
}
