//! Choosing a backend and opening a captured runner on it: the one constructor the CLI, the
//! server and the tests share.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::backend::neuron::compile::CompilerConfig;
use crate::backend::neuron::sim_neff::{NeffNames, ENV_NEFF_NAMES, NAMES_FLAG};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{ModelWeights, PrecisionChoice};
use crate::source::ModelSource;

use super::device::RankSpan;
use super::instances::{Followers, InstanceSecret, Launch, Timeouts};
use super::{Backend, CpuRunner, DeviceOptions, DeviceRunner, Runner, RunnerConfig};

/// The file name of nrt-sim's shared library.
pub const SIM_LIBRARY_FILE: &str = "libnrt_sim.so";

/// The file name of nrt-sim's stand-in compiler (`src/bin/nrt-sim-neuronx-cc.rs`).
pub const SIM_COMPILER_FILE: &str = "nrt-sim-neuronx-cc";

/// The `git_hash` nrt-sim reports from `nrt_get_version`: how a loaded libnrt is recognised
/// as the simulator (whose NEFFs its stand-in compiler writes, see [`sim_compiler`]).
pub const SIM_GIT_HASH: &str = "nrt-sim";

/// The backend to use: the one asked for, else `sim` when `NEURON_RT_LIB` points at nrt-sim,
/// else `neuron` when libnrt loads and sees a NeuronCore, else `cpu`.
pub fn choose_backend(asked: Option<Backend>) -> Backend {
    if let Some(b) = asked {
        return b;
    }
    match neuron_sys::Library::load() {
        Ok(lib) if matches!(lib.version(), Ok(Some(v)) if v.git_hash == SIM_GIT_HASH) => {
            Backend::Sim
        }
        Ok(lib) if matches!(lib.visible_nc_count(), Ok(Some(n)) if n > 0) => Backend::Neuron,
        _ => Backend::Cpu,
    }
}

/// What a user sizes and types a runner by: [`Limits::runner_config`] turns it into buckets and
/// a cache; its `precision` resolves into the dtypes weights and cache are held in.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Sequences decoded together at most (the largest batch bucket).
    pub max_batch: usize,
    /// Longest sequence, prompt plus completion; capped at the model's
    /// `max_position_embeddings`.
    pub max_len: usize,
    /// KV-cache blocks, scratch included (default: every sequence at full length).
    pub kv_blocks: Option<usize>,
    /// `--kv-blocks auto`: on a device, as many blocks as fit each NeuronCore's HBM after the
    /// weights, metadata, outputs and NEFF (the memory plan's [`crate::plan::auto_kv_blocks`]);
    /// overrides `kv_blocks`. On the CPU, the default.
    pub kv_blocks_auto: bool,
    /// `--hbm-utilization`: the share of each NeuronCore's HBM the memory plan may fill.
    pub hbm_utilization: f64,
    /// Most prompt tokens per prefill step (default: 64, at most `max_len`).
    pub prefill_chunk: Option<usize>,
    /// Most sequences one prefill step packs (default
    /// [`super::buckets::DEFAULT_PREFILL_SEQS`], at most `max_batch`; 1 turns packing off).
    pub prefill_seqs: Option<usize>,
    /// `--dtype`, `--kv-dtype`, `--quantize`.
    pub precision: PrecisionChoice,
    /// `--compile-timeout`: how long one neuronx-cc process may run (default
    /// [`crate::backend::neuron::compile::DEFAULT_TIMEOUT`]).
    pub compile_timeout: Option<Duration>,
    /// `--tp`: the tensor-parallel degree (default 1).
    pub tp: usize,
    /// `--ranks`: the global ranks this process runs (default: all of them); fewer when the
    /// model spans several instances (see [`super::instances`]).
    pub ranks: Option<RankSpan>,
    /// `--followers`: the addresses of the processes running the other ranks, in rank order,
    /// for the leader of a model over several instances; empty for one instance.
    pub followers: Vec<String>,
    /// The secret the leader proves to its followers ([`super::instances::ENV_SECRET`]);
    /// required with `followers`.
    pub instance_secret: Option<super::instances::InstanceSecret>,
    /// `--split-sampler`: device decode steps run the forward pass and the sampler as two
    /// graphs, so constrained rows' masks are computed while the forward pass runs
    /// ([`DeviceOptions::split_sampler`]). The CPU backend ignores it.
    pub split_sampler: bool,
    /// Capture returns once the first buckets are loaded and the rest compile in the
    /// background ([`DeviceOptions::background_compile`]; `deepinfer serve`'s default). Only
    /// where this process runs every rank with no followers; otherwise, and on the CPU, every
    /// bucket is captured first.
    pub background_compile: bool,
}

impl Limits {
    /// `max_batch` sequences of up to `max_len` tokens, default cache and chunk.
    pub fn new(max_batch: usize, max_len: usize) -> Self {
        Limits {
            max_batch,
            max_len,
            kv_blocks: None,
            kv_blocks_auto: false,
            hbm_utilization: crate::plan::DEFAULT_HBM_UTILIZATION,
            prefill_chunk: None,
            prefill_seqs: None,
            precision: PrecisionChoice::default(),
            compile_timeout: None,
            tp: 1,
            ranks: None,
            followers: Vec::new(),
            instance_secret: None,
            split_sampler: false,
            background_compile: false,
        }
    }

    /// The compiler configuration a Neuron capture within these limits uses: the defaults
    /// ([`CompilerConfig::default`]) with `compile_timeout` applied.
    pub fn compiler_config(&self) -> CompilerConfig {
        let mut cc = CompilerConfig::default();
        if let Some(t) = self.compile_timeout {
            cc.timeout = t;
        }
        cc
    }

    /// The runner configuration for `cfg` within these limits, or an error naming the limit
    /// that cannot work.
    pub fn runner_config(&self, cfg: &ModelConfig) -> Result<RunnerConfig> {
        if self.max_batch == 0 {
            return Err(Error::InvalidInput("--max-batch must be at least 1".into()));
        }
        if self.max_len == 0 {
            return Err(Error::InvalidInput("--max-len must be at least 1".into()));
        }
        crate::model::shard::validate(cfg, self.tp)?;
        let max_len = self.max_len.min(cfg.max_position_embeddings);
        let mut rc = RunnerConfig::for_limits(self.max_batch, max_len);
        rc.tp = self.tp;
        let longest = rc.buckets.max_len();
        if let Some(blocks) = self.kv_blocks {
            let one_sequence = longest.div_ceil(rc.block_size) + 1;
            if blocks < one_sequence {
                return Err(Error::InvalidInput(format!(
                    "--kv-blocks {blocks} cannot hold even one sequence of {longest} tokens: at \
                     least {one_sequence} blocks are needed (or lower --max-len)"
                )));
            }
            rc.num_blocks = blocks;
        }
        if let Some(chunk) = self.prefill_chunk {
            if chunk == 0 {
                return Err(Error::InvalidInput(
                    "--prefill-chunk must be at least 1".into(),
                ));
            }
            rc.buckets.prefill_chunk = chunk.min(longest);
        }
        if let Some(seqs) = self.prefill_seqs {
            if seqs == 0 {
                return Err(Error::InvalidInput(
                    "--max-prefill-seqs must be at least 1".into(),
                ));
            }
            rc.buckets.prefill_seqs = seqs.min(self.max_batch);
        }
        Ok(rc)
    }
}

/// Loads the model at `model` (a checkpoint directory or a GGUF file), builds a runner within
/// `limits` on `backend` and captures its buckets. With `limits.followers`, this process leads
/// a model over several instances: it launches the followers, captures its own ranks while
/// they capture theirs, and checks them (see [`super::instances`]).
pub fn open(backend: Backend, model: &Path, limits: &Limits) -> Result<Box<dyn Runner>> {
    check_instances(backend, limits)?;
    if backend == Backend::Cpu {
        let (cfg, weights, runner_cfg) = load(backend, model, limits)?;
        return open_captured(backend, cfg, weights, runner_cfg, limits.compiler_config());
    }
    let pending = match (limits.followers.is_empty(), &limits.instance_secret) {
        (true, _) => None,
        (false, None) => return Err(InstanceSecret::missing("--followers")),
        (false, Some(secret)) => Some(Followers::launch(
            &limits.followers,
            &Launch::of(limits),
            secret,
            Timeouts::default(),
        )?),
    };
    let mut runner = prepare_device(backend, model, limits)?;
    // The followers capture only once their setups agree with this one, and at the same time
    // as this process (every rank loads each NEFF at once: see `instances`).
    let capturing = match pending {
        Some(p) => Some(p.agree(&runner.setup(), limits.tp)?),
        None => None,
    };
    let buckets = runner.runner_config().buckets.clone();
    runner.capture(&buckets)?;
    if let Some(capturing) = capturing {
        runner.attach_followers(capturing.join()?)?;
    }
    Ok(Box::new(runner))
}

/// `--ranks` and `--followers` make sense together: ranks on a device backend only, a span
/// inside `--tp`, and a leader (followers given) running the ranks from 0, short of `--tp`.
fn check_instances(backend: Backend, limits: &Limits) -> Result<()> {
    let Some(span) = limits.ranks else {
        return match limits.followers.is_empty() {
            true => Ok(()),
            false => Err(Error::InvalidInput(
                "--followers needs --ranks 0..K: the ranks this process (the leader) runs".into(),
            )),
        };
    };
    let end = span.first + span.count;
    if backend == Backend::Cpu {
        return Err(Error::InvalidInput(
            "--ranks splits a model over several instances' NeuronCores: use --backend neuron \
             (on the CPU, --tp runs every rank as a thread of one process)"
                .into(),
        ));
    }
    if span.count == 0 || end > limits.tp {
        return Err(Error::InvalidInput(format!(
            "--ranks {}..{end} is not a span of the --tp {} ranks",
            span.first, limits.tp
        )));
    }
    if !limits.followers.is_empty() && (span.first != 0 || span.count == limits.tp) {
        return Err(Error::InvalidInput(format!(
            "with --followers this process is the leader: --ranks 0..K with K below --tp {} \
             (got {}..{end})",
            limits.tp, span.first
        )));
    }
    Ok(())
}

/// The model's configuration, weights and runner configuration within `limits` for `backend`:
/// on a device, checked against the memory plan before the checkpoint is read, and streamed
/// (each rank's shards go from the checkpoint to its core at capture, no host copy).
fn load(
    backend: Backend,
    model: &Path,
    limits: &Limits,
) -> Result<(ModelConfig, ModelWeights, RunnerConfig)> {
    let source = ModelSource::new(model)?;
    let cfg = source.config()?;
    let mut runner_cfg = limits.runner_config(&cfg)?;
    if backend != Backend::Cpu {
        let quantize = limits.precision.quantize;
        if quantize.is_cpu_only() {
            return Err(quantize.cpu_only_error(&format!("--backend {backend}")));
        }
        // Before the checkpoint is read or a graph compiled: the plan must fit the NeuronCores
        // (the dtype `auto` resolves to is config.json's, as the checkpoint is not open yet).
        let cores = device_library(backend)?.visible_nc_count()?.unwrap_or(1) as usize;
        let plan = device_plan(&cfg, limits, cfg.saved_dtype, cores)?;
        if limits.kv_blocks_auto {
            runner_cfg.num_blocks = plan.kv_blocks;
        }
    }
    let checkpoint = source.checkpoint()?;
    let precision = limits.precision.resolve(checkpoint.float_dtype(), &cfg)?;
    runner_cfg.kv_dtype = precision.kv_cache;
    let weights = match backend {
        Backend::Cpu => ModelWeights::load(&cfg, &checkpoint, &precision)?,
        _ => ModelWeights::stream(&cfg, std::sync::Arc::new(checkpoint), &precision)?,
    };
    Ok((cfg, weights, runner_cfg))
}

/// A device runner (`backend` sim or neuron) for the model at `model` within `limits`,
/// running `limits.ranks` (default all) of its `--tp` ranks, planned and opened but not yet
/// captured (nothing compiled or loaded); no followers attached.
pub(crate) fn prepare_device(
    backend: Backend,
    model: &Path,
    limits: &Limits,
) -> Result<DeviceRunner> {
    let (cfg, weights, runner_cfg) = load(backend, model, limits)?;
    let mut opts = device_options(backend, limits.compiler_config())?;
    opts.ranks = limits.ranks;
    opts.split_sampler = limits.split_sampler;
    opts.background_compile =
        limits.background_compile && limits.ranks.is_none() && limits.followers.is_empty();
    let lib = device_library(backend)?;
    let cores = lib.visible_nc_count()?.unwrap_or(1) as usize;
    let mut runner = DeviceRunner::new(cfg, weights, runner_cfg, lib, opts)?;
    if limits.kv_blocks_auto {
        // The plan sized the cache by the instance's HBM per core; the runtime, now started,
        // may say its cores hold less (what it reserves for itself; nrt-sim's
        // NRT_SIM_HBM_BYTES): then the cache is sized by what it says, before anything is
        // allocated.
        if let Some(free) = runner.free_hbm()? {
            let cfg = runner.config().clone();
            let plan = device_plan_with(&cfg, limits, cfg.saved_dtype, cores, Some(free))?;
            runner.set_kv_blocks(plan.kv_blocks)?;
        }
    }
    Ok(runner)
}

/// The libnrt of `backend`: nrt-sim's for sim, else the installed one.
fn device_library(backend: Backend) -> Result<std::sync::Arc<neuron_sys::Library>> {
    Ok(match backend {
        Backend::Sim => neuron_sys::Library::open(&find_sim_library()?)?,
        _ => neuron_sys::Library::load()?,
    })
}

/// The device options of `backend` (sim or neuron) compiling with `compiler` on neuron.
fn device_options(backend: Backend, compiler: CompilerConfig) -> Result<DeviceOptions> {
    match backend {
        Backend::Sim => {
            let names = NeffNames::from_env().map_err(|e| Error::InvalidInput(e.to_string()))?;
            Ok(DeviceOptions::sim_named(names))
        }
        Backend::Neuron => Ok(DeviceOptions::neuron(compiler)),
        Backend::Cpu => Err(Error::Internal("device options for the CPU backend".into())),
    }
}

/// The memory plan of a device capture within `limits` on a trn instance with `cores` visible
/// NeuronCores (a trn1.2xlarge for up to 2, a trn1.32xlarge for up to 32, else a
/// trn2.48xlarge), for a checkpoint saved in `saved`; an error naming every shortfall and the
/// nearest plan that fits (`deepinfer plan`'s suggestion) when it does not fit.
pub fn device_plan(
    cfg: &ModelConfig,
    limits: &Limits,
    saved: Option<crate::graph::DType>,
    cores: usize,
) -> Result<crate::plan::Plan> {
    device_plan_with(cfg, limits, saved, cores, None)
}

/// [`device_plan`] with each core holding at most `hbm_per_core` bytes, as the runtime counts
/// them ([`crate::plan::PlanOptions::hbm_per_core`]).
fn device_plan_with(
    cfg: &ModelConfig,
    limits: &Limits,
    saved: Option<crate::graph::DType>,
    cores: usize,
    hbm_per_core: Option<u64>,
) -> Result<crate::plan::Plan> {
    use crate::plan;
    // More ranks than this process sees: said in what a runner's user can change (the plan's
    // own message would suggest `--instance`, a flag only `deepinfer plan` takes).
    let local = limits.ranks.map_or(limits.tp, |r| r.count);
    if local > cores {
        let fits: Vec<String> = plan::valid_tps(cfg, cores)
            .iter()
            .map(usize::to_string)
            .collect();
        let lower = match fits.is_empty() {
            true => String::new(),
            false => format!("use --tp {}, or ", fits.join(", ")),
        };
        return Err(Error::InvalidInput(format!(
            "--tp {} needs {local} NeuronCores here but {cores} are visible: {lower}run where \
             more are visible (a trn1.32xlarge has 32, selected with NEURON_RT_VISIBLE_CORES; \
             on --backend sim, NRT_SIM_NC_COUNT), or split the ranks over instances with \
             --ranks and --followers",
            limits.tp
        )));
    }
    let opts = plan::PlanOptions {
        hbm_per_core,
        ..device_plan_options(limits, saved, cores)?
    };
    let instance = opts.instance;
    let p = plan::Plan::compute(cfg, &opts)?;
    if p.fits() {
        return Ok(p);
    }
    let fix = plan::suggest(cfg, &opts)?
        .first()
        .map(|s| format!("; what would: {}", s.describe()))
        .unwrap_or_default();
    Err(Error::InvalidInput(format!(
        "the model does not fit a {instance} at --tp {}: {}{fix} (see `deepinfer plan`)",
        limits.tp,
        p.shortfalls().join("; ")
    )))
}

/// The memory plan's options for a device capture within `limits` on a trn instance with
/// `cores` visible NeuronCores ([`device_plan`]'s rule for the instance), for a checkpoint saved
/// in `saved`: public so that a report (`deepinfer first-contact`) can plan exactly what a
/// capture will check, and show the figures even when they do not fit.
pub fn device_plan_options(
    limits: &Limits,
    saved: Option<crate::graph::DType>,
    cores: usize,
) -> Result<crate::plan::PlanOptions> {
    use crate::plan::{Instance, KvBlocks, PlanOptions, WeightDType};
    let instance = match cores {
        0..=2 => Instance::Trn1_2xlarge,
        3..=32 => Instance::Trn1_32xlarge,
        _ => Instance::Trn2_48xlarge,
    };
    Ok(PlanOptions {
        instance,
        // A process running some of the ranks is one of the instances that run them all.
        instances: limits
            .ranks
            .map_or(1, |r| limits.tp.div_ceil(r.count.max(1))),
        tp: limits.tp,
        dtype: match limits.precision.dtype {
            crate::model::DTypeChoice::Auto => WeightDType::Auto,
            crate::model::DTypeChoice::Exactly(d) => WeightDType::Float(d),
        },
        kv_dtype: limits.precision.kv_dtype,
        experts: limits.precision.quantize.try_into()?,
        max_batch: limits.max_batch,
        max_len: limits.max_len,
        prefill_chunk: limits.prefill_chunk,
        prefill_seqs: limits.prefill_seqs,
        kv_blocks: match (limits.kv_blocks_auto, limits.kv_blocks) {
            (true, _) => KvBlocks::Auto,
            (false, Some(n)) => KvBlocks::Exactly(n),
            (false, None) => KvBlocks::Default,
        },
        hbm_utilization: limits.hbm_utilization,
        hbm_per_core: None,
        saved_dtype: saved,
        split_sampler: limits.split_sampler,
    })
}

/// [`open`] with a configuration and weights already in memory (random weights for a
/// benchmark, a checkpoint shared by several runners in a test).
pub fn open_with_weights(
    backend: Backend,
    cfg: ModelConfig,
    weights: ModelWeights,
    runner_cfg: RunnerConfig,
) -> Result<Box<dyn Runner>> {
    open_captured(backend, cfg, weights, runner_cfg, CompilerConfig::default())
}

/// [`open_with_weights`] compiling with `compiler` on the Neuron backend.
fn open_captured(
    backend: Backend,
    cfg: ModelConfig,
    weights: ModelWeights,
    runner_cfg: RunnerConfig,
    compiler: CompilerConfig,
) -> Result<Box<dyn Runner>> {
    let buckets = runner_cfg.buckets.clone();
    let mut runner: Box<dyn Runner> = match backend {
        Backend::Cpu => Box::new(CpuRunner::new(cfg, weights, runner_cfg)?),
        _ => {
            let opts = device_options(backend, compiler)?;
            let lib = device_library(backend)?;
            Box::new(DeviceRunner::new(cfg, weights, runner_cfg, lib, opts)?)
        }
    };
    runner.capture(&buckets)?;
    Ok(runner)
}

/// The stand-in compiler `--backend sim` runs: the first of [`sim_library_beside_exe`]'s
/// directories holding [`SIM_COMPILER_FILE`] (cargo writes it to `target/<profile>/`, beside the
/// CLI and one level above a test binary), else the bare name, looked up on `PATH` by the
/// compile driver (which reports a clear error when it is nowhere).
pub fn sim_compiler() -> PathBuf {
    sim_library_beside_exe()
        .into_iter()
        .filter_map(|lib| lib.parent().map(|d| d.join(SIM_COMPILER_FILE)))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(SIM_COMPILER_FILE))
}

/// The compile driver's configuration for nrt-sim: the stand-in compiler ([`sim_compiler`]), the
/// default flags plus the naming convention (`names`, part of the cache key), and a cache of its
/// own (`$DEEPINFER_NEFF_CACHE` when set, else `<tmp>/deepinfer-nrt-sim-neff`: sim NEFFs are
/// cheap to remake and do not belong in the user's NEFF cache). One compiler process per CPU,
/// since the stand-in is quick and single-threaded.
pub fn sim_compiler_config(names: NeffNames) -> CompilerConfig {
    sim_compiler_config_flag(names.flag())
}

/// [`sim_compiler_config`] with the convention `NRT_SIM_NEFF_NAMES` names, else the default,
/// passed to the stand-in as given: a value naming no convention fails the compile with the
/// stand-in's message (at capture, where a `Result` is returned), never silently the default.
/// How `NRT_SIM_NEFF_NAMES=positional cargo test --workspace` runs every sim test under that
/// convention.
pub fn sim_compiler_config_from_env() -> CompilerConfig {
    let value = std::env::var(ENV_NEFF_NAMES)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| NeffNames::default().as_str().to_string());
    sim_compiler_config_flag(format!("{NAMES_FLAG}={value}"))
}

fn sim_compiler_config_flag(names_flag: String) -> CompilerConfig {
    let base = CompilerConfig::default();
    let cache_dir = if std::env::var_os("DEEPINFER_NEFF_CACHE").is_none_or(|v| v.is_empty()) {
        std::env::temp_dir().join("deepinfer-nrt-sim-neff")
    } else {
        base.cache_dir.clone()
    };
    let mut flags = base.flags.clone();
    flags.push(names_flag);
    CompilerConfig {
        program: sim_compiler(),
        flags,
        jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cache_dir,
        progress: false,
        ..base
    }
}

/// Where `--backend sim` looks for nrt-sim, in order: `NEURON_RT_LIB` when set, then
/// [`sim_library_beside_exe`].
pub fn sim_library_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(neuron_sys::NEURON_RT_LIB).filter(|v| !v.is_empty()) {
        out.push(PathBuf::from(p));
    }
    out.extend(sim_library_beside_exe());
    out
}

/// Where cargo puts nrt-sim's library relative to the running executable, in order: beside
/// it, in its `deps/` directory, then in its parent directory. A binary lives in
/// `target/<profile>/` beside the library; a test or bench lives in `target/<profile>/deps/`,
/// where `cargo test` also writes the library; an example lives one level below the library.
/// nrt-sim's own test helpers look here too, so the rule is written once.
pub fn sim_library_beside_exe() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            out.push(dir.join(SIM_LIBRARY_FILE));
            out.push(dir.join("deps").join(SIM_LIBRARY_FILE));
            if let Some(up) = dir.parent() {
                out.push(up.join(SIM_LIBRARY_FILE));
            }
        }
    }
    out
}

/// The first of [`sim_library_candidates`] that exists, or an error listing where it looked.
pub fn find_sim_library() -> Result<PathBuf> {
    let candidates = sim_library_candidates();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            let places: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            Error::Unavailable(format!(
                "nrt-sim ({SIM_LIBRARY_FILE}) not found; looked in {}. Build it with \
                 `cargo build -p nrt-sim`, or set NEURON_RT_LIB to its path, or use `--backend cpu`",
                places.join(", ")
            ))
        })
}
