//! Building graphs through a candle-shaped API on symbolic tensors.
//!
//! A [`Tensor`] here holds no data: it is a node id plus the node's shape and dtype, and a handle
//! on the builder it belongs to, so the model reads like candle code (`x.matmul(&w.t()?)?`). Each
//! method checks its operands when called and fails with [`Error::Shape`] naming the op and the
//! shapes, so a mistake in the model surfaces where it is made, not when a backend runs it.
//!
//! The builder is single-threaded (`Rc<RefCell<..>>`): a graph is built on one thread, then
//! [`GraphBuilder::finish`] turns it into an immutable, shareable [`Graph`].

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::sync::Arc;

use super::{
    BinaryOp, CmpOp, DType, Graph, GraphInner, InputDecl, InputRole, Literal, Node, NodeId, Op,
    OutputDecl, ReduceOp, Shape, UnaryOp,
};
use crate::error::{Error, Result};

#[derive(Debug)]
struct BuilderState {
    name: String,
    nodes: Vec<Node>,
    inputs: Vec<InputDecl>,
    outputs: Vec<OutputDecl>,
    input_names: HashSet<String>,
    output_names: HashSet<String>,
}

/// Builds one [`Graph`]. Cloning yields another handle on the same graph under construction.
#[derive(Debug, Clone)]
pub struct GraphBuilder(Rc<RefCell<BuilderState>>);

/// A symbolic value of a graph under construction.
#[derive(Debug, Clone)]
pub struct Tensor {
    id: NodeId,
    shape: Shape,
    dtype: DType,
    builder: GraphBuilder,
}

fn shape_err(op: &'static str, msg: String) -> Error {
    Error::shape(op, msg)
}

impl GraphBuilder {
    /// Starts an empty graph.
    pub fn new(name: impl Into<String>) -> Self {
        GraphBuilder(Rc::new(RefCell::new(BuilderState {
            name: name.into(),
            nodes: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            input_names: HashSet::new(),
            output_names: HashSet::new(),
        })))
    }

    fn push(&self, op: Op, shape: Shape, dtype: DType) -> Tensor {
        let mut st = self.0.borrow_mut();
        let id = NodeId(st.nodes.len());
        st.nodes.push(Node {
            op,
            shape: shape.clone(),
            dtype,
        });
        Tensor {
            id,
            shape,
            dtype,
            builder: self.clone(),
        }
    }

    /// Declares an input. Input names are unique (outputs have their own namespace, so an
    /// updated root may keep its input's name).
    pub fn input(
        &self,
        name: impl Into<String>,
        role: InputRole,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<Tensor> {
        let name = name.into();
        let shape = shape.into();
        if !self.0.borrow_mut().input_names.insert(name.clone()) {
            return Err(shape_err("input", format!("duplicate name `{name}`")));
        }
        let index = self.0.borrow().inputs.len();
        let t = self.push(Op::Input(index), shape.clone(), dtype);
        self.0.borrow_mut().inputs.push(InputDecl {
            name,
            role,
            node: t.id,
            shape,
            dtype,
        });
        Ok(t)
    }

    /// A constant of the given shape; the literal's type decides the dtype.
    pub fn constant(&self, literal: Literal, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if literal.len() != shape.elem_count() {
            return Err(shape_err(
                "constant",
                format!("{} values for shape {shape}", literal.len()),
            ));
        }
        let dtype = match literal {
            Literal::F32(_) => DType::F32,
            Literal::I32(_) => DType::I32,
            Literal::U32(_) => DType::U32,
        };
        Ok(self.push(Op::Constant(literal), shape, dtype))
    }

    /// A scalar f32 constant.
    pub fn scalar_f32(&self, v: f32) -> Tensor {
        self.push(
            Op::Constant(Literal::F32(vec![v])),
            Shape(vec![]),
            DType::F32,
        )
    }

    /// A scalar i32 constant.
    pub fn scalar_i32(&self, v: i32) -> Tensor {
        self.push(
            Op::Constant(Literal::I32(vec![v])),
            Shape(vec![]),
            DType::I32,
        )
    }

    /// A scalar u32 constant.
    pub fn scalar_u32(&self, v: u32) -> Tensor {
        self.push(
            Op::Constant(Literal::U32(vec![v])),
            Shape(vec![]),
            DType::U32,
        )
    }

    /// A scalar constant of any numeric dtype, broadcast to `shape`.
    pub fn full(&self, v: f64, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let scalar = match dtype {
            DType::F32 => self.scalar_f32(v as f32),
            DType::I32 => self.scalar_i32(v as i32),
            DType::U32 => self.scalar_u32(v as u32),
            other => self.scalar_f32(v as f32).to_dtype(other)?,
        };
        scalar.broadcast_as(shape)
    }

    /// Each element holds its index along `dim`.
    pub fn iota(&self, shape: impl Into<Shape>, dtype: DType, dim: usize) -> Result<Tensor> {
        let shape = shape.into();
        if dim >= shape.rank() || !(dtype == DType::I32 || dtype == DType::F32) {
            return Err(shape_err(
                "iota",
                format!("dim {dim} of shape {shape} as {dtype}"),
            ));
        }
        Ok(self.push(Op::Iota { dim }, shape, dtype))
    }

    /// Joins tensors along `dim`; all other dims and the dtype must agree.
    pub fn cat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        let first = xs
            .first()
            .ok_or_else(|| shape_err("concat", "no operands".into()))?;
        let mut dims = first.shape.0.clone();
        if dim >= dims.len() {
            return Err(shape_err(
                "concat",
                format!("dim {dim} of shape {}", first.shape),
            ));
        }
        for x in &xs[1..] {
            let same_rest = x.shape.rank() == dims.len()
                && x.shape
                    .0
                    .iter()
                    .enumerate()
                    .all(|(i, &d)| i == dim || d == dims[i]);
            if !same_rest || x.dtype != first.dtype {
                return Err(shape_err(
                    "concat",
                    format!(
                        "{} {} and {} {} along dim {dim}",
                        first.shape, first.dtype, x.shape, x.dtype
                    ),
                ));
            }
            dims[dim] += x.shape.0[dim];
        }
        let ids = xs.iter().map(|x| x.id).collect();
        Ok(self.push(Op::Concat(ids, dim), Shape(dims), first.dtype))
    }

    /// Declares an output.
    pub fn output(&self, name: impl Into<String>, value: &Tensor) -> Result<()> {
        self.add_output(name.into(), value, None)
    }

    /// Declares an output that replaces cache-root input `root` in place: same shape and dtype,
    /// and the runtime binds one buffer as both (HLO `input_output_alias`, must-alias).
    pub fn output_aliased(
        &self,
        name: impl Into<String>,
        value: &Tensor,
        root: &Tensor,
    ) -> Result<()> {
        let st = self.0.borrow();
        let index = st
            .inputs
            .iter()
            .position(|i| i.node == root.id && i.role == InputRole::CacheRoot)
            .ok_or_else(|| {
                shape_err(
                    "output",
                    "an alias target must be a cache-root input".into(),
                )
            })?;
        drop(st);
        if value.shape != root.shape || value.dtype != root.dtype {
            return Err(shape_err(
                "output",
                format!(
                    "aliased output {} {} differs from its root {} {}",
                    value.shape, value.dtype, root.shape, root.dtype
                ),
            ));
        }
        self.add_output(name.into(), value, Some(index))
    }

    fn add_output(&self, name: String, value: &Tensor, aliases: Option<usize>) -> Result<()> {
        let mut st = self.0.borrow_mut();
        if !st.output_names.insert(name.clone()) {
            return Err(shape_err("output", format!("duplicate name `{name}`")));
        }
        if aliases.is_some() && st.outputs.iter().any(|o| o.aliases == aliases) {
            return Err(shape_err("output", format!("`{name}`: root aliased twice")));
        }
        st.outputs.push(OutputDecl {
            name,
            node: value.id,
            aliases,
        });
        Ok(())
    }

    /// Finishes the graph. Nodes that no output depends on are kept (they are cheap and rare);
    /// a graph with no output is an error.
    pub fn finish(self) -> Result<Graph> {
        let st = self.0.borrow();
        if st.outputs.is_empty() {
            return Err(shape_err(
                "finish",
                format!("graph `{}` has no output", st.name),
            ));
        }
        Ok(Graph(Arc::new(GraphInner {
            name: st.name.clone(),
            nodes: st.nodes.clone(),
            inputs: st.inputs.clone(),
            outputs: st.outputs.clone(),
        })))
    }
}

/// Broadcasts `from` to `to` (dims aligned right, each 1 or equal).
fn broadcast_compatible(from: &Shape, to: &Shape) -> bool {
    if from.rank() > to.rank() {
        return false;
    }
    let off = to.rank() - from.rank();
    from.0
        .iter()
        .enumerate()
        .all(|(i, &d)| d == 1 || d == to.0[off + i])
}

/// The shape both operands broadcast to, if any.
fn broadcast_shape(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let mut out = vec![0; rank];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + a.rank() >= rank {
            a.0[i + a.rank() - rank]
        } else {
            1
        };
        let db = if i + b.rank() >= rank {
            b.0[i + b.rank() - rank]
        } else {
            1
        };
        *o = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(Shape(out))
}

impl Tensor {
    /// The node this tensor names.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The static shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimension sizes.
    pub fn dims(&self) -> &[usize] {
        &self.shape.0
    }

    /// Size of dimension `d`.
    pub fn dim(&self, d: usize) -> usize {
        self.shape.0[d]
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The builder this tensor belongs to.
    pub fn builder(&self) -> &GraphBuilder {
        &self.builder
    }

    fn push(&self, op: Op, shape: Shape, dtype: DType) -> Tensor {
        self.builder.push(op, shape, dtype)
    }

    fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let ok = match op {
            UnaryOp::Neg | UnaryOp::Abs => self.dtype != DType::Bool && self.dtype != DType::U32,
            _ => self.dtype.is_float(),
        };
        if !ok {
            return Err(shape_err(
                op.name(),
                format!("operand of dtype {}", self.dtype),
            ));
        }
        Ok(self.push(Op::Unary(op, self.id), self.shape.clone(), self.dtype))
    }

    /// `-x`.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    /// `|x|`.
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    /// `e^x`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    /// `1 / sqrt(x)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Rsqrt)
    }
    /// Sine.
    pub fn sin(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sin)
    }
    /// Cosine.
    pub fn cos(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Cos)
    }
    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }
    /// Logistic sigmoid.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sigmoid)
    }
    /// `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Silu)
    }

    fn binary(&self, op: BinaryOp, rhs: &Tensor) -> Result<Tensor> {
        if self.shape != rhs.shape || self.dtype != rhs.dtype {
            return Err(shape_err(
                op.name(),
                format!(
                    "operands {} {} and {} {} differ (broadcast explicitly)",
                    self.shape, self.dtype, rhs.shape, rhs.dtype
                ),
            ));
        }
        let ok = if op.int_only() {
            self.dtype.is_int()
        } else {
            self.dtype != DType::Bool
        };
        if !ok {
            return Err(shape_err(
                op.name(),
                format!("operands of dtype {}", self.dtype),
            ));
        }
        Ok(self.push(
            Op::Binary(op, self.id, rhs.id),
            self.shape.clone(),
            self.dtype,
        ))
    }

    /// Both operands broadcast to their common shape first.
    fn broadcast_binary(&self, op: BinaryOp, rhs: &Tensor) -> Result<Tensor> {
        let shape = broadcast_shape(&self.shape, &rhs.shape).ok_or_else(|| {
            shape_err(
                op.name(),
                format!("shapes {} and {} do not broadcast", self.shape, rhs.shape),
            )
        })?;
        self.broadcast_as(shape.clone())?
            .binary(op, &rhs.broadcast_as(shape)?)
    }

    /// `a + b`.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, rhs)
    }
    /// `a - b`.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, rhs)
    }
    /// `a * b`.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, rhs)
    }
    /// `a / b`.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, rhs)
    }
    /// Integer remainder.
    pub fn rem(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Rem, rhs)
    }
    /// Elementwise maximum.
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Max, rhs)
    }
    /// Elementwise minimum.
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Min, rhs)
    }
    /// Bitwise xor.
    pub fn bitxor(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::BitXor, rhs)
    }
    /// Bitwise and.
    pub fn bitand(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::BitAnd, rhs)
    }
    /// Logical shift right.
    pub fn shr(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Shr, rhs)
    }
    /// Shift left.
    pub fn shl(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Shl, rhs)
    }
    /// `a + b` after broadcasting.
    pub fn broadcast_add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.broadcast_binary(BinaryOp::Add, rhs)
    }
    /// `a - b` after broadcasting.
    pub fn broadcast_sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.broadcast_binary(BinaryOp::Sub, rhs)
    }
    /// `a * b` after broadcasting.
    pub fn broadcast_mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.broadcast_binary(BinaryOp::Mul, rhs)
    }
    /// `a / b` after broadcasting.
    pub fn broadcast_div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.broadcast_binary(BinaryOp::Div, rhs)
    }
    /// Elementwise maximum after broadcasting.
    pub fn broadcast_maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.broadcast_binary(BinaryOp::Max, rhs)
    }

    /// A scalar constant of this tensor's dtype, broadcast to its shape.
    pub fn full_like(&self, v: f64) -> Result<Tensor> {
        self.builder.full(v, self.shape.clone(), self.dtype)
    }

    /// `x * mul + add` with scalar constants (candle's `affine`).
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        let mut out = self.clone();
        if mul != 1.0 {
            out = out.mul(&self.full_like(mul)?)?;
        }
        if add != 0.0 {
            out = out.add(&self.full_like(add)?)?;
        }
        Ok(out)
    }

    fn compare(&self, op: CmpOp, rhs: &Tensor) -> Result<Tensor> {
        let shape = broadcast_shape(&self.shape, &rhs.shape).ok_or_else(|| {
            shape_err(
                "compare",
                format!("shapes {} and {} do not broadcast", self.shape, rhs.shape),
            )
        })?;
        if self.dtype != rhs.dtype {
            return Err(shape_err(
                "compare",
                format!("dtypes {} and {} differ", self.dtype, rhs.dtype),
            ));
        }
        let a = self.broadcast_as(shape.clone())?;
        let b = rhs.broadcast_as(shape.clone())?;
        Ok(self.push(Op::Compare(op, a.id, b.id), shape, DType::Bool))
    }

    /// `a == b` (broadcasting).
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CmpOp::Eq, rhs)
    }
    /// `a != b` (broadcasting).
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CmpOp::Ne, rhs)
    }
    /// `a < b` (broadcasting).
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CmpOp::Lt, rhs)
    }
    /// `a <= b` (broadcasting).
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CmpOp::Le, rhs)
    }
    /// `a > b` (broadcasting).
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CmpOp::Gt, rhs)
    }
    /// `a >= b` (broadcasting).
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CmpOp::Ge, rhs)
    }

    /// `self ? on_true : on_false`, with `self` a bool tensor; all three broadcast to one shape.
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        if self.dtype != DType::Bool || on_true.dtype != on_false.dtype {
            return Err(shape_err(
                "select",
                format!(
                    "pred {} with branches {} and {}",
                    self.dtype, on_true.dtype, on_false.dtype
                ),
            ));
        }
        let shape = broadcast_shape(&self.shape, &on_true.shape)
            .and_then(|s| broadcast_shape(&s, &on_false.shape))
            .ok_or_else(|| {
                shape_err(
                    "select",
                    format!(
                        "shapes {}, {} and {} do not broadcast",
                        self.shape, on_true.shape, on_false.shape
                    ),
                )
            })?;
        let p = self.broadcast_as(shape.clone())?;
        let t = on_true.broadcast_as(shape.clone())?;
        let f = on_false.broadcast_as(shape.clone())?;
        Ok(self.push(
            Op::Select {
                pred: p.id,
                on_true: t.id,
                on_false: f.id,
            },
            shape,
            on_true.dtype,
        ))
    }

    /// Converts to another element type (a no-op node is not created for the same type).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        if dtype == DType::Bool {
            return Err(shape_err("cast", "cast to bool (compare instead)".into()));
        }
        Ok(self.push(Op::Cast(self.id), self.shape.clone(), dtype))
    }

    /// Expands to `shape` (dims aligned right, each 1 or equal).
    pub fn broadcast_as(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape == self.shape {
            return Ok(self.clone());
        }
        if !broadcast_compatible(&self.shape, &shape) {
            return Err(shape_err(
                "broadcast",
                format!("{} cannot broadcast to {shape}", self.shape),
            ));
        }
        Ok(self.push(Op::Broadcast(self.id), shape, self.dtype))
    }

    /// The same elements in another shape.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape == self.shape {
            return Ok(self.clone());
        }
        if shape.elem_count() != self.shape.elem_count() {
            return Err(shape_err(
                "reshape",
                format!(
                    "{} has {} elements, {shape} has {}",
                    self.shape,
                    self.shape.elem_count(),
                    shape.elem_count()
                ),
            ));
        }
        Ok(self.push(Op::Reshape(self.id), shape, self.dtype))
    }

    /// Inserts a dimension of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        let mut d = self.shape.0.clone();
        if dim > d.len() {
            return Err(shape_err(
                "reshape",
                format!("unsqueeze {dim} of {}", self.shape),
            ));
        }
        d.insert(dim, 1);
        self.reshape(d)
    }

    /// Removes dimension `dim`, which must have size 1.
    pub fn squeeze(&self, dim: usize) -> Result<Tensor> {
        let mut d = self.shape.0.clone();
        if dim >= d.len() || d[dim] != 1 {
            return Err(shape_err(
                "reshape",
                format!("squeeze {dim} of {}", self.shape),
            ));
        }
        d.remove(dim);
        self.reshape(d)
    }

    /// Reorders dimensions: output dim `i` is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let mut seen = vec![false; self.rank()];
        if perm.len() != self.rank()
            || perm
                .iter()
                .any(|&p| p >= seen.len() || std::mem::replace(&mut seen[p], true))
        {
            return Err(shape_err(
                "permute",
                format!(
                    "{perm:?} is not a permutation of the dims of {}",
                    self.shape
                ),
            ));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        let shape = Shape(perm.iter().map(|&p| self.shape.0[p]).collect());
        Ok(self.push(Op::Permute(self.id, perm.to_vec()), shape, self.dtype))
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, d1: usize, d2: usize) -> Result<Tensor> {
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        if d1 >= perm.len() || d2 >= perm.len() {
            return Err(shape_err(
                "permute",
                format!("transpose {d1},{d2} of {}", self.shape),
            ));
        }
        perm.swap(d1, d2);
        self.permute(&perm)
    }

    /// Swaps the last two dimensions.
    pub fn t(&self) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 {
            return Err(shape_err("permute", format!("t() of {}", self.shape)));
        }
        self.transpose(r - 2, r - 1)
    }

    /// `len` indices of `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.rank() || start + len > self.shape.0[dim] {
            return Err(shape_err(
                "slice",
                format!("{start}..{} of dim {dim} of {}", start + len, self.shape),
            ));
        }
        if start == 0 && len == self.shape.0[dim] {
            return Ok(self.clone());
        }
        let mut d = self.shape.0.clone();
        d[dim] = len;
        Ok(self.push(
            Op::Slice {
                x: self.id,
                dim,
                start,
                len,
            },
            Shape(d),
            self.dtype,
        ))
    }

    /// Batched matrix product `[..., m, k] x [..., k, n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let (a, b) = (&self.shape.0, &rhs.shape.0);
        let ok = a.len() >= 2
            && a.len() == b.len()
            && a[..a.len() - 2] == b[..b.len() - 2]
            && a[a.len() - 1] == b[b.len() - 2]
            && self.dtype == rhs.dtype
            && self.dtype.is_float();
        if !ok {
            return Err(shape_err(
                "matmul",
                format!(
                    "{} {} x {} {}",
                    self.shape, self.dtype, rhs.shape, rhs.dtype
                ),
            ));
        }
        let mut d = a.clone();
        let last = d.len() - 1;
        d[last] = b[b.len() - 1];
        Ok(self.push(Op::MatMul(self.id, rhs.id), Shape(d), self.dtype))
    }

    fn reduce(&self, op: ReduceOp, dim: usize) -> Result<Tensor> {
        if dim >= self.rank() || self.dtype == DType::Bool {
            return Err(shape_err(
                op.name(),
                format!("dim {dim} of {} {}", self.shape, self.dtype),
            ));
        }
        let mut d = self.shape.0.clone();
        d.remove(dim);
        Ok(self.push(Op::Reduce(op, self.id, dim), Shape(d), self.dtype))
    }

    /// Sum over `dim`, which is removed.
    pub fn sum(&self, dim: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, dim)
    }
    /// Maximum over `dim`, which is removed.
    pub fn max(&self, dim: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, dim)
    }
    /// Minimum over `dim`, which is removed.
    pub fn min(&self, dim: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, dim)
    }
    /// Sum over `dim`, kept with size 1.
    pub fn sum_keepdim(&self, dim: usize) -> Result<Tensor> {
        self.sum(dim)?.unsqueeze(dim)
    }
    /// Maximum over `dim`, kept with size 1.
    pub fn max_keepdim(&self, dim: usize) -> Result<Tensor> {
        self.max(dim)?.unsqueeze(dim)
    }

    /// Index of the first maximum over `dim` (i32), which is removed.
    pub fn argmax(&self, dim: usize) -> Result<Tensor> {
        if dim >= self.rank() || !self.dtype.is_float() {
            return Err(shape_err(
                "argmax",
                format!("dim {dim} of {} {}", self.shape, self.dtype),
            ));
        }
        let mut d = self.shape.0.clone();
        d.remove(dim);
        Ok(self.push(Op::ArgMax(self.id, dim), Shape(d), DType::I32))
    }

    /// Indices (i32) of the `k` largest values of the last dim, largest first.
    pub fn topk(&self, k: usize) -> Result<Tensor> {
        let r = self.rank();
        if r == 0 || k == 0 || k > self.shape.0[r - 1] || !self.dtype.is_float() {
            return Err(shape_err(
                "topk",
                format!("k={k} of {} {}", self.shape, self.dtype),
            ));
        }
        let mut d = self.shape.0.clone();
        d[r - 1] = k;
        Ok(self.push(Op::TopK(self.id, k), Shape(d), DType::I32))
    }

    /// Slices of `dim` picked by the 1-D i32 `ids`.
    pub fn index_select(&self, ids: &Tensor, dim: usize) -> Result<Tensor> {
        if dim >= self.rank() || ids.rank() != 1 || ids.dtype != DType::I32 {
            return Err(shape_err(
                "index_select",
                format!(
                    "ids {} {} into dim {dim} of {}",
                    ids.shape, ids.dtype, self.shape
                ),
            ));
        }
        let mut d = self.shape.0.clone();
        d[dim] = ids.shape.0[0];
        Ok(self.push(
            Op::IndexSelect {
                x: self.id,
                ids: ids.id,
                dim,
            },
            Shape(d),
            self.dtype,
        ))
    }

    /// `out[.., i, ..] = x[.., ids[.., i, ..], ..]` along `dim`.
    pub fn gather(&self, ids: &Tensor, dim: usize) -> Result<Tensor> {
        let ok = dim < self.rank()
            && ids.rank() == self.rank()
            && ids.dtype == DType::I32
            && ids
                .shape
                .0
                .iter()
                .zip(&self.shape.0)
                .enumerate()
                .all(|(i, (a, b))| i == dim || a == b);
        if !ok {
            return Err(shape_err(
                "gather",
                format!(
                    "ids {} {} into dim {dim} of {}",
                    ids.shape, ids.dtype, self.shape
                ),
            ));
        }
        Ok(self.push(
            Op::Gather {
                x: self.id,
                ids: ids.id,
                dim,
            },
            ids.shape.clone(),
            self.dtype,
        ))
    }

    /// This 2-D value with rows `rows[i]`, columns `col..col + w`, replaced by `src[i]`.
    pub fn scatter_rows(&self, rows: &Tensor, col: usize, src: &Tensor) -> Result<Tensor> {
        let ok = self.rank() == 2
            && rows.rank() == 1
            && rows.dtype == DType::I32
            && src.rank() == 2
            && src.dtype == self.dtype
            && src.shape.0[0] == rows.shape.0[0]
            && col + src.shape.0[1] <= self.shape.0[1];
        if !ok {
            return Err(shape_err(
                "scatter_rows",
                format!(
                    "rows {} {} and src {} {} at column {col} into {} {}",
                    rows.shape, rows.dtype, src.shape, src.dtype, self.shape, self.dtype
                ),
            ));
        }
        Ok(self.push(
            Op::ScatterRows {
                root: self.id,
                rows: rows.id,
                col,
                src: src.id,
            },
            self.shape.clone(),
            self.dtype,
        ))
    }
}
