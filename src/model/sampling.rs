//! Sampling inside the graph: greedy, temperature, top-k and top-p, with per-row parameters and a
//! per-row seed, exact for every `top_k` and `top_p`.
//!
//! A sampled row keeps the tokens whose scaled logit `z` is at or above one cut, then draws one
//! of them by inverse CDF with one uniform number:
//!
//! 1. **top-k** keeps `z >= ` the k-th largest `z` (tokens tied with it stay, as in vLLM).
//! 2. **top-p**, on what top-k kept and renormalised (the order of HF's and vLLM's warpers),
//!    keeps the smallest set of best tokens whose probability reaches `top_p`: `z >=` the
//!    largest value whose mass at or above reaches `top_p` of the kept mass.
//! 3. **The draw** is the first token, in vocabulary order, whose running mass reaches
//!    `u * total`: exactly a draw from the renormalised distribution.
//!
//! All three are one op, [`Tensor::mass_threshold`] (the largest value whose weighted mass at
//! or above reaches a target), which needs no sort: a vocabulary-wide sort is what neuronx-cc
//! turns into a top-k it caps at 16,384 (aws-neuron/aws-neuron-sdk issue 1339), and V2-Lite's
//! vocabulary is 102,400. Rows with `temperature <= 0` are a plain argmax.
//!
//! Split by vocabulary over tensor-parallel ranks, the same steps run on each rank's slice,
//! with the row maxima, sums, thresholds and the draw completed across ranks
//! ([`super::vocab`]); every rank draws the same token.
//!
//! The uniform comes from a counter-based generator: a hash of (seed, position), so it needs no
//! state between steps and gives the same draw for the same (seed, position) whatever the
//! batch. The hash is murmur3's 32-bit finalizer, whose u32 multiplies wrap; a NeuronCore's
//! vector engines compute arithmetic in fp32 (NKI `nki.isa.tensor_tensor`), where such a product
//! would lose bits. So the graph multiplies in 11-bit limbs whose products and sums stay below
//! 2^24, in f32, where they are exact on every engine, and reassembles the 32-bit result with
//! shifts, masks and xors; see [`wrapping_mul`]. The result is bit for bit the u32 hash.

use super::vocab::VocabSlice;
use crate::error::Result;
use crate::graph::{DType, Tensor};

/// Per-row sampling parameters, each `[b]`.
pub struct SamplingInputs<'a> {
    /// Temperature (f32); `<= 0` means greedy.
    pub temperature: &'a Tensor,
    /// top-k (i32); `<= 0` (or the vocabulary size and above) means off.
    pub top_k: &'a Tensor,
    /// top-p (f32); `>= 1` means off; `<= 0` keeps the best token only.
    pub top_p: &'a Tensor,
    /// min-p (f32); `<= 0` means off: tokens less likely than `min_p` times the likeliest
    /// (after temperature) are dropped before top-k and top-p, as in vLLM.
    pub min_p: &'a Tensor,
    /// Seed (u32).
    pub seeds: &'a Tensor,
    /// The position of the row's input token (i32): the generator's counter.
    pub positions: &'a Tensor,
}

/// The limbs a u32 is multiplied in: (shift, bits). Products of two limbs stay below 2^22 and
/// the sums [`wrapping_mul`] forms below 2^24.
const LIMBS: [(u32, u32); 3] = [(0, 11), (11, 11), (22, 10)];

/// `x * c` modulo 2^32 for u32 `x`, exact on an engine that computes arithmetic in fp32:
/// with 11-bit limbs `x = x0 + x1·2^11 + x2·2^22` (and `c` alike), the product modulo 2^32 is
/// `x0c0 + (x0c1 + x1c0)·2^11 + (x0c2 + x1c1 + x2c0)·2^22`; each coefficient is below 2^24, so
/// it is formed exactly in f32, and the carries between limbs are taken with shifts and masks.
pub fn wrapping_mul(x: &Tensor, c: u32) -> Result<Tensor> {
    let u = |v: u32| x.full_like(f64::from(v));
    let limb = |t: &Tensor, (shift, bits): (u32, u32)| -> Result<Tensor> {
        t.shr(&u(shift)?)?.bitand(&u((1 << bits) - 1)?)
    };
    let xs = LIMBS
        .iter()
        .map(|&l| limb(x, l)?.to_dtype(DType::F32))
        .collect::<Result<Vec<_>>>()?;
    let cs = LIMBS.map(|(shift, bits)| f64::from((c >> shift) & ((1 << bits) - 1)));
    // Coefficient k of the product: the sum of x_i * c_j over i + j = k.
    let coefficient = |k: usize| -> Result<Tensor> {
        let mut sum = xs[0].affine(cs[k], 0.0)?;
        for i in 1..=k {
            sum = sum.add(&xs[i].affine(cs[k - i], 0.0)?)?;
        }
        Ok(sum)
    };
    let mut out: Option<Tensor> = None;
    let mut carry: Option<Tensor> = None;
    for (k, &(shift, bits)) in LIMBS.iter().enumerate() {
        let mut coef = coefficient(k)?;
        if let Some(c) = &carry {
            coef = coef.add(&c.to_dtype(DType::F32)?)?;
        }
        let coef = coef.to_dtype(DType::U32)?;
        let digit = coef.bitand(&u((1 << bits) - 1)?)?.shl(&u(shift)?)?;
        carry = Some(coef.shr(&u(bits)?)?);
        out = Some(match out {
            None => digit,
            Some(o) => o.bitxor(&digit)?,
        });
    }
    Ok(out.expect("LIMBS is not empty"))
}

/// murmur3's 32-bit finalizer: a bijective mix with good avalanche.
fn fmix32(x: &Tensor) -> Result<Tensor> {
    let c = |v: u32| x.full_like(f64::from(v));
    let mut h = x.bitxor(&x.shr(&c(16)?)?)?;
    h = wrapping_mul(&h, 0x85eb_ca6b)?;
    h = h.bitxor(&h.shr(&c(13)?)?)?;
    h = wrapping_mul(&h, 0xc2b2_ae35)?;
    h.bitxor(&h.shr(&c(16)?)?)
}

/// The generator's 32 random bits for each row (`[b]`, u32):
/// `fmix32(seed ^ fmix32(position ^ 0x9e3779b9))`.
pub fn random_bits(seeds: &Tensor, positions: &Tensor) -> Result<Tensor> {
    let pos = positions.to_dtype(DType::U32)?;
    seeds
        .bitxor(&fmix32(
            &pos.bitxor(&pos.full_like(f64::from(0x9e37_79b9u32))?)?,
        )?)
        .and_then(|k| fmix32(&k))
}

/// One uniform in (0, 1) per row (`[b]`, f32): the top 23 random bits, centred in their
/// interval (`(k + 0.5) / 2^23`, exact in f32), so 0 and 1 are never produced.
pub fn uniform(seeds: &Tensor, positions: &Tensor) -> Result<Tensor> {
    let bits = random_bits(seeds, positions)?;
    let k = bits.shr(&bits.full_like(9.0)?)?.to_dtype(DType::F32)?;
    k.affine(1.0 / f64::from(1u32 << 23), 0.5 / f64::from(1u32 << 23))
}

/// What a sampled row may draw: each row's scaled, filtered probabilities (unnormalised).
struct Kept {
    /// Each row's argmax (`[b]` i32), the token of a greedy row.
    greedy: Tensor,
    /// Which rows sample (`[b]` bool).
    sampling: Tensor,
    /// `exp(z - max z)` of the tokens min-p, top-k and top-p keep, 0 elsewhere (`[b, n]`).
    kept: Tensor,
}

/// Temperature, min-p, top-k and top-p of each row over its logits (see the module docs).
fn keep(logits: &Tensor, p: &SamplingInputs<'_>, vocab: &VocabSlice) -> Result<Kept> {
    let greedy = vocab.argmax(logits)?;

    let zero = p.temperature.full_like(0.0)?;
    let neg_inf = p.temperature.full_like(f64::NEG_INFINITY)?;
    let sampling = p.temperature.gt(&zero)?;
    let temp = sampling.where_cond(p.temperature, &p.temperature.full_like(1.0)?)?;
    let z = logits.broadcast_div(&temp.unsqueeze(1)?)?;
    let z_max = vocab.row_max(&z)?.unsqueeze(1)?; // [b, 1]
    let e = z.broadcast_sub(&z_max)?.exp()?; // softmax(z), unnormalised
    let none = e.full_like(0.0)?;

    // min-p: z at least z_max + ln(min_p) (probability at least min_p times the best's).
    let m_on = p.min_p.gt(&zero)?;
    let safe_min_p = m_on.where_cond(p.min_p, &p.min_p.full_like(1.0)?)?;
    let t_m = z_max.squeeze(1)?.add(&safe_min_p.log()?)?;
    let t_m = m_on.where_cond(&t_m, &neg_inf)?;

    // top-k: the k-th largest z, for 0 < k < vocab, among what min-p kept.
    let k_positive = p.top_k.gt(&p.top_k.full_like(0.0)?)?;
    let whole = vocab.vocab(logits.dim(1)) as f64;
    let k_on = k_positive.where_cond(&p.top_k.lt(&p.top_k.full_like(whole)?)?, &k_positive)?;
    let k_target = k_on.where_cond(&p.top_k.to_dtype(DType::F32)?, &zero)?;
    let t_k = vocab.mass_threshold(&z, &z.full_like(1.0)?, &k_target)?;
    let t_k = k_on.where_cond(&t_k, &neg_inf)?.maximum(&t_m)?;
    let e_k = z.ge(&t_k.unsqueeze(1)?)?.where_cond(&e, &none)?;

    // top-p on what top-k kept: the largest z whose mass at or above reaches top_p of it.
    let p_on = p.top_p.lt(&p.top_p.full_like(1.0)?)?;
    let p_target = p_on.where_cond(&p.top_p.mul(&vocab.row_sum(&e_k)?)?, &zero)?;
    let t_p = vocab.mass_threshold(&z, &e_k, &p_target)?;
    let t_p = p_on.where_cond(&t_p, &neg_inf)?;

    // Both cuts, never above the best token (a top_p <= 0 keeps that one).
    let cut = t_k.maximum(&t_p)?.minimum(&z_max.squeeze(1)?)?;
    let kept = z.ge(&cut.unsqueeze(1)?)?.where_cond(&e, &none)?;
    Ok(Kept {
        greedy,
        sampling,
        kept,
    })
}

/// Each sampled row's draw from `kept` with the uniform `u` (`[b]`): the first token whose
/// running mass reaches `u` times the row's total; a greedy row's (or, should rounding leave
/// `u * total` above the summed mass, any row's) argmax.
fn draw(k: &Kept, kept: &Tensor, u: &Tensor, vocab: &VocabSlice) -> Result<Tensor> {
    let zero = u.full_like(0.0)?;
    let draw_target = k
        .sampling
        .where_cond(&u.mul(&vocab.row_sum(kept)?)?, &zero)?;
    let at = vocab.draw(kept, &draw_target)?;
    let found = at
        .gt(&zero.full_like(f64::NEG_INFINITY)?)?
        .where_cond(&k.sampling, &zero.gt(&zero)?)?;
    let token = found.where_cond(&at, &zero)?.neg()?.to_dtype(DType::I32)?;
    found.where_cond(&token, &k.greedy)
}

/// The next token of each row (`[b]`, i32) from its logits (`[b, n]`, f32), which cover the
/// part of the vocabulary `vocab` says: split by vocabulary, every rank draws the same tokens
/// from its own slice (see [`super::vocab`]).
pub fn sample(logits: &Tensor, p: &SamplingInputs<'_>, vocab: &VocabSlice) -> Result<Tensor> {
    let k = keep(logits, p, vocab)?;
    draw(&k, &k.kept, &uniform(p.seeds, p.positions)?, vocab)
}

/// Xored into a row's seed for the uniform that accepts or rejects its draft, so it is
/// independent of the uniform the row draws with (see [`verify`]).
const ACCEPT_STREAM: u32 = 0x5851_f42d;

/// Speculative decoding's verification of each row's draft (`drafts`, `[b]` i32, negative for
/// a row with none) by rejection sampling: the row's token (`[b]` i32) is distributed exactly as
/// [`sample`]'s, whatever the draft. The drafts come from a greedy draft model, a point mass,
/// so the rule of Leviathan et al. and Chen et al. ("accept with probability `min(1, p/q)`,
/// else draw from `max(0, p - q)` renormalised") becomes: accept the draft `d` with
/// probability `p(d)` (its share of the kept mass), else draw from the kept tokens without `d`.
/// A greedy row's token is its argmax (the draft is accepted when it equals it), and a row
/// without a draft draws as [`sample`] does, with the same uniform.
///
/// A rejected draft is never the row's token, so the caller accepts exactly the drafts equal
/// to the tokens returned.
pub fn verify(
    logits: &Tensor,
    p: &SamplingInputs<'_>,
    drafts: &Tensor,
    vocab: &VocabSlice,
) -> Result<Tensor> {
    let k = keep(logits, p, vocab)?;
    let ids = vocab.lookup_ids(logits)?;
    let (rows, n) = (logits.dim(0), logits.dim(1));
    let is_draft = ids.eq(&drafts.unsqueeze(1)?.broadcast_as([rows, n])?)?;
    let none = k.kept.full_like(0.0)?;
    let draft_mass = vocab.row_sum(&is_draft.where_cond(&k.kept, &none)?)?;
    let total = vocab.row_sum(&k.kept)?;
    let stream = p.seeds.full_like(f64::from(ACCEPT_STREAM))?;
    let u_accept = uniform(&p.seeds.bitxor(&stream)?, p.positions)?;
    // u < p(d), as u * total < mass(d); a row without a draft has mass(d) = 0.
    let accept = u_accept.mul(&total)?.lt(&draft_mass)?;
    let accept = k.sampling.where_cond(&accept, &k.sampling)?;
    let residual = is_draft.where_cond(&none, &k.kept)?;
    let drawn = draw(&k, &residual, &uniform(p.seeds, p.positions)?, vocab)?;
    accept.where_cond(drafts, &drawn)
}
