//! Tensor parallelism: how each parameter splits over `ranks` NeuronCores, and why.
//!
//! Every rank runs the same graph on its own shards; partial results meet in collectives
//! (`Tensor::all_reduce`, `Tensor::all_gather`). The choice per component, with the reason:
//!
//! - **Attention, by head.** `q_b_proj` (or `q_proj`) and `kv_b_proj` keep their rows of the
//!   rank's heads (both are head-major: `[heads * per_head, in]`), `o_proj` its columns of
//!   them; the rank's output is a partial sum, completed by one all-reduce per layer. This is
//!   Megatron's split and the cheapest: no collective inside attention.
//! - **MLA's latent cache, replicated.** The latent (`c_kv`, `k_pe`) has no head dimension:
//!   every head reads all of it, so each rank holds the whole root and writes the same rows
//!   (`q_a_proj`, `kv_a_proj_with_mqa` and their norms are replicated to compute them). A
//!   sequence shard would divide the cache by the rank count but needs a cross-rank softmax
//!   merge in every layer (two more collectives per layer, on the critical path of decode);
//!   the latent is small (576 values per token and layer for V2-Lite, V2 and V3: 69 KB per
//!   token for V2's 60 layers in bf16), so replication is what vLLM and NxD Inference chose too.
//! - **Dense MLP and shared experts, column then row.** `gate_proj`/`up_proj` keep rows of the
//!   intermediate dimension, `down_proj` the matching columns; one all-reduce completes the
//!   block (shared with the routed experts' in MoE layers).
//! - **Routed experts, expert-parallel.** Each rank owns `experts / ranks` whole experts (the
//!   stacked `[experts, ..]` tensors and their int8 or int4 scales split on the expert axis).
//!   Routing is computed on every rank from the replicated (f32) router, so no collective
//!   carries token assignments; a rank evaluates only its experts and contributes zero for the
//!   others. Splitting inside each expert instead would make every rank read a slice of every
//!   selected expert: the same bytes, but `ranks` times more, smaller matmuls.
//! - **Embedding and LM head, by vocabulary.** A rank holds `ceil(vocab / ranks)` rows: the
//!   embedding looks up the ids in its range and an all-reduce fills the others; each rank
//!   adjusts and samples its own slice of the logits, and only per-row figures cross ranks
//!   (`super::vocab`). A graph that returns logits returns the rank's slice; the runner joins
//!   the ranks' slices on the host. A vocabulary the degree does not divide is padded, as
//!   vLLM pads its vocabulary shards: the last rank's slice ends in zero rows whose logits the
//!   graph sets to `-inf` (never sampled), and the runner drops their columns (never
//!   returned). Heads and experts are not padded: a degree must divide them.
//!
//! A rank finds its vocabulary rows and experts from one small per-rank input,
//! [`SHARD_OFFSETS`], so that every rank runs one and the same HLO (one NEFF per bucket).

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// The per-rank input `[first vocabulary row, first expert]` (i32) of a sharded graph.
pub const SHARD_OFFSETS: &str = "tp.shard_offsets";

/// The tensor-parallel degrees `--tp` accepts.
pub const TP_DEGREES: &[usize] = &[1, 2, 4, 8, 16, 32, 64];

/// How one parameter is divided over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// Each rank holds `1 / ranks` of dimension 0 (rows, experts or vocabulary), rounded up:
    /// the last rank's shard of a vocabulary the degree does not divide ends in zero rows
    /// ([`rows_per_rank`]).
    Rows,
    /// Each rank holds `1 / ranks` of the last dimension (the input columns of a row-parallel
    /// projection).
    Cols,
}

/// How parameter `name` (a [`super::WeightSpecs`] name) is split.
pub fn split_of(name: &str) -> Split {
    const ROWS: &[&str] = &[
        ".self_attn.q_proj.weight",
        ".self_attn.q_b_proj.weight",
        ".self_attn.kv_b_proj.weight",
        ".mlp.gate_proj.weight",
        ".mlp.up_proj.weight",
        ".shared_experts.gate_proj.weight",
        ".shared_experts.up_proj.weight",
        ".mlp.experts.gate_proj",
        ".mlp.experts.up_proj",
        ".mlp.experts.down_proj",
        ".mlp.experts.gate_proj_scale",
        ".mlp.experts.up_proj_scale",
        ".mlp.experts.down_proj_scale",
    ];
    const COLS: &[&str] = &[
        ".self_attn.o_proj.weight",
        ".mlp.down_proj.weight",
        ".shared_experts.down_proj.weight",
    ];
    // The embeddings and the LM heads (an MTP layer's own too) split by vocabulary: their rows.
    let vocabulary = name.ends_with(".embed_tokens.weight")
        || name == "lm_head.weight"
        || name.ends_with(".shared_head.head.weight");
    if vocabulary || ROWS.iter().any(|s| name.ends_with(s)) {
        Split::Rows
    } else if COLS.iter().any(|s| name.ends_with(s)) {
        Split::Cols
    } else {
        Split::Replicated
    }
}

/// The rows of a [`Split::Rows`] dimension of `n` each of `ranks` ranks holds: `n / ranks`, or
/// one more when `ranks` does not divide `n` (only the vocabulary, padded; every other split
/// size is checked by [`validate`]).
pub fn rows_per_rank(n: usize, ranks: usize) -> usize {
    n.div_ceil(ranks.max(1))
}

/// The sizes tensor parallelism divides among the ranks, by their config.json names: the
/// degree must divide each. The vocabulary is not among them: it is padded instead.
pub fn split_sizes(cfg: &ModelConfig) -> Vec<(&'static str, usize)> {
    let mut sizes = vec![("num_attention_heads", cfg.num_attention_heads)];
    if (0..cfg.num_hidden_layers).any(|l| !cfg.is_moe_layer(l)) {
        sizes.push(("intermediate_size", cfg.intermediate_size));
    }
    if let Some(r) = &cfg.routing {
        sizes.push(("n_routed_experts", r.n_routed_experts));
        if cfg.n_shared_experts > 0 {
            sizes.push((
                "n_shared_experts * moe_intermediate_size",
                cfg.n_shared_experts * cfg.moe_intermediate_size,
            ));
        }
    }
    sizes
}

/// Checks that `ranks` divides everything the sharding splits; the error names the first
/// quantity that does not, and the degrees that would work.
pub fn validate(cfg: &ModelConfig, ranks: usize) -> Result<()> {
    if !TP_DEGREES.contains(&ranks) {
        return Err(Error::InvalidInput(format!(
            "--tp {ranks}: the tensor-parallel degree must be one of {TP_DEGREES:?}"
        )));
    }
    for (what, n) in split_sizes(cfg) {
        if !n.is_multiple_of(ranks) {
            let fits: Vec<usize> = TP_DEGREES
                .iter()
                .copied()
                .filter(|&d| n.is_multiple_of(d))
                .collect();
            return Err(Error::InvalidInput(format!(
                "--tp {ranks} does not divide the model's {what} ({n}); use a degree that \
                 does: one of {fits:?}"
            )));
        }
    }
    Ok(())
}

/// The shape rank `r`'s shard of a parameter of shape `full` has under `split`.
pub fn shard_shape(full: &[usize], split: Split, ranks: usize) -> Vec<usize> {
    let mut s = full.to_vec();
    match split {
        Split::Replicated => {}
        Split::Rows => s[0] = rows_per_rank(s[0], ranks),
        Split::Cols => {
            let last = s.len() - 1;
            s[last] /= ranks;
        }
    }
    s
}
