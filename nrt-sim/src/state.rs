//! The simulated runtime's process-wide state: the phase (`nrt_init` … `nrt_close`), the
//! fault configuration read at `nrt_init`, the registries of tensors, sets and models, and
//! the counters.
//!
//! One `Mutex` guards it all. libnrt is process-global too, calls are short (lookups and
//! bookkeeping), and `nrt_execute` holds the lock only to resolve its bindings and to count:
//! the copies and the arithmetic run unlocked, on `Arc`s of the tensors' storage, so a slow
//! or long execution never blocks other threads' tensor reads and writes. Per-object locks
//! were rejected: they would make `nrt_close` (which releases everything) race with calls
//! in flight.
//!
//! The object records live here rather than beside the calls that make them (`tensor`,
//! `model`, …) because those modules lock this state: keeping the records here keeps every
//! import arrow pointing one way, from the calls down to the state.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use deepinfer::backend::cpu::RankComm;
use deepinfer::graph::Graph;
use neuron_sys::sys;

use crate::config::Config;
use crate::counters::{CoreMemory, Counters, Live, ModelCounters};
use crate::fail::{Fail, Res};
use crate::handle::{Handle, Kind, Slab};
use crate::identity::{nc_count, MAX_NC_COUNT};
use crate::model_io::{InfoArray, IoDesc};

// === Objects ===

/// Device memory in use per NeuronCore (bytes of live device storage), kept beside the storage
/// that frees it on drop (see [`Storage`]) rather than in the locked state: the last view of a
/// storage may be dropped by an execution that holds no lock.
static HBM_USED: [AtomicU64; MAX_NC_COUNT as usize] =
    [const { AtomicU64::new(0) }; MAX_NC_COUNT as usize];
/// The highest [`HBM_USED`] since load or the last counters reset, per NeuronCore.
static HBM_PEAK: [AtomicU64; MAX_NC_COUNT as usize] =
    [const { AtomicU64::new(0) }; MAX_NC_COUNT as usize];

/// Reserves `size` bytes of `core`'s device memory of `capacity`, or says how much is in use.
pub(crate) fn reserve_hbm(core: u32, size: u64, capacity: u64) -> Result<(), u64> {
    let used = &HBM_USED[core as usize];
    let now = used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
        u.checked_add(size).filter(|&n| n <= capacity)
    })? + size;
    HBM_PEAK[core as usize].fetch_max(now, Ordering::SeqCst);
    Ok(())
}

/// Bytes of `core`'s device memory in use now.
pub(crate) fn hbm_used(core: u32) -> u64 {
    HBM_USED[core as usize].load(Ordering::SeqCst)
}

/// Returns `size` bytes of `core`'s device memory.
pub(crate) fn release_hbm(core: u32, size: u64) {
    HBM_USED[core as usize].fetch_sub(size, Ordering::SeqCst);
}

/// The bytes of one allocation, shared by the tensor that allocated them and its slices.
/// libnrt's storage is refcounted the same way: a slice keeps it alive after its parent is
/// freed.
pub(crate) struct Storage {
    pub(crate) bytes: Mutex<Vec<u8>>,
    /// The NeuronCore whose device memory holds it (`None` for host and virtual placement),
    /// and its size: what it gives back to [`HBM_USED`] when the last view goes.
    pub(crate) device: Option<(u32, u64)>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Some((core, size)) = self.device {
            release_hbm(core, size);
        }
    }
}

/// A tensor: a window `offset .. offset + size` of a storage.
pub(crate) struct TensorEntry {
    pub(crate) storage: Arc<Storage>,
    pub(crate) offset: usize,
    pub(crate) size: usize,
    /// The name given at allocation (counters are kept by it).
    pub(crate) name: String,
    /// `NRT_TENSOR_PLACEMENT_*` (a slice inherits its source's).
    pub(crate) placement: sys::nrt_tensor_placement_t,
}

impl TensorEntry {
    /// The NeuronCore a device tensor lives on (`None` for host and virtual placement).
    pub(crate) fn core(&self) -> Option<u32> {
        self.storage.device.map(|(core, _)| core)
    }
}

/// A tensor set: names bound to tensor handles. The set does not own its tensors.
pub(crate) type TensorSet = HashMap<String, Handle>;

/// What a loaded NEFF holds of its core's HBM beyond its bound tensors
/// (`deepinfer::backend::neuron::footprint`): its private part (code, DMA rings, collectives
/// buffers) is reserved at load and given back when the model goes; its scratchpad is the
/// core's shared one ([`State::scratch_held`]), which holds the largest of its NEFFs'.
pub(crate) struct NeffCharge {
    pub(crate) core: u32,
    pub(crate) private: u64,
    pub(crate) scratch: u64,
}

impl Drop for NeffCharge {
    fn drop(&mut self) {
        release_hbm(self.core, self.private);
    }
}

/// A loaded model.
pub(crate) struct ModelEntry {
    pub(crate) graph: Graph,
    pub(crate) name: String,
    /// The NeuronCore it is loaded on.
    pub(crate) core: u32,
    pub(crate) inputs: Vec<IoDesc>,
    pub(crate) outputs: Vec<IoDesc>,
    pub(crate) executions: u64,
    /// For a model loaded with `nrt_load_collectives`: its seat in the group of ranks that
    /// load the same graph with the same device count.
    pub(crate) rank: Option<RankSeat>,
    /// Its code, DMA rings, collectives buffers and scratchpad, charged to its core.
    pub(crate) charge: NeffCharge,
}

/// One rank of a collectives group: its handle on the group's meetings, its global device id,
/// and how many executions were asked of it (the step number its collectives are tagged with;
/// every rank of a group is asked the same executions in the same order).
pub(crate) struct RankSeat {
    pub(crate) comm: RankComm,
    pub(crate) device_id: u32,
    pub(crate) steps: u64,
}

/// Where the runtime is in its lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Before the first `nrt_init`.
    Uninitialized,
    /// Between `nrt_init` and `nrt_close`.
    Running,
    /// After `nrt_close` (a new `nrt_init` is allowed).
    Closed,
}

/// Counters that [`crate::reset_counters`] clears.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) bytes_written: BTreeMap<String, u64>,
    pub(crate) bytes_read: BTreeMap<String, u64>,
    pub(crate) executions: BTreeMap<String, u64>,
    pub(crate) execute_calls: u64,
    pub(crate) execute_failures: u64,
    pub(crate) loads: u64,
    pub(crate) load_failures: u64,
    pub(crate) total_bytes_allocated: u64,
    pub(crate) tensors_allocated: u64,
    pub(crate) errors: u64,
    pub(crate) invalid_handle_uses: u64,
    pub(crate) last_error: Option<String>,
    pub(crate) live_at_last_close: Option<Live>,
}

/// Everything.
pub(crate) struct State {
    pub(crate) phase: Phase,
    pub(crate) config: Config,
    /// Executions that passed validation since `nrt_init` (for `NRT_SIM_FAIL_EXECUTE`).
    pub(crate) executes_since_init: u64,
    /// Loads of valid modules since `nrt_init` (for `NRT_SIM_FAIL_LOAD`).
    pub(crate) loads_since_init: u64,
    pub(crate) tensors: Slab<TensorEntry>,
    pub(crate) sets: Slab<TensorSet>,
    pub(crate) models: Slab<ModelEntry>,
    /// Tensor-info arrays handed out, by address (they are looked up, never dereferenced).
    pub(crate) infos: HashMap<usize, InfoArray>,
    pub(crate) stats: Stats,
    /// The shared scratchpad each core holds (reserved in its HBM): the largest of its loaded
    /// NEFFs' scratch, as libnrt (2.33 and later) shares one scratchpad between a core's NEFFs.
    pub(crate) scratch_held: [u64; MAX_NC_COUNT as usize],
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| {
    Mutex::new(State {
        phase: Phase::Uninitialized,
        config: Config::default(),
        executes_since_init: 0,
        loads_since_init: 0,
        tensors: Slab::new(Kind::Tensor),
        sets: Slab::new(Kind::TensorSet),
        models: Slab::new(Kind::Model),
        infos: HashMap::new(),
        stats: Stats::default(),
        scratch_held: [0; MAX_NC_COUNT as usize],
    })
});

/// Locks the state. Poisoning is ignored: every mutation leaves the state consistent
/// between statements that can panic, and the FFI layer must keep answering after a caught
/// panic.
pub(crate) fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Locks one storage, ignoring poisoning (bytes have no invariant to break).
pub(crate) fn lock_bytes(s: &Storage) -> MutexGuard<'_, Vec<u8>> {
    s.bytes.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    /// Reserves what a NEFF needs on `core` beyond what the core already holds: its private
    /// part, and the growth of the shared scratchpad when its scratch is the largest. Nothing
    /// is reserved when it does not fit (`Err` with the bytes missing and in use).
    pub(crate) fn charge_neff(
        &mut self,
        core: u32,
        private: u64,
        scratch: u64,
    ) -> Result<NeffCharge, (u64, u64)> {
        let capacity = self.config.hbm_bytes;
        let held = self.scratch_held[core as usize];
        let growth = scratch.saturating_sub(held);
        let need = private + growth;
        reserve_hbm(core, need, capacity).map_err(|used| (need, used))?;
        self.scratch_held[core as usize] = held.max(scratch);
        Ok(NeffCharge {
            core,
            private,
            scratch,
        })
    }

    /// Shrinks each core's shared scratchpad to the largest of the NEFFs still loaded on it
    /// (after a model is unloaded, or all are at `nrt_close`).
    pub(crate) fn settle_scratch(&mut self) {
        let mut wanted = [0u64; MAX_NC_COUNT as usize];
        for (_, m) in self.models.iter() {
            let c = m.charge.core as usize;
            wanted[c] = wanted[c].max(m.charge.scratch);
        }
        for (core, (held, want)) in self.scratch_held.iter_mut().zip(wanted).enumerate() {
            if *held > want {
                release_hbm(core as u32, *held - want);
                *held = want;
            }
        }
    }

    /// `NRT_UNINITIALIZED` before `nrt_init`, `NRT_CLOSED` after `nrt_close`.
    pub(crate) fn require_running(&self, call: &str) -> Res<()> {
        match self.phase {
            Phase::Running => Ok(()),
            Phase::Uninitialized => Err(Fail::new(
                sys::NRT_UNINITIALIZED,
                format!("{call} before nrt_init"),
            )),
            Phase::Closed => Err(Fail::new(
                sys::NRT_CLOSED,
                format!("{call} after nrt_close"),
            )),
        }
    }

    /// The live tensor behind `h`.
    pub(crate) fn tensor(&self, what: &str, h: Handle) -> Res<&TensorEntry> {
        self.tensors
            .get(h)
            .map_err(|why| Fail::handle(what, Kind::Tensor, why))
    }

    /// The live set behind `h`.
    pub(crate) fn set(&self, what: &str, h: Handle) -> Res<&TensorSet> {
        self.sets
            .get(h)
            .map_err(|why| Fail::handle(what, Kind::TensorSet, why))
    }

    /// The live model behind `h`.
    pub(crate) fn model(&self, what: &str, h: Handle) -> Res<&ModelEntry> {
        self.models
            .get(h)
            .map_err(|why| Fail::handle(what, Kind::Model, why))
    }

    /// Live objects and the bytes of live storage (each storage once, however many tensors
    /// view it).
    pub(crate) fn live(&self) -> Live {
        let mut seen = std::collections::HashSet::new();
        let bytes = self
            .tensors
            .iter()
            .filter(|(_, t)| seen.insert(Arc::as_ptr(&t.storage)))
            .map(|(_, t)| lock_bytes(&t.storage).len() as u64)
            .sum();
        Live {
            tensors: self.tensors.len() as u64,
            tensor_sets: self.sets.len() as u64,
            models: self.models.len() as u64,
            tensor_info_arrays: self.infos.len() as u64,
            bytes,
        }
    }

    /// The counters, as [`Counters`].
    pub(crate) fn counters(&self) -> Counters {
        let s = &self.stats;
        Counters {
            initialized: self.phase == Phase::Running,
            live: self.live(),
            total_bytes_allocated: s.total_bytes_allocated,
            tensors_allocated: s.tensors_allocated,
            tensor_bytes_written: s.bytes_written.clone(),
            tensor_bytes_read: s.bytes_read.clone(),
            executions: s.executions.clone(),
            models: self
                .models
                .iter()
                .map(|(h, m)| ModelCounters {
                    handle: h.0,
                    name: m.name.clone(),
                    executions: m.executions,
                    core: m.charge.core,
                    private_bytes: m.charge.private,
                    scratch_bytes: m.charge.scratch,
                })
                .collect(),
            execute_calls: s.execute_calls,
            execute_failures: s.execute_failures,
            loads: s.loads,
            load_failures: s.load_failures,
            errors: s.errors,
            invalid_handle_uses: s.invalid_handle_uses,
            last_error: s.last_error.clone(),
            live_at_last_close: s.live_at_last_close.clone(),
            hbm: (0..nc_count())
                .map(|core| CoreMemory {
                    core,
                    used: hbm_used(core),
                    peak: HBM_PEAK[core as usize].load(Ordering::SeqCst),
                    capacity: self.config.hbm_bytes,
                    scratch: self.scratch_held[core as usize],
                })
                .collect(),
        }
    }

    /// Clears the cumulative counters (not the live counts, which describe objects).
    pub(crate) fn reset_counters(&mut self) {
        self.stats = Stats::default();
        for (used, peak) in HBM_USED.iter().zip(&HBM_PEAK) {
            peak.store(used.load(Ordering::SeqCst), Ordering::SeqCst);
        }
        for m in self.models.values_mut() {
            m.executions = 0;
        }
    }

    /// Records a failed call.
    pub(crate) fn record(&mut self, call: &str, fail: &Fail) {
        self.stats.errors += 1;
        if fail.status == sys::NRT_INVALID_HANDLE {
            self.stats.invalid_handle_uses += 1;
        }
        self.stats.last_error = Some(format!("{call}: {fail}"));
    }
}

impl Counters {
    /// The counters of the nrt-sim copy linked into the caller (not of a `libnrt_sim.so`
    /// the caller opened with `dlopen`; use [`crate::SimLibrary`] for that).
    ///
    /// Defined here, not beside [`Counters`], so that the counter types import nothing of
    /// the crate and only this module reads the live state.
    pub fn of_this_copy() -> Counters {
        state().counters()
    }
}
