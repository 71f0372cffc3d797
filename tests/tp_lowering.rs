//! `lower --tp N`: one HLO module per graph whose collectives span the replica group {0..N},
//! that imports back to the same collectives; per-rank inputs that, run by every rank of the
//! imported graph on the CPU, give the outputs file bit for bit (each rank its slice of the
//! logits' columns); and a degree that does not fit the model refused in one line before
//! anything is written.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use candle_core::{Device, Tensor};
use common::{fixture_dir, reference, FIXTURES};
use deepinfer::backend::cpu::{self, Group, DEFAULT_COLLECTIVE_TIMEOUT};
use deepinfer::backend::hlo;
use deepinfer::export::{lower_sharded, LowerOptions};
use deepinfer::graph::{Graph, Op};
use deepinfer::model::{Dots, PrecisionChoice};
use prost::Message;

fn temp(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("deepinfer-tp-{}-{tag}", std::process::id()))
}

/// (all-reduces, all-gathers) of a graph, each checked to span `ranks` ranks.
fn collectives(g: &Graph, ranks: usize) -> (usize, usize) {
    let (mut reduces, mut gathers) = (0, 0);
    for n in g.nodes() {
        match n.op {
            Op::AllReduce { ranks: r, .. } => {
                assert_eq!(r, ranks, "{}", g.name());
                reduces += 1;
            }
            Op::AllGather { ranks: r, .. } => {
                assert_eq!(r, ranks, "{}", g.name());
                gathers += 1;
            }
            _ => {}
        }
    }
    (reduces, gathers)
}

#[test]
fn tp_modules_name_the_replica_group_and_import_to_the_same_collectives() {
    for ranks in [2, 4] {
        let out = temp(&format!("ops-{ranks}"));
        let opts = LowerOptions {
            batch_sizes: vec![1, 4],
            ctx: 64,
            inputs_from_token_ids: None,
            precision: PrecisionChoice::default(),
            dots: Dots::DEVICE,
            split_sampler: false,
            speculative: false,
        };
        let manifest = lower_sharded(&fixture_dir("tiny-v3"), &out, &opts, ranks).unwrap();
        assert_eq!(manifest.tp, ranks);
        let group: Vec<i64> = (0..ranks as i64).collect();
        for g in &manifest.graphs {
            let bytes = std::fs::read(out.join(&g.hlo)).unwrap();
            let module = hlo::proto::HloModuleProto::decode(bytes.as_slice()).unwrap();
            let (mut reduces, mut gathers) = (0, 0);
            for i in module.computations.iter().flat_map(|c| &c.instructions) {
                if i.opcode != "all-reduce" && i.opcode != "all-gather" {
                    continue;
                }
                let groups: Vec<Vec<i64>> = i
                    .replica_groups
                    .iter()
                    .map(|r| r.replica_ids.clone())
                    .collect();
                assert_eq!(groups, vec![group.clone()], "{}: {}", g.name, i.name);
                assert_eq!(i.channel_id, 0, "{}: cross-replica, no channel", i.name);
                match i.opcode.as_str() {
                    "all-reduce" => reduces += 1,
                    _ => gathers += 1,
                }
            }
            // Per layer: attention's o_proj and the MLP's down projection; plus the embedding.
            assert!(reduces >= 3, "{}: {reduces} all-reduces", g.name);
            assert!(gathers >= 1, "{}: no all-gather of the logits", g.name);
            let imported = hlo::import::import_bytes(&bytes).unwrap();
            assert_eq!(imported.ranks(), ranks, "{}", g.name);
            assert_eq!(
                collectives(&imported, ranks),
                (reduces, gathers),
                "{}: the importer reads back the emitted collectives",
                g.name
            );
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn tp_inputs_per_rank_reproduce_the_outputs_through_emit_and_import() {
    for name in FIXTURES {
        let ranks = 2;
        let out = temp(&format!("run-{name}"));
        let opts = LowerOptions {
            batch_sizes: vec![1],
            ctx: 64,
            inputs_from_token_ids: Some(reference(name).token_ids),
            precision: PrecisionChoice::default(),
            dots: Dots::DEVICE,
            split_sampler: false,
            speculative: false,
        };
        let manifest = lower_sharded(&fixture_dir(name), &out, &opts, ranks).unwrap();
        assert_eq!(
            manifest.graphs.len(),
            3,
            "prefill, packed prefill and decode b1"
        );
        for g in &manifest.graphs {
            assert!(g.inputs.is_none(), "{}: no unsharded inputs file", g.name);
            let files: Vec<String> = (0..ranks)
                .map(|r| format!("{}.rank{r}.inputs.safetensors", g.name))
                .collect();
            assert_eq!(g.rank_inputs, files, "{}", g.name);
            let imported =
                hlo::import::import_bytes(&std::fs::read(out.join(&g.hlo)).unwrap()).unwrap();
            let rank_inputs: Vec<HashMap<String, Tensor>> = files
                .iter()
                .map(|f| candle_core::safetensors::load(out.join(f), &Device::Cpu).unwrap())
                .collect();
            // The ranks differ in their shards and offsets, and hold the same cache.
            let offsets = |r: usize| rank_inputs[r]["tp.shard_offsets"].to_vec1::<i32>().unwrap();
            assert_ne!(offsets(0), offsets(1), "{}", g.name);
            let args: Vec<Vec<Tensor>> = rank_inputs
                .iter()
                .map(|inputs| {
                    imported
                        .inputs()
                        .iter()
                        .map(|d| inputs[&d.name].copy().unwrap())
                        .collect()
                })
                .collect();
            let group = Group::new(ranks, DEFAULT_COLLECTIVE_TIMEOUT);
            let got = cpu::run_group(&imported, &args, &group, 0).unwrap();
            let want = candle_core::safetensors::load(
                out.join(g.cpu_outputs.as_ref().unwrap()),
                &Device::Cpu,
            )
            .unwrap();
            assert_eq!(got.len(), ranks, "{}: ranks that returned outputs", g.name);
            for (r, outs) in got.iter().enumerate() {
                assert_eq!(
                    outs.len(),
                    imported.outputs().len(),
                    "{} rank {r}: outputs computed vs declared",
                    g.name
                );
                for (decl, t) in imported.outputs().iter().zip(outs) {
                    // Each rank's logits are its slice of the whole rows' columns.
                    let w = &match decl.name.as_str() {
                        "logits" => {
                            let width = t.dim(1).unwrap();
                            want[&decl.name].narrow(1, r * width, width).unwrap()
                        }
                        _ => want[&decl.name].clone(),
                    };
                    let same = t
                        .flatten_all()
                        .unwrap()
                        .to_dtype(candle_core::DType::F64)
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap()
                        == w.flatten_all()
                            .unwrap()
                            .to_dtype(candle_core::DType::F64)
                            .unwrap()
                            .to_vec1::<f64>()
                            .unwrap();
                    assert!(same, "{} rank {r}: output {} differs", g.name, decl.name);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn lower_with_a_tp_that_does_not_fit_fails_in_one_line_before_writing() {
    for (tp, needle) in [
        ("3", "--tp 3: the tensor-parallel degree must be one of"),
        // tiny-v3 has 4 attention heads.
        (
            "8",
            "--tp 8 does not divide the model's num_attention_heads (4)",
        ),
    ] {
        let out = temp(&format!("bad-{tp}"));
        let model = fixture_dir("tiny-v3");
        let run = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .args(["lower", "--model"])
            .arg(&model)
            .arg("--out")
            .arg(&out)
            .args(["--tp", tp, "--inputs-from-token-ids", "1,2,3"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "--tp {tp} accepted: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(err.contains(needle), "`{needle}` not in: {err}");
        assert!(!out.exists(), "--tp {tp}: {} was created", out.display());
        let check = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .args(["lower", "--check", "neuron", "--model"])
            .arg(&model)
            .args(["--tp", tp])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&check.stderr);
        assert!(!check.status.success(), "--check --tp {tp} accepted: {err}");
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
}
