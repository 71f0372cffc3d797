//! A sequence's logits do not depend on what else runs in its step: how many other rows there
//! are, what they hold, or how long the longest of them is. The server relies on it (a stream
//! must not change because another request joined, or because its client paused and it resumed
//! in other company), and the CPU runner runs each step at its own batch size and context
//! rather than a bucket's, so every batch size and many contexts are exercised here. Bit for bit:
//! "close" would still let a sampled stream diverge.

mod common;

use common::{decode_staggered_steps, runner_in};
use deepinfer::graph::DType;
use deepinfer::model::Precision;

/// Decodes the same tokens as one sequence alone, then as each row of batches of several sizes
/// (row `i` starting `i` steps late, so the rows sit at different positions, the batch grows and
/// shrinks, and the context is set by the longest row), and asserts every row's logits at each
/// position are the bits of the lone sequence's.
fn logits_do_not_depend_on_the_batch(name: &str, precision: Precision) {
    let mut one = runner_in(name, 1, None, precision);
    let vocab = one.config().vocab_size as u32;
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 977 + 13) % vocab).collect();
    let alone: Vec<Vec<f32>> = decode_staggered_steps(&mut *one, &ids, 1)
        .into_iter()
        .map(|mut s| s.logits.remove(0))
        .collect();
    for row in &alone {
        assert!(
            row.iter().all(|v| v.is_finite()),
            "{name}: a logit is not finite"
        );
    }
    for rows in [2, 3, 5, 8, 9, 13, 17] {
        let mut run = runner_in(name, rows, None, precision);
        for (step, s) in decode_staggered_steps(&mut *run, &ids, rows)
            .iter()
            .enumerate()
        {
            for (r, (got, &pos)) in s.logits.iter().zip(&s.positions).enumerate() {
                let differ = got
                    .iter()
                    .zip(&alone[pos])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differ,
                    0,
                    "{name}: {rows} rows, step {step}: the row at position {pos} (batch index \
                     {r} of {}) differs from the sequence alone in {differ} logits",
                    s.logits.len()
                );
            }
        }
    }
}

#[test]
fn f32_logits_do_not_depend_on_the_batch() {
    logits_do_not_depend_on_the_batch("tiny-v3", Precision::F32);
}

#[test]
fn the_default_models_logits_do_not_depend_on_the_batch() {
    logits_do_not_depend_on_the_batch("default-model", Precision::all(DType::BF16));
}
