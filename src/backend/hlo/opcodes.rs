//! HLO opcode spellings, each written once for the emitter, the importer and the text printer.
//!
//! The one-to-one op families keep their HLO form in the graph's op tables
//! ([`UnaryOp::hlo_opcode`], [`BinaryOp::hlo_opcode`], [`CmpOp::name`] as the comparison
//! direction, [`ReduceOp::combiner`] as the root of a `reduce`'s computation): the emitter reads
//! them forwards, and the functions below read them backwards for the importer, so adding an
//! op to a table is all it takes to lower and import it. The constants are the opcodes of the
//! instructions that belong to no family: the parameters, constants and shape ops every module
//! has, and the parts of the structural lowerings (dot, gather, top-k, scatter, ...), which the
//! importer recognises by their structure.
//!
//! The reverse lookups scan a table of at most a dozen entries; a map built once would be
//! faster, but the importer runs once per loaded graph, not per step.

use crate::graph::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

/// An entry parameter (a graph input).
pub(super) const PARAMETER: &str = "parameter";
/// A literal.
pub(super) const CONSTANT: &str = "constant";
/// Each element is its index along one dimension.
pub(super) const IOTA: &str = "iota";
/// An elementwise comparison; its direction is a [`CmpOp`] name.
pub(super) const COMPARE: &str = "compare";
/// `pred ? on_true : on_false`.
pub(super) const SELECT: &str = "select";
/// An element type conversion.
pub(super) const CONVERT: &str = "convert";
/// The same elements in another shape.
pub(super) const RESHAPE: &str = "reshape";
/// Expansion by a dimension map (each operand dim to an output dim of the same size).
pub(super) const BROADCAST: &str = "broadcast";
/// A dimension permutation.
pub(super) const TRANSPOSE: &str = "transpose";
/// A static slice.
pub(super) const SLICE: &str = "slice";
/// Operands joined along one dimension.
pub(super) const CONCATENATE: &str = "concatenate";
/// A general contraction; the graph's batched matmul.
pub(super) const DOT: &str = "dot";
/// A reduction over dimensions by a called scalar computation.
pub(super) const REDUCE: &str = "reduce";
/// A sort of several operands by a called comparator (top-k's first half).
pub(super) const SORT: &str = "sort";
/// One element of a tuple (top-k's indices out of the sort).
pub(super) const GET_TUPLE_ELEMENT: &str = "get-tuple-element";
/// Slices picked by an index array (`index_select`, `gather`).
pub(super) const GATHER: &str = "gather";
/// Windows written at an index array (`scatter_rows`).
pub(super) const SCATTER: &str = "scatter";
/// A sum or max over the replicas of a group, each getting the result (`all_reduce`).
pub(super) const ALL_REDUCE: &str = "all-reduce";
/// The replicas' operands joined along one dimension (`all_gather`).
pub(super) const ALL_GATHER: &str = "all-gather";
/// The entry computation's root: one element per graph output.
pub(super) const TUPLE: &str = "tuple";

/// The unary op whose single instruction is `opcode` (composites such as silu have none).
pub(super) fn unary(opcode: &str) -> Option<UnaryOp> {
    UnaryOp::ALL
        .iter()
        .copied()
        .find(|u| u.hlo_opcode() == Some(opcode))
}

/// The binary op whose instruction is `opcode`.
pub(super) fn binary(opcode: &str) -> Option<BinaryOp> {
    BinaryOp::ALL
        .iter()
        .copied()
        .find(|b| b.hlo_opcode() == opcode)
}

/// The comparison whose HLO `comparison_direction` is `direction`.
pub(super) fn comparison(direction: &str) -> Option<CmpOp> {
    CmpOp::ALL.iter().copied().find(|c| c.name() == direction)
}

/// The reduction whose called computation's root has opcode `combiner`.
pub(super) fn reduction(combiner: &str) -> Option<ReduceOp> {
    ReduceOp::ALL
        .iter()
        .copied()
        .find(|r| r.combiner().hlo_opcode() == combiner)
}
