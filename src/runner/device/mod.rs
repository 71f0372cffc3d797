//! The device graph runner: every bucket's graph captured once over libnrt (or nrt-sim), then
//! replayed with persistent device tensors.
//!
//! Capture ([`Runner::capture`]) builds each bucket's graph (decode per batch bucket × context
//! bucket, prefill per context bucket), lowers it to HLO, turns it into a NEFF through the
//! compile driver and its NEFF cache (neuronx-cc, or for nrt-sim its stand-in compiler) and
//! loads it, largest first. It uploads the weights once, allocates the KV root once and binds it
//! as input and aliased output of every model, and allocates the step metadata buffers once per
//! context bucket at the largest batch: the model for batch `b` binds slices of their first `b`
//! rows. Outputs (`next_tokens`, `logits`) are persistent too. Every tensor is bound under the
//! name the loaded model reports for its role ([`super::binding`]), not under ours.
//!
//! A replay pads the step (see [`super::step`]), writes only the chosen bucket's metadata
//! bytes, executes, and reads `next_tokens` (and the logits only when asked). It allocates no
//! device tensor and never touches the KV root from the host. The allowed-token mask, the one
//! large metadata array, is not copied when no row is constrained and its buffer already holds
//! all ones (see [`step::StepArrays::allowed_tokens_unmasked`]).
//!
//! Destroy ([`Runner::destroy`]) unloads every model and frees every tensor; it is idempotent,
//! runs on drop, and capture works again afterwards.
//!
//! With tensor parallelism (`RunnerConfig::tp` > 1; the layout is `model::shard`'s) each rank
//! is a NeuronCore (core `nc + i` for local rank `i`): the same NEFF per bucket is loaded on
//! every rank with `nrt_load_collectives`, each rank's weight shards are uploaded to its core
//! (streamed from the checkpoint, see [`ModelWeights::stream`]), and each rank has its own KV
//! root (the latent cache is replicated), metadata buffers and outputs. A replay writes every
//! rank's metadata and executes the ranks concurrently; outputs are read from the first rank
//! (every rank samples the same tokens from its vocabulary slice, see `model::vocab`); when a
//! request asks for logprobs, every rank's logits slice is read and the columns joined.
//!
//! A runner may run only some of the ranks ([`DeviceOptions::ranks`]): one instance's share of
//! a model over several. The leader's runner then sends every step to its followers' runners
//! before executing its own ranks and waits for their answers ([`super::instances`]).
//!
//! # Split sampling
//!
//! A constrained row's allowed-token mask depends on the token the last step sampled for it,
//! and computing it walks the vocabulary on the host (`engine::grammar`): at 64 rows of a
//! 129,280-token vocabulary, milliseconds. With the sampler inside the decode graph, the device
//! idles while the host computes them. With [`DeviceOptions::split_sampler`], every decode
//! bucket is captured as two graphs instead: the forward pass, which leaves the logits in the
//! persistent `logits` output (`model::Sampler::Deferred`), and per batch bucket a small
//! sampling graph ([`model::build_sample`]) that reads that buffer (an
//! [`InputRole::Carried`] input, bound to the same device tensor) with the masks and the other
//! sampling inputs. [`Runner::replay_with_masks`] starts the forward pass, computes the masks
//! on another thread meanwhile, then writes them and runs the sampler: the masks cost the step
//! only what they take beyond the forward pass. Tokens are the fused graph's (the sampling
//! graph runs the same ops on the same logits). Each decode bucket's sampling graph binds
//! that bucket's metadata buffers (one NEFF per batch size, compiled and loaded once, bound
//! per context bucket): the forward pass writes every input both graphs read, and the sampling
//! graph's step copies only the masks.
//!
//! # Speculative decoding
//!
//! A model loaded with its MTP layer (`--speculative-tokens`) captures more graphs per bucket
//! (each decode bucket's verify and draft graphs, each prefill bucket's draft graph; see
//! `Buckets::capture_specs`) and two more persistent buffers, the hidden states out of every
//! step graph and into every draft graph. How verify and draft steps take the buckets' shapes
//! is in the `speculative` submodule's docs.
//!
//! # Background compiling
//!
//! neuronx-cc takes minutes to hours per graph. With [`DeviceOptions::background_compile`]
//! (what `deepinfer serve` does) capture still builds every graph and allocates every
//! persistent tensor at the largest bucket's size, but compiles and loads only the first two
//! buckets ([`LiveBuckets::first`]: decode at the smallest batch and the largest prefill chunk,
//! both at the longest context, which run any request) and returns. A thread of its own
//! compiles the rest ([`compile_each`]: each result as soon as it is ready); the caller's
//! [`Runner::join_buckets`], between two steps, loads each bucket whose NEFFs are ready on
//! every rank at once (each other rank's worker loads it on the thread that executes that
//! rank's steps, as `nrt_load_collectives` needs every rank present) and makes it live. Loading binds the same
//! weights, cache roots, metadata buffers and outputs as the graphs already loaded, so a
//! bucket joins without touching the others. Replays take the smallest live bucket that holds
//! the step ([`LiveBuckets`]); the scheduler forms only steps some live bucket holds. A
//! failed background compile or load is logged and the bucket stays absent; a failure of the
//! first buckets fails the capture. Rejected: loading in the compile thread while steps run,
//! because a rank's loaded graphs live with its worker (and the first rank's with the
//! runner), and a collectives load would need every rank's thread at once anyway.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor as CTensor;
use neuron_sys::{Library, Model, Runtime, Tensor, TensorSet};

use super::binding::{bind, NeffBinding};
use super::instances::{Followers, Setup, StepMessage};
use super::live::{BucketKey, BucketKind, LiveBuckets};
use super::sim::{sim_compiler_config, sim_compiler_config_from_env};
use super::step::{self, HostArray, HostData};
use super::{Backend, BucketEvent, LateMasks, Runner, Step, StepOutput};
use crate::backend::hlo::emit;
use crate::backend::neuron::check::estimate;
use crate::backend::neuron::compile::{compile_all, compile_each, CompileJob, CompilerConfig};
use crate::backend::neuron::progress::Progress;
use crate::backend::neuron::sim_neff::NeffNames;
use crate::config::ModelConfig;
use crate::deployment::{self, Buckets, RankSpan, RunnerConfig, StepKind};
use crate::error::{Error, Result};
use crate::graph::{Graph, InputRole};
use crate::host::{tensor_from_bytes, with_tensor_bytes};
use crate::model::{
    self, CacheLayout, Dots, GraphSpec, LogitsOutput, ModelWeights, MoeStrategy, WeightSpecs,
};
use crate::model::{inputs, mtp, shard};

mod speculative;

/// How a device runner turns a lowered graph into the bytes `nrt_load` takes: always the compile
/// driver ([`compile_all`]) and its NEFF cache, with one compiler or the other.
#[derive(Debug, Clone)]
pub enum NeffSource {
    /// nrt-sim: its stand-in compiler writes nrt-sim's NEFF container
    /// ([`crate::backend::neuron::sim_neff`]); see [`super::sim_compiler_config`].
    Sim(CompilerConfig),
    /// neuronx-cc.
    Compile(CompilerConfig),
}

impl NeffSource {
    /// The compile driver's configuration.
    pub fn compiler(&self) -> &CompilerConfig {
        match self {
            NeffSource::Sim(c) | NeffSource::Compile(c) => c,
        }
    }
}

/// Where a replay finds the step metadata: the seed's `input_on_device`, as a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetadataSource {
    /// Replay copies the step's host metadata into the persistent device buffers first.
    #[default]
    Host,
    /// The caller already wrote the persistent buffers ([`DeviceRunner::metadata_buffer`]);
    /// replay executes without copying anything.
    OnDevice,
}

/// Where and how a [`DeviceRunner`] runs.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// How NEFFs are made.
    pub neff: NeffSource,
    /// The first NeuronCore (relative to the visible set) models and tensors live on; with
    /// tensor parallelism, local rank `i` uses core `nc + i`.
    pub nc: u32,
    /// Where replays find the step metadata.
    pub metadata: MetadataSource,
    /// Which of the `tp` ranks this process runs (see [`RankSpan`]); `None`: all of them.
    pub ranks: Option<RankSpan>,
    /// Split every decode step in two graphs, the forward pass to the logits and the sampler
    /// (see "Split sampling" in the module docs), so that the allowed-token masks of
    /// constrained rows are computed on the host while the forward pass runs. Costs a second
    /// execution per decode step and one small graph per batch bucket.
    pub split_sampler: bool,
    /// Capture only the first buckets ([`LiveBuckets::first`]) and return; compile the others
    /// on a thread of their own, each joining (loaded on every rank between two steps,
    /// [`Runner::join_buckets`]) as soon as its NEFF is ready. What `deepinfer serve` does, so
    /// that a server answers after two compiles rather than all of them (see "Background
    /// compiling" in the module docs). Only for a process that runs every rank: followers on
    /// other instances could not join a bucket at the same step.
    pub background_compile: bool,
}

/// `NEURON_RT_ROOT_COMM_ID`: where libnrt bootstraps its collectives (`host:port` of rank 0).
pub const ROOT_COMM_ID_ENV: &str = "NEURON_RT_ROOT_COMM_ID";

/// The root communicator a single-instance tensor-parallel runner sets when
/// `NEURON_RT_ROOT_COMM_ID` is unset: this host, and the port Neuron's examples use for it.
pub const DEFAULT_ROOT_COMM_ID: &str = "localhost:61234";

impl DeviceOptions {
    /// nrt-sim on core 0, its NEFFs named after the convention `NRT_SIM_NEFF_NAMES` names, else
    /// the default ([`NeffNames::MustAlias`]); see [`super::sim_compiler_config_from_env`].
    pub fn sim() -> Self {
        DeviceOptions {
            neff: NeffSource::Sim(sim_compiler_config_from_env()),
            nc: 0,
            metadata: MetadataSource::Host,
            ranks: None,
            split_sampler: false,
            background_compile: false,
        }
    }

    /// nrt-sim on core 0, its stand-in compiler told to name NEFF tensors after `names`.
    pub fn sim_named(names: NeffNames) -> Self {
        DeviceOptions {
            neff: NeffSource::Sim(sim_compiler_config(names)),
            nc: 0,
            metadata: MetadataSource::Host,
            ranks: None,
            split_sampler: false,
            background_compile: false,
        }
    }

    /// A NeuronCore (core 0) with neuronx-cc configured by `cfg`.
    pub fn neuron(cfg: CompilerConfig) -> Self {
        DeviceOptions {
            neff: NeffSource::Compile(cfg),
            nc: 0,
            metadata: MetadataSource::Host,
            ranks: None,
            split_sampler: false,
            background_compile: false,
        }
    }
}

/// What one capture cost, per graph.
#[derive(Debug, Clone)]
pub struct CaptureStats {
    /// Per graph, largest first: its name, build + lower time, and NEFF bytes.
    pub graphs: Vec<(String, Duration, usize)>,
    /// The whole capture, compile and load included.
    pub total: Duration,
    /// Bytes written to the device from the host at capture: the weights (the cache roots are
    /// zeroed on the device, see `nrt_tensor_memset`).
    pub bytes_uploaded: u64,
}

/// One metadata input's persistent buffer, at the bucket's largest row count.
#[derive(Clone)]
struct MetaBuf {
    name: &'static str,
    tensor: Tensor,
    row_bytes: usize,
    /// How many leading bytes are known to hold all ones (an unmasked allowed-token array);
    /// 0 when unknown. Shared by the clones, which name the same device tensor.
    ones: Arc<AtomicUsize>,
}

impl MetaBuf {
    /// Forgets what the buffer holds (someone else may write it).
    fn forget(&self) {
        self.ones.store(0, Ordering::Relaxed);
    }
}

/// One loaded model and its bindings.
struct Loaded {
    name: String,
    /// How the graph evaluates its routed experts.
    moe: MoeStrategy,
    /// Shared by every bucket whose graph is the same NEFF (a split decode step's sampling
    /// graph, one per batch size, bound to each context bucket's metadata): loaded once.
    model: Arc<Model>,
    /// The NEFF names its tensors are bound under.
    names: NeffBinding,
    inputs: TensorSet,
    outputs: TensorSet,
    /// Index into the context bucket's metadata buffers.
    ctx_index: usize,
}

/// Everything capture allocates on one rank's NeuronCore; dropping it unloads the models and
/// frees the tensors.
struct RankState {
    // Field order is drop order: models (and their sets) first, then the tensors they bind.
    graphs: HashMap<GraphKey, Loaded>,
    decode_meta: Vec<Vec<MetaBuf>>,
    prefill_meta: Vec<Vec<MetaBuf>>,
    decode_next: Tensor,
    decode_logits: Tensor,
    prefill_next: Tensor,
    prefill_logits: Tensor,
    /// Where a drafting model's step graphs leave their hidden states ([`mtp::HIDDEN`], or a
    /// draft graph's [`mtp::DRAFT_HIDDEN`]), at the most rows a step has; the next draft step
    /// reads them back through the host (see `speculative`).
    hidden_out: Option<Tensor>,
    /// The cache roots (the KV root, and V3.2's state root) by graph input name.
    roots: Vec<(&'static str, Tensor)>,
    weights: HashMap<String, Tensor>,
    /// What loading a graph on this rank needs beyond the tensors above.
    loader: GraphLoader,
}

/// Where a rank loads its graphs: its runtime, NeuronCore and place in the model.
struct GraphLoader {
    rt: Runtime,
    nc: u32,
    /// The global rank (for `nrt_load_collectives`).
    rank: usize,
    tp: usize,
    /// The context buckets, ascending (a graph's metadata buffers are its context's).
    ctx: Vec<usize>,
    /// This rank's vocabulary slice's width.
    vocab: usize,
    /// The model's hidden size (a hidden-state row's f32 values).
    hidden: usize,
}

/// Every local rank's capture. The first rank's state is the runner's own (replay executes
/// it on the calling thread and reads the outputs from it); every other rank's state lives on
/// a worker thread of its own ([`RankWorkers`]), which executes that rank's graph each step.
/// libnrt's `nrt_execute` blocks until the graph ends, and a graph with collectives ends only
/// when every rank has run it, so the ranks must execute concurrently.
struct Captured {
    // Field order is drop order; the two are independent.
    first: RankState,
    others: RankWorkers,
}

/// Which of the staged metadata arrays a step writes into its graph's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MetaWrites {
    /// Every array: what every graph but a split step's sampling graph needs.
    All,
    /// Only the allowed-token array: masks computed while the step's forward pass ran, which
    /// wrote the rest into the same buffers.
    AllowedTokens,
    /// Every array but the allowed-token one: a split step's forward pass (which does not read
    /// it) while its masks are still being computed.
    AllButAllowedTokens,
    /// Nothing: the step's forward pass wrote every buffer its sampling graph reads.
    None,
}

/// The graph key of a step: kind, rows, sequences (decode: its rows), context.
type GraphKey = (StepKind, usize, usize, usize);

/// One rank's metadata buffers per context bucket: decode's, then prefill's.
type RankMeta = (Vec<Vec<MetaBuf>>, Vec<Vec<MetaBuf>>);

/// The worker threads of the ranks after the first, and the board they meet the runner on.
///
/// One step costs the runner one broadcast (every worker waits on the same condition) and one
/// wake-up (the last worker to finish wakes it), not a message per rank each way: on a host
/// with fewer cores than ranks, every wake-up is a context switch the step waits for.
/// Dropping it stops the threads and waits for them, so every rank's models are unloaded and
/// its tensors freed before the drop returns.
struct RankWorkers {
    /// Each worker's rank's metadata buffers (`decode`, `prefill`), which the runner fills.
    metas: Vec<RankMeta>,
    /// Each worker's rank's logits outputs (`decode`, `prefill`): its vocabulary slice, which
    /// the runner reads to join whole rows.
    logits: Vec<(Tensor, Tensor)>,
    board: Arc<Board>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Where the runner posts a step and the workers report on it.
#[derive(Default)]
struct Board {
    state: Mutex<BoardState>,
    /// Signalled when a step is posted (or the workers are told to stop).
    posted: Condvar,
    /// Signalled when the last worker has finished the step.
    finished: Condvar,
}

#[derive(Default)]
struct BoardState {
    /// Tasks posted so far; a worker runs each once.
    posted: u64,
    task: Option<Task>,
    /// Workers that have not finished the current step.
    pending: usize,
    errors: Vec<Error>,
    stop: bool,
}

/// What the workers are told to do on their ranks.
#[derive(Clone)]
enum Task {
    /// Execute this graph (a step).
    Execute(GraphKey),
    /// Load these graphs (a bucket that joins; see [`RankState::load_graph`]).
    Load(Arc<Vec<JoiningGraph>>),
    /// Unload these graphs (a bucket that failed to load on some rank).
    Forget(Arc<Vec<GraphKey>>),
}

/// One graph of a bucket that joins after capture, with its NEFF.
struct JoiningGraph {
    kind: StepKind,
    spec: GraphSpec,
    graph: Graph,
    neff: Arc<Vec<u8>>,
}

fn lock_board(m: &Mutex<BoardState>) -> MutexGuard<'_, BoardState> {
    // A worker that panicked holding the lock leaves counts a step may wait on; the step
    // itself is what fails then, not every later lock.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RankWorkers {
    /// Moves each of `states` onto a thread of its own.
    fn start(states: Vec<RankState>) -> Result<Self> {
        let board = Arc::new(Board::default());
        let mut metas = Vec::with_capacity(states.len());
        let mut workers = RankWorkers {
            metas: Vec::new(),
            logits: Vec::with_capacity(states.len()),
            board: Arc::clone(&board),
            threads: Vec::with_capacity(states.len()),
        };
        for (i, state) in states.into_iter().enumerate() {
            metas.push((state.decode_meta.clone(), state.prefill_meta.clone()));
            workers
                .logits
                .push((state.decode_logits.clone(), state.prefill_logits.clone()));
            let board = Arc::clone(&board);
            let thread = std::thread::Builder::new()
                .name(format!("deepinfer-rank-{}", i + 1))
                .spawn(move || Self::work(state, &board))
                .map_err(|e| Error::Internal(format!("cannot start a rank's thread: {e}")))?;
            workers.threads.push(thread);
        }
        workers.metas = metas;
        Ok(workers)
    }

    /// A worker: runs each posted task on its rank until told to stop.
    fn work(mut state: RankState, board: &Board) {
        let mut seen = 0;
        loop {
            let task = {
                let mut b = lock_board(&board.state);
                while b.posted == seen && !b.stop {
                    b = board.posted.wait(b).unwrap_or_else(|e| e.into_inner());
                }
                if b.stop {
                    return;
                }
                seen = b.posted;
                b.task.clone()
            };
            let result = match task {
                Some(Task::Execute(key)) => state.execute(&key),
                Some(Task::Load(graphs)) => graphs
                    .iter()
                    .try_for_each(|j| state.load_graph(j.kind, &j.spec, &j.graph, &j.neff)),
                Some(Task::Forget(keys)) => {
                    keys.iter().for_each(|k| drop(state.graphs.remove(k)));
                    Ok(())
                }
                None => Err(Error::Internal("a task was posted without a graph".into())),
            };
            let mut b = lock_board(&board.state);
            if let Err(e) = result {
                b.errors.push(e);
            }
            b.pending -= 1;
            if b.pending == 0 {
                board.finished.notify_one();
            }
        }
    }

    /// Posts graph `key` to every worker.
    fn post(&self, key: GraphKey) {
        self.post_task(Task::Execute(key));
    }

    /// Posts `task` to every worker.
    fn post_task(&self, task: Task) {
        if self.threads.is_empty() {
            return;
        }
        let mut b = lock_board(&self.board.state);
        b.posted += 1;
        b.task = Some(task);
        b.pending = self.threads.len();
        b.errors.clear();
        drop(b);
        self.board.posted.notify_all();
    }

    /// Waits until every worker has finished the posted step; returns their errors.
    fn wait(&self) -> Vec<Error> {
        if self.threads.is_empty() {
            return Vec::new();
        }
        let mut b = lock_board(&self.board.state);
        while b.pending > 0 {
            b = self
                .board
                .finished
                .wait(b)
                .unwrap_or_else(|e| e.into_inner());
        }
        std::mem::take(&mut b.errors)
    }
}

impl Drop for RankWorkers {
    fn drop(&mut self) {
        lock_board(&self.board.state).stop = true;
        self.board.posted.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl RankState {
    /// Executes graph `key` on this rank.
    fn execute(&self, key: &GraphKey) -> Result<()> {
        let g = self.graphs.get(key).ok_or_else(|| {
            Error::Internal(format!(
                "no {:?} graph for {} rows of {} sequences, context {}",
                key.0, key.1, key.2, key.3
            ))
        })?;
        g.model.execute(&g.inputs, &g.outputs).map_err(dev(&g.name))
    }
}

/// The bucket a graph belongs to: a sampling or greedy graph is its decode bucket's.
fn bucket_of(kind: StepKind, spec: &GraphSpec) -> BucketKey {
    BucketKey {
        kind: match kind.is_decode() {
            true => BucketKind::Decode,
            false => BucketKind::Prefill,
        },
        rows: spec.rows,
        seqs: spec.seqs,
        ctx: spec.ctx,
    }
}

/// A bucket a background capture has not loaded yet: its key and its graphs (kind, spec,
/// graph, build time).
struct PendingBucket {
    key: BucketKey,
    /// The bucket's greedy graphs ([`StepKind::is_greedy`]), which join a bucket already live
    /// (or absent): failing them costs greedy steps their shortcut, not the bucket.
    greedy: bool,
    graphs: Vec<(StepKind, GraphSpec, Graph, Duration)>,
}

/// A compiled NEFF, or why it could not be compiled.
type Compiled = std::result::Result<Arc<Vec<u8>>, String>;

/// A pending bucket whose compiles have all finished: its graphs' NEFFs, or why one is
/// missing.
type ReadyBucket = (
    PendingBucket,
    std::result::Result<Vec<Arc<Vec<u8>>>, String>,
);

/// What a background capture ([`DeviceOptions::background_compile`]) has not loaded yet, and
/// the thread compiling it. Dropping it tells the thread to start no new compile (those
/// running finish, and their NEFFs are cached for the next run); the thread is not waited for,
/// since a neuronx-cc run can take an hour.
struct Background {
    /// In joining order.
    units: Vec<PendingBucket>,
    /// NEFFs compiled so far by graph name, kept until no pending bucket needs them.
    neffs: HashMap<String, Compiled>,
    rx: mpsc::Receiver<(String, std::result::Result<Vec<u8>, String>)>,
    cancel: Arc<AtomicBool>,
    /// When the capture began (for the log).
    started: Instant,
}

impl Background {
    /// Starts compiling `jobs` (in order, [`CompilerConfig::jobs`] at a time, no progress bar:
    /// a server logs instead) for the pending buckets `units`; `ready` holds the NEFFs they
    /// need that the capture compiled already.
    fn start(
        cfg: &CompilerConfig,
        jobs: Vec<CompileJob>,
        units: Vec<PendingBucket>,
        ready: HashMap<String, Compiled>,
        started: Instant,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut cfg = cfg.clone();
        cfg.progress = false;
        let stop = Arc::clone(&cancel);
        std::thread::Builder::new()
            .name("deepinfer-compile".into())
            .spawn(move || {
                compile_each(&cfg, &jobs, &stop, &|i, result| {
                    let Some(job) = jobs.get(i) else { return };
                    let result = match result {
                        Ok(c) => {
                            tracing::info!(
                                "compiled {}{}",
                                job.name,
                                if c.cache_hit { " (cached)" } else { "" }
                            );
                            Ok(c.neff)
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    // The runner may be gone (destroyed meanwhile): nothing to tell then.
                    let _ = tx.send((job.name.clone(), result));
                });
            })
            .map_err(|e| Error::Internal(format!("cannot start the compile thread: {e}")))?;
        Ok(Background {
            units,
            neffs: ready,
            rx,
            cancel,
            started,
        })
    }

    /// Takes the pending buckets whose NEFFs have all arrived, in joining order, each with its
    /// graphs' NEFFs or why one of them is missing.
    fn take_ready(&mut self) -> Vec<ReadyBucket> {
        let mut ended = false;
        loop {
            match self.rx.try_recv() {
                Ok((name, r)) => {
                    self.neffs.insert(name, r.map(Arc::new));
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    ended = true;
                    break;
                }
            }
        }
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.units.len() {
            let mut neffs = Vec::new();
            let mut verdict = Some(Ok(()));
            for (_, _, g, _) in &self.units[i].graphs {
                match self.neffs.get(g.name()) {
                    Some(Ok(n)) => neffs.push(Arc::clone(n)),
                    Some(Err(e)) => {
                        verdict = Some(Err(e.clone()));
                        break;
                    }
                    None if ended => {
                        verdict = Some(Err(format!(
                            "the compile thread ended before compiling {}",
                            g.name()
                        )));
                        break;
                    }
                    None => {
                        verdict = None;
                        break;
                    }
                }
            }
            match verdict {
                Some(v) => out.push((self.units.remove(i), v.map(|()| neffs))),
                None => i += 1,
            }
        }
        let units = &self.units;
        self.neffs.retain(|name, _| {
            units
                .iter()
                .flat_map(|u| &u.graphs)
                .any(|g| g.2.name() == name)
        });
        out
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// The graph runner over libnrt (a NeuronCore, or nrt-sim).
pub struct DeviceRunner {
    cfg: ModelConfig,
    specs: WeightSpecs,
    /// Each local rank's weights (its shards under tensor parallelism).
    weights: Vec<ModelWeights>,
    /// The global ranks this process runs.
    span: RankSpan,
    layout: CacheLayout,
    runner_cfg: RunnerConfig,
    opts: DeviceOptions,
    rt: Runtime,
    state: Option<Captured>,
    stats: Option<CaptureStats>,
    /// Host staging for step metadata, refilled in place each replay (no allocation).
    staging: step::StepArrays,
    /// Where late masks are computed during a split step's forward pass, kept between steps.
    mask_scratch: Vec<u32>,
    /// The processes running the other ranks, when this one leads a model over several
    /// instances ([`DeviceRunner::attach_followers`]).
    followers: Option<Followers>,
    /// The buckets steps can run on now (every captured one, unless some are still compiling
    /// in the background).
    live: LiveBuckets,
    /// The buckets still compiling, with [`DeviceOptions::background_compile`].
    background: Option<Background>,
    /// Where the replays so far spent their time.
    timing: ReplayTiming,
    /// The last step's hidden states (`[rows, hidden]`, row-major) when the model drafts:
    /// what the next draft step reads (see `speculative`).
    hidden: Option<Vec<f32>>,
}

/// Where a device runner's replays spent their time: in all, and waiting for the NeuronCores
/// (from the executions' start until every rank's ended). The rest is the host's own work per
/// step (staging the metadata, writing it, reading the outputs), which a device cannot hide:
/// the first-contact report gives it per replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayTiming {
    /// Replays timed.
    pub replays: u64,
    /// Their wall time.
    pub total: Duration,
    /// The part of it spent waiting for the executions.
    pub waiting: Duration,
}

impl ReplayTiming {
    /// The host's own time per replay (`(total - waiting) / replays`); `None` before any.
    pub fn host_per_replay(&self) -> Option<Duration> {
        let replays = u32::try_from(self.replays).ok().filter(|&n| n > 0)?;
        Some(self.total.saturating_sub(self.waiting) / replays)
    }
}

impl std::fmt::Debug for DeviceRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRunner")
            .field("runner_cfg", &self.runner_cfg)
            .field("opts", &self.opts)
            .field("captured", &self.state.is_some())
            .field("followers", &self.followers)
            .finish()
    }
}

fn dev(graph: &str) -> impl FnOnce(neuron_sys::Error) -> Error + '_ {
    move |nrt| Error::Device {
        graph: graph.to_string(),
        nrt,
    }
}

/// What a rank's loading thread reads of its runner (see `DeviceRunner::load_every_rank`).
struct RankLoader<'a> {
    rt: &'a Runtime,
    /// The NeuronCore of local rank 0.
    first_nc: u32,
    /// The global rank of local rank 0.
    first_rank: usize,
    rc: &'a RunnerConfig,
    cfg: &'a ModelConfig,
    layout: &'a CacheLayout,
    /// Each local rank's weights.
    weights: &'a [ModelWeights],
}

impl RankLoader<'_> {
    /// Uploads local rank `local`'s weights to its NeuronCore, allocates its persistent
    /// tensors and loads every graph on it (with `nrt_load_collectives` as global rank
    /// `span.first + local` when the model is split).
    ///
    /// Every graph of the capture (`graphs`) sizes the persistent tensors; only those of
    /// `neffs` (index into `graphs`, NEFF) are loaded now, the others join later
    /// ([`RankState::load_graph`]).
    fn allocate_and_load(
        &self,
        local: usize,
        graphs: &[(StepKind, GraphSpec, Graph)],
        neffs: &[(usize, &[u8])],
        progress: &Progress,
    ) -> Result<(RankState, u64)> {
        const CAP: &str = "capture";
        let rt = self.rt;
        let nc = self.first_nc + local as u32;
        let rc = self.rc;
        let host_weights = &self.weights[local];
        let mut uploaded = 0u64;

        // Weights: once, under the graph input's name, each read (for streamed weights: from
        // the checkpoint, this rank's shard only) and uploaded before the next is read.
        let mut weights: HashMap<String, Tensor> = HashMap::new();
        for (_, _, g) in graphs {
            for decl in g.inputs().iter().filter(|d| d.role == InputRole::Weight) {
                if weights.contains_key(&decl.name) {
                    continue;
                }
                for (name, host) in host_weights.fetch(&decl.name)? {
                    let Some(d) = g.inputs().iter().find(|d| d.name == name) else {
                        continue;
                    };
                    let (t, n) = with_tensor_bytes(&host, d.dtype, |bytes| -> Result<_> {
                        let t = Tensor::device(rt, nc, bytes.len(), &name).map_err(dev(CAP))?;
                        t.write(0, bytes).map_err(dev(CAP))?;
                        Ok((t, bytes.len() as u64))
                    })??;
                    uploaded += n;
                    weights.insert(name, t);
                }
            }
        }

        // The cache roots, each zeroed once (device memory is not zeroed by the allocator), on
        // the device: `nrt_tensor_memset` sends nothing over the bus, where host writes of
        // zeros would send the whole root (about 124 GB for V2 at tp 32).
        let mut roots = Vec::new();
        for spec in model::cache_roots(self.cfg, self.layout)? {
            let root_bytes = spec.bytes() as usize;
            let root = Tensor::device(rt, nc, root_bytes, spec.name).map_err(dev(CAP))?;
            root.fill_or_write(0, 0, root_bytes).map_err(dev(CAP))?;
            roots.push((spec.name, root));
        }

        let max_batch = rc.buckets.batch.iter().copied().max().unwrap_or(1);
        // A drafting model's draft graphs read their hidden states from the host (see
        // `speculative`): one buffer for every bucket, at the most rows a step has.
        let hidden_rows = max_batch.max(rc.buckets.prefill_chunk);
        let hidden_bytes = hidden_rows * self.cfg.hidden_size * 4;
        let drafting = self.cfg.draft_layers > 0;
        let hidden_in = match drafting {
            true => Some(MetaBuf {
                name: mtp::HIDDEN,
                tensor: Tensor::device(rt, nc, hidden_bytes, "draft/hidden").map_err(dev(CAP))?,
                row_bytes: self.cfg.hidden_size * 4,
                ones: Arc::new(AtomicUsize::new(0)),
            }),
            false => None,
        };
        let hidden_out = match drafting {
            true => Some(Tensor::device(rt, nc, hidden_bytes, "hidden").map_err(dev(CAP))?),
            false => None,
        };

        // Metadata buffers per ctx bucket, at the largest batch (decode) / the largest chunk
        // packing the most sequences (prefill: every smaller prefill graph's inputs are
        // prefixes of its, and only it and the other packed graphs read `seq_ids`).
        let mut decode_meta = Vec::with_capacity(rc.buckets.ctx.len());
        let mut prefill_meta = Vec::with_capacity(rc.buckets.ctx.len());
        for &ctx in &rc.buckets.ctx {
            let chunk = rc.buckets.prefill_chunk;
            for (kind, rows, seqs, out) in [
                (StepKind::Decode, max_batch, max_batch, &mut decode_meta),
                (
                    StepKind::Prefill,
                    chunk,
                    rc.buckets.packed_seqs(chunk, ctx),
                    &mut prefill_meta,
                ),
            ] {
                let g = graphs
                    .iter()
                    .find(|(k, s, _)| {
                        *k == kind && s.rows == rows && s.seqs == seqs && s.ctx == ctx
                    })
                    .map(|(_, _, g)| g)
                    .ok_or_else(|| Error::Binding {
                        name: format!("{kind:?} rows {rows} seqs {seqs} ctx {ctx}"),
                        msg: "no captured graph".into(),
                    })?;
                // The bucket's other graphs' inputs too: a split decode step's sampling
                // graph's, a verify graph's chunk arrays.
                let siblings = graphs.iter().filter(|(k, s, _)| {
                    kind == StepKind::Decode
                        && *k != StepKind::Decode
                        && k.is_decode()
                        && s.rows == rows
                        && s.ctx == ctx
                });
                let prefix = match kind.is_decode() {
                    true => "decode",
                    false => "prefill",
                };
                let mut bufs: Vec<MetaBuf> = Vec::new();
                let decls = g
                    .inputs()
                    .iter()
                    .chain(siblings.flat_map(|(_, _, g)| g.inputs()));
                for decl in decls.filter(|d| d.role == InputRole::Metadata) {
                    if bufs.iter().any(|b| b.name == decl.name) {
                        continue;
                    }
                    let dims = decl.shape.dims();
                    let lead = dims.first().copied().unwrap_or(1).max(1);
                    let total = dims.iter().product::<usize>() * decl.dtype.size_in_bytes();
                    let name = inputs::by_name(&decl.name).ok_or_else(|| Error::Binding {
                        name: decl.name.clone(),
                        msg: format!("graph `{}`: unknown metadata input", g.name()),
                    })?;
                    let tensor = Tensor::device(rt, nc, total, &format!("{prefix}_c{ctx}/{name}"))
                        .map_err(dev(CAP))?;
                    bufs.push(MetaBuf {
                        name,
                        tensor,
                        row_bytes: total / lead,
                        ones: Arc::new(AtomicUsize::new(0)),
                    });
                }
                bufs.extend(hidden_in.iter().cloned());
                out.push(bufs);
            }
        }

        // Persistent outputs; the logits are this rank's vocabulary slice's columns.
        let vocab = shard::rows_per_rank(self.cfg.vocab_size, rc.tp);
        let t = rc.buckets.prefill_chunk;
        let decode_next =
            Tensor::device(rt, nc, max_batch * 4, "decode/next_tokens").map_err(dev(CAP))?;
        let decode_logits =
            Tensor::device(rt, nc, max_batch * vocab * 4, "decode/logits").map_err(dev(CAP))?;
        let max_packed = rc
            .buckets
            .ctx
            .iter()
            .map(|&c| rc.buckets.packed_seqs(t, c))
            .max()
            .unwrap_or(1);
        let prefill_next =
            Tensor::device(rt, nc, max_packed * 4, "prefill/next_tokens").map_err(dev(CAP))?;
        let prefill_logits =
            Tensor::device(rt, nc, t * vocab * 4, "prefill/logits").map_err(dev(CAP))?;

        let mut state = RankState {
            graphs: HashMap::new(),
            decode_meta,
            prefill_meta,
            decode_next,
            decode_logits,
            prefill_next,
            prefill_logits,
            hidden_out,
            roots,
            weights,
            loader: GraphLoader {
                rt: rt.clone(),
                nc,
                rank: self.first_rank + local,
                tp: rc.tp,
                ctx: rc.buckets.ctx.clone(),
                vocab,
                hidden: self.cfg.hidden_size,
            },
        };
        for (done, &(i, neff)) in neffs.iter().enumerate() {
            let (kind, spec, g) = graphs.get(i).ok_or_else(|| {
                Error::Internal(format!("no graph {i} of {} to load", graphs.len()))
            })?;
            progress.update(done, g.name());
            state.load_graph(*kind, spec, g, neff)?;
        }
        Ok((state, uploaded))
    }
}

impl RankState {
    /// Loads graph `g` (bucket `kind`, `spec`) from `neff` on this rank and binds it to the
    /// rank's persistent tensors: at capture, and when a bucket compiled in the background
    /// joins.
    fn load_graph(
        &mut self,
        kind: StepKind,
        spec: &GraphSpec,
        g: &Graph,
        neff: &[u8],
    ) -> Result<()> {
        let l = &self.loader;
        let (rt, nc, vocab) = (&l.rt, l.nc, l.vocab);
        let (weights, roots) = (&self.weights, &self.roots);
        let (decode_meta, prefill_meta) = (&self.decode_meta, &self.prefill_meta);
        let (decode_next, decode_logits) = (&self.decode_next, &self.decode_logits);
        let (prefill_next, prefill_logits) = (&self.prefill_next, &self.prefill_logits);
        let hidden_out = |rows: usize, graph: &str| match &self.hidden_out {
            Some(t) => first_bytes(t, rows * self.loader.hidden * 4, graph),
            None => Err(Error::Binding {
                name: mtp::HIDDEN.into(),
                msg: format!("graph `{graph}`: the runner holds no hidden states (no MTP layer)"),
            }),
        };
        let root_named = |name: &str, graph: &str| {
            roots
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, t)| t.clone())
                .ok_or_else(|| Error::Binding {
                    name: name.to_string(),
                    msg: format!("graph `{graph}`: the model keeps no cache root of that name"),
                })
        };
        let kind = &kind;
        let name = g.name();
        let ctx_index = l.ctx.iter().position(|&c| c == spec.ctx).unwrap_or(0);
        let meta = match kind.is_decode() {
            true => decode_meta.get(ctx_index),
            false => prefill_meta.get(ctx_index),
        }
        .ok_or_else(|| Error::Internal(format!("graph `{name}`: no metadata buffers")))?;
        // A NEFF already loaded for another bucket (the same graph) is bound again, not loaded
        // again: its code takes device memory once, as the memory plan counts it, and with
        // collectives a second load of it would take the rank's seat in its group again.
        let loaded = self.graphs.values().find(|g| g.name == name);
        let model = match (loaded, l.tp) {
            (Some(g), _) => Arc::clone(&g.model),
            (None, 1) => Arc::new(Model::load(rt, neff, Some(nc), None).map_err(dev(name))?),
            (None, tp) => Arc::new(
                Model::load_collectives(rt, neff, Some(nc), None, l.rank as u32, tp as u32)
                    .map_err(dev(name))?,
            ),
        };
        let (names, in_sizes, out_sizes) = reported_io(&model, g)?;
        let mut inputs = TensorSet::new(rt).map_err(dev(name))?;
        for (k, decl) in g.inputs().iter().enumerate() {
            let want = decl.shape.dims().iter().product::<usize>() * decl.dtype.size_in_bytes();
            let t = match decl.role {
                InputRole::Weight => {
                    weights
                        .get(&decl.name)
                        .cloned()
                        .ok_or_else(|| Error::Binding {
                            name: decl.name.clone(),
                            msg: format!("graph `{name}`: weight not uploaded"),
                        })?
                }
                InputRole::CacheRoot => root_named(&decl.name, name)?,
                // The logits the step's forward graph left (see "Split sampling").
                InputRole::Carried if decl.name == model::STEP_LOGITS => {
                    first_bytes(decode_logits, spec.rows * vocab * 4, name)?
                }
                // The hidden states a draft step drafts from, written from the host.
                InputRole::Carried if decl.name == mtp::HIDDEN => {
                    let buf = meta.iter().find(|b| b.name == mtp::HIDDEN).ok_or_else(|| {
                        Error::Binding {
                            name: decl.name.clone(),
                            msg: format!("graph `{name}`: no hidden-state buffer"),
                        }
                    })?;
                    first_bytes(&buf.tensor, want, name)?
                }
                InputRole::Carried => {
                    return Err(Error::Binding {
                        name: decl.name.clone(),
                        msg: format!("graph `{name}`: no graph leaves that input"),
                    })
                }
                InputRole::Metadata => {
                    let buf = meta.iter().find(|b| b.name == decl.name).ok_or_else(|| {
                        Error::Binding {
                            name: decl.name.clone(),
                            msg: format!("graph `{name}`: no metadata buffer"),
                        }
                    })?;
                    first_bytes(&buf.tensor, want, name)?
                }
            };
            if t.size() != want {
                return Err(Error::Binding {
                    name: decl.name.clone(),
                    msg: format!(
                        "graph `{name}` needs {want} bytes, the device tensor has {}",
                        t.size()
                    ),
                });
            }
            check_size(
                name,
                "input",
                &names.inputs[k],
                in_sizes.get(&names.inputs[k]),
                &t,
            )?;
            inputs.add(&names.inputs[k], &t).map_err(dev(name))?;
        }
        let mut outputs = TensorSet::new(rt).map_err(dev(name))?;
        for (k, decl) in g.outputs().iter().enumerate() {
            let t = match (kind, decl.name.as_str()) {
                // An updated cache root: the same tensor as the input it aliases.
                _ if decl.aliases.is_some() => root_named(&decl.name, name)?,
                (k, "next_tokens") if k.is_decode() => {
                    first_bytes(decode_next, spec.rows * 4, name)?
                }
                (StepKind::Decode | StepKind::Greedy | StepKind::Verify, "logits") => {
                    first_bytes(decode_logits, spec.rows * vocab * 4, name)?
                }
                (_, mtp::HIDDEN | mtp::DRAFT_HIDDEN) => hidden_out(spec.rows, name)?,
                (StepKind::Prefill | StepKind::Draft, "next_tokens") => {
                    first_bytes(prefill_next, spec.seqs * 4, name)?
                }
                (StepKind::Prefill, "logits") => {
                    first_bytes(prefill_logits, spec.rows * vocab * 4, name)?
                }
                (_, other) => {
                    return Err(Error::Binding {
                        name: other.to_string(),
                        msg: format!("graph `{name}`: unexpected output"),
                    })
                }
            };
            let neff_name = &names.outputs[k];
            check_size(name, "output", neff_name, out_sizes.get(neff_name), &t)?;
            outputs.add(neff_name, &t).map_err(dev(name))?;
        }
        self.graphs.insert(
            (*kind, spec.rows, spec.seqs, spec.ctx),
            Loaded {
                name: name.to_string(),
                moe: spec.moe,
                model,
                names,
                inputs,
                outputs,
                ctx_index,
            },
        );
        Ok(())
    }
}

/// A device error of rank `rank`'s capture, saying which rank and NeuronCore it came from.
fn on_rank(e: Error, rank: usize, nc: u32) -> Error {
    match e {
        Error::Device { graph, nrt } => Error::Device {
            graph: format!("{graph} (rank {rank}, NeuronCore {nc})"),
            nrt,
        },
        e => e,
    }
}

fn host_bytes(a: &HostArray) -> &[u8] {
    match &a.data {
        HostData::I32(v) => bytemuck::cast_slice(v),
        HostData::F32(v) => bytemuck::cast_slice(v),
        HostData::U32(v) => bytemuck::cast_slice(v),
    }
}

/// A slice of the first `bytes` of `t`, or `t` itself when that is all of it.
fn first_bytes(t: &Tensor, bytes: usize, graph: &str) -> Result<Tensor> {
    if bytes == t.size() {
        Ok(t.clone())
    } else {
        t.slice(0, bytes).map_err(dev(graph))
    }
}

impl DeviceRunner {
    /// A runner over `lib` (libnrt or nrt-sim), initialising (or sharing) the runtime over
    /// cores `opts.nc ..` (one per local rank). `weights` are the whole model's; with
    /// `runner_cfg.tp > 1` each local rank takes its shards. Nothing is allocated on the device
    /// until [`Runner::capture`]. Its graphs multiply in the weights' own dtype
    /// ([`Dots::DEVICE`], see `model::precision`), whatever `weights` were loaded for.
    ///
    /// A tensor-parallel runner needs `NEURON_RT_ROOT_COMM_ID` for libnrt's collectives: when
    /// it is unset and this process runs every rank, it is set to [`DEFAULT_ROOT_COMM_ID`]
    /// before the runtime starts; a process running only some ranks must be given it.
    pub fn new(
        cfg: ModelConfig,
        weights: ModelWeights,
        runner_cfg: RunnerConfig,
        lib: Arc<Library>,
        opts: DeviceOptions,
    ) -> Result<Self> {
        let quantize = weights.specs().precision().quantize;
        if quantize.is_cpu_only() {
            return Err(quantize.cpu_only_error("a NeuronCore (the device runner)"));
        }
        let weights = weights.with_dots(Dots::DEVICE);
        runner_cfg.buckets.validate(runner_cfg.block_size)?;
        let tp = runner_cfg.tp;
        let span = opts.ranks.unwrap_or(RankSpan {
            first: 0,
            count: tp,
        });
        if span.count == 0 || span.first + span.count > tp {
            return Err(Error::InvalidInput(format!(
                "ranks {}..{} of a model split over --tp {tp}",
                span.first,
                span.first + span.count
            )));
        }
        if tp > 1 && std::env::var_os(ROOT_COMM_ID_ENV).is_none() {
            if span.count != tp {
                return Err(Error::InvalidInput(format!(
                    "{ROOT_COMM_ID_ENV} is not set: a process running ranks {}..{} of {tp} \
                     needs the host:port of rank 0's root communicator (the same on every \
                     instance)",
                    span.first,
                    span.first + span.count
                )));
            }
            // Read by libnrt when it bootstraps the collectives, after this.
            std::env::set_var(ROOT_COMM_ID_ENV, DEFAULT_ROOT_COMM_ID);
        }
        if let Ok(Some(visible)) = lib.visible_nc_count() {
            let end = opts.nc as usize + span.count;
            if span.count > 1 && end > visible as usize {
                return Err(Error::InvalidInput(format!(
                    "--tp {tp} needs NeuronCores {}..{end} for its {} ranks here, but only \
                     {visible} are visible (a trn1.2xlarge has 2, a trn1.32xlarge 32; see \
                     NEURON_RT_VISIBLE_CORES): use a smaller --tp or a larger instance",
                    opts.nc, span.count
                )));
            }
        }
        let rt = Runtime::shared(lib, opts.nc, span.count as u32)?;
        let weights = match tp {
            1 => vec![weights],
            _ => (span.first..span.first + span.count)
                .map(|r| weights.shard(&cfg, r, tp))
                .collect::<Result<Vec<_>>>()?,
        };
        let layout = runner_cfg.cache_layout();
        let live = LiveBuckets::none(&runner_cfg.buckets);
        Ok(DeviceRunner {
            specs: weights[0].specs().clone(),
            cfg,
            weights,
            span,
            layout,
            runner_cfg,
            opts,
            rt,
            state: None,
            stats: None,
            staging: step::StepArrays::default(),
            mask_scratch: Vec::new(),
            followers: None,
            live,
            background: None,
            timing: ReplayTiming::default(),
            hidden: None,
        })
    }

    /// Runs one replay, adding its wall time to [`Self::replay_timing`].
    fn timed<T>(&mut self, replay: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = replay(self);
        self.timing.replays += 1;
        self.timing.total += t.elapsed();
        out
    }

    /// Sets where replays find the step metadata (see [`MetadataSource`]).
    pub fn set_metadata_source(&mut self, source: MetadataSource) {
        self.opts.metadata = source;
        // The caller may have written the buffers meanwhile.
        for (decode, prefill) in self.all_metadata() {
            decode
                .iter()
                .chain(prefill)
                .flatten()
                .for_each(MetaBuf::forget);
        }
    }

    /// Every local rank's metadata buffers (decode's, prefill's), the first rank's first.
    fn all_metadata(&self) -> impl Iterator<Item = (&Vec<Vec<MetaBuf>>, &Vec<Vec<MetaBuf>>)> {
        self.state.iter().flat_map(|st| {
            std::iter::once((&st.first.decode_meta, &st.first.prefill_meta))
                .chain(st.others.metas.iter().map(|(d, p)| (d, p)))
        })
    }

    /// The cache geometry graphs are built for.
    pub fn cache_layout(&self) -> CacheLayout {
        self.layout
    }

    /// The device memory each local rank's NeuronCore can still take, by the runtime's own
    /// count (`nrt_get_vnc_memory_stats`: its limit less what is in use), the least over the
    /// cores; `None` when the runtime cannot say (libnrt before 2.27.23).
    pub fn free_hbm(&self) -> Result<Option<u64>> {
        let mut least: Option<u64> = None;
        for nc in self.opts.nc..self.opts.nc + self.span.count as u32 {
            let Some(stats) = self.rt.memory_stats(nc)? else {
                return Ok(None);
            };
            let free = stats.limit.saturating_sub(stats.used);
            least = Some(least.map_or(free, |l| l.min(free)));
        }
        Ok(least)
    }

    /// Sizes the KV cache to `blocks` blocks before the first capture (`--kv-blocks auto` by
    /// the runtime's count, see [`Self::free_hbm`]); a captured runner keeps its cache.
    pub fn set_kv_blocks(&mut self, blocks: usize) -> Result<()> {
        if self.state.is_some() {
            return Err(Error::Internal(
                "the KV cache is resized only before the first capture".into(),
            ));
        }
        self.runner_cfg.num_blocks = blocks;
        self.layout = self.runner_cfg.cache_layout();
        Ok(())
    }

    /// The runtime the models are loaded in.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// What the last capture cost, if one happened.
    pub fn capture_stats(&self) -> Option<&CaptureStats> {
        self.stats.as_ref()
    }

    /// How many weight tensors live on the first local rank's NeuronCore (0 when not
    /// captured).
    pub fn device_weight_count(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.first.weights.len())
    }

    /// The global ranks this runner runs.
    pub fn ranks(&self) -> RankSpan {
        self.span
    }

    /// Whether the graphs are captured (false after [`Runner::destroy`]).
    pub fn is_captured(&self) -> bool {
        self.state.is_some()
    }

    /// The NEFF names graph `graph`'s inputs and outputs are bound under (what its loaded model
    /// reports, mapped onto the graph by [`super::binding`]), or `None` when no such graph is
    /// captured.
    pub fn bound_names(&self, graph: &str) -> Option<&NeffBinding> {
        let st = self.state.as_ref()?;
        st.first
            .graphs
            .values()
            .find(|l| l.name == graph)
            .map(|l| &l.names)
    }

    /// The MoE strategy loaded graph `graph` was built with, or `None` when no such graph is
    /// captured. Tests use it to see that nrt-sim runs both strategies where a device would.
    pub fn moe_strategy(&self, graph: &str) -> Option<MoeStrategy> {
        let st = self.state.as_ref()?;
        st.first
            .graphs
            .values()
            .find(|l| l.name == graph)
            .map(|l| l.moe)
    }

    /// Names of the loaded graphs, largest first.
    pub fn graph_names(&self) -> Vec<String> {
        self.stats
            .as_ref()
            .filter(|_| self.state.is_some())
            .map(|s| s.graphs.iter().map(|g| g.0.clone()).collect())
            .unwrap_or_default()
    }

    /// The graphs of every bucket ([`Buckets::capture_specs`], the list the plan and the Neuron
    /// check build too; `RunnerConfig::moe` forces one MoE strategy), largest first: smaller
    /// buckets bind prefixes of the largest one's metadata and output buffers. nrt-sim takes
    /// the same MoE strategies a device would (on the CPU backend the gather would be faster,
    /// but the simulator runs what ships).
    fn specs_largest_first(&self) -> Vec<(StepKind, GraphSpec)> {
        let rc = &self.runner_cfg;
        let mut out = rc
            .buckets
            .capture_specs(&self.cfg, rc.tp, self.opts.split_sampler);
        if let Some(forced) = rc.moe {
            out.iter_mut().for_each(|(_, spec)| spec.moe = forced);
        }
        out.sort_by_key(|(k, s)| {
            (
                std::cmp::Reverse(s.rows * s.ctx),
                std::cmp::Reverse(s.ctx),
                *k == StepKind::Decode,
                std::cmp::Reverse(s.seqs),
            )
        });
        out
    }

    /// Builds and lowers every bucket's graph, uploads the weights, allocates every persistent
    /// tensor, and compiles and loads the buckets: all of them, or with
    /// [`DeviceOptions::background_compile`] the first ones, leaving the rest to a compile
    /// thread ([`Background`]).
    fn capture_buckets(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let specs = self.specs_largest_first();
        let mut built = Vec::with_capacity(specs.len());
        let mut emitted = std::collections::HashSet::new();
        // A span the binary draws as a bar (see `backend::neuron::progress`); ends when dropped.
        let progress = Progress::start(&format!("capturing {} graphs", specs.len()), specs.len());
        for (i, (kind, spec)) in specs.iter().enumerate() {
            progress.update(
                i + 1,
                &format!("{kind:?} rows {} ctx {}", spec.rows, spec.ctx),
            );
            let t = Instant::now();
            let g = kind.build(&self.cfg, &self.specs, &self.layout, spec)?;
            // A sampling or argmax graph is the same for every context bucket: emitted (and
            // compiled) once.
            let hlo = match emitted.insert(g.name().to_string()) {
                true => Some(emit::emit(&g)?),
                false => None,
            };
            built.push((*kind, *spec, (g, hlo, t.elapsed())));
        }
        deployment::keep_paying_greedy(&mut built, |(g, hlo, _)| {
            hlo.as_ref()
                .map(estimate::instructions)
                .ok_or_else(|| Error::Internal(format!("`{}` was not emitted", g.name())))
        })?;
        let mut graphs = Vec::with_capacity(built.len());
        let mut jobs: Vec<CompileJob> = Vec::with_capacity(built.len());
        let mut timings = Vec::with_capacity(built.len());
        for (kind, spec, (g, hlo, t)) in built {
            if let Some(hlo) = hlo {
                jobs.push(CompileJob {
                    name: g.name().to_string(),
                    hlo: emit::to_bytes(&hlo),
                });
            }
            timings.push(t);
            graphs.push((kind, spec, g));
        }
        // Which graphs load now: all, or the first buckets' (a decode bucket's sampling graph
        // joins with it).
        let buckets = self.runner_cfg.buckets.clone();
        let first = LiveBuckets::first(&buckets);
        let now: Vec<bool> = graphs
            .iter()
            .map(|(kind, spec, _)| {
                !self.opts.background_compile
                    || (first.contains(&bucket_of(*kind, spec)) && !kind.is_greedy())
            })
            .collect();
        let now_jobs: Vec<CompileJob> = jobs
            .iter()
            .filter(|j| {
                graphs
                    .iter()
                    .zip(&now)
                    .any(|((_, _, g), &n)| n && g.name() == j.name)
            })
            .cloned()
            .collect();
        let compiled = compile_all(self.opts.neff.compiler(), &now_jobs)?;
        // Each graph's NEFF, borrowed: a sampling graph's is shared by its context buckets.
        let neff_of = |name: &str| {
            now_jobs
                .iter()
                .position(|j| j.name == name)
                .and_then(|i| compiled.get(i))
                .map(|c| c.neff.as_slice())
        };
        let neffs: Vec<(usize, &[u8])> = graphs
            .iter()
            .enumerate()
            .filter(|(i, _)| now[*i])
            .map(|(i, (_, _, g))| {
                neff_of(g.name())
                    .map(|n| (i, n))
                    .ok_or_else(|| Error::Internal(format!("no NEFF for `{}`", g.name())))
            })
            .collect::<Result<_>>()?;
        progress.update(
            graphs.len(),
            &format!("loading {} models, uploading weights", neffs.len()),
        );
        let loaded = self.load_every_rank(&graphs, &neffs);
        drop(progress);
        let loaded = loaded?;
        let uploaded = loaded.iter().map(|(_, n)| n).sum();
        let mut states = loaded.into_iter().map(|(r, _)| r);
        let first_rank = states
            .next()
            .ok_or_else(|| Error::Internal("a capture with no rank".into()))?;
        let others = RankWorkers::start(states.collect())?;
        self.state = Some(Captured {
            first: first_rank,
            others,
        });
        self.stats = Some(CaptureStats {
            graphs: neffs
                .iter()
                .filter_map(|&(i, n)| {
                    let t = timings.get(i)?;
                    graphs
                        .get(i)
                        .map(|(_, _, g)| (g.name().to_string(), *t, n.len()))
                })
                .collect(),
            total: t0.elapsed(),
            bytes_uploaded: uploaded,
        });
        if !self.opts.background_compile {
            self.live = LiveBuckets::complete(&buckets);
            return Ok(());
        }
        let mut live = LiveBuckets::none(&buckets);
        first.iter().for_each(|k| live.join(*k));
        self.live = live;
        // The rest, bucket by bucket in the order they are to join, each with its graphs; then
        // every decode bucket's greedy graph, which only makes greedy steps cheaper and so
        // delays no bucket's joining.
        let order = LiveBuckets::background_order(&buckets);
        let mut units: Vec<PendingBucket> = order
            .iter()
            .map(|&key| (key, false))
            .chain(first.iter().chain(&order).map(|&key| (key, true)))
            .map(|(key, greedy)| PendingBucket {
                key,
                greedy,
                graphs: Vec::new(),
            })
            .collect();
        for (((kind, spec, g), t), loaded) in graphs.into_iter().zip(timings).zip(now) {
            let key = bucket_of(kind, &spec);
            let unit = units
                .iter_mut()
                .find(|u| u.key == key && u.greedy == kind.is_greedy());
            if let (Some(u), false) = (unit, loaded) {
                u.graphs.push((kind, spec, g, t));
            }
        }
        units.retain(|u| !u.graphs.is_empty());
        // The NEFFs the pending buckets need that were compiled already (a sampling graph's),
        // and the jobs left, in joining order.
        let mut ready = HashMap::new();
        let mut rest: Vec<CompileJob> = Vec::new();
        for (_, _, g, _) in units.iter().flat_map(|u| &u.graphs) {
            let name = g.name();
            if let Some(n) = neff_of(name) {
                ready
                    .entry(name.to_string())
                    .or_insert_with(|| Ok(Arc::new(n.to_vec())));
            } else if !rest.iter().any(|j| j.name == name) {
                if let Some(j) = jobs.iter().find(|j| j.name == name) {
                    rest.push(j.clone());
                }
            }
        }
        tracing::info!(
            "serving on {} and {} after {:.1} s; {} more buckets ({} graphs to compile) join \
             as they are compiled",
            first[0],
            first[1],
            t0.elapsed().as_secs_f64(),
            units.len(),
            rest.len()
        );
        self.background = Some(Background::start(
            self.opts.neff.compiler(),
            rest,
            units,
            ready,
            t0,
        )?);
        Ok(())
    }

    /// Loads the pending buckets whose NEFFs are ready on every local rank (between steps: the
    /// caller owns the runner), marks them live, and drops what the compile thread is done
    /// with. A bucket whose compile or load failed is recorded as failed and stays absent.
    fn join_ready(&mut self) -> Vec<BucketEvent> {
        let Some(bg) = self.background.as_mut() else {
            return Vec::new();
        };
        let ready = bg.take_ready();
        let started = bg.started;
        let finished = bg.units.is_empty();
        let mut events = Vec::new();
        for (unit, neffs) in ready {
            let key = unit.key;
            let loaded = neffs.and_then(|neffs| {
                let names: Vec<String> = unit.graphs.iter().map(|g| g.2.name().into()).collect();
                let sizes: Vec<usize> = neffs.iter().map(|n| n.len()).collect();
                let joining: Vec<JoiningGraph> = unit
                    .graphs
                    .iter()
                    .zip(neffs)
                    .map(|((kind, spec, graph, _), neff)| JoiningGraph {
                        kind: *kind,
                        spec: *spec,
                        graph: graph.clone(),
                        neff,
                    })
                    .collect();
                self.load_joining(joining).map_err(|e| e.to_string())?;
                Ok(names.into_iter().zip(sizes).collect::<Vec<_>>())
            });
            match loaded {
                Ok(names) => {
                    if let Some(stats) = self.stats.as_mut() {
                        for ((name, size), (_, _, _, t)) in names.into_iter().zip(&unit.graphs) {
                            stats.graphs.push((name, *t, size));
                        }
                    }
                    if unit.greedy {
                        tracing::info!("bucket {key}'s greedy graph joined");
                        continue;
                    }
                    self.live.join(key);
                    tracing::info!(
                        "bucket {key} joined, {:.1} s after capture began ({} still to join)",
                        started.elapsed().as_secs_f64(),
                        self.live.pending().len()
                    );
                    events.push(BucketEvent::Joined(key));
                }
                Err(why) if unit.greedy => tracing::warn!(
                    "bucket {key}'s greedy graph failed to compile or load; its greedy steps \
                     run the full sampler: {why}"
                ),
                Err(why) => {
                    tracing::error!(
                        "bucket {key} failed to compile or load and stays absent (the server \
                         goes on without it): {why}"
                    );
                    self.live.fail(key, why.clone());
                    events.push(BucketEvent::Failed(key, why));
                }
            }
        }
        if finished {
            if let Some(bg) = self.background.take() {
                tracing::info!(
                    "every bucket compiled {:.1} s after capture began ({} failed)",
                    bg.started.elapsed().as_secs_f64(),
                    self.live.failed().len()
                );
            }
        }
        events
    }

    /// Loads a joining bucket's graphs on every local rank at once (the others on their
    /// workers, as `nrt_load_collectives` needs); on any rank's failure unloads them from
    /// every rank, so no rank runs a bucket another lacks.
    fn load_joining(&mut self, graphs: Vec<JoiningGraph>) -> Result<()> {
        let st = self.state.as_mut().ok_or_else(not_captured)?;
        let graphs = Arc::new(graphs);
        st.others.post_task(Task::Load(Arc::clone(&graphs)));
        let mine = graphs.iter().try_for_each(|j| {
            st.first
                .load_graph(j.kind, &j.spec, &j.graph, &j.neff)
                .map_err(|e| on_rank(e, self.span.first, self.opts.nc))
        });
        let theirs = st.others.wait();
        if mine.is_ok() && theirs.is_empty() {
            return Ok(());
        }
        let keys: Vec<GraphKey> = graphs
            .iter()
            .map(|j| (j.kind, j.spec.rows, j.spec.seqs, j.spec.ctx))
            .collect();
        keys.iter().for_each(|k| drop(st.first.graphs.remove(k)));
        st.others.post_task(Task::Forget(Arc::new(keys)));
        st.others.wait();
        match mine {
            Err(e) => Err(e),
            Ok(()) => Err(theirs.into_iter().next().unwrap_or_else(|| {
                Error::Internal("a rank failed to load a bucket without an error".into())
            })),
        }
    }

    /// Runs [`Self::allocate_and_load`] for every local rank at once, each on its own thread.
    ///
    /// Concurrency is required, not an optimisation: `nrt_load_collectives` bootstraps the
    /// collectives communicator inside the call and returns only once every rank of the group
    /// has entered it (a serial loop waits in rank 0's first load forever on a trn1,
    /// aws-neuron-sdk#699; nrt-sim fails it with `NRT_TIMEOUT`). The ranks of the other
    /// instances load at the same time in their own processes. Each rank shows a progress bar
    /// (weights, then each model loaded); of the ranks that failed, the error reported is the first
    /// that is not a bootstrap timeout (a rank whose load failed leaves the others waiting for
    /// it until they time out), naming the rank, its NeuronCore and the graph.
    fn load_every_rank(
        &self,
        graphs: &[(StepKind, GraphSpec, Graph)],
        neffs: &[(usize, &[u8])],
    ) -> Result<Vec<(RankState, u64)>> {
        // What the loading threads share: the runner's configuration, not the runner (whose
        // captured state is not `Sync`).
        let loader = RankLoader {
            rt: &self.rt,
            first_nc: self.opts.nc,
            first_rank: self.span.first,
            rc: &self.runner_cfg,
            cfg: &self.cfg,
            layout: &self.layout,
            weights: &self.weights,
        };
        let loader = &loader;
        let results: Vec<Result<(RankState, u64)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.span.count)
                .map(|local| {
                    let rank = self.span.first + local;
                    let nc = self.opts.nc + local as u32;
                    std::thread::Builder::new()
                        .name(format!("load-rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let t = Instant::now();
                            // A bar per rank: weights uploaded, then each model loaded.
                            let progress = Progress::start(
                                &format!("rank {rank} (NeuronCore {nc}): loading"),
                                neffs.len(),
                            );
                            progress.update(0, "uploading weights");
                            let r = loader
                                .allocate_and_load(local, graphs, neffs, &progress)
                                .map_err(|e| on_rank(e, rank, nc));
                            if let Ok((_, bytes)) = &r {
                                tracing::debug!(
                                    "rank {rank} (NeuronCore {nc}): {} models loaded, {:.2} GB \
                                     uploaded in {:.1} s",
                                    neffs.len(),
                                    *bytes as f64 / 1e9,
                                    t.elapsed().as_secs_f64()
                                );
                            }
                            r
                        })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(Error::Internal("a rank's loading thread panicked".into()))
                    }),
                    Err(e) => Err(Error::Internal(format!(
                        "cannot start a loading thread: {e}"
                    ))),
                })
                .collect()
        });
        let is_timeout = |r: &Result<(RankState, u64)>| match r {
            Err(Error::Device { nrt, .. }) => {
                nrt.status_code() == Some(neuron_sys::sys::NRT_TIMEOUT)
            }
            _ => false,
        };
        if let Some(at) = results
            .iter()
            .position(|r| r.is_err() && !is_timeout(r))
            .or_else(|| results.iter().position(Result::is_err))
        {
            let mut results = results;
            return Err(results
                .swap_remove(at)
                .err()
                .unwrap_or_else(|| Error::Internal("a failed rank's error went missing".into())));
        }
        results.into_iter().collect()
    }

    /// Unloads every model and frees every tensor. Idempotent. Returns the first error libnrt
    /// reported while unloading.
    fn release(&mut self) -> Result<()> {
        // The followers end with the leader's capture (dropping them says goodbye).
        self.followers = None;
        self.background = None;
        self.live = LiveBuckets::none(&self.runner_cfg.buckets);
        if let Some(state) = self.state.take() {
            drop(state);
            if let Some(e) = self.rt.take_deferred_errors().into_iter().next() {
                return Err(Error::Device {
                    graph: "destroy".into(),
                    nrt: e,
                });
            }
        }
        Ok(())
    }

    /// Whether graph `key` is loaded (on every local rank: they load together).
    fn has_graph(&self, key: &GraphKey) -> bool {
        self.state
            .as_ref()
            .is_some_and(|st| st.first.graphs.contains_key(key))
    }

    fn captured(&self) -> Result<&Captured> {
        self.state.as_ref().ok_or_else(not_captured)
    }

    /// Writes `meta` into the bucket's persistent buffers (only the bucket's rows), except an
    /// `unmasked` allowed-token array whose buffer already holds all ones there. An array no
    /// buffer is named for is one no graph of the bucket reads (the buffers are its graphs'
    /// metadata inputs, each checked to have one when bound): a V4 decode step has no
    /// `context_lens`, for one. It is not written.
    fn write_meta<'a>(
        bufs: &[MetaBuf],
        meta: impl IntoIterator<Item = &'a HostArray>,
        unmasked: bool,
        graph: &str,
    ) -> Result<()> {
        for a in meta {
            let Some(buf) = bufs.iter().find(|b| b.name == a.name) else {
                continue;
            };
            let bytes = host_bytes(a);
            if bytes.len() > buf.tensor.size() || !bytes.len().is_multiple_of(buf.row_bytes.max(1))
            {
                return Err(Error::Binding {
                    name: a.name.to_string(),
                    msg: format!(
                        "graph `{graph}`: {} bytes do not fit the {}-byte buffer",
                        bytes.len(),
                        buf.tensor.size()
                    ),
                });
            }
            let ones = unmasked && a.name == inputs::ALLOWED_TOKENS;
            if ones && buf.ones.load(Ordering::Relaxed) >= bytes.len() {
                continue;
            }
            buf.forget();
            buf.tensor.write(0, bytes).map_err(dev(graph))?;
            if ones {
                buf.ones.store(bytes.len(), Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// The first `real_rows` sampled tokens of the step just run, from the first rank's `kind`
    /// output.
    fn read_tokens(&self, kind: StepKind, real_rows: usize) -> Result<Vec<u32>> {
        let first = &self.captured()?.first;
        let (next, graph) = match kind.is_decode() {
            true => (&first.decode_next, "decode"),
            false => (&first.prefill_next, "prefill"),
        };
        let mut tokens = vec![0u32; real_rows];
        next.read(0, bytemuck::cast_slice_mut(&mut tokens))
            .map_err(dev(graph))?;
        Ok(tokens)
    }

    /// The logits rows `rows` of the step just run on this process's ranks: each rank's
    /// vocabulary slice (`vocab / tp` columns, rounded up), rank after rank, the rows of each
    /// in order.
    fn local_logits(&self, kind: StepKind, rows: &[Range<usize>]) -> Result<Vec<f32>> {
        let st = self.captured()?;
        let width = shard::rows_per_rank(self.cfg.vocab_size, self.runner_cfg.tp);
        let n: usize = rows.iter().map(|r| r.len()).sum();
        let mut out = vec![0f32; self.span.count * n * width];
        let slices = std::iter::once((&st.first.decode_logits, &st.first.prefill_logits))
            .chain(st.others.logits.iter().map(|(d, p)| (d, p)));
        let mut at = 0;
        for (decode, prefill) in slices {
            let (t, graph) = match kind.is_decode() {
                true => (decode, "decode"),
                false => (prefill, "prefill"),
            };
            for r in rows {
                let part = &mut out[at..at + r.len() * width];
                t.read(r.start * width * 4, bytemuck::cast_slice_mut(part))
                    .map_err(dev(graph))?;
                at += part.len();
            }
        }
        Ok(out)
    }

    /// Whether this process can return whole logits rows: it runs every rank, or its followers
    /// run the others.
    fn sees_every_rank(&self) -> Result<()> {
        let remote: usize = self.followers.as_ref().map_or(0, Followers::rank_count);
        if self.span.count + remote == self.runner_cfg.tp {
            return Ok(());
        }
        Err(Error::InvalidInput(format!(
            "logits (logprobs) need every rank's vocabulary slice; this process runs ranks \
             {}..{} of {} and has no followers for the others",
            self.span.first,
            self.span.first + self.span.count,
            self.runner_cfg.tp
        )))
    }

    /// Writes the step's metadata into every local rank's buffers for graph `key` (unless the
    /// caller wrote them, [`MetadataSource::OnDevice`]), sends the step to the followers,
    /// executes the graph on every local rank (the first here, the others on their workers,
    /// concurrently) and returns the logits rows `logits_rows` of every rank that ran it: as
    /// `(first rank, values)` parts, this process's first (see [`Self::local_logits`]). A
    /// failure on any rank or follower fails the step; the error reported is the failing
    /// rank's own, not the collective failure it caused on the others.
    fn run_step(
        &mut self,
        key: GraphKey,
        logits_rows: &[Range<usize>],
        writes: MetaWrites,
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        let copy = self.opts.metadata == MetadataSource::Host;
        let st = self.state.as_ref().ok_or_else(not_captured)?;
        let g = st.first.graphs.get(&key).ok_or_else(|| {
            Error::Internal(format!(
                "no {:?} graph for {} rows of {} sequences, context {}",
                key.0, key.1, key.2, key.3
            ))
        })?;
        let (arrays, unmasked) = (
            self.staging.arrays(),
            self.staging.allowed_tokens_unmasked(),
        );
        let allowed = |a: &HostArray| a.name == inputs::ALLOWED_TOKENS;
        let written = |a: &&HostArray| match writes {
            MetaWrites::All => true,
            MetaWrites::None => false,
            MetaWrites::AllowedTokens => allowed(a),
            MetaWrites::AllButAllowedTokens => !allowed(a),
        };
        if copy {
            for (decode, prefill) in self.all_metadata() {
                let meta = match key.0.is_decode() {
                    true => &decode[g.ctx_index],
                    false => &prefill[g.ctx_index],
                };
                Self::write_meta(meta, arrays.iter().filter(written), unmasked, &g.name)?;
            }
        }
        if let Some(followers) = self.followers.as_mut() {
            if !copy {
                return Err(Error::InvalidInput(
                    "followers need the step metadata on the host (MetadataSource::Host)".into(),
                ));
            }
            followers.send(&StepMessage {
                kind: key.0,
                rows: key.1,
                seqs: key.2,
                ctx: key.3,
                unmasked,
                arrays: Cow::Borrowed(arrays),
                logits_rows: Cow::Borrowed(logits_rows),
            })?;
        }
        let started = Instant::now();
        st.others.post(key);
        let first = st.first.execute(&key);
        let mut errors: Vec<(Error, bool)> = st
            .others
            .wait()
            .into_iter()
            .map(|e| {
                let collective = e.is_collective_failure();
                (e, collective)
            })
            .collect();
        if let Err(e) = first {
            let collective = e.is_collective_failure();
            errors.insert(0, (e, collective));
        }
        let mut parts = Vec::new();
        for (rank, answer) in self
            .followers
            .as_mut()
            .map(|f| f.wait())
            .unwrap_or_default()
        {
            match answer {
                Ok(logits) => parts.push((rank, logits)),
                Err(e) => errors.push(e),
            }
        }
        self.timing.waiting += started.elapsed();
        if let Some(i) = errors.iter().position(|(_, collective)| !collective) {
            return Err(errors.swap_remove(i).0);
        }
        if let Some((e, _)) = errors.into_iter().next() {
            return Err(e);
        }
        if !logits_rows.is_empty() {
            parts.insert(0, (self.span.first, self.local_logits(key.0, logits_rows)?));
        }
        Ok(parts)
    }

    /// Whole logits rows (`rows` of them, `vocab` wide) from every rank's part, as
    /// [`Self::run_step`] returns them.
    fn join_logits(&self, parts: Vec<(usize, Vec<f32>)>, rows: usize) -> Result<Vec<Vec<f32>>> {
        let (vocab, tp) = (self.cfg.vocab_size, self.runner_cfg.tp);
        let width = shard::rows_per_rank(vocab, tp);
        let mut out = vec![vec![0f32; vocab]; rows];
        let mut seen = 0;
        for (first, data) in parts {
            let per_rank = rows * width;
            if per_rank == 0 || !data.len().is_multiple_of(per_rank) {
                return Err(Error::Internal(format!(
                    "{} logits from the ranks from {first}: not whole rows of {width}",
                    data.len()
                )));
            }
            for (k, rank_rows) in data.chunks(per_rank).enumerate() {
                // The last rank's slice may end in padding past the vocabulary: dropped.
                let start = ((first + k) * width).min(vocab);
                let cols = start..((first + k + 1) * width).min(vocab);
                for (row, part) in out.iter_mut().zip(rank_rows.chunks(width)) {
                    row[cols.clone()].copy_from_slice(&part[..cols.len()]);
                }
                seen += 1;
            }
        }
        if seen != tp {
            return Err(Error::Internal(format!("logits from {seen} of {tp} ranks")));
        }
        Ok(out)
    }

    /// Runs one prefill step over `chunks` on its bucket's graph.
    fn replay_prefill(
        &mut self,
        chunks: &[step::PrefillChunk<'_>],
        logits: LogitsOutput,
    ) -> Result<StepOutput> {
        self.captured()?;
        let (t, seqs, ctx) = self.live.prefill_bucket(chunks, self.cfg.vocab_size)?;
        if self.opts.metadata == MetadataSource::Host {
            self.staging.fill_prefill(
                chunks,
                t,
                seqs,
                ctx,
                self.layout.block_size,
                self.cfg.vocab_size,
            )?;
        }
        // The graph returns every position's logits, chunk after chunk; a chunk's sample was
        // drawn from its last.
        let all = logits == LogitsOutput::AllPositions;
        let rows: Vec<Range<usize>> = match logits {
            LogitsOutput::None => Vec::new(),
            _ => chunks
                .iter()
                .scan(0, |end, c| {
                    let start = *end;
                    *end += c.tokens.len();
                    Some(if all { start..*end } else { *end - 1..*end })
                })
                .collect(),
        };
        let key = (StepKind::Prefill, t, seqs, ctx);
        self.finish_step(key, &rows, chunks.len(), MetaWrites::All)
    }

    /// Runs one decode step for `rows`, padded to the smallest batch bucket.
    fn replay_decode(
        &mut self,
        rows: &[step::DecodeRow<'_>],
        logits: LogitsOutput,
    ) -> Result<StepOutput> {
        self.captured()?;
        let (batch, ctx) = self.live.decode_bucket(rows, self.cfg.vocab_size)?;
        if self.opts.metadata == MetadataSource::Host {
            self.staging.fill_decode(
                rows,
                batch,
                ctx,
                self.layout.block_size,
                self.cfg.vocab_size,
            )?;
        }
        let wanted = decode_logits_rows(rows.len(), logits);
        // A step of plain greedy rows takes its bucket's greedy graph where one is loaded.
        let greedy = rows.iter().all(step::DecodeRow::is_plain_greedy);
        let pick = |this: &Self, full: StepKind, cheap: StepKind| {
            let key = (cheap, batch, batch, ctx);
            match greedy && this.has_graph(&key) {
                true => key,
                false => (full, batch, batch, ctx),
            }
        };
        if !self.opts.split_sampler {
            let key = pick(self, StepKind::Decode, StepKind::Greedy);
            return self.finish_step(key, wanted.as_slice(), rows.len(), MetaWrites::All);
        }
        let key = (StepKind::Decode, batch, batch, ctx);
        // Checked before the forward pass, not after it (in `finish_step`): a step that cannot
        // return its logits must not have written the cache.
        if wanted.is_some() {
            self.sees_every_rank()?;
        }
        self.run_step(key, &[], MetaWrites::All)?;
        // The forward pass wrote the sampling graph's inputs too (the same buffers).
        let sample = pick(self, StepKind::Sample, StepKind::Argmax);
        self.finish_step(sample, wanted.as_slice(), rows.len(), MetaWrites::None)
    }

    /// [`Runner::replay_with_masks`] on split graphs: stages the step, runs the forward pass
    /// while another thread computes the masks, writes them into the staged allowed-token
    /// array and runs the sampling graph (see "Split sampling").
    fn replay_split_with_masks(
        &mut self,
        rows: &[step::DecodeRow<'_>],
        logits: LogitsOutput,
        masks: LateMasks<'_>,
    ) -> Result<StepOutput> {
        self.captured()?;
        let vocab = self.cfg.vocab_size;
        let (batch, ctx) = self.live.decode_bucket(rows, vocab)?;
        if let Some(&i) = masks.rows.iter().find(|&&i| i >= rows.len()) {
            return Err(Error::InvalidInput(format!(
                "a late mask for row {i} of a step of {} rows",
                rows.len()
            )));
        }
        self.staging
            .fill_decode(rows, batch, ctx, self.layout.block_size, vocab)?;
        let wanted = decode_logits_rows(rows.len(), logits);
        // Checked before the forward pass, not after it (in `finish_step`): a step that cannot
        // return its logits must not have written the cache.
        if wanted.is_some() {
            self.sees_every_rank()?;
        }
        let words = vocab.div_ceil(32);
        let mut scratch = std::mem::take(&mut self.mask_scratch);
        scratch.clear();
        scratch.resize(masks.rows.len() * words, u32::MAX);
        let (fill, out) = (masks.fill, &mut scratch);
        let (forward, filled) = std::thread::scope(|s| {
            let filler = s.spawn(move || {
                let mut views: Vec<&mut [u32]> = out.chunks_mut(words).collect();
                fill(&mut views);
            });
            let forward = self.run_step(
                (StepKind::Decode, batch, batch, ctx),
                &[],
                MetaWrites::AllButAllowedTokens,
            );
            (forward, filler.join())
        });
        if filled.is_err() {
            return Err(Error::Internal(
                "computing the allowed-token masks panicked".into(),
            ));
        }
        forward?;
        let written = self.staging.set_allowed_rows(masks.rows, &scratch);
        self.mask_scratch = scratch;
        written?;
        // Only the masks changed since the forward pass wrote the step's buffers.
        let sample = (StepKind::Sample, batch, batch, ctx);
        self.finish_step(
            sample,
            wanted.as_slice(),
            rows.len(),
            MetaWrites::AllowedTokens,
        )
    }

    /// Runs the step whose metadata is staged on graph `key` and reads its `real_rows` tokens
    /// and the logits rows `wanted` (none when empty).
    fn finish_step(
        &mut self,
        key: GraphKey,
        wanted: &[Range<usize>],
        real_rows: usize,
        writes: MetaWrites,
    ) -> Result<StepOutput> {
        if !wanted.is_empty() {
            self.sees_every_rank()?;
        }
        let parts = self.run_step(key, wanted, writes)?;
        let next_tokens = self.read_tokens(key.0, real_rows)?;
        let logits = match wanted.is_empty() {
            true => None,
            false => {
                let n = wanted.iter().map(|r| r.len()).sum();
                Some(self.join_logits(parts, n)?)
            }
        };
        Ok(StepOutput {
            next_tokens,
            logits,
        })
    }

    /// Runs one step a leader sent this follower: its metadata on every local rank, and the
    /// logits rows it asked for from them (see [`Self::local_logits`]).
    pub(crate) fn run_followed(&mut self, step: StepMessage<'_>) -> Result<Vec<f32>> {
        self.captured()?;
        if self.opts.metadata != MetadataSource::Host {
            return Err(Error::InvalidInput(
                "a follower takes its step metadata from the leader (MetadataSource::Host)".into(),
            ));
        }
        self.staging
            .replace(step.arrays.into_owned(), step.unmasked);
        let key = (step.kind, step.rows, step.seqs, step.ctx);
        let parts = self.run_step(key, &step.logits_rows, MetaWrites::All)?;
        Ok(parts.into_iter().next().map(|(_, v)| v).unwrap_or_default())
    }

    /// What this runner captured, for a leader and its followers to compare (see
    /// [`super::instances::Setup`]).
    pub fn setup(&self) -> Setup {
        Setup {
            first: self.span.first,
            count: self.span.count,
            model: format!("{:?}", self.cfg),
            runner: format!("{:?}", self.runner_cfg),
            precision: format!("{:?}", self.specs.precision()),
        }
    }

    /// Makes this runner the leader of `followers` (which run the ranks after its own): every
    /// step is sent to them first. The runner must be captured, and replays must copy host
    /// metadata ([`MetadataSource::Host`]: the followers receive it from here).
    pub fn attach_followers(&mut self, followers: Followers) -> Result<()> {
        self.captured()?;
        if self.background.is_some() {
            return Err(Error::InvalidInput(
                "a leader compiles every bucket before serving: its followers cannot join a \
                 bucket between two steps (turn background compiling off)"
                    .into(),
            ));
        }
        if self.opts.metadata != MetadataSource::Host {
            return Err(Error::InvalidInput(
                "followers need the step metadata on the host (MetadataSource::Host)".into(),
            ));
        }
        self.followers = Some(followers);
        Ok(())
    }

    /// The persistent device buffer of metadata input `name` (`input_ids`, `block_tables`, …)
    /// for the decode (or, with `prefill`, the prefill) graphs of context bucket `ctx`, sized
    /// for the largest batch: a caller that fills it itself replays with
    /// [`MetadataSource::OnDevice`].
    pub fn metadata_buffer(&self, prefill: bool, ctx: usize, name: &str) -> Option<Tensor> {
        let st = self.state.as_ref()?;
        let i = self.runner_cfg.buckets.ctx.iter().position(|&c| c == ctx)?;
        let r = &st.first;
        let bufs = if prefill {
            r.prefill_meta.get(i)?
        } else {
            r.decode_meta.get(i)?
        };
        let buf = bufs.iter().find(|b| b.name == name)?;
        // The caller will write it.
        buf.forget();
        Some(buf.tensor.clone())
    }

    /// Every cache root copied to the host by name (`[slots, cols]` in the cache dtype, the
    /// KV root first); for tests and tools.
    pub fn read_roots(&self) -> Result<Vec<(&'static str, CTensor)>> {
        let state = &self.captured()?.first;
        model::cache_roots(&self.cfg, &self.layout)?
            .into_iter()
            .zip(&state.roots)
            .map(|(spec, (name, root))| {
                let mut bytes = vec![0u8; root.size()];
                root.read(0, &mut bytes).map_err(dev(name))?;
                Ok((
                    spec.name,
                    tensor_from_bytes(spec.dtype, &spec.shape(), &bytes)?,
                ))
            })
            .collect()
    }
}

/// The error for a replay before capture (or after destroy).
/// The logits rows a decode step of `rows` rows reads back: none, or all of them as one range.
fn decode_logits_rows(rows: usize, logits: LogitsOutput) -> Option<Range<usize>> {
    (logits != LogitsOutput::None).then_some(0..rows)
}

fn not_captured() -> Error {
    Error::Internal(
        "the device runner is not captured (never, or destroyed since): call capture() before \
         replaying"
            .into(),
    )
}

/// The byte size the NEFF declares for each of its inputs (or outputs), by name.
type Sizes = HashMap<String, usize>;

/// The NEFF name of every graph input and output, read back from the loaded model
/// (`nrt_get_model_tensor_info`) and bound by [`super::binding`]'s rules, with the byte size the
/// NEFF declares for each input and output (empty when the runtime cannot report them: the names
/// are then the emitted ones, and sizes are checked at the first execution).
fn reported_io(model: &Model, graph: &Graph) -> Result<(NeffBinding, Sizes, Sizes)> {
    let io = match model.io() {
        Ok(io) => io,
        Err(neuron_sys::Error::Unsupported { .. }) => {
            return Ok((NeffBinding::emitted(graph), Sizes::new(), Sizes::new()))
        }
        Err(e) => return Err(dev(graph.name())(e)),
    };
    let ins: Vec<String> = io.inputs().map(|t| t.name.clone()).collect();
    let outs: Vec<String> = io.outputs().map(|t| t.name.clone()).collect();
    let binding = bind(graph, &ins, &outs)?;
    let ins_sizes = io.inputs().map(|t| (t.name.clone(), t.size)).collect();
    let outs_sizes = io.outputs().map(|t| (t.name.clone(), t.size)).collect();
    Ok((binding, ins_sizes, outs_sizes))
}

/// The tensor bound under NEFF name `neff_name` must have the size the NEFF declares (when it
/// declares one): a clear error at capture instead of a failed execution at the first replay.
fn check_size(
    graph: &str,
    what: &str,
    neff_name: &str,
    declared: Option<&usize>,
    t: &Tensor,
) -> Result<()> {
    match declared {
        Some(&size) if size != t.size() => Err(Error::Binding {
            name: neff_name.to_string(),
            msg: format!(
                "graph `{graph}`: the NEFF {what} takes {size} bytes, the runner bound {}",
                t.size()
            ),
        }),
        _ => Ok(()),
    }
}

impl Runner for DeviceRunner {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn runner_config(&self) -> &RunnerConfig {
        &self.runner_cfg
    }

    fn backend(&self) -> Backend {
        match self.opts.neff {
            NeffSource::Sim(_) => Backend::Sim,
            NeffSource::Compile(_) => Backend::Neuron,
        }
    }

    /// Captures `buckets`; capturing the buckets already captured does nothing, other buckets
    /// release the current capture first.
    fn capture(&mut self, buckets: &Buckets) -> Result<()> {
        buckets.validate(self.runner_cfg.block_size)?;
        if self.state.is_some() && self.runner_cfg.buckets == *buckets {
            return Ok(());
        }
        if self.followers.is_some() {
            return Err(Error::InvalidInput(
                "a leader cannot capture other buckets: its followers captured these".into(),
            ));
        }
        self.release()?;
        self.runner_cfg.buckets = buckets.clone();
        self.capture_buckets()
    }

    fn replay_with_masks(
        &mut self,
        rows: &[step::DecodeRow<'_>],
        logits: LogitsOutput,
        masks: LateMasks<'_>,
    ) -> Result<StepOutput> {
        let out = match self.opts.split_sampler && self.opts.metadata == MetadataSource::Host {
            true => self.timed(|r| r.replay_split_with_masks(rows, logits, masks)),
            false => super::replay_after_masks(self, rows, logits, masks),
        }?;
        self.keep_hidden(rows.len(), false)?;
        Ok(out)
    }

    fn replay(&mut self, step: &Step<'_>) -> Result<StepOutput> {
        self.timed(|r| match *step {
            Step::Prefill { chunks, logits } => {
                let out = r.replay_prefill(chunks, logits)?;
                r.keep_hidden(chunks.iter().map(|c| c.tokens.len()).sum(), false)?;
                Ok(out)
            }
            Step::Decode { rows, logits } => {
                let out = r.replay_decode(rows, logits)?;
                r.keep_hidden(rows.len(), false)?;
                Ok(out)
            }
            Step::Verify { chunks, logits } => r.replay_verify(chunks, logits),
            Step::Draft { chunks, logits } => r.replay_draft(chunks, logits),
        })
    }

    fn destroy(&mut self) -> Result<()> {
        self.release()
    }

    fn live_buckets(&self) -> Option<&LiveBuckets> {
        Some(&self.live)
    }

    fn join_buckets(&mut self) -> Vec<BucketEvent> {
        self.join_ready()
    }

    fn replay_timing(&self) -> Option<ReplayTiming> {
        Some(self.timing)
    }

    fn reset_replay_timing(&mut self) {
        self.timing = ReplayTiming::default();
    }

    fn loaded_graphs(&self) -> Option<Vec<String>> {
        Some(self.graph_names())
    }
}

impl Drop for DeviceRunner {
    fn drop(&mut self) {
        let _ = self.release();
    }
}
