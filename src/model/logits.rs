//! What a row's logits go through before the sampler, in vLLM's order: the allowed-token mask
//! (structured outputs), `logit_bias` (with `min_tokens`' ban on end-of-sequence tokens), then
//! the repetition, frequency and presence penalties. `min_p` belongs to the sampler (after
//! temperature, see [`super::sampling`]).
//!
//! The penalties need, per sequence, how often each token was generated and whether it is in
//! the prompt. Those live on the device, in the *sampling-state root* (`[rows, 2 * vocab]`
//! f32: generated-token counts, then prompt presence as 0/1), one row per running sequence
//! (the scheduler assigns it; row 0 is padding's scratch row), updated in place by every step
//! from the tokens it feeds (a graph output aliased to the root, like the KV cache). A prefill
//! chunk that starts a sequence (position 0) resets its row first, so a row is reused without
//! the host clearing it, and a preempted sequence rebuilds its counts when it is prefilled
//! again. Nothing is copied from the host but the per-row parameters.
//!
//! Formulas (vLLM's `apply_penalties`, OpenAI's documented penalty formula): with `c[v]` the
//! generated count and `seen[v]` "in the prompt or generated", `l[v]` becomes
//! `l / r` (if `l > 0`) or `l * r` where `seen`, with `r` the repetition penalty; then
//! `l - c * frequency - (c > 0) * presence`.

use super::vocab::VocabSlice;
use crate::error::Result;
use crate::graph::{DType, Tensor};

/// Most `logit_bias` entries per row: the `[rows * LOGIT_BIAS_SLOTS]` bias inputs.
pub const LOGIT_BIAS_SLOTS: usize = 32;

/// The input (and aliased output) name of the sampling-state root.
pub const STATE_ROOT: &str = "sampling_state";

/// The per-row inputs of [`adjust`], each with `rows` rows.
pub struct LogitInputs<'a> {
    /// Allowed-token bits, `[rows, vocab.div_ceil(32)]` u32.
    pub allowed: &'a Tensor,
    /// Where each bias entry goes in the flattened `[rows, vocab + LOGIT_BIAS_SLOTS]` bias:
    /// `row * (vocab + LOGIT_BIAS_SLOTS) + token`, or `... + vocab + k` (a spare column) for
    /// the row's unused `k`-th entry. Every index depends only on its own row, so the first
    /// rows of a wider batch's metadata are a narrower batch's. `[rows * LOGIT_BIAS_SLOTS]`
    /// i32.
    pub bias_index: &'a Tensor,
    /// The entries' values, `[rows * LOGIT_BIAS_SLOTS]` f32.
    pub bias_values: &'a Tensor,
    /// `[rows]` f32 each.
    pub presence: &'a Tensor,
    /// See `presence`.
    pub frequency: &'a Tensor,
    /// See `presence` (1: none).
    pub repetition: &'a Tensor,
}

/// Each column's bit of its row's mask, as a bool `[rows, n]`, given the columns' token ids
/// (`[rows, n]` i32).
fn allowed_tokens(words: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let v = ids.to_dtype(DType::U32)?;
    let word = words.gather(&v.shr(&v.full_like(5.0)?)?.to_dtype(DType::I32)?, 1)?;
    let bit = word
        .shr(&v.bitand(&v.full_like(31.0)?)?)?
        .bitand(&v.full_like(1.0)?)?;
    bit.eq(&bit.full_like(1.0)?)
}

/// The dense `[rows, vocab]` bias of the sparse entries.
fn dense_bias(index: &Tensor, values: &Tensor, rows: usize, vocab: usize) -> Result<Tensor> {
    let b = index.builder();
    let n = index.dim(0);
    let width = vocab + LOGIT_BIAS_SLOTS;
    let zeros = b.full(0.0, [rows * width, 1], DType::F32)?;
    zeros
        .scatter_rows(index, 0, &values.reshape([n, 1])?)?
        .reshape([rows, width])?
        .narrow(1, 0, vocab)
}

/// `logits` (`[rows, n]` f32, the part of the vocabulary `vocab` says) after the mask, the
/// bias and the penalties, given each row's generated-token counts and prompt presence over
/// the whole vocabulary (`[rows, vocab]` f32 each).
pub fn adjust(
    logits: &Tensor,
    counts: &Tensor,
    prompt: &Tensor,
    p: &LogitInputs<'_>,
    vocab: &VocabSlice,
) -> Result<Tensor> {
    let rows = logits.dim(0);
    let ids = vocab.lookup_ids(logits)?;
    let allowed = allowed_tokens(p.allowed, &ids)?;
    let l = allowed.where_cond(logits, &logits.full_like(f64::NEG_INFINITY)?)?;
    let bias = dense_bias(p.bias_index, p.bias_values, rows, counts.dim(1))?;
    let l = l.add(&vocab.columns(&bias, logits)?)?;
    let (counts, prompt) = (
        vocab.columns(counts, logits)?,
        vocab.columns(prompt, logits)?,
    );
    let zero = l.full_like(0.0)?;
    let generated = counts.gt(&zero)?;
    let seen = generated.where_cond(&generated, &prompt.gt(&zero)?)?;
    let r = p.repetition.unsqueeze(1)?.broadcast_as(l.shape().clone())?;
    let penalised = l.gt(&zero)?.where_cond(&l.div(&r)?, &l.mul(&r)?)?;
    let l = seen.where_cond(&penalised, &l)?;
    let freq = counts.broadcast_mul(&p.frequency.unsqueeze(1)?)?;
    let pres = generated
        .where_cond(&l.full_like(1.0)?, &zero)?
        .broadcast_mul(&p.presence.unsqueeze(1)?)?;
    l.sub(&freq)?.sub(&pres)
}

/// `ids` (`[n]` i32) one-hot over the vocabulary, `[n, vocab]` f32.
pub(crate) fn one_hot(ids: &Tensor, vocab: usize) -> Result<Tensor> {
    let b = ids.builder();
    let n = ids.dim(0);
    let v = b.iota([n, vocab], DType::I32, 1)?;
    let hit = v.eq(&ids.unsqueeze(1)?.broadcast_as([n, vocab])?)?;
    hit.where_cond(
        &v.full_like(1.0)?.to_dtype(DType::F32)?,
        &v.full_like(0.0)?.to_dtype(DType::F32)?,
    )
}

/// A decode step's state: each row feeds one generated token. Returns the updated root and the
/// rows' counts and prompt presence after it.
pub fn decode_state(
    root: &Tensor,
    rows: &Tensor,
    input_ids: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let vocab = root.dim(1) / 2;
    let old = root.index_select(rows, 0)?;
    let counts = old.narrow(1, 0, vocab)?.add(&one_hot(input_ids, vocab)?)?;
    let prompt = old.narrow(1, vocab, vocab)?;
    let new = root.builder().cat(&[&counts, &prompt], 1)?;
    Ok((root.scatter_rows(rows, 0, &new)?, counts, prompt))
}

/// A prefill step's state: chunk `c` (state row `rows[c]`, prompt length `prompt_lens[c]`)
/// feeds the tokens `i` with `member[c, i]`; those at or past its prompt length are generated.
/// A chunk fed from position 0 starts its row afresh. Returns the updated root and each
/// chunk's counts and prompt presence after it (`[chunks, vocab]`).
pub fn prefill_state(
    root: &Tensor,
    rows: &Tensor,
    member: &Tensor,
    positions: &Tensor,
    prompt_lens: &Tensor,
    input_ids: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let vocab = root.dim(1) / 2;
    let (chunks, t) = (member.dim(0), member.dim(1));
    let pos = positions.unsqueeze(0)?.broadcast_as([chunks, t])?;
    let plen = prompt_lens.unsqueeze(1)?.broadcast_as([chunks, t])?;
    let f32_of = |mask: &Tensor| -> Result<Tensor> {
        let one = pos.full_like(1.0)?.to_dtype(DType::F32)?;
        mask.where_cond(&one, &one.full_like(0.0)?)
    };
    let generated = member.where_cond(&pos.ge(&plen)?, member)?;
    let in_prompt = member.where_cond(&pos.lt(&plen)?, member)?;
    let hot = one_hot(input_ids, vocab)?; // [t, vocab]
    let add_counts = f32_of(&generated)?.matmul(&hot)?;
    let add_prompt = f32_of(&in_prompt)?.matmul(&hot)?;
    // A chunk whose first fed position is 0 starts its sequence: its old row is stale.
    let far = pos.full_like(i32::MAX as f64)?;
    let first = member.where_cond(&pos, &far)?.min(1)?;
    let fresh = first
        .eq(&first.full_like(0.0)?)?
        .unsqueeze(1)?
        .broadcast_as([chunks, 2 * vocab])?;
    let old = root.index_select(rows, 0)?;
    let old = fresh.where_cond(&old.full_like(0.0)?, &old)?;
    let counts = old.narrow(1, 0, vocab)?.add(&add_counts)?;
    let prompt = old
        .narrow(1, vocab, vocab)?
        .maximum(&add_prompt.minimum(&add_prompt.full_like(1.0)?)?)?;
    let new = root.builder().cat(&[&counts, &prompt], 1)?;
    Ok((root.scatter_rows(rows, 0, &new)?, counts, prompt))
}
