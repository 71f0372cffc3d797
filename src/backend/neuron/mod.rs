//! The Neuron backend: compiling graphs with `neuronx-cc` and running them through libnrt.
//!
//! - [`compile`]: the `neuronx-cc` driver and its NEFF cache.
//! - [`runtime`]: the libnrt runtime (loaded at run time through `neuron-sys`).

pub mod compile;
pub mod runtime;
