//! CPU decode-step latency on the synthetic ~300M-parameter "medium" DeepSeek-V3 config
//! (`fixtures/configs/medium-bench.json`: 64 experts, top-6, noaux_tc routing) at batch 1, 8
//! and 32, with random weights held in f32, in bf16 (bf16 cache too), in bf16 with int8
//! routed experts, and with every linear layer in GGML's q8_0 and q4_k (bf16 for the rest).
//! Each iteration runs one decode step at a fixed position (context 17), so every sample does
//! the same amount of work, but with its own tokens: each row's token is drawn at random
//! (seeded) from the vocabulary, a fresh draw per iteration (cycling through [`TOKEN_SETS`]
//! sets), so a batch's rows route to different experts and consecutive steps to different
//! ones, as real decoding's do (a token repeated over the rows and steps would read one set of
//! experts, kept warm in the caches). Rows are greedy, so the CPU runner's argmax-only decode
//! graph runs.
//!
//! Run with `cargo bench --bench decode`. `scripts/bench_vs_transformers.py` compares the same
//! config against transformers' eager CPU decode.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::BlockAllocator;
use deepinfer::graph::DType;
use deepinfer::model::{LogitsOutput, ModelWeights, Precision, Quantize};
use deepinfer::runner::step::{DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, Step};

/// The binary's allocator (jemalloc with transparent huge pages, see `src/bin/deepinfer`), so
/// this bench measures what `deepinfer` runs.
#[cfg(all(target_os = "linux", feature = "server"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const PROMPT: usize = 16;
/// Distinct token sets an iteration cycles through (a step's rows take one set).
const TOKEN_SETS: usize = 64;

#[path = "common/rng.rs"]
mod rng;

fn decode_step(c: &mut Criterion) {
    // As the binary does (see its docs).
    deepinfer::backend::cpu::pin_thread_count();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/medium-bench.json");
    let cfg = ModelConfig::from_file(&path).expect("medium config");
    let bf16 = Precision::all(DType::BF16);
    let int8 = Precision {
        quantize: Quantize::ExpertsInt8,
        ..bf16
    };
    let ggml = |quantize| Precision { quantize, ..bf16 };
    let mut group = c.benchmark_group("cpu_decode_step_medium");
    group.sample_size(10);
    for (tag, precision) in [
        ("f32", Precision::F32),
        ("bf16", bf16),
        ("int8", int8),
        ("q8_0", ggml(Quantize::Q8_0)),
        ("q4_k", ggml(Quantize::Q4K)),
    ] {
        let weights = ModelWeights::random(&cfg, 0, &precision).expect("random weights");
        for batch in [1usize, 8, 32] {
            let mut rc = RunnerConfig::for_limits(batch, 64);
            rc.kv_dtype = precision.kv_cache;
            let mut blocks = BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
            let mut runner =
                runner::open_with_weights(Backend::Cpu, cfg.clone(), weights.clone(), rc)
                    .expect("runner");
            let mut tables = vec![Vec::new(); batch];
            for (i, table) in tables.iter_mut().enumerate() {
                let prompt: Vec<u32> = (0..PROMPT as u32)
                    .map(|j| (j * 7 + i as u32 * 13 + 1) % 32000)
                    .collect();
                blocks.grow(table, PROMPT + 1).expect("blocks");
                let chunk = PrefillChunk {
                    tokens: &prompt,
                    start: 0,
                    blocks: table,
                    sampling: SamplingParams::GREEDY,
                    controls: LogitControls::NONE,
                };
                runner
                    .replay(&Step::Prefill {
                        chunks: &[chunk],
                        logits: LogitsOutput::None,
                    })
                    .expect("prefill");
            }
            let mut rng = rng::Rng::new(batch as u64);
            let vocab = cfg.vocab_size as u32;
            let sets: Vec<Vec<DecodeRow>> = (0..TOKEN_SETS)
                .map(|_| {
                    tables
                        .iter()
                        .map(|t| DecodeRow {
                            token: rng.below(vocab),
                            position: PROMPT,
                            blocks: t,
                            sampling: SamplingParams::GREEDY,
                            controls: LogitControls::NONE,
                        })
                        .collect()
                })
                .collect();
            let steps: Vec<Step> = sets
                .iter()
                .map(|rows| Step::Decode {
                    rows,
                    logits: LogitsOutput::None,
                })
                .collect();
            group.throughput(Throughput::Elements(batch as u64));
            group.bench_with_input(BenchmarkId::new(tag, batch), &batch, |b, _| {
                let mut next = steps.iter().cycle();
                b.iter(|| {
                    let step = next.next().expect("a cycle never ends");
                    runner.replay(step).expect("decode")
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
