//! The "device": bytes in, [`deepinfer::backend::cpu::run`], bytes out.
//!
//! Input bytes are copied into candle tensors (candle owns its storage, so wrapping the
//! caller's buffer without a copy is not possible), the CPU backend runs the imported graph,
//! and each output is copied into the tensor bound to it. A cache root bound as both input
//! and output is therefore updated in place *as the caller sees it*: the one buffer the
//! caller allocated holds the new value afterwards, and the transient copy lives only inside
//! this call. The price is one extra copy of each root per execution, which a test
//! simulator can afford.

use candle_core::Tensor as CTensor;
use deepinfer::backend::cpu;
use deepinfer::graph::Graph;
use neuron_sys::sys;

use crate::fail::{Fail, Res};
use crate::model_io::IoDesc;

/// Builds a candle tensor of `desc`'s dtype and shape from little-endian `bytes` (whose
/// length the caller checked against `desc.size`).
fn to_candle(desc: &IoDesc, bytes: &[u8]) -> Res<CTensor> {
    let dims: Vec<usize> = desc.shape.iter().map(|&d| d as usize).collect();
    cpu::tensor_from_bytes(desc.dtype, &dims, bytes).map_err(|e| {
        Fail::new(
            sys::NRT_FAILURE,
            format!("input `{}`: cannot build a tensor: {e}", desc.name),
        )
    })
}

/// The little-endian bytes of an output tensor, checked against its declared dtype and size.
fn to_bytes(desc: &IoDesc, t: &CTensor) -> Res<Vec<u8>> {
    let fail = |msg: String| Fail::new(sys::NRT_FAILURE, format!("output `{}`: {msg}", desc.name));
    cpu::with_tensor_bytes(t, desc.dtype, |bytes| {
        if bytes.len() != desc.size {
            return Err(fail(format!(
                "the CPU backend produced {} bytes, the model declares {}",
                bytes.len(),
                desc.size
            )));
        }
        Ok(bytes.to_vec())
    })
    .map_err(|e| fail(e.to_string()))?
}

/// Runs `graph` on the input bytes (one per declared input, in order) and returns the
/// output bytes (one per declared output, in order).
///
/// An error from the CPU backend (say, a token id outside the vocabulary reaching an
/// embedding lookup) is `NRT_EXEC_BAD_INPUT`: on a device, that is input the NEFF cannot
/// execute correctly on.
pub(crate) fn run(
    graph: &Graph,
    inputs: &[IoDesc],
    outputs: &[IoDesc],
    input_bytes: &[Vec<u8>],
) -> Res<Vec<Vec<u8>>> {
    let tensors = inputs
        .iter()
        .zip(input_bytes)
        .map(|(d, b)| to_candle(d, b))
        .collect::<Res<Vec<_>>>()?;
    let results = cpu::run(graph, &tensors).map_err(|e| {
        Fail::new(
            sys::NRT_EXEC_BAD_INPUT,
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
        .map(|(d, t)| to_bytes(d, t))
        .collect()
}
