//! The static graph every backend consumes.
//!
//! candle records ops for backprop, but `Tensor::op()` is crate-private in candle-core 0.11 and its
//! comparison node drops the right-hand side, so candle's own graph cannot be lowered from outside
//! the crate. The model is therefore written against this module's candle-shaped API
//! ([`Tensor::matmul`], [`Tensor::narrow`], [`Tensor::broadcast_as`], ...) on symbolic tensors:
//! each call checks shapes and dtypes and appends one [`Node`]. A finished [`Graph`] is immutable
//! and has three consumers: the CPU backend, the HLO emitter and the HLO importer.
//!
//! Shapes are static and there is no control flow, because neuronx-cc compiles one static program
//! per bucket. Nodes live in a `Vec` behind [`NodeId`]s in creation order, which is a topological
//! order (an operand always exists before its user); backends may execute nodes in that order.

mod builder;
mod display;
mod dtype;
mod op;
pub mod order_key;
mod shape;
pub mod stats;
mod tensor;

use std::sync::Arc;

pub use builder::GraphBuilder;
pub use dtype::DType;
pub use op::{BinaryOp, CmpOp, FourBit, Literal, Op, ReduceOp, UnaryOp};
pub use shape::Shape;
pub use tensor::Tensor;

/// Index of a node in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

/// One value of the graph: the op that computes it, its shape and its dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The computation.
    pub op: Op,
    /// The result's shape.
    pub shape: Shape,
    /// The result's element type.
    pub dtype: DType,
}

/// What a graph input is, which decides how a runner binds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputRole {
    /// A model parameter: uploaded once and shared by every graph.
    Weight,
    /// Per-step data (ids, positions, slots, sampling parameters): written before each replay.
    Metadata,
    /// A KV-cache root: allocated once, updated in place through an aliased output.
    CacheRoot,
    /// A tensor an earlier graph of the same step left on the device (the logits a split
    /// decode step's forward graph returns, which its sampling graph reads): bound to that
    /// graph's output buffer, never written by the host.
    Carried,
}

impl InputRole {
    /// The role's name in dumps and manifests.
    pub fn name(self) -> &'static str {
        match self {
            InputRole::Weight => "weight",
            InputRole::Metadata => "metadata",
            InputRole::CacheRoot => "cache_root",
            InputRole::Carried => "carried",
        }
    }

    /// The role whose [`InputRole::name`] is `name`: how a dump or an HLO module's role
    /// attribute is read back.
    pub fn from_name(name: &str) -> Option<Self> {
        [
            InputRole::Weight,
            InputRole::Metadata,
            InputRole::CacheRoot,
            InputRole::Carried,
        ]
        .into_iter()
        .find(|r| r.name() == name)
    }
}

/// A declared graph input (an HLO entry parameter).
#[derive(Debug, Clone, PartialEq)]
pub struct InputDecl {
    /// Unique name: the weight's name, or the metadata field's.
    pub name: String,
    /// How the input is bound.
    pub role: InputRole,
    /// The node that reads it.
    pub node: NodeId,
    /// Its shape.
    pub shape: Shape,
    /// Its element type.
    pub dtype: DType,
}

/// A declared graph output (an element of the HLO root tuple).
#[derive(Debug, Clone, PartialEq)]
pub struct OutputDecl {
    /// Unique name.
    pub name: String,
    /// The node whose value is returned.
    pub node: NodeId,
    /// For an updated cache root: the index of the input it replaces in place.
    pub aliases: Option<usize>,
}

#[derive(Debug)]
struct GraphInner {
    name: String,
    nodes: Vec<Node>,
    inputs: Vec<InputDecl>,
    outputs: Vec<OutputDecl>,
}

/// A finished, immutable graph. Cloning is cheap (an `Arc`): one graph is shared by the backend
/// that runs it, the emitter that lowers it, and the runner that replays it.
#[derive(Debug, Clone)]
pub struct Graph(Arc<GraphInner>);

impl Graph {
    /// The graph's name (e.g. `decode_b4_c256`).
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// All nodes, in a topological (creation) order.
    pub fn nodes(&self) -> &[Node] {
        &self.0.nodes
    }

    /// One node.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.0.nodes[id.0]
    }

    /// The declared inputs, in parameter order.
    pub fn inputs(&self) -> &[InputDecl] {
        &self.0.inputs
    }

    /// The declared outputs, in root-tuple order.
    pub fn outputs(&self) -> &[OutputDecl] {
        &self.0.outputs
    }

    /// The index of the input with this name.
    pub fn input_index(&self, name: &str) -> Option<usize> {
        self.0.inputs.iter().position(|i| i.name == name)
    }

    /// The index of the output with this name.
    pub fn output_index(&self, name: &str) -> Option<usize> {
        self.0.outputs.iter().position(|o| o.name == name)
    }

    /// The size of the tensor-parallel group the graph's collectives span: 1 for a graph
    /// without collectives (what an executor must supply, see `backend::cpu::run_rank`).
    pub fn ranks(&self) -> usize {
        self.0
            .nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::AllReduce { ranks, .. } | Op::AllGather { ranks, .. } => Some(ranks),
                _ => None,
            })
            .max()
            .unwrap_or(1)
    }

    /// For each node, how many times later nodes and outputs read it: backends use this to free
    /// intermediates after their last use and to update cache roots in place.
    pub fn use_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.0.nodes.len()];
        for node in &self.0.nodes {
            for operand in node.op.operands() {
                counts[operand.0] += 1;
            }
        }
        for out in &self.0.outputs {
            counts[out.node.0] += 1;
        }
        counts
    }
}
