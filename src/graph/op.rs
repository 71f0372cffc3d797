//! The op set: every computation a graph can contain.
//!
//! Each op has one meaning shared by all three consumers of a graph (the CPU backend, the HLO
//! emitter and the HLO importer), so each is chosen to be one or a few plain HLO instructions:
//! no op depends on data for its shape, binary ops never broadcast implicitly (a [`Op::Broadcast`]
//! node makes it explicit, as HLO requires), and integer arithmetic wraps (as HLO's does).

use super::NodeId;

/// Elementwise functions of one operand (float operands, except `Neg` and `Abs`, which also take
/// integers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `|x|`.
    Abs,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// Sine.
    Sin,
    /// Cosine.
    Cos,
    /// Hyperbolic tangent.
    Tanh,
    /// `1 / (1 + e^-x)` (HLO `logistic`).
    Sigmoid,
    /// `x * sigmoid(x)`, the MLP activation (HLO: `multiply(x, logistic(x))`).
    Silu,
}

impl UnaryOp {
    /// The op's name in dumps and errors.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Silu => "silu",
        }
    }
}

/// Elementwise functions of two operands of the same shape and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b` (wrapping for integers).
    Add,
    /// `a - b` (wrapping for integers).
    Sub,
    /// `a * b` (wrapping for integers).
    Mul,
    /// `a / b` (truncating for integers).
    Div,
    /// Remainder with the sign of `a` (integers only).
    Rem,
    /// Larger of the two.
    Max,
    /// Smaller of the two.
    Min,
    /// Bitwise exclusive or (integers only).
    BitXor,
    /// Bitwise and (integers only).
    BitAnd,
    /// Logical shift right by `b` bits (integers only; HLO `shift-right-logical`).
    Shr,
    /// Shift left by `b` bits (integers only).
    Shl,
}

impl BinaryOp {
    /// The op's name in dumps and errors.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Rem => "rem",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::BitXor => "xor",
            BinaryOp::BitAnd => "and",
            BinaryOp::Shr => "shr",
            BinaryOp::Shl => "shl",
        }
    }

    /// Whether the op is defined only for integers.
    pub fn int_only(self) -> bool {
        matches!(
            self,
            BinaryOp::Rem | BinaryOp::BitXor | BinaryOp::BitAnd | BinaryOp::Shr | BinaryOp::Shl
        )
    }
}

/// Comparison directions; the result is a [`super::DType::Bool`] value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmpOp {
    /// `a == b`.
    Eq,
    /// `a != b`.
    Ne,
    /// `a < b`.
    Lt,
    /// `a <= b`.
    Le,
    /// `a > b`.
    Gt,
    /// `a >= b`.
    Ge,
}

impl CmpOp {
    /// The op's name in dumps (HLO's direction spelling).
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "EQ",
            CmpOp::Ne => "NE",
            CmpOp::Lt => "LT",
            CmpOp::Le => "LE",
            CmpOp::Gt => "GT",
            CmpOp::Ge => "GE",
        }
    }
}

/// Reductions over one dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    /// The op's name in dumps.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// Literal data of a [`Op::Constant`], in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub enum Literal {
    /// f32 values.
    F32(Vec<f32>),
    /// i32 values.
    I32(Vec<i32>),
    /// u32 values.
    U32(Vec<u32>),
}

impl Literal {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Literal::F32(v) => v.len(),
            Literal::I32(v) => v.len(),
            Literal::U32(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One node's computation. The node's own shape and dtype (in [`super::Node`]) complete the
/// description where an op needs a target (`Cast`, `Broadcast`, `Reshape`, `Iota`, `Constant`).
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// The graph input with this index in [`super::Graph::inputs`].
    Input(usize),
    /// A constant; scalars and small tables only (large data belongs in a weight input).
    Constant(Literal),
    /// Each element is its own index along `dim`.
    Iota {
        /// The dimension whose index is written.
        dim: usize,
    },
    /// An elementwise function of one operand.
    Unary(UnaryOp, NodeId),
    /// An elementwise function of two operands of equal shape and dtype.
    Binary(BinaryOp, NodeId, NodeId),
    /// An elementwise comparison of two operands of equal shape and dtype.
    Compare(CmpOp, NodeId, NodeId),
    /// `pred ? on_true : on_false`, elementwise; all three of one shape.
    Select {
        /// A bool value.
        pred: NodeId,
        /// Taken where `pred` holds.
        on_true: NodeId,
        /// Taken elsewhere.
        on_false: NodeId,
    },
    /// Conversion to the node's dtype (float to int truncates toward zero).
    Cast(NodeId),
    /// Expansion to the node's shape: operand dims align to the right, each of size 1 or equal.
    Broadcast(NodeId),
    /// The same elements, row-major, in the node's shape.
    Reshape(NodeId),
    /// Dimensions reordered: output dim `i` is operand dim `perm[i]`.
    Permute(NodeId, Vec<usize>),
    /// `len` elements of `dim` starting at `start` (static).
    Slice {
        /// Operand.
        x: NodeId,
        /// Sliced dimension.
        dim: usize,
        /// First index kept.
        start: usize,
        /// Number of indices kept.
        len: usize,
    },
    /// Operands joined along `dim`.
    Concat(Vec<NodeId>, usize),
    /// Batched matrix product `[..., m, k] x [..., k, n] -> [..., m, n]`, equal batch dims.
    MatMul(NodeId, NodeId),
    /// A reduction that removes `dim`.
    Reduce(ReduceOp, NodeId, usize),
    /// The i32 index of the first maximum along `dim`, which is removed.
    ArgMax(NodeId, usize),
    /// The i32 indices of the `k` largest values along the last dim, largest first, ties broken
    /// by the lower index (HLO: a stable descending `sort` of (value, iota), then a slice).
    TopK(NodeId, usize),
    /// Rows (or slices) of `x` along `dim` picked by the 1-D i32 `ids`.
    IndexSelect {
        /// Source.
        x: NodeId,
        /// 1-D i32 indices into `dim`.
        ids: NodeId,
        /// Indexed dimension.
        dim: usize,
    },
    /// `out[.., i, ..] = x[.., ids[.., i, ..], ..]` along `dim`; `ids` has `x`'s rank and shape
    /// except at `dim`, and the output has `ids`'s shape.
    Gather {
        /// Source.
        x: NodeId,
        /// i32 indices.
        ids: NodeId,
        /// Indexed dimension.
        dim: usize,
    },
    /// `root` (`[rows, cols]`) with `root[rows_ids[i], col..col + w] = src[i]` for each row `i` of
    /// `src` (`[n, w]`). This is how a cache root is written: one column range per layer.
    /// Indices must be distinct and in range.
    ScatterRows {
        /// The 2-D value being updated.
        root: NodeId,
        /// 1-D i32 destination rows.
        rows: NodeId,
        /// First destination column.
        col: usize,
        /// The new values, `[rows.len(), w]`.
        src: NodeId,
    },
}

impl Op {
    /// The op's name in dumps and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input(_) => "input",
            Op::Constant(_) => "constant",
            Op::Iota { .. } => "iota",
            Op::Unary(u, _) => u.name(),
            Op::Binary(b, _, _) => b.name(),
            Op::Compare(..) => "compare",
            Op::Select { .. } => "select",
            Op::Cast(_) => "cast",
            Op::Broadcast(_) => "broadcast",
            Op::Reshape(_) => "reshape",
            Op::Permute(..) => "permute",
            Op::Slice { .. } => "slice",
            Op::Concat(..) => "concat",
            Op::MatMul(..) => "matmul",
            Op::Reduce(r, _, _) => r.name(),
            Op::ArgMax(..) => "argmax",
            Op::TopK(..) => "topk",
            Op::IndexSelect { .. } => "index_select",
            Op::Gather { .. } => "gather",
            Op::ScatterRows { .. } => "scatter_rows",
        }
    }

    /// The nodes this op reads, in operand order.
    pub fn operands(&self) -> Vec<NodeId> {
        match self {
            Op::Input(_) | Op::Constant(_) | Op::Iota { .. } => vec![],
            Op::Unary(_, x)
            | Op::Cast(x)
            | Op::Broadcast(x)
            | Op::Reshape(x)
            | Op::Permute(x, _)
            | Op::Slice { x, .. }
            | Op::Reduce(_, x, _)
            | Op::ArgMax(x, _)
            | Op::TopK(x, _) => vec![*x],
            Op::Binary(_, a, b) | Op::Compare(_, a, b) | Op::MatMul(a, b) => vec![*a, *b],
            Op::Select {
                pred,
                on_true,
                on_false,
            } => vec![*pred, *on_true, *on_false],
            Op::Concat(xs, _) => xs.clone(),
            Op::IndexSelect { x, ids, .. } | Op::Gather { x, ids, .. } => vec![*x, *ids],
            Op::ScatterRows {
                root, rows, src, ..
            } => vec![*root, *rows, *src],
        }
    }
}
