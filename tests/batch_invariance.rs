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
    // 65 rows: past the 64 from which the CPU matmul once switched to another kernel.
    for rows in [2, 3, 5, 8, 9, 13, 17, 65] {
        let mut run = runner_in(name, rows, None, precision);
        for (step, s) in decode_staggered_steps(&mut *run, &ids, rows)
            .iter()
            .enumerate()
        {
            // `decode_staggered_steps` checked one row of logits per position.
            for (r, (got, &pos)) in s.logits.iter().zip(&s.positions).enumerate() {
                assert_eq!(
                    got.len(),
                    alone[pos].len(),
                    "{name}: {rows} rows, step {step}: logits of the row at position {pos}"
                );
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

/// A prompt's last logits do not depend on the prompts packed with it in one prefill step.
///
/// Alone, a short prompt runs in the 16-token prefill bucket; packed, in the 64-token one, and
/// every other prompt's tokens, context positions and expert choices sit in the same matmuls
/// and reductions. Until 2026-12-03 the CPU matmul handed operands of 64 rows or more to
/// candle's GEMM, which sums in another order: 492 of 512 tiny-v3 logits differed for the
/// first packing, and identical server requests prefilled in different company drifted apart
/// after a few hundred sampled tokens.
fn packed_prefill_does_not_change_a_prompt(name: &str, precision: Precision) {
    use deepinfer::model::LogitsOutput;
    use deepinfer::runner::step::{LogitControls, PrefillChunk, SamplingParams};
    use deepinfer::runner::Step;
    // Contexts up to 1,024 tokens: the short ones pack up to eight prompts.
    let mut run = common::runner_sized(name, 8, 1024, None, precision);
    let vocab = run.config().vocab_size as u32;
    let mut blocks = common::allocator(&*run);
    let prompts: Vec<Vec<u32>> = [11usize, 7, 16, 3, 9]
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            (0..n as u32)
                .map(|i| (i * 977 + 13 + p as u32 * 31) % vocab)
                .collect()
        })
        .collect();
    let mut last = |which: &[usize], blocks: &mut deepinfer::engine::BlockAllocator| {
        let tables: Vec<Vec<u32>> = which
            .iter()
            .map(|&p| {
                let mut t = Vec::new();
                blocks.grow(&mut t, prompts[p].len()).unwrap();
                t
            })
            .collect();
        let chunks: Vec<PrefillChunk> = which
            .iter()
            .zip(&tables)
            .map(|(&p, t)| PrefillChunk {
                tokens: &prompts[p],
                start: 0,
                blocks: t,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            })
            .collect();
        let out = run
            .replay(&Step::Prefill {
                chunks: &chunks,
                logits: LogitsOutput::Sampled,
            })
            .unwrap();
        for mut t in tables {
            blocks.release(&mut t);
        }
        out.logits.unwrap()
    };
    let alone: Vec<Vec<f32>> = (0..prompts.len())
        .map(|p| last(&[p], &mut blocks).remove(0))
        .collect();
    // Equal bits would let NaN logits alone and packed pass.
    for (p, row) in alone.iter().enumerate() {
        assert!(
            row.iter().all(|v| v.is_finite()),
            "{name}: prompt {p} alone: a logit is not finite"
        );
    }
    for packing in [vec![0, 1], vec![1, 0, 2], vec![3, 4, 0, 1, 2], vec![2, 0]] {
        let got = last(&packing, &mut blocks);
        assert_eq!(
            got.len(),
            packing.len(),
            "{name}: rows of logits for the prompts packed as {packing:?}"
        );
        for (row, &p) in got.iter().zip(&packing) {
            assert_eq!(
                row.len(),
                alone[p].len(),
                "{name}: logits of prompt {p} packed as {packing:?}"
            );
            let differ = row
                .iter()
                .zip(&alone[p])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "{name}: prompt {p} packed as {packing:?}: {differ} logits differ"
            );
        }
    }
}

#[test]
fn f32_packed_prefill_does_not_change_a_prompt() {
    packed_prefill_does_not_change_a_prompt("tiny-v3", Precision::F32);
}

#[test]
fn the_default_models_packed_prefill_does_not_change_a_prompt() {
    packed_prefill_does_not_change_a_prompt("default-model", Precision::all(DType::BF16));
}
