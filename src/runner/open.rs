//! Choosing a backend and opening a captured runner on it: the one constructor the CLI, the
//! server and the tests share.

use std::path::Path;

use crate::backend::neuron::compile::CompilerConfig;
use crate::backend::neuron::sim_neff::NeffNames;
use crate::config::ModelConfig;
use crate::deployment::{InstanceSecret, Limits, RunnerConfig};
use crate::error::{Error, Result};
use crate::model::ModelWeights;
use crate::source::ModelSource;

use super::device::{DeviceOptions, DeviceRunner};
use super::instances::{Followers, Launch, Timeouts};
use super::sim::{find_sim_library, SIM_GIT_HASH};
use super::{Backend, CpuRunner, Runner};

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

/// On a device, a sequence's last token and its `--speculative-tokens` drafts verify as rows
/// of one decode graph (see `DeviceRunner`'s speculative steps): they must fit the largest
/// batch bucket.
fn check_device_drafts(backend: Backend, rc: &RunnerConfig) -> Result<()> {
    let k = rc.speculative_tokens;
    let batch = rc.buckets.max_batch();
    if backend == Backend::Cpu || k < batch {
        return Ok(());
    }
    Err(Error::InvalidInput(format!(
        "--speculative-tokens {k} on --backend {backend}: a sequence verifies its last token and \
         its drafts as rows of one decode graph, and the largest holds {batch} (--max-batch): \
         use --speculative-tokens {} or less, or a larger --max-batch",
        batch.saturating_sub(1)
    )))
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
    let mut cfg = source.config()?;
    if limits.speculative_tokens > 0 {
        cfg = cfg.with_draft_layer()?;
    }
    let mut runner_cfg = limits.runner_config(&cfg)?;
    check_device_drafts(backend, &runner_cfg)?;
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
    crate::model::mtp::share_absent_embeddings(&mut cfg, &checkpoint);
    let precision = limits.precision.resolve(checkpoint.float_dtype(), &cfg)?;
    runner_cfg.kv_dtype = precision.kv_cache;
    let weights = match backend {
        Backend::Cpu => {
            let what = model.display().to_string();
            crate::plan::host::check_cpu_load(&cfg, &checkpoint, &precision, &runner_cfg, &what)?;
            ModelWeights::load(&cfg, &checkpoint, &precision)?
        }
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
    if !limits.kv_blocks_auto {
        return Ok(runner);
    }
    // The plan sized the cache by the instance's HBM per core; the runtime, now started, may
    // say its cores hold less (what it reserves for itself; nrt-sim's NRT_SIM_HBM_BYTES): then
    // the cache is sized by what it says, before anything is allocated. Not less: the plan
    // already made stands.
    let cfg = runner.config().clone();
    let instance = device_plan_options(limits, cfg.saved_dtype, cores)?.instance;
    if let Some(free) = runner.free_hbm()?.filter(|&f| f < instance.hbm_per_core()) {
        let plan = device_plan_with(&cfg, limits, cfg.saved_dtype, cores, Some(free))?;
        runner.set_kv_blocks(plan.kv_blocks)?;
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
    check_device_drafts(backend, &runner_cfg)?;
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
