//! The `deepinfer` command line: generate, score and benchmark DeepSeek-architecture models.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use deepinfer::config::ModelConfig;
use deepinfer::engine::{self, StopConditions};
use deepinfer::model::ModelWeights;
use deepinfer::runner::{
    CpuRunner, DeviceOptions, DeviceRunner, GraphRunner, Runner, RunnerConfig,
};
use deepinfer::step::{DecodeRow, PrefillChunk, SamplingParams};
use deepinfer::tokenizer::Tokenizer;
use deepinfer::weights::Checkpoint;

#[derive(Parser)]
#[command(
    name = "deepinfer",
    version,
    about = "Serve DeepSeek-architecture models (MLA + MoE) from Rust: Trainium or CPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Generate(GenerateArgs),
    /// Print the logits of every position of a token sequence as JSON.
    Score(ScoreArgs),
    /// Measure decode throughput (tokens/s) at one batch size.
    Bench(BenchArgs),
    /// Lower the model's bucket graphs to XLA HLO files with a manifest.
    Lower(LowerArgs),
    /// Report whether the Neuron backend can run here: libnrt, NeuronCores, neuronx-cc.
    Doctor,
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
}

/// Where graphs run.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// candle-core on the host CPU.
    Cpu,
    /// nrt-sim (libnrt_sim.so): the device runner over a simulated NeuronCore.
    Sim,
    /// libnrt on a NeuronCore, graphs compiled with neuronx-cc.
    Neuron,
}

#[derive(Args)]
struct ModelArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json). Defaults to the
    /// embedded default model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where graphs run: `neuron` when libnrt and a NeuronCore are present, else `cpu`.
    #[arg(long, value_enum)]
    backend: Option<Backend>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "token_ids",
        required_unless_present = "token_ids"
    )]
    prompt: Option<String>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Wrap the prompt in the model's chat template as one user message.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass; 1 disables it.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sample among the k most likely tokens; 0 disables it.
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// Print `{"token_ids": [...], "text": "..."}` instead of the text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind; the default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind; 0 picks a free one (the ready line on stderr says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health and /metrics.
    #[arg(long, env = "DEEPINFER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model name clients pass (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Sequences decoded together at most (the largest batch bucket).
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Longest sequence, prompt plus completion (default: the model's, at most 2048).
    #[arg(long)]
    max_len: Option<usize>,
    /// KV-cache blocks of 16 tokens (default: enough for --max-batch sequences of --max-len).
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Most prompt tokens per prefill step. Prefill graphs are built for 16, 64, ... up to this
    /// size, and a chunk runs on the smallest that holds it; larger chunks take long prompts in
    /// fewer steps but stall the decoding streams longer.
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// Requests that may wait for a batch slot before new ones get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds between stats lines on stderr while serving (throughput, running, waiting, KV
    /// cache use); 0 turns them off.
    #[arg(long, default_value_t = 10)]
    log_stats_secs: u64,
    /// Seconds shutdown waits for requests in flight before ending them.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The tokens, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
}

#[derive(Args)]
struct BenchArgs {
    /// Checkpoint directory to benchmark.
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    model: Option<PathBuf>,
    /// A config.json to benchmark with random weights instead.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prompt tokens prefilled per sequence before timing.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Print one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct LowerArgs {
    /// Checkpoint directory (only config.json is needed unless --inputs-from-token-ids is given).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Decode batch sizes, one graph each.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch_sizes: Vec<usize>,
    /// Context bucket of every graph (a multiple of 16).
    #[arg(long, default_value_t = 128)]
    ctx: usize,
    /// Also write each graph's inputs (and CPU outputs) for the step that decodes the last of
    /// these tokens in row 0 after the others were prefilled.
    #[arg(long, value_delimiter = ',')]
    inputs_from_token_ids: Option<Vec<u32>>,
    /// Print each graph's instruction count, bytes read/written and FLOPs per step, next to the
    /// decode floor (works from config.json alone).
    #[arg(long)]
    stats: bool,
    /// Also compile every graph with neuronx-cc into `NAME.neff` (through the NEFF cache).
    #[arg(long)]
    compile: bool,
    /// The neuronx-cc executable.
    #[arg(long, default_value = "neuronx-cc")]
    neuronx_cc: PathBuf,
    /// neuronx-cc's `--target`.
    #[arg(long, default_value = "trn1")]
    neuron_target: String,
    /// Compiler processes run at once (default: one per 8 CPUs).
    #[arg(long)]
    compile_jobs: Option<usize>,
    /// The NEFF cache directory.
    #[arg(long, env = "DEEPINFER_NEFF_CACHE")]
    neff_cache: Option<PathBuf>,
}

/// The embedded default model: shipped in the repository, found beside the binary or in the
/// source tree the binary was built from.
fn default_model_dir() -> Result<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join("default-model"));
        }
    }
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    candidates.push(source.join("default-model"));
    candidates.push(source.join("tiny-v3"));
    candidates
        .iter()
        .find(|d| d.join("config.json").is_file())
        .cloned()
        .with_context(|| {
            format!("no default model found (looked in {candidates:?}); pass --model DIR")
        })
}

/// The backend to use: the one asked for, else `neuron` when libnrt loads and sees a
/// NeuronCore, else `cpu`.
fn choose_backend(asked: Option<Backend>) -> Backend {
    if let Some(b) = asked {
        return b;
    }
    match neuron_sys::Library::load() {
        // NEURON_RT_LIB naming nrt-sim: the simulator, whose "NEFF" is our HLO.
        Ok(lib) if matches!(lib.version(), Ok(Some(v)) if v.git_hash == nrt_sim_git_hash()) => {
            Backend::Sim
        }
        Ok(lib) if matches!(lib.visible_nc_count(), Ok(Some(n)) if n > 0) => Backend::Neuron,
        _ => Backend::Cpu,
    }
}

/// The `git_hash` nrt-sim reports from `nrt_get_version`.
fn nrt_sim_git_hash() -> &'static str {
    "nrt-sim"
}

fn load_runner(
    dir: &Path,
    max_batch: usize,
    max_len: usize,
    backend: Option<Backend>,
) -> Result<GraphRunner> {
    check_model_dir(dir)?;
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let max_len = max_len.min(cfg.max_position_embeddings);
    let rc = RunnerConfig::for_limits(max_batch, max_len);
    open_runner(dir, cfg, rc, backend)
}

fn check_model_dir(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        bail!(
            "model directory {} does not exist or is not a directory",
            dir.display()
        );
    }
    Ok(())
}

/// Loads the weights and builds the runner for `rc` on the chosen backend.
fn open_runner(
    dir: &Path,
    cfg: ModelConfig,
    rc: RunnerConfig,
    backend: Option<Backend>,
) -> Result<GraphRunner> {
    let weights = ModelWeights::load(&cfg, &Checkpoint::open(dir)?)?;
    Ok(match choose_backend(backend) {
        Backend::Cpu => GraphRunner::Cpu(Box::new(CpuRunner::new(cfg, weights, rc)?)),
        Backend::Sim => {
            let path = deepinfer::runner::find_sim_library()?;
            let lib = neuron_sys::Library::open(&path)
                .with_context(|| format!("loading nrt-sim from {}", path.display()))?;
            GraphRunner::Device(Box::new(DeviceRunner::new(
                cfg,
                weights,
                rc,
                lib,
                DeviceOptions::sim(),
            )?))
        }
        Backend::Neuron => {
            let lib = neuron_sys::Library::load()?;
            let cc = deepinfer::backend::neuron::compile::CompilerConfig::default();
            GraphRunner::Device(Box::new(DeviceRunner::new(
                cfg,
                weights,
                rc,
                lib,
                DeviceOptions::neuron(cc),
            )?))
        }
    })
}

fn model_dir(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(d) => Ok(d.clone()),
        None => default_model_dir(),
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let tokenizer = if dir.join("tokenizer.json").is_file() {
        Some(Tokenizer::from_dir(&dir)?)
    } else {
        None
    };
    let prompt = match (&args.prompt, &args.token_ids, &tokenizer) {
        (_, Some(ids), _) => ids.clone(),
        (Some(text), None, Some(tok)) if args.chat => {
            let msg = deepinfer::tokenizer::ChatMessage {
                role: "user".into(),
                content: text.clone(),
            };
            tok.encode(&tok.apply_chat_template(&[msg], true)?, false)?
        }
        (Some(text), None, Some(tok)) => tok.encode(text, true)?,
        (Some(_), None, None) => bail!(
            "{} has no tokenizer.json: pass --token-ids instead of --prompt",
            dir.display()
        ),
        (None, None, _) => bail!("pass --prompt or --token-ids"),
    };
    let mut runner = load_runner(&dir, 1, prompt.len() + args.max_tokens, args.model.backend)?;
    let eos: Vec<u32> = match &tokenizer {
        Some(t) => t
            .eos_token_id()
            .into_iter()
            .chain(runner.config().eos_token_ids.iter().copied())
            .collect(),
        None => runner.config().eos_token_ids.clone(),
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let stop = StopConditions {
        max_tokens: args.max_tokens,
        stop_token_ids: eos,
    };
    let ids = engine::generate(&mut runner, &prompt, sampling, &stop)?;
    let text = match &tokenizer {
        Some(t) => t.decode(&ids, true)?,
        None => String::new(),
    };
    if args.json {
        emit(&serde_json::json!({ "token_ids": ids, "text": text }).to_string())?;
    } else if tokenizer.is_some() {
        emit(&format!("{}{text}", args.prompt.as_deref().unwrap_or("")))?;
    } else {
        emit(
            &ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )?;
    }
    Ok(())
}

fn score(args: ScoreArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let mut runner = load_runner(&dir, 1, args.token_ids.len(), args.model.backend)?;
    let logits = engine::score(&mut runner, &args.token_ids)?;
    emit(&serde_json::json!({ "logits": logits }).to_string())?;
    Ok(())
}

fn bench(args: BenchArgs) -> Result<()> {
    let (cfg, weights) = match (&args.model, &args.config) {
        (Some(dir), _) => {
            let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
            let w = ModelWeights::load(&cfg, &Checkpoint::open(dir)?)?;
            (cfg, w)
        }
        (None, Some(file)) => {
            let cfg = ModelConfig::from_file(file)?;
            let w = ModelWeights::random(&cfg, 0)?;
            (cfg, w)
        }
        (None, None) => bail!("pass --model or --config"),
    };
    let vocab = cfg.vocab_size as u32;
    let max_len = args.prompt_len + args.steps + 1;
    let mut runner = CpuRunner::new(cfg, weights, RunnerConfig::for_limits(args.batch, max_len))?;
    let mut tables = vec![Vec::new(); args.batch];
    let mut tokens = Vec::with_capacity(args.batch);
    for (i, table) in tables.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..args.prompt_len as u32)
            .map(|j| (j * 7 + i as u32 * 13 + 1) % vocab)
            .collect();
        runner.blocks.grow(table, args.prompt_len)?;
        let out = runner.prefill(
            &PrefillChunk {
                tokens: &prompt,
                start: 0,
                blocks: table,
                sampling: SamplingParams::GREEDY,
            },
            deepinfer::model::LogitsOutput::None,
        )?;
        tokens.push(out.next_tokens[0]);
    }
    let mut run_step = |step: usize, tokens: &mut Vec<u32>| -> Result<()> {
        let position = args.prompt_len + step;
        for t in tables.iter_mut() {
            runner.blocks.grow(t, position + 1)?;
        }
        let rows: Vec<DecodeRow> = tables
            .iter()
            .zip(tokens.iter())
            .map(|(t, &token)| DecodeRow {
                token,
                position,
                blocks: t,
                sampling: SamplingParams::GREEDY,
            })
            .collect();
        *tokens = runner.decode(&rows, false)?.next_tokens;
        Ok(())
    };
    run_step(0, &mut tokens)?; // builds the decode graph
    let start = Instant::now();
    for step in 1..=args.steps {
        run_step(step, &mut tokens)?;
    }
    let secs = start.elapsed().as_secs_f64();
    let tps = (args.batch * args.steps) as f64 / secs;
    let ms = secs * 1e3 / args.steps as f64;
    if args.json {
        emit(
            &serde_json::json!({ "batch": args.batch, "tokens_per_s": tps, "ms_per_step": ms })
                .to_string(),
        )?;
    } else {
        emit(&format!(
            "batch {}: {tps:.1} tokens/s, {ms:.2} ms/step",
            args.batch
        ))?;
    }
    Ok(())
}

/// Prints one line to stdout; a closed pipe (`| head`) ends the program quietly, not with a panic.
fn emit(line: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        r => Ok(r?),
    }
}

fn lower(args: LowerArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model_dir()?,
    };
    let opts = deepinfer::lowering::LowerOptions {
        batch_sizes: args.batch_sizes,
        ctx: args.ctx,
        inputs_from_token_ids: args.inputs_from_token_ids,
    };
    let manifest = deepinfer::lowering::lower(&dir, &args.out, &opts)?;
    if args.compile {
        use deepinfer::backend::neuron::compile::{compile_all, CompileJob, CompilerConfig};
        let mut cfg = CompilerConfig {
            program: args.neuronx_cc.clone(),
            target: args.neuron_target.clone(),
            ..Default::default()
        };
        if let Some(j) = args.compile_jobs {
            cfg.jobs = j.max(1);
        }
        if let Some(d) = &args.neff_cache {
            cfg.cache_dir = d.clone();
        }
        let jobs = manifest
            .graphs
            .iter()
            .map(|g| {
                let hlo = std::fs::read(args.out.join(&g.hlo))
                    .with_context(|| format!("reading {}", g.hlo))?;
                Ok(CompileJob {
                    name: g.name.clone(),
                    hlo,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for neff in compile_all(&cfg, &jobs)? {
            let path = args.out.join(format!("{}.neff", neff.name));
            std::fs::write(&path, &neff.neff)
                .with_context(|| format!("writing {}", path.display()))?;
            let how = if neff.cache_hit { "cached" } else { "compiled" };
            emit(&format!("{} -> {} ({how})", neff.name, path.display()))?;
        }
    }
    if args.stats {
        emit(deepinfer::lowering::stats_table(&manifest.costs).trim_end())?;
    } else {
        for g in &manifest.graphs {
            emit(&format!(
                "{} -> {}",
                g.name,
                args.out.join(&g.hlo).display()
            ))?;
        }
    }
    Ok(())
}

fn serve(args: ServeArgs) -> Result<()> {
    use deepinfer::engine::{Engine, EngineOptions};
    use deepinfer::server::{AppState, ServerConfig};
    use std::sync::Arc;

    let dir = model_dir(&args.model)?;
    check_model_dir(&dir)?;
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let tokenizer = if dir.join("tokenizer.json").is_file() {
        Some(Arc::new(Tokenizer::from_dir(&dir)?))
    } else {
        None
    };
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let max_len = args
        .max_len
        .unwrap_or(2048)
        .min(cfg.max_position_embeddings);
    let mut rc = RunnerConfig::for_limits(args.max_batch, max_len);
    if let Some(blocks) = args.kv_blocks {
        let one_sequence = rc.max_len().div_ceil(rc.block_size) + 1;
        if blocks < one_sequence {
            bail!(
                "--kv-blocks {blocks} cannot hold even one sequence of {} tokens: at least \
                 {one_sequence} blocks are needed (or lower --max-len)",
                rc.max_len()
            );
        }
        rc.num_blocks = blocks;
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    rc.prefill_chunk = args.prefill_chunk.min(rc.max_len());
    let eos: Vec<u32> = tokenizer
        .as_ref()
        .and_then(|t| t.eos_token_id())
        .into_iter()
        .chain(cfg.eos_token_ids.iter().copied())
        .collect();
    let served_model_name = match args.served_model_name {
        Some(n) => n,
        None => dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into()),
    };
    let metrics = Arc::new(deepinfer::metrics::Metrics::new());
    let backend = choose_backend(args.model.backend);
    let runner_dir = dir.clone();
    let engine = Engine::start(
        move || open_runner(&runner_dir, cfg, rc, Some(backend)),
        tokenizer.clone(),
        EngineOptions {
            max_waiting: args.max_waiting,
            eos_token_ids: eos,
            log_stats_every: (args.log_stats_secs > 0)
                .then(|| std::time::Duration::from_secs(args.log_stats_secs)),
        },
        metrics,
    )?;
    let engine = Arc::new(engine);
    let backend_name = match backend {
        Backend::Cpu => "cpu",
        Backend::Sim => "sim",
        Backend::Neuron => "neuron",
    };
    let config = ServerConfig {
        served_model_name: served_model_name.clone(),
        api_key: args.api_key.filter(|k| !k.is_empty()),
        max_body_bytes: args.max_body_bytes,
        drain_timeout: std::time::Duration::from_secs(args.drain_timeout_secs),
    };
    let state = Arc::new(AppState::new(config, engine, tokenizer));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        deepinfer::server::serve(listener, state, |bound| {
            eprintln!(
                "deepinfer: serving \"{served_model_name}\" on http://{bound} (backend {backend_name})"
            );
        })
        .await
        .context("serving")
    })
}

/// candle-core asks for its thread count on every matrix product, and without
/// `RAYON_NUM_THREADS` that means parsing `/proc/cpuinfo` each time (several percent of a
/// decode step). Setting it once, before any thread starts, makes the answer an env lookup.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

fn main() -> ExitCode {
    pin_thread_count();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Score(a) => score(a),
        Command::Bench(a) => bench(a),
        Command::Lower(a) => lower(a),
        Command::Serve(a) => serve(a),
        Command::Doctor => {
            let report = deepinfer::backend::neuron::runtime::doctor_report();
            match emit(report.to_string().trim_end()) {
                Ok(()) if report.neuron_ready() => Ok(()),
                Ok(()) => return ExitCode::FAILURE,
                Err(e) => Err(e),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
