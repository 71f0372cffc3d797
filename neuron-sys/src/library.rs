//! Loading libnrt at run time: the function table.
//!
//! cudarc's and ash's pattern: one struct of function pointers, resolved with `dlsym` when
//! the library is opened. Functions every supported libnrt exports are *required*: a library
//! missing one is rejected at load, naming the symbol. Functions that some runtimes lack
//! (older releases, or a simulator) are *optional*: `Option<fn>` fields, and the operations
//! that need them return [`Error::Unsupported`].
//!
//! A library is never unloaded: see [`Library`]'s field notes.
//!
//! There is no process-wide cached table (`OnceLock`): opening is cheap (the loader
//! refcounts the library), and a cache would also cache a failure that setting
//! `NEURON_RT_LIB` could fix. Whoever needs the library holds an `Arc<Library>`; every
//! handle in [`crate::safe`] keeps one, so the code stays mapped while a handle exists.

use std::borrow::Cow;
use std::ffi::{c_char, CStr, OsStr, OsString};
use std::fmt;
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{Error, LoadAttempt, Result};
use crate::sys::{self, NRT_STATUS};

/// The environment variable naming the libnrt to load (a path, or a soname).
pub const NEURON_RT_LIB: &str = "NEURON_RT_LIB";
/// The soname the dynamic loader is asked for after `NEURON_RT_LIB`.
pub const LIBNRT_SONAME: &str = "libnrt.so.1";
/// Where `aws-neuronx-runtime-lib` installs libnrt; not always on the loader's path.
pub const LIBNRT_DEFAULT_PATH: &str = "/opt/aws/neuron/lib/libnrt.so.1";

/// The function-pointer type inside one of the bindings' `Option<unsafe extern "C" fn>`
/// typedefs (bindgen wraps every C function-pointer typedef in `Option`).
pub trait OptionFn {
    /// The non-null function-pointer type.
    type Fn: Copy;
}

impl<F: Copy> OptionFn for Option<F> {
    type Fn = F;
}

/// Resolves one symbol; `None` when it is absent (or null).
///
/// # Safety
///
/// `F` must be the function-pointer type of the C function named `name` (a NUL-terminated
/// byte string) in `lib`.
unsafe fn symbol<F: Copy>(lib: &libloading::Library, name: &[u8]) -> Option<F> {
    // SAFETY: the caller guarantees `F` is the symbol's type. Asking for `Option<F>` makes a
    // null address `None` instead of an invalid function pointer.
    unsafe { lib.get::<Option<F>>(name).ok().and_then(|sym| *sym) }
}

macro_rules! api_table {
    (
        required { $($req:ident: $req_ty:ident,)* }
        optional { $($opt:ident: $opt_ty:ident,)* }
    ) => {
        /// libnrt's function table: the raw C entry points, resolved at load.
        ///
        /// Calling any of them is `unsafe`: the arguments must satisfy libnrt's contract
        /// (see `include/nrt_deepinfer.h`). The [`crate::safe`] types do that for you.
        #[derive(Clone, Copy, Debug)]
        pub struct Api {
            $(
                #[doc = concat!("`", stringify!($req), "` (required).")]
                pub $req: <sys::$req_ty as OptionFn>::Fn,
            )*
            $(
                #[doc = concat!("`", stringify!($opt), "`, when the library exports it.")]
                pub $opt: sys::$opt_ty,
            )*
        }

        /// The symbols [`Library`] requires, in the order it resolves them.
        pub const REQUIRED_SYMBOLS: &[&str] = &[$(stringify!($req)),*];
        /// The symbols [`Library`] resolves when present.
        pub const OPTIONAL_SYMBOLS: &[&str] = &[$(stringify!($opt)),*];

        impl Api {
            /// Whether `symbol` was resolved (false for names outside the table).
            pub fn has(&self, symbol: &str) -> bool {
                match symbol {
                    $(stringify!($opt) => self.$opt.is_some(),)*
                    $(stringify!($req))|* => true,
                    _ => false,
                }
            }

            /// # Safety
            ///
            /// `lib` must be a libnrt (or a library exporting libnrt's functions with
            /// libnrt's signatures) under the names used here.
            unsafe fn resolve(lib: &libloading::Library, library: &str) -> Result<Api> {
                Ok(Api {
                    $($req: {
                        // SAFETY: the typedef is derived from libnrt's prototype of this
                        // very function (include/nrt_deepinfer.h); the caller vouches that
                        // `lib` is a libnrt.
                        match unsafe {
                            symbol::<<sys::$req_ty as OptionFn>::Fn>(
                                lib,
                                concat!(stringify!($req), "\0").as_bytes(),
                            )
                        } {
                            Some(f) => f,
                            None => {
                                return Err(Error::MissingSymbol {
                                    library: library.to_string(),
                                    symbol: stringify!($req),
                                })
                            }
                        }
                    },)*
                    $($opt: {
                        // SAFETY: as above.
                        unsafe {
                            symbol::<<sys::$opt_ty as OptionFn>::Fn>(
                                lib,
                                concat!(stringify!($opt), "\0").as_bytes(),
                            )
                        }
                    },)*
                })
            }
        }
    };
}

api_table! {
    required {
        nrt_init: nrt_init_fn,
        nrt_close: nrt_close_fn,
        nrt_load: nrt_load_fn,
        nrt_unload: nrt_unload_fn,
        nrt_tensor_allocate: nrt_tensor_allocate_fn,
        nrt_tensor_free: nrt_tensor_free_fn,
        nrt_tensor_read: nrt_tensor_read_fn,
        nrt_tensor_write: nrt_tensor_write_fn,
        nrt_tensor_get_size: nrt_tensor_get_size_fn,
        nrt_allocate_tensor_set: nrt_allocate_tensor_set_fn,
        nrt_destroy_tensor_set: nrt_destroy_tensor_set_fn,
        nrt_add_tensor_to_tensor_set: nrt_add_tensor_to_tensor_set_fn,
        nrt_get_tensor_from_tensor_set: nrt_get_tensor_from_tensor_set_fn,
        nrt_execute: nrt_execute_fn,
    }
    optional {
        nrt_load_collectives: nrt_load_collectives_fn,
        nrt_get_model_tensor_info: nrt_get_model_tensor_info_fn,
        nrt_free_model_tensor_info: nrt_free_model_tensor_info_fn,
        nrt_tensor_allocate_slice: nrt_tensor_allocate_slice_fn,
        nrt_tensor_memset: nrt_tensor_memset_fn,
        nrt_get_version: nrt_get_version_fn,
        nrt_get_total_nc_count: nrt_get_total_nc_count_fn,
        nrt_get_visible_nc_count: nrt_get_visible_nc_count_fn,
        nrt_get_total_vnc_count: nrt_get_total_vnc_count_fn,
        nrt_get_visible_vnc_count: nrt_get_visible_vnc_count_fn,
        nrt_get_status_as_str: nrt_get_status_as_str_fn,
        nrt_get_vnc_memory_stats: nrt_get_vnc_memory_stats_fn,
    }
}

/// One place to look for libnrt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// What is passed to `dlopen`: a path, or a bare soname the loader searches for.
    pub path: OsString,
    /// Where the candidate came from, for messages (`NEURON_RT_LIB`, ...).
    pub origin: &'static str,
}

impl Candidate {
    /// A candidate with a description of where it came from.
    pub fn new(path: impl Into<OsString>, origin: &'static str) -> Self {
        Candidate {
            path: path.into(),
            origin,
        }
    }

    fn describe(&self) -> String {
        format!("{} ({})", self.path.to_string_lossy(), self.origin)
    }
}

/// The runtime's version, from `nrt_get_version`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Major version.
    pub major: u64,
    /// Minor version.
    pub minor: u64,
    /// Patch version.
    pub patch: u64,
    /// Maintenance version.
    pub maintenance: u64,
    /// Free-text detail.
    pub detail: String,
    /// Git hash of the runtime build.
    pub git_hash: String,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{}.{}.{}",
            self.major, self.minor, self.patch, self.maintenance
        )?;
        if !self.git_hash.is_empty() {
            write!(f, " ({})", self.git_hash)?;
        }
        Ok(())
    }
}

/// An opened libnrt and its function table.
pub struct Library {
    api: Api,
    name: String,
    path: OsString,
    /// Never closed (`dlclose`): libnrt starts threads of its own that may still run code
    /// from the library after `nrt_close`, and unmapping it under them would crash. The
    /// mapping lives until the process exits; opening again only bumps the loader's count.
    _lib: ManuallyDrop<libloading::Library>,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library").field("name", &self.name).finish()
    }
}

impl Library {
    /// The places [`Library::load`] tries, in order: `$NEURON_RT_LIB` (when set and
    /// non-empty), then `libnrt.so.1` through the loader's search path, then
    /// `/opt/aws/neuron/lib/libnrt.so.1`.
    pub fn candidates() -> Vec<Candidate> {
        let mut out = Vec::with_capacity(3);
        if let Some(path) = std::env::var_os(NEURON_RT_LIB).filter(|p| !p.is_empty()) {
            out.push(Candidate::new(path, "from NEURON_RT_LIB"));
        }
        out.push(Candidate::new(LIBNRT_SONAME, "dynamic loader search path"));
        out.push(Candidate::new(
            LIBNRT_DEFAULT_PATH,
            "aws-neuronx-runtime-lib install path",
        ));
        out
    }

    /// Loads libnrt from the first of [`Library::candidates`] that opens.
    pub fn load() -> Result<Arc<Library>> {
        Self::load_from(&Self::candidates())
    }

    /// Loads libnrt from the first candidate that opens.
    ///
    /// A candidate that does not open is skipped; if none opens, the error lists every
    /// candidate with the loader's reason and says how to get libnrt. A candidate that opens
    /// but lacks a required symbol stops the search with [`Error::MissingSymbol`]: that
    /// file was chosen (by the user or the loader), and quietly trying the next one would
    /// hide the problem.
    pub fn load_from(candidates: &[Candidate]) -> Result<Arc<Library>> {
        let mut tried = Vec::with_capacity(candidates.len());
        for candidate in candidates {
            // SAFETY: opening a shared library runs its initialisers. The candidates are
            // libnrt's install locations or a library the user named in NEURON_RT_LIB.
            match unsafe { libloading::Library::new(&candidate.path) } {
                Ok(lib) => return Self::from_opened(lib, candidate),
                Err(e) => tried.push(LoadAttempt {
                    place: candidate.describe(),
                    reason: e.to_string(),
                }),
            }
        }
        Err(Error::LibraryNotFound { tried })
    }

    /// Loads libnrt from exactly this path (or soname).
    pub fn open(path: impl AsRef<OsStr>) -> Result<Arc<Library>> {
        Self::load_from(&[Candidate::new(path.as_ref(), "given path")])
    }

    fn from_opened(lib: libloading::Library, candidate: &Candidate) -> Result<Arc<Library>> {
        let name = candidate.path.to_string_lossy().into_owned();
        // SAFETY: the library is one of libnrt's candidates (see load_from); its symbols
        // are resolved with libnrt's signatures.
        let api = unsafe { Api::resolve(&lib, &name) }?;
        Ok(Arc::new(Library {
            api,
            name,
            path: candidate.path.clone(),
            _lib: ManuallyDrop::new(lib),
        }))
    }

    /// The raw function table.
    pub fn api(&self) -> &Api {
        &self.api
    }

    /// What was passed to `dlopen`, as text.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What was passed to `dlopen`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(&self.path)
    }

    /// Whether the library exports `symbol` (one of [`REQUIRED_SYMBOLS`], always true, or
    /// of [`OPTIONAL_SYMBOLS`]); false for any other name.
    pub fn has_symbol(&self, symbol: &str) -> bool {
        self.api.has(symbol)
    }

    /// [`Error::Unsupported`] for an optional function this library lacks.
    pub(crate) fn unsupported(&self, function: &'static str) -> Error {
        Error::Unsupported {
            function,
            library: self.name.clone(),
        }
    }

    /// `Ok(())` for `NRT_SUCCESS`, else [`Error::Status`] naming `call` and the status.
    ///
    /// The name comes from this crate's table, or for a code it does not know, from the
    /// runtime's `nrt_get_status_as_str` when the runtime has it.
    pub fn check(&self, call: &'static str, status: NRT_STATUS) -> Result<()> {
        if status == sys::NRT_SUCCESS {
            return Ok(());
        }
        let known = sys::status_name(status);
        let name = if known != "NRT_STATUS_UNKNOWN" {
            Cow::Borrowed(known)
        } else {
            self.status_str(status)
                .map(Cow::Owned)
                .unwrap_or(Cow::Borrowed(known))
        };
        Err(Error::Status { call, status, name })
    }

    /// The runtime's own text for a status (`nrt_get_status_as_str`), when it has that
    /// function and returns non-null.
    pub fn status_str(&self, status: NRT_STATUS) -> Option<String> {
        let f = self.api.nrt_get_status_as_str?;
        // SAFETY: takes a status by value; returns NULL or a NUL-terminated string owned by
        // libnrt that stays valid (static table), which is copied at once.
        unsafe {
            let ptr = f(status);
            if ptr.is_null() {
                None
            } else {
                Some(CStr::from_ptr(ptr).to_string_lossy().into_owned())
            }
        }
    }

    /// The runtime's version, when it exports `nrt_get_version` (callable before
    /// `nrt_init`); `Ok(None)` when it does not.
    pub fn version(&self) -> Result<Option<Version>> {
        let Some(f) = self.api.nrt_get_version else {
            return Ok(None);
        };
        let mut raw = std::mem::MaybeUninit::<sys::nrt_version_t>::zeroed();
        // SAFETY: `raw` is a zeroed nrt_version_t (valid for every field: integers and char
        // arrays) of the size passed, which the runtime fills at most.
        let status = unsafe { f(raw.as_mut_ptr(), std::mem::size_of::<sys::nrt_version_t>()) };
        self.check("nrt_get_version", status)?;
        // SAFETY: all-zero bytes are a valid nrt_version_t, and the runtime only wrote
        // integers and bytes into it.
        let raw = unsafe { raw.assume_init() };
        Ok(Some(Version {
            major: raw.rt_major,
            minor: raw.rt_minor,
            patch: raw.rt_patch,
            maintenance: raw.rt_maintenance,
            detail: c_chars_to_string(&raw.rt_detail),
            git_hash: c_chars_to_string(&raw.git_hash),
        }))
    }

    /// NeuronCores visible to this process (`nrt_get_visible_vnc_count`, else the older
    /// `nrt_get_visible_nc_count`; callable before `nrt_init`). `Ok(None)` when the runtime
    /// has neither.
    pub fn visible_nc_count(&self) -> Result<Option<u32>> {
        self.count(
            self.api
                .nrt_get_visible_vnc_count
                .map(|f| ("nrt_get_visible_vnc_count", f))
                .or(self
                    .api
                    .nrt_get_visible_nc_count
                    .map(|f| ("nrt_get_visible_nc_count", f))),
        )
    }

    /// NeuronCores on the instance (`nrt_get_total_vnc_count`, else
    /// `nrt_get_total_nc_count`). `Ok(None)` when the runtime has neither.
    pub fn total_nc_count(&self) -> Result<Option<u32>> {
        self.count(
            self.api
                .nrt_get_total_vnc_count
                .map(|f| ("nrt_get_total_vnc_count", f))
                .or(self
                    .api
                    .nrt_get_total_nc_count
                    .map(|f| ("nrt_get_total_nc_count", f))),
        )
    }

    fn count(
        &self,
        f: Option<(&'static str, unsafe extern "C" fn(*mut u32) -> NRT_STATUS)>,
    ) -> Result<Option<u32>> {
        let Some((call, f)) = f else {
            return Ok(None);
        };
        let mut n = 0u32;
        // SAFETY: writes one u32 through a valid pointer.
        let status = unsafe { f(&mut n) };
        self.check(call, status)?;
        Ok(Some(n))
    }
}

/// A NUL-terminated C `char` array as text (all of it when there is no NUL).
pub(crate) fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
