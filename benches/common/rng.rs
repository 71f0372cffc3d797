//! The benches' seeded token choices: SplitMix64 (Steele, Lea and Flood, "Fast splittable
//! pseudorandom number generators", 2014), so that a bench draws the same tokens on every run
//! and machine (its figures reproduce) while its rows and steps get different tokens, as real
//! decoding's do (a batch of one repeated token routes every row to the same experts). Not a
//! statistical generator beyond that; the crate has no `rand` dependency to use instead.

/// A SplitMix64 stream.
pub struct Rng(u64);

impl Rng {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0): the top 32 bits scaled by `n` (bias under 2^-32 per value).
    pub fn below(&mut self, n: u32) -> u32 {
        (((self.next_u64() >> 32) * n as u64) >> 32) as u32
    }
}
