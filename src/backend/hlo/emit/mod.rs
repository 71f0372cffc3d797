//! Graph -> `HloModuleProto`.
//!
//! The module follows the checklist XLA and neuronx-cc impose: named entry parameters
//! (`neff_input_names`), a tuple root (`neff_output_names`), `input_output_alias` (must-alias)
//! for every updated cache root, a row-major layout on every array shape, small ids unique in the
//! module (one counter for instructions and computations), callee computations before their
//! callers, instructions after their operands, and `host_program_shape` derived from the entry
//! computation.
//!
//! This file assembles the module: ids, instructions, the scalar computations that `reduce`,
//! `sort` and `scatter` call, and the entry computation with its signature and aliases. Each
//! graph op's lowering is in `lower.rs`: one instruction from the op tables in
//! `graph::op` for the elementwise and reduction families, plain-HLO structures for the rest.

mod four_bit;
mod lower;
mod threshold;

pub(crate) use threshold::MASS_THRESHOLD;

use std::collections::{HashMap, HashSet};

use prost::Message;

use super::opcodes;
use super::proto::{
    hlo_input_output_alias_proto::AliasEntryProto, FrontendAttributes, HloComputationProto,
    HloInputOutputAliasProto, HloInstructionProto, HloModuleProto, Kind, LayoutProto, LiteralProto,
    PrimitiveType, ProgramShapeProto, ShapeProto,
};
use super::{
    literal, neff_input_name, primitive_type, COMPOSITE_ATTR, COMPOSITE_OPERANDS_ATTR,
    COMPOSITE_PART_ATTR, INPUT_NAMES_ATTR, OUTPUT_NAMES_ATTR,
};
use crate::error::Result;
use crate::graph::{BinaryOp, CmpOp, DType, Graph, Literal, ReduceOp};

/// The HLO array shape of `dims` with a row-major layout.
pub fn array_shape(dims: &[usize], t: PrimitiveType) -> ShapeProto {
    let rank = dims.len() as i64;
    ShapeProto {
        element_type: t as i32,
        dimensions: dims.iter().map(|&d| d as i64).collect(),
        tuple_shapes: vec![],
        layout: Some(LayoutProto {
            minor_to_major: (0..rank).rev().collect(),
        }),
        is_dynamic_dimension: vec![false; dims.len()],
    }
}

fn tuple_shape(elems: Vec<ShapeProto>) -> ShapeProto {
    ShapeProto {
        element_type: PrimitiveType::Tuple as i32,
        tuple_shapes: elems,
        ..Default::default()
    }
}

/// Serializes a module.
pub fn to_bytes(module: &HloModuleProto) -> Vec<u8> {
    module.encode_to_vec()
}

/// Lowers `graph` to an HLO module.
pub fn emit(graph: &Graph) -> Result<HloModuleProto> {
    let mut e = Emitter {
        graph,
        next_id: 1,
        callees: Vec::new(),
        scalar_fns: HashMap::new(),
        // Most nodes lower to one or two instructions: room for that up front spares the
        // copies of a growing vector of large structs.
        entry: Vec::with_capacity(2 * graph.nodes().len()),
        value: vec![0; graph.nodes().len()],
    };
    for (i, node) in graph.nodes().iter().enumerate() {
        e.value[i] = e.lower(i, &node.op)?;
    }
    e.finish()
}

/// Which scalar computation a `reduce`, `sort` or `scatter` calls.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum ScalarFn {
    /// A reduction's combiner: the binary op applied to two elements.
    Combine(BinaryOp),
    /// `lhs > rhs` on the first of two (key, index) pairs: a descending sort comparator.
    Greater,
    /// Returns its second argument: scatter's "assign".
    Second,
}

/// One module being written: the entry instructions in order, the callee computations, and
/// the one id counter both share.
struct Emitter<'g> {
    graph: &'g Graph,
    /// The next free id (instructions and computations share one counter).
    next_id: i64,
    /// Scalar computations, each emitted once, before the entry that calls them.
    callees: Vec<HloComputationProto>,
    /// The computation id of each (scalar function, element type) emitted so far.
    scalar_fns: HashMap<(ScalarFn, i32), i64>,
    /// The entry computation's instructions, operands before users.
    entry: Vec<HloInstructionProto>,
    /// The instruction holding each node's value.
    value: Vec<i64>,
}

impl Emitter<'_> {
    /// Tags the instructions emitted since entry index `first` as one composite op `name`, so
    /// the importer (and so nrt-sim) reads the run back as that op: every instruction a part,
    /// the last the op itself, with its `operands` and any `extra` attributes.
    fn tag_composite(
        &mut self,
        first: usize,
        name: &str,
        operands: &[i64],
        extra: &[(&str, String)],
    ) {
        let count = self.entry.len() - first;
        for (k, inst) in self.entry[first..].iter_mut().enumerate() {
            let map = &mut inst
                .frontend_attributes
                .get_or_insert_with(FrontendAttributes::default)
                .map;
            if k + 1 == count {
                let ids: Vec<String> = operands.iter().map(i64::to_string).collect();
                map.insert(COMPOSITE_ATTR.into(), name.into());
                map.insert(COMPOSITE_OPERANDS_ATTR.into(), ids.join(","));
                for (key, value) in extra {
                    map.insert((*key).into(), value.clone());
                }
            } else {
                map.insert(COMPOSITE_PART_ATTR.into(), name.into());
            }
        }
    }

    /// A fresh id.
    fn id(&mut self) -> i64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// An instruction named `opcode.id` (XLA's own naming, `-` read as `_`).
    fn make(opcode: &str, id: i64, shape: ShapeProto, operands: &[i64]) -> HloInstructionProto {
        HloInstructionProto {
            name: format!("{}.{id}", opcode.replace('-', "_")),
            opcode: opcode.to_string(),
            shape: Some(shape),
            id,
            operand_ids: operands.to_vec(),
            ..Default::default()
        }
    }

    /// Appends an entry instruction, letting `f` fill extra fields; returns its id.
    fn push(
        &mut self,
        opcode: &str,
        shape: ShapeProto,
        operands: &[i64],
        f: impl FnOnce(&mut HloInstructionProto),
    ) -> i64 {
        let id = self.id();
        let mut inst = Self::make(opcode, id, shape, operands);
        f(&mut inst);
        self.entry.push(inst);
        id
    }

    fn shape_of(&self, node: usize) -> ShapeProto {
        let n = &self.graph.nodes()[node];
        array_shape(n.shape.dims(), primitive_type(n.dtype))
    }

    fn dims_of(&self, node: usize) -> &[usize] {
        self.graph.nodes()[node].shape.dims()
    }

    fn dtype_of(&self, node: usize) -> DType {
        self.graph.nodes()[node].dtype
    }

    /// A `constant` instruction holding `lit`.
    fn constant(&mut self, lit: LiteralProto, shape: ShapeProto) -> i64 {
        self.push(opcodes::CONSTANT, shape, &[], |i| i.literal = Some(lit))
    }

    /// A scalar constant `v` of `dtype` (`bool`: `v != 0`).
    fn scalar(&mut self, dtype: DType, v: f64) -> i64 {
        let shape = array_shape(&[], primitive_type(dtype));
        let lit = match Literal::scalar(v, dtype) {
            Some(lit) => literal::to_proto(&lit, shape.clone()),
            None => LiteralProto {
                shape: Some(shape.clone()),
                preds: if dtype == DType::Bool {
                    vec![v != 0.0]
                } else {
                    vec![]
                },
                u8s: if dtype == DType::U8 {
                    vec![v as u8]
                } else {
                    vec![]
                },
                ..Default::default()
            },
        };
        self.constant(lit, shape)
    }

    /// `x` expanded to `to` (graph semantics: dims aligned right, each 1 or equal).
    fn broadcast(&mut self, x: i64, from: &[usize], to: &[usize], t: PrimitiveType) -> i64 {
        if from == to {
            return x;
        }
        let off = to.len() - from.len();
        // Keep the operand dims that are not expanded; reshape the others away, since HLO's
        // broadcast maps each operand dim to an output dim of the same size.
        let kept: Vec<usize> = (0..from.len())
            .filter(|&i| from[i] == to[off + i])
            .collect();
        let mut operand = x;
        if kept.len() != from.len() {
            let dims: Vec<usize> = kept.iter().map(|&i| from[i]).collect();
            operand = self.push(opcodes::RESHAPE, array_shape(&dims, t), &[x], |_| {});
        }
        self.push(opcodes::BROADCAST, array_shape(to, t), &[operand], |i| {
            i.dimensions = kept.iter().map(|&k| (off + k) as i64).collect();
        })
    }

    /// The callee computation `f` over scalars of type `t`, emitted on first use.
    fn scalar_fn(&mut self, f: ScalarFn, t: PrimitiveType) -> i64 {
        if let Some(&id) = self.scalar_fns.get(&(f, t as i32)) {
            return id;
        }
        let s = array_shape(&[], t);
        let pred = array_shape(&[], PrimitiveType::Pred);
        let nparams = if f == ScalarFn::Greater { 4 } else { 2 };
        let mut insts = Vec::new();
        let mut params = Vec::new();
        for p in 0..nparams {
            let id = self.id();
            // The comparator's second pair is the i32 index.
            let shape = if f == ScalarFn::Greater && p >= 2 {
                array_shape(&[], PrimitiveType::S32)
            } else {
                s.clone()
            };
            let mut inst = Self::make(opcodes::PARAMETER, id, shape.clone(), &[]);
            inst.parameter_number = p as i64;
            insts.push(inst);
            params.push(shape);
        }
        let (a, b) = (insts[0].id, insts[1].id);
        let root = match f {
            ScalarFn::Second => b,
            _ => {
                let id = self.id();
                let (opcode, shape) = match f {
                    ScalarFn::Combine(op) => (op.hlo_opcode(), s.clone()),
                    _ => (opcodes::COMPARE, pred.clone()),
                };
                let mut inst = Self::make(opcode, id, shape, &[a, b]);
                if f == ScalarFn::Greater {
                    inst.comparison_direction = CmpOp::Gt.name().into();
                    inst.comparison_type = comparison_type(t).into();
                }
                insts.push(inst);
                id
            }
        };
        let result = insts
            .iter()
            .find(|i| i.id == root)
            .and_then(|i| i.shape.clone());
        let id = self.id();
        let name = match f {
            ScalarFn::Combine(op) => op.name(),
            ScalarFn::Greater => "greater",
            ScalarFn::Second => "assign",
        };
        let names = (0..params.len()).map(|p| format!("p{p}")).collect();
        self.callees.push(HloComputationProto {
            name: format!("{name}_{}.{id}", t.as_str_name().to_lowercase()),
            instructions: insts,
            program_shape: Some(ProgramShapeProto {
                parameters: params,
                result,
                parameter_names: names,
            }),
            id,
            root_id: root,
        });
        self.scalar_fns.insert((f, t as i32), id);
        id
    }

    /// `op` over dimension `dim` of `x` (of shape `dims`), which is removed: a `reduce` from the
    /// op's identity calling its combiner.
    fn reduce(&mut self, x: i64, dims: &[usize], dim: usize, op: ReduceOp, dtype: DType) -> i64 {
        let init = reduce_identity(op, dtype);
        let t = primitive_type(dtype);
        let init = self.scalar(dtype, init);
        let comp = self.scalar_fn(ScalarFn::Combine(op.combiner()), t);
        let mut out: Vec<usize> = dims.to_vec();
        out.remove(dim);
        self.push(opcodes::REDUCE, array_shape(&out, t), &[x, init], |i| {
            i.dimensions = vec![dim as i64];
            i.called_computation_ids = vec![comp];
        })
    }

    fn finish(mut self) -> Result<HloModuleProto> {
        let graph = self.graph;
        let outs: Vec<i64> = graph
            .outputs()
            .iter()
            .map(|o| self.value[o.node.0])
            .collect();
        let out_shapes: Vec<ShapeProto> = graph
            .outputs()
            .iter()
            .map(|o| self.shape_of(o.node.0))
            .collect();
        let names = graph
            .outputs()
            .iter()
            .map(|o| o.name.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let root = self.push(
            opcodes::TUPLE,
            tuple_shape(out_shapes.clone()),
            &outs,
            |i| {
                i.frontend_attributes = Some(FrontendAttributes {
                    map: [(OUTPUT_NAMES_ATTR.to_string(), names)].into(),
                });
            },
        );
        let params: Vec<ShapeProto> = graph
            .inputs()
            .iter()
            .map(|d| array_shape(d.shape.dims(), primitive_type(d.dtype)))
            .collect();
        let program = ProgramShapeProto {
            parameters: params,
            result: Some(tuple_shape(out_shapes)),
            parameter_names: graph.inputs().iter().map(|d| d.name.clone()).collect(),
        };
        let entry_id = self.id();
        let entry_name = "main".to_string();
        let instructions = live(std::mem::take(&mut self.entry), root);
        // The scalar computations the live instructions call (they call nothing themselves).
        let called: HashSet<i64> = instructions
            .iter()
            .flat_map(|i| i.called_computation_ids.iter().copied())
            .collect();
        let mut computations = std::mem::take(&mut self.callees);
        computations.retain(|c| called.contains(&c.id));
        computations.push(HloComputationProto {
            name: entry_name.clone(),
            instructions,
            program_shape: Some(program.clone()),
            id: entry_id,
            root_id: root,
        });
        let aliases = graph
            .outputs()
            .iter()
            .enumerate()
            .filter_map(|(i, o)| {
                o.aliases.map(|p| AliasEntryProto {
                    output_shape_index: vec![i as i64],
                    parameter_number: p as i64,
                    parameter_shape_index: vec![],
                    kind: Kind::MustAlias as i32,
                })
            })
            .collect::<Vec<_>>();
        // An aliased parameter's NEFF name carries the compiler's suffix (see
        // `MUST_ALIAS_SUFFIX` for the convention and its source).
        let entry_insts = computations
            .last_mut()
            .map(|c| c.instructions.as_mut_slice())
            .unwrap_or_default();
        for e in &aliases {
            let param = entry_insts.iter_mut().find(|i| {
                i.opcode == opcodes::PARAMETER && i.parameter_number == e.parameter_number
            });
            if let Some(attrs) = param.and_then(|i| i.frontend_attributes.as_mut()) {
                if let Some(name) = attrs.map.get_mut(INPUT_NAMES_ATTR) {
                    *name = neff_input_name(name, true);
                }
            }
        }
        Ok(HloModuleProto {
            name: graph.name().to_string(),
            entry_computation_name: entry_name,
            computations,
            host_program_shape: Some(program),
            id: 1,
            entry_computation_id: entry_id,
            input_output_alias: (!aliases.is_empty())
                .then_some(HloInputOutputAliasProto { entries: aliases }),
        })
    }
}

/// The entry instructions the root depends on, in their order, plus every parameter (the
/// signature keeps them all). A lowering may leave an instruction unused (a transpose folded
/// into a `dot`); this drops it rather than hand neuronx-cc dead code.
fn live(mut entry: Vec<HloInstructionProto>, root: i64) -> Vec<HloInstructionProto> {
    let index: HashMap<i64, usize> = entry.iter().enumerate().map(|(k, i)| (i.id, k)).collect();
    let mut keep = vec![false; entry.len()];
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        if let Some(&k) = index.get(&id) {
            if !keep[k] {
                keep[k] = true;
                stack.extend(&entry[k].operand_ids);
            }
        }
    }
    // In place: a module's instructions are large structs, and collecting the kept ones into a
    // growing vector copied them over and over (a fifth of `deepinfer plan`'s time).
    let mut kept = keep.into_iter();
    entry.retain(|i| kept.next().unwrap_or(false) || i.opcode == opcodes::PARAMETER);
    entry
}

/// The identity of `op` in `dtype`, the init value of its `reduce`: 0 for a sum, the lowest
/// value for a max and the highest for a min (infinities where the type has them; f8e4m3fn has
/// none, so its finite extremes). A reduction over an empty dimension returns it, so the CPU
/// backend reads it from here too.
pub(crate) fn reduce_identity(op: ReduceOp, dtype: DType) -> f64 {
    let (lowest, highest) = match dtype {
        DType::F32 | DType::BF16 | DType::F16 => (f64::NEG_INFINITY, f64::INFINITY),
        DType::F8E4M3 => (-448.0, 448.0),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        DType::U32 => (0.0, u32::MAX as f64),
        DType::I8 => (i8::MIN as f64, i8::MAX as f64),
        DType::U8 => (0.0, u8::MAX as f64),
        DType::Bool => (0.0, 1.0),
    };
    match op {
        ReduceOp::Sum => 0.0,
        ReduceOp::Max => lowest,
        ReduceOp::Min => highest,
    }
}

fn comparison_type(t: PrimitiveType) -> &'static str {
    match t {
        PrimitiveType::F32 | PrimitiveType::F16 | PrimitiveType::Bf16 | PrimitiveType::F8e4m3fn => {
            "FLOAT"
        }
        PrimitiveType::S32 | PrimitiveType::S8 => "SIGNED",
        _ => "UNSIGNED",
    }
}
