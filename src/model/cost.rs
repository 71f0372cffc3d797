//! The floor of a decode step: the bytes it cannot avoid reading.
//!
//! Decode is memory-bound, so a step's time is bounded below by (weights it must read + cache it
//! must read) / memory bandwidth. The weights it must read are every weight the forward uses,
//! except that the embedding contributes one row per sequence and each MoE layer only the experts
//! some token selects: `E * (1 - (1 - k/E)^b)` of them in expectation under uniform routing. The
//! cache it must read is every sequence's latent rows for the context, or with V3.2's sparse
//! attention its `index_topk` selected latents plus every position's index key. Comparing a graph's
//! [`crate::graph::stats`] with this floor shows how much the lowering wastes.

use crate::config::ModelConfig;
use crate::graph::DType;

use super::WeightSpecs;

/// The unavoidable reads of one decode step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeFloor {
    /// Weight bytes.
    pub weight_bytes: f64,
    /// Cache bytes: latents (and V3.2's index keys).
    pub cache_bytes: f64,
}

impl DecodeFloor {
    /// Weight plus cache bytes.
    pub fn total(&self) -> f64 {
        self.weight_bytes + self.cache_bytes
    }
}

/// The floor for `batch` sequences with `ctx` cached positions each, with weights stored as
/// `specs` says and a cache of `kv_dtype`.
pub fn decode_floor(
    cfg: &ModelConfig,
    specs: &WeightSpecs,
    kv_dtype: DType,
    batch: usize,
    ctx: usize,
) -> DecodeFloor {
    let mut weights = 0.0f64;
    for name in specs.names() {
        let shape = specs.shape(name).unwrap_or_default();
        let n: usize = shape.iter().product();
        let elems = if name == "model.embed_tokens.weight" {
            if cfg.tie_word_embeddings {
                n as f64 // also the LM head, read in full
            } else {
                (batch * cfg.hidden_size) as f64
            }
        } else if name.contains(".mlp.experts.") {
            let r = cfg
                .routing
                .as_ref()
                .map(|r| (r.n_routed_experts as f64, r.num_experts_per_tok as f64));
            let (e, k) = r.unwrap_or((1.0, 1.0));
            let distinct = e * (1.0 - (1.0 - k / e).powi(batch as i32));
            n as f64 / e * distinct
        } else {
            n as f64
        };
        weights += elems * specs.dtype(name).size_in_bytes() as f64;
    }
    let latents = cfg.indexer.map_or(ctx, |ix| ix.topk.min(ctx));
    let per_layer = latents * cfg.kv_cache_width() + ctx * cfg.index_cache_width();
    let cache =
        (batch * cfg.num_hidden_layers * per_layer) as f64 * kv_dtype.size_in_bytes() as f64;
    DecodeFloor {
        weight_bytes: weights,
        cache_bytes: cache,
    }
}
