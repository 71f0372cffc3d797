//! Reading the counters of a `libnrt_sim.so` a test loaded with `dlopen`, and finding the
//! file cargo built.
//!
//! A test that loads `libnrt_sim.so` with `dlopen` (as `neuron_sys::Library` does) must read
//! the counters through that same library: the statics in the `.so` are not the statics of
//! this crate linked into the test binary as an rlib. [`SimLibrary::open`] opens the same
//! file (the loader maps it once, so both handles see one state);
//! [`Counters::of_this_copy`] reads the copy linked into the caller.

use std::ffi::{c_char, OsStr};
use std::path::{Path, PathBuf};

use crate::counters::Counters;

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

/// The `libnrt_sim.so` cargo built for the running test, bench or example: the first of
/// deepinfer's [`sim_library_beside_exe`](deepinfer::runner::sim_library_beside_exe) that
/// exists (the rule `--backend sim` also follows, minus `NEURON_RT_LIB`).
///
/// `cargo test -p nrt-sim` (and `cargo test --workspace`) builds the library before this
/// package's integration tests, because it is the package's `cdylib`. Other packages' tests
/// must make sure it is built (`cargo build -p nrt-sim`) or locate it themselves.
pub fn library_next_to_current_exe() -> Option<PathBuf> {
    deepinfer::runner::sim_library_beside_exe()
        .into_iter()
        .find(|p| p.is_file())
}
