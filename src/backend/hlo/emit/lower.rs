//! One lowering per graph op.
//!
//! Unary, binary, compare and reduce ops take their opcode (or direction, or combiner) from the
//! op tables in `graph::op`, so nothing here restates which opcode an op is. The other ops are
//! one instruction with attributes, or a plain-HLO structure that the importer recognises:
//! `silu` is `multiply(x, logistic(x))`, `argmax` is reduce-max + compare + select(iota) +
//! reduce-min (no sort), `topk` is a stable descending `sort` of (value, iota) and a slice,
//! `index_select`/`gather` are `gather`, and `scatter_rows` is a `scatter` whose update
//! computation returns the new value.

use super::{array_shape, comparison_type, tuple_shape, Emitter, ScalarFn};
use crate::backend::hlo::proto::{
    hlo_instruction_proto::SliceDimensions, DotDimensionNumbers, FrontendAttributes,
    GatherDimensionNumbers, PrimitiveType, ReplicaGroup, ScatterDimensionNumbers, ShapeProto,
};
use crate::backend::hlo::{literal, opcodes, primitive_type, INPUT_NAMES_ATTR, ROLE_ATTR};
use crate::error::{Error, Result};
use crate::graph::{BinaryOp, CmpOp, DType, NodeId, Op, ReduceOp, UnaryOp};

/// The error for an op the emitter has no lowering for: a defensive arm, since every op of the
/// tables has an opcode or a composite lowering below (the round-trip tests cover each one).
fn no_lowering(op: &'static str) -> Error {
    Error::Internal(format!("graph op `{op}` has no HLO lowering"))
}

/// The one replica group of a tensor-parallel graph: all `ranks` replicas (cross-replica mode:
/// no channel id, replica ids rather than global device ids, as XLA and neuronx-cc read a
/// module compiled with `num_replicas = ranks`).
fn every_replica(ranks: usize) -> ReplicaGroup {
    ReplicaGroup {
        replica_ids: (0..ranks as i64).collect(),
    }
}

impl Emitter<'_> {
    /// The instruction holding node `n`'s value.
    fn value_of(&self, n: &NodeId) -> i64 {
        self.value[n.0]
    }

    /// Lowers node `node`, whose operands are lowered already; returns the instruction holding
    /// its value.
    pub(super) fn lower(&mut self, node: usize, op: &Op) -> Result<i64> {
        let shape = self.shape_of(node);
        let t = primitive_type(self.dtype_of(node));
        let v = |n: &NodeId| self.value_of(n);
        Ok(match op {
            Op::Input(k) => self.lower_input(*k, shape),
            Op::Constant(lit) => self.constant(literal::to_proto(lit, shape.clone()), shape),
            Op::Iota { dim } => self.push(opcodes::IOTA, shape, &[], |i| {
                i.dimensions = vec![*dim as i64]
            }),
            Op::Unary(u, x) => {
                let x = v(x);
                self.lower_unary(*u, x, shape)?
            }
            Op::Binary(b, x, y) => {
                let (x, y) = (v(x), v(y));
                self.push(b.hlo_opcode(), shape, &[x, y], |_| {})
            }
            Op::Compare(c, x, y) => {
                let xt = primitive_type(self.dtype_of(x.0));
                let (x, y) = (v(x), v(y));
                self.compare(*c, x, y, shape, xt)
            }
            Op::Select {
                pred,
                on_true,
                on_false,
            } => {
                let ops = [v(pred), v(on_true), v(on_false)];
                self.push(opcodes::SELECT, shape, &ops, |_| {})
            }
            Op::Cast(x) => {
                let x = v(x);
                self.push(opcodes::CONVERT, shape, &[x], |_| {})
            }
            Op::Broadcast(x) => {
                let from = self.dims_of(x.0).to_vec();
                let to = self.dims_of(node).to_vec();
                let x = v(x);
                self.broadcast(x, &from, &to, t)
            }
            Op::Reshape(x) => {
                let x = v(x);
                self.push(opcodes::RESHAPE, shape, &[x], |_| {})
            }
            Op::Permute(x, perm) => {
                let x = v(x);
                self.push(opcodes::TRANSPOSE, shape, &[x], |i| {
                    i.dimensions = perm.iter().map(|&p| p as i64).collect()
                })
            }
            Op::Slice { x, dim, start, len } => {
                let dims = self.dims_of(x.0).to_vec();
                let x = v(x);
                self.push(opcodes::SLICE, shape, &[x], |i| {
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
                self.push(opcodes::CONCATENATE, shape, &ops, |i| {
                    i.dimensions = vec![*dim as i64]
                })
            }
            Op::MatMul(a, b) => self.lower_matmul(*a, *b, shape),
            Op::Reduce(r, x, dim) => {
                let dims = self.dims_of(x.0).to_vec();
                let x = v(x);
                self.reduce(x, &dims, *dim, *r, self.dtype_of(node))
            }
            Op::ArgMax(x, dim) => self.lower_argmax(*x, *dim),
            Op::TopK(x, k) => self.lower_topk(*x, *k, shape),
            Op::MassThreshold { x, w, target } => {
                let (rows, n) = (self.dims_of(x.0)[0], self.dims_of(x.0)[1]);
                let (x, w, target) = (v(x), v(w), v(target));
                self.lower_mass_threshold(x, w, target, rows, n)
            }
            Op::Dequantize4Bit {
                codes,
                scales,
                group,
                format,
            } => {
                let dims = self.dims_of(codes.0).to_vec();
                let groups = *self.dims_of(scales.0).last().unwrap_or(&0);
                let (codes, scales) = (v(codes), v(scales));
                let out = self.dtype_of(node);
                self.lower_dequantize_4bit(codes, scales, &dims, groups, *group, *format, out)
            }
            Op::IndexSelect { x, ids, dim } => self.lower_index_select(*x, *ids, *dim, shape),
            Op::Gather { x, ids, dim } => self.lower_gather(*x, *ids, *dim, shape),
            Op::AllReduce { op, x, ranks } => {
                let x = v(x);
                let comp = self.scalar_fn(ScalarFn::Combine(op.combiner()), t);
                self.push(opcodes::ALL_REDUCE, shape, &[x], |i| {
                    i.called_computation_ids = vec![comp];
                    i.replica_groups = vec![every_replica(*ranks)];
                })
            }
            Op::AllGather { x, dim, ranks } => {
                let x = v(x);
                self.push(opcodes::ALL_GATHER, shape, &[x], |i| {
                    i.dimensions = vec![*dim as i64];
                    i.replica_groups = vec![every_replica(*ranks)];
                })
            }
            Op::ScatterRows {
                root,
                rows,
                col,
                src,
            } => self.lower_scatter_rows(*root, *rows, *col, *src, shape, t),
        })
    }

    /// Entry parameter `k`, named for the runtime (`neff_input_names`) and tagged with its role.
    /// A matmul as one `dot`. A right operand that is a transpose of its last two dims (a
    /// weight used as `[out, in]`, a cache read as keys), possibly through converts, is not
    /// transposed: the `dot` contracts its last dim instead (`rhs_contracting_dimensions =
    /// [rank - 1]`), and the converts are applied to the untransposed value. The transpose and
    /// any convert no other instruction uses are then dead, and [`Emitter::finish`] drops them,
    /// so no graph makes a transposed copy of a weight per step (issue 13: neuronx-cc does not
    /// promise to fold it).
    fn lower_matmul(&mut self, a: NodeId, b: NodeId, shape: ShapeProto) -> i64 {
        let r = self.dims_of(a.0).len() as i64;
        let (rhs, contracting) = match self.transposed_operand(b) {
            Some((base, casts)) => {
                let dims = self.dims_of(base.0).to_vec();
                let mut x = self.value_of(&base);
                for dtype in casts {
                    let to = array_shape(&dims, primitive_type(dtype));
                    x = self.push(opcodes::CONVERT, to, &[x], |_| {});
                }
                (x, r - 1)
            }
            None => (self.value_of(&b), r - 2),
        };
        let lhs = self.value_of(&a);
        self.push(opcodes::DOT, shape, &[lhs, rhs], |i| {
            i.dot_dimension_numbers = Some(DotDimensionNumbers {
                lhs_contracting_dimensions: vec![r - 1],
                rhs_contracting_dimensions: vec![contracting],
                lhs_batch_dimensions: (0..r - 2).collect(),
                rhs_batch_dimensions: (0..r - 2).collect(),
            })
        })
    }

    /// When `n` is `cast(...cast(permute(base)))` with the permute swapping the last two dims
    /// only: `base` and the casts' dtypes, innermost first.
    fn transposed_operand(&self, mut n: NodeId) -> Option<(NodeId, Vec<DType>)> {
        let mut casts = Vec::new();
        while let Op::Cast(x) = self.graph.node(n).op {
            casts.push(self.dtype_of(n.0));
            n = x;
        }
        let op = &self.graph.node(n).op;
        let Op::Permute(base, _) = *op else {
            return None;
        };
        casts.reverse();
        op.is_matrix_transpose().then_some((base, casts))
    }

    fn lower_input(&mut self, k: usize, shape: ShapeProto) -> i64 {
        let decl = &self.graph.inputs()[k];
        // The role attribute lets the importer restore the input's role; other consumers
        // ignore unknown frontend attributes.
        let map = [
            (INPUT_NAMES_ATTR.to_string(), decl.name.clone()),
            (ROLE_ATTR.to_string(), decl.role.name().to_string()),
        ]
        .into();
        self.push(opcodes::PARAMETER, shape, &[], |i| {
            i.parameter_number = k as i64;
            i.frontend_attributes = Some(FrontendAttributes { map });
        })
    }

    /// One instruction from the unary table, or the composite the table marks with `None`.
    fn lower_unary(&mut self, u: UnaryOp, x: i64, shape: ShapeProto) -> Result<i64> {
        if let Some(opcode) = u.hlo_opcode() {
            return Ok(self.push(opcode, shape, &[x], |_| {}));
        }
        match u {
            UnaryOp::Silu => {
                let s = self.lower_unary(UnaryOp::Sigmoid, x, shape.clone())?;
                Ok(self.push(BinaryOp::Mul.hlo_opcode(), shape, &[x, s], |_| {}))
            }
            other => Err(no_lowering(other.name())),
        }
    }

    /// `compare` in direction `c` of two operands of element type `xt`.
    pub(super) fn compare(
        &mut self,
        c: CmpOp,
        x: i64,
        y: i64,
        shape: ShapeProto,
        xt: PrimitiveType,
    ) -> i64 {
        self.push(opcodes::COMPARE, shape, &[x, y], |i| {
            i.comparison_direction = c.name().into();
            i.comparison_type = comparison_type(xt).into();
        })
    }

    /// The first index of the maximum, a NaN counting as the maximum (the first NaN's index, as
    /// `torch.argmax` and numpy answer): reduce-max, compare with it, select the iota where
    /// equal (`i32::MAX` elsewhere), reduce-min; the same for `x != x` (NaN), whose index wins
    /// when there is one. Without the NaN half a row holding a NaN has a NaN maximum equal to
    /// nothing, and the index would be `i32::MAX`, outside the row; a NaN-skipping maximum (the
    /// CPU backend's, under nrt-sim) would give another index than XLA's.
    fn lower_argmax(&mut self, x: NodeId, dim: usize) -> i64 {
        let dims = self.dims_of(x.0).to_vec();
        let x_dtype = self.dtype_of(x.0);
        let xt = primitive_type(x_dtype);
        let x = self.value_of(&x);
        let max = self.reduce(x, &dims, dim, ReduceOp::Max, x_dtype);
        let maxb = self.push(opcodes::BROADCAST, array_shape(&dims, xt), &[max], |i| {
            i.dimensions = (0..dims.len())
                .filter(|&d| d != dim)
                .map(|d| d as i64)
                .collect();
        });
        let pred = array_shape(&dims, PrimitiveType::Pred);
        let is_max = self.compare(CmpOp::Eq, x, maxb, pred.clone(), xt);
        let is_nan = self.compare(CmpOp::Ne, x, x, pred, xt);
        let s32 = array_shape(&dims, PrimitiveType::S32);
        let iota = self.push(opcodes::IOTA, s32.clone(), &[], |i| {
            i.dimensions = vec![dim as i64]
        });
        let big = self.scalar(DType::I32, i32::MAX as f64);
        let bigb = self.broadcast(big, &[], &dims, PrimitiveType::S32);
        let first_of = |e: &mut Self, mask: i64| {
            let sel = e.push(opcodes::SELECT, s32.clone(), &[mask, iota, bigb], |_| {});
            e.reduce(sel, &dims, dim, ReduceOp::Min, DType::I32)
        };
        let max_at = first_of(self, is_max);
        let nan_at = first_of(self, is_nan);
        let out: Vec<usize> = dims
            .iter()
            .enumerate()
            .filter(|&(d, _)| d != dim)
            .map(|(_, &n)| n)
            .collect();
        let big_out = self.broadcast(big, &[], &out, PrimitiveType::S32);
        let has_nan = self.compare(
            CmpOp::Lt,
            nan_at,
            big_out,
            array_shape(&out, PrimitiveType::Pred),
            PrimitiveType::S32,
        );
        self.push(
            opcodes::SELECT,
            array_shape(&out, PrimitiveType::S32),
            &[has_nan, nan_at, max_at],
            |_| {},
        )
    }

    /// The indices of the `k` largest along the last dim: a stable descending sort of (value,
    /// iota), its index half, sliced to `k`.
    fn lower_topk(&mut self, x: NodeId, k: usize, shape: ShapeProto) -> i64 {
        let dims = self.dims_of(x.0).to_vec();
        let xt = primitive_type(self.dtype_of(x.0));
        let last = dims.len() - 1;
        let x = self.value_of(&x);
        let s32 = array_shape(&dims, PrimitiveType::S32);
        let iota = self.push(opcodes::IOTA, s32.clone(), &[], |i| {
            i.dimensions = vec![last as i64]
        });
        let cmp = self.scalar_fn(ScalarFn::Greater, xt);
        let sorted = self.push(
            opcodes::SORT,
            tuple_shape(vec![array_shape(&dims, xt), s32.clone()]),
            &[x, iota],
            |i| {
                i.dimensions = vec![last as i64];
                i.called_computation_ids = vec![cmp];
                i.is_stable = true;
            },
        );
        let idx = self.push(opcodes::GET_TUPLE_ELEMENT, s32, &[sorted], |i| {
            i.tuple_index = 1
        });
        self.push(opcodes::SLICE, shape, &[idx], |i| {
            i.slice_dimensions = dims
                .iter()
                .enumerate()
                .map(|(d, &n)| SliceDimensions {
                    start: 0,
                    limit: if d == last { k } else { n } as i64,
                    stride: 1,
                })
                .collect();
        })
    }

    /// A `gather` of whole slices of `dim`, one per id (index vector of length 1).
    fn lower_index_select(&mut self, x: NodeId, ids: NodeId, dim: usize, shape: ShapeProto) -> i64 {
        let dims = self.dims_of(x.0).to_vec();
        let n = self.dims_of(ids.0)[0];
        let (x, ids) = (self.value_of(&x), self.value_of(&ids));
        let idx = self.push(
            opcodes::RESHAPE,
            array_shape(&[n, 1], PrimitiveType::S32),
            &[ids],
            |_| {},
        );
        let mut sizes: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        sizes[dim] = 1;
        self.push(opcodes::GATHER, shape, &[x, idx], |i| {
            i.gather_dimension_numbers = Some(GatherDimensionNumbers {
                offset_dims: (0..dims.len() as i64)
                    .filter(|&d| d != dim as i64)
                    .collect(),
                collapsed_slice_dims: vec![dim as i64],
                start_index_map: vec![dim as i64],
                index_vector_dim: 1,
                ..Default::default()
            });
            i.gather_slice_sizes = sizes;
        })
    }

    /// A `gather` of single elements at full coordinates: iota along every dim except `dim`,
    /// which takes `ids`.
    fn lower_gather(&mut self, x: NodeId, ids: NodeId, dim: usize, shape: ShapeProto) -> i64 {
        let out = self.dims_of(ids.0).to_vec();
        let r = out.len();
        let (x, ids) = (self.value_of(&x), self.value_of(&ids));
        let mut coord_dims = out.clone();
        coord_dims.push(1);
        let coord_shape = array_shape(&coord_dims, PrimitiveType::S32);
        let mut coords = Vec::new();
        for d in 0..r {
            let c = if d == dim {
                self.push(opcodes::RESHAPE, coord_shape.clone(), &[ids], |_| {})
            } else {
                self.push(opcodes::IOTA, coord_shape.clone(), &[], |i| {
                    i.dimensions = vec![d as i64]
                })
            };
            coords.push(c);
        }
        let mut all = out.clone();
        all.push(r);
        let index = self.push(
            opcodes::CONCATENATE,
            array_shape(&all, PrimitiveType::S32),
            &coords,
            |i| i.dimensions = vec![r as i64],
        );
        self.push(opcodes::GATHER, shape, &[x, index], |i| {
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

    /// A `scatter` of `src`'s rows at (`rows[i]`, `col`), whose update computation returns the
    /// new value; the indices are `concatenate(reshape(rows), broadcast(col))`.
    fn lower_scatter_rows(
        &mut self,
        root: NodeId,
        rows: NodeId,
        col: usize,
        src: NodeId,
        shape: ShapeProto,
        t: PrimitiveType,
    ) -> i64 {
        let n = self.dims_of(rows.0)[0];
        let (root, rows, src) = (
            self.value_of(&root),
            self.value_of(&rows),
            self.value_of(&src),
        );
        let r = self.push(
            opcodes::RESHAPE,
            array_shape(&[n, 1], PrimitiveType::S32),
            &[rows],
            |_| {},
        );
        let c = self.scalar(DType::I32, col as f64);
        let cb = self.broadcast(c, &[], &[n, 1], PrimitiveType::S32);
        let idx = self.push(
            opcodes::CONCATENATE,
            array_shape(&[n, 2], PrimitiveType::S32),
            &[r, cb],
            |i| i.dimensions = vec![1],
        );
        let assign = self.scalar_fn(ScalarFn::Second, t);
        self.push(opcodes::SCATTER, shape, &[root, idx, src], |i| {
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
}
