//! Runs a model's bucketed graphs over one KV root.
//!
//! Two runners share one API (the [`Runner`] trait, and the [`GraphRunner`] enum over both):
//!
//! - [`CpuRunner`]: the CPU twin. It owns the weights (bound to every graph by name), the KV
//!   root (bound as input and aliased output of every graph, updated in place), and one graph
//!   per bucket, built on first use and kept.
//! - [`DeviceRunner`] (in [`device`]): every bucket's graph captured once over libnrt or nrt-sim
//!   and replayed with persistent device tensors (see DESIGN.md, "The runner contract").
//!
//! A batch is padded up to the smallest bucket that holds it.

pub mod device;

use std::path::PathBuf;

use std::collections::HashMap;

use candle_core::{DType as CDType, Device, Tensor as CTensor};

use crate::backend::cpu;
use crate::cache::BlockAllocator;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::graph::{Graph, InputRole};
use crate::model::{
    self, CacheLayout, GraphSpec, LogitsOutput, ModelWeights, MoeStrategy, WeightSpecs,
};
use crate::step::{self, DecodeRow, HostArray, HostData, PrefillChunk};

pub use device::{CaptureStats, DeviceOptions, DeviceRunner, NeffSource};

/// The smallest prefill graph (see [`RunnerConfig::prefill_buckets`]).
const MIN_PREFILL_BUCKET: usize = 16;

/// Sizes the runner captures graphs for.
#[derive(Debug, Clone, PartialEq)]
pub struct RunnerConfig {
    /// Slots per cache block.
    pub block_size: usize,
    /// Blocks in the cache, the scratch block included.
    pub num_blocks: usize,
    /// Decode batch buckets, ascending.
    pub batch_buckets: Vec<usize>,
    /// Context-length buckets, ascending, each a multiple of `block_size`.
    pub ctx_buckets: Vec<usize>,
    /// Tokens per prefill chunk: the largest prefill graph. Shorter chunks run on smaller
    /// graphs (see [`RunnerConfig::prefill_buckets`]).
    pub prefill_chunk: usize,
    /// Force one MoE strategy instead of choosing per bucket.
    pub moe: Option<MoeStrategy>,
}

impl RunnerConfig {
    /// Buckets for `max_batch` sequences of up to `max_len` tokens: batch 1, 2, 4, 8, then steps
    /// of 8; contexts doubling from 64 up to `max_len`; enough blocks for every sequence at full
    /// length plus scratch.
    pub fn for_limits(max_batch: usize, max_len: usize) -> Self {
        let block_size = 16;
        let max_len = max_len.div_ceil(block_size) * block_size;
        let mut batch_buckets: Vec<usize> = [1, 2, 4, 8]
            .into_iter()
            .filter(|&b| b < max_batch)
            .collect();
        let mut b = 8;
        while b < max_batch {
            b += 8;
            if b < max_batch {
                batch_buckets.push(b);
            }
        }
        batch_buckets.push(max_batch);
        let mut ctx_buckets = Vec::new();
        let mut c = 64.min(max_len);
        while c < max_len {
            ctx_buckets.push(c);
            c *= 2;
        }
        ctx_buckets.push(max_len);
        RunnerConfig {
            block_size,
            num_blocks: max_batch * (max_len / block_size) + 1,
            batch_buckets,
            ctx_buckets,
            prefill_chunk: 64.min(max_len),
            moe: None,
        }
    }

    /// The longest sequence any bucket holds.
    pub fn max_len(&self) -> usize {
        self.ctx_buckets.last().copied().unwrap_or(0)
    }

    /// The chunk sizes prefill graphs exist for, ascending: 16, 64, 256, ... below
    /// `prefill_chunk`, then `prefill_chunk`. A short prompt (most chat turns) then runs on a
    /// graph a few times its size instead of one padded to the full chunk: on the CPU a
    /// 16-token chunk costs about 0.6x a 64-token one.
    pub fn prefill_buckets(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut t = MIN_PREFILL_BUCKET;
        while t < self.prefill_chunk {
            out.push(t);
            t *= 4;
        }
        out.push(self.prefill_chunk);
        out
    }

    /// The (chunk size, context) bucket of a prefill chunk, checking its tokens against `vocab`.
    pub fn prefill_bucket(&self, chunk: &PrefillChunk<'_>, vocab: usize) -> Result<(usize, usize)> {
        check_tokens(chunk.tokens.iter().copied(), vocab)?;
        let (n, max) = (chunk.tokens.len(), self.prefill_chunk);
        if n > max {
            return Err(Error::InvalidRequest(format!(
                "a prefill chunk of {n} tokens exceeds the chunk size {max}"
            )));
        }
        // The smallest of `prefill_buckets` that holds n, without allocating.
        let mut t = MIN_PREFILL_BUCKET;
        while t < n && t < max {
            t *= 4;
        }
        let t = t.min(max);
        let ctx = smallest_fitting(&self.ctx_buckets, chunk.start + n, "context length")?;
        Ok((t, ctx))
    }

    /// The (batch, context) bucket of a decode step, checking its tokens against `vocab`.
    pub fn decode_bucket(&self, rows: &[DecodeRow<'_>], vocab: usize) -> Result<(usize, usize)> {
        check_tokens(rows.iter().map(|r| r.token), vocab)?;
        let batch = smallest_fitting(&self.batch_buckets, rows.len(), "batch size")?;
        let longest = rows.iter().map(|r| r.position + 1).max().unwrap_or(1);
        let ctx = smallest_fitting(&self.ctx_buckets, longest, "context length")?;
        Ok((batch, ctx))
    }
}

fn check_tokens(tokens: impl IntoIterator<Item = u32>, vocab: usize) -> Result<()> {
    for t in tokens {
        if t as usize >= vocab {
            return Err(Error::InvalidRequest(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
    }
    Ok(())
}

/// What one executed step returns.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The sampled token of each real row (padding rows dropped).
    pub next_tokens: Vec<u32>,
    /// The logits, when the graph returns them: one row per real row (or per real position).
    pub logits: Option<Vec<Vec<f32>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Decode,
    Prefill,
}

/// The CPU graph runner for one model.
pub struct CpuRunner {
    cfg: ModelConfig,
    specs: WeightSpecs,
    weights: ModelWeights,
    layout: CacheLayout,
    root: CTensor,
    runner_cfg: RunnerConfig,
    graphs: HashMap<(Kind, usize, usize, LogitsOutput), Graph>,
    /// The cache's block allocator: callers grow and release sequences' tables through it.
    pub blocks: BlockAllocator,
}

fn smallest_fitting(buckets: &[usize], need: usize, what: &str) -> Result<usize> {
    buckets.iter().copied().find(|&b| b >= need).ok_or_else(|| {
        Error::InvalidRequest(format!(
            "{what} {need} exceeds the largest bucket ({})",
            buckets.last().copied().unwrap_or(0)
        ))
    })
}

impl CpuRunner {
    /// A runner with a zeroed KV root sized by `runner_cfg`.
    pub fn new(cfg: ModelConfig, weights: ModelWeights, runner_cfg: RunnerConfig) -> Result<Self> {
        let layout = CacheLayout {
            block_size: runner_cfg.block_size,
            num_slots: runner_cfg.num_blocks * runner_cfg.block_size,
        };
        let root = CTensor::zeros(
            (
                layout.num_slots,
                cfg.num_hidden_layers * cfg.kv_cache_width(),
            ),
            CDType::F32,
            &Device::Cpu,
        )?;
        Ok(CpuRunner {
            specs: WeightSpecs::new(&cfg),
            blocks: BlockAllocator::new(runner_cfg.num_blocks, runner_cfg.block_size)?,
            cfg,
            weights,
            layout,
            root,
            runner_cfg,
            graphs: HashMap::new(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The runner's buckets.
    pub fn runner_config(&self) -> &RunnerConfig {
        &self.runner_cfg
    }

    fn graph(
        &mut self,
        kind: Kind,
        rows: usize,
        ctx: usize,
        logits: LogitsOutput,
    ) -> Result<Graph> {
        let key = (kind, rows, ctx, logits);
        if let Some(g) = self.graphs.get(&key) {
            return Ok(g.clone());
        }
        // On the CPU the fused gather reads only the selected experts and computes only their
        // rows, so it wins at every batch size; the dense strategy only pays off on a device
        // whose bottleneck is memory traffic, not arithmetic (see `MoeStrategy::for_tokens`).
        let moe = self.runner_cfg.moe.unwrap_or(MoeStrategy::Gather);
        let spec = GraphSpec {
            rows,
            ctx,
            logits,
            moe,
        };
        let g = match kind {
            Kind::Decode => model::build_decode(&self.cfg, &self.specs, &self.layout, &spec)?,
            Kind::Prefill => model::build_prefill(&self.cfg, &self.specs, &self.layout, &spec)?,
        };
        self.graphs.insert(key, g.clone());
        Ok(g)
    }

    fn execute(
        &mut self,
        graph: &Graph,
        metadata: &[HostArray],
        real_rows: usize,
    ) -> Result<StepOutput> {
        let mut inputs = Vec::with_capacity(graph.inputs().len());
        for decl in graph.inputs() {
            let t = match decl.role {
                InputRole::Weight => self.weights.get(&decl.name)?.clone(),
                InputRole::CacheRoot => self.root.clone(),
                InputRole::Metadata => {
                    let a = metadata
                        .iter()
                        .find(|a| a.name == decl.name)
                        .ok_or_else(|| Error::Binding {
                            name: decl.name.clone(),
                            msg: "no metadata given for it".into(),
                        })?;
                    let dev = &Device::Cpu;
                    match &a.data {
                        HostData::I32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
                        HostData::F32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
                        HostData::U32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
                    }
                }
            };
            inputs.push(t);
        }
        let outputs = cpu::run(graph, &inputs)?;
        let get = |name: &str| graph.output_index(name).map(|i| &outputs[i]);
        let next = get("next_tokens")
            .ok_or_else(|| Error::Binding {
                name: "next_tokens".into(),
                msg: "missing output".into(),
            })?
            .to_vec1::<i32>()?;
        let logits = match get("logits") {
            Some(t) => {
                let mut rows = t.to_vec2::<f32>()?;
                rows.truncate(real_rows);
                Some(rows)
            }
            None => None,
        };
        Ok(StepOutput {
            next_tokens: next.into_iter().take(real_rows).map(|x| x as u32).collect(),
            logits,
        })
    }

    /// Runs one prefill chunk (at most `prefill_chunk` tokens). With
    /// [`LogitsOutput::AllPositions`] the logits of every token of the chunk are returned.
    pub fn prefill(
        &mut self,
        chunk: &PrefillChunk<'_>,
        logits: LogitsOutput,
    ) -> Result<StepOutput> {
        let (t, ctx) = self.runner_cfg.prefill_bucket(chunk, self.cfg.vocab_size)?;
        let n = chunk.tokens.len();
        let graph = self.graph(Kind::Prefill, t, ctx, logits)?;
        let meta = step::prefill_step(chunk, t, ctx, self.layout.block_size)?;
        let real = if logits == LogitsOutput::AllPositions {
            n
        } else {
            1
        };
        self.execute(&graph, &meta, real)
    }

    /// Runs one decode step for `rows`, padded to the smallest batch bucket.
    pub fn decode(&mut self, rows: &[DecodeRow<'_>], logits: bool) -> Result<StepOutput> {
        let (batch, ctx) = self.runner_cfg.decode_bucket(rows, self.cfg.vocab_size)?;
        let want = if logits {
            LogitsOutput::Sampled
        } else {
            LogitsOutput::None
        };
        let graph = self.graph(Kind::Decode, batch, ctx, want)?;
        let meta = step::decode_step(rows, batch, ctx, self.layout.block_size)?;
        self.execute(&graph, &meta, rows.len())
    }
}

impl CpuRunner {
    /// The KV root (for tools that snapshot the cache, e.g. `deepinfer lower`).
    pub fn kv_root(&self) -> &CTensor {
        &self.root
    }

    /// The prepared weights.
    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    /// The cache geometry graphs are built for.
    pub fn cache_layout(&self) -> CacheLayout {
        self.layout
    }
}

/// What the engine drives: prefill chunks and decode steps over a block allocator.
pub trait Runner {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// The runner's buckets.
    fn runner_config(&self) -> &RunnerConfig;
    /// The cache's block allocator.
    fn blocks_mut(&mut self) -> &mut BlockAllocator;
    /// Runs one prefill chunk (see [`CpuRunner::prefill`]).
    fn prefill(&mut self, chunk: &PrefillChunk<'_>, logits: LogitsOutput) -> Result<StepOutput>;
    /// Runs one decode step (see [`CpuRunner::decode`]).
    fn decode(&mut self, rows: &[DecodeRow<'_>], logits: bool) -> Result<StepOutput>;
}

impl Runner for CpuRunner {
    fn config(&self) -> &ModelConfig {
        CpuRunner::config(self)
    }
    fn runner_config(&self) -> &RunnerConfig {
        CpuRunner::runner_config(self)
    }
    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        &mut self.blocks
    }
    fn prefill(&mut self, chunk: &PrefillChunk<'_>, logits: LogitsOutput) -> Result<StepOutput> {
        CpuRunner::prefill(self, chunk, logits)
    }
    fn decode(&mut self, rows: &[DecodeRow<'_>], logits: bool) -> Result<StepOutput> {
        CpuRunner::decode(self, rows, logits)
    }
}

impl Runner for DeviceRunner {
    fn config(&self) -> &ModelConfig {
        DeviceRunner::config(self)
    }
    fn runner_config(&self) -> &RunnerConfig {
        DeviceRunner::runner_config(self)
    }
    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        &mut self.blocks
    }
    fn prefill(&mut self, chunk: &PrefillChunk<'_>, logits: LogitsOutput) -> Result<StepOutput> {
        DeviceRunner::prefill(self, chunk, logits)
    }
    fn decode(&mut self, rows: &[DecodeRow<'_>], logits: bool) -> Result<StepOutput> {
        DeviceRunner::decode(self, rows, logits)
    }
}

/// A graph runner on any backend: the CPU twin or a device (nrt-sim or a NeuronCore).
#[derive(Debug)]
pub enum GraphRunner {
    /// candle-core on the host.
    Cpu(Box<CpuRunner>),
    /// libnrt (or nrt-sim) with captured graphs.
    Device(Box<DeviceRunner>),
}

impl std::fmt::Debug for CpuRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuRunner")
            .field("runner_cfg", &self.runner_cfg)
            .field("graphs", &self.graphs.len())
            .finish()
    }
}

impl GraphRunner {
    /// The backend's name: `cpu` or `device`.
    pub fn backend_name(&self) -> &'static str {
        match self {
            GraphRunner::Cpu(_) => "cpu",
            GraphRunner::Device(_) => "device",
        }
    }

    fn inner(&self) -> &dyn Runner {
        match self {
            GraphRunner::Cpu(r) => r.as_ref(),
            GraphRunner::Device(r) => r.as_ref(),
        }
    }

    fn inner_mut(&mut self) -> &mut dyn Runner {
        match self {
            GraphRunner::Cpu(r) => r.as_mut(),
            GraphRunner::Device(r) => r.as_mut(),
        }
    }
}

impl Runner for GraphRunner {
    fn config(&self) -> &ModelConfig {
        self.inner().config()
    }
    fn runner_config(&self) -> &RunnerConfig {
        self.inner().runner_config()
    }
    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        self.inner_mut().blocks_mut()
    }
    fn prefill(&mut self, chunk: &PrefillChunk<'_>, logits: LogitsOutput) -> Result<StepOutput> {
        self.inner_mut().prefill(chunk, logits)
    }
    fn decode(&mut self, rows: &[DecodeRow<'_>], logits: bool) -> Result<StepOutput> {
        self.inner_mut().decode(rows, logits)
    }
}

/// The file name of nrt-sim's shared library.
pub const SIM_LIBRARY_FILE: &str = "libnrt_sim.so";

/// Where `--backend sim` looks for nrt-sim, in order: `NEURON_RT_LIB` when it names a file
/// called `libnrt_sim.so`, then beside the executable, then its `deps/` directory, then the
/// executable's parent directory (for tests and benches, which live in `deps/`).
pub fn sim_library_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(neuron_sys::NEURON_RT_LIB).filter(|v| !v.is_empty()) {
        out.push(PathBuf::from(p));
    }
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
            Error::InvalidRequest(format!(
                "nrt-sim ({SIM_LIBRARY_FILE}) not found; looked in {}. Build it with \
                 `cargo build -p nrt-sim`, or set NEURON_RT_LIB to its path, or use `--backend cpu`",
                places.join(", ")
            ))
        })
}
