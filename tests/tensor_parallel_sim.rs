//! Tensor parallelism through the real FFI path: the device runner on nrt-sim loads one rank per
//! simulated NeuronCore with `nrt_load_collectives` and executes the ranks concurrently; their
//! all-reduces and all-gathers meet inside nrt-sim. Every fixture at `--tp 2` and `--tp 4` gives
//! transformers' greedy tokens and logits within 1e-4 of the unsplit CPU model's; a fault on
//! one rank fails that step on every rank, promptly, and the next step works.
//!
//! nrt-sim's core count and fault variables are read once per process, so each test runs in
//! a child process of this binary with them set (`nrt_sim::run_test_in_child`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{fixture_dir, max_abs_diff_rows, reference, RunnerExt, FIXTURES};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Limits, RunnerConfig};
use deepinfer::engine::{self, StopConditions};
use deepinfer::model::{LogitsOutput, ModelWeights, Precision};
use deepinfer::runner::step::{LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, DeviceOptions, DeviceRunner, Runner};
use deepinfer::weights::Checkpoint;
use neuron_sys::Library;
use nrt_sim::{is_fault_child as is_child, run_test_in_child as run_child};

const TOL: f32 = 1e-4;

/// Enough simulated NeuronCores for `--tp 4` (a trn1.2xlarge has 2).
const CORES: (&str, &str) = (nrt_sim::ENV_NC_COUNT, "4");

fn load(name: &str) -> (ModelConfig, ModelWeights) {
    load_dir(&fixture_dir(name))
}

fn load_dir(dir: &Path) -> (ModelConfig, ModelWeights) {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights =
        ModelWeights::load(&cfg, &Checkpoint::open(dir).unwrap(), &Precision::F32).unwrap();
    (cfg, weights)
}

fn config(tp: usize) -> RunnerConfig {
    let mut rc = RunnerConfig::for_limits(2, 128);
    rc.tp = tp;
    rc
}

/// A captured device runner on nrt-sim, split over `tp` cores.
fn sim(name: &str, tp: usize) -> DeviceRunner {
    sim_with(name, tp, DeviceOptions::sim())
}

fn sim_with(name: &str, tp: usize, opts: DeviceOptions) -> DeviceRunner {
    sim_at(&fixture_dir(name), tp, opts)
}

fn sim_at(dir: &Path, tp: usize, opts: DeviceOptions) -> DeviceRunner {
    let (cfg, weights) = load_dir(dir);
    let lib = Library::open(nrt_sim::library_next_to_current_exe().expect("libnrt_sim.so"))
        .expect("load nrt-sim");
    let rc = config(tp);
    let buckets = rc.buckets.clone();
    let mut d = DeviceRunner::new(cfg, weights, rc, lib, opts).expect("runner");
    d.capture(&buckets).expect("capture");
    d
}

#[test]
fn split_models_on_nrt_sim_match_transformers_and_the_unsplit_model() {
    run_child("child_split_models", &[CORES]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_split_models() {
    if !is_child() {
        return split_models_on_nrt_sim_match_transformers_and_the_unsplit_model();
    }
    for name in FIXTURES {
        let r = reference(name);
        let (cfg, weights) = load(name);
        let mut cpu = runner::open_with_weights(Backend::Cpu, cfg, weights, config(1)).unwrap();
        let unsplit = engine::score(&mut cpu, &r.token_ids).unwrap();
        for tp in [2, 4] {
            let mut d = sim(name, tp);
            assert_eq!(d.ranks().count, tp);
            let logits = engine::score(&mut d, &r.token_ids).unwrap();
            let (vs_hf, vs_one) = (
                max_abs_diff_rows(&logits, &r.logits),
                max_abs_diff_rows(&logits, &unsplit),
            );
            eprintln!("{name} sim tp {tp}: vs transformers {vs_hf:e}, vs tp 1 {vs_one:e}");
            assert!(
                vs_hf < TOL && vs_one < TOL,
                "{name} tp {tp}: {vs_hf} / {vs_one}"
            );
            let stop = StopConditions {
                max_tokens: r.greedy.generated_token_ids.len(),
                stop_token_ids: vec![],
            };
            let got = engine::generate(
                &mut d,
                &r.greedy.prompt_token_ids,
                SamplingParams::GREEDY,
                &stop,
            )
            .unwrap();
            assert_eq!(got, r.greedy.generated_token_ids, "{name} tp {tp}");
            d.destroy().unwrap();
        }
        // Split sampling: each rank's sampling graph reads its own vocabulary slice of the
        // logits its forward pass left, and the ranks complete the argmax together.
        let split = DeviceOptions {
            split_sampler: true,
            ..DeviceOptions::sim()
        };
        let mut d = sim_with(name, 2, split);
        let stop = StopConditions {
            max_tokens: r.greedy.generated_token_ids.len(),
            stop_token_ids: vec![],
        };
        let prompt = &r.greedy.prompt_token_ids;
        let got = engine::generate(&mut d, prompt, SamplingParams::GREEDY, &stop).unwrap();
        assert_eq!(
            got, r.greedy.generated_token_ids,
            "{name} tp 2, split sampling"
        );
    }
}

/// A vocabulary `--tp` does not divide (tiny-v3 cut to 501 tokens, see
/// [`common::fixture_with_vocab`]) is padded on the device too: each rank's logits buffer is
/// its padded slice, the host joins them into rows `vocab` wide, and neither the fused
/// sampler nor the split one (whose sampling graph reads the padded slice its forward graph
/// left) draws the padding. Transformers' logits cut to the same vocabulary are the reference.
#[test]
fn a_padded_vocabulary_on_nrt_sim_is_never_returned_or_drawn() {
    run_child("child_padded_vocabulary", &[CORES]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_padded_vocabulary() {
    if !is_child() {
        return a_padded_vocabulary_on_nrt_sim_is_never_returned_or_drawn();
    }
    const VOCAB: usize = common::ODD_VOCAB;
    let dir = common::fixture_with_vocab("tiny-v3", VOCAB);
    let r = reference("tiny-v3");
    let want: Vec<Vec<f32>> = r.logits.iter().map(|row| row[..VOCAB].to_vec()).collect();
    let hot = common::HOT;
    let stop = StopConditions {
        max_tokens: 24,
        stop_token_ids: vec![],
    };
    let (cfg, weights) = load_dir(&dir);
    let mut cpu = runner::open_with_weights(Backend::Cpu, cfg, weights, config(1)).unwrap();
    let drawn = engine::generate(&mut cpu, &r.token_ids, hot, &stop).unwrap();
    let split = DeviceOptions {
        split_sampler: true,
        ..DeviceOptions::sim()
    };
    for (tp, opts) in [
        (2, DeviceOptions::sim()),
        (4, DeviceOptions::sim()),
        (4, split),
    ] {
        let what = format!("tp {tp}, split sampler {}", opts.split_sampler);
        let mut d = sim_at(&dir, tp, opts);
        let logits = engine::score(&mut d, &r.token_ids).unwrap();
        assert!(logits.iter().all(|row| row.len() == VOCAB), "{what}");
        let worst = max_abs_diff_rows(&logits, &want);
        eprintln!("tiny-v3 vocab {VOCAB} sim {what}: vs transformers {worst:e}");
        assert!(worst < TOL, "{what}: {worst}");
        let got = engine::generate(&mut d, &r.token_ids, hot, &stop).unwrap();
        assert!(got.iter().all(|&t| (t as usize) < VOCAB), "{what}: {got:?}");
        assert_eq!(got, drawn, "{what}");
        d.destroy().unwrap();
    }
}

#[test]
fn a_fault_on_one_rank_fails_the_step_on_every_rank_and_the_next_step_works() {
    // Executions are counted over the process: at --tp 2 each step is two, so execution 3 is
    // one rank's share of the second step. A rank left waiting would fail only after the
    // collective timeout; it is set far above what a prompt failure takes.
    run_child(
        "child_rank_fault",
        &[
            CORES,
            (nrt_sim::ENV_FAIL_EXECUTE, "3"),
            (nrt_sim::ENV_COLLECTIVE_TIMEOUT_MS, "60000"),
        ],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_rank_fault() {
    if !is_child() {
        return a_fault_on_one_rank_fails_the_step_on_every_rank_and_the_next_step_works();
    }
    let mut d = sim("tiny-v3", 2);
    let mut blocks = common::allocator(&d);
    let mut table = Vec::new();
    blocks.grow(&mut table, 3).unwrap();
    let chunk = PrefillChunk {
        tokens: &[3, 4, 5],
        start: 0,
        blocks: &table,
        sampling: SamplingParams::GREEDY,
        controls: LogitControls::NONE,
    };
    let first = d.prefill(&chunk, LogitsOutput::Sampled).unwrap();
    let t = Instant::now();
    let err = d
        .prefill(&chunk, LogitsOutput::Sampled)
        .unwrap_err()
        .to_string();
    let waited = t.elapsed();
    // The failing rank's own status (the injected one), not the collective failure it caused
    // on the other rank.
    assert!(
        err.contains("NRT_EXEC_COMPLETED_WITH_ERR"),
        "the failing rank's own error: {err}"
    );
    assert!(
        waited < Duration::from_secs(30),
        "the other rank waited {waited:?}: the failure did not reach it"
    );
    let again = d.prefill(&chunk, LogitsOutput::Sampled).unwrap();
    assert_eq!(again.next_tokens, first.next_tokens);
    assert_eq!(again.logits, first.logits);
}

#[test]
fn more_ranks_than_visible_cores_is_one_clear_error() {
    // The default simulated instance is a trn1.2xlarge: two NeuronCores.
    run_child("child_too_many_ranks", &[]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_too_many_ranks() {
    if !is_child() {
        return more_ranks_than_visible_cores_is_one_clear_error();
    }
    let (cfg, weights) = load("tiny-v3");
    let lib = Library::open(nrt_sim::library_next_to_current_exe().expect("libnrt_sim.so"))
        .expect("load nrt-sim");
    let err = DeviceRunner::new(cfg, weights, config(4), lib, DeviceOptions::sim())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--tp 4 needs NeuronCores 0..4") && err.contains("only 2 are visible"),
        "{err}"
    );
}

#[test]
fn each_cores_peak_hbm_is_what_the_memory_plan_says() {
    run_child("child_peak_hbm", &[CORES]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_peak_hbm() {
    if !is_child() {
        return each_cores_peak_hbm_is_what_the_memory_plan_says();
    }
    let hooks = nrt_sim::SimLibrary::open(nrt_sim::library_next_to_current_exe().expect("lib"))
        .expect("hooks");
    for name in FIXTURES {
        for tp in [1, 2, 4] {
            let d = sim(name, tp);
            let counters = hooks.counters().expect("counters");
            let (cfg, _) = load(name);
            let limits = Limits {
                tp,
                ..Limits::new(2, 128)
            };
            let plan = runner::device_plan(&cfg, &limits, Some(deepinfer::graph::DType::F32), 4)
                .expect("plan");
            // What the plan counts of the NEFFs, less the runtime's micro-code (per core, not
            // per NEFF), which nrt-sim does not charge: every NEFF's code and collectives
            // buffers and the largest one's scratchpad, each charged by nrt-sim at its load.
            let neffs: u64 = plan.neffs.iter().map(|g| g.footprint.private()).sum();
            for (core, planned) in plan.per_core().iter().enumerate() {
                let want = planned.weights
                    + planned.kv_cache
                    + planned.metadata
                    + planned.outputs
                    + neffs
                    + planned.scratchpad;
                let got = counters.hbm[core].peak;
                let err = (got as f64 - want as f64).abs() / want as f64;
                eprintln!("{name} tp {tp} core {core}: nrt-sim peak {got} B, plan {want} B");
                assert!(err < 0.05, "{name} tp {tp} core {core}: {got} vs {want}");
            }
            drop(d);
            hooks.reset();
        }
    }
}
