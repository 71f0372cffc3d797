//! Which part of the vocabulary a graph's logits cover, and the row reductions the sampler
//! needs over the whole vocabulary when they cover one rank's slice.
//!
//! Split by vocabulary (`--tp N`), each rank's LM head computes the logits of `vocab / N`
//! consecutive tokens (rounded up: the last slice may end in padding, see [`VocabSlice`]). Gathering every rank's slice before sampling moves `[rows, vocab]` f32
//! through a collective each step (33 MB at batch 64 for V3's 129,280 tokens) and makes every
//! rank repeat the whole sampler over the whole vocabulary. Instead each rank adjusts and
//! filters its own slice, and only per-row figures cross ranks:
//!
//! - a maximum or a sum: one all-reduce of `[rows]`;
//! - the argmax: the maximum, then the lowest index holding it (an all-reduce of negated
//!   indices), which is what a whole-row argmax returns;
//! - a mass threshold (top-k's and top-p's cuts, see [`crate::graph::Op::MassThreshold`]): the
//!   threshold's order-preserving key ([`crate::graph::order_key`]) is found 4 bits at a time,
//!   from the top. Each round tries the 15 keys that extend the prefix so far by one more digit,
//!   sums the rank's mass at or above each (`[rows, 15]`), all-reduces those sums, and keeps the
//!   largest digit whose mass reaches the target. The mass only falls as the key grows, so this
//!   is the bit-at-a-time bisection of the unsplit op, 8 collectives instead of 32, and it finds
//!   the same threshold: the masses agree up to the order of summation.
//! - the draw (the first token, in vocabulary order, whose running mass reaches `u * total`): the
//!   ranks' kept masses are all-gathered (`[rows, N]`), each rank searches its own slice for what
//!   is left of the target after the ranks before it, and an all-reduce keeps the lowest token
//!   found.
//!
//! A step then crosses ranks 23 times with at most `[rows, 15]` f32, against one gather of
//! `[rows, vocab]`; the logits themselves never cross ranks (a graph that returns them returns
//! each rank's slice).

use crate::error::Result;
use crate::graph::{order_key, DType, Literal, ReduceOp, Tensor};

/// Bits of the threshold key found per round of the split search.
const DIGIT_BITS: u32 = 4;

/// The keys a round tries: every nonzero digit.
const DIGITS: usize = (1 << DIGIT_BITS) - 1;

/// The part of the vocabulary a graph's `[rows, n]` logits cover.
#[derive(Clone)]
pub enum VocabSlice {
    /// All of it: every reduction is local.
    Whole,
    /// One of `ranks` equal consecutive slices; `first` (`[1]` i32) is its first token id.
    /// When `ranks` does not divide `vocab`, the slices together are wider than the vocabulary
    /// and the last one ends in padding columns (see [`crate::model::shard`]).
    Shard {
        /// The ranks the vocabulary is split over.
        ranks: usize,
        /// The slice's first token id.
        first: Tensor,
        /// The whole vocabulary's size (the model's `vocab_size`).
        vocab: usize,
    },
}

impl VocabSlice {
    /// The whole vocabulary's size, for logits `n` columns wide.
    pub fn vocab(&self, n: usize) -> usize {
        match self {
            VocabSlice::Whole => n,
            VocabSlice::Shard { vocab, .. } => *vocab,
        }
    }

    /// Whether slices `n` columns wide hold padding past the vocabulary's last token.
    fn padded(&self, n: usize) -> bool {
        matches!(self, VocabSlice::Shard { ranks, vocab, .. } if n * ranks > *vocab)
    }

    /// The token id of each column of `[rows, n]` logits, as `[rows, n]` i32 (a padding
    /// column's id is past the vocabulary).
    pub fn token_ids(&self, like: &Tensor) -> Result<Tensor> {
        let ids = like.builder().iota(like.shape().clone(), DType::I32, 1)?;
        match self {
            VocabSlice::Whole => Ok(ids),
            VocabSlice::Shard { first, .. } => ids.broadcast_add(first),
        }
    }

    /// [`Self::token_ids`] with a padding column's id replaced by the last token's, for looking
    /// up per-token inputs `vocab` wide (the padding's logits are `-inf` whatever it finds).
    pub fn lookup_ids(&self, like: &Tensor) -> Result<Tensor> {
        let ids = self.token_ids(like)?;
        if !self.padded(like.dim(1)) {
            return Ok(ids);
        }
        let last = ids.full_like((self.vocab(like.dim(1)) - 1) as f64)?;
        ids.minimum(&last)
    }

    /// `logits` (`[rows, n]`, this slice's) with a padding column's logit set to `-inf`, so that
    /// no sampler, argmax or mass ever counts it; unchanged when there is no padding.
    pub fn mask_padding(&self, logits: &Tensor) -> Result<Tensor> {
        let n = logits.dim(1);
        if !self.padded(n) {
            return Ok(logits.clone());
        }
        let ids = self.token_ids(logits)?;
        let real = ids.lt(&ids.full_like(self.vocab(n) as f64)?)?;
        real.where_cond(logits, &logits.full_like(f64::NEG_INFINITY)?)
    }

    /// This slice's columns of `whole` (`[rows, vocab]`), as `[rows, n]` like `like` (a padding
    /// column takes the last token's value).
    pub fn columns(&self, whole: &Tensor, like: &Tensor) -> Result<Tensor> {
        match self {
            VocabSlice::Whole => Ok(whole.clone()),
            VocabSlice::Shard { .. } => whole.gather(&self.lookup_ids(like)?, 1),
        }
    }

    /// Each row's maximum (`[rows]`).
    pub fn row_max(&self, x: &Tensor) -> Result<Tensor> {
        self.across(x.max(1)?, ReduceOp::Max)
    }

    /// Each row's sum (`[rows]`); split, the ranks' sums are added in rank order.
    pub fn row_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.across(x.sum(1)?, ReduceOp::Sum)
    }

    fn across(&self, local: Tensor, op: ReduceOp) -> Result<Tensor> {
        match self {
            VocabSlice::Whole => Ok(local),
            VocabSlice::Shard { ranks, .. } => local.all_reduce(op, *ranks),
        }
    }

    /// Each row's argmax (`[rows]` i32): the lowest token id holding the row's maximum.
    pub fn argmax(&self, x: &Tensor) -> Result<Tensor> {
        let local = x.argmax(1)?;
        let VocabSlice::Shard { first, .. } = self else {
            return Ok(local);
        };
        let local_max = x.max(1)?;
        let best = self.row_max(x)?;
        let id = local.broadcast_add(first)?.to_dtype(DType::F32)?;
        let claim = local_max
            .eq(&best)?
            .where_cond(&id.neg()?, &id.full_like(f64::NEG_INFINITY)?)?;
        self.row_max(&claim.unsqueeze(1)?)?
            .neg()?
            .to_dtype(DType::I32)
    }

    /// Per row, the largest value `t` of `x` whose mass under the weights `w`
    /// (`sum(w[i] for x[i] >= t)` over the whole vocabulary) reaches `target` (`[rows]`):
    /// [`Tensor::mass_threshold`] over the whole row.
    pub fn mass_threshold(&self, x: &Tensor, w: &Tensor, target: &Tensor) -> Result<Tensor> {
        let VocabSlice::Shard { ranks, .. } = self else {
            return x.mass_threshold(w, target);
        };
        let b = x.builder();
        let (rows, n) = (x.dim(0), x.dim(1));
        let wide = [rows, DIGITS, n];
        let xs = x.unsqueeze(1)?.broadcast_as(wide)?;
        let ws = w.unsqueeze(1)?.broadcast_as(wide)?;
        let none = ws.full_like(0.0)?;
        let target = target.unsqueeze(1)?.broadcast_as([rows, DIGITS])?;
        let digits = b
            .constant(Literal::U32((1..=DIGITS as u32).collect()), [DIGITS])?
            .unsqueeze(0)?
            .broadcast_as([rows, DIGITS])?;
        let mut key = b.full(0.0, [rows], DType::U32)?;
        for round in 1..=32 / DIGIT_BITS {
            let shift = digits.full_like(f64::from(32 - round * DIGIT_BITS))?;
            let tries = key
                .unsqueeze(1)?
                .broadcast_as([rows, DIGITS])?
                .bitxor(&digits.shl(&shift)?)?;
            let t = order_key::key_value(&tries)?
                .unsqueeze(2)?
                .broadcast_as(wide)?;
            let mass = xs
                .ge(&t)?
                .where_cond(&ws, &none)?
                .sum(2)?
                .all_reduce(ReduceOp::Sum, *ranks)?;
            let reached = mass.ge(&target)?;
            let digit = reached
                .where_cond(&mass.full_like(1.0)?, &mass.full_like(0.0)?)?
                .sum(1)?
                .to_dtype(DType::U32)?;
            key = key.bitxor(&digit.shl(&key.full_like(f64::from(32 - round * DIGIT_BITS))?)?)?;
        }
        order_key::key_value(&key)
    }

    /// Per row, the negated lowest token id (f32) whose running mass of `kept` (`[rows, n]`, in
    /// vocabulary order over the whole row) reaches `target` (`[rows]`); `-inf` where even the
    /// whole row falls short. A target `<= 0` gives `+inf` on the whole vocabulary and `-inf` on
    /// a slice; the sampler asks only for positive targets.
    pub fn draw(&self, kept: &Tensor, target: &Tensor) -> Result<Tensor> {
        let neg_id = self.token_ids(kept)?.to_dtype(DType::F32)?.neg()?;
        let VocabSlice::Shard { ranks, first, .. } = self else {
            // The largest -id whose mass at or above (the tokens up to it) reaches the target.
            return neg_id.mass_threshold(kept, target);
        };
        let b = kept.builder();
        let (rows, n) = (kept.dim(0), kept.dim(1));
        // What the ranks before this one hold, from every rank's kept mass in rank order.
        let masses = kept.sum(1)?.unsqueeze(1)?.all_gather(1, *ranks)?;
        let firsts = b
            .iota([rows, *ranks], DType::F32, 1)?
            .affine(n as f64, 0.0)?;
        let before = firsts
            .lt(&first.to_dtype(DType::F32)?)?
            .where_cond(&masses, &masses.full_like(0.0)?)?
            .sum(1)?;
        let rest = target.sub(&before)?;
        let found = neg_id.mass_threshold(kept, &rest)?;
        let mine = rest.gt(&rest.full_like(0.0)?)?;
        let claim = mine.where_cond(&found, &found.full_like(f64::NEG_INFINITY)?)?;
        self.row_max(&claim.unsqueeze(1)?)
    }
}
