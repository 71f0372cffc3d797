//! Sampling inside the graph: greedy, temperature, top-k and top-p, with per-row parameters and a
//! per-row seed.
//!
//! Randomness comes from a counter-based generator: the uniform for row `r`, vocabulary entry `i`
//! is a hash of (seed, position, i). It needs no state between steps, gives the same draw for the
//! same (seed, position) whatever the batch, and is plain integer HLO (multiply, xor, shift), so
//! the CPU and Neuron draw the same tokens. A token is drawn by the Gumbel-max trick:
//! `argmax(z + g)` with `g = -ln(-ln(u))` samples from `softmax(z)`, with no sort and no cumsum
//! over the vocabulary.
//!
//! top-k and top-p become one threshold on the scaled logits, found among the
//! [`MAX_CANDIDATES`] best tokens (a sort of the whole vocabulary is slow to compile and run on
//! Neuron; NxD Inference uses the same global top-k cap). Exact for `top_k <= MAX_CANDIDATES` and
//! for nuclei of at most that many tokens; a larger nucleus is cut to the candidates. With
//! neither set, sampling is over the whole vocabulary. Rows with `temperature <= 0` are greedy.

use crate::error::Result;
use crate::graph::{DType, Literal, Tensor};

/// How many best tokens the top-k/top-p threshold is searched among.
pub const MAX_CANDIDATES: usize = 256;

/// Per-row sampling parameters, each `[b]`.
pub struct SamplingInputs<'a> {
    /// Temperature (f32); `<= 0` means greedy.
    pub temperature: &'a Tensor,
    /// top-k (i32); `<= 0` means off.
    pub top_k: &'a Tensor,
    /// top-p (f32); `>= 1` means off.
    pub top_p: &'a Tensor,
    /// Seed (u32).
    pub seeds: &'a Tensor,
    /// The position of the row's input token (i32): the generator's counter.
    pub positions: &'a Tensor,
}

/// murmur3's 32-bit finalizer: a bijective mix with good avalanche.
fn fmix32(x: &Tensor) -> Result<Tensor> {
    let c = |v: u32| x.full_like(v as f64);
    let mut h = x.bitxor(&x.shr(&c(16)?)?)?;
    h = h.mul(&c(0x85eb_ca6b)?)?;
    h = h.bitxor(&h.shr(&c(13)?)?)?;
    h = h.mul(&c(0xc2b2_ae35)?)?;
    h.bitxor(&h.shr(&c(16)?)?)
}

/// Uniforms in (0, 1), `[b, n]`, from each row's seed and position.
pub fn uniform(seeds: &Tensor, positions: &Tensor, n: usize) -> Result<Tensor> {
    let b = seeds.builder();
    let rows = seeds.dim(0);
    let pos = positions.to_dtype(DType::U32)?;
    let key = fmix32(&seeds.bitxor(&fmix32(&pos.add(&pos.full_like(0x9e37_79b9u32 as f64)?)?)?)?)?;
    let idx = b.iota([rows, n], DType::I32, 1)?.to_dtype(DType::U32)?;
    let golden = idx.full_like(0x27d4_eb2fu32 as f64)?;
    let x = fmix32(
        &key.unsqueeze(1)?
            .broadcast_as([rows, n])?
            .bitxor(&idx.mul(&golden)?)?,
    )?;
    // 24 random bits, centred in their interval so 0 and 1 are never produced.
    let bits = x.shr(&x.full_like(8.0)?)?.to_dtype(DType::F32)?;
    bits.affine(1.0 / (1u32 << 24) as f64, 0.5 / (1u32 << 24) as f64)
}

/// The next token of each row (`[b]`, i32) from its logits (`[b, vocab]`, f32).
pub fn sample(logits: &Tensor, p: &SamplingInputs<'_>) -> Result<Tensor> {
    let b = logits.builder();
    let (rows, vocab) = (logits.dim(0), logits.dim(1));
    let greedy = logits.argmax(1)?;

    let zero = p.temperature.full_like(0.0)?;
    let sampling = p.temperature.gt(&zero)?;
    let temp = sampling.where_cond(p.temperature, &p.temperature.full_like(1.0)?)?;
    let z = logits.broadcast_div(&temp.unsqueeze(1)?)?;

    // Candidates: the best tokens, best first, with their probabilities under softmax(z).
    let k = MAX_CANDIDATES.min(vocab);
    let cand = z.topk(k)?;
    let cand_z = z.gather(&cand, 1)?;
    let zmax = cand_z.narrow(1, 0, 1)?;
    let denom = z.broadcast_sub(&zmax)?.exp()?.sum_keepdim(1)?;
    let cand_p = cand_z.broadcast_sub(&zmax)?.exp()?.broadcast_div(&denom)?;
    // Probability mass strictly before each candidate: a product with a strictly upper
    // triangular matrix of ones.
    let tri: Vec<f32> = (0..k * k)
        .map(|i| if i / k < i % k { 1.0 } else { 0.0 })
        .collect();
    let before = cand_p.matmul(&b.constant(Literal::F32(tri), [k, k])?)?;

    let rank = b.iota([rows, k], DType::I32, 1)?;
    let top_k_on = p.top_k.gt(&p.top_k.full_like(0.0)?)?;
    let top_p_on = p.top_p.lt(&p.top_p.full_like(1.0)?)?;
    let k_eff = top_k_on.where_cond(p.top_k, &p.top_k.full_like(k as f64)?)?;
    let p_eff = top_p_on.where_cond(p.top_p, &p.top_p.full_like(2.0)?)?;
    let within_k = rank.lt(&k_eff.unsqueeze(1)?)?;
    let within_p = before.lt(&p_eff.unsqueeze(1)?)?;
    let first = rank.eq(&rank.full_like(0.0)?)?;
    let both = within_k.where_cond(&within_p.to_dtype(DType::F32)?, &cand_p.full_like(0.0)?)?;
    let kept = first.where_cond(&cand_p.full_like(1.0)?, &both)?;
    let kept = kept.gt(&kept.full_like(0.5)?)?;
    let inf = cand_z.full_like(f64::INFINITY)?;
    let cut = kept.where_cond(&cand_z, &inf)?.min(1)?; // smallest kept candidate
    let restricted =
        top_p_on.where_cond(&p.top_p.full_like(1.0)?, &top_k_on.to_dtype(DType::F32)?)?;
    let restricted = restricted.gt(&restricted.full_like(0.5)?)?;
    let threshold = restricted.where_cond(&cut, &cut.full_like(f64::NEG_INFINITY)?)?;
    let allowed = z.ge(&threshold.unsqueeze(1)?)?;
    let masked = allowed.where_cond(&z, &z.full_like(f64::NEG_INFINITY)?)?;

    let u = uniform(p.seeds, p.positions, vocab)?;
    let gumbel = u.log()?.neg()?.log()?.neg()?;
    let drawn = masked.add(&gumbel)?.argmax(1)?;
    sampling.where_cond(&drawn, &greedy)
}
