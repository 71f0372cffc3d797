//! Bindings to the AWS Neuron runtime, `libnrt`, loaded at run time.
//!
//! This crate is a placeholder until the neuron-sys issue lands: the workspace layout is fixed
//! from the start so that later work adds code without moving files.
