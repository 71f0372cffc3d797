//! Backends that execute graphs.
pub mod cpu;
pub mod hlo;
pub mod neuron;
