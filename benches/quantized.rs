//! One routed expert's product in GGML blocks at DeepSeek-V2-Lite's shapes, as candle-core
//! multiplies the stored blocks and as deepinfer holds them (`host::BlockMatrix`): what a
//! quantized GGUF's MoE layer spends a decode step on.
//!
//! - `down_1408/{q5_0,q8_0}`: an expert's down-projection, `[2048, 1408]`. Its rows are not
//!   whole 256-blocks, so llama.cpp's `Q4_K_M` stores it in `Q5_0` (or `Q8_0` where it would
//!   pick `Q6_K`), and a `Q8_0` GGUF in `Q8_0`. `candle_stored` is candle's own `QTensor` of
//!   those blocks; `deepinfer_held` the matrix as deepinfer holds it (`Q5_0` as `Q8_0`, rows
//!   padded to 1,536 where candle tiles `Q8_0`: `host::quantized::held`).
//! - `gate_2048/q4_k`: a gate or up projection, `[1408, 2048]` in `Q4_K`, which both multiply
//!   from candle's tiles: the reference for what a 256-aligned matrix costs.
//!
//! Each for 1 row (batch-1 decode: one token routed to the expert) and 8 rows. Every iteration
//! takes the next of 64 experts (about 0.2 GB of blocks in each form), so the weights come
//! from memory as in a decode step, not from cache. The weights are seeded random values
//! quantized by candle.
//!
//! Run with `cargo bench --bench quantized`.

use std::hint::black_box;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use deepinfer::host::QuantizedWeight;

#[path = "common/rng.rs"]
mod rng;

/// Experts cycled through, as many as V2-Lite has a layer.
const EXPERTS: usize = 64;

/// `EXPERTS` seeded `[out, k]` matrices of standard deviation ~0.02, stacked.
fn experts(out: usize, k: usize) -> Tensor {
    let mut rng = rng::Rng::new(45);
    let values: Vec<f32> = (0..EXPERTS * out * k)
        .map(|_| (unit(&mut rng) - 0.5) * 0.07)
        .collect();
    Tensor::from_vec(values, (EXPERTS, out, k), &Device::Cpu).expect("stacked experts")
}

/// Uniform in `[0, 1)`.
fn unit(rng: &mut rng::Rng) -> f32 {
    rng.below(1 << 24) as f32 / (1u32 << 24) as f32
}

fn products(c: &mut Criterion) {
    let cases = [
        ("down_1408", "q5_0", GgmlDType::Q5_0, 2048, 1408),
        ("down_1408", "q8_0", GgmlDType::Q8_0, 2048, 1408),
        ("gate_2048", "q4_k", GgmlDType::Q4K, 1408, 2048),
    ];
    for (matrix, name, format, out, k) in cases {
        let w = experts(out, k);
        let stored: Vec<QMatMul> = (0..EXPERTS)
            .map(|e| {
                let q = QTensor::quantize(&w.get(e).expect("expert"), format).expect("quantize");
                QMatMul::from_qtensor(q).expect("candle's matrix")
            })
            .collect();
        let held = QuantizedWeight::quantize(&w, format).expect("held experts");
        drop(w);
        let mut group = c.benchmark_group(format!("{matrix}/{name}"));
        for rows in [1usize, 8] {
            let mut rng = rng::Rng::new(7);
            let x: Vec<f32> = (0..rows * k).map(|_| unit(&mut rng) - 0.5).collect();
            let x = Tensor::from_vec(x, (rows, k), &Device::Cpu).expect("activations");
            let mut e = 0;
            group.bench_function(format!("candle_stored/rows_{rows}"), |b| {
                b.iter(|| {
                    e = (e + 1) % EXPERTS;
                    black_box(stored[e].forward(&x).expect("candle's product"))
                })
            });
            group.bench_function(format!("deepinfer_held/rows_{rows}"), |b| {
                b.iter(|| {
                    e = (e + 1) % EXPERTS;
                    black_box(held.matrices()[e].matmul(&x).expect("deepinfer's product"))
                })
            });
        }
        group.finish();
    }
}

criterion_group!(
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = products
);
criterion_main!(benches);
