//! deepinfer: a pure-Rust engine that serves DeepSeek-architecture models (MLA + MoE).
//!
//! The forward pass is written once, as a static [`graph::Graph`] built by [`model`]. The CPU
//! backend ([`backend::cpu`]) runs that graph with candle-core; later layers lower the same graph
//! to XLA HLO for neuronx-cc and replay it on Trainium through libnrt.
//!
//! Arrows point one way: `server -> engine -> runner -> backend -> graph`, `model -> graph`;
//! [`error`] sits below them all. Nothing below imports anything above.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used)]
#![forbid(unsafe_code)]

pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod export;
pub mod graph;
pub mod metrics;
pub mod model;
pub mod runner;
pub mod server;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
