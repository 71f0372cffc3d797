//! The graph runner: the contract every backend implements, and the one way to open one.
//!
//! # The contract
//!
//! It is the contract of the Python runner deepinfer reimplements (a `NeuronGraphRunner`: the
//! `CudaGraphRunner` surface, backed by `torch.compile(backend="neuron")` with one compiled graph
//! per captured batch size), in its words:
//!
//! - [`Runner::capture`]`(buckets)`: one static graph per captured bucket ([`Buckets`]: each
//!   decode batch size and each prefill chunk size, per context length), built, compiled and
//!   loaded at capture, largest first. Step metadata lives in persistent device buffers
//!   allocated once at the largest bucket; a smaller bucket binds the first rows of the same
//!   buffers. Weights are uploaded once and shared by every graph. Every layer's KV cache is a
//!   view of one KV root, re-sliced inside the graph; the root is bound as input and aliased
//!   output of every graph, so it is updated in place and never copied. Configuration and
//!   environment are read here, never at replay.
//! - [`Runner::replay`]`(&Step) -> StepOutput`: pads the step to its bucket (padding rows write
//!   only the scratch block), writes the host metadata into the persistent buffers (the
//!   host-to-device copy stays outside the graph, and is skipped when the caller already wrote
//!   them: [`device::MetadataSource::OnDevice`], the seed's `input_on_device`), executes the
//!   bucket's graph and returns the sampled tokens (and logits when asked).
//! - [`Runner::destroy`]`()`: unloads every graph and frees every device tensor; capture works
//!   again afterwards.
//!
//! [`Buckets`] is the single source of truth for batch -> bucket. The runner never decides who
//! owns which cache block: the scheduler's block allocator (`engine::BlockAllocator`) hands
//! out the block tables that steps carry. [`step`] turns a step into the metadata arrays the
//! graphs read.
//!
//! # The backends
//!
//! - [`CpuRunner`]: the CPU twin, candle-core on the host (the fallback, and the reference the
//!   device runner is tested against).
//! - [`DeviceRunner`]: libnrt, either a NeuronCore (graphs compiled by neuronx-cc) or nrt-sim
//!   (the same FFI path and the same compile driver and NEFF cache, with nrt-sim's stand-in
//!   compiler writing its own NEFF container around our HLO). Either way the NEFF's tensors are
//!   bound under the names the loaded model reports ([`binding`]).
//!
//! [`open`] loads a checkpoint, builds the runner for a [`Backend`] and captures it: the CLI,
//! the server and the tests all open runners through it.

pub mod binding;
mod buckets;
mod cpu;
mod decode_costs;
pub mod device;
mod follow;
pub mod instances;
mod live;
mod open;
mod sim;
pub mod step;

use crate::config::ModelConfig;
use crate::deployment::{Buckets, RunnerConfig};
use crate::error::{Error, Result};
use crate::model::LogitsOutput;

pub use cpu::CpuRunner;
pub use decode_costs::DecodeCosts;
pub use device::{
    CaptureStats, DeviceOptions, DeviceRunner, MetadataSource, NeffSource, ReplayTiming,
};
pub use follow::follow;
pub use live::{BucketKey, BucketKind, LiveBuckets};
pub use open::{choose_backend, device_plan, device_plan_options, open, open_with_weights};
pub use sim::{
    find_sim_library, sim_compiler, sim_compiler_config, sim_compiler_config_from_env,
    sim_library_beside_exe, sim_library_candidates, SIM_COMPILER_FILE, SIM_GIT_HASH,
    SIM_LIBRARY_FILE,
};
use step::{DecodeRow, PrefillChunk};

/// Where graphs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// candle-core on the host CPU.
    Cpu,
    /// nrt-sim (`libnrt_sim.so`): the device runner over a simulated NeuronCore.
    Sim,
    /// libnrt on a NeuronCore, graphs compiled with neuronx-cc.
    Neuron,
}

impl Backend {
    /// The name users type (`--backend cpu|sim|neuron`) and the server reports.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Sim => "sim",
            Backend::Neuron => "neuron",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "sim" => Ok(Backend::Sim),
            "neuron" => Ok(Backend::Neuron),
            other => Err(Error::InvalidInput(format!(
                "unknown backend `{other}`: expected cpu, sim or neuron"
            ))),
        }
    }
}

/// One step for [`Runner::replay`]: prefill chunks of one or more sequences, or one decode
/// token for each of a batch of sequences.
#[derive(Debug, Clone, Copy)]
pub enum Step<'a> {
    /// One chunk each of some sequences' prompts (their earlier parts already in the cache),
    /// packed into one step; at most one chunk per sequence, and as many chunks as some bucket
    /// packs ([`Buckets::prefill_fits`]).
    Prefill {
        /// The chunks, in the order their outputs come back.
        chunks: &'a [PrefillChunk<'a>],
        /// Which logits to return: none, each chunk's last position's, or every position's.
        logits: LogitsOutput,
    },
    /// A verify step of speculative decoding: each chunk a decoding sequence's last token and
    /// its drafted tokens after it, all fed at once; `next_tokens` holds every position's
    /// token (chunk after chunk), each equal to the draft after it exactly when the draft is
    /// accepted (greedy rows: their argmax; sampled rows: by rejection sampling, see
    /// `model::sampling::verify`), so the caller keeps each chunk's drafts up to the first
    /// that differs and the token there (see `engine::speculative`). Each chunk's row of the
    /// sampling-state root then counts what the chunk keeps (a step of plain greedy rows,
    /// whose counts no penalty reads, leaves them alone). At most one chunk per sequence and
    /// as many chunks as the largest batch bucket.
    Verify {
        /// The chunks, each with its sequence's sampling parameters and logit controls, the
        /// same at every position but the allowed-token mask: a chunk's `controls.allowed`,
        /// when set, holds one mask per position, one after another (the grammar's state
        /// moves along the drafts).
        chunks: &'a [PrefillChunk<'a>],
        /// Which logits to return: none, or every position's.
        logits: LogitsOutput,
    },
    /// A draft step: the MTP layer over chunks of rows of some sequences (see
    /// [`crate::model::mtp`]), each row drafting from a hidden state the previous step left;
    /// its `next_tokens` are each chunk's last row's proposal. Only for a runner whose model
    /// was loaded with its MTP layer ([`crate::config::ModelConfig::draft_layers`]).
    Draft {
        /// The chunks, in the order their proposals come back.
        chunks: &'a [step::DraftChunk<'a>],
        /// Which logits to return: none, each chunk's last row's, or every row's.
        logits: LogitsOutput,
    },
    /// One new token for each row.
    Decode {
        /// The rows, at most the largest batch bucket.
        rows: &'a [DecodeRow<'a>],
        /// Which logits to return: none, or each row's ([`LogitsOutput::AllPositions`] means
        /// the same as [`LogitsOutput::Sampled`] here: a decode row has one position).
        logits: LogitsOutput,
    },
}

/// What one executed step returns.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The sampled token of each real row (decode) or chunk (prefill), padding dropped.
    pub next_tokens: Vec<u32>,
    /// The logits, when the step asked for them: one row per real row or chunk (its last
    /// position), or with [`LogitsOutput::AllPositions`] one per real position, chunk after
    /// chunk.
    pub logits: Option<Vec<Vec<f32>>>,
}

/// The allowed-token masks of some rows of a decode step, which the caller computes while the
/// step runs ([`Runner::replay_with_masks`]).
pub struct LateMasks<'a> {
    /// The rows (indices into the step's rows, ascending) the masks are for; their
    /// `controls.allowed` is ignored.
    pub rows: &'a [usize],
    /// Writes row `rows[k]`'s mask into `masks[k]` (`vocab.div_ceil(32)` words, every bit set
    /// on entry; token `32 w + j` is bit `j` of word `w`). Called once, on a thread of its own
    /// where the runner overlaps it with the step.
    pub fill: &'a mut (dyn FnMut(&mut [&mut [u32]]) + Send),
}

/// [`Runner::replay_with_masks`] without overlap: fills the masks, then replays the step with
/// them. What a runner that cannot overlap them does.
pub fn replay_after_masks<R: Runner + ?Sized>(
    runner: &mut R,
    rows: &[DecodeRow<'_>],
    logits: LogitsOutput,
    masks: LateMasks<'_>,
) -> Result<StepOutput> {
    let words = runner.config().vocab_size.div_ceil(32);
    let mut filled = vec![u32::MAX; masks.rows.len() * words];
    let mut views: Vec<&mut [u32]> = filled.chunks_mut(words).collect();
    (masks.fill)(&mut views);
    let mut rows = rows.to_vec();
    for (&i, mask) in masks.rows.iter().zip(filled.chunks(words)) {
        let row = rows.get_mut(i).ok_or_else(|| {
            Error::InvalidInput(format!("a late mask for row {i} of a step of fewer rows"))
        })?;
        row.controls.allowed = Some(mask);
    }
    runner.replay(&Step::Decode {
        rows: &rows,
        logits,
    })
}

/// What changed in a runner's live buckets ([`Runner::join_buckets`]).
#[derive(Debug, Clone, PartialEq)]
pub enum BucketEvent {
    /// The bucket was compiled and loaded: steps run on it from now on.
    Joined(BucketKey),
    /// The bucket's compile or load failed (why): it stays absent, steps run on the others.
    Failed(BucketKey, String),
}

/// The graph runner contract (see the module docs). The engine drives it; every backend
/// implements it.
pub trait Runner {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// The cache geometry and the buckets of the last capture.
    fn runner_config(&self) -> &RunnerConfig;
    /// Where the graphs run.
    fn backend(&self) -> Backend;
    /// Builds, compiles and loads one graph per bucket, allocating the persistent buffers.
    /// Capturing again replaces the bucket set.
    fn capture(&mut self, buckets: &Buckets) -> Result<()>;
    /// Runs one step on its bucket's graph.
    fn replay(&mut self, step: &Step<'_>) -> Result<StepOutput>;
    /// Releases every graph and device tensor; [`Runner::capture`] works again afterwards.
    fn destroy(&mut self) -> Result<()>;
    /// What a decode step of `rows` rows is expected to cost, where that grows with the rows
    /// and the runner has measured it (the CPU runner; see [`DecodeCosts`]); `None` otherwise.
    /// The scheduler's fair decoding bounds how much one request's rows slow a step by it.
    fn decode_cost(&self, _rows: usize) -> Option<std::time::Duration> {
        None
    }
    /// Runs a decode step whose rows `masks.rows` are under constraints whose masks depend on
    /// the tokens the last step sampled: [`LateMasks::fill`] computes them while the step's
    /// forward pass runs where the runner can (a device runner that splits its decode steps,
    /// [`DeviceOptions::split_sampler`]), and before the step otherwise
    /// ([`replay_after_masks`]). The tokens are those [`Runner::replay`] draws with the masks
    /// in the rows.
    fn replay_with_masks(
        &mut self,
        rows: &[DecodeRow<'_>],
        logits: LogitsOutput,
        masks: LateMasks<'_>,
    ) -> Result<StepOutput> {
        replay_after_masks(self, rows, logits, masks)
    }
    /// Which buckets steps can run on now, for a runner that captures some of them after it
    /// starts serving (a device runner compiling in the background,
    /// [`DeviceOptions::background_compile`]); `None` when every bucket of
    /// [`Runner::runner_config`] always is. The scheduler forms only steps these hold.
    fn live_buckets(&self) -> Option<&LiveBuckets> {
        None
    }
    /// Loads the buckets compiled since the last call, between two steps (the engine calls it
    /// before each iteration, and while idle), and says which joined or failed; nothing for a
    /// runner that captured every bucket.
    fn join_buckets(&mut self) -> Vec<BucketEvent> {
        Vec::new()
    }
    /// Where the replays since the last [`Runner::reset_replay_timing`] spent their time, for
    /// a runner that waits on a device (the first-contact report's host time per replay);
    /// `None` for the CPU, whose whole step is host time.
    fn replay_timing(&self) -> Option<ReplayTiming> {
        None
    }
    /// Starts [`Runner::replay_timing`] afresh.
    fn reset_replay_timing(&mut self) {}
    /// The compiled graphs loaded so far, for a runner that loads them (a device's: its
    /// buckets' and the greedy graphs that pay); `None` for the CPU, which builds graphs as
    /// steps need them.
    fn loaded_graphs(&self) -> Option<Vec<String>> {
        None
    }
}

impl<R: Runner + ?Sized> Runner for Box<R> {
    fn config(&self) -> &ModelConfig {
        (**self).config()
    }
    fn runner_config(&self) -> &RunnerConfig {
        (**self).runner_config()
    }
    fn backend(&self) -> Backend {
        (**self).backend()
    }
    fn capture(&mut self, buckets: &Buckets) -> Result<()> {
        (**self).capture(buckets)
    }
    fn replay(&mut self, step: &Step<'_>) -> Result<StepOutput> {
        (**self).replay(step)
    }
    fn destroy(&mut self) -> Result<()> {
        (**self).destroy()
    }
    fn decode_cost(&self, rows: usize) -> Option<std::time::Duration> {
        (**self).decode_cost(rows)
    }
    fn replay_with_masks(
        &mut self,
        rows: &[DecodeRow<'_>],
        logits: LogitsOutput,
        masks: LateMasks<'_>,
    ) -> Result<StepOutput> {
        (**self).replay_with_masks(rows, logits, masks)
    }
    fn live_buckets(&self) -> Option<&LiveBuckets> {
        (**self).live_buckets()
    }
    fn join_buckets(&mut self) -> Vec<BucketEvent> {
        (**self).join_buckets()
    }
    fn replay_timing(&self) -> Option<ReplayTiming> {
        (**self).replay_timing()
    }
    fn reset_replay_timing(&mut self) {
        (**self).reset_replay_timing()
    }
    fn loaded_graphs(&self) -> Option<Vec<String>> {
        (**self).loaded_graphs()
    }
}
