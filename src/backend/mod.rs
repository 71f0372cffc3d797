//! Backends that execute graphs.
pub mod cpu;
pub mod neuron;
