//! The graph under construction: its nodes, declared inputs and outputs, and the values that
//! start a graph (inputs, constants, iota) or join several tensors (concat).
//!
//! The ops on one value are [`Tensor`] methods (in `tensor.rs`); every node, whichever made it,
//! is appended here, in creation order, which is a topological order. Input and output names
//! are checked for uniqueness when declared, so a finished graph's names are valid.
//!
//! The builder is single-threaded (`Rc<RefCell<..>>`): a graph is built on one thread, then
//! [`GraphBuilder::finish`] turns it into an immutable, shareable [`Graph`].

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::sync::Arc;

use super::{
    DType, Graph, GraphInner, InputDecl, InputRole, Literal, Node, NodeId, Op, OutputDecl, Shape,
    Tensor,
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

    /// Appends a node whose operands and result were checked by the caller (a [`Tensor`]
    /// method or this builder), and names it.
    pub(super) fn push(&self, op: Op, shape: Shape, dtype: DType) -> Tensor {
        let mut st = self.0.borrow_mut();
        let id = NodeId(st.nodes.len());
        st.nodes.push(Node {
            op,
            shape: shape.clone(),
            dtype,
        });
        Tensor::new(id, shape, dtype, self.clone())
    }

    /// The one value node `id` holds everywhere, when it is a constant of one value or a
    /// broadcast of one: what [`Tensor::to_dtype`] folds.
    pub(super) fn repeated_constant(&self, id: NodeId) -> Option<f64> {
        let st = self.0.borrow();
        let mut node = st.nodes.get(id.0)?;
        if let Op::Broadcast(x) = node.op {
            node = st.nodes.get(x.0)?;
        }
        match &node.op {
            Op::Constant(lit) if lit.len() == 1 => lit.get_f64(0),
            _ => None,
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
            return Err(Error::shape("input", format!("duplicate name `{name}`")));
        }
        let index = self.0.borrow().inputs.len();
        let t = self.push(Op::Input(index), shape.clone(), dtype);
        self.0.borrow_mut().inputs.push(InputDecl {
            name,
            role,
            node: t.id(),
            shape,
            dtype,
        });
        Ok(t)
    }

    /// The metadata input `name` of `shape` and `dtype`: the one declared earlier, or a new
    /// one. For step metadata that two parts of a graph read (a sequence's state row: its
    /// caches' and its sampler's), each declaring what it needs without knowing the other.
    pub fn metadata(&self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let found = self
            .0
            .borrow()
            .inputs
            .iter()
            .find(|d| d.name == name)
            .map(|d| (d.role, d.node, d.shape.clone(), d.dtype));
        match found {
            None => self.input(name, InputRole::Metadata, shape, dtype),
            Some((InputRole::Metadata, node, s, d)) if s == shape && d == dtype => {
                Ok(Tensor::new(node, s, d, self.clone()))
            }
            Some((role, _, s, d)) => Err(Error::shape(
                "input",
                format!(
                    "`{name}` is declared as {role:?} {s} {d:?}, and asked for as metadata                      {shape} {dtype:?}"
                ),
            )),
        }
    }

    /// A constant of the given shape; the literal's type decides the dtype.
    pub fn constant(&self, literal: Literal, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if literal.len() != shape.elem_count() {
            return Err(Error::shape(
                "constant",
                format!("{} values for shape {shape}", literal.len()),
            ));
        }
        let dtype = literal.dtype();
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
        let scalar = match Literal::scalar(v, dtype) {
            Some(lit) => self.push(Op::Constant(lit), Shape(vec![]), dtype),
            None => self.scalar_f32(v as f32).to_dtype(dtype)?,
        };
        scalar.broadcast_as(shape)
    }

    /// Each element holds its index along `dim`.
    pub fn iota(&self, shape: impl Into<Shape>, dtype: DType, dim: usize) -> Result<Tensor> {
        let shape = shape.into();
        if dim >= shape.rank() || !(dtype == DType::I32 || dtype == DType::F32) {
            return Err(Error::shape(
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
            .ok_or_else(|| Error::shape("concat", "no operands"))?;
        let mut dims = first.dims().to_vec();
        if dim >= dims.len() {
            return Err(Error::shape(
                "concat",
                format!("dim {dim} of shape {}", first.shape()),
            ));
        }
        for x in &xs[1..] {
            let same_rest = x.shape().rank() == dims.len()
                && x.dims()
                    .iter()
                    .enumerate()
                    .all(|(i, &d)| i == dim || d == dims[i]);
            if !same_rest || x.dtype() != first.dtype() {
                return Err(Error::shape(
                    "concat",
                    format!(
                        "{} {} and {} {} along dim {dim}",
                        first.shape(),
                        first.dtype(),
                        x.shape(),
                        x.dtype()
                    ),
                ));
            }
            dims[dim] += x.dims()[dim];
        }
        let ids = xs.iter().map(|x| x.id()).collect();
        Ok(self.push(Op::Concat(ids, dim), Shape(dims), first.dtype()))
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
            .position(|i| i.node == root.id() && i.role == InputRole::CacheRoot)
            .ok_or_else(|| Error::shape("output", "an alias target must be a cache-root input"))?;
        drop(st);
        if value.shape() != root.shape() || value.dtype() != root.dtype() {
            return Err(Error::shape(
                "output",
                format!(
                    "aliased output {} {} differs from its root {} {}",
                    value.shape(),
                    value.dtype(),
                    root.shape(),
                    root.dtype()
                ),
            ));
        }
        self.add_output(name.into(), value, Some(index))
    }

    fn add_output(&self, name: String, value: &Tensor, aliases: Option<usize>) -> Result<()> {
        let mut st = self.0.borrow_mut();
        if !st.output_names.insert(name.clone()) {
            return Err(Error::shape("output", format!("duplicate name `{name}`")));
        }
        if aliases.is_some() && st.outputs.iter().any(|o| o.aliases == aliases) {
            return Err(Error::shape(
                "output",
                format!("`{name}`: root aliased twice"),
            ));
        }
        st.outputs.push(OutputDecl {
            name,
            node: value.id(),
            aliases,
        });
        Ok(())
    }

    /// Finishes the graph. Nodes that no output depends on are kept (they are cheap and rare);
    /// a graph with no output is an error.
    pub fn finish(self) -> Result<Graph> {
        let st = self.0.borrow();
        if st.outputs.is_empty() {
            return Err(Error::shape(
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
