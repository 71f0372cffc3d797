//! Host cost of the device runner.
//!
//! - `replay_sim/batch_N`: host time of one decode replay on nrt-sim with
//!   `NRT_SIM_FREE_EXECUTE=1` (executions validate their bindings and return at once, so the
//!   device is excluded): pad, write the bucket's metadata, execute, read `next_tokens`. Prints
//!   the host↔device bytes of one step. Target: ≤ 50 µs at batch 64.
//! - `replay_sim_tp/tp_N`: the same at batch 64 for the default model (8 heads) split over N
//!   simulated NeuronCores: N metadata writes and N concurrent executions per step. Target:
//!   `tp_8` ≤ 2 × `tp_1`.
//! - `capture/…`: build + lower time of one bucket graph of `fixtures/configs/deepseek-v2-lite.json`
//!   (config only; no weights).
//! - `decode_step/…` (on a trn1 by default, elsewhere with `DEEPINFER_BENCH_BACKEND=cpu|sim|
//!   neuron`): one real decode step per batch bucket of the deployment the `DEEPINFER_BENCH_*`
//!   variables describe (model, dtype, quantization, tp, batch, length; see
//!   `benches/common/deployment.rs`), opened as `serve` opens it, with each bucket's NeuronCore
//!   floor.
//!
//! Needs `libnrt_sim.so` beside the bench binary: `cargo build -p nrt-sim` (or `cargo test
//! --workspace`) first.

use std::path::{Path, PathBuf};

use criterion::{criterion_group, criterion_main, Criterion};
use deepinfer::backend::hlo::emit;
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Buckets, RunnerConfig};
use deepinfer::engine::BlockAllocator;
use deepinfer::graph::DType;
use deepinfer::model::{
    self, CacheLayout, GraphSpec, LogitsOutput, ModelWeights, MoeStrategy, Precision, Sampler,
    WeightSpecs,
};
use deepinfer::runner::step::{DecodeRow, LogitControls, SamplingParams};
use deepinfer::runner::{DeviceOptions, DeviceRunner, Runner, Step};
use deepinfer::weights::Checkpoint;

#[path = "common/deployment.rs"]
mod deployment;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn sim_lib() -> Option<PathBuf> {
    nrt_sim::library_next_to_current_exe()
        .or_else(|| Some(root().join("target/release/libnrt_sim.so")).filter(|p| p.is_file()))
}

fn tiny() -> (ModelConfig, ModelWeights) {
    let dir = root().join("fixtures/tiny-v3");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("config");
    let w = ModelWeights::load(
        &cfg,
        &Checkpoint::open(&dir).expect("checkpoint"),
        &Precision::F32,
    )
    .expect("w");
    (cfg, w)
}

fn replay_config() -> RunnerConfig {
    RunnerConfig {
        block_size: 16,
        num_blocks: 64 * 4 + 1,
        buckets: Buckets {
            batch: vec![1, 8, 32, 64],
            ctx: vec![64],
            prefill_chunk: 16,
            prefill_seqs: 1,
        },
        moe: None,
        kv_dtype: DType::BF16,
        tp: 1,
        speculative_tokens: 0,
    }
}

/// One greedy decode row per block table, at varied tokens and positions.
fn decode_rows(tables: &[Vec<u32>]) -> Vec<DecodeRow<'_>> {
    tables
        .iter()
        .enumerate()
        .map(|(i, t)| DecodeRow {
            token: (i % 50) as u32 + 1,
            position: 30 + i % 9,
            blocks: t,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        })
        .collect()
}

fn replay(c: &mut Criterion) {
    let Some(path) = sim_lib() else {
        eprintln!("replay_sim skipped: libnrt_sim.so not found (cargo build -p nrt-sim)");
        return;
    };
    // Read at nrt_init (and the core count at the first call): set before the runtime
    // exists (nothing else runs yet).
    std::env::set_var(nrt_sim::ENV_FREE_EXECUTE, "1");
    std::env::set_var(nrt_sim::ENV_NC_COUNT, "8");
    let (cfg, weights) = tiny();
    let vocab = cfg.vocab_size;
    let lib = neuron_sys::Library::open(&path).expect("nrt-sim");
    let hooks = nrt_sim::SimLibrary::open(&path).expect("hooks");
    let rc = replay_config();
    let mut blocks = BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
    let buckets = rc.buckets.clone();
    let mut runner =
        DeviceRunner::new(cfg, weights, rc, lib, DeviceOptions::sim()).expect("nrt-sim runner");
    runner.capture(&buckets).expect("capture");
    if let Some(st) = runner.capture_stats() {
        println!(
            "capture on nrt-sim (tiny-v3, {} graphs): {:?} total, {} B uploaded",
            st.graphs.len(),
            st.total,
            st.bytes_uploaded
        );
        for (name, t, bytes) in &st.graphs {
            println!("  {name}: build + lower {t:?}, {bytes} B NEFF");
        }
    }
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); 64];
    for t in tables.iter_mut() {
        blocks.grow(t, 40).expect("blocks");
    }
    let mut group = c.benchmark_group("replay_sim");
    for batch in [1usize, 8, 32, 64] {
        let rows = decode_rows(&tables[..batch]);
        let step = Step::Decode {
            rows: &rows,
            logits: LogitsOutput::None,
        };
        // The steady state: the first replay of a bucket also copies the all-ones
        // allowed-token mask, which later unconstrained steps skip.
        runner.replay(&step).expect("replay");
        hooks.reset();
        runner.replay(&step).expect("replay");
        let counters = hooks.counters().expect("counters");
        let written: u64 = counters.tensor_bytes_written.values().sum();
        let read: u64 = counters.tensor_bytes_read.values().sum();
        let mask = batch * vocab.div_ceil(32) * 4;
        println!(
            "replay_sim batch {batch}: host->device {written} B, device->host {read} B per \
             step (+{mask} B of allowed-token mask in a step with a constrained row)"
        );
        group.bench_function(format!("batch_{batch}"), |b| {
            b.iter(|| runner.replay(&step).expect("replay"))
        });
    }
    group.finish();
    drop(runner);

    // Tensor parallelism: one runtime per process, so each degree's runner is dropped before
    // the next starts.
    let dir = root().join("fixtures/default-model");
    let mut group = c.benchmark_group("replay_sim_tp");
    for tp in [1usize, 2, 8] {
        let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("config");
        let weights = ModelWeights::random(&cfg, 0, &Precision::F32).expect("weights");
        let lib = neuron_sys::Library::open(&path).expect("nrt-sim");
        let rc = RunnerConfig {
            tp,
            ..replay_config()
        };
        let buckets = rc.buckets.clone();
        let mut runner =
            DeviceRunner::new(cfg, weights, rc, lib, DeviceOptions::sim()).expect("runner");
        runner.capture(&buckets).expect("capture");
        let rows = decode_rows(&tables);
        let step = Step::Decode {
            rows: &rows,
            logits: LogitsOutput::None,
        };
        group.bench_function(format!("tp_{tp}"), |b| {
            b.iter(|| runner.replay(&step).expect("replay"))
        });
    }
    group.finish();
    std::env::remove_var(nrt_sim::ENV_FREE_EXECUTE);
}

fn capture(c: &mut Criterion) {
    let path = root().join("fixtures/configs/deepseek-v2-lite.json");
    let cfg = ModelConfig::from_file(Path::new(&path)).expect("deepseek-v2-lite config");
    let specs = WeightSpecs::new(&cfg, &Precision::all(DType::BF16));
    let layout = CacheLayout {
        dtype: DType::BF16,
        block_size: 16,
        num_slots: 64 * 256 + 16,
        state_rows: 65,
    };
    let mut group = c.benchmark_group("capture");
    group.sample_size(10);
    for (prefill, rows, ctx) in [
        (false, 1usize, 4096usize),
        (false, 8, 4096),
        (false, 64, 4096),
        (true, 64, 4096),
    ] {
        let spec = GraphSpec {
            rows,
            seqs: if prefill { 1 } else { rows },
            ctx,
            logits: if prefill {
                LogitsOutput::AllPositions
            } else {
                LogitsOutput::Sampled
            },
            moe: MoeStrategy::Gather,
            sampler: Sampler::Full,
        };
        let name = if prefill {
            format!("prefill_t{rows}_c{ctx}")
        } else {
            format!("decode_b{rows}_c{ctx}")
        };
        group.bench_function(name, |b| {
            b.iter(|| {
                let g = if prefill {
                    model::build_prefill(&cfg, &specs, &layout, &spec)
                } else {
                    model::build_decode(&cfg, &specs, &layout, &spec)
                }
                .expect("build");
                emit::to_bytes(&emit::emit(&g).expect("lower")).len()
            })
        });
    }
    group.finish();
}

/// The decode-step rows' deployment without `DEEPINFER_BENCH_*` variables: the tiny-v3
/// fixture in f32, batches up to 8, 128 tokens.
fn decode_defaults() -> deployment::Defaults {
    deployment::Defaults {
        model: root().join("fixtures/tiny-v3"),
        model_dtype: Some(DType::F32),
        model_is_embedded: false,
        max_batch: 8,
        max_len: Some(128),
    }
}

/// One NeuronCore-v2's share of a trn1 chip's HBM bandwidth (820 GiB/s for the chip's two
/// cores, AWS's trn1 architecture page): the floor's denominator.
const CORE_BANDWIDTH: f64 = 410.0 * (1u64 << 30) as f64;

/// One real decode step per captured batch bucket of the deployment the `DEEPINFER_BENCH_*`
/// variables describe (`deployment::from_env`, defaults [`decode_defaults`]), on the backend `DEEPINFER_BENCH_BACKEND` names, or by default on the Neuron
/// backend when libnrt loads and sees a NeuronCore (on a trn1 instance, `cargo bench` thus
/// measures the device). The runner is opened as `serve` opens it: the memory plan refuses a
/// deployment that does not fit (the message is printed and the bench skipped), and weights
/// stream from the checkpoint to each core. Throughput is tokens per second; each bucket's
/// line also prints the step's memory-bandwidth floor on a NeuronCore (the unavoidable bytes,
/// `model::cost::decode_floor`, spread over the ranks, at 410 GiB/s a core).
fn decode_step(c: &mut Criterion) {
    let Some((deployment, mut runner)) = deployment::open("decode_step", &decode_defaults()) else {
        return;
    };
    let (dir, limits) = (&deployment.model, &deployment.limits);
    let rc = runner.runner_config().clone();
    let cfg = runner.config().clone();
    let floor_of = |batch: usize, ctx: usize| -> Option<f64> {
        let saved = Checkpoint::open(dir).ok()?.float_dtype();
        let precision = limits.precision.resolve(saved, &cfg).ok()?;
        let specs = WeightSpecs::new(&cfg, &precision);
        let f = deepinfer::model::cost::decode_floor(&cfg, &specs, rc.kv_dtype, batch, ctx);
        Some(f.total() / rc.tp as f64 / CORE_BANDWIDTH)
    };
    let max_batch = rc.buckets.max_batch();
    let mut blocks = BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
    // Every sequence at the middle of the longest context bucket.
    let ctx = rc.buckets.max_len() / 2;
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); max_batch];
    for t in tables.iter_mut() {
        blocks.grow(t, ctx + 1).expect("blocks");
    }
    let mut group = c.benchmark_group(format!("decode_step/{}", deployment.label()));
    for &batch in &rc.buckets.batch {
        let rows: Vec<DecodeRow> = tables
            .iter()
            .take(batch)
            .enumerate()
            .map(|(i, t)| DecodeRow {
                token: i as u32 + 1,
                position: ctx - i % 4,
                blocks: t,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            })
            .collect();
        let step = Step::Decode {
            rows: &rows,
            logits: LogitsOutput::None,
        };
        if let Some(floor) = floor_of(batch, ctx) {
            eprintln!(
                "decode_step batch {batch} at {ctx} tokens: NeuronCore floor {:.3} ms a step \
                 ({:.0} tok/s)",
                floor * 1e3,
                batch as f64 / floor
            );
        }
        group.throughput(criterion::Throughput::Elements(batch as u64));
        group.bench_function(format!("batch_{batch}"), |b| {
            b.iter(|| runner.replay(&step).expect("decode"))
        });
    }
    group.finish();
}

criterion_group!(benches, replay, capture, decode_step);
criterion_main!(benches);
