//! The engine thread's host work per generated token, beside the device step: what one token
//! of one choice costs in stop-string matching and in log-probabilities. The engine thread does
//! this work for every running sequence between two steps, so it adds to every stream's
//! time per output token.
//!
//! - `stop_strings/*`: [`StopStrings`] with 4 stop strings of about 200 characters, fed a
//!   2,000-token generation (4-character pieces, as detokenized tokens arrive): `near_miss`,
//!   where the text keeps repeating the first 190 characters of the stop strings without
//!   completing one (the worst realistic case: a model quoting the boilerplate a stop string was
//!   cut from), and `prose`, where the text seldom starts one. The figure is per generation;
//!   divide by 2,000 for a token.
//! - `token_logprobs`: [`TokenLogprobs::from_logits`] at DeepSeek's vocabulary of 102,400 with
//!   the top 20 alternatives (a log-sum-exp and a selection over the whole row).
//!
//! - `json_schema_masks_64_rows`: structured outputs' share of a decode step: 64 sequences
//!   under one JSON schema (an object with a string, an integer range, an enum and an array of
//!   enums; the string with `maxLength` 16 or unbounded): one iteration is one step's host
//!   work, every mask filled and every row's constraint advanced by its token as the scheduler
//!   does it (`fill_masks`: `grammar::fill_masks` and `grammar::advance_all`, on rayon's
//!   threads; `one_thread`: the same work one row after the other), with the default model's
//!   tokenizer (4,096 tokens) and with a synthetic byte-level vocabulary of DeepSeek V3's
//!   129,280 (`tests/common/synthetic_vocab.rs`). Each row walks whole documents by taking a
//!   seeded random token among those its mask allows (end-of-sequence only once the document
//!   is complete), as sampling from a model under the schema would, starting over when one is
//!   done; row `i` starts `3i` tokens ahead, and the rows live across criterion's samples, so a
//!   step's rows are at different places and the mean covers the grammar's states: inside and
//!   outside the string, the integer, the enum, the array. (Always taking the lowest allowed
//!   token, as this bench once did, never leaves an unbounded string: its lowest token is a
//!   space, forever.) Choosing the tokens and starting a document over are off the clock (on a
//!   server the device samples, and a new request's constraint is made at admission). A new
//!   document is a new sequence from the compiler's cache, as a server's next request is: its
//!   lexer family (see `grammar`'s "Shared lexers") has already built most of the DFA it needs.
//!
//! - `json_schema_device_step_64_rows/device_{3,10}ms/{fused,split}`: the same 64 rows
//!   (129,280 tokens, `maxLength` 16) through a whole decode step of the device runner on
//!   nrt-sim, whose forward pass takes a fixed device time without the host's CPUs
//!   (`NRT_SIM_FREE_EXECUTE=1`, and `NRT_SIM_SLOW_EXECUTE_MS` for the models named `decode*`):
//!   3 ms or 10 ms (a V2-Lite batch-64 forward pass at its bandwidth floor is about 2 ms split
//!   over a trn1.32xlarge's cores, 17 to 35 ms on a trn1.2xlarge).
//!   `fused`: the masks, then the step (one graph); `split` (`--split-sampler`): the masks on
//!   another thread while the forward pass runs, then the sampling graph. One iteration is the
//!   runner's `replay_with_masks` and the constraints' advance, as the scheduler runs them;
//!   subtract the device time to get the host time the step waits for. `*_no_schema`: the
//!   same steps' replay without constraints, the runner's own share. The model is tiny-v3's shape
//!   with the vocabulary widened to 129,280 and random weights (nothing is computed).
//!   Needs `libnrt_sim.so` (`cargo build --release -p nrt-sim`); skipped without it.
//!
//! - `step_metadata_b64_vocab_129280`: a decode step's metadata as the device runner refills it
//!   (`StepArrays::fill_decode`): 64 unconstrained rows, context 4,096, a 129,280 vocabulary.
//!
//! Run with `cargo bench --bench host_work`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepinfer::engine::detokenize::StopStrings;
use deepinfer::engine::TokenLogprobs;

#[path = "common/rng.rs"]
mod rng;
#[path = "../tests/common/synthetic_vocab.rs"]
mod synthetic_vocab;

/// Tokens per generation.
const TOKENS: usize = 2000;
/// Characters per token's text.
const PIECE: usize = 4;
const VOCAB: usize = 102_400;

/// A 200-character stretch of boilerplate: the stop strings are cut from it.
fn boilerplate() -> String {
    let sentence = "The quick brown fox jumps over the lazy dog while five wizards box. ";
    sentence.repeat(4).chars().take(200).collect()
}

/// Four stop strings of 200 characters: the boilerplate's first 196 and a distinct ending.
fn stops() -> Vec<String> {
    let b = boilerplate();
    (0..4).map(|i| format!("{}<#{i}>", &b[..196])).collect()
}

/// A generation's pieces: `text` repeated and cut into `PIECE`-character tokens.
fn pieces(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().cycle().take(TOKENS * PIECE).collect();
    chars.chunks(PIECE).map(|c| c.iter().collect()).collect()
}

fn run(stops: &[String], pieces: &[String]) -> usize {
    let mut m = StopStrings::new(stops);
    let mut released = 0;
    for p in pieces {
        let c = m.push(p);
        released += c.text.len();
        assert!(
            !c.stopped,
            "the bench's text must not complete a stop string"
        );
    }
    released + m.flush().len()
}

fn stop_strings(c: &mut Criterion) {
    let stops = stops();
    // 190 characters of the boilerplate, then a turn that no stop string takes.
    let near_miss = pieces(&format!("{}, and then? ", &boilerplate()[..190]));
    let prose = pieces(
        "It was the best of times, it was the worst of times, it was the age of wisdom, \
         it was the age of foolishness; ",
    );
    let mut group = c.benchmark_group("stop_strings_4x200_2000_tokens");
    group.throughput(Throughput::Elements(TOKENS as u64));
    group.bench_function("near_miss", |b| {
        b.iter(|| run(black_box(&stops), black_box(&near_miss)))
    });
    group.bench_function("prose", |b| {
        b.iter(|| run(black_box(&stops), black_box(&prose)))
    });
    group.finish();
}

fn token_logprobs(c: &mut Criterion) {
    let logits: Vec<f32> = (0..VOCAB)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 12) as f32 / 65_536.0 - 8.0)
        .collect();
    c.bench_function("token_logprobs_vocab_102400_top_20", |b| {
        b.iter(|| TokenLogprobs::from_logits(black_box(&logits), black_box(7), 20))
    });
}

/// `step_metadata_b64_vocab_129280`: the host side of a decode replay's metadata, what the
/// device runner refills in its staging arrays every step: 64 unconstrained rows at context
/// 4,096 and DeepSeek V3's vocabulary (whose allowed-token array is 1 MB of the step).
fn step_metadata(c: &mut Criterion) {
    use deepinfer::runner::step::{DecodeRow, LogitControls, SamplingParams, StepArrays};
    const ROWS: usize = 64;
    const CTX: usize = 4096;
    const BLOCK: usize = 16;
    let tables: Vec<Vec<u32>> = (0..ROWS as u32)
        .map(|r| {
            (0..(CTX / BLOCK) as u32 / 2)
                .map(|b| r * 1000 + b + 1)
                .collect()
        })
        .collect();
    let rows: Vec<DecodeRow> = tables
        .iter()
        .map(|t| DecodeRow {
            token: 7,
            position: t.len() * BLOCK - 1,
            blocks: t,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        })
        .collect();
    let mut staging = StepArrays::default();
    c.bench_function("step_metadata_b64_vocab_129280", |b| {
        b.iter(|| {
            staging
                .fill_decode(black_box(&rows), ROWS, CTX, BLOCK, 129_280)
                .expect("metadata")
        })
    });
}

/// The schemas of `json_schema_masks_64_rows`: an object with a string, an integer range, an
/// enum and an array of enums, the string bounded by `maxLength` or not. A bounded string's
/// interior is where llguidance's masks cost most (each position is a lexer state of its own,
/// and near the bound its precomputed token slices no longer apply, so it walks the whole
/// token trie).
fn schema(max_length: Option<u64>) -> serde_json::Value {
    let mut name = serde_json::json!({"type": "string"});
    if let Some(n) = max_length {
        name["maxLength"] = n.into();
    }
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": name,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "mood": {"enum": ["happy", "sad", "angry"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}
        },
        "required": ["name", "age", "mood", "tags"],
        "additionalProperties": false
    })
}

fn json_schema_masks(c: &mut Criterion) {
    let default_dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/default-model");
    let default_model = deepinfer::tokenizer::Tokenizer::from_dir(&default_dir)
        .expect("the default model's tokenizer");
    let synthetic_dir =
        std::env::temp_dir().join(format!("deepinfer-bench-vocab-{}", std::process::id()));
    let deepseek_sized = synthetic_vocab::synthetic_tokenizer(&synthetic_dir, 129_280);
    let mut group = c.benchmark_group("json_schema_masks_64_rows");
    for (name, tok, max_length) in [
        ("default_model_4096/max_length_16", &default_model, Some(16)),
        ("vocab_129280/max_length_16", &deepseek_sized, Some(16)),
        ("vocab_129280/unbounded", &deepseek_sized, None),
    ] {
        // One set of rows per case, kept across criterion's samples (which call the closure
        // afresh) so the steps measured cover whole documents.
        let mut rows = SchemaRows::new(tok, schema(max_length));
        for parallel in [false, true] {
            let variant = if parallel { "fill_masks" } else { "one_thread" };
            group.bench_function(format!("{name}/{variant}"), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| rows.step(parallel)).sum())
            });
        }
    }
    group.finish();
    let _ = std::fs::remove_dir_all(&synthetic_dir);
}

/// The device times of a forward pass in `json_schema_device_step_64_rows`, in ms.
const DEVICE_STEP_MS: [u64; 2] = [3, 10];

fn json_schema_device_step(c: &mut Criterion) {
    use deepinfer::runner::{DeviceOptions, DeviceRunner, Runner};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(lib) = nrt_sim::library_next_to_current_exe()
        .or_else(|| Some(root.join("target/release/libnrt_sim.so")).filter(|p| p.is_file()))
    else {
        eprintln!("json_schema_device_step skipped: no libnrt_sim.so (cargo build -p nrt-sim)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("deepinfer-bench-step-{}", std::process::id()));
    let tok = synthetic_vocab::synthetic_tokenizer(&dir.join("vocab"), 129_280);
    // tiny-v3's shape with DeepSeek V3's vocabulary.
    let text = std::fs::read_to_string(root.join("fixtures/tiny-v3/config.json")).expect("config");
    let mut raw: serde_json::Value = serde_json::from_str(&text).expect("config json");
    raw["vocab_size"] = 129_280.into();
    std::fs::create_dir_all(dir.join("model")).expect("temp dir");
    std::fs::write(dir.join("model/config.json"), raw.to_string()).expect("config");
    let cfg = deepinfer::config::ModelConfig::from_file(&dir.join("model/config.json"))
        .expect("widened config");
    let rc = deepinfer::deployment::RunnerConfig {
        block_size: 16,
        num_blocks: 64 * 3 + 1,
        buckets: deepinfer::deployment::Buckets {
            batch: vec![64],
            ctx: vec![64],
            prefill_chunk: 16,
            prefill_seqs: 1,
        },
        moe: None,
        kv_dtype: deepinfer::graph::DType::BF16,
        tp: 1,
        speculative_tokens: 0,
    };
    let mut blocks =
        deepinfer::engine::BlockAllocator::new(rc.num_blocks, rc.block_size).expect("blocks");
    let tables: Vec<Vec<u32>> = (0..64)
        .map(|_| {
            let mut t = Vec::new();
            blocks.grow(&mut t, 40).expect("blocks");
            t
        })
        .collect();
    // Read at each nrt_init (each runner's): nothing else runs meanwhile.
    std::env::set_var(nrt_sim::ENV_FREE_EXECUTE, "1");
    std::env::set_var(nrt_sim::ENV_SLOW_EXECUTE_MODELS, "decode");
    let mut group = c.benchmark_group("json_schema_device_step_64_rows");
    group.sample_size(30);
    for (ms, split) in DEVICE_STEP_MS
        .into_iter()
        .flat_map(|ms| [(ms, false), (ms, true)])
    {
        std::env::set_var(nrt_sim::ENV_SLOW_EXECUTE_MS, ms.to_string());
        let weights =
            deepinfer::model::ModelWeights::random(&cfg, 0, &deepinfer::model::Precision::F32)
                .expect("random weights");
        let opts = DeviceOptions {
            split_sampler: split,
            ..DeviceOptions::sim()
        };
        let lib = neuron_sys::Library::open(&lib).expect("nrt-sim");
        let mut runner =
            DeviceRunner::new(cfg.clone(), weights, rc.clone(), lib, opts).expect("nrt-sim runner");
        runner.capture(&rc.buckets).expect("capture");
        let mut rows = SchemaRows::new(&tok, schema(Some(16)));
        let name = if split { "split" } else { "fused" };
        group.bench_function(format!("device_{ms}ms/{name}"), |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| rows.device_step(&mut runner, &tables))
                    .sum()
            })
        });
        // The same step without a schema: what the runner's replay itself leaves the host.
        group.bench_function(format!("device_{ms}ms/{name}_no_schema"), |b| {
            let steps: Vec<_> = decode_rows(&tables);
            let step = deepinfer::runner::Step::Decode {
                rows: &steps,
                logits: deepinfer::model::LogitsOutput::None,
            };
            b.iter(|| runner.replay(&step).expect("a step on nrt-sim"))
        });
        drop(runner);
    }
    group.finish();
    for var in [
        nrt_sim::ENV_FREE_EXECUTE,
        nrt_sim::ENV_SLOW_EXECUTE_MS,
        nrt_sim::ENV_SLOW_EXECUTE_MODELS,
    ] {
        std::env::remove_var(var);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// 64 sequences under one schema, each at its own place in its document.
struct SchemaRows {
    compiler: deepinfer::engine::grammar::GrammarCompiler,
    format: deepinfer::engine::grammar::ResponseFormat,
    rows: Vec<deepinfer::engine::grammar::Constraint>,
    masks: Vec<Vec<u32>>,
    /// The rows' token choices (seeded, so every run walks the same documents).
    rng: rng::Rng,
}

impl SchemaRows {
    const ROWS: usize = 64;

    fn new(tok: &deepinfer::tokenizer::Tokenizer, schema: serde_json::Value) -> Self {
        use deepinfer::engine::grammar::{GrammarCompiler, ResponseFormat};
        let compiler = GrammarCompiler::new(tok).expect("a grammar compiler");
        let format = ResponseFormat::JsonSchema {
            name: "person".into(),
            schema,
            strict: Some(true),
        };
        let words = compiler.mask_words();
        let mut rows = SchemaRows {
            rows: Vec::new(),
            masks: vec![vec![0u32; words]; Self::ROWS],
            compiler,
            format,
            rng: rng::Rng::new(SCHEMA_ROWS_SEED),
        };
        rows.rows = (0..Self::ROWS).map(|_| rows.fresh()).collect();
        // Row i starts 3i tokens into its documents, so the rows are at different places in
        // their grammars (as a server's are), not in lockstep.
        for i in 0..Self::ROWS {
            for _ in 0..3 * i {
                let mut one = [(&mut rows.rows[i], rows.masks[i].as_mut_slice())];
                deepinfer::engine::grammar::fill_masks(&mut one);
                let token = rows.token(i);
                if rows.rows[i].advance(token) != deepinfer::engine::grammar::Advance::Accepted {
                    rows.rows[i] = rows.fresh();
                }
            }
        }
        rows
    }

    /// A new sequence, as a server's next request gets one from the compiler's cache.
    fn fresh(&self) -> deepinfer::engine::grammar::Constraint {
        self.compiler
            .matcher(&self.format)
            .expect("schema")
            .expect("a constraint")
    }

    /// Row `i`'s next token: one of those its mask allows other than end-of-sequence, at
    /// random, or end-of-sequence once the document is complete.
    fn token(&mut self, i: usize) -> u32 {
        let eos = self.compiler.eos_token_id();
        random_allowed_but(&self.masks[i], eos, &mut self.rng).unwrap_or(eos)
    }

    /// One decode step's grammar work, timed: every mask filled, every constraint advanced by
    /// its row's token (as the scheduler does it with `parallel`, else one row after the
    /// other). Choosing the tokens, and starting over a row whose document is done, are off
    /// the clock.
    fn step(&mut self, parallel: bool) -> std::time::Duration {
        use deepinfer::engine::grammar::{advance_all, fill_masks, Advance};
        let start = std::time::Instant::now();
        let mut step: Vec<_> = self
            .rows
            .iter_mut()
            .zip(self.masks.iter_mut())
            .map(|(row, mask)| (row, mask.as_mut_slice()))
            .collect();
        if parallel {
            fill_masks(&mut step);
        } else {
            for (row, mask) in step.iter_mut() {
                row.fill_mask(mask);
            }
        }
        let masks_time = start.elapsed();
        let tokens: Vec<u32> = (0..Self::ROWS).map(|i| self.token(i)).collect();
        let start = std::time::Instant::now();
        let mut step: Vec<_> = self.rows.iter_mut().zip(tokens).collect();
        let advanced = if parallel {
            advance_all(&mut step)
        } else {
            step.iter_mut().map(|(row, t)| row.advance(*t)).collect()
        };
        let timed = masks_time + start.elapsed();
        black_box(&self.masks);
        for (i, advance) in advanced.into_iter().enumerate() {
            if advance != Advance::Accepted {
                self.rows[i] = self.fresh();
            }
        }
        timed
    }
}

impl SchemaRows {
    /// One decode step of the rows on `runner` (their block tables `tables`), timed: the
    /// masks through [`Runner::replay_with_masks`] (each also kept for choosing the row's
    /// token), then every constraint advanced, as the scheduler runs a step; choosing the
    /// tokens is off the clock.
    fn device_step(
        &mut self,
        runner: &mut impl deepinfer::runner::Runner,
        tables: &[Vec<u32>],
    ) -> std::time::Duration {
        use deepinfer::engine::grammar::{advance_all, fill_masks, Advance};
        let rows = decode_rows(tables);
        let late: Vec<usize> = (0..Self::ROWS).collect();
        let start = std::time::Instant::now();
        let (constraints, masks) = (&mut self.rows, &mut self.masks);
        let mut fill = |out: &mut [&mut [u32]]| {
            let mut step: Vec<_> = constraints
                .iter_mut()
                .zip(masks.iter_mut())
                .map(|(row, mask)| (row, mask.as_mut_slice()))
                .collect();
            fill_masks(&mut step);
            for (o, m) in out.iter_mut().zip(masks.iter()) {
                o.copy_from_slice(m);
            }
        };
        runner
            .replay_with_masks(
                &rows,
                deepinfer::model::LogitsOutput::None,
                deepinfer::runner::LateMasks {
                    rows: &late,
                    fill: &mut fill,
                },
            )
            .expect("a step on nrt-sim");
        let step_time = start.elapsed();
        // The device sampled the tokens; here the host draws them, off the clock.
        let tokens: Vec<u32> = (0..Self::ROWS).map(|i| self.token(i)).collect();
        let start = std::time::Instant::now();
        let mut step: Vec<_> = self.rows.iter_mut().zip(tokens).collect();
        let advanced = advance_all(&mut step);
        let timed = step_time + start.elapsed();
        for (i, advance) in advanced.into_iter().enumerate() {
            if advance != Advance::Accepted {
                self.rows[i] = self.fresh();
            }
        }
        timed
    }
}

/// One greedy decode row per block table, fed token 1 at position 39.
fn decode_rows(tables: &[Vec<u32>]) -> Vec<deepinfer::runner::step::DecodeRow<'_>> {
    use deepinfer::runner::step::{DecodeRow, LogitControls, SamplingParams};
    tables
        .iter()
        .map(|t| DecodeRow {
            token: 1,
            position: 39,
            blocks: t,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        })
        .collect()
}

/// The seed of [`SchemaRows`]' token choices.
const SCHEMA_ROWS_SEED: u64 = 46;

/// A token the mask allows other than `eos`, uniformly at random, or `None` if it allows
/// only `eos` (or nothing).
fn random_allowed_but(mask: &[u32], eos: u32, rng: &mut rng::Rng) -> Option<u32> {
    let without_eos = |w: usize, word: u32| {
        if eos / 32 == w as u32 {
            word & !(1 << (eos % 32))
        } else {
            word
        }
    };
    let allowed: u32 = mask
        .iter()
        .enumerate()
        .map(|(w, &word)| without_eos(w, word).count_ones())
        .sum();
    if allowed == 0 {
        return None;
    }
    let mut k = rng.below(allowed);
    for (w, &word) in mask.iter().enumerate() {
        let mut word = without_eos(w, word);
        let n = word.count_ones();
        if k < n {
            for _ in 0..k {
                word &= word - 1;
            }
            return Some(w as u32 * 32 + word.trailing_zeros());
        }
        k -= n;
    }
    None
}

criterion_group!(
    benches,
    stop_strings,
    token_logprobs,
    step_metadata,
    json_schema_masks,
    json_schema_device_step
);
criterion_main!(benches);
