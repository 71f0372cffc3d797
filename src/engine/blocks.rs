//! The paged KV cache's bookkeeping: which blocks of the root each sequence owns.
//!
//! The root is one `[blocks * block_size, layers * width]` tensor (see `model`); a slot is a row.
//! Block [`SCRATCH_BLOCK`] is reserved: padding rows and padding tokens write there, so a padded
//! batch never touches a live sequence's slots. Nothing here touches tensor data.
//!
//! The scheduler owns the allocator, as vLLM's scheduler owns its block manager: the runner
//! only executes steps over the block tables it is handed, and never decides who gets a block.

use crate::error::{Error, Result};
use crate::runner::step::SCRATCH_BLOCK;

/// Hands out the cache's blocks; block 0 is never handed out.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    num_blocks: usize,
    free: Vec<u32>,
}

impl BlockAllocator {
    /// An allocator over `num_blocks` blocks of `block_size` slots (at least two blocks: the
    /// scratch block and one usable).
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
        })
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache, scratch included.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks not in use.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` so that it holds `tokens` tokens; on failure nothing is allocated.
    pub fn grow(&mut self, table: &mut Vec<u32>, tokens: usize) -> Result<()> {
        let need = self.blocks_for(tokens).saturating_sub(table.len());
        if need > self.free.len() {
            return Err(Error::OutOfBlocks(format!(
                "{need} more blocks needed for {tokens} tokens, {} free",
                self.free.len()
            )));
        }
        for _ in 0..need {
            if let Some(b) = self.free.pop() {
                table.push(b);
            }
        }
        Ok(())
    }

    /// Returns a sequence's blocks.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            debug_assert!(b != SCRATCH_BLOCK && !self.free.contains(&b));
            self.free.push(b);
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
