//! The "device": bound bytes in, [`deepinfer::backend::cpu::run`], bound bytes out.
//!
//! Each input is read from its storage into a candle tensor (candle owns its storage, so
//! wrapping the caller's buffer without a copy is not possible), the CPU backend runs the
//! imported graph, and each output is written into the bytes bound to it. A cache root bound as
//! both input and aliased output is therefore updated in place *as the caller sees it*: the one
//! buffer the caller allocated holds the new value afterwards, and candle's copy lives only
//! inside this call.

use std::sync::Arc;

use candle_core::Tensor as CTensor;
use deepinfer::backend::cpu;
use deepinfer::graph::Graph;
use deepinfer::host;
use neuron_sys::sys;

use crate::fail::{Fail, Res};
use crate::model_io::IoDesc;
use crate::state::{lock_bytes, Storage};

/// A binding resolved for one execution: the storage window of the tensor bound to an
/// input or output.
pub(crate) struct Bound {
    pub(crate) storage: Arc<Storage>,
    pub(crate) offset: usize,
    pub(crate) size: usize,
    /// The NEFF name it is bound under, and the tensor's own name, for messages.
    pub(crate) name: String,
    pub(crate) tensor: String,
}

impl Bound {
    /// Whether the two windows share a byte.
    pub(crate) fn overlaps(&self, other: &Bound) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
            && self.offset < other.offset + other.size
            && other.offset < self.offset + self.size
    }

    /// Whether the two are exactly the same bytes.
    pub(crate) fn same_bytes(&self, other: &Bound) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
            && self.offset == other.offset
            && self.size == other.size
    }
}

/// Builds a candle tensor of `desc`'s dtype and shape from little-endian `bytes` (whose
/// length the caller checked against `desc.size`).
fn to_candle(desc: &IoDesc, bytes: &[u8]) -> Res<CTensor> {
    let dims: Vec<usize> = desc.shape.iter().map(|&d| d as usize).collect();
    host::tensor_from_bytes(desc.dtype, &dims, bytes).map_err(|e| {
        Fail::new(
            sys::NRT_FAILURE,
            format!("input `{}`: cannot build a tensor: {e}", desc.name),
        )
    })
}

/// Writes an output tensor's little-endian bytes into the bytes bound to it, checked against
/// its declared dtype and size.
fn write_output(desc: &IoDesc, t: &CTensor, to: &Bound) -> Res<()> {
    let fail = |msg: String| Fail::new(sys::NRT_FAILURE, format!("output `{}`: {msg}", desc.name));
    host::with_tensor_bytes(t, desc.dtype, |bytes| {
        if bytes.len() != desc.size || bytes.len() != to.size {
            return Err(fail(format!(
                "the CPU backend produced {} bytes, the model declares {}",
                bytes.len(),
                desc.size
            )));
        }
        lock_bytes(&to.storage)[to.offset..to.offset + to.size].copy_from_slice(bytes);
        Ok(())
    })
    .map_err(|e| fail(e.to_string()))?
}

/// Runs `graph` on the bytes bound to its inputs (one per declared input, in order) and writes
/// its outputs into the bytes bound to them (one per declared output, in order).
///
/// An error from the CPU backend (say, a token id outside the vocabulary reaching an
/// embedding lookup) is `NRT_EXEC_BAD_INPUT`: on a device, that is input the NEFF cannot
/// execute correctly on. A rank of a collectives group (`rank`: its handle and step) runs
/// with [`cpu::run_rank`]; a collective that failed (another rank's failure, a rank that
/// never came) is `NRT_EXEC_HW_ERR_COLLECTIVES`.
pub(crate) fn run(
    graph: &Graph,
    inputs: &[IoDesc],
    outputs: &[IoDesc],
    bound_in: &[Bound],
    bound_out: &[Bound],
    rank: Option<&(cpu::RankComm, u64)>,
) -> Res<()> {
    let tensors = inputs
        .iter()
        .zip(bound_in)
        .map(|(d, b)| to_candle(d, &lock_bytes(&b.storage)[b.offset..b.offset + b.size]))
        .collect::<Res<Vec<_>>>()?;
    let results = match rank {
        None => cpu::run(graph, &tensors),
        Some((comm, step)) => cpu::run_rank(graph, &tensors, comm, *step),
    }
    .map_err(|e| {
        let status = match e {
            deepinfer::Error::Collective(_) => sys::NRT_EXEC_HW_ERR_COLLECTIVES,
            _ => sys::NRT_EXEC_BAD_INPUT,
        };
        Fail::new(
            status,
            format!("the CPU backend failed on model `{}`: {e}", graph.name()),
        )
    })?;
    if results.len() != outputs.len() {
        return Err(Fail::new(
            sys::NRT_FAILURE,
            format!(
                "the CPU backend returned {} outputs for {} declared",
                results.len(),
                outputs.len()
            ),
        ));
    }
    outputs
        .iter()
        .zip(&results)
        .zip(bound_out)
        .try_for_each(|((d, t), b)| write_output(d, t, b))
}
