//! DeepSeek-V4's MTP layer (`model::v4::mtp`) on the CPU backend against the published module
//! on `fixtures/tiny-v4-mtp` (scripts/make_v4_mtp_fixture.py: tiny-v4 plus `mtp.0.*`, its
//! block run by transformers 5.25's `DeepseekV4DecoderLayer`, the rest of `MTPBlock` written
//! from DeepSeek's inference code): every row's draft logits and output streams under teacher
//! forcing, through the cache-free graph and through the draft step graphs over the cache
//! roots; and how a checkpoint's MTP tensors are found, named when missing, or left unread.

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor as CTensor};
use deepinfer::backend::cpu;
use deepinfer::config::v4::V4Config;
use deepinfer::graph::{DType, Graph, InputRole};
use deepinfer::model::mtp::{DRAFT_HIDDEN, HIDDEN};
use deepinfer::model::v4::forward::build_stateless_draft;
use deepinfer::model::v4::step::{build_draft_step, build_step, cache_roots, V4Step};
use deepinfer::model::v4::{shard, tensors};
use deepinfer::model::{CacheLayout, Dots, LogitsOutput, MoeStrategy, Sampler};
use deepinfer::runner::step::{self, DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::weights::Checkpoint;

const FIXTURE: &str = "tiny-v4-mtp";

#[derive(serde::Deserialize)]
struct MtpReference {
    token_ids: Vec<u32>,
    streams: Vec<Vec<f32>>,
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

/// Token slots per cache block in the step tests (a divisor of both compress rates).
const BLOCK: usize = 4;
/// The step tests' context bucket.
const CTX: usize = 64;

/// The drafting model's cache roots on the CPU backend, fed step by step as a runner feeds
/// them: sequence `s` owns state row `s + 1` of the rings and its own blocks of the paged
/// roots (handed out in reverse, so never contiguous with another's).
struct Steps {
    cfg: V4Config,
    layout: CacheLayout,
    weights: HashMap<String, CTensor>,
    roots: HashMap<String, CTensor>,
    blocks: Vec<Vec<u32>>,
}

impl Steps {
    fn new(cfg: &V4Config, seqs: usize) -> Self {
        let per_seq = CTX / BLOCK;
        let layout = CacheLayout::new(BLOCK, seqs * per_seq + 1, DType::F32, seqs);
        let roots = common::zero_roots(cache_roots(cfg, &layout).unwrap());
        let full = weights(cfg, &common::fixture_dir(FIXTURE));
        let total = (seqs * per_seq) as u32;
        Steps {
            cfg: cfg.clone(),
            layout,
            weights: shard::rank_weights(cfg, &full, 1, 0).unwrap(),
            roots,
            blocks: (0..seqs as u32)
                .map(|s| {
                    (0..per_seq as u32)
                        .map(|b| total - s * per_seq as u32 - b)
                        .collect()
                })
                .collect(),
        }
    }

    /// Runs `graph` on `meta` (the runner's own step arrays) and, for a draft graph, the rows'
    /// streams `hidden` (padded with zeros to its rows); keeps the updated roots and returns
    /// the other outputs by name.
    fn run(
        &mut self,
        graph: &Graph,
        meta: &[step::HostArray],
        hidden: Option<&[Vec<f32>]>,
        rows: usize,
    ) -> HashMap<String, CTensor> {
        let width = self.cfg.hc_mult * self.cfg.hidden_size;
        let inputs: Vec<CTensor> = graph
            .inputs()
            .iter()
            .map(|d| match d.role {
                InputRole::CacheRoot => self.roots[&d.name].copy().unwrap(),
                InputRole::Weight => self.weights[&d.name].clone(),
                _ if d.name == HIDDEN => {
                    let mut v: Vec<f32> = hidden.unwrap().concat();
                    v.resize(rows * width, 0.0);
                    CTensor::from_vec(v, (rows, width), &Device::Cpu).unwrap()
                }
                _ => common::host_tensor(meta.iter().find(|a| a.name == d.name).expect("metadata")),
            })
            .collect();
        let outs = cpu::run(graph, &inputs).unwrap();
        let mut out: HashMap<String, CTensor> = graph
            .outputs()
            .iter()
            .map(|o| o.name.clone())
            .zip(outs)
            .collect();
        for name in self.roots.keys().cloned().collect::<Vec<_>>() {
            if let Some(root) = out.remove(&name) {
                self.roots.insert(name, root);
            }
        }
        out
    }

    /// One prefill-shaped step of `spec` (main or draft) over sequence `seq`'s `tokens` at
    /// positions `start..`: the fed rows' logits and hidden output (`hidden` for the main
    /// graph, `draft_hidden` for a draft).
    fn chunk(
        &mut self,
        graph: &Graph,
        rows: usize,
        seq: usize,
        start: usize,
        tokens: &[u32],
        hidden: Option<&[Vec<f32>]>,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let chunk = PrefillChunk {
            tokens,
            start,
            blocks: &self.blocks[seq],
            sampling: SamplingParams::GREEDY,
            controls: controls(seq),
        };
        let meta = step::prefill_step(&[chunk], rows, 1, CTX, BLOCK, self.cfg.vocab_size).unwrap();
        self.outputs(graph, &meta, hidden, rows, tokens.len())
    }

    /// One decode-shaped draft step of one row: sequence `seq`'s `token` at `position`.
    fn row(
        &mut self,
        graph: &Graph,
        seq: usize,
        position: usize,
        token: u32,
        hidden: &[f32],
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let row = DecodeRow {
            token,
            position,
            blocks: &self.blocks[seq],
            sampling: SamplingParams::GREEDY,
            controls: controls(seq),
        };
        let meta = step::decode_step(&[row], 1, CTX, BLOCK, self.cfg.vocab_size).unwrap();
        self.outputs(graph, &meta, Some(&[hidden.to_vec()]), 1, 1)
    }

    fn outputs(
        &mut self,
        graph: &Graph,
        meta: &[step::HostArray],
        hidden: Option<&[Vec<f32>]>,
        rows: usize,
        fed: usize,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let mut out = self.run(graph, meta, hidden, rows);
        let rows_of = |t: CTensor| t.to_vec2::<f32>().unwrap()[..fed].to_vec();
        let logits = rows_of(out.remove("logits").unwrap());
        let kept = out
            .remove(HIDDEN)
            .or_else(|| out.remove(DRAFT_HIDDEN))
            .unwrap();
        (logits, rows_of(kept))
    }
}

/// Sequence `seq`'s rings are in state row `seq + 1` (row 0 is the scratch padding writes).
fn controls(seq: usize) -> LogitControls<'static> {
    LogitControls {
        state_row: seq as u32 + 1,
        ..LogitControls::NONE
    }
}

fn spec(rows: usize, decode: bool) -> V4Step {
    V4Step {
        rows,
        seqs: 1.max(if decode { rows } else { 1 }),
        ctx: CTX,
        decode,
        ranks: 1,
        logits: LogitsOutput::AllPositions,
        sampler: Sampler::Full,
        moe: MoeStrategy::Gather,
        weights: DType::F32,
        dots: Dots::Widen,
    }
}

/// The step graphs over the cache roots, as a runner drives them: the main prefill returns
/// every fed token's streams before the hyper-head (the reference's `streams`), and the MTP
/// layer's draft graphs, fed those streams and the next tokens in chunks (prefill-shaped,
/// the window's ring carried across chunks) or a row a step (decode-shaped), give the
/// teacher-forced reference's draft logits and streams at every row.
#[test]
fn the_draft_step_graphs_match_the_published_module() {
    let r: MtpReference = common::reference_file(FIXTURE, "reference-mtp.json");
    let cfg = config_of(FIXTURE).with_draft_layer().unwrap();
    let mut steps = Steps::new(&cfg, 2);
    let ids = &r.token_ids;
    let t = ids.len();
    let chunk = 16;
    let main = build_step(&cfg, &steps.layout, &spec(chunk, false)).unwrap();
    let (mut logits, mut streams) = (Vec::new(), Vec::new());
    for start in (0..t).step_by(chunk) {
        let end = (start + chunk).min(t);
        let (l, s) = steps.chunk(&main, chunk, 0, start, &ids[start..end], None);
        logits.extend(l);
        streams.extend(s);
    }
    let (main_err, streams_err) = (worst(&logits, &r.main_logits), worst(&streams, &r.streams));
    assert!(main_err <= 1e-4, "main logits: {main_err}");
    assert!(streams_err <= 1e-4, "streams: {streams_err}");

    // Sequence 0: the draft rows 0..t-1 in prefill-shaped chunks of up to 16 rows.
    let draft = build_draft_step(&cfg, &steps.layout, &spec(chunk, false)).unwrap();
    let (mut drafts, mut kept) = (Vec::new(), Vec::new());
    for start in (0..t - 1).step_by(chunk) {
        let end = (start + chunk).min(t - 1);
        let hidden = &streams[start..end];
        let (l, s) = steps.chunk(
            &draft,
            chunk,
            0,
            start,
            &ids[start + 1..end + 1],
            Some(hidden),
        );
        drafts.extend(l);
        kept.extend(s);
    }
    let (chunked, chunked_streams) = (worst(&drafts, &r.mtp_logits), worst(&kept, &r.mtp_streams));
    // Sequence 1: the first 30 rows as one chunk, then the rest a row a step.
    let one = build_draft_step(&cfg, &steps.layout, &spec(1, true)).unwrap();
    let wide = build_draft_step(&cfg, &steps.layout, &spec(32, false)).unwrap();
    let (mut rows, _) = steps.chunk(&wide, 32, 1, 0, &ids[1..31], Some(&streams[..30]));
    for p in 30..t - 1 {
        let (l, _) = steps.row(&one, 1, p, ids[p + 1], &streams[p]);
        rows.extend(l);
    }
    let decoded = worst(&rows, &r.mtp_logits);
    eprintln!(
        "main {main_err:.2e}, streams {streams_err:.2e}; drafts: chunked {chunked:.2e} \
         (streams {chunked_streams:.2e}), a row a step {decoded:.2e}"
    );
    assert!(chunked <= 1e-4, "chunked drafts: {chunked}");
    assert!(
        chunked_streams <= 1e-4,
        "chunked draft streams: {chunked_streams}"
    );
    assert!(decoded <= 1e-4, "drafts a row a step: {decoded}");
}

/// The draft step graphs, and a drafting model's step graphs (which return the streams too),
/// break none of the rules `lower --check neuron` applies to every graph a capture compiles.
#[test]
fn the_draft_graphs_lower_within_neurons_rules() {
    use deepinfer::backend::hlo::emit;
    use deepinfer::backend::neuron::check::{check_module, CheckOptions};
    let cfg = config_of(FIXTURE).with_draft_layer().unwrap();
    let layout = CacheLayout::new(BLOCK, 4 * CTX / BLOCK + 1, DType::F32, 4);
    let device = |s: V4Step| V4Step {
        dots: Dots::DEVICE,
        ..s
    };
    let graphs = [
        build_draft_step(&cfg, &layout, &device(spec(4, true))).unwrap(),
        build_draft_step(&cfg, &layout, &device(spec(32, false))).unwrap(),
        build_step(&cfg, &layout, &device(spec(4, true))).unwrap(),
        build_step(&cfg, &layout, &device(spec(32, false))).unwrap(),
    ];
    for g in &graphs {
        let report = check_module(&emit::emit(g).unwrap(), &CheckOptions::default());
        assert!(report.clean(), "{}: {:?}", g.name(), report.findings);
    }
    // Without the layer in use there is no draft graph.
    let plain = config_of(FIXTURE);
    let err = build_draft_step(&plain, &layout, &spec(4, true))
        .unwrap_err()
        .to_string();
    assert!(err.contains("MTP layer"), "{err}");
}
