//! The crate's one error type, and the kind a caller matches on.
//!
//! Every fallible function in the library returns [`Result`]. Variants are grouped by the layer
//! that raises them, and each one carries what a user needs to fix the problem: the config key and
//! its value, the tensor name and the shape that was expected, the op and both shapes, the graph
//! and the libnrt call.
//!
//! Callers that must act differently per cause (the server picks an HTTP status, the CLI an exit
//! message) match on [`Error::kind`], not on variants: a new variant then never changes what a
//! client sees by accident. The one rule the kinds enforce is the one that matters most to a
//! server: a request is only ever blamed ([`ErrorKind::InvalidInput`]) for what is in the request;
//! a device, compiler or internal fault is reported as such.
//!
//! This module sits at the bottom of the crate: it imports nothing of deepinfer's. The compiler
//! driver's failures ([`CompileError`]) are defined here for that reason, so the error type never
//! depends on the driver that raises them.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why an operation failed, coarsely: what a caller decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller's input is wrong: a token outside the vocabulary, a prompt longer than the
    /// context, a batch larger than any bucket, a malformed module handed to the importer. Fix
    /// the input; retrying it unchanged fails again.
    InvalidInput,
    /// The model directory is wrong: `config.json`, the checkpoint or the tokenizer.
    InvalidModel,
    /// A resource ran out (KV-cache blocks); the same input may succeed later.
    ResourceExhausted,
    /// Something deepinfer needs is not installed or not found (libnrt, nrt-sim, neuronx-cc).
    Unavailable,
    /// A file could not be read or written.
    Io,
    /// neuronx-cc failed on a graph, or its cache could not be used.
    Compile,
    /// The Neuron runtime or device failed while loading or running a graph.
    Device,
    /// An invariant of deepinfer itself broke (a bug): a graph built with mismatched shapes, an
    /// input the runner forgot to bind, an error inside candle-core.
    Internal,
    /// The engine is shutting down and ended the request: nothing failed, and the same request
    /// succeeds on a server that is up (the engine's `abort_all`).
    ShuttingDown,
}

/// Everything that can go wrong in deepinfer's library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // === Input files ===
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// `config.json` is malformed or asks for something deepinfer does not support.
    #[error("config.json: {0}")]
    Config(String),
    /// A checkpoint tensor is missing, mis-shaped, of an unsupported dtype, or the file is corrupt.
    #[error("checkpoint: {0}")]
    Weights(String),
    /// A GGUF file is malformed, or its metadata names something deepinfer does not run.
    #[error("GGUF: {0}")]
    Gguf(String),
    /// The tokenizer or chat template could not be loaded or applied.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    // === Requests ===
    /// Input the model cannot serve: a token outside the vocabulary, a prompt longer than the
    /// context, a batch larger than any bucket, an HLO module that does not parse.
    #[error("{0}")]
    InvalidInput(String),
    /// The cache has no free block left.
    #[error("out of KV-cache blocks: {0}")]
    OutOfBlocks(String),

    // === Graph construction and execution (deepinfer's own invariants) ===
    /// A node was built with operands whose shapes or dtypes do not fit the op.
    #[error("graph op `{op}`: {msg}")]
    Shape {
        /// The op being built.
        op: &'static str,
        /// What was wrong, naming the shapes involved.
        msg: String,
    },
    /// The inputs handed to a backend do not match the graph's declared inputs.
    #[error("graph input `{name}`: {msg}")]
    Binding {
        /// The input's name.
        name: String,
        /// What was wrong.
        msg: String,
    },
    /// A broken invariant that is neither a shape nor a binding: a step that returned fewer
    /// tokens than rows, a bucket the runner was asked for but never captured.
    #[error("internal error: {0}")]
    Internal(String),
    /// A collective of a tensor-parallel step failed: another rank failed the step, or a rank
    /// never arrived within the group's timeout.
    #[error("collective: {0}")]
    Collective(String),
    /// An error inside candle-core while running a graph on the CPU.
    #[error("cpu backend: {0}")]
    Candle(#[from] candle_core::Error),

    // === Neuron toolchain and device ===
    /// A tool or library deepinfer needs is not installed or not found; the message says how
    /// to get it.
    #[error("{0}")]
    Unavailable(String),
    /// Compiling a graph with neuronx-cc failed (or the compiler is missing). Boxed: its
    /// variants carry paths and output tails, and every `Result` in the crate pays for the
    /// largest variant.
    #[error(transparent)]
    Compile(Box<CompileError>),
    /// The Neuron runtime (libnrt) is missing or a call into it failed outside any one graph.
    #[error(transparent)]
    Neuron(#[from] neuron_sys::Error),
    /// A libnrt call made for one captured graph failed (load, bind or execute).
    #[error("graph `{graph}`: {nrt}")]
    Device {
        /// The graph (`decode_b8_c256`, `prefill_t64_c128`, or `capture` for shared buffers).
        graph: String,
        /// The runtime's error, naming the C call and the NRT status. In the message, not a
        /// `source` (which a `{:#}` chain would print a second time).
        nrt: neuron_sys::Error,
    },

    // === Engine ===
    /// The engine thread could not start, or the model failed to load on it.
    #[error("engine: {0}")]
    Engine(String),

    /// Another instance of a model split over several (a follower, or the leader seen from
    /// one) failed, answered nonsense or went away; `addr` is its address.
    #[error("instance {addr}: {msg}")]
    Instance {
        /// The other instance's address (`host:port`).
        addr: String,
        /// What happened.
        msg: String,
    },
}

impl Error {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Config(_) | Error::Weights(_) | Error::Gguf(_) | Error::Tokenizer(_) => {
                ErrorKind::InvalidModel
            }
            Error::InvalidInput(_) => ErrorKind::InvalidInput,
            Error::OutOfBlocks(_) => ErrorKind::ResourceExhausted,
            Error::Shape { .. } | Error::Binding { .. } | Error::Internal(_) | Error::Candle(_) => {
                ErrorKind::Internal
            }
            Error::Unavailable(_) => ErrorKind::Unavailable,
            Error::Compile(e) if matches!(**e, CompileError::CompilerNotFound { .. }) => {
                ErrorKind::Unavailable
            }
            Error::Compile(_) => ErrorKind::Compile,
            Error::Neuron(e) if e.is_library_missing() => ErrorKind::Unavailable,
            Error::Neuron(_) | Error::Device { .. } | Error::Collective(_) => ErrorKind::Device,
            Error::Instance { .. } => ErrorKind::Device,
            Error::Engine(_) => ErrorKind::Internal,
        }
    }

    /// Whether this is a collective's failure on a tensor-parallel rank: libnrt's status when
    /// another rank failed or vanished, so the step's real cause is that rank's own error.
    pub fn is_collective_failure(&self) -> bool {
        matches!(self, Error::Device { nrt, .. }
            if nrt.status_code() == Some(neuron_sys::sys::NRT_EXEC_HW_ERR_COLLECTIVES))
    }

    /// Builds a [`Error::Shape`] error.
    pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }
}

/// What can go wrong while compiling; every message names the graph(s) and says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompileError {
    /// The compiler could not be started: not installed, not on `PATH`, or not executable.
    #[error(
        "cannot run the Neuron compiler `{}` (needed to compile {graphs}): {source}. \
         Install it from AWS's Neuron pip repository: \
         `pip install neuronx-cc --extra-index-url=https://pip.repos.neuron.amazonaws.com` \
         (part of the AWS Neuron SDK; the apt packages carry only the driver, runtime and \
         tools), then put it on PATH or give its path explicitly. \
         To run without it, use `--backend cpu` (or `--backend sim`)",
        program.display()
    )]
    CompilerNotFound {
        /// The program that was tried.
        program: PathBuf,
        /// The graphs that needed it.
        graphs: String,
        /// Why it could not be started.
        source: io::Error,
    },

    /// `neuronx-cc --version` failed or printed nothing.
    #[error(
        "`{} --version` failed ({status}) before compiling {graphs}; its output:\n{output}\n\
         Check the compiler installation (run the same command by hand)",
        program.display()
    )]
    VersionFailed {
        /// The program that was run.
        program: PathBuf,
        /// The graphs that were waiting on it.
        graphs: String,
        /// Its exit status, or why it did not finish.
        status: String,
        /// The tail of what it printed.
        output: String,
    },

    /// The configuration contradicts the driver (e.g. `--output` among the flags).
    #[error("cannot compile {graphs}: {msg}")]
    InvalidConfig {
        /// The graphs that were to be compiled.
        graphs: String,
        /// What is wrong and how to fix it.
        msg: String,
    },

    /// neuronx-cc exited with an error.
    #[error(
        "neuronx-cc failed compiling {graph} ({status}); the last lines of its output:\n{tail}\n\
         Command: {command}\nIts logs and artifacts are kept in {}. \
         Fix the graph or the flags and rerun; nothing was cached",
        workdir.display()
    )]
    CompilerFailed {
        /// The graph's name.
        graph: String,
        /// Its exit status.
        status: String,
        /// The command line, quoted for a shell.
        command: String,
        /// The last lines of its stdout/stderr (or of `log-neuron-cc.txt`).
        tail: String,
        /// Its working directory, kept for the logs.
        workdir: PathBuf,
    },

    /// neuronx-cc ran longer than the timeout and was killed.
    #[error(
        "neuronx-cc timed out after {} compiling {graph} and was killed; the last lines of its \
         output:\n{tail}\nIts logs are kept in {}. Raise the compile timeout if the graph is \
         just large, or look for a hang in the log",
        fmt_duration(*timeout),
        workdir.display()
    )]
    Timeout {
        /// The graph's name.
        graph: String,
        /// The timeout that was exceeded.
        timeout: Duration,
        /// The last lines of its output.
        tail: String,
        /// Its working directory, kept for the logs.
        workdir: PathBuf,
    },

    /// neuronx-cc reported success but wrote no (or an empty) NEFF.
    #[error(
        "neuronx-cc exited successfully compiling {graph} but wrote no NEFF at {}; the last \
         lines of its output:\n{tail}\nCheck that the compiler's flags do not redirect its output",
        path.display()
    )]
    NoOutput {
        /// The graph's name.
        graph: String,
        /// Where the NEFF should have been.
        path: PathBuf,
        /// The last lines of its output.
        tail: String,
    },

    /// The cache (or a scratch directory under it) could not be read or written.
    #[error(
        "NEFF cache, compiling {graph}: cannot {action} {}: {source}. Check that the cache \
         directory is writable and has free space, or point DEEPINFER_NEFF_CACHE elsewhere",
        path.display()
    )]
    Cache {
        /// The graph's name (or the list of graphs, before any single one started).
        graph: String,
        /// What was being done (`create`, `write`, `lock`, ...).
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

impl From<CompileError> for Error {
    fn from(e: CompileError) -> Self {
        Error::Compile(Box::new(e))
    }
}

/// A duration as neuronx-cc's messages show it: whole seconds, or tenths when not whole.
pub(crate) fn fmt_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}
