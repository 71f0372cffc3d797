//! deepinfer: a pure-Rust engine that serves DeepSeek-architecture models (MLA + MoE).
//!
//! The forward pass is written once, as a static [`graph::Graph`] built by [`model`]. The CPU
//! backend ([`backend::cpu`]) runs that graph with candle-core; later layers lower the same graph
//! to XLA HLO for neuronx-cc and replay it on Trainium through libnrt.
//!
//! Arrows point one way: `runner -> backend -> graph`, `model -> graph`; nothing below imports
//! anything above.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod backend;
pub mod cache;
pub mod config;
#[cfg(feature = "server")]
pub mod engine;
pub mod error;
pub mod graph;
pub mod lowering;
#[cfg(feature = "server")]
pub mod metrics;
pub mod model;
pub mod runner;
#[cfg(feature = "server")]
pub mod server;
pub mod step;
#[cfg(feature = "server")]
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
