//! The memory plan: what each NeuronCore of a tensor-parallel deployment holds, before anything
//! is compiled or loaded, and whether it fits.
//!
//! A DeepSeek model does not fit one 16 GiB NeuronCore (V2-Lite is 29.3 GiB in bf16), so the
//! runner shards it over N cores (`--tp N`, see [`bytes`] for the rules). Finding out at load
//! time, after minutes of compiling, that a shard does not fit is the failure this module
//! prevents: [`Plan::compute`] adds up, per rank, the weight shards, the KV cache root, the step
//! metadata buffers, the persistent outputs and an estimate of NEFF code and scratchpad
//! ([`neff`]), compares them with HBM x `--hbm-utilization` (vLLM's
//! `gpu_memory_utilization`: the rest is left to the runtime and to error in the estimates),
//! and [`suggest()`] searches for the smallest change that fits.
//!
//! ```no_run
//! # use deepinfer::config::ModelConfig;
//! # use deepinfer::plan::{Plan, PlanOptions};
//! # fn main() -> deepinfer::Result<()> {
//! let cfg = ModelConfig::from_file("config.json".as_ref())?;
//! let plan = Plan::compute(&cfg, &PlanOptions { tp: 2, ..PlanOptions::default() })?;
//! if !plan.fits() {
//!     eprintln!("{}", plan.shortfalls().join("; "));
//! }
//! # Ok(()) }
//! ```
//!
//! # KV blocks that fit
//!
//! [`auto_kv_blocks`] (`plan --kv-blocks auto`) is the runner-facing half: the number of
//! cache blocks (scratch block included) that fit on every rank after everything else, the
//! smallest over ranks, because every rank holds the whole latent cache (MLA's latent has no
//! head dimension to split). It is not capped at what `--max-batch` sequences of `--max-len`
//! need: spare blocks let the scheduler keep more sequences' caches resident.
//!
//! # What is counted per rank
//!
//! - weights: [`bytes`];
//! - KV root: `kv_blocks x block_size` rows of `layers x (kv_lora_rank + qk_rope_head_dim)` in
//!   the KV dtype, whole on every rank;
//! - metadata: the persistent step buffers the device runner allocates per context bucket, at
//!   the largest batch (decode: eight `[batch]` i32/f32 vectors and `block_tables
//!   [batch, ctx/block]`) and the prefill chunk packing the most sequences `s` at that
//!   context (three `[chunk]` vectors, `seq_ids [chunk]` when `s > 1`, `s` block-table rows,
//!   `last_index [s]` and four `[s]` sampling vectors);
//! - outputs: `next_tokens` and f32 logits `[max_batch, ceil(vocab / N)]` (decode) and
//!   `[chunk, ceil(vocab / N)]` (prefill; its `next_tokens` at the widest packing): each rank's
//!   logits are its vocabulary slice's (`model::vocab`);
//! - with `--speculative-tokens` (a model loaded with its MTP layer): that layer's weights and
//!   cache rows, its draft graphs and the verify graphs, two `[batch]` chunk vectors per
//!   context's decode buffers, and the hidden states `[max(batch, chunk), hidden]` f32 once
//!   as an output and once as an input;
//! - NEFF code and scratchpad: from each bucket's graph, partly computed and partly guessed,
//!   see [`neff`].
//!
//! # Host RAM while loading
//!
//! With streaming loads (each rank's shards read from the safetensors files and uploaded
//! tensor by tensor) a rank's loader holds at most one checkpoint tensor as read plus one shard
//! being staged for upload; the ranks of one instance load at once, each on its own thread (the
//! collectives bootstrap needs them together), so the peak is
//!
//! `ranks per instance x (largest checkpoint tensor (stored dtype) + largest shard of one rank
//! (device dtype))`
//!
//! plus, per rank, with `--quantize experts-int8|int4`, one expert matrix in f32 (the quantizer
//! reads each expert widened to f32). The checkpoint's tensors are per expert (`experts.E.gate_proj`), so
//! its largest is usually the embedding. A plan that needs more than the instance's RAM does
//! not fit.

pub mod bytes;
pub mod host;
pub mod instance;
pub mod neff;
pub mod suggest;

use std::fmt;
use std::str::FromStr;

use crate::config::v4::{V4Config, V4Experts};
use crate::config::ModelConfig;
use crate::deployment::{Buckets, Limits, DEFAULT_HBM_UTILIZATION};
use crate::error::{Error, Result};
use crate::graph::DType;
use crate::model::{DTypeChoice, Dots, Precision, PrecisionChoice, Quantize};

pub use self::bytes::WeightFormat;
pub use self::instance::Instance;
pub use self::suggest::{suggest, Suggestion};

/// The tensor-parallel degrees a plan considers: the runner's.
pub const TP_CHOICES: &[usize] = crate::model::shard::TP_DEGREES;

/// `--dtype` for a plan: the runner's choices plus `fp8`, the published V3 storage, which the
/// runner does not serve yet (it dequantizes fp8 checkpoints to bf16) but a deployment must be
/// able to size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDType {
    /// The checkpoint's float dtype, as the runner's `--dtype auto` (fp8 checkpoints: bf16).
    #[default]
    Auto,
    /// Every weight in this float dtype (f32, bf16 or f16).
    Float(DType),
    /// f8e4m3 linear weights with one f32 scale per block (see [`bytes`]).
    Fp8,
}

impl FromStr for WeightDType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp8" | "f8e4m3" | "float8_e4m3fn" => Ok(WeightDType::Fp8),
            other => match other.parse::<DTypeChoice>() {
                Ok(DTypeChoice::Auto) => Ok(WeightDType::Auto),
                Ok(DTypeChoice::Exactly(d)) => Ok(WeightDType::Float(d)),
                Err(_) => Err(Error::InvalidInput(format!(
                    "--dtype {other}: expected auto, bf16, f16, f32 or fp8"
                ))),
            },
        }
    }
}

/// `--kv-blocks`: how many KV-cache blocks the plan allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvBlocks {
    /// The runner's default: every sequence of `--max-batch` at `--max-len`, plus scratch.
    #[default]
    Default,
    /// This many blocks, scratch included.
    Exactly(usize),
    /// As many as fit after everything else ([`auto_kv_blocks`]).
    Auto,
}

impl FromStr for KvBlocks {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(KvBlocks::Auto);
        }
        s.parse().map(KvBlocks::Exactly).map_err(|_| {
            Error::InvalidInput(format!(
                "--kv-blocks {s}: expected a number of blocks or auto"
            ))
        })
    }
}

/// Routed experts' storage: the runner's `--quantize` choices that a NeuronCore computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Experts {
    /// In the weights' format.
    #[default]
    AsWeights,
    /// int8 with one f32 scale per output channel (`--quantize experts-int8`).
    Int8,
    /// 4-bit values packed two per byte with one f32 scale per 128 inputs of each output
    /// channel (`--quantize experts-int4`; GPTQ/AWQ's usual group of 128).
    Int4,
    /// FP4 (E2M1) codes two a byte with one f32 scale per 32 inputs, as a DeepSeek-V4
    /// checkpoint publishes them (`expert_dtype: fp4`); not a `--quantize` choice.
    Fp4,
}

impl TryFrom<Quantize> for Experts {
    type Error = crate::error::Error;

    /// The plan's storage for `q`; GGML's block formats are refused (CPU only: nothing on a
    /// NeuronCore computes on them).
    fn try_from(q: Quantize) -> Result<Self, Self::Error> {
        match q {
            Quantize::None => Ok(Experts::AsWeights),
            Quantize::ExpertsInt8 => Ok(Experts::Int8),
            Quantize::ExpertsInt4 => Ok(Experts::Int4),
            Quantize::Q8_0 | Quantize::Q4K => Err(q.cpu_only_error("a NeuronCore memory plan")),
        }
    }
}

/// What a plan is made for: the `deepinfer plan` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// The instance type.
    pub instance: Instance,
    /// Instances the ranks span (the runtime's global device count); 1 unless planning a
    /// multi-instance deployment.
    pub instances: usize,
    /// Tensor-parallel degree: ranks, one per core.
    pub tp: usize,
    /// The weights' storage.
    pub dtype: WeightDType,
    /// The KV cache's dtype (`auto`: the weights' float dtype).
    pub kv_dtype: DTypeChoice,
    /// Routed experts' storage (`--quantize`).
    pub experts: Experts,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Longest sequence (capped at the model's `max_position_embeddings`).
    pub max_len: usize,
    /// Most prompt tokens per prefill step (default 64).
    pub prefill_chunk: Option<usize>,
    /// Most sequences one prefill step packs (default
    /// [`crate::deployment::DEFAULT_PREFILL_SEQS`]).
    pub prefill_seqs: Option<usize>,
    /// KV-cache blocks.
    pub kv_blocks: KvBlocks,
    /// Share of each core's HBM the plan may fill, in (0, 1].
    pub hbm_utilization: f64,
    /// What each core can still hold by the runtime's own count (`nrt_get_vnc_memory_stats`,
    /// before anything of this model is loaded), when a runner asked it; `None` (the `plan`
    /// command, a runtime without the call): the instance's HBM per core. The plan takes the
    /// smaller of the two.
    pub hbm_per_core: Option<u64>,
    /// The checkpoint's float dtype when known (what `--dtype auto` means); `None` falls back
    /// to config.json's `torch_dtype`, then f32, as the runner does.
    pub saved_dtype: Option<DType>,
    /// `--split-sampler`: decode buckets captured as a forward pass and a sampling graph
    /// (more NEFFs, each smaller).
    pub split_sampler: bool,
}

impl Default for PlanOptions {
    /// `serve`'s defaults on one trn1.2xlarge at `--tp 1`.
    fn default() -> Self {
        PlanOptions {
            instance: Instance::default(),
            instances: 1,
            tp: 1,
            dtype: WeightDType::Auto,
            kv_dtype: DTypeChoice::Auto,
            experts: Experts::AsWeights,
            max_batch: 32,
            max_len: 2048,
            prefill_chunk: None,
            prefill_seqs: None,
            kv_blocks: KvBlocks::Default,
            hbm_utilization: DEFAULT_HBM_UTILIZATION,
            hbm_per_core: None,
            saved_dtype: None,
            split_sampler: false,
        }
    }
}

/// One rank's device bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreBytes {
    /// The rank (its core, counted across instances).
    pub rank: usize,
    /// Weight shards, replicated tensors and scales included.
    pub weights: u64,
    /// The cache roots: the KV blocks, and a DeepSeek-V4 model's per-sequence rings.
    pub kv_cache: u64,
    /// Persistent step-metadata buffers.
    pub metadata: u64,
    /// Persistent outputs (sampled tokens, logits).
    pub outputs: u64,
    /// Estimated NEFF code, DMA rings and runtime micro-code ([`neff`]).
    pub neff_code: u64,
    /// Estimated shared scratchpad ([`neff`]).
    pub scratchpad: u64,
}

impl CoreBytes {
    /// Everything on the core.
    pub fn total(&self) -> u64 {
        self.weights
            + self.kv_cache
            + self.metadata
            + self.outputs
            + self.neff_code
            + self.scratchpad
    }

    /// Everything but the KV cache: what [`auto_kv_blocks`] subtracts from the budget.
    fn without_kv(&self) -> u64 {
        self.total() - self.kv_cache
    }
}

/// What the cache of `cfg` costs a core in `dtype`: bytes per block of `block_size` token
/// slots in every paged root (MLA's latents and V3.2's index keys; V4's compressed entries),
/// and bytes per running sequence outside the blocks (V4's rings; none for MLA).
fn cache_bytes(cfg: &ModelConfig, block_size: usize, dtype: DType) -> Result<(u64, u64)> {
    if let Some(v4) = &cfg.v4 {
        let cost = crate::model::v4::step::cache_cost(v4, dtype, block_size)?;
        let block = (cost.bytes_per_token * block_size as f64).ceil() as u64;
        return Ok((block, cost.bytes_per_sequence));
    }
    // A drafting model's MTP layer keeps its rows in the same root (`cached_layers`).
    let block = (block_size
        * cfg.cached_layers()
        * (cfg.kv_cache_width() + cfg.index_cache_width())) as u64
        * dtype.size_in_bytes() as u64;
    Ok((block, 0))
}

/// The host's RAM while loading (see the module docs for the formula).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPeak {
    /// The largest single tensor of the checkpoint, as stored there.
    pub largest_checkpoint_tensor: u64,
    /// The largest shard one rank uploads, in the device's dtype.
    pub largest_shard: u64,
    /// One expert matrix in f32 when experts are quantized at load, else 0.
    pub quantize_staging: u64,
    /// Ranks one instance loads at once (each on its own thread).
    pub ranks_at_once: u64,
    /// The instance's RAM.
    pub ram: u64,
}

impl HostPeak {
    /// The peak: each rank loading at once holding the three.
    pub fn peak(&self) -> u64 {
        self.ranks_at_once
            * (self.largest_checkpoint_tensor + self.largest_shard + self.quantize_staging)
    }
}

/// How a plan's weights are held, from which [`Plan::assemble`] makes the rest.
struct Stored {
    weights: WeightFormat,
    experts: Experts,
    kv_dtype: DType,
    /// Every tensor a rank holds.
    entries: Vec<bytes::Entry>,
    /// The graphs' precision (for the NEFF estimates).
    precision: Precision,
}

/// A computed plan: per-rank bytes against the budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The instance type.
    pub instance: Instance,
    /// Instances the ranks span.
    pub instances: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// How weights are stored.
    pub weights: WeightFormat,
    /// Routed experts' storage.
    pub experts: Experts,
    /// The KV cache's dtype.
    pub kv_dtype: DType,
    /// The buckets the runner would capture (one NEFF each).
    pub buckets: Buckets,
    /// Cache slots per block.
    pub block_size: usize,
    /// Cache blocks, scratch included.
    pub kv_blocks: usize,
    /// Whether `kv_blocks` was chosen by [`auto_kv_blocks`].
    pub kv_blocks_auto: bool,
    /// The fewest blocks that hold one sequence of the longest context plus scratch.
    pub min_kv_blocks: usize,
    /// The model's parameters (the engine's; MTP layers excluded).
    pub params: u64,
    /// The model's weight bytes at this precision, each tensor counted once, scales included.
    pub weights_bytes_total: u64,
    /// Bytes every rank holds whole.
    pub replicated_bytes: u64,
    /// HBM per core: the instance's, or less when the runtime said so
    /// ([`PlanOptions::hbm_per_core`]).
    pub hbm_per_core: u64,
    /// Whether [`Self::hbm_per_core`] is the runtime's count rather than the instance's.
    pub hbm_measured: bool,
    /// HBM per core x utilization.
    pub budget_per_core: u64,
    /// The host while loading.
    pub host: HostPeak,
    /// Each NEFF's estimated footprint on a core, in the order a capture builds them.
    pub neffs: Vec<neff::GraphFootprint>,
    per_core: Vec<CoreBytes>,
}

/// Whether a plan builds every bucket's graph to count its NEFF ([`neff::estimate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Graphs {
    Measured,
    Skipped,
}

impl Plan {
    /// The plan for `cfg` under `opts`, or an error naming the option that cannot work (a
    /// `--tp` that does not divide the model or exceeds the cores, a bad dtype).
    pub fn compute(cfg: &ModelConfig, opts: &PlanOptions) -> Result<Plan> {
        Plan::compute_with(cfg, opts, Graphs::Measured)
    }

    /// [`Plan::compute`] without building the graphs: every rank's NEFF code and scratchpad
    /// counted as nothing. Since they only ever add to a rank's bytes (and take from what
    /// `--kv-blocks auto` finds), a configuration whose bound does not fit does not fit, which
    /// [`suggest()`] tells in milliseconds where building each bucket's graph takes seconds.
    pub fn lower_bound(cfg: &ModelConfig, opts: &PlanOptions) -> Result<Plan> {
        Plan::compute_with(cfg, opts, Graphs::Skipped)
    }

    fn compute_with(cfg: &ModelConfig, opts: &PlanOptions, graphs: Graphs) -> Result<Plan> {
        check_options(cfg, opts)?;
        if let Some(v4) = &cfg.v4 {
            return Plan::compute_v4(cfg, v4, opts, graphs);
        }
        let saved = opts.saved_dtype.or(cfg.saved_dtype);
        let block = cfg.fp8_block.unwrap_or([128, 128]);
        let weights = match opts.dtype {
            WeightDType::Auto => WeightFormat::Float(saved.unwrap_or(DType::F32)),
            WeightDType::Float(d) => WeightFormat::Float(d),
            WeightDType::Fp8 => WeightFormat::Fp8Block(block),
        };
        let checkpoint = if cfg.fp8_block.is_some() {
            WeightFormat::Fp8Block(block)
        } else {
            WeightFormat::Float(saved.unwrap_or(DType::F32))
        };
        let kv_dtype = match opts.kv_dtype {
            DTypeChoice::Auto => weights.float(),
            DTypeChoice::Exactly(d) => d,
        };
        for (flag, d) in [("--dtype", weights.float()), ("--kv-dtype", kv_dtype)] {
            if !matches!(d, DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::InvalidInput(format!(
                    "{flag} {d}: expected f32, bf16 or f16"
                )));
            }
        }

        let tp = opts.tp;
        let entries = experts_entries(cfg, weights, opts.experts, checkpoint, tp);
        // The graphs as a device runner builds them: fp8 checkpoints are dequantized to bf16
        // at load, so their graphs are bf16's, and they multiply in the weights' dtype.
        let precision = Precision {
            weights: match weights {
                WeightFormat::Float(d) => d,
                WeightFormat::Fp8Block(_) => DType::BF16,
            },
            kv_cache: kv_dtype,
            quantize: quantize_of(opts.experts),
            dots: Dots::DEVICE,
        };
        let stored = Stored {
            weights,
            experts: opts.experts,
            kv_dtype,
            entries,
            precision,
        };
        Plan::assemble(cfg, opts, stored, graphs)
    }

    /// [`Plan::compute`] for a DeepSeek-V4 model, as its runner holds it: its matrices in
    /// `--dtype` (f32 or bf16, `auto` following the checkpoint; FP8 ones dequantized at load),
    /// its other weights in f32, FP4 experts as published, the cache in `--kv-dtype` (f32 or
    /// bf16), as the runner's [`PrecisionChoice::v4`] decides; each rank's share read from the checkpoint
    /// one tensor at a time, as for MLA models.
    fn compute_v4(
        cfg: &ModelConfig,
        v4: &V4Config,
        opts: &PlanOptions,
        graphs: Graphs,
    ) -> Result<Plan> {
        let dtype = match opts.dtype {
            WeightDType::Auto => DTypeChoice::Auto,
            WeightDType::Float(d) => DTypeChoice::Exactly(d),
            WeightDType::Fp8 => {
                return Err(Error::InvalidInput(
                    "--dtype fp8: DeepSeek-V4's FP8 weights are dequantized at load, held in \
                     f32 or bf16"
                        .into(),
                ))
            }
        };
        let precision = PrecisionChoice {
            dtype,
            kv_dtype: opts.kv_dtype,
            quantize: quantize_of(opts.experts),
        }
        .v4(opts.saved_dtype.or(v4.saved_dtype))?;
        let (matrices, kv_dtype) = (precision.weights, precision.kv_cache);
        let entries = bytes::entries_v4(v4, opts.tp, matrices)?;
        let stored = Stored {
            weights: WeightFormat::Float(matrices),
            experts: match v4.experts {
                V4Experts::Fp4 => Experts::Fp4,
                V4Experts::Float => Experts::AsWeights,
            },
            kv_dtype,
            entries,
            precision: Precision {
                dots: Dots::DEVICE,
                ..precision
            },
        };
        Plan::assemble(cfg, opts, stored, graphs)
    }

    /// The plan of weights `stored`: the buckets, per-rank bytes and the host's peak.
    fn assemble(
        cfg: &ModelConfig,
        opts: &PlanOptions,
        stored: Stored,
        graphs: Graphs,
    ) -> Result<Plan> {
        let limits = Limits {
            kv_blocks: match opts.kv_blocks {
                KvBlocks::Exactly(n) => Some(n),
                KvBlocks::Default | KvBlocks::Auto => None,
            },
            prefill_chunk: opts.prefill_chunk,
            prefill_seqs: opts.prefill_seqs,
            ..Limits::new(opts.max_batch, opts.max_len)
        };
        let Stored {
            weights,
            experts,
            kv_dtype,
            entries,
            precision,
        } = stored;
        let tp = opts.tp;
        let mut rc = limits.runner_config(cfg)?;
        rc.tp = tp;
        rc.kv_dtype = kv_dtype;
        let buckets = rc.buckets.clone();
        let block_size = rc.block_size;
        let min_kv_blocks = buckets.max_len().div_ceil(block_size) + 1;

        let est = match graphs {
            Graphs::Measured => {
                neff::estimate(cfg, &precision, &rc, opts.instance, opts.split_sampler)?
            }
            Graphs::Skipped => neff::NeffEstimate {
                code: 0,
                scratchpad: 0,
                graphs: Vec::new(),
            },
        };
        let (metadata, outputs) = metadata_and_outputs(cfg, &buckets, block_size, tp);
        let (block_bytes, sequence_bytes) = cache_bytes(cfg, block_size, kv_dtype)?;
        // Per-sequence state (V4's rings) for every batch slot and the scratch row.
        let fixed_cache = sequence_bytes * (buckets.max_batch() as u64 + 1);
        let instance_hbm = opts.instance.hbm_per_core();
        let hbm_per_core = opts
            .hbm_per_core
            .map_or(instance_hbm, |m| m.min(instance_hbm));
        let budget_per_core = (hbm_per_core as f64 * opts.hbm_utilization).floor() as u64;

        let mut per_core: Vec<CoreBytes> = (0..tp)
            .map(|rank| CoreBytes {
                rank,
                weights: bytes::rank_bytes(&entries, tp, rank),
                kv_cache: 0,
                metadata,
                outputs,
                neff_code: est.code,
                scratchpad: est.scratchpad,
            })
            .collect();
        let kv_blocks = match opts.kv_blocks {
            KvBlocks::Auto => per_core
                .iter()
                .map(|c| {
                    budget_per_core.saturating_sub(c.without_kv() + fixed_cache)
                        / block_bytes.max(1)
                })
                .min()
                .unwrap_or(0) as usize,
            KvBlocks::Default | KvBlocks::Exactly(_) => rc.num_blocks,
        };
        for c in &mut per_core {
            c.kv_cache = kv_blocks as u64 * block_bytes + fixed_cache;
        }

        let largest_shard = (0..tp)
            .flat_map(|r| entries.iter().map(move |e| e.shard_bytes(tp, r)))
            .max()
            .unwrap_or(0);
        let quantize_staging = match (experts, &cfg.routing) {
            (Experts::Int8 | Experts::Int4, Some(_)) => {
                (cfg.moe_intermediate_size * cfg.hidden_size * 4) as u64
            }
            _ => 0,
        };
        let host = HostPeak {
            largest_checkpoint_tensor: entries
                .iter()
                .map(|e| e.checkpoint_bytes)
                .max()
                .unwrap_or(0),
            largest_shard,
            quantize_staging,
            ranks_at_once: tp.div_ceil(opts.instances.max(1)) as u64,
            ram: opts.instance.host_ram(),
        };
        Ok(Plan {
            instance: opts.instance,
            instances: opts.instances,
            tp,
            weights,
            experts,
            kv_dtype,
            buckets,
            block_size,
            kv_blocks,
            kv_blocks_auto: opts.kv_blocks == KvBlocks::Auto,
            min_kv_blocks,
            params: bytes::param_count(&entries),
            weights_bytes_total: bytes::total_bytes(&entries),
            replicated_bytes: bytes::replicated_bytes(&entries),
            hbm_per_core,
            hbm_measured: opts.hbm_per_core.is_some(),
            budget_per_core,
            host,
            neffs: est.graphs,
            per_core,
        })
    }

    /// One entry per rank, rank order.
    pub fn per_core(&self) -> &[CoreBytes] {
        &self.per_core
    }

    /// Whether every rank fits its budget, the cache holds at least one sequence of the longest
    /// context, and loading fits the host's RAM.
    pub fn fits(&self) -> bool {
        self.shortfalls().is_empty()
    }

    /// Why the plan does not fit, one reason per line (empty when it fits).
    pub fn shortfalls(&self) -> Vec<String> {
        let mut out = Vec::new();
        // The first of the fullest ranks (`max_by_key` would name the last).
        if let Some(c) = self.per_core.iter().rev().max_by_key(|c| c.total()) {
            if c.total() > self.budget_per_core {
                out.push(format!(
                    "rank {} needs {} of HBM, over its budget of {} ({} x utilization)",
                    c.rank,
                    gib(c.total()),
                    gib(self.budget_per_core),
                    gib(self.hbm_per_core),
                ));
            }
        }
        if self.kv_blocks < self.min_kv_blocks {
            out.push(format!(
                "{} KV blocks cannot hold one sequence of {} tokens ({} needed)",
                self.kv_blocks,
                self.buckets.max_len(),
                self.min_kv_blocks
            ));
        }
        if self.host.peak() > self.host.ram {
            out.push(format!(
                "loading needs {} of host RAM, the {} has {}",
                gib(self.host.peak()),
                self.instance,
                gib(self.host.ram)
            ));
        }
        out
    }

    /// The largest total over ranks.
    pub fn max_core_total(&self) -> u64 {
        self.per_core
            .iter()
            .map(CoreBytes::total)
            .max()
            .unwrap_or(0)
    }
}

/// The number of KV-cache blocks (scratch included) that fit on every rank after weights,
/// metadata, outputs and the NEFF estimate, within HBM x `opts.hbm_utilization`: the smallest
/// over ranks. `opts.kv_blocks` is ignored. The runner can size its cache with this instead of
/// `--max-batch x --max-len`; 0 when nothing is left. Fails as [`Plan::compute`] does.
pub fn auto_kv_blocks(cfg: &ModelConfig, opts: &PlanOptions) -> Result<usize> {
    let opts = PlanOptions {
        kv_blocks: KvBlocks::Auto,
        ..opts.clone()
    };
    Ok(Plan::compute(cfg, &opts)?.kv_blocks)
}

/// The runner's quantization for `experts` storage.
fn quantize_of(experts: Experts) -> Quantize {
    match experts {
        Experts::AsWeights | Experts::Fp4 => Quantize::None,
        Experts::Int8 => Quantize::ExpertsInt8,
        Experts::Int4 => Quantize::ExpertsInt4,
    }
}

/// The entries for `experts` storage.
fn experts_entries(
    cfg: &ModelConfig,
    weights: WeightFormat,
    experts: Experts,
    checkpoint: WeightFormat,
    tp: usize,
) -> Vec<bytes::Entry> {
    bytes::entries(cfg, weights, quantize_of(experts), checkpoint, tp)
}

/// Bytes of the persistent metadata buffers and outputs on one of `tp` ranks (see the module
/// docs; `runner::device`'s `allocate_and_load` is what this mirrors).
fn metadata_and_outputs(
    cfg: &ModelConfig,
    buckets: &Buckets,
    block_size: usize,
    tp: usize,
) -> (u64, u64) {
    let (b, t) = (buckets.max_batch(), buckets.prefill_chunk);
    let vocab = crate::model::shard::rows_per_rank(cfg.vocab_size, tp);
    let metadata: usize = buckets
        .ctx
        .iter()
        .map(|&ctx| {
            let width = ctx / block_size;
            // A drafting model's verify graphs add `seq_ids` and `last_index` (`[batch]`).
            let chunks = if cfg.draft_layers > 0 { 2 * b * 4 } else { 0 };
            let decode = 8 * b * 4 + b * width * 4 + chunks;
            // At the packing of the largest chunk: `seq_ids` only when it packs.
            let s = buckets.packed_seqs(t, ctx);
            let seq_ids = if s > 1 { t * 4 } else { 0 };
            let prefill = 3 * t * 4 + seq_ids + s * width * 4 + s * 4 + 4 * s * 4;
            decode + prefill
        })
        .sum();
    let packed = buckets
        .ctx
        .iter()
        .map(|&c| buckets.packed_seqs(t, c))
        .max()
        .unwrap_or(1);
    // A drafting model's hidden states, at the most rows a step has: the step graphs' output
    // and the draft graphs' input (`runner::device`'s `speculative`).
    let hidden = match cfg.draft_layers {
        0 => 0,
        _ => b.max(t) * cfg.hidden_size * 4,
    };
    let outputs = b * 4 + b * vocab * 4 + packed * 4 + t * vocab * 4 + hidden;
    ((metadata + hidden) as u64, outputs as u64)
}

/// Checks the instance count, utilization and `--tp` against the model and the instance.
fn check_options(cfg: &ModelConfig, opts: &PlanOptions) -> Result<()> {
    if !(opts.hbm_utilization > 0.0 && opts.hbm_utilization <= 1.0) {
        return Err(Error::InvalidInput(format!(
            "--hbm-utilization {}: expected a fraction in (0, 1], e.g. 0.9",
            opts.hbm_utilization
        )));
    }
    if opts.instances == 0 {
        return Err(Error::InvalidInput("--instances must be at least 1".into()));
    }
    // A V4 model's routed experts are read as published (`Plan::compute_v4` says so).
    if opts.experts != Experts::AsWeights && cfg.routing.is_none() && cfg.v4.is_none() {
        return Err(Error::InvalidInput(format!(
            "--quantize {}: this model has no routed experts (config.json sets no \
             n_routed_experts)",
            opts.experts
        )));
    }
    check_tp(cfg, opts.tp, opts.instance, opts.instances)
}

/// Why `tp` cannot shard `cfg`, if it cannot: the first size it does not divide (the sizes
/// [`crate::model::shard::split_sizes`] lists; DeepSeek-V4's, `model::v4::shard`'s).
pub fn tp_divides(cfg: &ModelConfig, tp: usize) -> Option<String> {
    if let Some(v4) = &cfg.v4 {
        return crate::model::v4::shard::indivisible(v4, tp);
    }
    crate::model::shard::split_sizes(cfg)
        .into_iter()
        .find(|(_, n)| n % tp != 0)
        .map(|(key, n)| format!("{key} = {n} (split across ranks)"))
}

/// The degrees of [`TP_CHOICES`] that shard `cfg` and fit `cores` cores.
pub fn valid_tps(cfg: &ModelConfig, cores: usize) -> Vec<usize> {
    TP_CHOICES
        .iter()
        .copied()
        .filter(|&t| t <= cores && tp_divides(cfg, t).is_none())
        .collect()
}

fn check_tp(cfg: &ModelConfig, tp: usize, instance: Instance, instances: usize) -> Result<()> {
    let cores = instance.cores() * instances;
    let list = |v: Vec<usize>| {
        v.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let fix = || match valid_tps(cfg, cores) {
        v if v.is_empty() => "no --tp works here".to_string(),
        v => format!("use --tp {}", list(v)),
    };
    if !TP_CHOICES.contains(&tp) {
        return Err(Error::InvalidInput(format!(
            "--tp {tp}: expected one of {}",
            list(TP_CHOICES.to_vec())
        )));
    }
    if let Some(why) = tp_divides(cfg, tp) {
        return Err(Error::InvalidInput(format!(
            "--tp {tp} does not divide {why}: {}",
            fix()
        )));
    }
    if tp > cores {
        let on = if instances == 1 {
            format!("one {instance} has {cores}")
        } else {
            format!("{instances} x {instance} have {cores}")
        };
        let bigger = Instance::ALL
            .into_iter()
            .find(|i| i.cores() >= tp)
            .map(|i| format!(", or --instance {i}"))
            .unwrap_or_default();
        return Err(Error::InvalidInput(format!(
            "--tp {tp} needs {tp} NeuronCores but {on}: {}{bigger}",
            fix()
        )));
    }
    Ok(())
}

/// `n` bytes in GiB with two decimals, for messages and tables.
pub fn gib(n: u64) -> String {
    format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
}

/// `n` bytes in the largest binary unit (KiB, MiB, GiB) that keeps it at least 1: small
/// buffers (metadata) stay readable next to the weights.
pub fn human_bytes(n: u64) -> String {
    let f = n as f64;
    match n {
        n if n >= 1 << 30 => gib(n),
        n if n >= 1 << 20 => format!("{:.1} MiB", f / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", f / 1024.0),
        n => format!("{n} B"),
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightFormat::Float(d) => write!(f, "{d}"),
            WeightFormat::Fp8Block([r, c]) => write!(f, "fp8 ({r}x{c} block scales)"),
        }
    }
}

impl fmt::Display for Experts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Experts::AsWeights => "none",
            Experts::Int8 => "experts-int8",
            Experts::Int4 => "experts-int4",
            Experts::Fp4 => "fp4 experts (as published)",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lite() -> ModelConfig {
        ModelConfig::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/configs/deepseek-v2-lite.json"),
        )
        .unwrap()
    }

    /// The runner-facing call agrees with the plan it makes, and the plan at that count fills
    /// the budget to within one block.
    #[test]
    fn auto_kv_blocks_is_the_plans_count() {
        let cfg = lite();
        let opts = PlanOptions {
            tp: 2,
            experts: Experts::Int8,
            dtype: WeightDType::Float(DType::BF16),
            ..PlanOptions::default()
        };
        let n = auto_kv_blocks(&cfg, &opts).unwrap();
        let plan = Plan::compute(
            &cfg,
            &PlanOptions {
                kv_blocks: KvBlocks::Exactly(n),
                ..opts.clone()
            },
        )
        .unwrap();
        assert!(plan.fits(), "{:?}", plan.shortfalls());
        let more = Plan::compute(
            &cfg,
            &PlanOptions {
                kv_blocks: KvBlocks::Exactly(n + 1),
                ..opts
            },
        )
        .unwrap();
        assert!(!more.fits());
    }

    #[test]
    fn bad_tp_names_the_size_and_the_fix() {
        let cfg = lite();
        let err = |tp, instance| {
            Plan::compute(
                &cfg,
                &PlanOptions {
                    tp,
                    instance,
                    ..PlanOptions::default()
                },
            )
            .unwrap_err()
            .to_string()
        };
        let e = err(32, Instance::Trn1_32xlarge);
        assert!(e.contains("num_attention_heads = 16"), "{e}");
        assert!(e.contains("use --tp 1, 2, 4, 8, 16"), "{e}");
        let e = err(8, Instance::Trn1_2xlarge);
        assert!(e.contains("needs 8 NeuronCores"), "{e}");
        assert!(err(0, Instance::Trn1_2xlarge).contains("expected one of"));
    }
}
