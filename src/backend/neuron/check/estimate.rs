//! Estimates of what neuronx-cc will make of a module: how many instructions it generates, and
//! how long it takes. Both are estimates, labelled so wherever they are printed.
//!
//! # Instructions
//!
//! neuronx-cc refuses a graph whose generated instruction stream exceeds
//! [`super::accepted::INSTRUCTION_BUDGET`] after it has tiled and unrolled
//! every operator. The count it means is of NeuronCore engine instructions, which depend on its
//! tiling, fusion and scheduling, none of which is public. The estimate counts, per HLO
//! instruction of the entry computation, the tiles one NeuronCore-v2 instruction can cover:
//!
//! - elementwise, reductions, broadcasts, iota: one instruction per [128 partitions x 512]
//!   tile ([`VECTOR_TILE`] elements), at least one;
//! - `dot`: the Tensor Engine is a 128x128 systolic array that takes up to 512 moving columns
//!   per instruction, so `batch x ceil(M/128) x ceil(N/512) x ceil(K/128)` matmuls, plus one
//!   PSUM evacuation per output tile;
//! - `transpose`: one PE-array transpose per 128x128 block;
//! - `gather`/`scatter`: one indirect DMA per 128 slices (one slice per partition), times the
//!   [`VECTOR_TILE`] chunks of a slice;
//! - `sort`: a bitonic network: `log2(n)(log2(n)+1)/2` compare-exchange stages of three vector
//!   instructions (compare, two selects) over the whole operand;
//! - slices, concatenation, padding, copies: one DMA per [`VECTOR_TILE`] elements written,
//!   except a slice of an entry parameter, a reshape of one or an in-place update of one (a
//!   layer's window of a cache root), which its consumers read in place: none;
//! - parameters, constants, tuples, reshapes: none (layout only).
//!
//! Limits, stated plainly: this is not calibrated against a compiler run (nothing here has
//! neuronx-cc); the real count can be several times higher (DMA descriptors, semaphores and
//! synchronisation, instructions the scheduler adds) or lower (fusion). It is meant to catch a
//! graph that is clearly too large (orders of magnitude, e.g. an unbounded prefill chunk) and to
//! compare buckets, not to predict the compiler's number. Called computations (reduce
//! combiners, sort comparators) are inlined into their caller's instructions and not counted; a
//! `while` body would have to be multiplied by its trip count, which the check rejects anyway.
//!
//! # Compile time
//!
//! Public data points, one per term:
//! - a whole-model forward of Llama-3.1-8B compiles in about a minute without a vocabulary-wide
//!   ArgMax and in about 22 minutes with one, in the decode graph (aws-neuron-sdk#1210, zml):
//!   [`BASE_MINUTES`] per NEFF, plus [`WIDE_REDUCTION_MINUTES`] for a graph that reduces or
//!   sorts over a dimension wider than 16,384;
//! - a compile that reaches the instruction budget is the "may take up to one hour for large
//!   models" case that libneuronxla warns about on a cache miss (optimum-neuron#698): so
//!   [`BUDGET_MINUTES`] at [`super::accepted::INSTRUCTION_BUDGET`],
//!   linearly in the instruction estimate.
//!
//! One NEFF compiles per neuronx-cc process; the driver runs one process per 8 CPUs
//! (`CompilerConfig::jobs`), so a trn1.2xlarge (8 vCPUs) compiles one at a time.

use super::accepted::{INSTRUCTION_BUDGET, MAX_SORT_WIDTH};
use crate::backend::hlo::proto::{
    HloComputationProto, HloInstructionProto, HloModuleProto, ShapeProto,
};

/// Partitions of a NeuronCore-v2 SBUF tile times the free elements one vector instruction
/// covers in the estimate.
pub const VECTOR_TILE: u64 = 128 * 512;

/// Minutes for a NEFF of negligible size (see the module docs).
pub const BASE_MINUTES: f64 = 1.0;

/// Extra minutes for a graph with a vocabulary-wide ArgMax-like reduction (aws-neuron-sdk#1210).
pub const WIDE_REDUCTION_MINUTES: f64 = 21.0;

/// Minutes at the instruction budget.
pub const BUDGET_MINUTES: f64 = 60.0;

fn elems(shape: &ShapeProto) -> u64 {
    shape.dimensions.iter().map(|&d| d.max(0) as u64).product()
}

fn tiles(n: u64, tile: u64) -> u64 {
    n.div_ceil(tile).max(1)
}

/// The estimated engine instructions of one HLO instruction, given its operands' shapes.
fn instruction_cost(
    inst: &HloInstructionProto,
    operand: &dyn Fn(usize) -> Option<ShapeProto>,
) -> u64 {
    let Some(shape) = inst.shape.as_ref() else {
        return 0;
    };
    let out = elems(shape);
    match inst.opcode.as_str() {
        "parameter" | "constant" | "tuple" | "get-tuple-element" | "reshape" | "bitcast" => 0,
        "dot" => {
            let (Some(lhs), Some(rhs), Some(dn)) =
                (operand(0), operand(1), inst.dot_dimension_numbers.as_ref())
            else {
                return tiles(out, VECTOR_TILE);
            };
            let prod = |s: &ShapeProto, dims: &[i64]| -> u64 {
                dims.iter()
                    .filter_map(|&d| s.dimensions.get(d as usize))
                    .map(|&d| d.max(0) as u64)
                    .product()
            };
            let batch = prod(&lhs, &dn.lhs_batch_dimensions);
            let k = prod(&lhs, &dn.lhs_contracting_dimensions);
            let free = |s: &ShapeProto, batch: &[i64], contract: &[i64]| -> u64 {
                (0..s.dimensions.len() as i64)
                    .filter(|d| !batch.contains(d) && !contract.contains(d))
                    .map(|d| s.dimensions[d as usize].max(0) as u64)
                    .product()
            };
            let m = free(
                &lhs,
                &dn.lhs_batch_dimensions,
                &dn.lhs_contracting_dimensions,
            );
            let n = free(
                &rhs,
                &dn.rhs_batch_dimensions,
                &dn.rhs_contracting_dimensions,
            );
            let out_tiles = batch.max(1) * tiles(m, 128) * tiles(n, 512);
            out_tiles * tiles(k, 128) + out_tiles
        }
        "transpose" => tiles(out, 128 * 128),
        "gather" => {
            let slice: u64 = inst
                .gather_slice_sizes
                .iter()
                .map(|&d| d.max(0) as u64)
                .product();
            let slices = out / slice.max(1);
            tiles(slices, 128) * tiles(slice, VECTOR_TILE)
        }
        "scatter" => match operand(2) {
            Some(updates) => tiles(elems(&updates), 128),
            None => tiles(out, VECTOR_TILE),
        },
        "sort" => {
            let Some(keys) = operand(0) else {
                return tiles(out, VECTOR_TILE);
            };
            let width = sort_width(inst, &keys).max(2);
            let log = 64 - (width - 1).leading_zeros() as u64;
            let stages = log * (log + 1) / 2;
            3 * stages * tiles(elems(&keys), VECTOR_TILE)
        }
        "reduce" => operand(0).map_or(1, |s| tiles(elems(&s), VECTOR_TILE)),
        _ => tiles(out, VECTOR_TILE),
    }
}

/// The length of the dimension a `sort` sorts along.
pub(super) fn sort_width(inst: &HloInstructionProto, keys: &ShapeProto) -> u64 {
    inst.dimensions
        .first()
        .and_then(|&d| keys.dimensions.get(d as usize))
        .map_or(0, |&d| d.max(0) as u64)
}

/// The module's entry computation, if it names one it has.
pub(crate) fn entry_computation(module: &HloModuleProto) -> Option<&HloComputationProto> {
    module
        .computations
        .iter()
        .find(|c| c.id == module.entry_computation_id)
}

/// The estimated engine instructions of `module`'s entry computation (see the module docs).
pub fn instructions(module: &HloModuleProto) -> u64 {
    instructions_by_opcode(module).iter().map(|(_, n)| n).sum()
}

/// [`instructions`] per opcode, largest first (ties by name): what the estimate is made of.
pub fn instructions_by_opcode(module: &HloModuleProto) -> Vec<(String, u64)> {
    let Some(entry) = entry_computation(module) else {
        return Vec::new();
    };
    let shapes: std::collections::HashMap<i64, &ShapeProto> = entry
        .instructions
        .iter()
        .filter_map(|i| i.shape.as_ref().map(|s| (i.id, s)))
        .collect();
    // Entry parameters, reshapes and bitcasts of them, and in-place updates of them (a cache
    // root after a layer's scatter); instructions are in order, so an operand is seen before
    // its user.
    let mut parameters = std::collections::HashSet::new();
    for i in &entry.instructions {
        let view_of_input = matches!(
            i.opcode.as_str(),
            "reshape" | "bitcast" | "scatter" | "dynamic-update-slice"
        ) && i
            .operand_ids
            .first()
            .is_some_and(|id| parameters.contains(id));
        if i.opcode == "parameter" || view_of_input {
            parameters.insert(i.id);
        }
    }
    let mut by_opcode: std::collections::BTreeMap<&str, u64> = Default::default();
    for inst in &entry.instructions {
        // A static slice of an input (a layer's column window of a cache root) is read in
        // place by its consumers' DMAs through an access pattern: no copy of its own.
        if inst.opcode == "slice"
            && inst
                .operand_ids
                .first()
                .is_some_and(|id| parameters.contains(id))
        {
            continue;
        }
        let operand = |k: usize| {
            inst.operand_ids
                .get(k)
                .and_then(|id| shapes.get(id))
                .map(|s| (*s).clone())
        };
        let cost = instruction_cost(inst, &operand);
        if cost > 0 {
            *by_opcode.entry(inst.opcode.as_str()).or_default() += cost;
        }
    }
    let mut out: Vec<(String, u64)> = by_opcode
        .into_iter()
        .map(|(o, n)| (o.to_string(), n))
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// Whether the entry computation reduces or sorts over a dimension wider than
/// [`MAX_SORT_WIDTH`]: the vocabulary-wide ArgMax that made one decode graph take 22 minutes
/// (aws-neuron-sdk#1210).
pub fn has_wide_reduction(module: &HloModuleProto) -> bool {
    let Some(entry) = entry_computation(module) else {
        return false;
    };
    let shapes: std::collections::HashMap<i64, &ShapeProto> = entry
        .instructions
        .iter()
        .filter_map(|i| i.shape.as_ref().map(|s| (i.id, s)))
        .collect();
    entry.instructions.iter().any(|inst| {
        if !matches!(inst.opcode.as_str(), "reduce" | "sort") {
            return false;
        }
        let Some(input) = inst.operand_ids.first().and_then(|id| shapes.get(id)) else {
            return false;
        };
        inst.dimensions.iter().any(|&d| {
            input
                .dimensions
                .get(d as usize)
                .is_some_and(|&n| n.max(0) as u64 > MAX_SORT_WIDTH)
        })
    })
}

/// Estimated minutes neuronx-cc takes for one module (see the module docs).
pub fn compile_minutes(instructions: u64, wide_reduction: bool) -> f64 {
    let scaled = BUDGET_MINUTES * instructions as f64 / INSTRUCTION_BUDGET as f64;
    let wide = if wide_reduction {
        WIDE_REDUCTION_MINUTES
    } else {
        0.0
    };
    BASE_MINUTES + scaled + wide
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::hlo::emit::array_shape;
    use crate::backend::hlo::proto::{HloComputationProto, PrimitiveType};

    fn inst(id: i64, opcode: &str, dims: &[usize], operands: &[i64]) -> HloInstructionProto {
        HloInstructionProto {
            name: format!("i{id}"),
            opcode: opcode.into(),
            shape: Some(array_shape(dims, PrimitiveType::F32)),
            id,
            operand_ids: operands.to_vec(),
            ..Default::default()
        }
    }

    fn module(insts: Vec<HloInstructionProto>) -> HloModuleProto {
        let root = insts.last().map_or(0, |i| i.id);
        HloModuleProto {
            name: "m".into(),
            computations: vec![HloComputationProto {
                name: "main".into(),
                instructions: insts,
                id: 100,
                root_id: root,
                ..Default::default()
            }],
            entry_computation_id: 100,
            ..Default::default()
        }
    }

    #[test]
    fn elementwise_counts_tiles_and_layout_ops_count_nothing() {
        let m = module(vec![
            inst(1, "parameter", &[256, 1024], &[]),
            inst(2, "reshape", &[1024, 256], &[1]),
            // 262,144 elements: 4 tiles of 128 x 512.
            inst(3, "exponential", &[1024, 256], &[2]),
            // A reduce over a 1024-wide row: the operand's 4 tiles.
            {
                let mut r = inst(4, "reduce", &[256], &[1]);
                r.dimensions = vec![1];
                r
            },
        ]);
        assert_eq!(instructions(&m), 4 + 4);
        assert_eq!(
            instructions_by_opcode(&m),
            [("exponential".to_string(), 4), ("reduce".to_string(), 4)]
        );
        assert!(!has_wide_reduction(&m));
    }

    #[test]
    fn a_vocabulary_wide_reduction_is_noticed_and_costs_minutes() {
        let mut r = inst(2, "reduce", &[8], &[1]);
        r.dimensions = vec![1];
        let wide = module(vec![inst(1, "parameter", &[8, 102_400], &[]), r.clone()]);
        assert!(has_wide_reduction(&wide));
        let narrow = module(vec![inst(1, "parameter", &[8, 16_384], &[]), r]);
        assert!(!has_wide_reduction(&narrow));
        assert_eq!(compile_minutes(0, false), BASE_MINUTES);
        assert_eq!(
            compile_minutes(0, true),
            BASE_MINUTES + WIDE_REDUCTION_MINUTES
        );
        assert_eq!(
            compile_minutes(INSTRUCTION_BUDGET, false),
            BASE_MINUTES + BUDGET_MINUTES
        );
    }

    #[test]
    fn a_sort_costs_a_bitonic_network() {
        let mut s = inst(2, "sort", &[2, 1024], &[1]);
        s.dimensions = vec![1];
        let m = module(vec![inst(1, "parameter", &[2, 1024], &[]), s]);
        // log2(1024) = 10: 55 stages of 3 instructions over one tile.
        assert_eq!(instructions(&m), 3 * 55);
    }
}
