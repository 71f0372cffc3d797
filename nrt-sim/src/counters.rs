//! What the simulator counts, and how to read it from a loaded `libnrt_sim.so`.
//!
//! The counters cross the C boundary as JSON (`nrt_sim_counters_json`) rather than as a
//! `#[repr(C)]` struct: they include maps keyed by tensor and model names, which a fixed C
//! struct cannot carry without a second, pointer-chasing API. The JSON is this module's
//! [`Counters`] serialized, so a Rust reader gets the same type back ([`SimLibrary`]).
//!
//! A test that loads `libnrt_sim.so` with `dlopen` (as `neuron_sys::Library` does) must read
//! the counters through that same library: the statics in the `.so` are not the statics of
//! this crate linked into the test binary as an rlib. [`SimLibrary::open`] opens the same
//! file (the loader maps it once, so both handles see one state); [`Counters::of_this_copy`]
//! reads the copy linked into the caller.

use std::collections::BTreeMap;
use std::ffi::{c_char, OsStr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Objects alive right now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Live {
    /// Tensors (allocations and slices) not yet freed.
    pub tensors: u64,
    /// Tensor sets not yet destroyed.
    pub tensor_sets: u64,
    /// Models not yet unloaded.
    pub models: u64,
    /// `nrt_get_model_tensor_info` arrays not yet freed.
    pub tensor_info_arrays: u64,
    /// Bytes of storage the live tensors hold (an allocation counts once however many slices
    /// view it, and stays counted while a slice outlives its parent).
    pub bytes: u64,
}

/// One live model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCounters {
    /// The handle (`nrt_model_t*` as an integer).
    pub handle: u64,
    /// The model's name: the HLO module's name (the graph's, e.g. `decode_b1_c64`).
    pub name: String,
    /// Completed executions of this handle since load (or the last reset).
    pub executions: u64,
}

/// A snapshot of the simulator's counters.
///
/// Cumulative fields count since the library was loaded or [`SimLibrary::reset`] (the C
/// function `nrt_sim_reset_counters`) was last called; `live` and `models` describe objects
/// and are never reset. The fault counters behind `NRT_SIM_FAIL_*` restart at each
/// `nrt_init` and are not affected by a reset either.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Between `nrt_init` and `nrt_close`.
    pub initialized: bool,
    /// Objects alive now.
    pub live: Live,
    /// Bytes requested by `nrt_tensor_allocate` (slices allocate nothing).
    pub total_bytes_allocated: u64,
    /// Successful `nrt_tensor_allocate` calls.
    pub tensors_allocated: u64,
    /// Bytes written with `nrt_tensor_write`, by the name the written tensor was allocated
    /// (or sliced) with; execution outputs are not counted here.
    pub tensor_bytes_written: BTreeMap<String, u64>,
    /// Bytes read with `nrt_tensor_read`, by tensor name.
    pub tensor_bytes_read: BTreeMap<String, u64>,
    /// Completed executions by model name (kept after the model is unloaded).
    pub executions: BTreeMap<String, u64>,
    /// Live models and their execution counts.
    pub models: Vec<ModelCounters>,
    /// Every `nrt_execute` call, failed ones included.
    pub execute_calls: u64,
    /// `nrt_execute` calls that did not return `NRT_SUCCESS` (injected faults included).
    pub execute_failures: u64,
    /// Successful loads.
    pub loads: u64,
    /// Failed loads (corrupt modules, injected faults, bad arguments).
    pub load_failures: u64,
    /// Calls that failed, of any function (a failing `void` function such as a double
    /// `nrt_tensor_free` counts too).
    pub errors: u64,
    /// Of those, calls given a null, freed or foreign handle (`NRT_INVALID_HANDLE`).
    pub invalid_handle_uses: u64,
    /// The last failure: `"<function>: <STATUS> (<code>): <why>"`.
    pub last_error: Option<String>,
    /// What was still alive (and then released) at the last `nrt_close`.
    pub live_at_last_close: Option<Live>,
}

impl Counters {
    /// Bytes written through `nrt_tensor_write` to tensors named `name`.
    pub fn bytes_written(&self, name: &str) -> u64 {
        self.tensor_bytes_written.get(name).copied().unwrap_or(0)
    }

    /// Bytes read through `nrt_tensor_read` from tensors named `name`.
    pub fn bytes_read(&self, name: &str) -> u64 {
        self.tensor_bytes_read.get(name).copied().unwrap_or(0)
    }

    /// Completed executions of models named `name`.
    pub fn executions_of(&self, name: &str) -> u64 {
        self.executions.get(name).copied().unwrap_or(0)
    }

    /// The counters of the nrt-sim copy linked into the caller (not of a `libnrt_sim.so`
    /// the caller opened with `dlopen`; use [`SimLibrary`] for that).
    pub fn of_this_copy() -> Counters {
        crate::state::state().counters()
    }
}

/// Errors of the Rust-side reader.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The library could not be opened, or lacks the nrt-sim hooks (it is not nrt-sim).
    #[error("{path}: {source}")]
    Load {
        /// What was opened.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The counters' JSON did not parse (a reader and library from different versions).
    #[error("nrt_sim_counters_json: {0}")]
    Json(#[from] serde_json::Error),
}

/// `nrt_sim_counters_json`'s type.
type CountersJsonFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;
/// `nrt_sim_reset_counters`'s type.
type ResetFn = unsafe extern "C" fn();

/// A `libnrt_sim.so` opened for its test hooks: the counters and their reset.
///
/// Opening it next to a `neuron_sys::Library` of the same path shares one mapping, hence one
/// state. The hooks stay valid while this value lives.
pub struct SimLibrary {
    counters_json: CountersJsonFn,
    reset: ResetFn,
    path: PathBuf,
    // Declared last: dropped after the function pointers copied out of it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for SimLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimLibrary")
            .field("path", &self.path)
            .finish()
    }
}

impl SimLibrary {
    /// Opens the nrt-sim library at `path` and resolves its hooks.
    pub fn open(path: impl AsRef<OsStr>) -> Result<SimLibrary, Error> {
        let path = PathBuf::from(path.as_ref());
        let load = |source| Error::Load {
            path: path.clone(),
            source,
        };
        // SAFETY: loading runs the library's initialisers; nrt-sim has none beyond Rust's.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(load)?;
        // SAFETY: these are the types of the exported hooks (crate::ffi); the pointers are
        // used only while `_lib` keeps the library mapped.
        let (counters_json, reset) = unsafe {
            (
                *lib.get::<CountersJsonFn>(b"nrt_sim_counters_json\0")
                    .map_err(load)?,
                *lib.get::<ResetFn>(b"nrt_sim_reset_counters\0")
                    .map_err(load)?,
            )
        };
        Ok(SimLibrary {
            counters_json,
            reset,
            path,
            _lib: lib,
        })
    }

    /// The counters now.
    pub fn counters(&self) -> Result<Counters, Error> {
        let mut buf = vec![0u8; 4096];
        loop {
            // SAFETY: `buf` is writable for `buf.len()` bytes; the hook writes at most that
            // many (NUL included) and returns the full length without the NUL.
            let needed = unsafe { (self.counters_json)(buf.as_mut_ptr().cast(), buf.len()) };
            if needed < buf.len() {
                buf.truncate(needed);
                return Ok(serde_json::from_slice(&buf)?);
            }
            buf.resize(needed + 1, 0);
        }
    }

    /// Clears the cumulative counters (`nrt_sim_reset_counters`).
    pub fn reset(&self) {
        // SAFETY: takes no arguments; safe to call at any time.
        unsafe { (self.reset)() }
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Where cargo puts `libnrt_sim.so` for a test or bench executable, which lives in
/// `target/<profile>/deps/`: `cargo test` writes the library into that same `deps/`
/// directory, and `cargo build` also copies it up to `target/<profile>/`. The `deps/` copy
/// is tried first (it is the one built with the tests), then the parent directory (for
/// binaries and examples, which live in `target/<profile>/` and `.../examples/`).
///
/// `cargo test -p nrt-sim` (and `cargo test --workspace`) builds the library before this
/// package's integration tests, because it is the package's `cdylib`. Other packages' tests
/// must make sure it is built (`cargo build -p nrt-sim`) or locate it themselves.
pub fn library_next_to_current_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let file = format!(
        "{}nrt_sim{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(&file))
        .find(|p| p.is_file())
}
