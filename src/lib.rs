//! deepinfer: a pure-Rust engine that serves DeepSeek-architecture models (MLA + MoE).
//!
//! The forward pass is written once, as a static [`graph::Graph`] built by [`model`]. The CPU
//! backend ([`backend::cpu`]) runs that graph with candle-core; later layers lower the same graph
//! to XLA HLO for neuronx-cc and replay it on Trainium through libnrt.
//!
//! Arrows point one way: `server -> engine -> runner -> backend -> graph`, `model -> graph`;
//! [`error`] sits below them all. Nothing below imports anything above. Host tensors
//! ([`host`]: the model's weights, the CPU backend's values) sit below both `model` and
//! `backend`, so the model names no backend. [`plan`] sizes a deployment before any runner
//! exists, from the config and [`deployment`] (buckets, limits), which the runner reads too:
//! `runner -> plan -> deployment`, `runner -> deployment` (a device capture checks its plan).
//!
//! The default `server` feature adds what serving needs (the engine, the HTTP server, the
//! tokenizer, metrics, and the `deepinfer` binary). Without it the library is the graph, the
//! backends, the model, the runners and the HLO export: what nrt-sim links, so the simulator
//! carries no HTTP stack.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used)]
#![forbid(unsafe_code)]

pub mod backend;
#[cfg(feature = "server")]
pub mod chat_v4;
pub mod config;
pub mod deployment;
#[cfg(feature = "server")]
pub mod engine;
pub mod error;
pub mod export;
pub mod gguf;
pub mod graph;
pub mod host;
#[cfg(feature = "server")]
pub mod metrics;
pub mod model;
pub mod plan;
pub mod runner;
#[cfg(feature = "server")]
pub mod server;
pub mod source;
#[cfg(test)]
mod test_util;
#[cfg(feature = "server")]
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
