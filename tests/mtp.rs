//! DeepSeek-V3's multi-token-prediction layer as a draft model (`model::mtp`), against
//! `fixtures/tiny-v3-mtp/reference-mtp.json`: an MTP forward written by hand in
//! `scripts/make_mtp_fixture.py` from vLLM's `deepseek_mtp.py`, SGLang's `deepseek_nextn.py`
//! and the DeepSeek-V3 report, around transformers' own `DeepseekV3DecoderLayer` (transformers
//! itself drops the layer).

mod common;

use common::{argmax, fixture_dir, max_abs_diff_rows, RunnerExt};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::model::{LogitsOutput, ModelWeights, Precision};
use deepinfer::runner::step::{DraftChunk, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, CpuRunner, Runner, Step, StepOutput};
use deepinfer::weights::Checkpoint;
use serde::Deserialize;

const FIXTURE: &str = "tiny-v3-mtp";
/// f32 throughout, as the reference; the layer adds one MLA + MoE block to the main model's.
const TOLERANCE: f32 = 1e-4;

#[derive(Deserialize)]
struct MtpReference {
    token_ids: Vec<u32>,
    main_logits: Vec<Vec<f32>>,
    mtp_logits: Vec<Vec<f32>>,
    mtp_greedy: Vec<u32>,
}

fn reference() -> MtpReference {
    common::reference_file(FIXTURE, "reference-mtp.json")
}

/// A CPU runner for the fixture with its MTP layer loaded, split over `tp` ranks.
fn drafting_runner(tp: usize) -> CpuRunner {
    let dir = fixture_dir(FIXTURE);
    let cfg = ModelConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .with_draft_layer()
        .unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let weights = ModelWeights::load(&cfg, &ckpt, &Precision::F32).unwrap();
    let mut rc = RunnerConfig::for_limits(2, 128);
    rc.tp = tp;
    let mut runner = CpuRunner::new(cfg, weights, rc.clone()).unwrap();
    runner.capture(&rc.buckets).unwrap();
    runner
}

fn chunk<'a>(tokens: &'a [u32], start: usize, blocks: &'a [u32]) -> PrefillChunk<'a> {
    PrefillChunk {
        tokens,
        start,
        blocks,
        sampling: SamplingParams::GREEDY,
        controls: LogitControls::NONE,
    }
}

fn draft(runner: &mut CpuRunner, chunk: DraftChunk<'_>) -> StepOutput {
    runner
        .replay(&Step::Draft {
            chunks: &[chunk],
            logits: LogitsOutput::AllPositions,
        })
        .unwrap()
}

/// The main model over all of `tokens` in one chunk (every position's logits), then the MTP
/// layer over every row whose next token is known: row i drafts from the hidden state at i and
/// the token at i + 1.
fn prefill_and_draft(
    runner: &mut CpuRunner,
    tokens: &[u32],
    blocks: &[u32],
) -> (Vec<Vec<f32>>, StepOutput) {
    let main = runner
        .prefill(&chunk(tokens, 0, blocks), LogitsOutput::AllPositions)
        .unwrap()
        .logits
        .unwrap();
    let rows: Vec<usize> = (0..tokens.len() - 1).collect();
    let out = draft(
        runner,
        DraftChunk {
            next_tokens: &tokens[1..],
            start: 0,
            blocks,
            hidden_rows: &rows,
        },
    );
    (main, out)
}

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    assert!(
        got.iter().flatten().all(|x| x.is_finite()),
        "{what}: not finite"
    );
    let diff = max_abs_diff_rows(got, want);
    assert!(diff <= TOLERANCE, "{what}: max |diff| {diff:e}");
}

#[test]
fn the_mtp_layer_drafts_what_the_reference_module_computes() {
    let r = reference();
    let s = r.token_ids.len();
    // At tp 2 the layer's heads, experts, embedding and head are split like the model's.
    for tp in [1, 2] {
        let mut runner = drafting_runner(tp);
        let blocks: Vec<u32> = (1..=8).collect();
        let (main, out) = prefill_and_draft(&mut runner, &r.token_ids, &blocks);
        assert_close("main logits", &main, &r.main_logits);
        let what = format!("MTP logits at tp {tp}");
        assert_close(&what, &out.logits.unwrap(), &r.mtp_logits);
        assert_eq!(out.next_tokens, vec![r.mtp_greedy[s - 2]], "tp {tp}");
    }
}

/// The engine's order: a prompt chunk, then its draft rows; the next chunk's draft rows attend
/// to the MTP layer's cached rows of the first.
#[test]
fn draft_chunks_continue_the_mtp_layers_cache() {
    let r = reference();
    let s = r.token_ids.len();
    let mut runner = drafting_runner(1);
    let blocks: Vec<u32> = (1..=8).collect();
    let mut got = Vec::new();
    for (start, end) in [(0, 17), (17, s)] {
        runner
            .prefill(
                &chunk(&r.token_ids[start..end], start, &blocks),
                LogitsOutput::None,
            )
            .unwrap();
        // Every row whose next token is known: the chunk's, up to the prompt's last.
        let rows = end.min(s - 1) - start;
        let hidden_rows: Vec<usize> = (0..rows).collect();
        let out = draft(
            &mut runner,
            DraftChunk {
                next_tokens: &r.token_ids[start + 1..start + 1 + rows],
                start,
                blocks: &blocks,
                hidden_rows: &hidden_rows,
            },
        );
        got.extend(out.logits.unwrap());
    }
    assert_close("MTP logits in two chunks", &got, &r.mtp_logits);
}

#[derive(Deserialize)]
struct HeldoutReference {
    token_ids: Vec<u32>,
    mtp_argmax: Vec<u32>,
    agreement_with_main_argmax: f64,
}

/// The default model's held-out reference, and the model loaded with its MTP layer in f32.
fn default_model_drafting() -> (HeldoutReference, ModelConfig, ModelWeights) {
    let dir = fixture_dir("default-model");
    let r: HeldoutReference = common::reference_file("default-model", "mtp-heldout.json");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut cfg = ModelConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .with_draft_layer()
        .unwrap();
    deepinfer::model::mtp::share_absent_embeddings(&mut cfg, &ckpt);
    let weights = ModelWeights::load(&cfg, &ckpt, &Precision::F32).unwrap();
    (r, cfg, weights)
}

/// The default model's trained MTP layer (`scripts/train_mtp.py`), which ships no embedding or
/// head of its own and so drafts with the main model's: its greedy drafts over the held-out
/// text are those of the Python reference forward, and agree with the main model's own next
/// tokens as often as the reference measured.
#[test]
fn the_default_models_mtp_layer_drafts_as_its_reference() {
    let (r, cfg, weights) = default_model_drafting();
    assert!(cfg.draft_shares_embeddings);
    let s = r.token_ids.len();
    let mut rc = RunnerConfig::for_limits(1, 512);
    rc.buckets.prefill_chunk = s;
    let mut runner = CpuRunner::new(cfg, weights, rc.clone()).unwrap();
    runner.capture(&rc.buckets).unwrap();
    let blocks: Vec<u32> = (1..=s.div_ceil(16) as u32).collect();
    let (main, out) = prefill_and_draft(&mut runner, &r.token_ids, &blocks);
    let logits = out.logits.unwrap();
    assert!(logits.iter().flatten().all(|x| x.is_finite()));
    let drafted: Vec<u32> = logits.iter().map(|row| argmax(row)).collect();
    assert_eq!(drafted, r.mtp_argmax);
    // Row i drafts the token at i + 2, which the main model predicts from row i + 1.
    let agree = (0..s - 1)
        .filter(|&i| drafted[i] == argmax(&main[i + 1]))
        .count();
    let rate = agree as f64 / (s - 1) as f64;
    assert!(
        (rate - r.agreement_with_main_argmax).abs() < 0.01,
        "{rate} against the reference's {}",
        r.agreement_with_main_argmax
    );
}

/// The same trained layer on nrt-sim (the device runner): its draft graphs give the
/// reference's drafts. The held-out text prefilled in one chunk, then drafted over in one
/// chunk of 255 rows (more than a decode batch: the prefill bucket's `Draft` graph, whose
/// proposal is its last row's), and again as 255 chunks of one row each (the decode buckets'
/// `DecodeDraft` graph, eight rows a graph, each row attending to the MTP layer's cache rows
/// the rows before it wrote in the same graph or an earlier one), whose proposals are every
/// row's.
#[test]
fn the_default_models_mtp_layer_drafts_as_its_reference_on_nrt_sim() {
    let (r, cfg, weights) = default_model_drafting();
    let s = r.token_ids.len();
    let mut rc = RunnerConfig::for_limits(8, 512);
    rc.buckets.prefill_chunk = s;
    rc.speculative_tokens = 1;
    let mut runner = runner::open_with_weights(Backend::Sim, cfg, weights, rc).unwrap();
    let blocks: Vec<u32> = (1..=s.div_ceil(16) as u32).collect();
    let rows: Vec<usize> = (0..s - 1).collect();
    let prefill = |runner: &mut Box<dyn Runner>| {
        runner
            .prefill(&chunk(&r.token_ids, 0, &blocks), LogitsOutput::None)
            .unwrap();
    };
    prefill(&mut runner);
    let whole = runner
        .replay(&Step::Draft {
            chunks: &[DraftChunk {
                next_tokens: &r.token_ids[1..],
                start: 0,
                blocks: &blocks,
                hidden_rows: &rows,
            }],
            logits: LogitsOutput::None,
        })
        .unwrap();
    assert_eq!(whole.next_tokens, vec![r.mtp_argmax[s - 2]]);
    prefill(&mut runner);
    let singles: Vec<DraftChunk<'_>> = (0..s - 1)
        .map(|i| DraftChunk {
            next_tokens: &r.token_ids[i + 1..i + 2],
            start: i,
            blocks: &blocks,
            hidden_rows: &rows[i..i + 1],
        })
        .collect();
    let each = runner
        .replay(&Step::Draft {
            chunks: &singles,
            logits: LogitsOutput::None,
        })
        .unwrap();
    assert_eq!(each.next_tokens, r.mtp_argmax);
}

#[test]
fn a_checkpoint_without_an_mtp_layer_is_refused_by_name() {
    let cfg = ModelConfig::from_file(&fixture_dir("tiny-v3").join("config.json")).unwrap();
    let msg = cfg.with_draft_layer().unwrap_err().to_string();
    assert!(msg.contains("num_nextn_predict_layers"), "{msg}");
    assert!(msg.contains("model.layers.3.eh_proj"), "{msg}");

    // A config that promises the layer over files that lack it: every missing tensor named.
    let mut cfg = cfg;
    cfg.num_nextn_predict_layers = 1;
    let cfg = cfg.with_draft_layer().unwrap();
    let ckpt = Checkpoint::open(&fixture_dir("tiny-v3")).unwrap();
    let msg = match ModelWeights::load(&cfg, &ckpt, &Precision::F32) {
        Ok(_) => panic!("loading a missing MTP layer must fail"),
        Err(e) => e.to_string(),
    };
    for name in [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.enorm.weight",
    ] {
        assert!(msg.contains(name), "{msg}");
    }
    assert!(msg.contains("more"), "{msg}");
}
