//! Lowering round trip: for every graph of every fixture, emit -> import -> CPU backend gives
//! bit-identical outputs to the original graph on the same inputs; every op of the op tables
//! comes back as itself; and bad bytes are errors.

mod common;

use candle_core::{Device, Tensor};
use common::{fixture_dir, max_abs_diff_f64, reference, FIXTURES};
use deepinfer::backend::{cpu, hlo};
use deepinfer::export::{lower, LowerOptions};
use deepinfer::graph::{
    BinaryOp, CmpOp, DType, GraphBuilder, InputRole, Op, ReduceOp, Tensor as GTensor, UnaryOp,
};
use deepinfer::model::{DTypeChoice, Dots, PrecisionChoice, Quantize};
use prost::Message;
use std::collections::{HashMap, HashSet};

#[test]
fn emit_import_run_is_bit_identical_for_every_fixture_graph() {
    // f32, and bf16 weights and cache (bf16 literals, converts, f32-result dots).
    let dtypes = [DType::F32, DType::BF16].map(DTypeChoice::Exactly);
    for (name, dtype) in FIXTURES.iter().flat_map(|n| dtypes.map(|d| (*n, d))) {
        let out = std::env::temp_dir().join(format!(
            "deepinfer-roundtrip-{}-{name}-{dtype}",
            std::process::id()
        ));
        let opts = LowerOptions {
            batch_sizes: vec![1, 2, 4, 8],
            ctx: 64,
            inputs_from_token_ids: Some(reference(name).token_ids),
            precision: PrecisionChoice {
                dtype,
                ..Default::default()
            },
            dots: Dots::DEVICE,
            split_sampler: false,
            speculative: false,
        };
        let manifest = lower(&fixture_dir(name), &out, &opts).unwrap();
        // Prefill, packed prefill of two sequences, four decode batches.
        assert_eq!(manifest.graphs.len(), 6);
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
            assert_eq!(
                got.len(),
                imported.outputs().len(),
                "{}: outputs computed vs declared",
                g.name
            );
            for (decl, t) in imported.outputs().iter().zip(&got) {
                let w = &want[&decl.name];
                assert_eq!(t.dims(), w.dims(), "{} output {}", g.name, decl.name);
                let values = |t: &Tensor| {
                    t.flatten_all()
                        .unwrap()
                        .to_dtype(candle_core::DType::F64)
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap()
                };
                // Fails on a NaN or an infinity on either side, which candle's `max` of the
                // differences skipped unless it came first.
                let diff = max_abs_diff_f64(&values(t), &values(w));
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

/// Every weight is used as `[out, in]` by a `dot` contracting its last dim: no graph of any
/// fixture, in f32, bf16 or with int8 experts, transposes the right operand of a `dot` (where
/// weights and cached keys go), and no transpose is left dead in the module either.
#[test]
fn no_graph_transposes_an_operand_of_a_dot() {
    let precisions = [
        PrecisionChoice::default(),
        PrecisionChoice {
            dtype: DTypeChoice::Exactly(DType::BF16),
            ..Default::default()
        },
        PrecisionChoice {
            dtype: DTypeChoice::Exactly(DType::F32),
            quantize: Quantize::ExpertsInt8,
            ..Default::default()
        },
        PrecisionChoice {
            dtype: DTypeChoice::Exactly(DType::F32),
            quantize: Quantize::ExpertsInt4,
            ..Default::default()
        },
    ];
    let mut dots = 0;
    for (k, precision) in precisions.into_iter().enumerate() {
        for name in FIXTURES {
            let out = std::env::temp_dir().join(format!(
                "deepinfer-transposes-{}-{name}-{k}",
                std::process::id()
            ));
            let opts = LowerOptions {
                batch_sizes: vec![1, 4],
                ctx: 64,
                inputs_from_token_ids: None,
                precision,
                dots: Dots::DEVICE,
                split_sampler: false,
                speculative: false,
            };
            let manifest = lower(&fixture_dir(name), &out, &opts).unwrap();
            for g in &manifest.graphs {
                let bytes = std::fs::read(out.join(&g.hlo)).unwrap();
                let module = hlo::proto::HloModuleProto::decode(bytes.as_slice()).unwrap();
                let entry = module.computations.last().unwrap();
                let by_id: HashMap<i64, &hlo::proto::HloInstructionProto> =
                    entry.instructions.iter().map(|i| (i.id, i)).collect();
                let used: HashSet<i64> = entry
                    .instructions
                    .iter()
                    .flat_map(|i| i.operand_ids.iter().copied())
                    .chain([entry.root_id])
                    .collect();
                for i in &entry.instructions {
                    if i.opcode == "transpose" {
                        assert!(used.contains(&i.id), "{}: dead {}", g.name, i.name);
                    }
                    if i.opcode != "dot" {
                        continue;
                    }
                    dots += 1;
                    // The right operand: where weights (and cached keys) go.
                    let mut x = by_id[&i.operand_ids[1]];
                    while x.opcode == "convert" {
                        x = by_id[&x.operand_ids[0]];
                    }
                    assert_ne!(
                        x.opcode, "transpose",
                        "{} ({name}, precision {k}): {} reads {}",
                        g.name, i.name, x.name
                    );
                }
            }
            let _ = std::fs::remove_dir_all(&out);
        }
    }
    assert!(dots > 100, "only {dots} dots seen");
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
        precision: PrecisionChoice::default(),
        dots: Dots::DEVICE,
        split_sampler: false,
        speculative: false,
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
        precision: PrecisionChoice::default(),
        dots: Dots::DEVICE,
        split_sampler: false,
        speculative: false,
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

/// Builds a one-op graph over two `[2, 3]` inputs of `dtype`, emits it, imports it, and checks
/// that the imported graph computes its output with `want` (the same op, read back through the
/// op table) and that both graphs give identical values on the CPU.
fn round_trip_one_op(
    label: &str,
    dtype: DType,
    build: impl Fn(&GTensor, &GTensor) -> GTensor,
    want: impl Fn(&Op) -> bool,
) {
    let b = GraphBuilder::new(label);
    let x = b.input("x", InputRole::Metadata, [2, 3], dtype).unwrap();
    let y = b.input("y", InputRole::Metadata, [2, 3], dtype).unwrap();
    b.output("out", &build(&x, &y)).unwrap();
    let g = b.finish().unwrap();
    let imported = hlo::import::import(&hlo::emit::emit(&g).unwrap()).unwrap();
    let op = &imported.node(imported.outputs()[0].node).op;
    assert!(want(op), "{label} imported as {op:?}");

    let dev = &Device::Cpu;
    let (xs, ys) = match dtype {
        DType::F32 => (
            Tensor::new(&[[0.5f32, -1.25, 2.0], [0.1, 3.0, -0.7]], dev).unwrap(),
            Tensor::new(&[[1.5f32, -1.25, 0.3], [2.0, -4.0, 0.9]], dev).unwrap(),
        ),
        _ => (
            Tensor::new(&[[7i32, -9, 12], [1, 100, -3]], dev).unwrap(),
            Tensor::new(&[[2i32, 3, 12], [5, 4, 1]], dev).unwrap(),
        ),
    };
    let args = [xs, ys];
    let before = cpu::run(&g, &args).unwrap();
    let after = cpu::run(&imported, &args).unwrap();
    let bits = |t: &Tensor| -> Vec<u8> {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            candle_core::DType::F32 => t
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
            candle_core::DType::U8 => t.to_vec1::<u8>().unwrap(),
            _ => t
                .to_dtype(candle_core::DType::I64)
                .unwrap()
                .to_vec1::<i64>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        }
    };
    assert_eq!(bits(&before[0]), bits(&after[0]), "{label} values differ");
}

#[test]
fn every_op_of_every_table_lowers_and_imports_back_to_itself() {
    // Each family's op table is read forwards by the emitter and backwards by the importer: an
    // opcode written for two ops, or an op whose lowering the importer does not recognise,
    // comes back as another op (or an error) here.
    for &u in UnaryOp::ALL {
        round_trip_one_op(
            u.name(),
            DType::F32,
            |x, _| x.unary(u).unwrap(),
            |op| matches!(op, Op::Unary(got, _) if *got == u),
        );
    }
    for &bop in BinaryOp::ALL {
        let dtype = if bop.int_only() {
            DType::I32
        } else {
            DType::F32
        };
        round_trip_one_op(
            bop.name(),
            dtype,
            |x, y| x.binary(bop, y).unwrap(),
            |op| matches!(op, Op::Binary(got, _, _) if *got == bop),
        );
    }
    for &c in CmpOp::ALL {
        round_trip_one_op(
            c.name(),
            DType::F32,
            |x, y| x.compare(c, y).unwrap(),
            |op| matches!(op, Op::Compare(got, _, _) if *got == c),
        );
    }
    for &r in ReduceOp::ALL {
        for dtype in [DType::F32, DType::I32] {
            round_trip_one_op(
                r.name(),
                dtype,
                |x, _| x.reduce(r, 1).unwrap(),
                |op| matches!(op, Op::Reduce(got, _, 1) if *got == r),
            );
        }
    }
}
