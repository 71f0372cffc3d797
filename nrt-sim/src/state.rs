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

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use deepinfer::graph::{DType, Graph};
use neuron_sys::sys::{self, NRT_STATUS};

use crate::counters::{Counters, Live, ModelCounters};
use crate::handle::{Handle, Kind, Lookup, Slab};

/// A failed call: the status to return and a message for `last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fail {
    pub(crate) status: NRT_STATUS,
    pub(crate) msg: String,
}

impl Fail {
    pub(crate) fn new(status: NRT_STATUS, msg: impl Into<String>) -> Fail {
        Fail {
            status,
            msg: msg.into(),
        }
    }

    /// A handle that did not resolve: `NRT_INVALID_HANDLE`, naming what was wrong.
    pub(crate) fn handle(what: &str, kind: Kind, why: Lookup) -> Fail {
        let msg = match why {
            Lookup::Null => format!("{what} is a null {}", kind.c_name()),
            Lookup::Stale => format!(
                "{what} is a freed {} (use after free, double free, or released by nrt_close)",
                kind.c_name()
            ),
            Lookup::Foreign => format!("{what} is not a live {}", kind.c_name()),
        };
        Fail::new(sys::NRT_INVALID_HANDLE, msg)
    }
}

impl fmt::Display for Fail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            sys::status_name(self.status),
            self.status,
            self.msg
        )
    }
}

/// A call's result.
pub(crate) type Res<T> = Result<T, Fail>;

// === Configuration (read at nrt_init) ===

/// `NRT_SIM_FAIL_EXECUTE`.
pub const ENV_FAIL_EXECUTE: &str = "NRT_SIM_FAIL_EXECUTE";
/// `NRT_SIM_FAIL_LOAD`.
pub const ENV_FAIL_LOAD: &str = "NRT_SIM_FAIL_LOAD";
/// `NRT_SIM_SLOW_EXECUTE_MS`.
pub const ENV_SLOW_EXECUTE_MS: &str = "NRT_SIM_SLOW_EXECUTE_MS";
/// `NRT_SIM_FREE_EXECUTE`.
pub const ENV_FREE_EXECUTE: &str = "NRT_SIM_FREE_EXECUTE";

/// The fault and timing knobs, from the environment at `nrt_init`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Config {
    /// The execution (1-based, counting executions whose bindings validated) that fails.
    pub(crate) fail_execute: Option<u64>,
    /// The `nrt_load` (1-based, counting loads of valid modules) that fails.
    pub(crate) fail_load: Option<u64>,
    /// Sleep this long in every execution, after validation.
    pub(crate) slow_execute: Option<Duration>,
    /// Validate bindings, then return success without computing.
    pub(crate) free_execute: bool,
}

impl Config {
    /// Reads the `NRT_SIM_*` variables through `get`. A malformed value is an error (a typo
    /// must not silently turn a fault test into a passing run).
    pub(crate) fn from_env(get: impl Fn(&str) -> Option<String>) -> Res<Config> {
        let bad = |var: &str, val: &str, want: &str| {
            Fail::new(
                sys::NRT_INVALID,
                format!("nrt_init: {var}={val:?} is not {want}"),
            )
        };
        let nth = |var: &str| -> Res<Option<u64>> {
            match get(var).as_deref().map(str::trim) {
                None | Some("") | Some("0") => Ok(None),
                Some(v) => v
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| bad(var, v, "a positive integer (1-based count)")),
            }
        };
        let slow = match get(ENV_SLOW_EXECUTE_MS).as_deref().map(str::trim) {
            None | Some("") | Some("0") => None,
            Some(v) => {
                Some(Duration::from_millis(v.parse::<u64>().map_err(|_| {
                    bad(ENV_SLOW_EXECUTE_MS, v, "a number of milliseconds")
                })?))
            }
        };
        let free = match get(ENV_FREE_EXECUTE).as_deref().map(str::trim) {
            None | Some("") | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(v) => return Err(bad(ENV_FREE_EXECUTE, v, "0, 1, true or false")),
        };
        Ok(Config {
            fail_execute: nth(ENV_FAIL_EXECUTE)?,
            fail_load: nth(ENV_FAIL_LOAD)?,
            slow_execute: slow,
            free_execute: free,
        })
    }
}

// === Objects ===

/// The bytes of one allocation, shared by the tensor that allocated them and its slices.
/// libnrt's storage is refcounted the same way: a slice keeps it alive after its parent is
/// freed.
pub(crate) struct Storage {
    pub(crate) bytes: Mutex<Vec<u8>>,
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

/// One input or output of a model, as `nrt_get_model_tensor_info` reports it.
#[derive(Debug, Clone)]
pub(crate) struct IoDesc {
    pub(crate) name: String,
    pub(crate) usage: sys::nrt_tensor_usage_t,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u32>,
    pub(crate) size: usize,
}

/// A loaded model.
pub(crate) struct ModelEntry {
    pub(crate) graph: Graph,
    pub(crate) name: String,
    pub(crate) inputs: Vec<IoDesc>,
    pub(crate) outputs: Vec<IoDesc>,
    pub(crate) executions: u64,
}

/// A tensor-info array handed to the caller (until `nrt_free_model_tensor_info`).
pub(crate) struct InfoAlloc {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) layout: std::alloc::Layout,
    /// The arrays the entries' `shape` pointers point into.
    pub(crate) _shapes: Vec<Box<[u32]>>,
}

// SAFETY: the allocation is plain memory owned by this record (no thread affinity); it is
// only deallocated through the record, under the state lock.
unsafe impl Send for InfoAlloc {}

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
    pub(crate) sets: Slab<HashMap<String, Handle>>,
    pub(crate) models: Slab<ModelEntry>,
    pub(crate) infos: HashMap<usize, InfoAlloc>,
    pub(crate) stats: Stats,
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
    pub(crate) fn set(&self, what: &str, h: Handle) -> Res<&HashMap<String, Handle>> {
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
        }
    }

    /// Clears the cumulative counters (not the live counts, which describe objects).
    pub(crate) fn reset_counters(&mut self) {
        self.stats = Stats::default();
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
