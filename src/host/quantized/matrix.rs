//! One matrix in a GGML block format as candle's kernels hold it, kept in RAM once.
//!
//! candle's x86 kernels (AVX-512 VNNI, AVX-VNNI or AVX2) multiply a `Q4_K` or `Q8_0` matrix
//! whose shape suits them from a copy of its blocks repacked into 16-row tiles, made on the
//! first product and kept: `Q8_0` tiles are as large as the blocks, `Q4_K` tiles 4/3 of them
//! (scales unpacked to f32). Holding both made a V2-Lite-shaped Q4_K_M GGUF (10.4 GB) peak at
//! 19.8 GB, and the 16.7 GB Q8_0 one not load in 24 GiB. So a [`BlockMatrix`] repacks at load
//! (a one-row product, which also spares the first decode steps the repack) and then, when
//! candle ran that product on its tiles, drops the blocks: the tiles are all its kernels read.
//! Decode runs exactly the kernels it ran before. (Which blocks are held, where the file's
//! format has no fast candle kernel, is the `held` module's concern.)
//!
//! One exception is kept in check here: with AMX, candle multiplies a `Q4_K` matrix by 32 rows
//! or more from yet another copy (AMX tiles, 1.25 bytes a weight), made from the blocks. A
//! routed expert whose blocks were released is therefore multiplied at most
//! [`AMX_MIN_ROWS`]` - 1` rows at a time. An expert gets that many rows only in a large
//! prefill (a 64-token chunk routes ~6 rows to each of V2-Lite's 64 experts), and each time it
//! did, candle kept that third copy of it for good. A single matrix (attention, shared experts,
//! the LM head) sees that many rows in every prefill chunk, so a `Q4_K` one keeps its blocks and
//! candle's AMX prefill; other formats have no such path and keep only their tiles.
//!
//! Rejected:
//! - Holding only the blocks, multiplied by candle's kernel over them (`matmul_t`), with a
//!   temporary repack for prefill: a one-row expert product measured ~1.2x slower for `Q4_K`
//!   and 2x for `Q8_0`.
//! - Our own kernels over a tile layout: the crate forbids `unsafe`, which SIMD intrinsics need.
//! - mmap of the file: the blocks would be page cache instead of heap, but candle's tiles would
//!   still be a second copy, and `Mmap::map` is `unsafe`.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::quantized::{k_quants::QK_K, GgmlDType, QStorage, QTensor, QuantizedType};
use candle_core::{DType as CDType, Device, Tensor as CTensor};

use super::held::{held_form, held_shape};
use super::storage::{ReleasableBlocks, SharedBlocks};
use crate::error::{Error, Result};

/// The row count from which candle 0.11 multiplies a `Q4_K` matrix with AMX tiles that it
/// makes from the stored blocks (`repack::try_matmul_f32`), on CPUs with AMX-INT8.
pub const AMX_MIN_ROWS: usize = 32;

/// The rows of one of candle 0.11's x86 tiles: it repacks a matrix only when its row count is
/// a multiple of this and its rows are whole super-blocks (`repack_x86::select`).
const TILE_ROWS: usize = 16;

/// Whether a matrix may drop its blocks once candle has repacked them: see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// One routed expert of a stacked expert weight: its tiles only, whatever the format.
    Expert,
    /// A single matrix: its tiles only unless candle would read its blocks again for a large
    /// product (`Q4_K` with AMX).
    Single,
}

/// One `[out, in]` matrix in GGML blocks, held as candle's kernels read it: its repacked tiles
/// alone when they are all its kernels read, else its blocks (and tiles, where candle made
/// them). Built only by [`BlockMatrix::new`], which decides.
pub struct BlockMatrix {
    /// The held blocks (see [`super::held`]): `[out, held_cols]`.
    tensor: QTensor,
    /// `[out, in]`.
    dims: [usize; 2],
    /// The held rows' width: `in`, or `in` padded with zero blocks (see [`super::held`]).
    held_cols: usize,
    /// Whether the stored blocks are still held.
    holds_blocks: bool,
    /// Whether candle multiplies it from its repacked tiles.
    on_tiles: bool,
    /// The most rows one candle product may take (see [`AMX_MIN_ROWS`]); `None`: any.
    max_rows: Option<usize>,
}

impl std::fmt::Debug for BlockMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockMatrix({:?}, {:?}, {})",
            self.format(),
            self.dims(),
            match (self.holds_blocks, self.on_tiles) {
                (true, true) => "blocks and tiles",
                (true, false) => "blocks",
                (false, _) => "tiles only",
            }
        )
    }
}

impl BlockMatrix {
    /// The `[out, in]` matrix whose blocks candle's storage `blocks` holds (as
    /// `GgmlDType::from_data` makes it), repacked now by one product; its blocks are dropped
    /// when that product ran on candle's tiles and `role` allows it.
    pub fn new(blocks: Box<dyn QuantizedType>, dims: [usize; 2], role: Role) -> Result<Self> {
        let format = blocks.dtype();
        let expected = dims[0] * (dims[1] / format.block_size()) * format.type_size();
        if !dims[1].is_multiple_of(format.block_size())
            || blocks.storage_size_in_bytes() != expected
        {
            return Err(Error::Internal(format!(
                "{} bytes of {format:?} blocks for a {dims:?} matrix (expected {expected})",
                blocks.storage_size_in_bytes()
            )));
        }
        let (blocks, held_cols) = held_form(blocks, dims)?;
        let format = blocks.dtype();
        let (shared, tensor) = warmed(blocks, [dims[0], held_cols])?;
        let on_tiles = !shared.read_blocks();
        let max_rows = (format == GgmlDType::Q4K).then_some(AMX_MIN_ROWS - 1);
        let release = on_tiles && (role == Role::Expert || max_rows.is_none());
        if release {
            // Sound: `tensor` is not shared yet, so no read of the blocks is in flight.
            shared.release();
        }
        Ok(BlockMatrix {
            tensor,
            dims,
            held_cols,
            holds_blocks: shared.holds_blocks(),
            on_tiles,
            max_rows: if release { max_rows } else { None },
        })
    }

    /// The block format the matrix is held in: a stored `Q5_0` is held as `Q8_0`, for candle's
    /// faster kernels (`host::quantized::held`).
    pub fn format(&self) -> GgmlDType {
        self.tensor.dtype()
    }

    /// `[out, in]`.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Whether the stored blocks are still held (else only candle's repacked tiles are).
    pub fn holds_blocks(&self) -> bool {
        self.holds_blocks
    }

    /// The bytes of RAM it holds: its blocks, candle's tiles, or both (at candle 0.11's tile
    /// sizes).
    pub fn held_bytes(&self) -> u64 {
        self.layout().bytes(self.dims[0])
    }

    /// What the matrix holds, as [`Layout::predict`] would have said.
    pub(super) fn layout(&self) -> Layout {
        Layout {
            format: self.format(),
            held_cols: self.held_cols,
            tiles: self.on_tiles,
            blocks: self.holds_blocks,
        }
    }

    /// `x @ w^T` for `x: [.., m, in]` (any float dtype, computed in f32): `[.., m, out]` in f32,
    /// by candle's quantized kernels, a row limit's worth of rows at a time.
    pub fn matmul(&self, x: &CTensor) -> Result<CTensor> {
        let x = x.to_dtype(CDType::F32)?.contiguous()?;
        let (out, k) = (self.dims()[0], self.dims()[1]);
        let mut dims = x.dims().to_vec();
        match dims.last_mut() {
            Some(last) if *last == k => *last = out,
            _ => {
                return Err(Error::Internal(format!(
                    "a product of {:?} by a {:?} matrix",
                    x.dims(),
                    self.dims()
                )))
            }
        }
        let rows = x.elem_count() / k.max(1);
        if rows == 0 {
            return Ok(CTensor::zeros(dims, CDType::F32, &Device::Cpu)?);
        }
        let (x, k) = if self.held_cols > k {
            let padded = x.pad_with_zeros(candle_core::D::Minus1, 0, self.held_cols - k)?;
            (padded, self.held_cols)
        } else {
            (x, k)
        };
        let limit = self.max_rows.unwrap_or(rows).max(1);
        if rows <= limit {
            return Ok(x.apply_op1_no_bwd(&self.tensor)?);
        }
        let flat = x.reshape((rows, k))?;
        let parts = (0..rows)
            .step_by(limit)
            .map(|start| {
                flat.narrow(0, start, limit.min(rows - start))?
                    .apply_op1_no_bwd(&self.tensor)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(CTensor::cat(&parts, 0)?.reshape(dims)?)
    }
}

/// What a [`BlockMatrix`] holds, told from the stored format, shape and role alone, by the
/// rules [`BlockMatrix::new`] follows: so what a checkpoint will cost in RAM is known before
/// its tensors are read (see [`super::QuantizedWeight::predicted_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// The held block format ([`held_shape`]).
    pub format: GgmlDType,
    /// The held rows' width ([`held_shape`]).
    pub held_cols: usize,
    /// Whether candle repacks it into tiles: a format it tiles on this CPU ([`candle_tiles`]),
    /// rows a multiple of [`TILE_ROWS`], whole super-blocks.
    pub tiles: bool,
    /// Whether the blocks stay: no tiles, or a single `Q4_K` matrix (its blocks feed candle's
    /// AMX prefill; see the module docs).
    pub blocks: bool,
}

impl Layout {
    /// The layout of an `[out, in]` matrix (`dims`) stored in `format` blocks, held in `role`.
    pub(super) fn predict(format: GgmlDType, dims: [usize; 2], role: Role) -> Self {
        let (format, held_cols) = held_shape(format, dims[1]);
        let tiles = candle_tiles(format)
            && dims[0].is_multiple_of(TILE_ROWS)
            && held_cols.is_multiple_of(QK_K);
        let keeps_for_amx = role == Role::Single && format == GgmlDType::Q4K;
        Layout {
            format,
            held_cols,
            tiles,
            blocks: !tiles || keeps_for_amx,
        }
    }

    /// The bytes held for `rows` rows: blocks and tiles, at candle 0.11's tile sizes (a `Q4_K`
    /// tile unpacks each sub-block's 6-bit scale and min to f32, 192 bytes a row's super-block
    /// against the blocks' 144; a `Q8_0` tile reorders the blocks, 34 bytes each). Copies candle
    /// makes later are not counted: AMX tiles of a single `Q4_K` matrix in a prefill of 32 rows
    /// or more (1.25 bytes a weight), `Q6_K` tiles on its first product of several rows.
    pub(super) fn bytes(&self, rows: usize) -> u64 {
        let values = (rows * self.held_cols) as u64;
        let blocks = values / self.format.block_size() as u64 * self.format.type_size() as u64;
        let tiles = match (self.tiles, self.format) {
            (false, _) => 0,
            (true, GgmlDType::Q4K) => values / QK_K as u64 * 192,
            (true, _) => blocks,
        };
        tiles + if self.blocks { blocks } else { 0 }
    }
}

/// Whether candle 0.11 multiplies a matrix of `format` blocks (of a shape it tiles) from
/// repacked tiles on this CPU (`Q4_K` and `Q8_0` with AVX-512 VNNI or AVX-VNNI, `Q4_K` also
/// with AVX2; never at one row for `Q6_K`): asked of candle, by one product of a small zero
/// matrix, once per format per process, rather than copying its feature rules.
pub(super) fn candle_tiles(format: GgmlDType) -> bool {
    static ASKED: Mutex<Vec<(GgmlDType, bool)>> = Mutex::new(Vec::new());
    let mut asked = ASKED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&(_, tiles)) = asked.iter().find(|(f, _)| *f == format) {
        return tiles;
    }
    let dims = [TILE_ROWS, QK_K];
    let bytes = dims[0] * dims[1] / format.block_size() * format.type_size();
    let zeros = vec![0u64; bytes.div_ceil(8)];
    let blocks = format.from_data(Cow::Borrowed(&bytemuck::cast_slice(&zeros)[..bytes]));
    let tiles = reads_tiles(blocks, dims).unwrap_or(false);
    asked.push((format, tiles));
    tiles
}

/// `blocks` (an `[out, in]` matrix, `dims`) as a candle matrix over storage that can release
/// them, after one product ([`warm`]).
fn warmed(
    blocks: Box<dyn QuantizedType>,
    dims: [usize; 2],
) -> Result<(Arc<ReleasableBlocks>, QTensor)> {
    let shared = ReleasableBlocks::new(blocks);
    let storage = QStorage::Cpu(Box::new(SharedBlocks(Arc::clone(&shared))));
    let tensor = QTensor::new(storage, dims.to_vec())?;
    warm(&tensor)?;
    Ok((shared, tensor))
}

/// Whether candle multiplies `blocks` (an `[out, in]` matrix, `dims`) from its repacked tiles.
fn reads_tiles(blocks: Box<dyn QuantizedType>, dims: [usize; 2]) -> Result<bool> {
    Ok(!warmed(blocks, dims)?.0.read_blocks())
}

/// Multiplies one zero row by `q`, so candle repacks its tiles now, at load.
///
/// Left to the first step that uses it, every expert's first selection costs a repack: the
/// medium model's first eight decode steps at batch 1 took 7.5 ms each against 5.3 later
/// (13 ms with transparent huge pages, whose fresh memory the copies fault in), so a server's
/// first requests, and any short benchmark, paid for it. It is also how [`BlockMatrix::new`]
/// learns whether candle multiplies the matrix from tiles at all.
fn warm(q: &QTensor) -> candle_core::Result<()> {
    let k = q.shape().dims().last().copied().unwrap_or(0);
    let zero = CTensor::zeros((1, k), CDType::F32, &Device::Cpu)?;
    zero.apply_op1_no_bwd(q).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::super::QuantizedWeight;
    use super::*;
    use crate::test_util::seeded_values;

    /// What a matrix is predicted to hold from its format and shape alone is what candle's
    /// kernels made of it: the held format and width, tiles or not, blocks kept or not, over
    /// formats candle tiles, pads, converts and leaves alone, at row counts it tiles and not.
    #[test]
    fn the_predicted_layout_is_what_a_matrix_holds() {
        for (format, rows, cols) in [
            (GgmlDType::Q8_0, 32, 256),
            (GgmlDType::Q8_0, 32, 1408),
            (GgmlDType::Q8_0, 24, 1408),
            (GgmlDType::Q8_0, 32, 96),
            (GgmlDType::Q5_0, 32, 1408),
            (GgmlDType::Q5_0, 16, 96),
            (GgmlDType::Q4K, 32, 512),
            (GgmlDType::Q4K, 40, 256),
            (GgmlDType::Q6K, 32, 256),
        ] {
            let w = CTensor::from_vec(seeded_values(rows * cols, 9), (rows, cols), &Device::Cpu)
                .unwrap();
            for (w, role) in [
                (w.clone(), Role::Single),
                (w.unsqueeze(0).unwrap(), Role::Expert),
            ] {
                let q = QuantizedWeight::quantize(&w, format).unwrap();
                let predicted = Layout::predict(format, [rows, cols], role);
                assert_eq!(
                    q.matrices()[0].layout(),
                    predicted,
                    "{format:?} [{rows}, {cols}] {role:?}"
                );
            }
        }
    }

    /// The bytes of each layout, against the formats' block sizes and candle's tiles.
    #[test]
    fn a_layout_counts_its_blocks_and_tiles() {
        let layout = |format, held_cols, tiles, blocks| Layout {
            format,
            held_cols,
            tiles,
            blocks,
        };
        // 16 rows of one super-block: 16 Q4_K blocks of 144 bytes, tiles of 192 a row.
        assert_eq!(layout(GgmlDType::Q4K, 256, false, true).bytes(16), 16 * 144);
        assert_eq!(layout(GgmlDType::Q4K, 256, true, false).bytes(16), 16 * 192);
        assert_eq!(
            layout(GgmlDType::Q4K, 256, true, true).bytes(16),
            16 * (144 + 192)
        );
        // 1,408 held as 1,536: 48 blocks of 34 bytes a row, tiles as large.
        assert_eq!(
            layout(GgmlDType::Q8_0, 1536, true, false).bytes(2),
            2 * 48 * 34
        );
        assert_eq!(layout(GgmlDType::Q6K, 256, false, true).bytes(3), 3 * 210);
    }
}
