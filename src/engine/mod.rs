//! Turning requests into runner steps.
//!
//! - [`single`]: one sequence at a time (`deepinfer generate` and `score`).
//! - [`Scheduler`]: continuous batching. Requests become sequences; every iteration runs one
//!   decode step over every decoding sequence (padded to a captured batch bucket) and one
//!   prefill chunk, so long prompts never stall the streams already running. When the KV cache
//!   runs out of blocks the newest sequence is preempted and later recomputed; nothing is dropped.
//! - [`Engine`]: the scheduler on its own thread, fed by channels, for the async server.
//! - [`detokenize`]: incremental, UTF-8-safe detokenization and stop strings.
//! - [`BlockAllocator`]: which KV-cache blocks each sequence owns; the scheduler owns it.
//! - [`speculative`]: speculative decoding with the model's multi-token-prediction layer.

mod blocks;
pub mod detokenize;
pub mod grammar;
mod params;
mod scheduler;
pub mod single;
pub mod speculative;
mod thread;

pub use blocks::BlockAllocator;
pub use params::{FinishReason, GenerationParams};
pub use scheduler::{
    shares_prefixes, Event, Output, RequestId, Scheduler, TokenEvent, TokenLogprobs,
    DEFAULT_FAIR_DECODE_SLOWDOWN,
};
pub use single::{generate, score, StopConditions};
pub use thread::{
    Engine, EngineInfo, EngineOptions, RequestStream, SubmitError, DEFAULT_STALL_TIMEOUT,
    EVENT_QUEUE_CAPACITY,
};
