//! Serving before every bucket is compiled (issue 42, item 7), on nrt-sim: the engine thread
//! over a device runner capturing in the background, its stand-in compiler told to hold the
//! batch-4 decode graphs until the test releases them (`--nrt-sim-hold`), or to fail some.
//!
//! Nothing here depends on timing: the order is forced by the hold, and liveness is polled
//! through `/metrics`' gauges. Outputs are compared with the CPU runner's greedy tokens.
//!
//! The simulated runtime is process-global, so the tests run one at a time (`serial`).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Buckets, RunnerConfig};
use deepinfer::engine::{Engine, EngineOptions, Event, GenerationParams, RequestStream, Scheduler};
use deepinfer::graph::DType;
use deepinfer::metrics::Metrics;
use deepinfer::model::{ModelWeights, Precision};
use deepinfer::runner::{self, Backend, DeviceOptions, DeviceRunner, NeffSource, Runner};
use deepinfer::weights::Checkpoint;
use neuron_sys::Library;
use nrt_sim::SimLibrary;

const MODEL: &str = "tiny-v2-lite";

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

fn sim_path() -> PathBuf {
    nrt_sim::library_next_to_current_exe()
        .expect("libnrt_sim.so next to the test binary (cargo test --workspace builds it)")
}

/// Batches 1, 2, 4 at contexts 32 and 64, 16-token prefill chunks: 8 graphs, of which the
/// first two (decode batch 1 and prefill 16 at context 64) are loaded before serving.
fn config() -> RunnerConfig {
    RunnerConfig {
        block_size: 16,
        num_blocks: 4 * 4 + 1,
        buckets: Buckets {
            batch: vec![1, 2, 4],
            ctx: vec![32, 64],
            prefill_chunk: 16,
            prefill_seqs: 1,
        },
        moe: None,
        kv_dtype: DType::F32,
        tp: 1,
        speculative_tokens: 0,
    }
}

fn load() -> (ModelConfig, ModelWeights) {
    let dir = common::fixture_dir(MODEL);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights =
        ModelWeights::load(&cfg, &Checkpoint::open(&dir).unwrap(), &Precision::F32).unwrap();
    (cfg, weights)
}

/// A device runner on nrt-sim compiling in the background, its stand-in compiler given
/// `flags` and a NEFF cache of its own at `cache` (so every graph is really compiled).
fn background_runner(
    flags: Vec<String>,
    cache: PathBuf,
    split_sampler: bool,
    tp: usize,
) -> deepinfer::error::Result<Box<dyn Runner>> {
    let (cfg, weights) = load();
    let rc = RunnerConfig { tp, ..config() };
    let lib = Library::open(sim_path())?;
    let mut opts = DeviceOptions::sim();
    if let NeffSource::Sim(c) = &mut opts.neff {
        c.flags.extend(flags);
        c.cache_dir = cache;
    }
    opts.background_compile = true;
    opts.split_sampler = split_sampler;
    let buckets = rc.buckets.clone();
    let mut d = DeviceRunner::new(cfg, weights, rc, lib, opts)?;
    d.capture(&buckets)?;
    Ok(Box::new(d))
}

/// The engine over [`background_runner`].
fn start(flags: Vec<String>, cache: &Path) -> deepinfer::error::Result<Engine> {
    start_split(flags, cache, false)
}

/// [`start`], with the sampler split from each decode graph (`--split-sampler`) or not.
fn start_split(
    flags: Vec<String>,
    cache: &Path,
    split_sampler: bool,
) -> deepinfer::error::Result<Engine> {
    start_with(flags, cache, split_sampler, 1)
}

/// [`start_split`] over `tp` simulated NeuronCores.
fn start_with(
    flags: Vec<String>,
    cache: &Path,
    split_sampler: bool,
    tp: usize,
) -> deepinfer::error::Result<Engine> {
    let cache = cache.to_path_buf();
    Engine::start(
        move || background_runner(flags, cache, split_sampler, tp),
        None,
        EngineOptions {
            max_waiting: 64,
            max_num_batched_tokens: None,
            prefix_caching: true,
            fair_decode: false,
            fair_decode_slowdown: deepinfer::engine::DEFAULT_FAIR_DECODE_SLOWDOWN,
            eos_token_ids: Vec::new(),
            log_stats_every: None,
        },
        Arc::new(Metrics::new()),
    )
}

fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|j| (j * 7 + salt * 13 + 3) % vocab)
        .collect()
}

fn params(max_tokens: usize) -> GenerationParams {
    GenerationParams {
        ignore_eos: true,
        ..GenerationParams::greedy(max_tokens)
    }
}

/// The CPU runner's greedy tokens for each prompt, run alone.
fn cpu_tokens(prompts: &[(Vec<u32>, usize)]) -> Vec<Vec<u32>> {
    let (cfg, weights) = load();
    let runner = runner::open_with_weights(Backend::Cpu, cfg, weights, config()).unwrap();
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    prompts
        .iter()
        .map(|(p, n)| {
            s.add(1, p.clone(), params(*n)).unwrap();
            let mut out = Vec::new();
            while !s.is_idle() {
                for o in s.step() {
                    match o.event {
                        Event::Token(t) => out.push(t.token),
                        Event::Failed { message, .. } => panic!("CPU: {message}"),
                        _ => {}
                    }
                }
            }
            out
        })
        .collect()
}

/// Every token of a request, or a panic naming its failure.
async fn tokens_of(mut s: RequestStream) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(e) = s.next().await {
        match e {
            Event::Token(t) => {
                out.push(t.token);
                if t.finish.is_some() {
                    break;
                }
            }
            Event::Failed { message, .. } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    out
}

/// The gauge line of a decode bucket in `/metrics`' text: `Some(1)` live, `Some(0)` not yet.
fn decode_gauge(metrics: &str, family: &str, batch: usize, ctx: usize) -> Option<u32> {
    let head = format!(
        "deepinfer_{family}{{kind=\"decode\",batch=\"{batch}\",tokens=\"{batch}\",ctx=\"{ctx}\"}} "
    );
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&head))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits (polling the metrics, up to five minutes on a loaded machine) until `done` holds.
fn wait_for(engine: &Engine, what: &str, done: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let text = engine.metrics().encode();
        if done(&text) {
            return;
        }
        assert!(Instant::now() < deadline, "never: {what}; metrics:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The decode steps run on batch bucket `batch`: on its decode graph, or its greedy graph once
/// that has joined too.
fn executions_of_batch(hooks: &SimLibrary, batch: usize) -> u64 {
    let c = hooks.counters().unwrap();
    [32, 64]
        .iter()
        .flat_map(|ctx| ["decode", "decode_greedy"].map(|g| format!("{g}_b{batch}_c{ctx}")))
        .map(|name| c.executions_of(&name))
        .sum()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn answers_before_the_largest_bucket_compiles_and_uses_it_once_it_joins() {
    let _g = serial();
    let hooks = SimLibrary::open(sim_path()).unwrap();
    // The counters are the process's: other tests' executions are not this one's.
    hooks.reset();
    let tmp = tempfile::tempdir().unwrap();
    let release = tmp.path().join("release-b4");
    let engine = start(
        vec![format!("--nrt-sim-hold=decode_b4:{}", release.display())],
        &tmp.path().join("neff"),
    )
    .expect("the engine starts on its first buckets");
    let vocab = engine.info().vocab_size as u32;
    let m = engine.metrics().encode();
    assert_eq!(decode_gauge(&m, "live_buckets", 1, 64), Some(1), "{m}");
    assert_eq!(decode_gauge(&m, "live_buckets", 4, 64), Some(0), "{m}");
    assert_eq!(decode_gauge(&m, "live_buckets", 4, 32), Some(0), "{m}");

    let rt = rt();
    // One request, answered while batch 4 cannot have compiled (its compile is held).
    let first = (prompt(5, 1, vocab), 6);
    let got = rt.block_on(tokens_of(
        engine.submit(first.0.clone(), params(first.1)).unwrap(),
    ));
    assert_eq!(got, cpu_tokens(std::slice::from_ref(&first))[0]);
    let m = engine.metrics().encode();
    assert_eq!(decode_gauge(&m, "live_buckets", 4, 64), Some(0), "{m}");

    // Four at once before it joins: they wait for slots (or run on batch 2 if it joined), and
    // none fails.
    let four: Vec<(Vec<u32>, usize)> = (0..4)
        .map(|i| (prompt(4 + i, 10 + i as u32, vocab), 5))
        .collect();
    let streams: Vec<RequestStream> = four
        .iter()
        .map(|(p, n)| engine.submit(p.clone(), params(*n)).unwrap())
        .collect();
    let got: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| rt.block_on(tokens_of(s)))
        .collect();
    let want = cpu_tokens(&four);
    assert_eq!(got, want);
    assert_eq!(executions_of_batch(&hooks, 4), 0);

    // Released: both batch-4 buckets join, and the gauges say so.
    std::fs::write(&release, b"").unwrap();
    wait_for(&engine, "decode batch 4 joins", |m| {
        decode_gauge(m, "live_buckets", 4, 64) == Some(1)
            && decode_gauge(m, "live_buckets", 4, 32) == Some(1)
    });

    // A long request decoding, then three more: a step of 3 or 4 rows, which only batch 4
    // holds.
    let long = (prompt(6, 20, vocab), 40);
    let mut first_stream = engine.submit(long.0.clone(), params(long.1)).unwrap();
    let head = rt.block_on(first_stream.next());
    let Some(Event::Token(head)) = head else {
        panic!("no first token: {head:?}")
    };
    let three: Vec<(Vec<u32>, usize)> = (0..3)
        .map(|i| (prompt(3 + i, 30 + i as u32, vocab), 8))
        .collect();
    let streams: Vec<RequestStream> = three
        .iter()
        .map(|(p, n)| engine.submit(p.clone(), params(*n)).unwrap())
        .collect();
    let mut long_got = vec![head.token];
    long_got.extend(rt.block_on(tokens_of(first_stream)));
    let got: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| rt.block_on(tokens_of(s)))
        .collect();
    let mut all = vec![long.clone()];
    all.extend(three);
    let want = cpu_tokens(&all);
    assert_eq!(long_got, want[0]);
    assert_eq!(got, want[1..]);
    assert!(
        executions_of_batch(&hooks, 4) > 0,
        "four sequences at once ran on batch 4"
    );
    engine.shutdown();
}

#[test]
fn a_failed_background_compile_leaves_its_bucket_absent() {
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let engine = start(
        vec!["--nrt-sim-fail=decode_b2".into()],
        &tmp.path().join("neff"),
    )
    .expect("a background failure does not stop the start");
    wait_for(&engine, "every other bucket joins", |m| {
        decode_gauge(m, "live_buckets", 4, 64) == Some(1)
            && decode_gauge(m, "live_buckets", 4, 32) == Some(1)
            && decode_gauge(m, "failed_buckets", 2, 64) == Some(1)
            && decode_gauge(m, "failed_buckets", 2, 32) == Some(1)
    });
    let m = engine.metrics().encode();
    assert_eq!(decode_gauge(&m, "live_buckets", 2, 64), Some(0), "{m}");
    // Two sequences at once run on batch 4 (batch 2 is absent).
    let vocab = engine.info().vocab_size as u32;
    let two: Vec<(Vec<u32>, usize)> = (0..2).map(|i| (prompt(5, 40 + i, vocab), 6)).collect();
    let streams: Vec<RequestStream> = two
        .iter()
        .map(|(p, n)| engine.submit(p.clone(), params(*n)).unwrap())
        .collect();
    let rt = rt();
    let got: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| rt.block_on(tokens_of(s)))
        .collect();
    assert_eq!(got, cpu_tokens(&two));
    engine.shutdown();
}

#[test]
fn a_failed_first_bucket_fails_the_start() {
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let err = match start(
        vec!["--nrt-sim-fail=decode_b1_c64".into()],
        &tmp.path().join("neff"),
    ) {
        Ok(_) => panic!("the engine started without its first buckets"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("decode_b1_c64"), "{err}");
}

#[test]
fn split_decode_buckets_join_with_their_sampling_graphs() {
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let release = tmp.path().join("release");
    // The batch-2 sampling graph (one NEFF for both contexts) waits; the forward graphs do
    // not: a bucket joins with both or not at all.
    let engine = start_split(
        vec![format!("--nrt-sim-hold=sample_b2:{}", release.display())],
        &tmp.path().join("neff"),
        true,
    )
    .unwrap();
    wait_for(&engine, "batch 4 joins", |m| {
        decode_gauge(m, "live_buckets", 4, 64) == Some(1)
            && decode_gauge(m, "live_buckets", 4, 32) == Some(1)
    });
    let m = engine.metrics().encode();
    assert_eq!(decode_gauge(&m, "live_buckets", 2, 64), Some(0), "{m}");
    std::fs::write(&release, b"").unwrap();
    wait_for(&engine, "batch 2 joins", |m| {
        decode_gauge(m, "live_buckets", 2, 64) == Some(1)
            && decode_gauge(m, "live_buckets", 2, 32) == Some(1)
    });
    let vocab = engine.info().vocab_size as u32;
    let two: Vec<(Vec<u32>, usize)> = (0..2).map(|i| (prompt(7, 50 + i, vocab), 6)).collect();
    let streams: Vec<RequestStream> = two
        .iter()
        .map(|(p, n)| engine.submit(p.clone(), params(*n)).unwrap())
        .collect();
    let rt = rt();
    let got: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| rt.block_on(tokens_of(s)))
        .collect();
    assert_eq!(got, cpu_tokens(&two));
    engine.shutdown();
}

#[test]
fn every_rank_loads_a_joining_bucket() {
    let _g = serial();
    let hooks = SimLibrary::open(sim_path()).unwrap();
    hooks.reset();
    let tmp = tempfile::tempdir().unwrap();
    let release = tmp.path().join("release-b4");
    // Two ranks: a joining bucket is loaded by the runner's thread and the other rank's worker
    // at once (`nrt_load_collectives` waits for both).
    let engine = start_with(
        vec![format!("--nrt-sim-hold=decode_b4:{}", release.display())],
        &tmp.path().join("neff"),
        false,
        2,
    )
    .unwrap();
    std::fs::write(&release, b"").unwrap();
    wait_for(&engine, "decode batch 4 joins on both ranks", |m| {
        decode_gauge(m, "live_buckets", 4, 64) == Some(1)
            && decode_gauge(m, "live_buckets", 4, 32) == Some(1)
    });
    let vocab = engine.info().vocab_size as u32;
    let rt = rt();
    let long = (prompt(6, 60, vocab), 40);
    let mut first = engine.submit(long.0.clone(), params(long.1)).unwrap();
    let Some(Event::Token(head)) = rt.block_on(first.next()) else {
        panic!("no first token")
    };
    let three: Vec<(Vec<u32>, usize)> = (0..3)
        .map(|i| (prompt(3 + i, 70 + i as u32, vocab), 8))
        .collect();
    let streams: Vec<RequestStream> = three
        .iter()
        .map(|(p, n)| engine.submit(p.clone(), params(*n)).unwrap())
        .collect();
    let mut long_got = vec![head.token];
    long_got.extend(rt.block_on(tokens_of(first)));
    let got: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| rt.block_on(tokens_of(s)))
        .collect();
    let mut all = vec![long];
    all.extend(three);
    let want = cpu_tokens(&all);
    assert_eq!(long_got, want[0]);
    assert_eq!(got, want[1..]);
    assert!(executions_of_batch(&hooks, 4) > 0);
    engine.shutdown();
}
