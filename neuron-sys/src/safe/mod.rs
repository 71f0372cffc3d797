//! RAII handles over libnrt: the `safe` level.
//!
//! Ownership mirrors libnrt's lifetime rules, so that no call can reach a freed object:
//!
//! - every [`Model`], [`Tensor`] and [`TensorSet`] holds its [`Runtime`], so `nrt_close` runs
//!   only after every model is unloaded and every tensor and set freed;
//! - a [`TensorSet`] holds every tensor added to it (libnrt's set does not own them);
//! - a slice [`Tensor`] holds its parent.
//!
//! `Drop` never panics: a failed `nrt_unload` (the only release call that returns a status)
//! is recorded on the runtime and surfaces through [`Runtime::take_deferred_errors`].

mod model;
mod runtime;
mod tensor;

pub use model::{execute, Model, ModelIo, TensorInfo, TensorUsage};
pub use runtime::{MemoryStats, Runtime};
pub use tensor::{Placement, Tensor, TensorSet};
