//! A step's metadata: the host arrays a decode or prefill graph reads, padded to its bucket.
//!
//! Padding rows and tokens write their cache rows into the scratch block and attend only to
//! scratch, so they cannot disturb a live sequence; their outputs are ignored.

use crate::cache::{slot, SCRATCH_BLOCK};
use crate::error::{Error, Result};

/// Host data of one metadata input.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    /// i32 values.
    I32(Vec<i32>),
    /// f32 values.
    F32(Vec<f32>),
    /// u32 values.
    U32(Vec<u32>),
}

/// One metadata input: its graph input name, shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct HostArray {
    /// The graph input it binds.
    pub name: &'static str,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values, row-major.
    pub data: HostData,
}

/// How one sequence's next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// `<= 0` for greedy.
    pub temperature: f32,
    /// `<= 0` for no top-k.
    pub top_k: i32,
    /// `>= 1` for no top-p.
    pub top_p: f32,
    /// Seed of the counter-based generator.
    pub seed: u32,
}

impl SamplingParams {
    /// Greedy decoding.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
}

/// One decoding sequence in a batch.
#[derive(Debug, Clone)]
pub struct DecodeRow<'a> {
    /// The token being fed (the last one generated).
    pub token: u32,
    /// Its position (tokens before it in the sequence).
    pub position: usize,
    /// The sequence's block table (already grown to hold `position + 1` tokens).
    pub blocks: &'a [u32],
    /// Sampling parameters.
    pub sampling: SamplingParams,
}

/// One chunk of a sequence's prompt.
#[derive(Debug, Clone)]
pub struct PrefillChunk<'a> {
    /// The chunk's tokens.
    pub tokens: &'a [u32],
    /// Position of the first of them.
    pub start: usize,
    /// The sequence's block table (already grown to hold `start + tokens.len()` tokens).
    pub blocks: &'a [u32],
    /// Sampling parameters for the token after the chunk.
    pub sampling: SamplingParams,
}

fn sampling_arrays(params: &[SamplingParams]) -> [HostArray; 4] {
    let n = params.len();
    [
        HostArray {
            name: "temperature",
            shape: vec![n],
            data: HostData::F32(params.iter().map(|p| p.temperature).collect()),
        },
        HostArray {
            name: "top_k",
            shape: vec![n],
            data: HostData::I32(params.iter().map(|p| p.top_k).collect()),
        },
        HostArray {
            name: "top_p",
            shape: vec![n],
            data: HostData::F32(params.iter().map(|p| p.top_p).collect()),
        },
        HostArray {
            name: "seeds",
            shape: vec![n],
            data: HostData::U32(params.iter().map(|p| p.seed).collect()),
        },
    ]
}

/// A sequence's block table cut or padded (with the scratch block) to `width` entries. Blocks
/// past the context bucket hold no position the step can see (positions are checked against the
/// bucket by the callers), so they are left out.
fn block_row(blocks: &[u32], width: usize) -> Vec<i32> {
    let mut row: Vec<i32> = blocks.iter().take(width).map(|&b| b as i32).collect();
    row.resize(width, SCRATCH_BLOCK as i32);
    row
}

/// The metadata of a decode step for `rows`, padded to `batch` rows and a context of `ctx`.
pub fn decode_step(
    rows: &[DecodeRow<'_>],
    batch: usize,
    ctx: usize,
    block_size: usize,
) -> Result<Vec<HostArray>> {
    if rows.len() > batch {
        return Err(Error::InvalidRequest(format!(
            "{} rows do not fit a batch of {batch}",
            rows.len()
        )));
    }
    let width = ctx / block_size;
    let mut ids = Vec::with_capacity(batch);
    let mut positions = Vec::with_capacity(batch);
    let mut slots = Vec::with_capacity(batch);
    let mut tables = Vec::with_capacity(batch * width);
    let mut lens = Vec::with_capacity(batch);
    let mut params = Vec::with_capacity(batch);
    for r in rows {
        if r.position >= ctx {
            return Err(Error::InvalidRequest(format!(
                "position {} is beyond the context bucket {ctx}",
                r.position
            )));
        }
        ids.push(r.token as i32);
        positions.push(r.position as i32);
        slots.push(slot(r.blocks, block_size, r.position)?);
        tables.extend(block_row(r.blocks, width));
        lens.push(r.position as i32 + 1);
        params.push(r.sampling);
    }
    for _ in rows.len()..batch {
        ids.push(0);
        positions.push(0);
        slots.push((SCRATCH_BLOCK as usize * block_size) as i32);
        tables.extend(std::iter::repeat_n(SCRATCH_BLOCK as i32, width));
        lens.push(1);
        params.push(SamplingParams::GREEDY);
    }
    let mut out = vec![
        HostArray {
            name: "input_ids",
            shape: vec![batch],
            data: HostData::I32(ids),
        },
        HostArray {
            name: "positions",
            shape: vec![batch],
            data: HostData::I32(positions),
        },
        HostArray {
            name: "slot_mapping",
            shape: vec![batch],
            data: HostData::I32(slots),
        },
        HostArray {
            name: "block_tables",
            shape: vec![batch, width],
            data: HostData::I32(tables),
        },
        HostArray {
            name: "context_lens",
            shape: vec![batch],
            data: HostData::I32(lens),
        },
    ];
    out.extend(sampling_arrays(&params));
    Ok(out)
}

/// The metadata of a prefill step for one chunk, padded to `t` tokens and a context of `ctx`.
pub fn prefill_step(
    chunk: &PrefillChunk<'_>,
    t: usize,
    ctx: usize,
    block_size: usize,
) -> Result<Vec<HostArray>> {
    let n = chunk.tokens.len();
    if n == 0 || n > t || chunk.start + n > ctx {
        return Err(Error::InvalidRequest(format!(
            "a chunk of {n} tokens at position {} does not fit {t} tokens and a context of {ctx}",
            chunk.start
        )));
    }
    let mut ids: Vec<i32> = chunk.tokens.iter().map(|&x| x as i32).collect();
    let mut positions: Vec<i32> = (chunk.start..chunk.start + n).map(|p| p as i32).collect();
    let mut slots = positions
        .iter()
        .map(|&p| slot(chunk.blocks, block_size, p as usize))
        .collect::<Result<Vec<_>>>()?;
    for i in n..t {
        ids.push(0);
        positions.push(0);
        slots.push((SCRATCH_BLOCK as usize * block_size + i % block_size) as i32);
    }
    let width = ctx / block_size;
    let mut out = vec![
        HostArray {
            name: "input_ids",
            shape: vec![t],
            data: HostData::I32(ids),
        },
        HostArray {
            name: "positions",
            shape: vec![t],
            data: HostData::I32(positions),
        },
        HostArray {
            name: "slot_mapping",
            shape: vec![t],
            data: HostData::I32(slots),
        },
        HostArray {
            name: "block_tables",
            shape: vec![1, width],
            data: HostData::I32(block_row(chunk.blocks, width)),
        },
        HostArray {
            name: "last_index",
            shape: vec![1],
            data: HostData::I32(vec![n as i32 - 1]),
        },
    ];
    out.extend(sampling_arrays(&[chunk.sampling]));
    Ok(out)
}
