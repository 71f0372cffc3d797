//! Graph -> `HloModuleProto`.
//!
//! The module follows the checklist XLA and neuronx-cc impose: named entry parameters
//! (`neff_input_names`), a tuple root (`neff_output_names`), `input_output_alias` (must-alias)
//! for every updated cache root, a row-major layout on every array shape, small ids unique in the
//! module (one counter for instructions and computations), callee computations before their
//! callers, instructions after their operands, and `host_program_shape` derived from the entry
//! computation.
//!
//! Each graph op has one lowering below; multi-instruction lowerings are plain HLO only:
//! `argmax` is reduce-max + compare + select(iota) + reduce-min (no sort), `topk` is a stable
//! descending `sort` of (value, iota) and a slice, `index_select`/`gather` are `gather`, and
//! `scatter_rows` is a `scatter` whose update computation returns the new value.

use std::collections::HashMap;

use prost::Message;

use super::primitive_type;
use super::proto::{
    hlo_input_output_alias_proto::AliasEntryProto, hlo_instruction_proto::SliceDimensions,
    DotDimensionNumbers, FrontendAttributes, GatherDimensionNumbers, HloComputationProto,
    HloInputOutputAliasProto, HloInstructionProto, HloModuleProto, Kind, LayoutProto, LiteralProto,
    PrimitiveType, ProgramShapeProto, ScatterDimensionNumbers, ShapeProto,
};
use crate::error::Result;
use crate::graph::{BinaryOp, DType, Graph, Literal, Op, ReduceOp, UnaryOp};

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
        entry: Vec::new(),
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
    Add,
    Max,
    Min,
    /// `lhs > rhs` on the first of two (key, index) pairs: a descending sort comparator.
    Greater,
    /// Returns its second argument: scatter's "assign".
    Second,
}

struct Emitter<'g> {
    graph: &'g Graph,
    next_id: i64,
    callees: Vec<HloComputationProto>,
    scalar_fns: HashMap<(ScalarFn, i32), i64>,
    entry: Vec<HloInstructionProto>,
    /// The instruction holding each node's value.
    value: Vec<i64>,
}

impl Emitter<'_> {
    fn id(&mut self) -> i64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

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

    fn constant(&mut self, lit: LiteralProto, shape: ShapeProto) -> i64 {
        self.push("constant", shape, &[], |i| i.literal = Some(lit))
    }

    /// A scalar constant of type `t`.
    fn scalar(&mut self, t: PrimitiveType, v: f64) -> i64 {
        let shape = array_shape(&[], t);
        let mut lit = LiteralProto {
            shape: Some(shape.clone()),
            ..Default::default()
        };
        match t {
            PrimitiveType::F32 => lit.f32s = vec![v as f32],
            PrimitiveType::S32 => lit.s32s = vec![v as i32],
            PrimitiveType::U32 => lit.u32s = vec![v as u32],
            PrimitiveType::Pred => lit.preds = vec![v != 0.0],
            _ => lit.u8s = vec![v as u8],
        }
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
            operand = self.push("reshape", array_shape(&dims, t), &[x], |_| {});
        }
        self.push("broadcast", array_shape(to, t), &[operand], |i| {
            i.dimensions = kept.iter().map(|&k| (off + k) as i64).collect();
        })
    }

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
            let mut inst = Self::make("parameter", id, shape.clone(), &[]);
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
                    ScalarFn::Add => ("add", s.clone()),
                    ScalarFn::Max => ("maximum", s.clone()),
                    ScalarFn::Min => ("minimum", s.clone()),
                    _ => ("compare", pred.clone()),
                };
                let mut inst = Self::make(opcode, id, shape, &[a, b]);
                if f == ScalarFn::Greater {
                    inst.comparison_direction = "GT".into();
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
            ScalarFn::Add => "add",
            ScalarFn::Max => "max",
            ScalarFn::Min => "min",
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

    fn reduce(&mut self, x: i64, dims: &[usize], dim: usize, f: ScalarFn, t: PrimitiveType) -> i64 {
        let init = match (f, t) {
            (ScalarFn::Add, _) => 0.0,
            (ScalarFn::Max, PrimitiveType::F32) => f64::NEG_INFINITY,
            (ScalarFn::Min, PrimitiveType::F32) => f64::INFINITY,
            (ScalarFn::Max, PrimitiveType::S32) => i32::MIN as f64,
            (ScalarFn::Min, PrimitiveType::S32) => i32::MAX as f64,
            (ScalarFn::Max, _) => 0.0,
            _ => u32::MAX as f64,
        };
        let init = self.scalar(t, init);
        let comp = self.scalar_fn(f, t);
        let mut out: Vec<usize> = dims.to_vec();
        out.remove(dim);
        self.push("reduce", array_shape(&out, t), &[x, init], |i| {
            i.dimensions = vec![dim as i64];
            i.called_computation_ids = vec![comp];
        })
    }

    fn lower(&mut self, node: usize, op: &Op) -> Result<i64> {
        let shape = self.shape_of(node);
        let t = primitive_type(self.dtype_of(node));
        let v = |n: &crate::graph::NodeId| self.value[n.0];
        Ok(match op {
            Op::Input(k) => {
                let decl = &self.graph.inputs()[*k];
                // `deepinfer_role` lets the importer restore the input's role; other consumers
                // ignore unknown frontend attributes.
                let map = [
                    ("neff_input_names".to_string(), decl.name.clone()),
                    ("deepinfer_role".to_string(), decl.role.name().to_string()),
                ]
                .into();
                self.push("parameter", shape, &[], |i| {
                    i.parameter_number = *k as i64;
                    i.frontend_attributes = Some(FrontendAttributes { map });
                })
            }
            Op::Constant(lit) => {
                let mut l = LiteralProto {
                    shape: Some(shape.clone()),
                    ..Default::default()
                };
                match lit {
                    Literal::F32(v) => l.f32s = v.clone(),
                    Literal::I32(v) => l.s32s = v.clone(),
                    Literal::U32(v) => l.u32s = v.clone(),
                }
                self.constant(l, shape)
            }
            Op::Iota { dim } => self.push("iota", shape, &[], |i| i.dimensions = vec![*dim as i64]),
            Op::Unary(u, x) => {
                let x = v(x);
                let opcode = match u {
                    UnaryOp::Neg => "negate",
                    UnaryOp::Abs => "abs",
                    UnaryOp::Exp => "exponential",
                    UnaryOp::Log => "log",
                    UnaryOp::Sqrt => "sqrt",
                    UnaryOp::Rsqrt => "rsqrt",
                    UnaryOp::Sin => "sine",
                    UnaryOp::Cos => "cosine",
                    UnaryOp::Tanh => "tanh",
                    UnaryOp::Sigmoid => "logistic",
                    UnaryOp::Silu => {
                        let s = self.push("logistic", shape.clone(), &[x], |_| {});
                        return Ok(self.push("multiply", shape, &[x, s], |_| {}));
                    }
                };
                self.push(opcode, shape, &[x], |_| {})
            }
            Op::Binary(b, x, y) => {
                let opcode = match b {
                    BinaryOp::Add => "add",
                    BinaryOp::Sub => "subtract",
                    BinaryOp::Mul => "multiply",
                    BinaryOp::Div => "divide",
                    BinaryOp::Rem => "remainder",
                    BinaryOp::Max => "maximum",
                    BinaryOp::Min => "minimum",
                    BinaryOp::BitXor => "xor",
                    BinaryOp::BitAnd => "and",
                    BinaryOp::Shr => "shift-right-logical",
                    BinaryOp::Shl => "shift-left",
                };
                let (x, y) = (v(x), v(y));
                self.push(opcode, shape, &[x, y], |_| {})
            }
            Op::Compare(c, x, y) => {
                let ct = comparison_type(primitive_type(self.dtype_of(x.0)));
                let (x, y) = (v(x), v(y));
                self.push("compare", shape, &[x, y], |i| {
                    i.comparison_direction = c.name().into();
                    i.comparison_type = ct.into();
                })
            }
            Op::Select {
                pred,
                on_true,
                on_false,
            } => {
                let ops = [v(pred), v(on_true), v(on_false)];
                self.push("select", shape, &ops, |_| {})
            }
            Op::Cast(x) => {
                let x = v(x);
                self.push("convert", shape, &[x], |_| {})
            }
            Op::Broadcast(x) => {
                let from = self.dims_of(x.0).to_vec();
                let to = self.dims_of(node).to_vec();
                let x = v(x);
                self.broadcast(x, &from, &to, t)
            }
            Op::Reshape(x) => {
                let x = v(x);
                self.push("reshape", shape, &[x], |_| {})
            }
            Op::Permute(x, perm) => {
                let x = v(x);
                self.push("transpose", shape, &[x], |i| {
                    i.dimensions = perm.iter().map(|&p| p as i64).collect()
                })
            }
            Op::Slice { x, dim, start, len } => {
                let dims = self.dims_of(x.0).to_vec();
                let x = v(x);
                self.push("slice", shape, &[x], |i| {
                    i.slice_dimensions = dims
                        .iter()
                        .enumerate()
                        .map(|(d, &n)| {
                            let (s, l) = if d == *dim {
                                (*start, start + len)
                            } else {
                                (0, n)
                            };
                            SliceDimensions {
                                start: s as i64,
                                limit: l as i64,
                                stride: 1,
                            }
                        })
                        .collect();
                })
            }
            Op::Concat(xs, dim) => {
                let ops: Vec<i64> = xs.iter().map(v).collect();
                self.push("concatenate", shape, &ops, |i| {
                    i.dimensions = vec![*dim as i64]
                })
            }
            Op::MatMul(a, b) => {
                let r = self.dims_of(a.0).len() as i64;
                let (a, b) = (v(a), v(b));
                self.push("dot", shape, &[a, b], |i| {
                    i.dot_dimension_numbers = Some(DotDimensionNumbers {
                        lhs_contracting_dimensions: vec![r - 1],
                        rhs_contracting_dimensions: vec![r - 2],
                        lhs_batch_dimensions: (0..r - 2).collect(),
                        rhs_batch_dimensions: (0..r - 2).collect(),
                    })
                })
            }
            Op::Reduce(r, x, dim) => {
                let dims = self.dims_of(x.0).to_vec();
                let f = match r {
                    ReduceOp::Sum => ScalarFn::Add,
                    ReduceOp::Max => ScalarFn::Max,
                    ReduceOp::Min => ScalarFn::Min,
                };
                let x = v(x);
                self.reduce(x, &dims, *dim, f, t)
            }
            Op::ArgMax(x, dim) => {
                let dims = self.dims_of(x.0).to_vec();
                let xt = primitive_type(self.dtype_of(x.0));
                let x = v(x);
                let max = self.reduce(x, &dims, *dim, ScalarFn::Max, xt);
                let mut reduced = dims.clone();
                reduced.remove(*dim);
                let maxb = self.push("broadcast", array_shape(&dims, xt), &[max], |i| {
                    i.dimensions = (0..dims.len())
                        .filter(|d| d != dim)
                        .map(|d| d as i64)
                        .collect();
                });
                let is_max = self.push(
                    "compare",
                    array_shape(&dims, PrimitiveType::Pred),
                    &[x, maxb],
                    |i| {
                        i.comparison_direction = "EQ".into();
                        i.comparison_type = comparison_type(xt).into();
                    },
                );
                let iota = self.push("iota", array_shape(&dims, PrimitiveType::S32), &[], |i| {
                    i.dimensions = vec![*dim as i64]
                });
                let big = self.scalar(PrimitiveType::S32, i32::MAX as f64);
                let bigb = self.broadcast(big, &[], &dims, PrimitiveType::S32);
                let sel = self.push(
                    "select",
                    array_shape(&dims, PrimitiveType::S32),
                    &[is_max, iota, bigb],
                    |_| {},
                );
                self.reduce(sel, &dims, *dim, ScalarFn::Min, PrimitiveType::S32)
            }
            Op::TopK(x, k) => {
                let dims = self.dims_of(x.0).to_vec();
                let xt = primitive_type(self.dtype_of(x.0));
                let last = dims.len() - 1;
                let x = v(x);
                let iota = self.push("iota", array_shape(&dims, PrimitiveType::S32), &[], |i| {
                    i.dimensions = vec![last as i64]
                });
                let cmp = self.scalar_fn(ScalarFn::Greater, xt);
                let sorted = self.push(
                    "sort",
                    tuple_shape(vec![
                        array_shape(&dims, xt),
                        array_shape(&dims, PrimitiveType::S32),
                    ]),
                    &[x, iota],
                    |i| {
                        i.dimensions = vec![last as i64];
                        i.called_computation_ids = vec![cmp];
                        i.is_stable = true;
                    },
                );
                let idx = self.push(
                    "get-tuple-element",
                    array_shape(&dims, PrimitiveType::S32),
                    &[sorted],
                    |i| i.tuple_index = 1,
                );
                self.push("slice", shape, &[idx], |i| {
                    i.slice_dimensions = dims
                        .iter()
                        .enumerate()
                        .map(|(d, &n)| SliceDimensions {
                            start: 0,
                            limit: if d == last { *k } else { n } as i64,
                            stride: 1,
                        })
                        .collect();
                })
            }
            Op::IndexSelect { x, ids, dim } => {
                let dims = self.dims_of(x.0).to_vec();
                let n = self.dims_of(ids.0)[0];
                let (x, ids) = (v(x), v(ids));
                let idx = self.push(
                    "reshape",
                    array_shape(&[n, 1], PrimitiveType::S32),
                    &[ids],
                    |_| {},
                );
                let mut sizes: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
                sizes[*dim] = 1;
                self.push("gather", shape, &[x, idx], |i| {
                    i.gather_dimension_numbers = Some(GatherDimensionNumbers {
                        offset_dims: (0..dims.len() as i64)
                            .filter(|&d| d != *dim as i64)
                            .collect(),
                        collapsed_slice_dims: vec![*dim as i64],
                        start_index_map: vec![*dim as i64],
                        index_vector_dim: 1,
                        ..Default::default()
                    });
                    i.gather_slice_sizes = sizes;
                })
            }
            Op::Gather { x, ids, dim } => {
                // Full coordinates: iota along every dim except `dim`, which takes `ids`.
                let out = self.dims_of(ids.0).to_vec();
                let r = out.len();
                let (x, ids) = (v(x), v(ids));
                let mut coord_dims = out.clone();
                coord_dims.push(1);
                let mut coords = Vec::new();
                for d in 0..r {
                    let c = if d == *dim {
                        self.push(
                            "reshape",
                            array_shape(&coord_dims, PrimitiveType::S32),
                            &[ids],
                            |_| {},
                        )
                    } else {
                        self.push(
                            "iota",
                            array_shape(&coord_dims, PrimitiveType::S32),
                            &[],
                            |i| i.dimensions = vec![d as i64],
                        )
                    };
                    coords.push(c);
                }
                let mut all = out.clone();
                all.push(r);
                let index = self.push(
                    "concatenate",
                    array_shape(&all, PrimitiveType::S32),
                    &coords,
                    |i| i.dimensions = vec![r as i64],
                );
                self.push("gather", shape, &[x, index], |i| {
                    i.gather_dimension_numbers = Some(GatherDimensionNumbers {
                        offset_dims: vec![],
                        collapsed_slice_dims: (0..r as i64).collect(),
                        start_index_map: (0..r as i64).collect(),
                        index_vector_dim: r as i64,
                        ..Default::default()
                    });
                    i.gather_slice_sizes = vec![1; r];
                })
            }
            Op::ScatterRows {
                root,
                rows,
                col,
                src,
            } => {
                let n = self.dims_of(rows.0)[0];
                let (root, rows, src) = (v(root), v(rows), v(src));
                let r = self.push(
                    "reshape",
                    array_shape(&[n, 1], PrimitiveType::S32),
                    &[rows],
                    |_| {},
                );
                let c = self.scalar(PrimitiveType::S32, *col as f64);
                let cb = self.broadcast(c, &[], &[n, 1], PrimitiveType::S32);
                let idx = self.push(
                    "concatenate",
                    array_shape(&[n, 2], PrimitiveType::S32),
                    &[r, cb],
                    |i| i.dimensions = vec![1],
                );
                let assign = self.scalar_fn(ScalarFn::Second, t);
                self.push("scatter", shape, &[root, idx, src], |i| {
                    i.scatter_dimension_numbers = Some(ScatterDimensionNumbers {
                        update_window_dims: vec![1],
                        inserted_window_dims: vec![0],
                        scatter_dims_to_operand_dims: vec![0, 1],
                        index_vector_dim: 1,
                        ..Default::default()
                    });
                    i.called_computation_ids = vec![assign];
                })
            }
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
        let root = self.push("tuple", tuple_shape(out_shapes.clone()), &outs, |i| {
            i.frontend_attributes = Some(FrontendAttributes {
                map: [("neff_output_names".to_string(), names)].into(),
            });
        });
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
        let mut computations = std::mem::take(&mut self.callees);
        computations.push(HloComputationProto {
            name: entry_name.clone(),
            instructions: std::mem::take(&mut self.entry),
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

fn comparison_type(t: PrimitiveType) -> &'static str {
    match t {
        PrimitiveType::F32 | PrimitiveType::F16 | PrimitiveType::Bf16 => "FLOAT",
        PrimitiveType::S32 => "SIGNED",
        _ => "UNSIGNED",
    }
}
