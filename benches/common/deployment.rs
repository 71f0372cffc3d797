//! The real deployment a bench measures, from the environment: backend, checkpoint, dtype,
//! quantization, tensor parallelism and limits (`DEEPINFER_BENCH_*`). Parsed here once for
//! `replay`'s `decode_step`, `prefill`'s `prefill_step` and `serve_load`'s spawned server, so
//! the three read the same variables the same way (included by each with `#[path]`). A malformed
//! value is an error naming the variable, never a default. Whether the deployment fits is the
//! memory plan's call, made by the code `deepinfer serve` runs (`runner::open`, or
//! `runner::device_plan` before a server is spawned); a bench prints its refusal as it is.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `DEEPINFER_BENCH_BACKEND` | `cpu`, `sim` or `neuron` | `neuron` when libnrt sees a NeuronCore, else the bench's (none: the rows are skipped) |
//! | `DEEPINFER_BENCH_MODEL` | checkpoint directory or GGUF file | the bench's fixture |
//! | `DEEPINFER_BENCH_DTYPE` | `--dtype`: auto, bf16, f16, f32 | the bench's (auto for a checkpoint given) |
//! | `DEEPINFER_BENCH_QUANTIZE` | `--quantize` | none |
//! | `DEEPINFER_BENCH_TP` | `--tp` | 1 |
//! | `DEEPINFER_BENCH_MAX_BATCH` | `--max-batch` (the largest decode bucket) | the bench's |
//! | `DEEPINFER_BENCH_MAX_LEN` | `--max-len` (the longest context bucket) | the bench's |
//! | `DEEPINFER_BENCH_PREFILL_CHUNK` | `--prefill-chunk` (the largest prefill bucket) | 64 |

// Each bench uses its part (the server's flags only serve_load, the plan check before a spawn
// only serve_load, the rest all three).
#![allow(dead_code)]

use std::path::PathBuf;

use deepinfer::deployment::Limits;
use deepinfer::graph::DType;
use deepinfer::model::{DTypeChoice, Quantize};
use deepinfer::runner::{self, Backend};

/// Every variable [`from_env`] and [`backend`] read.
pub const VARIABLES: [&str; 8] = [
    "DEEPINFER_BENCH_BACKEND",
    "DEEPINFER_BENCH_MODEL",
    "DEEPINFER_BENCH_DTYPE",
    "DEEPINFER_BENCH_QUANTIZE",
    "DEEPINFER_BENCH_TP",
    "DEEPINFER_BENCH_MAX_BATCH",
    "DEEPINFER_BENCH_MAX_LEN",
    "DEEPINFER_BENCH_PREFILL_CHUNK",
];

/// What a bench measures when the environment leaves a variable unset.
pub struct Defaults {
    /// The checkpoint without `DEEPINFER_BENCH_MODEL`.
    pub model: PathBuf,
    /// The dtype `model` is measured in without `DEEPINFER_BENCH_DTYPE` (`None`: auto; a
    /// checkpoint given by the variable is always auto by default).
    pub model_dtype: Option<DType>,
    /// Whether `model` is what the server loads with no `--model` (the embedded default
    /// model): then no `--model` flag is passed to a spawned server.
    pub model_is_embedded: bool,
    /// The largest decode batch without `DEEPINFER_BENCH_MAX_BATCH`.
    pub max_batch: usize,
    /// `None`: the server's default (the model's context, at most 2048), and no `--max-len`.
    pub max_len: Option<usize>,
}

/// The server's `--max-len` when none is given (`deepinfer serve`'s rule).
const SERVE_MAX_LEN: usize = 2048;

/// A deployment: where it runs, which checkpoint, and within which limits.
pub struct Deployment {
    /// Where its graphs run.
    pub backend: Backend,
    /// The checkpoint (a directory or a GGUF file).
    pub model: PathBuf,
    /// What `runner::open` sizes and types the runner by.
    pub limits: Limits,
    /// The `deepinfer serve` flags saying the same (only those the environment or the bench's
    /// defaults set, so an unset variable leaves the server's own default).
    pub serve_flags: Vec<String>,
}

/// A variable's value, `None` when unset or blank.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A positive count from `name`, `None` when unset.
fn count(name: &str) -> Result<Option<usize>, String> {
    var(name)
        .map(|v| match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{name}={v:?} is not a positive number")),
        })
        .transpose()
}

/// The backend the deployment rows run on: `DEEPINFER_BENCH_BACKEND`, else the one `deepinfer
/// serve` would pick when it is not `cpu` (`neuron` when libnrt loads and sees a NeuronCore, so
/// on a trn1 instance `cargo bench` measures the device; `sim` when `NEURON_RT_LIB` names
/// nrt-sim), else `otherwise` (`None`: the bench skips these rows here).
pub fn backend(otherwise: Option<Backend>) -> Result<Option<Backend>, String> {
    if let Some(b) = var("DEEPINFER_BENCH_BACKEND") {
        return b
            .trim()
            .parse()
            .map(Some)
            .map_err(|e| format!("DEEPINFER_BENCH_BACKEND={b:?}: {e}"));
    }
    Ok(match runner::choose_backend(None) {
        Backend::Cpu => otherwise,
        device => Some(device),
    })
}

/// The deployment on `backend` the `DEEPINFER_BENCH_*` variables describe, `defaults` filling
/// what they leave unset.
pub fn from_env(backend: Backend, defaults: &Defaults) -> Result<Deployment, String> {
    let mut flags = vec!["--backend".to_string(), backend.to_string()];
    let mut flag = |name: &str, value: String| {
        flags.push(name.to_string());
        flags.push(value);
    };
    let given = var("DEEPINFER_BENCH_MODEL").map(PathBuf::from);
    if let Some(m) = &given {
        if !m.exists() {
            return Err(format!(
                "DEEPINFER_BENCH_MODEL={}: no such file or directory",
                m.display()
            ));
        }
    }
    if given.is_some() || !defaults.model_is_embedded {
        let m = given.as_ref().unwrap_or(&defaults.model);
        flag("--model", m.display().to_string());
    }
    let dtype = match var("DEEPINFER_BENCH_DTYPE") {
        Some(d) => d
            .trim()
            .parse()
            .map_err(|e| format!("DEEPINFER_BENCH_DTYPE={d:?}: {e}"))?,
        None => match (given.is_some(), defaults.model_dtype) {
            (false, Some(d)) => DTypeChoice::Exactly(d),
            _ => DTypeChoice::Auto,
        },
    };
    flag("--dtype", dtype.to_string());
    let quantize: Quantize = match var("DEEPINFER_BENCH_QUANTIZE") {
        Some(q) => q
            .trim()
            .parse()
            .map_err(|e| format!("DEEPINFER_BENCH_QUANTIZE={q:?}: {e}"))?,
        None => Quantize::None,
    };
    flag("--quantize", quantize.to_string());
    let tp = count("DEEPINFER_BENCH_TP")?.unwrap_or(1);
    flag("--tp", tp.to_string());
    let max_batch = count("DEEPINFER_BENCH_MAX_BATCH")?.unwrap_or(defaults.max_batch);
    flag("--max-batch", max_batch.to_string());
    let max_len = count("DEEPINFER_BENCH_MAX_LEN")?.or(defaults.max_len);
    if let Some(n) = max_len {
        flag("--max-len", n.to_string());
    }
    let prefill_chunk = count("DEEPINFER_BENCH_PREFILL_CHUNK")?;
    if let Some(n) = prefill_chunk {
        flag("--prefill-chunk", n.to_string());
    }
    let mut limits = Limits {
        tp,
        prefill_chunk,
        ..Limits::new(max_batch, max_len.unwrap_or(SERVE_MAX_LEN))
    };
    limits.precision.dtype = dtype;
    limits.precision.quantize = quantize;
    Ok(Deployment {
        backend,
        model: given.unwrap_or_else(|| defaults.model.clone()),
        limits,
        serve_flags: flags,
    })
}

impl Deployment {
    /// `backend/model/tpN/dtype[/quantize]`: the criterion group or table title of its rows.
    pub fn label(&self) -> String {
        let model = self
            .model
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        let quantize = match self.limits.precision.quantize {
            Quantize::None => String::new(),
            q => format!("/{q}"),
        };
        format!(
            "{}/{model}/tp{}/{}{quantize}",
            self.backend, self.limits.tp, self.limits.precision.dtype
        )
    }

    /// On a device backend, the memory plan's verdict before anything is loaded, in the words
    /// `deepinfer serve` would refuse with (`runner::device_plan`, the check `runner::open`
    /// makes); `Ok` on the CPU, whose refusals come from opening the runner.
    pub fn check_fits(&self) -> Result<(), String> {
        if self.backend == Backend::Cpu {
            return Ok(());
        }
        let quantize = self.limits.precision.quantize;
        if quantize.is_cpu_only() {
            return Err(quantize
                .cpu_only_error(&format!("--backend {}", self.backend))
                .to_string());
        }
        let cfg = deepinfer::source::ModelSource::new(&self.model)
            .and_then(|s| s.config())
            .map_err(|e| format!("{}: {e}", self.model.display()))?;
        let lib: deepinfer::Result<_> = match self.backend {
            Backend::Sim => {
                runner::find_sim_library().and_then(|p| Ok(neuron_sys::Library::open(&p)?))
            }
            _ => neuron_sys::Library::load().map_err(deepinfer::Error::from),
        };
        let lib = lib.map_err(|e| format!("libnrt for --backend {}: {e}", self.backend))?;
        let cores = lib
            .visible_nc_count()
            .map_err(|e| format!("counting NeuronCores: {e}"))?
            .unwrap_or(1) as usize;
        runner::device_plan(&cfg, &self.limits, cfg.saved_dtype, cores)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

/// The deployment the environment describes for bench `name` (defaults `defaults`), opened as
/// `serve` opens it; `None`, with the reason printed, when no backend is named and none is
/// found, or when the memory plan (or anything else `runner::open` checks) refuses it. A
/// malformed variable panics with its message: a bench must not measure a default instead.
pub fn open(name: &str, defaults: &Defaults) -> Option<(Deployment, Box<dyn runner::Runner>)> {
    let backend = match backend(None) {
        Ok(Some(b)) => b,
        Ok(None) => {
            eprintln!(
                "{name}: no libnrt with a NeuronCore here; set DEEPINFER_BENCH_BACKEND=cpu|sim|neuron to run it"
            );
            return None;
        }
        Err(e) => panic!("{name}: {e}"),
    };
    let deployment = from_env(backend, defaults).unwrap_or_else(|e| panic!("{name}: {e}"));
    match runner::open(backend, &deployment.model, &deployment.limits) {
        Ok(r) => Some((deployment, r)),
        Err(e) => {
            eprintln!("{name}: {} not measured: {e}", deployment.label());
            None
        }
    }
}
