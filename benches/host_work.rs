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
//! Run with `cargo bench --bench host_work`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepinfer::engine::detokenize::StopStrings;
use deepinfer::engine::TokenLogprobs;

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

criterion_group!(benches, stop_strings, token_logprobs);
criterion_main!(benches);
