//! DeepSeek-V4's MTP layer (`model::v4::mtp`) on the CPU backend against the published module
//! on `fixtures/tiny-v4-mtp` (scripts/make_v4_mtp_fixture.py: tiny-v4 plus `mtp.0.*`, its
//! block run by transformers 5.25's `DeepseekV4DecoderLayer`, the rest of `MTPBlock` written
//! from DeepSeek's inference code): every row's draft logits and output streams under teacher
//! forcing, and how a checkpoint's MTP tensors are found, named when missing, or left unread.

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor as CTensor};
use deepinfer::backend::cpu;
use deepinfer::config::v4::V4Config;
use deepinfer::graph::DType;
use deepinfer::model::v4::forward::build_stateless_draft;
use deepinfer::model::v4::{shard, tensors};
use deepinfer::weights::Checkpoint;

const FIXTURE: &str = "tiny-v4-mtp";

#[derive(serde::Deserialize)]
struct MtpReference {
    token_ids: Vec<u32>,
    main_logits: Vec<Vec<f32>>,
    mtp_logits: Vec<Vec<f32>>,
    mtp_streams: Vec<Vec<f32>>,
    mtp_greedy: Vec<u32>,
}

fn config_of(fixture: &str) -> V4Config {
    let text = std::fs::read_to_string(common::fixture_dir(fixture).join("config.json")).unwrap();
    V4Config::from_json_str(&text).unwrap()
}

fn weights(cfg: &V4Config, dir: &std::path::Path) -> HashMap<String, CTensor> {
    let ckpt = Checkpoint::open(dir).unwrap();
    tensors::load(cfg, &ckpt, DType::F32).unwrap()
}

fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            assert!(a.iter().all(|v| v.is_finite()), "a non-finite output");
            common::max_abs_diff(a, b)
        })
        .fold(0.0, f32::max)
}

/// Row `i`: the MTP layer fed the main model's streams at `i` and the token at `i + 1`, at
/// position `i`: the reference's logits and output streams within 1e-4, its argmax exactly.
#[test]
fn the_mtp_layer_matches_the_published_module() {
    let r: MtpReference = common::reference_file(FIXTURE, "reference-mtp.json");
    let cfg = config_of(FIXTURE).with_draft_layer().unwrap();
    let full = weights(&cfg, &common::fixture_dir(FIXTURE));
    let mut w = shard::rank_weights(&cfg, &full, 1, 0).unwrap();
    let t = r.token_ids.len();
    let g = build_stateless_draft(&cfg, t).unwrap();
    let inputs: Vec<CTensor> = g
        .inputs()
        .iter()
        .map(|d| match d.name.as_str() {
            "input_ids" => {
                let v: Vec<i32> = r.token_ids.iter().map(|&i| i as i32).collect();
                CTensor::from_vec(v, t, &Device::Cpu).unwrap()
            }
            name => w.remove(name).unwrap_or_else(|| panic!("no weight {name}")),
        })
        .collect();
    let out = cpu::run(&g, &inputs).unwrap();
    let [logits, draft, streams] = [0, 1, 2].map(|i| out[i].to_vec2::<f32>().unwrap());
    let main = worst(&logits, &r.main_logits);
    let drafts = worst(&draft, &r.mtp_logits);
    let kept = worst(&streams, &r.mtp_streams);
    eprintln!("main logits {main:.2e}, draft logits {drafts:.2e}, draft streams {kept:.2e}");
    assert!(main <= 1e-4, "main logits: {main}");
    assert!(drafts <= 1e-4, "draft logits: {drafts}");
    assert!(kept <= 1e-4, "draft streams: {kept}");
    let greedy: Vec<u32> = draft
        .iter()
        .map(|row| {
            (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                .unwrap() as u32
        })
        .collect();
    assert_eq!(greedy, r.mtp_greedy);
}

/// The MTP block is a sliding, top-k layer after the decoder's, under `mtp.0`; without the
/// layer in use, its tensors are not read (and the checkpoint serves as tiny-v4 does).
#[test]
fn the_mtp_layer_is_listed_only_when_in_use() {
    let plain = config_of(FIXTURE);
    assert_eq!(plain.num_nextn_predict_layers, 1);
    let ckpt = Checkpoint::open(&common::fixture_dir(FIXTURE)).unwrap();
    let without = tensors::check(&plain, &ckpt).unwrap();
    assert_eq!(
        without,
        tensors::check(
            &config_of("tiny-v4"),
            &Checkpoint::open(&common::fixture_dir("tiny-v4")).unwrap()
        )
        .unwrap()
    );
    let cfg = plain.with_draft_layer().unwrap();
    let listed = tensors::expected(&cfg);
    let mtp: Vec<&str> = listed
        .iter()
        .map(|t| t.names[0].as_str())
        .filter(|n| n.starts_with("mtp.0."))
        .collect();
    assert_eq!(tensors::check(&cfg, &ckpt).unwrap(), without + mtp.len());
    for name in [
        "mtp.0.e_proj.weight",
        "mtp.0.h_proj.weight",
        "mtp.0.hc_head_fn",
        "mtp.0.attn.wkv.weight",
        "mtp.0.ffn.gate.bias",
        "mtp.0.ffn.experts.7.w2.weight",
    ] {
        assert!(mtp.contains(&name), "{name} not listed: {mtp:?}");
    }
    assert!(
        !mtp.iter()
            .any(|n| n.contains("compressor") || n.contains("indexer") || n.contains("tid2eid")),
        "{mtp:?}"
    );
    assert_eq!(cfg.layer_prefix(cfg.num_hidden_layers), "mtp.0");
    assert_eq!(cfg.layer_prefix(2), "layers.2");
}

/// No MTP layer in the checkpoint: drafting is refused, naming the config field and tensors.
/// An MTP tensor missing from a checkpoint that declares the layer: named.
#[test]
fn missing_mtp_layers_and_tensors_are_named() {
    let err = config_of("tiny-v4")
        .with_draft_layer()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("num_nextn_predict_layers") && err.contains("mtp.0"),
        "{err}"
    );
    let src = common::fixture_dir(FIXTURE);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let dropped = "mtp.0.h_proj.weight";
    let kept: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != dropped)
        .collect();
    safetensors::serialize_to_file(kept, None, &dir.path().join("model.safetensors")).unwrap();
    let cfg = config_of(FIXTURE).with_draft_layer().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = tensors::check(&cfg, &ckpt).unwrap_err().to_string();
    assert!(err.contains(dropped) && err.contains("missing"), "{err}");
    // Without the layer in use the same file serves.
    tensors::check(&config_of(FIXTURE), &ckpt).unwrap();
}
