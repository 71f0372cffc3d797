//! The Neuron backend: compiling graphs with `neuronx-cc` and running them through libnrt.
//!
//! - [`check`]: `lower --check neuron`, what neuronx-cc and libnrt would reject in a module.
//! - [`compile`]: the `neuronx-cc` driver and its NEFF cache.
//! - [`doctor`]: `deepinfer doctor`'s report of what a Neuron run needs on this machine.
//! - [`footprint`]: what a loaded NEFF takes of its core's HBM (code, scratchpad, collectives), from its HLO.
//! - [`minimums`]: the oldest runtime and compiler versions the graphs need, and why.
//! - [`progress`]: how long operations (capture, compile) report progress, for the binary to draw.
//! - [`sim_neff`]: nrt-sim's NEFF container, which its stand-in compiler writes through the same
//!   compile driver, so `--backend sim` takes the device path end to end.
//! - The libnrt runtime itself (loaded at run time through `neuron-sys`): its safe level is
//!   re-exported here unchanged, with its error type [`NeuronError`] (which [`crate::Error`]
//!   wraps), and [`open_runtime`] opens it. All `unsafe` lives in `neuron-sys`; this crate is
//!   `forbid(unsafe_code)`.

pub mod check;
pub mod compile;
pub mod doctor;
pub mod footprint;
pub mod minimums;
pub mod progress;
pub mod sim_neff;

pub use neuron_sys::{
    execute, Candidate, Error as NeuronError, Library, Model, ModelIo, Placement, Runtime, Tensor,
    TensorInfo, TensorSet, TensorUsage, Version,
};

/// Loads libnrt (`NEURON_RT_LIB`, then `libnrt.so.1`, then `/opt/aws/neuron/lib/libnrt.so.1`)
/// and initialises it (`nrt_init`) over the NeuronCores `start_nc .. start_nc + nc_count`
/// (relative to `NEURON_RT_VISIBLE_CORES`), or returns the runtime already initialised over the
/// same cores.
pub fn open_runtime(start_nc: u32, nc_count: u32) -> Result<Runtime, NeuronError> {
    Runtime::shared(Library::load()?, start_nc, nc_count)
}
