//! The `deepinfer` command line: serve, generate, score, benchmark, lower and plan
//! DeepSeek-architecture models.
//!
//! Each command lives in its own module with its arguments; this file holds what they share
//! (the model and backend arguments, the default model, printing) and the dispatch. Backend
//! choice and runner construction are the library's ([`deepinfer::runner::open`]); the binary
//! only turns flags into [`Limits`] and prints.

#![deny(clippy::unwrap_used)]

/// jemalloc with transparent huge pages (configured in `.cargo/config.toml`): the weights a
/// CPU step streams then cost far fewer TLB misses (see tikv-jemallocator in Cargo.toml).
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod bench;
mod first_contact;
mod follow;
mod generate;
mod logging;
mod lower;
mod plan;
mod score;
mod serve;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use deepinfer::deployment::{InstanceSecret, Limits, RankSpan};
use deepinfer::model::{DTypeChoice, PrecisionChoice, Quantize};
use deepinfer::runner::{self, Backend, Runner};
use deepinfer::source::ModelSource;
use deepinfer::tokenizer::Tokenizer;

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
    Generate(generate::GenerateArgs),
    /// Print the logits of every position of a token sequence as JSON.
    Score(score::ScoreArgs),
    /// Measure decode throughput (tokens/s) at one batch size.
    Bench(bench::BenchArgs),
    /// Lower the model's bucket graphs to XLA HLO files with a manifest.
    Lower(lower::LowerArgs),
    /// Report whether the Neuron backend can run here: libnrt, NeuronCores, neuronx-cc.
    Doctor,
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Per-NeuronCore memory plan of a (tensor-parallel) deployment: whether it fits an
    /// instance, and what would. Exit status 0 when it fits, 1 when not, 2 on bad flags.
    Plan(plan::PlanArgs),
    /// Run some ranks of a model split over several instances for a leader elsewhere (which
    /// sends the launch and every step): wait for it, capture, run its steps until it ends.
    Follow(follow::FollowArgs),
    /// On a fresh trn1 (or with --sim, on nrt-sim): doctor, plan, check, compile, capture,
    /// parity with the CPU backend and a short bench, stopping at the first failure; writes
    /// DIR/report.json and DIR/report.md. Exit status 0 when every step passed, 1 when one
    /// failed, 2 when there is no Neuron here.
    FirstContact(first_contact::FirstContactArgs),
}

/// The model and backend arguments every running command takes.
#[derive(Args)]
struct ModelArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a GGUF file
    /// (llama.cpp's format, a DeepSeek-V2/V3 `deepseek2` model). Defaults to the embedded
    /// default model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where graphs run: cpu, sim (nrt-sim) or neuron. Default: `sim` when NEURON_RT_LIB names
    /// nrt-sim, `neuron` when libnrt and a NeuronCore are present, else `cpu`.
    #[arg(long)]
    backend: Option<Backend>,
    /// Seconds one neuronx-cc process may run at capture before it is killed (default 3600).
    #[arg(long, value_parser = lower::parse_seconds)]
    compile_timeout: Option<std::time::Duration>,
    /// Tensor parallelism: split the model over this many NeuronCores (1, 2, 4, 8, 16, 32 or
    /// 64; attention heads, MLP columns, experts and vocabulary divided among them). On the
    /// CPU backend each rank is a thread.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// The global ranks this process runs, FIRST..END (default: all of --tp). A model over
    /// several instances runs one process per instance: this one, the leader, runs 0..K and
    /// lists the others in --followers.
    #[arg(long, value_name = "FIRST..END")]
    ranks: Option<RankSpan>,
    /// The followers running the ranks after --ranks, as HOST:PORT, comma-separated, in rank
    /// order: each started with `deepinfer follow` on its instance (see the README).
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT")]
    followers: Vec<String>,
    /// On a device (sim or neuron): run each decode step as two graphs, the forward pass and
    /// the sampler, so that structured outputs' allowed-token masks are computed on the host
    /// while the forward pass runs instead of before it. Costs a second graph execution per
    /// decode step and one small graph per batch bucket at capture.
    #[arg(long)]
    split_sampler: bool,
    #[command(flatten)]
    precision: PrecisionArgs,
}

/// The dtypes the model is served in (see `deepinfer::model::precision`).
#[derive(Args, Clone, Copy)]
struct PrecisionArgs {
    /// The weights' dtype: auto (the checkpoint's own; FP8 checkpoints are dequantized to bf16),
    /// bf16, f16 or f32. Matmuls accumulate in f32 whatever this is.
    #[arg(long, default_value = "auto")]
    dtype: DTypeChoice,
    /// The KV cache's dtype: auto (the weights'), bf16, f16 or f32.
    #[arg(long, default_value = "auto")]
    kv_dtype: DTypeChoice,
    /// Weight-only quantization at load: none; experts-int8 (routed experts in int8 with a
    /// per-output-channel scale; nearly halves a bf16 DeepSeek model; every backend);
    /// experts-int4 (routed experts in 4 bits with a scale per 128 inputs; about a third of
    /// bf16; every backend, made for NeuronCores: the CPU dequantizes the selected experts
    /// each step); or, on the CPU backend only, GGML's q8_0 or q4_k for every linear layer
    /// (llama.cpp's formats).
    #[arg(long, default_value = "none")]
    quantize: Quantize,
}

impl PrecisionArgs {
    /// What was asked for, for the library to resolve.
    fn choice(self) -> PrecisionChoice {
        PrecisionChoice {
            dtype: self.dtype,
            kv_dtype: self.kv_dtype,
            quantize: self.quantize,
        }
    }

    /// `limits` with these dtypes.
    fn apply(self, limits: &Limits) -> Limits {
        Limits {
            precision: self.choice(),
            ..limits.clone()
        }
    }
}

impl ModelArgs {
    /// The model: the directory or GGUF file given, else the embedded default model.
    fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(d) => Ok(ModelSource::new(d)?.path().to_path_buf()),
            None => default_model_dir(),
        }
    }

    /// `limits` with these dtypes and this compile timeout; with `--followers`, the
    /// instances' shared secret from the environment.
    fn limits(&self, limits: &Limits) -> Result<Limits> {
        let instance_secret = match self.followers.is_empty() {
            true => None,
            false => InstanceSecret::from_env()?,
        };
        Ok(Limits {
            compile_timeout: self.compile_timeout,
            tp: self.tp,
            ranks: self.ranks,
            followers: self.followers.clone(),
            instance_secret,
            split_sampler: self.split_sampler,
            ..self.precision.apply(limits)
        })
    }

    /// Opens a captured runner for the model within `limits` on the chosen backend.
    fn open(&self, dir: &Path, limits: &Limits) -> Result<Box<dyn Runner>> {
        let backend = runner::choose_backend(self.backend);
        let limits = self.limits(limits)?;
        announce_capture(backend, dir, &limits)?;
        Ok(runner::open(backend, dir, &limits)?)
    }
}

/// The tokenizer of the model at `dir`: its tokenizer.json, or a GGUF file's own; `None` for a
/// directory without one (commands then take token ids).
fn tokenizer_of(dir: &Path) -> Result<Option<Tokenizer>> {
    if dir.join("tokenizer.json").is_file() || deepinfer::gguf::is_gguf(dir) {
        return Ok(Some(Tokenizer::from_dir(dir)?));
    }
    Ok(None)
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

/// Prints one line to stdout; a closed pipe (`| head`) ends the program quietly, not with a panic.
fn emit(line: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        r => Ok(r?),
    }
}

/// Before a Neuron capture, says on stderr how many NEFFs it compiles (one per decode and
/// prefill bucket): each takes minutes, so the user should know what the wait is for. Other
/// backends compile nothing and print nothing (tests count stderr lines).
fn announce_capture(backend: Backend, dir: &Path, limits: &Limits) -> Result<()> {
    if backend != Backend::Neuron {
        return Ok(());
    }
    let cfg = ModelSource::new(dir)?.config()?;
    let b = limits.runner_config(&cfg)?.buckets;
    let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let packed = b.graph_count() - (b.batch.len() + b.prefill_sizes().len()) * b.ctx.len();
    let decode = b.batch.len() * b.ctx.len();
    // Split: a sampling and an argmax graph per batch size. Fused: a greedy graph per decode
    // bucket where it pays (`deployment::keep_paying_greedy`), which only the graphs tell.
    let (samplers, greedy) = match limits.split_sampler {
        true => (b.batch.len(), String::new()),
        false => (
            0,
            format!(
                ", and up to {decode} greedy decode graphs (where the sampler is at least a \
                 tenth of the step)"
            ),
        ),
    };
    eprintln!(
        "deepinfer: capture compiles {} NEFFs ({decode} decode: batch {} x context {}; {} \
         prefill: chunk {} x context {}; {packed} packed prefill of up to {} sequences; \
         {samplers} sampling and {samplers} argmax graphs){greedy}; NEFFs already in the \
         cache are reused",
        b.graph_count() + 2 * samplers,
        list(&b.batch),
        list(&b.ctx),
        b.prefill_sizes().len() * b.ctx.len(),
        list(&b.prefill_sizes()),
        list(&b.ctx),
        b.prefill_seqs,
    );
    if limits.background_compile && limits.ranks.is_none() && limits.followers.is_empty() {
        eprintln!(
            "deepinfer: serving starts once 2 buckets are loaded (decode batch {} and prefill \
             chunk {} at context {}); the rest compile in the background and join as they \
             load (--compile-all-first to wait for all)",
            b.batch.first().copied().unwrap_or(1),
            b.prefill_chunk,
            b.max_len()
        );
    }
    Ok(())
}

fn doctor() -> Result<ExitCode> {
    let report = deepinfer::backend::neuron::doctor::doctor_report();
    emit(report.to_string().trim_end())?;
    Ok(if report.neuron_ready() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn main() -> ExitCode {
    deepinfer::backend::cpu::pin_thread_count();
    logging::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Score(a) => score::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Lower(a) => lower::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Follow(a) => follow::run(a),
        Command::Plan(a) => match plan::run(a) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
        Command::FirstContact(a) => match first_contact::run(a) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
        Command::Doctor => match doctor() {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
