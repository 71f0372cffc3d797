//! Building and emitting the DeepSeek-V2-Lite decode graph at batch 64 (context 1024): the host
//! cost of capturing one bucket, from config.json alone (no weights). Target: under 1 s.
//!
//! Run with `cargo bench --bench lowering`.

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use deepinfer::backend::hlo::emit;
use deepinfer::config::ModelConfig;
use deepinfer::graph::DType;
use deepinfer::model::{
    self, CacheLayout, GraphSpec, LogitsOutput, MoeStrategy, Precision, Sampler, WeightSpecs,
};

fn lower_v2_lite(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/deepseek-v2-lite.json");
    let cfg = ModelConfig::from_file(&path).expect("config");
    let specs = WeightSpecs::new(&cfg, &Precision::all(DType::BF16));
    let layout = CacheLayout {
        dtype: DType::BF16,
        block_size: 16,
        num_slots: 64 * 1024 + 16,
        state_rows: 65,
    };
    let spec = GraphSpec {
        rows: 64,
        seqs: 1,
        ctx: 1024,
        logits: LogitsOutput::None,
        moe: MoeStrategy::Dense,
        sampler: Sampler::Full,
    };
    c.bench_function("build_and_emit_v2_lite_decode_b64", |b| {
        b.iter(|| {
            let g = model::build_decode(&cfg, &specs, &layout, &spec).expect("build");
            emit::to_bytes(&emit::emit(&g).expect("emit"))
        })
    });
}

criterion_group!(benches, lower_v2_lite);
criterion_main!(benches);
