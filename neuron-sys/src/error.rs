//! The crate's one error type.

use std::borrow::Cow;

use crate::sys;

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How to get libnrt, appended to every "not found" message.
pub const HOW_TO_GET_LIBNRT: &str =
    "install the `aws-neuronx-runtime-lib` package from the AWS Neuron \
     apt/yum repository (it puts libnrt.so.1 in /opt/aws/neuron/lib), or set NEURON_RT_LIB to the \
     path of libnrt.so.1, or run without Neuron: `--backend cpu` or `--backend sim`";

/// One place [`crate::Library::load`] looked for libnrt, and why it did not work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAttempt {
    /// Where: a path, a bare soname (resolved by the dynamic loader), and where it came from.
    pub place: String,
    /// The dynamic loader's message.
    pub reason: String,
}

/// Everything that can go wrong in neuron-sys.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // === Loading libnrt ===
    /// No candidate could be opened. Lists every place tried and how to get libnrt.
    #[error("{}", not_found_message(.tried))]
    LibraryNotFound {
        /// Every place tried, in order.
        tried: Vec<LoadAttempt>,
    },
    /// The library opened but lacks a function every supported libnrt exports: it is not
    /// libnrt, or a broken one.
    #[error(
        "{library} is not a usable libnrt: required symbol `{symbol}` is missing ({HOW_TO_GET_LIBNRT})"
    )]
    MissingSymbol {
        /// The library that was opened.
        library: String,
        /// The first required symbol that is missing.
        symbol: &'static str,
    },
    /// An optional libnrt function this operation needs is absent from the loaded runtime
    /// (it is too old, or a simulator that does not implement it).
    #[error("{function} is not available in {library}")]
    Unsupported {
        /// The missing function.
        function: &'static str,
        /// The loaded library.
        library: String,
    },

    // === Calls ===
    /// A libnrt call returned a status other than `NRT_SUCCESS`.
    #[error("{call} failed: {name} (status {status})")]
    Status {
        /// The C function that failed.
        call: &'static str,
        /// The raw `NRT_STATUS`.
        status: u32,
        /// Its name: this crate's table, else the runtime's `nrt_get_status_as_str`, else
        /// `NRT_STATUS_UNKNOWN`.
        name: Cow<'static, str>,
    },
    /// A libnrt call reported success but returned a null handle.
    #[error("{call} returned NRT_SUCCESS but a null handle")]
    NullHandle {
        /// The C function.
        call: &'static str,
    },
    /// An argument was rejected before reaching libnrt (out of bounds, a NUL in a name,
    /// objects from different runtimes, ...).
    #[error("{call}: {msg}")]
    InvalidArgument {
        /// The operation (usually the C function it guards).
        call: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// `nrt_init` may run once per process at a time, and a [`crate::Runtime`] is alive.
    #[error(
        "a neuron-sys Runtime is already initialized in this process (libnrt allows one \
         nrt_init); clone it, or use Runtime::shared"
    )]
    AlreadyInitialized,
}

impl Error {
    /// Builds [`Error::Status`] with the name from this crate's table.
    pub fn status(call: &'static str, status: u32) -> Self {
        Error::Status {
            call,
            status,
            name: Cow::Borrowed(sys::status_name(status)),
        }
    }

    /// The raw `NRT_STATUS` for [`Error::Status`], else `None`.
    pub fn status_code(&self) -> Option<u32> {
        match self {
            Error::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether this error means libnrt could not be loaded at all (the case where a caller
    /// would fall back to another backend).
    pub fn is_library_missing(&self) -> bool {
        matches!(self, Error::LibraryNotFound { .. })
    }

    pub(crate) fn invalid(call: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            call,
            msg: msg.into(),
        }
    }
}

fn not_found_message(tried: &[LoadAttempt]) -> String {
    use std::fmt::Write as _;
    // One line: it is what a user sees when `--backend neuron` cannot start.
    let mut msg = String::from("libnrt (the AWS Neuron runtime) could not be loaded; tried");
    for (i, attempt) in tried.iter().enumerate() {
        let sep = if i == 0 { " " } else { "; " };
        let _ = write!(msg, "{sep}{}: {}", attempt.place, attempt.reason);
    }
    let _ = write!(
        msg,
        ". To fix: {HOW_TO_GET_LIBNRT}. (If libnrt is installed but a library it needs is not \
         found, add /opt/aws/neuron/lib to LD_LIBRARY_PATH.)"
    );
    msg
}
