//! An estimate of the device memory the compiled graphs themselves take on each core: NEFF
//! code (with its DMA rings) and the scratchpad for intermediates. Nothing here is measured on
//! hardware; every figure is a rule of thumb with its source, printed as an estimate.
//!
//! # Code
//!
//! The Neuron runtime's device-memory guide (aws-neuron-sdk
//! `neuron-runtime/explore/device-memory.rst`) splits a core's HBM into tensors, model
//! constants, model code (with "a micro-code overhead of 96MB per physical Neuron Core"),
//! scratchpad, DMA rings, profile buffers and collectives; each loaded NEFF pays its own code
//! and DMA rings, and only the scratchpad is shared. Our NEFFs carry no constants (weights are
//! inputs), so per core:
//!
//! `code = 96 MiB x physical cores per rank + NEFFs x layers x` [`CODE_PER_LAYER`]
//!
//! where [`CODE_PER_LAYER`] comes from the one public size of a whole-model NEFF with weights
//! as inputs and no vocabulary-wide ArgMax: 40 MB for Llama-3.1-8B's 32 layers (ZML's prefill
//! NEFF, aws-neuron-sdk#1210; its decode NEFF with an ArgMax was 800 MB, the reason our
//! sampler avoids one). It is not scaled with tensor parallelism: a rank's graph has the same
//! layers and ops on narrower tensors, and instruction counts shrink far less than bytes.
//!
//! # Scratchpad
//!
//! One layer's live f32 intermediates in the largest graph, the larger of decode at
//! (max batch, longest context) and prefill at (chunk, longest context): the residual stream
//! and its normalized copies (4 x `[rows, hidden]`), the query and the absorbed query
//! (`[rows, heads/N, qk_head_dim + kv_lora_rank]`), the context latents gathered from the cache
//! (`[seqs, ctx, kv_lora_rank + qk_rope_head_dim]`), the attention scores and probabilities
//! (2 x `[rows, heads/N, ctx]`), prefill's naive keys and values
//! (`[ctx, heads/N, qk_head_dim + v_head_dim]`), the all-experts MoE strategy's gate, up and
//! activation (3 x `[E/N, rows, moe_intermediate]`), and the logits and the sampler's working
//! copy over the rank's vocabulary slice (2 x `[rows, vocab/N]`; the split threshold search's
//! `[rows, 15, vocab/N]` compares are taken to fuse into their sums). neuronx-cc tiles through
//! SBUF and may need less; it may also keep more alive. Meant for a margin, not a prediction.

use crate::config::ModelConfig;
use crate::runner::Buckets;

use super::instance::Instance;

/// The runtime's micro-code overhead per physical NeuronCore (device-memory.rst).
pub const MICROCODE_PER_PHYSICAL_CORE: u64 = 96 << 20;

/// NEFF code and DMA rings per layer of one whole-model NEFF: 40 MB / 32 layers
/// (aws-neuron-sdk#1210, see the module docs).
pub const CODE_PER_LAYER: u64 = 40_000_000 / 32;

/// The estimate for one core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NeffEstimate {
    /// Code, DMA rings and micro-code of every NEFF loaded on the core.
    pub code: u64,
    /// The shared scratchpad.
    pub scratchpad: u64,
}

/// The estimate for one rank of `tp` running `buckets` of `cfg` on `instance`.
pub fn estimate(
    cfg: &ModelConfig,
    tp: usize,
    buckets: &Buckets,
    instance: Instance,
) -> NeffEstimate {
    let code = MICROCODE_PER_PHYSICAL_CORE * instance.physical_per_core()
        + buckets.graph_count() as u64 * cfg.num_hidden_layers as u64 * CODE_PER_LAYER;
    let ctx = buckets.max_len();
    let decode = live_f32(
        cfg,
        tp,
        buckets.max_batch(),
        buckets.max_batch(),
        ctx,
        false,
    );
    let prefill = live_f32(cfg, tp, buckets.prefill_chunk, 1, ctx, true);
    NeffEstimate {
        code,
        scratchpad: 4 * decode.max(prefill),
    }
}

/// f32 elements alive in one layer of a graph of `rows` tokens of `seqs` sequences over `ctx`.
fn live_f32(
    cfg: &ModelConfig,
    tp: usize,
    rows: usize,
    seqs: usize,
    ctx: usize,
    naive: bool,
) -> u64 {
    let tp = tp.max(1);
    let heads = cfg.num_attention_heads / tp;
    let mut n = 4 * rows * cfg.hidden_size
        + rows * heads * (cfg.qk_head_dim() + cfg.kv_lora_rank)
        + seqs * ctx * (cfg.kv_cache_width() + cfg.index_cache_width())
        + 2 * rows * heads * ctx
        + rows * cfg.indexer.map_or(0, |ix| ix.n_heads) * ctx
        + 2 * rows * (cfg.vocab_size / tp);
    if naive {
        n += ctx * heads * (cfg.qk_head_dim() + cfg.v_head_dim);
    }
    if let Some(r) = &cfg.routing {
        n += 3 * (r.n_routed_experts / tp) * rows * cfg.moe_intermediate_size;
    }
    n as u64
}
