//! CPU prefill-step latency on the synthetic ~300M-parameter "medium" DeepSeek-V3 config
//! (`fixtures/configs/medium-bench.json`, as `benches/decode.rs`): one 64-token chunk of one
//! prompt, and four 16-token prompts packed into one step, with random weights in f32 and in
//! bf16 (bf16 cache too). Prefill is compute-bound where decode is bandwidth-bound, so this is
//! where the matmul kernel's arithmetic rate shows; throughput is in prompt tokens.
//!
//! Run with `cargo bench --bench prefill`.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deepinfer::config::ModelConfig;
use deepinfer::engine::BlockAllocator;
use deepinfer::graph::DType;
use deepinfer::model::{LogitsOutput, ModelWeights, Precision};
use deepinfer::runner::step::{LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, RunnerConfig, Step};

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

criterion_group!(benches, prefill_step);
criterion_main!(benches);
