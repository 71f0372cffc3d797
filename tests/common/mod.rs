//! Shared helpers for the integration tests: fixture loading and comparisons.
#![allow(dead_code)]

use std::path::PathBuf;

use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::BlockAllocator;
use deepinfer::model::LogitsOutput;
use deepinfer::model::{ModelWeights, MoeStrategy, Precision};
use deepinfer::runner::step::{DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, Runner, Step, StepOutput};
use deepinfer::weights::Checkpoint;
use serde::Deserialize;

mod compare;
#[allow(unused_imports)] // not every test binary compares floats
pub use compare::{max_abs, max_abs_diff, max_abs_diff_f64, max_abs_diff_rows};

/// The tiny checkpoints `scripts/make_fixtures.py` writes, with transformers' outputs.
pub const FIXTURES: &[&str] = &["tiny-v3", "tiny-v2-lite", "tiny-v2-group", "tiny-v32"];

/// Zero-filled f32 CPU tensors for cache roots `specs`, by name: a fresh cache for tests that
/// run step graphs themselves.
pub fn zero_roots(
    specs: Vec<deepinfer::model::RootSpec>,
) -> std::collections::HashMap<String, candle_core::Tensor> {
    specs
        .into_iter()
        .map(|r| {
            let zeros = candle_core::Tensor::zeros(
                r.shape().to_vec(),
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            );
            (r.name.to_string(), zeros.unwrap())
        })
        .collect()
}

/// A step array the runner fills (`runner::step`) as the CPU tensor a graph input takes.
pub fn host_tensor(a: &deepinfer::runner::step::HostArray) -> candle_core::Tensor {
    use deepinfer::runner::step::HostData;
    let (shape, cpu) = (a.shape.as_slice(), &candle_core::Device::Cpu);
    match &a.data {
        HostData::I32(v) => candle_core::Tensor::from_slice(v, shape, cpu),
        HostData::F32(v) => candle_core::Tensor::from_slice(v, shape, cpu),
        HostData::U32(v) => candle_core::Tensor::from_slice(v, shape, cpu),
    }
    .unwrap()
}

/// Held by a test that keeps the CPU backend busy for a long time, so the binary's other such
/// tests wait rather than run beside it. candle's one CPU thread pool is shared by the whole
/// process and its idle workers spin: two such tests side by side on a two-core machine took
/// 1.8 times as long as one after the other (`tests/speculative_sampling.rs`: 255 s against
/// 143 s in release).
pub fn cpu_heavy() -> std::sync::MutexGuard<'static, ()> {
    static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that panicked holding it leaves nothing to repair.
    HEAVY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

#[derive(Deserialize)]
pub struct Greedy {
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
}

/// A vocabulary size no tensor-parallel degree above 1 divides: a fixture cut to it
/// ([`fixture_with_vocab`]) pads its last rank's slice at `--tp 2` (1 row) and `--tp 4` (3).
pub const ODD_VOCAB: usize = 501;

/// A sampler hot enough that a padding column's logit, were it not masked, would be drawn
/// among the likeliest tokens (the padded-vocabulary tests).
pub const HOT: SamplingParams = SamplingParams {
    temperature: 4.0,
    seed: 21,
    ..SamplingParams::GREEDY
};

/// Fixture `name` cut to its first `vocab` tokens, written once under the tests' scratch
/// directory: `config.json`'s `vocab_size` and the embedding's and LM head's rows, the rest
/// as it is. Its logits at a position are the fixture's first `vocab` logits there as long
/// as the tokens fed are below `vocab` (each LM-head row is its own token's, and the tokens
/// fed read the same embedding rows), so transformers' reference cut the same way is its
/// reference.
pub fn fixture_with_vocab(name: &str, vocab: usize) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-vocab{vocab}"));
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    let src = fixture_dir(name);
    let staging = dir.with_extension(format!("tmp{}", std::process::id()));
    std::fs::create_dir_all(&staging).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    assert!(
        cfg["vocab_size"].as_u64().unwrap() as usize > vocab,
        "{name}: a larger vocab"
    );
    cfg["vocab_size"] = vocab.into();
    std::fs::write(staging.join("config.json"), cfg.to_string()).unwrap();
    // Every shard of the checkpoint, written back as one file.
    let mut tensors = std::collections::HashMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let shard = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
            tensors.extend(shard);
        }
    }
    for key in ["model.embed_tokens.weight", "lm_head.weight"] {
        if let Some(t) = tensors.get(key) {
            let cut = t.narrow(0, 0, vocab).unwrap().contiguous().unwrap();
            tensors.insert(key.to_string(), cut);
        }
    }
    candle_core::safetensors::save(&tensors, staging.join("model.safetensors")).unwrap();
    // Concurrent test binaries may race here: the first rename wins, the others' are dropped.
    if std::fs::rename(&staging, &dir).is_err() {
        std::fs::remove_dir_all(&staging).unwrap();
    }
    dir
}

/// `reference.json`: transformers' float32 logits and greedy continuation.
#[derive(Deserialize)]
pub struct Reference {
    pub token_ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub greedy: Greedy,
}

pub fn reference(name: &str) -> Reference {
    reference_file(name, "reference.json")
}

/// Another reference file of fixture `name` (`reference-bf16.json`, ...), with the same
/// `token_ids`, `logits` and `greedy` keys.
pub fn reference_file<T: serde::de::DeserializeOwned>(name: &str, file: &str) -> T {
    let text = std::fs::read_to_string(fixture_dir(name).join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A captured CPU runner for fixture `name`, batches up to `max_batch`, 128 tokens, computing
/// in f32 (the weights widened exactly: what transformers' f32 references computed).
pub fn runner(name: &str, max_batch: usize, moe: Option<MoeStrategy>) -> Box<dyn Runner> {
    runner_in(name, max_batch, moe, Precision::F32)
}

/// [`runner`] with weights and cache held in `precision`'s dtypes.
pub fn runner_in(
    name: &str,
    max_batch: usize,
    moe: Option<MoeStrategy>,
    precision: Precision,
) -> Box<dyn Runner> {
    runner_sized(name, max_batch, 128, moe, precision)
}

/// [`runner_in`] for sequences of up to `max_len` tokens.
pub fn runner_sized(
    name: &str,
    max_batch: usize,
    max_len: usize,
    moe: Option<MoeStrategy>,
    precision: Precision,
) -> Box<dyn Runner> {
    let dir = fixture_dir(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let weights = ModelWeights::load(&cfg, &ckpt, &precision).unwrap();
    let mut rc = RunnerConfig::for_limits(max_batch, max_len);
    rc.moe = moe;
    rc.kv_dtype = precision.kv_cache;
    runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap()
}

/// Shorthands for [`Runner::replay`] that keep the tests short.
pub trait RunnerExt: Runner {
    /// Replays one prefill chunk.
    fn prefill(
        &mut self,
        chunk: &PrefillChunk<'_>,
        logits: LogitsOutput,
    ) -> deepinfer::Result<StepOutput> {
        self.replay(&Step::Prefill {
            chunks: std::slice::from_ref(chunk),
            logits,
        })
    }

    /// Replays one decode step, with each row's logits when `logits`.
    fn decode(&mut self, rows: &[DecodeRow<'_>], logits: bool) -> deepinfer::Result<StepOutput> {
        let logits = if logits {
            LogitsOutput::Sampled
        } else {
            LogitsOutput::None
        };
        self.replay(&Step::Decode { rows, logits })
    }
}

impl<R: Runner + ?Sized> RunnerExt for R {}

/// A block allocator over all of `runner`'s cache (what the scheduler would own).
pub fn allocator<R: Runner + ?Sized>(runner: &R) -> BlockAllocator {
    let rc = runner.runner_config();
    BlockAllocator::new(rc.num_blocks, rc.block_size).unwrap()
}

/// One step of [`decode_staggered_steps`]: the sampled tokens, and each active row's position
/// and logits, in row order.
pub struct StaggeredStep {
    pub next_tokens: Vec<u32>,
    pub positions: Vec<usize>,
    pub logits: Vec<Vec<f32>>,
}

/// `rows` sequences decode `ids` one token at a time through the decode graph only, row `i`
/// starting `i` steps late (so positions differ within a batch); every step's outputs, each
/// checked to hold one row of logits and one sampled token per row in the batch (so that the
/// callers' zips of logits with positions cannot drop a row).
pub fn decode_staggered_steps(
    run: &mut dyn Runner,
    ids: &[u32],
    rows: usize,
) -> Vec<StaggeredStep> {
    let mut alloc = allocator(&*run);
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); rows];
    let n = ids.len();
    let mut steps = Vec::new();
    for step in 0..n + rows - 1 {
        let active: Vec<usize> = (0..rows).filter(|&i| step >= i && step - i < n).collect();
        for &i in &active {
            alloc.grow(&mut tables[i], step - i + 1).unwrap();
        }
        let batch: Vec<DecodeRow> = active
            .iter()
            .map(|&i| DecodeRow {
                token: ids[step - i],
                position: step - i,
                blocks: &tables[i],
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            })
            .collect();
        let out = run
            .replay(&Step::Decode {
                rows: &batch,
                logits: LogitsOutput::Sampled,
            })
            .unwrap();
        let logits = out.logits.unwrap();
        assert_eq!(
            (logits.len(), out.next_tokens.len()),
            (batch.len(), batch.len()),
            "step {step}: rows of logits and sampled tokens vs rows in the batch"
        );
        steps.push(StaggeredStep {
            next_tokens: out.next_tokens,
            positions: active.iter().map(|&i| step - i).collect(),
            logits,
        });
    }
    steps
}

/// [`decode_staggered_steps`]' largest difference of any row's logits from `want` (its
/// position's row). Every logit must be finite.
pub fn decode_staggered(run: &mut dyn Runner, ids: &[u32], rows: usize, want: &[Vec<f32>]) -> f32 {
    let mut worst = 0.0f32;
    for step in decode_staggered_steps(run, ids, rows) {
        // `decode_staggered_steps` checked one row of logits per position.
        for (got, &position) in step.logits.iter().zip(&step.positions) {
            worst = worst.max(max_abs_diff(got, &want[position]));
        }
    }
    worst
}

/// What the CPU backend predicts it will hold for the model at `path` in `choice`, from the
/// headers alone (the RAM check before a load), and what the load then holds, in bytes.
pub fn predicted_and_held_bytes(
    path: &std::path::Path,
    choice: &deepinfer::model::PrecisionChoice,
) -> (u64, u64) {
    let (cfg, ckpt) = deepinfer::source::ModelSource::new(path)
        .unwrap()
        .open()
        .unwrap();
    let precision = choice.resolve(ckpt.float_dtype(), &cfg).unwrap();
    let predicted = ModelWeights::predicted_bytes(&cfg, &ckpt, &precision)
        .unwrap()
        .expect("a prediction");
    let held = ModelWeights::load(&cfg, &ckpt, &precision)
        .unwrap()
        .held_bytes();
    (predicted, held)
}

/// The index of a row's largest value (the first of equals), as greedy decoding picks.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A runner that forwards every call to `inner` and lets `hook` rewrite each step's output:
/// for tests that stand in for one part of the model (an MTP layer's proposals, say) and keep
/// the rest.
pub struct Intercept<F> {
    /// The runner doing the work.
    pub inner: Box<dyn Runner>,
    /// Sees every step and its output, after `inner` ran it.
    pub hook: F,
}

impl<F: FnMut(&Step<'_>, &mut StepOutput)> Runner for Intercept<F> {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn runner_config(&self) -> &RunnerConfig {
        self.inner.runner_config()
    }
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn capture(&mut self, buckets: &deepinfer::deployment::Buckets) -> deepinfer::Result<()> {
        self.inner.capture(buckets)
    }
    fn replay(&mut self, step: &Step<'_>) -> deepinfer::Result<StepOutput> {
        let mut out = self.inner.replay(step)?;
        (self.hook)(step, &mut out);
        Ok(out)
    }
    fn destroy(&mut self) -> deepinfer::Result<()> {
        self.inner.destroy()
    }
}

/// A CPU runner over fixture `name` in f32 drafting `k` tokens a step with its MTP layer
/// (loaded only when `k > 0`; the main model's embedding and head when the layer has none of
/// its own), split over `tp` ranks, batches up to `max_batch` of up to `max_len` tokens,
/// prompts prefilled `chunk` tokens at a time.
pub fn drafting_runner(
    name: &str,
    k: usize,
    tp: usize,
    limits: (usize, usize),
    chunk: usize,
) -> Box<dyn Runner> {
    drafting_runner_on(Backend::Cpu, name, k, tp, limits, chunk)
}

/// [`drafting_runner`] on `backend` (nrt-sim: every bucket's graphs captured, speculative ones
/// included).
pub fn drafting_runner_on(
    backend: Backend,
    name: &str,
    k: usize,
    tp: usize,
    (max_batch, max_len): (usize, usize),
    chunk: usize,
) -> Box<dyn Runner> {
    let dir = fixture_dir(name);
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    if k > 0 {
        cfg = cfg.with_draft_layer().unwrap();
        deepinfer::model::mtp::share_absent_embeddings(&mut cfg, &ckpt);
    }
    let weights = ModelWeights::load(&cfg, &ckpt, &Precision::F32).unwrap();
    let mut rc = RunnerConfig::for_limits(max_batch, max_len);
    rc.buckets.prefill_chunk = chunk;
    rc.speculative_tokens = k;
    rc.tp = tp;
    runner::open_with_weights(backend, cfg, weights, rc).unwrap()
}
