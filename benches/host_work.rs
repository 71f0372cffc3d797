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
//!   under one JSON schema (an object with a bounded string, an integer range, an enum and an
//!   array of them): one iteration is one step's host work, the 64 masks filled as the
//!   scheduler does it (`grammar::fill_masks` and `grammar::advance_all`, on rayon's threads):
//!   every mask filled and every row's constraint advanced by its token (`one_thread`: the same
//!   work one row after the other), with the default model's
//!   tokenizer (4,096 tokens) and with a synthetic byte-level vocabulary of DeepSeek V3's
//!   129,280 (`tests/common/synthetic_vocab.rs`).
//!   The masks are walked through a whole document by always taking the lowest allowed token,
//!   restarting each row when its document is done, so every kind of grammar state is measured.
//!
//! Run with `cargo bench --bench host_work`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepinfer::engine::detokenize::StopStrings;
use deepinfer::engine::TokenLogprobs;

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

/// The schema of `json_schema_masks_64_rows`.
fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
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
    for (name, tok) in [
        ("default_model_4096", &default_model),
        ("vocab_129280", &deepseek_sized),
    ] {
        group.bench_function(format!("{name}/one_thread"), |b| {
            masks_64_rows(b, tok, false)
        });
        group.bench_function(format!("{name}/fill_masks"), |b| {
            masks_64_rows(b, tok, true)
        });
    }
    group.finish();
    let _ = std::fs::remove_dir_all(&synthetic_dir);
}

/// One iteration: every one of 64 rows fills its mask (one after the other, or as the
/// scheduler does with `parallel`) and accepts its next token.
fn masks_64_rows(
    b: &mut criterion::Bencher,
    tok: &deepinfer::tokenizer::Tokenizer,
    parallel: bool,
) {
    use deepinfer::engine::grammar::{
        advance_all, fill_masks, Advance, GrammarCompiler, ResponseFormat,
    };
    const ROWS: usize = 64;
    let compiler = GrammarCompiler::new(tok).expect("a grammar compiler");
    let format = ResponseFormat::JsonSchema {
        name: "person".into(),
        schema: schema(),
        strict: Some(true),
    };
    let fresh = || {
        compiler
            .matcher(&format)
            .expect("schema")
            .expect("a constraint")
    };
    let mut rows: Vec<_> = (0..ROWS).map(|_| fresh()).collect();
    let words = compiler.mask_words();
    let mut masks = vec![vec![0u32; words]; ROWS];
    let eos = compiler.eos_token_id();
    // Only the step's work is timed: a row whose document is done is started over (a deep
    // copy of the compiled grammar, which a request pays once, not per step) off the clock.
    b.iter_custom(|iters| {
        let mut timed = std::time::Duration::ZERO;
        for _ in 0..iters {
            let start = std::time::Instant::now();
            let mut step: Vec<_> = rows
                .iter_mut()
                .zip(masks.iter_mut())
                .map(|(row, mask)| (row, mask.as_mut_slice()))
                .collect();
            if parallel {
                fill_masks(&mut step);
            } else {
                for (row, mask) in step.iter_mut() {
                    row.fill_mask(mask);
                }
            }
            // Each row's token: the lowest allowed, or end-of-sequence once the document is
            // complete (then the row starts over).
            let tokens: Vec<u32> = masks
                .iter()
                .map(|mask| lowest_allowed_but(mask, eos).unwrap_or(eos))
                .collect();
            let mut step: Vec<_> = rows.iter_mut().zip(tokens).collect();
            let advanced = if parallel {
                advance_all(&mut step)
            } else {
                step.iter_mut().map(|(row, t)| row.advance(*t)).collect()
            };
            let done: Vec<bool> = advanced.iter().map(|a| *a != Advance::Accepted).collect();
            timed += start.elapsed();
            black_box(&masks);
            for (row, done) in rows.iter_mut().zip(done) {
                if done {
                    *row = fresh();
                }
            }
        }
        timed
    })
}

/// The lowest token the mask allows other than `eos` (a word at a time).
fn lowest_allowed_but(mask: &[u32], eos: u32) -> Option<u32> {
    mask.iter().enumerate().find_map(|(w, &word)| {
        let word = if eos / 32 == w as u32 {
            word & !(1 << (eos % 32))
        } else {
            word
        };
        (word != 0).then(|| w as u32 * 32 + word.trailing_zeros())
    })
}

criterion_group!(benches, stop_strings, token_logprobs, json_schema_masks);
criterion_main!(benches);
