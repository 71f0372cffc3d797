//! What verifying drafts costs: a speculative-decoding verify step of `K + 1` positions
//! (`Step::Verify`) against the one-token decode step it replaces, at batch 1, on the synthetic
//! ~300M-parameter "medium" config (`fixtures/configs/medium-bench.json`, random weights, as
//! `benches/decode.rs`) and on the default model (bf16, with its MTP layer), after a 256-token
//! prompt; for the default model also one draft step (`Step::Draft`, the MTP layer over one
//! row), the other cost an iteration pays `K` times, and both steps with a sampled row (the
//! full sampler, and the rejection sampler at every verify position). A batch-1 decode step is bound by reading the
//! weights; a verify step reads them once for all its positions, so the closer its time is to
//! the decode step's, the more of the acceptance turns into speed (see
//! docs/speculative-decoding.md). Both steps feed the same position again each iteration (the
//! cache slots are overwritten with the same values).
//!
//! Run with `cargo bench --bench speculative`.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::BlockAllocator;
use deepinfer::graph::DType;
use deepinfer::model::{mtp, LogitsOutput, ModelWeights, Precision};
use deepinfer::runner::step::{DecodeRow, DraftChunk, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, Step};
use deepinfer::weights::Checkpoint;

/// The binary's allocator (jemalloc with transparent huge pages, see `src/bin/deepinfer`), so
/// this bench measures what `deepinfer` runs.
#[cfg(all(target_os = "linux", feature = "server"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Tokens cached before the measured steps.
const CONTEXT: usize = 256;

/// A sampled row's parameters: its verify step runs the rejection sampler at every position.
const SAMPLED: SamplingParams = SamplingParams {
    temperature: 0.8,
    top_p: 0.95,
    seed: 1,
    ..SamplingParams::GREEDY
};

fn chunk<'a>(tokens: &'a [u32], start: usize, blocks: &'a [u32]) -> PrefillChunk<'a> {
    PrefillChunk {
        tokens,
        start,
        blocks,
        sampling: SamplingParams::GREEDY,
        controls: LogitControls::NONE,
    }
}

fn verify_step(c: &mut Criterion) {
    deepinfer::backend::cpu::pin_thread_count();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let medium =
        ModelConfig::from_file(&root.join("fixtures/configs/medium-bench.json")).expect("medium");
    let default_dir = root.join("fixtures/default-model");
    let ckpt = Checkpoint::open(&default_dir).expect("default model");
    let mut default = ModelConfig::from_file(&default_dir.join("config.json"))
        .expect("default config")
        .with_draft_layer()
        .expect("an MTP layer");
    mtp::share_absent_embeddings(&mut default, &ckpt);
    let bf16 = Precision::all(DType::BF16);
    let models = [
        ("medium_f32", medium.clone(), Precision::F32),
        ("medium_bf16", medium, bf16),
        ("default_bf16", default, bf16),
    ];
    let mut group = c.benchmark_group("cpu_verify_step_b1");
    group.sample_size(20);
    for (tag, cfg, precision) in models {
        let weights = match cfg.draft_layers {
            0 => ModelWeights::random(&cfg, 0, &precision).expect("random weights"),
            _ => ModelWeights::load(&cfg, &ckpt, &precision).expect("default weights"),
        };
        let vocab = cfg.vocab_size as u32;
        let drafts = cfg.draft_layers > 0;
        let mut rc = RunnerConfig::for_limits(1, 1024);
        rc.kv_dtype = precision.kv_cache;
        let mut blocks = BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
        let mut runner = runner::open_with_weights(Backend::Cpu, cfg, weights, rc).expect("runner");
        let prompt: Vec<u32> = (0..CONTEXT as u32).map(|j| (j * 7 + 1) % vocab).collect();
        let mut table = Vec::new();
        blocks.grow(&mut table, CONTEXT + 8).expect("blocks");
        for (i, piece) in prompt.chunks(64).enumerate() {
            runner
                .replay(&Step::Prefill {
                    chunks: &[chunk(piece, i * 64, &table)],
                    logits: LogitsOutput::None,
                })
                .expect("prefill");
        }
        let fed: Vec<u32> = (0..8).map(|j| (j * 11 + 5) % vocab).collect();
        // Greedy, and for the default model sampled too (the full sampler in both steps).
        let samplers = match drafts {
            true => &[("", SamplingParams::GREEDY), ("_sampled", SAMPLED)][..],
            false => &[("", SamplingParams::GREEDY)][..],
        };
        for &(suffix, sampling) in samplers {
            group.bench_function(BenchmarkId::new(tag, format!("decode_1{suffix}")), |b| {
                let row = DecodeRow {
                    token: fed[0],
                    position: CONTEXT,
                    blocks: &table,
                    sampling,
                    controls: LogitControls::NONE,
                };
                b.iter(|| {
                    runner
                        .replay(&Step::Decode {
                            rows: std::slice::from_ref(&row),
                            logits: LogitsOutput::None,
                        })
                        .expect("decode")
                })
            });
            for k in [1usize, 2, 4] {
                let id = BenchmarkId::new(tag, format!("verify_{}{suffix}", k + 1));
                group.bench_function(id, |b| {
                    let verify = [PrefillChunk {
                        sampling,
                        ..chunk(&fed[..k + 1], CONTEXT, &table)
                    }];
                    b.iter(|| {
                        runner
                            .replay(&Step::Verify {
                                chunks: &verify,
                                logits: LogitsOutput::None,
                            })
                            .expect("verify")
                    })
                });
            }
        }
        if drafts {
            // One row drafting from the last step's (the verify step's) first hidden state.
            let draft = [DraftChunk {
                next_tokens: &fed[1..2],
                start: CONTEXT,
                blocks: &table,
                hidden_rows: &[0],
            }];
            group.bench_function(BenchmarkId::new(tag, "draft_1"), |b| {
                b.iter(|| {
                    runner
                        .replay(&Step::Draft {
                            chunks: &draft,
                            logits: LogitsOutput::None,
                        })
                        .expect("draft")
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, verify_step);
criterion_main!(benches);
