//! Backends that execute graphs.
pub mod cpu;
