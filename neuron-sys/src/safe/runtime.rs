//! [`Runtime`]: one `nrt_init` … `nrt_close` span.

use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::error::{Error, Result};
use crate::library::Library;
use crate::sys;

/// The live runtime, if any. libnrt is process-global state: `nrt_init` once, `nrt_close`
/// once, so at most one [`RuntimeInner`] exists at a time. The same lock serialises
/// `nrt_init` with a concurrent `nrt_close` from the last handle's drop.
static LIVE: Mutex<Weak<RuntimeInner>> = Mutex::new(Weak::new());

/// At most this many deferred errors are kept; later ones are counted, not stored.
const MAX_DEFERRED: usize = 64;

/// Locks a mutex, ignoring poisoning: the data behind these locks stays consistent
/// whatever panicked, and `Drop` impls must never panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) struct RuntimeInner {
    pub(crate) lib: Arc<Library>,
    start_nc: u32,
    nc_count: u32,
    deferred: Mutex<Deferred>,
}

#[derive(Default)]
struct Deferred {
    errors: Vec<Error>,
    dropped: usize,
}

impl Drop for RuntimeInner {
    fn drop(&mut self) {
        // Every handle holds an Arc<RuntimeInner>, so every model is unloaded and every
        // tensor and tensor set freed by now.
        let _live = lock(&LIVE);
        // SAFETY: nrt_init succeeded for this inner (it is only built after that), and this
        // is the one nrt_close for it. nrt_close takes no arguments and returns nothing.
        unsafe { (self.lib.api().nrt_close)() };
    }
}

/// An initialised libnrt: `nrt_init` on creation, `nrt_close` when the last clone — and the
/// last model, tensor and tensor set made from it — is dropped.
///
/// Cheap to clone (an `Arc`). libnrt allows one initialisation per process, so a second
/// [`Runtime::new`] while one is alive fails with [`Error::AlreadyInitialized`];
/// [`Runtime::shared`] returns the live one instead.
///
/// `nrt_init` takes no NeuronCore range: the cores a process may use are fixed by
/// `NEURON_RT_VISIBLE_CORES` (or `NEURON_RT_NUM_CORES`), which libnrt reads *during*
/// `nrt_init`; set them before the process starts threads (`std::env::set_var` is not
/// thread-safe). The `start_nc`/`nc_count` given here say which of the visible cores —
/// indices are relative to the visible set — this runtime's models and device tensors may
/// use; they are checked against `nrt_get_visible_(v)nc_count` when the runtime has it.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<RuntimeInner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("library", &self.inner.lib.name())
            .field("start_nc", &self.inner.start_nc)
            .field("nc_count", &self.inner.nc_count)
            .finish()
    }
}

/// A NeuronCore's device memory, as [`Runtime::memory_stats`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes allocated on the core now (tensors, loaded models, scratchpad).
    pub used: u64,
    /// Bytes the core can hold.
    pub limit: u64,
}

impl Runtime {
    /// Calls `nrt_init(NRT_FRAMEWORK_TYPE_NO_FW, "", "")` and owns the runtime over the
    /// NeuronCores `start_nc .. start_nc + nc_count` (relative to the visible set).
    pub fn new(lib: Arc<Library>, start_nc: u32, nc_count: u32) -> Result<Runtime> {
        let live = lock(&LIVE);
        if let Some(existing) = live.upgrade() {
            drop(live);
            // `existing` may be the last strong reference now; dropping it runs nrt_close,
            // which takes LIVE, so it is dropped only after the lock is released.
            drop(existing);
            return Err(Error::AlreadyInitialized);
        }
        Self::init_locked(live, lib, start_nc, nc_count)
    }

    /// The live runtime if there is one over the same library and cores, else a new one.
    /// A live runtime over a different library or core range is [`Error::AlreadyInitialized`].
    pub fn shared(lib: Arc<Library>, start_nc: u32, nc_count: u32) -> Result<Runtime> {
        let live = lock(&LIVE);
        if let Some(existing) = live.upgrade() {
            drop(live);
            let same = Arc::ptr_eq(&existing.lib, &lib) || existing.lib.path() == lib.path();
            if same && existing.start_nc == start_nc && existing.nc_count == nc_count {
                return Ok(Runtime { inner: existing });
            }
            drop(existing);
            return Err(Error::AlreadyInitialized);
        }
        Self::init_locked(live, lib, start_nc, nc_count)
    }

    fn init_locked(
        mut live: MutexGuard<'_, Weak<RuntimeInner>>,
        lib: Arc<Library>,
        start_nc: u32,
        nc_count: u32,
    ) -> Result<Runtime> {
        if nc_count == 0 {
            return Err(Error::invalid("nrt_init", "nc_count must be at least 1"));
        }
        let Some(end) = start_nc.checked_add(nc_count) else {
            return Err(Error::invalid("nrt_init", "start_nc + nc_count overflows"));
        };
        let empty: &CStr = c"";
        // SAFETY: nrt_init takes the framework type by value and two NUL-terminated strings
        // that it only reads during the call; LIVE is held, so no other nrt_init or
        // nrt_close runs concurrently through this crate.
        let status = unsafe {
            (lib.api().nrt_init)(
                sys::NRT_FRAMEWORK_TYPE_NO_FW,
                empty.as_ptr(),
                empty.as_ptr(),
            )
        };
        lib.check("nrt_init", status)?;
        let inner = Arc::new(RuntimeInner {
            lib,
            start_nc,
            nc_count,
            deferred: Mutex::new(Deferred::default()),
        });
        *live = Arc::downgrade(&inner);
        drop(live);
        let runtime = Runtime { inner };
        // Checked after nrt_init, which is what applies NEURON_RT_VISIBLE_CORES. On error
        // `runtime` is dropped here, which runs nrt_close.
        if let Ok(Some(visible)) = runtime.inner.lib.visible_nc_count() {
            if end > visible {
                return Err(Error::invalid(
                    "nrt_init",
                    format!(
                        "NeuronCores {start_nc}..{end} requested, but only {visible} are visible \
                         (see NEURON_RT_VISIBLE_CORES)"
                    ),
                ));
            }
        }
        Ok(runtime)
    }

    /// The library this runtime runs on.
    pub fn library(&self) -> &Arc<Library> {
        &self.inner.lib
    }

    /// The first NeuronCore (relative to the visible set) this runtime uses.
    pub fn start_nc(&self) -> u32 {
        self.inner.start_nc
    }

    /// How many NeuronCores this runtime uses.
    pub fn nc_count(&self) -> u32 {
        self.inner.nc_count
    }

    /// NeuronCore `nc`'s device memory as the runtime counts it (`nrt_get_vnc_memory_stats`):
    /// what is allocated on it and what it can hold. `Ok(None)` when the runtime predates the
    /// call (libnrt before 2.27.23).
    pub fn memory_stats(&self, nc: u32) -> Result<Option<MemoryStats>> {
        const CALL: &str = "nrt_get_vnc_memory_stats";
        self.check_nc(CALL, nc)?;
        let lib = &self.inner.lib;
        let Some(f) = lib.api().nrt_get_vnc_memory_stats else {
            return Ok(None);
        };
        let mut raw = sys::nrt_vnc_memory_stats_t {
            bytes_used: 0,
            bytes_limit: 0,
        };
        let mut filled = 0usize;
        let size = std::mem::size_of::<sys::nrt_vnc_memory_stats_t>();
        // SAFETY: `raw` is a valid nrt_vnc_memory_stats_t of `size` bytes and `filled` a valid
        // size_t, both live for the call, which only writes them; the runtime is initialised
        // (self holds it).
        let status = unsafe { f(nc, &mut raw, size, &mut filled) };
        lib.check(CALL, status)?;
        if filled < size {
            return Err(Error::invalid(
                CALL,
                format!("the runtime filled {filled} of the {size} bytes of its memory stats"),
            ));
        }
        Ok(Some(MemoryStats {
            used: raw.bytes_used as u64,
            limit: raw.bytes_limit as u64,
        }))
    }

    /// Whether `other` is this same runtime.
    pub fn same_as(&self, other: &Runtime) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Errors that happened where they could not be returned (a `Drop` whose libnrt call
    /// failed, such as `nrt_unload`), oldest first; taking them clears the record. At most
    /// 64 are kept; the count of any beyond that is reported as a final
    /// [`Error::InvalidArgument`] entry named `deferred`.
    pub fn take_deferred_errors(&self) -> Vec<Error> {
        let mut d = lock(&self.inner.deferred);
        let mut errors = std::mem::take(&mut d.errors);
        if d.dropped > 0 {
            errors.push(Error::invalid(
                "deferred",
                format!("{} more deferred errors were not kept", d.dropped),
            ));
            d.dropped = 0;
        }
        errors
    }

    /// Checks that `nc` (relative to the visible set) is one of this runtime's cores.
    pub(crate) fn check_nc(&self, call: &'static str, nc: u32) -> Result<()> {
        let (start, count) = (self.inner.start_nc, self.inner.nc_count);
        if nc < start || nc - start >= count {
            return Err(Error::invalid(
                call,
                format!(
                    "NeuronCore {nc} is outside this runtime's cores {start}..{}",
                    start as u64 + count as u64
                ),
            ));
        }
        Ok(())
    }
}

impl RuntimeInner {
    /// Records an error that a `Drop` could not return. Never panics.
    pub(crate) fn record(&self, error: Error) {
        let mut d = lock(&self.deferred);
        if d.errors.len() < MAX_DEFERRED {
            d.errors.push(error);
        } else {
            d.dropped += 1;
        }
    }
}
