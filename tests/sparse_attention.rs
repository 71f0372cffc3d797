//! DeepSeek-V3.2's sparse attention on the CPU backend against transformers'
//! `DeepseekV32ForCausalLM` (`fixtures/tiny-v32`, `index_topk` 6 over 16- and 32-token
//! references): the selection really changes the output (the reference with every key selected
//! differs, and our model reproduces that one too when `index_topk` is raised), decode at batch
//! 1, 2, 4 and 8 in several context buckets (the gathered path, and the bucket no wider than
//! `index_topk` where every visible token is attended), and broken V3.2 checkpoints named.

mod common;

use std::path::Path;

use common::{fixture_dir, max_abs_diff_rows, reference_file};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Buckets, RunnerConfig};
use deepinfer::engine;
use deepinfer::model::{ModelWeights, Precision};
use deepinfer::runner::{self, Backend, Runner};
use deepinfer::weights::Checkpoint;
use serde::Deserialize;

const NAME: &str = "tiny-v32";
const TOL: f32 = 1e-4;

#[derive(Deserialize)]
struct SparseReference {
    token_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    logits_dense_attention: Vec<Vec<f32>>,
}

/// A copy of the fixture's directory whose config.json has `index_topk` set; removed on drop.
fn with_index_topk(topk: usize) -> tempfile::TempDir {
    let src = fixture_dir(NAME);
    let tmp = tempfile::Builder::new()
        .prefix("deepinfer-v32-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["index_topk"] = topk.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    tmp
}

fn open(dir: &Path, rc: RunnerConfig) -> Box<dyn Runner> {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights =
        ModelWeights::load(&cfg, &Checkpoint::open(dir).unwrap(), &Precision::F32).unwrap();
    runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap()
}

/// Batches up to `max_batch` over exactly the context buckets `ctx`.
fn config(max_batch: usize, ctx: &[usize]) -> RunnerConfig {
    let mut rc = RunnerConfig::for_limits(max_batch, 64);
    rc.buckets = Buckets {
        ctx: ctx.to_vec(),
        ..rc.buckets
    };
    rc
}

#[test]
fn the_selection_matters_and_raising_index_topk_gives_dense_attention() {
    let r: SparseReference = reference_file(NAME, "reference.json");
    // The fixture is really sparse: transformers' own dense logits differ.
    let effect = max_abs_diff_rows(&r.logits, &r.logits_dense_attention);
    assert!(effect > 1e-2, "{effect}");
    let sparse = engine::score(
        &mut open(&fixture_dir(NAME), config(1, &[16, 64])),
        &r.token_ids,
    )
    .unwrap();
    assert!(max_abs_diff_rows(&sparse, &r.logits) < TOL);
    // index_topk 16 covers the 16-token text: every token is attended, as in transformers'
    // dense run, through the full selection in the 64 bucket and its skip in the 16 one.
    let dense_dir = with_index_topk(16);
    for ctx in [[16, 64], [64, 128]] {
        let dense =
            engine::score(&mut open(dense_dir.path(), config(1, &ctx)), &r.token_ids).unwrap();
        let worst = max_abs_diff_rows(&dense, &r.logits_dense_attention);
        assert!(worst < TOL, "ctx buckets {ctx:?}: {worst}");
    }
}

#[test]
fn decode_at_batch_1_2_4_8_matches_transformers_in_every_context_bucket() {
    let r: SparseReference = reference_file(NAME, "reference.json");
    let dense_dir = with_index_topk(16);
    for ctx in [vec![16], vec![32], vec![64]] {
        for rows in [1, 2, 4, 8] {
            let mut run = open(&fixture_dir(NAME), config(8, &ctx));
            let worst = common::decode_staggered(run.as_mut(), &r.token_ids, rows, &r.logits);
            assert!(worst < TOL, "sparse, ctx {ctx:?}, batch {rows}: {worst}");
            let mut run = open(dense_dir.path(), config(8, &ctx));
            let worst = common::decode_staggered(
                run.as_mut(),
                &r.token_ids,
                rows,
                &r.logits_dense_attention,
            );
            assert!(
                worst < TOL,
                "index_topk 16, ctx {ctx:?}, batch {rows}: {worst}"
            );
        }
    }
}

#[test]
fn a_broken_v32_checkpoint_names_the_tensor() {
    let tmp = with_index_topk(6);
    let dir = tmp.path();
    // index_head_dim 24 does not match the stored indexer weights (16).
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["index_head_dim"] = 24.into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let cfg = ModelConfig::from_file(&path).unwrap();
    let err = ModelWeights::load(&cfg, &Checkpoint::open(dir).unwrap(), &Precision::F32)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.0.self_attn.indexer.") && err.contains("expected [24]"),
        "{err}"
    );
}
