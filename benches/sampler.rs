//! The in-graph sampler's cost on the CPU backend at DeepSeek-V2/V3's vocabulary size
//! (102,400), batch 1 and 8: a step's whole sampler (argmax, temperature, top-k, top-p and the
//! inverse-CDF draw, each filter a sort-free mass threshold) with every row sampling under
//! `top_k = 50, top_p = 0.9`, with the filters off, and with every row greedy, beside the
//! floor a sampler cannot go under: one vocabulary-wide argmax alone. The ratios to that floor
//! are what to read; the machine's load moves all four together.
//!
//! Run with `cargo bench --bench sampler`.

use candle_core::{Device, Tensor as CTensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use deepinfer::backend::cpu;
use deepinfer::graph::{DType, Graph, GraphBuilder, InputRole};
use deepinfer::model::sampling::{self, SamplingInputs};
use deepinfer::model::vocab::VocabSlice;

const VOCAB: usize = 102_400;

/// The sampler over `[rows, VOCAB]` logits, or an argmax alone.
fn graph(rows: usize, argmax_only: bool) -> Graph {
    let b = GraphBuilder::new("sampler");
    let input = |name: &str, shape: Vec<usize>, dtype| {
        b.input(name, InputRole::Metadata, shape, dtype)
            .expect("input")
    };
    let logits = input("logits", vec![rows, VOCAB], DType::F32);
    let next = if argmax_only {
        logits.argmax(1).expect("argmax")
    } else {
        let p = SamplingInputs {
            temperature: &input("temperature", vec![rows], DType::F32),
            top_k: &input("top_k", vec![rows], DType::I32),
            top_p: &input("top_p", vec![rows], DType::F32),
            min_p: &input("min_p", vec![rows], DType::F32),
            seeds: &input("seeds", vec![rows], DType::U32),
            positions: &input("positions", vec![rows], DType::I32),
        };
        sampling::sample(&logits, &p, &VocabSlice::Whole).expect("sampler")
    };
    b.output("next", &next).expect("output");
    b.finish().expect("graph")
}

fn sampler(c: &mut Criterion) {
    // As the binary does (see its docs).
    deepinfer::backend::cpu::pin_thread_count();
    let dev = &Device::Cpu;
    let mut group = c.benchmark_group("cpu_sampler_vocab_102400");
    group.sample_size(20);
    for rows in [1usize, 8] {
        let logits: Vec<f32> = (0..rows * VOCAB)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 12) as f32 / 65_536.0 - 8.0)
            .collect();
        let logits = CTensor::from_vec(logits, (rows, VOCAB), dev).expect("logits");
        let vec_f32 = |v: f32| CTensor::from_vec(vec![v; rows], rows, dev).expect("tensor");
        let vec_i32 = |v: i32| CTensor::from_vec(vec![v; rows], rows, dev).expect("tensor");
        let seeds =
            CTensor::from_vec((0..rows as u32).collect::<Vec<_>>(), rows, dev).expect("seeds");
        let args = |temperature: f32, top_k: i32, top_p: f32| {
            vec![
                logits.clone(),
                vec_f32(temperature),
                vec_i32(top_k),
                vec_f32(top_p),
                seeds.clone(),
                vec_i32(17),
            ]
        };
        let full = graph(rows, false);
        for (tag, a) in [
            ("top_k50_top_p0.9", args(0.8, 50, 0.9)),
            ("unfiltered", args(0.8, 0, 1.0)),
            ("greedy", args(0.0, 0, 1.0)),
        ] {
            group.bench_with_input(BenchmarkId::new(tag, rows), &a, |bch, a| {
                bch.iter(|| cpu::run(&full, a).expect("run"))
            });
        }
        let floor = graph(rows, true);
        let a = vec![logits.clone()];
        group.bench_with_input(BenchmarkId::new("argmax_only", rows), &a, |bch, a| {
            bch.iter(|| cpu::run(&floor, a).expect("run"))
        });
    }
    group.finish();
}

criterion_group!(benches, sampler);
criterion_main!(benches);
