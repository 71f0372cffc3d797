//! The crate's one error type.
//!
//! Every fallible function in the library returns [`Result`]. Variants are grouped by the layer
//! that raises them, and each one carries what a user needs to fix the problem: the config key and
//! its value, the tensor name and the shape that was expected, the op and both shapes.

use std::path::PathBuf;

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in deepinfer's library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // === Input files ===
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `config.json` is malformed or asks for something deepinfer does not support.
    #[error("config.json: {0}")]
    Config(String),
    /// A checkpoint tensor is missing, mis-shaped, of an unsupported dtype, or the file is corrupt.
    #[error("checkpoint: {0}")]
    Weights(String),
    /// The tokenizer or chat template could not be loaded or applied.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    // === Graph construction ===
    /// A node was built with operands whose shapes or dtypes do not fit the op.
    #[error("graph op `{op}`: {msg}")]
    Shape {
        /// The op being built.
        op: &'static str,
        /// What was wrong, naming the shapes involved.
        msg: String,
    },

    // === Execution ===
    /// The inputs handed to a backend do not match the graph's declared inputs.
    #[error("graph input `{name}`: {msg}")]
    Binding {
        /// The input's name.
        name: String,
        /// What was wrong.
        msg: String,
    },
    /// A request the model cannot serve: a token outside the vocabulary, a prompt longer than the
    /// context, a batch larger than any bucket.
    #[error("{0}")]
    InvalidRequest(String),
    /// The cache has no free block left.
    #[error("out of KV-cache blocks: {0}")]
    OutOfBlocks(String),
    /// Compiling a graph with neuronx-cc failed (or the compiler is missing).
    #[error(transparent)]
    Compile(#[from] crate::backend::neuron::compile::CompileError),
    /// The Neuron runtime (libnrt) is missing or a call into it failed.
    #[error(transparent)]
    Neuron(#[from] neuron_sys::Error),
    /// A libnrt call made for one captured graph failed (load, bind or execute).
    #[error("graph `{graph}`: {source}")]
    Device {
        /// The graph (`decode_b8_c256`, `prefill_t64_c128`, or `capture` for shared buffers).
        graph: String,
        /// The runtime's error, naming the C call and the NRT status.
        source: neuron_sys::Error,
    },
    /// The engine thread could not start, or the model failed to load on it.
    #[error("engine: {0}")]
    Engine(String),
    /// An error inside candle-core while running a graph on the CPU.
    #[error("cpu backend: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// Builds a [`Error::Shape`] error.
    pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }
}
