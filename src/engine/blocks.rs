//! The paged KV cache's bookkeeping: which blocks of the roots each sequence owns, and which
//! full blocks are kept for reuse by later requests with the same prefix.
//!
//! The roots are `[blocks * block_size, ...]` tensors (see `model::cache_roots`); a slot is a
//! row. Block [`SCRATCH_BLOCK`] is reserved: padding rows and padding tokens write there, so a
//! padded batch never touches a live sequence's slots. Nothing here touches tensor data.
//!
//! The scheduler owns the allocator, as vLLM's scheduler owns its block manager: the runner
//! only executes steps over the block tables it is handed, and never decides who gets a block.
//!
//! # Prefix caching
//!
//! A block whose `block_size` tokens are all in the cache is identified by a hash of its
//! parent block's hash (the block before it in the sequence; a fixed seed for the first) and
//! its token ids, so equal hashes mean equal prefixes up to and including the block. Nothing
//! else changes a block's contents: the model, the cache dtype and the positions (a block's
//! index in its sequence) are fixed for the allocator's lifetime, and there are no adapters or
//! images. [`BlockAllocator::register`] records the full blocks of a sequence once a step has
//! written them; [`BlockAllocator::match_prefix`] hands a new sequence the longest run of
//! cached blocks its tokens begin with, each now shared (reference-counted). A shared block is
//! never written again: only full blocks are shared, and a sequence always computes at least
//! its last token itself. A block whose last reference goes keeps its contents and its hash,
//! free but *evictable*: it is reused as it is by a later match, or, when no plain free block
//! is left, given out for new contents, least recently released first. A hit is checked
//! against the block's token ids and parent hash, so a 64-bit hash collision cannot hand out
//! another prefix's cache.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::error::{Error, Result};
use crate::runner::step::SCRATCH_BLOCK;

/// The parent hash of a sequence's first block.
const ROOT_HASH: u64 = 0x6465_6570_696e_6672; // "deepinfr"

/// The hash of a full block: its parent's hash and its tokens.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a cached block holds, to confirm a hash hit.
#[derive(Debug, Clone)]
struct CachedBlock {
    hash: u64,
    parent: u64,
    tokens: Vec<u32>,
}

/// Prefix-cache counters, in tokens (vLLM's `prefix_cache_queries` / `prefix_cache_hits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
}

/// Hands out the cache's blocks; block 0 is never handed out.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    num_blocks: usize,
    /// Blocks with no reference and no cached contents.
    free: Vec<u32>,
    /// References to each block (sequences whose tables hold it).
    refs: Vec<u32>,
    /// Whether full blocks are kept for reuse.
    caching: bool,
    /// Each block's cached contents, if registered.
    cached: Vec<Option<CachedBlock>>,
    /// Registered blocks by hash.
    by_hash: HashMap<u64, u32>,
    /// Unreferenced registered blocks by release time, oldest first: evicted in that order.
    evictable: BTreeMap<u64, u32>,
    /// Each evictable block's key in `evictable`.
    released_at: Vec<u64>,
    clock: u64,
    stats: PrefixCacheStats,
}

impl BlockAllocator {
    /// An allocator over `num_blocks` blocks of `block_size` slots (at least two blocks: the
    /// scratch block and one usable), without prefix caching.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if num_blocks < 2 || block_size == 0 {
            return Err(Error::InvalidInput(format!(
                "a KV cache needs a block size > 0 and at least 2 blocks (got {num_blocks} of {block_size})"
            )));
        }
        // Lowest ids first.
        let free = (1..num_blocks as u32).rev().collect();
        Ok(BlockAllocator {
            block_size,
            num_blocks,
            free,
            refs: vec![0; num_blocks],
            caching: false,
            cached: vec![None; num_blocks],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            clock: 0,
            stats: PrefixCacheStats::default(),
        })
    }

    /// [`BlockAllocator::new`] keeping full blocks for reuse (see the module docs).
    pub fn with_prefix_caching(num_blocks: usize, block_size: usize) -> Result<Self> {
        let mut a = Self::new(num_blocks, block_size)?;
        a.caching = true;
        Ok(a)
    }

    /// Whether full blocks are kept for reuse.
    pub fn prefix_caching(&self) -> bool {
        self.caching
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache, scratch included.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks no sequence holds (cached ones included: they are given out when needed).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Unreferenced blocks whose cached contents a later request may reuse.
    pub fn num_cached_free(&self) -> usize {
        self.evictable.len()
    }

    /// The prefix cache's counters so far.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// References to `block` (for tests and metrics).
    pub fn refs(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// A block for new contents: a plain free one, else the least recently released cached
    /// one, forgotten.
    fn take(&mut self) -> Option<u32> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        let (_, b) = self.evictable.pop_first()?;
        if let Some(c) = self.cached[b as usize].take() {
            self.by_hash.remove(&c.hash);
        }
        Some(b)
    }

    /// Grows `table` so that it holds `tokens` tokens; on failure nothing is allocated.
    pub fn grow(&mut self, table: &mut Vec<u32>, tokens: usize) -> Result<()> {
        let need = self.blocks_for(tokens).saturating_sub(table.len());
        if need > self.num_free() {
            return Err(Error::OutOfBlocks(format!(
                "{need} more blocks needed for {tokens} tokens, {} free",
                self.num_free()
            )));
        }
        for _ in 0..need {
            if let Some(b) = self.take() {
                self.refs[b as usize] = 1;
                table.push(b);
            }
        }
        Ok(())
    }

    /// Returns a sequence's blocks: each loses a reference, and one that has none left is free
    /// (kept evictable when its contents are cached).
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            debug_assert!(b != SCRATCH_BLOCK && self.refs[b as usize] > 0);
            let r = &mut self.refs[b as usize];
            *r = r.saturating_sub(1);
            if *r > 0 {
                continue;
            }
            if self.cached[b as usize].is_some() {
                self.clock += 1;
                self.released_at[b as usize] = self.clock;
                self.evictable.insert(self.clock, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Counts a lookup that admitted a sequence: `queried` tokens, `hit` of them cached.
    pub fn record_lookup(&mut self, queried: usize, hit: usize) {
        self.stats.queries += queried as u64;
        self.stats.hits += hit as u64;
    }

    /// The longest run of cached blocks `tokens` begins with, at most `max_blocks` of them,
    /// each given one more reference, with their hashes (the sequence's chain so far). Nothing
    /// without caching.
    pub fn match_prefix(&mut self, tokens: &[u32], max_blocks: usize) -> (Vec<u32>, Vec<u64>) {
        let (mut blocks, mut hashes) = (Vec::new(), Vec::new());
        if !self.caching {
            return (blocks, hashes);
        }
        let mut parent = ROOT_HASH;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let hash = block_hash(parent, chunk);
            let Some(&b) = self.by_hash.get(&hash) else {
                break;
            };
            let same = self.cached[b as usize]
                .as_ref()
                .is_some_and(|c| c.parent == parent && c.tokens == chunk);
            if !same {
                break;
            }
            if self.refs[b as usize] == 0 {
                self.evictable.remove(&self.released_at[b as usize]);
            }
            self.refs[b as usize] += 1;
            blocks.push(b);
            hashes.push(hash);
            parent = hash;
        }
        (blocks, hashes)
    }

    /// Records the full blocks of a sequence (block table `table`, whose first `tokens.len()`
    /// tokens are in the cache) beyond the `hashes` already recorded, extending `hashes`. A
    /// block whose contents another block already caches stays unregistered (freed when
    /// released). Nothing without caching.
    pub fn register(&mut self, table: &[u32], tokens: &[u32], hashes: &mut Vec<u64>) {
        if !self.caching {
            return;
        }
        let full = (tokens.len() / self.block_size).min(table.len());
        for k in hashes.len()..full {
            let parent = hashes.last().copied().unwrap_or(ROOT_HASH);
            let chunk = &tokens[k * self.block_size..(k + 1) * self.block_size];
            let hash = block_hash(parent, chunk);
            hashes.push(hash);
            let b = table[k];
            if self.by_hash.contains_key(&hash) || self.cached[b as usize].is_some() {
                continue;
            }
            self.by_hash.insert(hash, b);
            self.cached[b as usize] = Some(CachedBlock {
                hash,
                parent,
                tokens: chunk.to_vec(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::step::slot;

    #[test]
    fn never_hands_out_scratch_and_fails_cleanly() {
        let mut a = BlockAllocator::new(3, 4).unwrap();
        let mut t = Vec::new();
        a.grow(&mut t, 5).unwrap();
        assert_eq!(t, vec![1, 2]);
        assert_eq!(slot(&t, 4, 5).unwrap(), 9);
        let mut u = Vec::new();
        assert!(a.grow(&mut u, 1).is_err());
        assert!(u.is_empty());
        a.release(&mut t);
        assert_eq!(a.num_free(), 2);
    }
}

#[cfg(test)]
mod prefix_tests {
    use super::*;

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn shared_blocks_are_counted_and_freed_once() {
        let mut a = BlockAllocator::with_prefix_caching(9, 4).unwrap();
        let prompt = tokens(10, 1); // two full blocks and two tokens
        let (mut t1, mut h1) = (Vec::new(), Vec::new());
        a.grow(&mut t1, prompt.len()).unwrap();
        a.register(&t1, &prompt, &mut h1);
        assert_eq!(h1.len(), 2);
        // The same prompt again shares both full blocks, at most (10 - 1) / 4 = 2.
        let (mut t2, h2) = a.match_prefix(&prompt, (prompt.len() - 1) / 4);
        assert_eq!((t2.clone(), h2.clone()), (t1[..2].to_vec(), h1.clone()));
        a.record_lookup(prompt.len(), 8);
        assert_eq!((a.refs(t1[0]), a.refs(t1[1]), a.refs(t1[2])), (2, 2, 1));
        a.grow(&mut t2, prompt.len()).unwrap();
        assert_ne!(t2[2], t1[2]);
        assert_eq!(a.num_free(), 8 - 4);
        a.release(&mut t1);
        assert_eq!(a.num_free(), 8 - 3); // t1's own third block
        a.release(&mut t2);
        assert_eq!(a.num_free(), 8);
        assert_eq!(a.num_cached_free(), 2);
        assert_eq!(
            a.prefix_cache_stats(),
            PrefixCacheStats {
                queries: 10,
                hits: 8
            }
        );
        // A different second block matches only the first.
        let mut other = prompt.clone();
        other[5] += 1;
        let (t3, _) = a.match_prefix(&other, 2);
        assert_eq!(t3, vec![h_block(&a, &prompt)]);
    }

    fn h_block(a: &BlockAllocator, prompt: &[u32]) -> u32 {
        a.by_hash[&block_hash(ROOT_HASH, &prompt[..a.block_size])]
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_released_first() {
        let mut a = BlockAllocator::with_prefix_caching(4, 2).unwrap(); // 3 usable
        let (p, q) = (tokens(2, 1), tokens(2, 2));
        for prompt in [&p, &q] {
            let (mut t, mut h) = (Vec::new(), Vec::new());
            a.grow(&mut t, 2).unwrap();
            a.register(&t, prompt, &mut h);
            a.release(&mut t);
        }
        assert_eq!((a.num_free(), a.num_cached_free()), (3, 2));
        // Two new blocks: the plain free one, then p's (released first).
        let mut t = Vec::new();
        a.grow(&mut t, 4).unwrap();
        assert_eq!(a.num_cached_free(), 1);
        assert!(a.match_prefix(&p, 1).0.is_empty());
        assert_eq!(a.match_prefix(&q, 1).0.len(), 1);
        // Without caching nothing is kept or matched.
        let mut b = BlockAllocator::new(4, 2).unwrap();
        let (mut t, mut h) = (Vec::new(), Vec::new());
        b.grow(&mut t, 2).unwrap();
        b.register(&t, &p, &mut h);
        b.release(&mut t);
        assert!(b.match_prefix(&p, 1).0.is_empty());
        assert_eq!(b.prefix_cache_stats(), PrefixCacheStats::default());
    }
}
