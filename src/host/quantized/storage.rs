//! The block storage under a [`super::BlockMatrix`]: candle's own storage of one matrix's
//! GGML blocks, behind a wrapper that can let the blocks go once candle has repacked them.
//!
//! candle's x86 kernels multiply most `Q4_K` and `Q8_0` matrices from a copy of the blocks
//! repacked into their own tiles, made on the first product and cached inside the `QTensor`
//! for good; from then on its kernels read only that copy. The `QTensor` still owns the
//! original blocks, and candle offers no way to drop them: a routed-expert model held ~1.9
//! times its file in RAM. candle does let a `QTensor` be built over any implementation of its
//! public [`QuantizedType`] trait, so this one holds candle's storage in a slot that
//! [`ReleasableBlocks::release`] empties. What decides whether that is safe (candle never read
//! the blocks in a product, so it ran on tiles) is recorded here too: every fallback kernel
//! call (the products over the stored blocks) sets [`ReleasableBlocks::read_blocks`].
//!
//! Once released, every method that would read the blocks returns an error (or, for the raw
//! pointer candle's packers read, an empty slice: an index out of bounds inside candle, never a
//! read of freed memory). Nothing in deepinfer calls them on a released matrix: see
//! [`super::BlockMatrix`] for the rows-per-product limit that keeps candle on its tiles.
//!
//! Rejected: a mutex around the slot held across candle's reads. candle takes the raw pointer
//! (`as_ptr`) and reads through it after the call returns; no guard can cover that. Instead the
//! slot is emptied only by the code that built the `QTensor`, before anyone else can see it
//! (see [`super::BlockMatrix`]), so no read can be in flight.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::quantized::{GgmlDType, QuantizedType};
use candle_core::CpuStorage;
use half::f16;

/// An empty buffer aligned for every GGML block type (their widest field is an `f32`), which
/// a released storage hands to candle as its pointer: a zero-length slice of any block type
/// made from it is valid.
static EMPTY: [u64; 0] = [];

/// candle's storage of one matrix's blocks, until released. Shared (`Arc`) between the
/// `QTensor` that owns it as its storage and the [`super::BlockMatrix`] code that built it, so
/// the latter can release the blocks after candle repacked them.
pub(super) struct ReleasableBlocks {
    format: GgmlDType,
    block_size: usize,
    slot: Mutex<Option<Box<dyn QuantizedType>>>,
    read_blocks: AtomicBool,
}

impl ReleasableBlocks {
    /// Holds candle's block storage `blocks`.
    pub(super) fn new(blocks: Box<dyn QuantizedType>) -> Arc<Self> {
        Arc::new(ReleasableBlocks {
            format: blocks.dtype(),
            block_size: blocks.block_size(),
            slot: Mutex::new(Some(blocks)),
            read_blocks: AtomicBool::new(false),
        })
    }

    /// Whether any product so far ran over the stored blocks (candle's kernels that read them
    /// directly, not its repacked tiles).
    pub(super) fn read_blocks(&self) -> bool {
        self.read_blocks.load(Ordering::Relaxed)
    }

    /// Frees the blocks. Only for the code that made the `QTensor` over this storage, while no
    /// one else holds it (see the module docs).
    pub(super) fn release(&self) {
        drop(self.slot().take());
    }

    /// Whether the blocks are still held.
    pub(super) fn holds_blocks(&self) -> bool {
        self.slot().is_some()
    }

    fn slot(&self) -> MutexGuard<'_, Option<Box<dyn QuantizedType>>> {
        // A panic while the slot was locked cannot leave it half-changed (it is replaced
        // whole), so a poisoned lock is still a consistent one.
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `f` over the blocks, or an error naming what was asked when they were released.
    fn with<T>(
        &self,
        what: &str,
        f: impl FnOnce(&dyn QuantizedType) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        match self.slot().as_deref() {
            Some(blocks) => f(blocks),
            None => Err(candle_core::Error::Msg(format!(
                "{what} of a {:?} matrix whose blocks were released after candle repacked them \
                 (only its repacked tiles are held)",
                self.format
            ))),
        }
    }
}

/// `QTensor::new` takes its storage boxed and by value; this is the box, sharing the slot.
pub(super) struct SharedBlocks(pub(super) Arc<ReleasableBlocks>);

impl QuantizedType for SharedBlocks {
    fn dtype(&self) -> GgmlDType {
        self.0.format
    }

    fn matmul_t(
        &self,
        mkn: (usize, usize, usize),
        lhs: &[f32],
        dst: &mut [f32],
    ) -> candle_core::Result<()> {
        self.0.read_blocks.store(true, Ordering::Relaxed);
        self.0.with("a product", |b| b.matmul_t(mkn, lhs, dst))
    }

    fn matmul_t_f16(
        &self,
        mkn: (usize, usize, usize),
        lhs: &[f16],
        dst: &mut [f16],
    ) -> candle_core::Result<()> {
        self.0.read_blocks.store(true, Ordering::Relaxed);
        self.0
            .with("an f16 product", |b| b.matmul_t_f16(mkn, lhs, dst))
    }

    fn embedding(
        &self,
        ids: &[u32],
        rows: usize,
        hidden: usize,
    ) -> candle_core::Result<CpuStorage> {
        self.0
            .with("an embedding lookup", |b| b.embedding(ids, rows, hidden))
    }

    fn dequantize(&self, elem_count: usize) -> candle_core::Result<CpuStorage> {
        self.0.with("dequantizing", |b| b.dequantize(elem_count))
    }

    fn storage_size_in_bytes(&self) -> usize {
        self.0
            .slot()
            .as_ref()
            .map_or(0, |b| b.storage_size_in_bytes())
    }

    fn as_ptr(&self) -> *const u8 {
        self.0
            .slot()
            .as_ref()
            .map_or(EMPTY.as_ptr().cast(), |b| b.as_ptr())
    }

    fn block_size(&self) -> usize {
        self.0.block_size
    }

    fn from_float(&mut self, xs: &[f32]) {
        if let Some(b) = self.0.slot().as_mut() {
            b.from_float(xs);
        }
    }

    fn from_float_imatrix(&mut self, xs: &[f32], imatrix_weights: &[f32], n_per_row: usize) {
        if let Some(b) = self.0.slot().as_mut() {
            b.from_float_imatrix(xs, imatrix_weights, n_per_row);
        }
    }

    fn size(&self) -> usize {
        self.0.slot().as_ref().map_or(0, |b| b.size())
    }
}
