//! CPU prefill-step latency on the synthetic ~300M-parameter "medium" DeepSeek-V3 config
//! (`fixtures/configs/medium-bench.json`, as `benches/decode.rs`): one 64-token chunk of one
//! prompt, and four 16-token prompts packed into one step, with random weights in f32 and in
//! bf16 (bf16 cache too). Prefill is compute-bound where decode is bandwidth-bound, so this is
//! where the matmul kernel's arithmetic rate shows; throughput is in prompt tokens.
//!
//! `prefill_step/BACKEND/MODEL/tpN/DTYPE[/QUANTIZE]/tokens_T` (on a trn1 by default, elsewhere
//! with `DEEPINFER_BENCH_BACKEND=cpu|sim|neuron`): one real prefill step per prefill bucket
//! (16, 64, ... up to `--prefill-chunk`) of the deployment the `DEEPINFER_BENCH_*` variables
//! describe (`benches/common/deployment.rs`; default the tiny-v3 fixture in f32), opened as
//! `deepinfer serve` opens it: a deployment the memory plan refuses is printed with the plan's
//! message and not measured. Each row is one prompt of T seeded random tokens from position 0,
//! so its time is the prompt's time to first token less the server's own overhead, and its
//! throughput prompt tokens per second.
//!
//! Run with `cargo bench --bench prefill`.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::BlockAllocator;
use deepinfer::graph::DType;
use deepinfer::model::{LogitsOutput, ModelWeights, Precision};
use deepinfer::runner::step::{LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, Step};

#[path = "common/deployment.rs"]
mod deployment;
#[path = "common/rng.rs"]
mod rng;

/// The binary's allocator (jemalloc with transparent huge pages, see `src/bin/deepinfer`), so
/// this bench measures what `deepinfer` runs.
#[cfg(all(target_os = "linux", feature = "server"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Tokens in one step, however they are split into prompts.
const STEP_TOKENS: usize = 64;

fn prefill_step(c: &mut Criterion) {
    // As the binary does (see its docs).
    deepinfer::backend::cpu::pin_thread_count();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/medium-bench.json");
    let cfg = ModelConfig::from_file(&path).expect("medium config");
    let mut group = c.benchmark_group("cpu_prefill_step_medium");
    group.sample_size(10);
    group.throughput(Throughput::Elements(STEP_TOKENS as u64));
    for (tag, precision) in [
        ("f32", Precision::F32),
        ("bf16", Precision::all(DType::BF16)),
    ] {
        let weights = ModelWeights::random(&cfg, 0, &precision).expect("random weights");
        for prompts in [1usize, 4] {
            let mut rc = RunnerConfig::for_limits(prompts, 1024);
            rc.kv_dtype = precision.kv_cache;
            let mut blocks = BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
            let mut runner =
                runner::open_with_weights(Backend::Cpu, cfg.clone(), weights.clone(), rc)
                    .expect("runner");
            let len = STEP_TOKENS / prompts;
            let tokens: Vec<Vec<u32>> = (0..prompts)
                .map(|p| {
                    (0..len as u32)
                        .map(|j| (j * 7 + p as u32 * 13 + 1) % 32000)
                        .collect()
                })
                .collect();
            let tables: Vec<Vec<u32>> = (0..prompts)
                .map(|_| {
                    let mut t = Vec::new();
                    blocks.grow(&mut t, len).expect("blocks");
                    t
                })
                .collect();
            let chunks: Vec<PrefillChunk> = tokens
                .iter()
                .zip(&tables)
                .map(|(tokens, blocks)| PrefillChunk {
                    tokens,
                    start: 0,
                    blocks,
                    sampling: SamplingParams::GREEDY,
                    controls: LogitControls::NONE,
                })
                .collect();
            let step = Step::Prefill {
                chunks: &chunks,
                logits: LogitsOutput::None,
            };
            let id = BenchmarkId::new(tag, format!("{prompts}x{len}"));
            group.bench_with_input(id, &prompts, |b, _| {
                b.iter(|| runner.replay(&step).expect("prefill"))
            });
        }
    }
    group.finish();
}

/// The deployment rows' defaults: the tiny-v3 fixture in f32, one sequence at a time, 128
/// tokens (prefill buckets 16 and 64).
fn deployment_defaults() -> deployment::Defaults {
    deployment::Defaults {
        model: Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-v3"),
        model_dtype: Some(DType::F32),
        model_is_embedded: false,
        max_batch: 1,
        max_len: Some(128),
    }
}

/// One prefill step per prefill bucket of the `DEEPINFER_BENCH_*` deployment (see the module
/// docs): a prompt filling the bucket, tokens seeded at random over the vocabulary.
fn deployment_prefill(c: &mut Criterion) {
    let Some((deployment, mut runner)) = deployment::open("prefill_step", &deployment_defaults())
    else {
        return;
    };
    let rc = runner.runner_config().clone();
    let vocab = runner.config().vocab_size as u32;
    let mut blocks = BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
    let mut table = Vec::new();
    blocks
        .grow(&mut table, rc.buckets.prefill_chunk)
        .expect("blocks for the largest prefill bucket");
    let mut rng = rng::Rng::new(42);
    let mut group = c.benchmark_group(format!("prefill_step/{}", deployment.label()));
    group.sample_size(10);
    for t in rc.buckets.prefill_sizes() {
        let tokens: Vec<u32> = (0..t).map(|_| rng.below(vocab)).collect();
        let chunk = PrefillChunk {
            tokens: &tokens,
            start: 0,
            blocks: &table,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        };
        let step = Step::Prefill {
            chunks: &[chunk],
            logits: LogitsOutput::None,
        };
        group.throughput(Throughput::Elements(t as u64));
        group.bench_function(format!("tokens_{t}"), |b| {
            b.iter(|| runner.replay(&step).expect("prefill"))
        });
    }
    group.finish();
}

criterion_group!(benches, prefill_step, deployment_prefill);
criterion_main!(benches);
