//! What one loaded NEFF takes of its NeuronCore's HBM besides the tensors bound to it, derived
//! from its HLO module: the figure `deepinfer plan` adds per NEFF and the figure nrt-sim charges
//! each `nrt_load` against the core, so the plan and the simulator count alike.
//!
//! The Neuron runtime's device-memory guide (aws-neuron-sdk
//! `neuron-runtime/explore/device-memory.rst`) splits a core's HBM into tensors, model
//! constants, model code, scratchpad (shared between the NEFFs of a core since runtime 2.33;
//! before that, a scratch variable over the 512 MB page was a private allocation per NEFF), DMA
//! rings, profile buffers and collectives, plus "a micro-code overhead of 96MB per physical
//! Neuron Core". Our NEFFs carry no constants (weights are inputs). Per NEFF:
//!
//! - **code and DMA rings** ([`NeffFootprint::code`]): [`CODE_BASE`] plus the instruction
//!   estimate ([`super::check::estimate::instructions`], which counts DMAs as well as compute)
//!   times [`BYTES_PER_INSTRUCTION`]. *A guess*: the per-instruction size is not public. It
//!   lands between the two public NEFF sizes (a 40 MB Llama-3.1-8B prefill NEFF with weights as
//!   inputs and an 800 MB decode NEFF with a vocabulary-wide ArgMax, aws-neuron-sdk#1210): a
//!   graph at the compiler's 5,000,000-instruction budget comes to 321 MB. The first-contact
//!   report measures the real NEFF sizes.
//! - **scratchpad** ([`NeffFootprint::scratch`]): the largest set of intermediates alive at
//!   once when the entry computation runs in its instruction order. *Computed*, with two
//!   assumptions: views (reshape, bitcast, tuple, get-tuple-element, and static slices, which
//!   a DMA reads through an access pattern: each layer's column slice of the KV root) take no
//!   memory and keep their source alive; a scatter or dynamic-update-slice writes its first
//!   operand's buffer
//!   in place (the KV root update), as XLA's buffer assignment does when that operand has no
//!   later reader. Parameters and the results handed to output tensors are the caller's
//!   tensors, not scratch. neuronx-cc fuses and tiles through SBUF, so the real figure is
//!   likely lower; whether it keeps a root-sized copy per layer is what only a trn1 can say.
//! - **collectives** ([`NeffFootprint::collectives`]): twice the largest collective's
//!   operand and result (a send and a receive buffer). *A guess*, bounded by the data moved.

use std::collections::HashMap;

use super::check::estimate;
use crate::backend::hlo::proto::{HloModuleProto, PrimitiveType, ShapeProto};

/// Fixed code of a NEFF of any size (headers, the program's control structures). *A guess*.
pub const CODE_BASE: u64 = 1 << 20;

/// Code and DMA-ring bytes per estimated instruction. *A guess* (see the module docs).
pub const BYTES_PER_INSTRUCTION: u64 = 64;

/// The runtime's micro-code overhead per physical NeuronCore (device-memory.rst).
pub const MICROCODE_PER_PHYSICAL_CORE: u64 = 96 << 20;

/// What one NEFF takes of its core's HBM beyond its bound tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NeffFootprint {
    /// The instruction estimate the code figure comes from.
    pub instructions: u64,
    /// Code and DMA rings, private to the NEFF.
    pub code: u64,
    /// The scratchpad it needs; shared with the other NEFFs of its core (the core holds the
    /// largest).
    pub scratch: u64,
    /// Collectives buffers, private to the NEFF.
    pub collectives: u64,
}

impl NeffFootprint {
    /// What the NEFF holds for itself alone: code, DMA rings and collectives buffers.
    pub fn private(&self) -> u64 {
        self.code + self.collectives
    }
}

/// The footprint of `module` (see the module docs).
pub fn of_module(module: &HloModuleProto) -> NeffFootprint {
    let instructions = estimate::instructions(module);
    NeffFootprint {
        instructions,
        code: CODE_BASE + instructions * BYTES_PER_INSTRUCTION,
        scratch: peak_scratch(module),
        collectives: 2 * largest_collective(module),
    }
}

/// The footprint of a serialized `HloModuleProto` (what nrt-sim's NEFF container carries).
pub fn of_hlo_bytes(hlo: &[u8]) -> Result<NeffFootprint, prost::DecodeError> {
    use prost::Message;
    Ok(of_module(&HloModuleProto::decode(hlo)?))
}

/// Bytes of one array of `shape` (0 for a tuple or an element type deepinfer does not emit).
fn array_bytes(shape: &ShapeProto) -> u64 {
    let elem = match PrimitiveType::try_from(shape.element_type) {
        Ok(PrimitiveType::Pred | PrimitiveType::S8 | PrimitiveType::U8) => 1,
        Ok(PrimitiveType::F8e4m3fn) => 1,
        Ok(PrimitiveType::S16 | PrimitiveType::U16 | PrimitiveType::F16 | PrimitiveType::Bf16) => 2,
        Ok(PrimitiveType::S32 | PrimitiveType::U32 | PrimitiveType::F32) => 4,
        Ok(PrimitiveType::S64 | PrimitiveType::U64 | PrimitiveType::F64) => 8,
        _ => return 0,
    };
    elem * shape
        .dimensions
        .iter()
        .map(|&d| d.max(0) as u64)
        .product::<u64>()
}

/// Whether an instruction's result is a view of (or written into) its first operand's
/// buffer rather than a buffer of its own.
fn reuses_operand(opcode: &str) -> bool {
    matches!(
        opcode,
        "reshape" | "bitcast" | "get-tuple-element" | "slice" | "scatter" | "dynamic-update-slice"
    )
}

/// The largest sum of live intermediate buffers over the entry computation, in order.
fn peak_scratch(module: &HloModuleProto) -> u64 {
    let Some(entry) = estimate::entry_computation(module) else {
        return 0;
    };
    let insts = &entry.instructions;
    let at: HashMap<i64, usize> = insts.iter().enumerate().map(|(i, x)| (x.id, i)).collect();
    // The buffer each instruction's result lives in: its own index, or (for a view or an
    // in-place update) its first operand's buffer; `None` for parameters and constants, whose
    // memory is not scratch.
    let mut buffer: Vec<Option<usize>> = vec![None; insts.len()];
    let mut size = vec![0u64; insts.len()];
    for (i, inst) in insts.iter().enumerate() {
        buffer[i] = match inst.opcode.as_str() {
            "parameter" | "constant" => None,
            // A tuple's elements keep their own buffers (the root tuple's are the outputs).
            "tuple" => None,
            op if reuses_operand(op) => inst
                .operand_ids
                .first()
                .and_then(|id| at.get(id))
                .and_then(|&k| buffer[k]),
            _ => {
                size[i] = inst.shape.as_ref().map_or(0, array_bytes);
                Some(i)
            }
        };
    }
    // The last instruction reading each buffer; results the root tuple hands out are written
    // into the caller's output tensors, so they are not scratch.
    let root = at.get(&entry.root_id).copied();
    let mut last_use: Vec<usize> = (0..insts.len()).collect();
    let mut output = vec![false; insts.len()];
    for (i, inst) in insts.iter().enumerate() {
        for id in &inst.operand_ids {
            let Some(b) = at.get(id).and_then(|&k| buffer[k]) else {
                continue;
            };
            if Some(i) == root {
                output[b] = true;
            } else {
                last_use[b] = last_use[b].max(i);
            }
        }
    }
    let mut frees: Vec<Vec<usize>> = vec![Vec::new(); insts.len()];
    for b in 0..insts.len() {
        if buffer[b] == Some(b) && !output[b] {
            frees[last_use[b]].push(b);
        }
    }
    let (mut live, mut peak) = (0u64, 0u64);
    for i in 0..insts.len() {
        if buffer[i] == Some(i) && !output[i] {
            live += size[i];
            peak = peak.max(live);
        }
        for &b in &frees[i] {
            live -= size[b];
        }
    }
    peak
}

/// The largest operand plus result of any collective in the entry computation, in bytes.
fn largest_collective(module: &HloModuleProto) -> u64 {
    let Some(entry) = estimate::entry_computation(module) else {
        return 0;
    };
    let shapes: HashMap<i64, &ShapeProto> = entry
        .instructions
        .iter()
        .filter_map(|i| i.shape.as_ref().map(|s| (i.id, s)))
        .collect();
    entry
        .instructions
        .iter()
        .filter(|i| {
            matches!(
                i.opcode.as_str(),
                "all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all"
            )
        })
        .map(|i| {
            let input: u64 = i
                .operand_ids
                .iter()
                .filter_map(|id| shapes.get(id))
                .map(|s| array_bytes(s))
                .sum();
            input + i.shape.as_ref().map_or(0, array_bytes)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::hlo::emit;
    use crate::graph::{DType, GraphBuilder, InputRole, ReduceOp};

    fn module_of(b: GraphBuilder) -> HloModuleProto {
        emit::emit(&b.finish().unwrap()).unwrap()
    }

    /// A chain `x -> a -> b -> c -> out`: at most two intermediates are alive at once (each
    /// step reads the previous one while writing its own), the output is not scratch.
    #[test]
    fn scratch_is_the_largest_live_set_in_order() {
        let b = GraphBuilder::new("chain");
        let x = b
            .input("x", InputRole::Metadata, vec![256], DType::F32)
            .unwrap();
        let a = x.exp().unwrap(); // 1 KiB
        let w = a.broadcast_as(vec![4, 256]).unwrap().exp().unwrap(); // 4 KiB
        let s = w.sum(0).unwrap(); // 1 KiB, reads w
        let out = s.add(&a).unwrap(); // reads s and a: the output
        b.output("y", &out).unwrap();
        let m = module_of(b);
        let f = of_module(&m);
        // While `s` is written: a (1 KiB) + w (4 KiB) + s (1 KiB); the broadcast before `w`'s
        // exp is a buffer too (4 KiB), alive with `a` and `w`: 9 KiB at most.
        assert!(f.scratch >= 6 * 1024, "{f:?}");
        assert!(f.scratch <= 9 * 1024, "{f:?}");
        assert_eq!(f.collectives, 0);
        assert_eq!(
            f.code,
            CODE_BASE + estimate::instructions(&m) * BYTES_PER_INSTRUCTION
        );
    }

    /// An update of a cache-root parameter writes in place: no root-sized scratch.
    #[test]
    fn an_in_place_update_of_a_parameter_is_not_scratch() {
        let b = GraphBuilder::new("update");
        let root = b
            .input("root", InputRole::CacheRoot, vec![1 << 14, 64], DType::F32)
            .unwrap();
        let rows = b
            .input("rows", InputRole::Metadata, vec![4], DType::I32)
            .unwrap();
        let v = b
            .input("v", InputRole::Metadata, vec![4, 64], DType::F32)
            .unwrap();
        let updated = root.scatter_rows(&rows, 0, &v.exp().unwrap()).unwrap();
        b.output_aliased("root", &updated, &root).unwrap();
        let f = of_module(&module_of(b));
        // The updates (`exp`, 1 KiB) and the row indices, not the 4 MiB root.
        assert!(f.scratch < 4096, "{f:?}");
    }

    /// Collectives buffers: a send and a receive buffer of the largest collective.
    #[test]
    fn collectives_take_twice_the_largest_payload() {
        let b = GraphBuilder::new("ar");
        let x = b
            .input("x", InputRole::Metadata, vec![1000], DType::F32)
            .unwrap();
        let y = x.exp().unwrap().all_reduce(ReduceOp::Sum, 2).unwrap();
        b.output("y", &y).unwrap();
        let f = of_module(&module_of(b));
        assert_eq!(f.collectives, 2 * (4000 + 4000));
        assert_eq!(f.private(), f.code + f.collectives);
    }
}
