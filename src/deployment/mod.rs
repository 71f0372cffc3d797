//! What a deployment is sized and typed by, decided before any runner exists: the graph shapes
//! it captures ([`Buckets`], [`RunnerConfig`]), the user's limits ([`Limits`]), the ranks one
//! process runs ([`RankSpan`]) and the secret a model's instances share ([`InstanceSecret`]).
//!
//! The memory plan ([`crate::plan`]) sizes a deployment from these and the runner
//! ([`crate::runner`]) captures and serves it: both read this module, neither the other's.

mod buckets;
mod limits;
mod ranks;
pub(crate) mod secret;

pub(crate) use buckets::{greedy_graph_pays, keep_paying_greedy, smallest_fitting, StepKind};
pub use buckets::{Buckets, RunnerConfig, CTX_BUCKET_RATIO, DEFAULT_PREFILL_SEQS, MIN_CTX_BUCKET};
pub use limits::{Limits, DEFAULT_HBM_UTILIZATION};
pub use ranks::RankSpan;
pub use secret::{InstanceSecret, ENV_SECRET};
