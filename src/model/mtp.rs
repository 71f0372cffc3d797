//! DeepSeek-V3's multi-token-prediction (MTP) layer as a draft model: the graph that proposes
//! the tokens speculative decoding then verifies.
//!
//! A checkpoint with `num_nextn_predict_layers` ships its MTP layers after the decoder layers,
//! as `model.layers.{num_hidden_layers + k}` (layer 61 in DeepSeek-V3). Each is a small model
//! on top of the main one (DeepSeek-V3 technical report, section 2.2; vLLM's `deepseek_mtp.py`
//! and SGLang's `deepseek_nextn.py` serve it the same way): for position `i` it takes the main
//! model's last hidden state `h_i` (after the final norm, what the LM head reads) and the
//! embedding of the token at `i + 1`, normalizes each (`hnorm`, `enorm`), projects their
//! concatenation `[enorm(emb); hnorm(h)]` back to the hidden size (`eh_proj`), runs one full
//! decoder layer (MLA and MoE, with its own KV cache at position `i`) and reads logits through
//! its own head (`shared_head.norm`, `shared_head.head`): a guess at the token at `i + 2`.
//!
//! The draft graph is prefill-shaped ([`build_draft`]): chunks of rows of one or more sequences
//! (every row a position whose hidden state and next token are known), causal within a
//! sequence over the MTP layer's cached context, exactly as [`super::build_prefill`]'s chunks
//! are. A device also replays it in a decode bucket's shape ([`build_decode_draft`]: a row per
//! position, each with its sequence's block table), after verify steps and while chaining. Its KV lives
//! in the same KV root as the decoder's, as layer `num_hidden_layers` (the root is that much
//! wider when [`ModelConfig::draft_layers`] is set), written in place like every layer's.
//!
//! Inputs besides the prefill's metadata: [`HIDDEN`] (`[t, hidden]` f32, the main model's
//! hidden states of the rows, which a step graph returns under the same name when the model
//! drafts). Outputs: `next_tokens` (`[s]` i32, each chunk's last row's argmax: its proposal,
//! under the name every step graph samples into), `logits` on request, [`DRAFT_HIDDEN`] (the
//! layer's output after its head's norm, what the head reads: chaining feeds it back as the
//! next draft's hidden state, as SGLang's `deepseek_nextn.py` and vLLM since its PR 45895 do),
//! and the updated KV root.
//!
//! vLLM also zeroes the embedding of a row at position 0 (`inputs_embeds[positions == 0] =
//! 0`); SGLang, Megatron's MTP and the report do not, and neither does this graph. A draft
//! only changes which tokens are proposed, never which are accepted.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Tensor};
use crate::weights::Checkpoint;

use super::attention::{self, Roots};
use super::{
    check_spec, chunk_visibility, decoder_layer, embed_in, head_logits, inputs, metadata, ops,
    step_inputs, AttnFn, CacheLayout, GraphSpec, LogitsOutput, ModelWeights, StepInputs,
    WeightSpecs, Weights, INDEX_ROOT, KV_ROOT, STEP_LOGITS,
};

/// The main model's last hidden states (after its final norm): a step graph's output when the
/// model drafts, and the draft graph's input.
pub const HIDDEN: &str = "hidden";
/// The draft graph's output hidden states: the MTP layer's output after its head's norm (what
/// chaining drafts from).
pub const DRAFT_HIDDEN: &str = "draft_hidden";

/// The draft graph of MTP layer `cfg.num_hidden_layers` for `spec.rows` rows in chunks of up to
/// `spec.seqs` sequences over `spec.ctx` context positions (see the module docs). Its
/// `input_ids` are each row's next token, its `positions` the rows' own.
pub fn build_draft(
    cfg: &ModelConfig,
    specs: &WeightSpecs,
    cache: &CacheLayout,
    spec: &GraphSpec,
) -> Result<Graph> {
    check_draft(cfg, spec, cache)?;
    let (t, seqs, ctx) = (spec.rows, spec.seqs.max(1), spec.ctx);
    if seqs > t {
        return Err(Error::shape(
            "bucket",
            format!("a draft step of {t} rows cannot carry {seqs} sequences"),
        ));
    }
    let b = GraphBuilder::new(format!("draft_t{t}_s{seqs}_c{ctx}"));
    let w = Weights::new(&b, specs);
    let s = step_inputs(&b, cfg, cache, t, seqs, ctx)?;
    let last_index = metadata(&b, inputs::LAST_INDEX, vec![seqs], DType::I32)?;
    let (visible, _) = chunk_visibility(&b, &s.positions, seqs, ctx)?;
    let (normed, head, roots) = mtp_layer(cfg, &b, &w, &s, &visible, attention::prefill, spec)?;
    let last_logits = head_logits(&w, &head, &normed.index_select(&last_index, 0)?)?;
    b.output("next_tokens", &w.vocab_slice()?.argmax(&last_logits)?)?;
    match spec.logits {
        LogitsOutput::None => {}
        LogitsOutput::Sampled => b.output(STEP_LOGITS, &last_logits)?,
        LogitsOutput::AllPositions => b.output(STEP_LOGITS, &head_logits(&w, &head, &normed)?)?,
    }
    draft_outputs(b, &s, &normed, &roots)
}

/// The draft graph in a decode bucket's shape, what a device replays after a verify step and
/// while chaining: `spec.rows` rows, each with its own block table and context length (as
/// [`super::build_decode`]'s), so the rows of one sequence at consecutive positions attend as
/// a chunk would (each row's cache row is written before any row reads the cache). Its
/// `next_tokens` are every row's proposal (`[rows]`); a chunk's is its last row's.
pub fn build_decode_draft(
    cfg: &ModelConfig,
    specs: &WeightSpecs,
    cache: &CacheLayout,
    spec: &GraphSpec,
) -> Result<Graph> {
    check_draft(cfg, spec, cache)?;
    let (rows, ctx) = (spec.rows, spec.ctx);
    let b = GraphBuilder::new(format!("draft_b{rows}_c{ctx}"));
    let w = Weights::new(&b, specs);
    let s = step_inputs(&b, cfg, cache, rows, rows, ctx)?;
    let context_lens = metadata(&b, inputs::CONTEXT_LENS, vec![rows], DType::I32)?;
    let visible = b
        .iota([rows, ctx], DType::I32, 1)?
        .lt(&context_lens.unsqueeze(1)?)?;
    let (normed, head, roots) = mtp_layer(cfg, &b, &w, &s, &visible, attention::decode, spec)?;
    let logits = head_logits(&w, &head, &normed)?;
    b.output("next_tokens", &w.vocab_slice()?.argmax(&logits)?)?;
    if spec.logits != LogitsOutput::None {
        b.output(STEP_LOGITS, &logits)?;
    }
    draft_outputs(b, &s, &normed, &roots)
}

/// Fails unless `cfg` drafts and `spec` fits `cache`.
fn check_draft(cfg: &ModelConfig, spec: &GraphSpec, cache: &CacheLayout) -> Result<()> {
    check_spec(spec, cache)?;
    match cfg.draft_layers {
        0 => Err(Error::shape(
            "bucket",
            "a draft graph of a model loaded without its MTP layer",
        )),
        _ => Ok(()),
    }
}

/// The MTP layer over the step's rows (see the module docs): its [`HIDDEN`] input, and its
/// output after its head's norm, the head's weight name and the updated roots.
fn mtp_layer(
    cfg: &ModelConfig,
    b: &GraphBuilder,
    w: &Weights,
    s: &StepInputs,
    visible: &Tensor,
    attn: AttnFn,
    spec: &GraphSpec,
) -> Result<(Tensor, String, Roots)> {
    let hidden = b.input(
        HIDDEN,
        InputRole::Carried,
        vec![spec.rows, cfg.hidden_size],
        DType::F32,
    )?;
    let layer = cfg.num_hidden_layers;
    let p = format!("model.layers.{layer}");
    let eps = cfg.rms_norm_eps;
    let (embedding, head) = embeddings(cfg, layer);
    let e = embed_in(w, &embedding, &s.input_ids)?;
    let e = ops::rms_norm(&e, &w.get(&format!("{p}.enorm.weight"))?, eps)?;
    let h = ops::rms_norm(&hidden, &w.get(&format!("{p}.hnorm.weight"))?, eps)?;
    let x = ops::linear(
        w.dots(),
        &b.cat(&[&e, &h], 1)?,
        &w.get(&format!("{p}.eh_proj.weight"))?,
    )?;
    let step = s.attn_step(visible);
    let (x, roots) = decoder_layer(cfg, w, layer, x, &s.roots, &step, attn, spec.moe)?;
    let normed = ops::rms_norm(&x, &w.get(&format!("{p}.shared_head.norm.weight"))?, eps)?;
    Ok((normed, head, roots))
}

/// A draft graph's [`DRAFT_HIDDEN`] and updated cache roots.
fn draft_outputs(b: GraphBuilder, s: &StepInputs, normed: &Tensor, roots: &Roots) -> Result<Graph> {
    b.output(DRAFT_HIDDEN, normed)?;
    b.output_aliased(KV_ROOT, &roots.kv, &s.roots.kv)?;
    if let (Some(new), Some(old)) = (&roots.index, &s.roots.index) {
        b.output_aliased(INDEX_ROOT, new, old)?;
    }
    b.finish()
}

/// The embedding and head MTP layer `layer` drafts with: its own copies, or the main model's
/// when it shares them ([`ModelConfig::draft_shares_embeddings`]).
fn embeddings(cfg: &ModelConfig, layer: usize) -> (String, String) {
    match cfg.draft_shares_embeddings {
        true => (
            "model.embed_tokens.weight".into(),
            ModelWeights::lm_head_name(cfg).into(),
        ),
        false => own_embeddings(layer),
    }
}

/// MTP layer `layer`'s own embedding and head, in DeepSeek-V3's published names.
fn own_embeddings(layer: usize) -> (String, String) {
    (
        format!("model.layers.{layer}.embed_tokens.weight"),
        format!("model.layers.{layer}.shared_head.head.weight"),
    )
}

/// Makes a drafting `cfg` share the main model's embedding and LM head when `ckpt` ships
/// neither of its MTP layer's own copies (a checkpoint written with the report's sharing in
/// mind, such as the default model's); a checkpoint with one but not the other keeps
/// `cfg` as it is, and loading then names the missing tensor.
pub fn share_absent_embeddings(cfg: &mut ModelConfig, ckpt: &Checkpoint) {
    if cfg.draft_layers == 0 {
        return;
    }
    let (embedding, head) = own_embeddings(cfg.num_hidden_layers);
    cfg.draft_shares_embeddings = !ckpt.contains(&embedding) && !ckpt.contains(&head);
}
