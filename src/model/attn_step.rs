//! What one layer's attention reads from the step: the new tokens' rope angles and cache slots,
//! the context's slots and what each query may see. MLA ([`super::attention`]) and V3.2's
//! indexer ([`super::indexer`]) both read it, so it lives below both.

use crate::graph::Tensor;

/// What one layer's attention needs from the step.
pub struct AttnStep<'a> {
    /// cos/sin of the new tokens' positions, `[n, rope_dim / 2]` each.
    pub cos: &'a Tensor,
    /// See `cos`.
    pub sin: &'a Tensor,
    /// Cache slots of the new tokens, `[n]`.
    pub slots: &'a Tensor,
    /// Cache slots of every context position, `[seqs * ctx]`, row-major by sequence.
    pub ctx_slots: &'a Tensor,
    /// Which (query, context position) pairs may attend: `[n, seqs * ctx]` bool for prefill
    /// (every token against every packed sequence's context), `[seqs, ctx]` for decode (one
    /// query per sequence).
    pub visible: &'a Tensor,
    /// Context positions of one sequence (the bucket's `ctx`): what a query can see at most.
    pub seq_ctx: usize,
}
