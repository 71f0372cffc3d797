//! Lowering round trip: for every graph of every fixture, emit -> import -> CPU backend gives
//! bit-identical outputs to the original graph on the same inputs; and bad bytes are errors.

mod common;

use candle_core::{Device, Tensor};
use common::{fixture_dir, reference, FIXTURES};
use deepinfer::backend::{cpu, hlo};
use deepinfer::export::{lower, LowerOptions};

#[test]
fn emit_import_run_is_bit_identical_for_every_fixture_graph() {
    for name in FIXTURES {
        let out =
            std::env::temp_dir().join(format!("deepinfer-roundtrip-{}-{name}", std::process::id()));
        let opts = LowerOptions {
            batch_sizes: vec![1, 2, 4, 8],
            ctx: 64,
            inputs_from_token_ids: Some(reference(name).token_ids),
        };
        let manifest = lower(&fixture_dir(name), &out, &opts).unwrap();
        assert_eq!(manifest.graphs.len(), 5);
        for g in &manifest.graphs {
            let bytes = std::fs::read(out.join(&g.hlo)).unwrap();
            let imported = hlo::import::import_bytes(&bytes).unwrap();
            let inputs =
                candle_core::safetensors::load(out.join(g.inputs.as_ref().unwrap()), &Device::Cpu)
                    .unwrap();
            let want = candle_core::safetensors::load(
                out.join(g.cpu_outputs.as_ref().unwrap()),
                &Device::Cpu,
            )
            .unwrap();
            let args: Vec<Tensor> = imported
                .inputs()
                .iter()
                .map(|d| inputs[&d.name].clone())
                .collect();
            let got = cpu::run(&imported, &args).unwrap();
            assert_eq!(imported.outputs().len(), want.len(), "{}", g.name);
            for (decl, t) in imported.outputs().iter().zip(&got) {
                let w = &want[&decl.name];
                let (a, b) = (
                    t.flatten_all()
                        .unwrap()
                        .to_dtype(candle_core::DType::F64)
                        .unwrap(),
                    w.flatten_all()
                        .unwrap()
                        .to_dtype(candle_core::DType::F64)
                        .unwrap(),
                );
                let diff: f64 = (a - b)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar()
                    .unwrap();
                assert_eq!(
                    diff, 0.0,
                    "{} output {} differs after the round trip",
                    g.name, decl.name
                );
            }
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn corrupt_or_foreign_modules_are_errors_not_panics() {
    assert!(hlo::import::import_bytes(b"definitely not a protobuf \xff\xff\xff").is_err());
    assert!(
        hlo::import::import_bytes(&[]).is_err(),
        "an empty module has no entry computation"
    );
    let out =
        std::env::temp_dir().join(format!("deepinfer-roundtrip-trunc-{}", std::process::id()));
    let opts = LowerOptions {
        batch_sizes: vec![1],
        ctx: 64,
        inputs_from_token_ids: None,
    };
    let manifest = lower(&fixture_dir("tiny-v3"), &out, &opts).unwrap();
    let bytes = std::fs::read(out.join(&manifest.graphs[1].hlo)).unwrap();
    for cut in [bytes.len() / 3, bytes.len() / 2, bytes.len() - 7] {
        assert!(
            hlo::import::import_bytes(&bytes[..cut]).is_err(),
            "truncated at {cut}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn emitting_the_same_graph_twice_gives_the_same_bytes() {
    // The NEFF cache is keyed by these bytes: any nondeterminism (map order, ids) would make
    // every run a cache miss and a recompile.
    let out = std::env::temp_dir().join(format!("deepinfer-roundtrip-det-{}", std::process::id()));
    let opts = LowerOptions {
        batch_sizes: vec![2],
        ctx: 64,
        inputs_from_token_ids: None,
    };
    let first = lower(&fixture_dir("tiny-v3"), &out.join("a"), &opts).unwrap();
    lower(&fixture_dir("tiny-v3"), &out.join("b"), &opts).unwrap();
    for g in &first.graphs {
        let a = std::fs::read(out.join("a").join(&g.hlo)).unwrap();
        let b = std::fs::read(out.join("b").join(&g.hlo)).unwrap();
        assert!(a == b, "{} differs between two emissions", g.name);
    }
    let _ = std::fs::remove_dir_all(&out);
}
