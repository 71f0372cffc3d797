//! The op set: every computation a graph can contain.
//!
//! Each op has one meaning shared by all three consumers of a graph (the CPU backend, the HLO
//! emitter and the HLO importer), so each is chosen to be one or a few plain HLO instructions:
//! no op depends on data for its shape, binary ops never broadcast implicitly (a [`Op::Broadcast`]
//! node makes it explicit, as HLO requires), and integer arithmetic wraps (as HLO's does).
//!
//! The elementwise and reduction families are tables (`op_family!` lines): an op's variant, its
//! name and its HLO form sit on one line, which the emitter reads forwards (op -> opcode) and
//! the importer backwards (opcode -> op). The table holds HLO spellings because HLO is what every
//! op is designed against; `graph` still imports nothing from `backend`. Ops whose lowering is a
//! structure of several instructions (matmul, gather, top-k, ...) are not in a table: their
//! lowering and its recognition live in `backend::hlo`.

use super::{DType, NodeId};

/// Defines one op family from a table with one line per op: its doc, its variant, its name in
/// dumps and errors and, for families that have one, a lowering column read by the HLO emitter
/// and (backwards) by the HLO importer. The enum, `ALL`, `name()` and the column's accessor are
/// generated, so each fact about an op is written once, here.
macro_rules! op_family {
    (
        $(#[$meta:meta])*
        pub enum $family:ident;
        $(#[$col_meta:meta])*
        pub fn $col:ident -> $col_ty:ty;
        $( $(#[$op_meta:meta])* $op:ident = $name:literal, $value:expr; )+
    ) => {
        op_family! {
            $(#[$meta])*
            pub enum $family;
            $( $(#[$op_meta])* $op = $name; )+
        }

        impl $family {
            $(#[$col_meta])*
            pub const fn $col(self) -> $col_ty {
                match self {
                    $( $family::$op => $value, )+
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        pub enum $family:ident;
        $( $(#[$op_meta:meta])* $op:ident = $name:literal; )+
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $family {
            $( $(#[$op_meta])* $op, )+
        }

        impl $family {
            /// Every op of the family, in table order.
            pub const ALL: &'static [$family] = &[$( $family::$op ),+];

            /// The op's name in dumps and errors.
            pub const fn name(self) -> &'static str {
                match self {
                    $( $family::$op => $name, )+
                }
            }
        }
    };
}

op_family! {
    /// Elementwise functions of one operand (float operands, except `Neg` and `Abs`, which also
    /// take integers).
    pub enum UnaryOp;
    /// The opcode of the one HLO instruction the op lowers to. `None` marks a composite, which
    /// the emitter writes as several instructions and the importer recognises by their
    /// structure.
    pub fn hlo_opcode -> Option<&'static str>;
    /// `-x`.
    Neg = "neg", Some("negate");
    /// `|x|`.
    Abs = "abs", Some("abs");
    /// `e^x`.
    Exp = "exp", Some("exponential");
    /// Natural logarithm.
    Log = "log", Some("log");
    /// Square root.
    Sqrt = "sqrt", Some("sqrt");
    /// `1 / sqrt(x)`.
    Rsqrt = "rsqrt", Some("rsqrt");
    /// Sine.
    Sin = "sin", Some("sine");
    /// Cosine.
    Cos = "cos", Some("cosine");
    /// Hyperbolic tangent.
    Tanh = "tanh", Some("tanh");
    /// `1 / (1 + e^-x)`.
    Sigmoid = "sigmoid", Some("logistic");
    /// `x * sigmoid(x)`, the MLP activation: a composite, `Mul(x, Sigmoid(x))` in HLO.
    Silu = "silu", None;
}

op_family! {
    /// Elementwise functions of two operands of the same shape and dtype.
    pub enum BinaryOp;
    /// The opcode of the one HLO instruction the op lowers to.
    pub fn hlo_opcode -> &'static str;
    /// `a + b` (wrapping for integers).
    Add = "add", "add";
    /// `a - b` (wrapping for integers).
    Sub = "sub", "subtract";
    /// `a * b` (wrapping for integers).
    Mul = "mul", "multiply";
    /// `a / b` (truncating for integers).
    Div = "div", "divide";
    /// Remainder with the sign of `a` (integers only).
    Rem = "rem", "remainder";
    /// Larger of the two.
    Max = "max", "maximum";
    /// Smaller of the two.
    Min = "min", "minimum";
    /// Bitwise exclusive or (integers only).
    BitXor = "xor", "xor";
    /// Bitwise and (integers only).
    BitAnd = "and", "and";
    /// Logical shift right by `b` bits (integers only).
    Shr = "shr", "shift-right-logical";
    /// Shift left by `b` bits (integers only).
    Shl = "shl", "shift-left";
}

impl BinaryOp {
    /// Whether the op is defined only for integers.
    pub fn int_only(self) -> bool {
        matches!(
            self,
            BinaryOp::Rem | BinaryOp::BitXor | BinaryOp::BitAnd | BinaryOp::Shr | BinaryOp::Shl
        )
    }
}

op_family! {
    /// Comparison directions; the result is a [`super::DType::Bool`] value. The name is HLO's
    /// spelling of the direction (`comparison_direction`), so dumps and HLO read alike.
    pub enum CmpOp;
    /// `a == b`.
    Eq = "EQ";
    /// `a != b`.
    Ne = "NE";
    /// `a < b`.
    Lt = "LT";
    /// `a <= b`.
    Le = "LE";
    /// `a > b`.
    Gt = "GT";
    /// `a >= b`.
    Ge = "GE";
}

op_family! {
    /// Reductions over one dimension.
    pub enum ReduceOp;
    /// The binary op that combines two elements: the root of the scalar computation an HLO
    /// `reduce` calls, by which the importer tells the reductions apart.
    pub fn combiner -> BinaryOp;
    /// Sum.
    Sum = "sum", BinaryOp::Add;
    /// Maximum.
    Max = "max", BinaryOp::Max;
    /// Minimum.
    Min = "min", BinaryOp::Min;
}

/// What a 4-bit code of [`Op::Dequantize4Bit`] stands for, before its group's scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FourBit {
    /// A signed integer biased by 8: `code - 8`, -8 to 7 (`--quantize experts-int4`).
    Int4,
    /// FP4 E2M1 (OCP microscaling): bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0
    /// the mantissa; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4 and 6. DeepSeek-V4's published
    /// routed experts, one power-of-two scale per 32 values.
    E2m1,
}

impl FourBit {
    /// The value of every code, in code order.
    pub const fn values(self) -> [f32; 16] {
        let mut t = [0f32; 16];
        let mut c = 0;
        while c < 16 {
            t[c] = match self {
                FourBit::Int4 => c as f32 - 8.0,
                FourBit::E2m1 => {
                    let magnitude = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][c & 7];
                    if c & 8 == 0 {
                        magnitude
                    } else {
                        -magnitude
                    }
                }
            };
            c += 1;
        }
        t
    }

    /// The op's name in the graph, in HLO's composite tag, and in the conformance suite.
    pub const fn op_name(self) -> &'static str {
        match self {
            FourBit::Int4 => "dequantize_int4",
            FourBit::E2m1 => "dequantize_e2m1",
        }
    }
}

/// Literal data of a [`Op::Constant`], in row-major order, one variant per dtype a constant
/// can have.
#[derive(Debug, Clone, PartialEq)]
pub enum Literal {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<half::bf16>),
    /// f16 values.
    F16(Vec<half::f16>),
    /// f8e4m3fn values.
    F8E4M3(Vec<float8::F8E4M3>),
    /// i32 values.
    I32(Vec<i32>),
    /// u32 values.
    U32(Vec<u32>),
    /// i8 values.
    I8(Vec<i8>),
}

impl Literal {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Literal::F32(v) => v.len(),
            Literal::BF16(v) => v.len(),
            Literal::F16(v) => v.len(),
            Literal::F8E4M3(v) => v.len(),
            Literal::I32(v) => v.len(),
            Literal::U32(v) => v.len(),
            Literal::I8(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `i` as an f64 (exact for every dtype a literal holds), or `None` past the end.
    pub fn get_f64(&self, i: usize) -> Option<f64> {
        Some(match self {
            Literal::F32(v) => f64::from(*v.get(i)?),
            Literal::BF16(v) => v.get(i)?.to_f64(),
            Literal::F16(v) => v.get(i)?.to_f64(),
            Literal::F8E4M3(v) => v.get(i)?.to_f64(),
            Literal::I32(v) => f64::from(*v.get(i)?),
            Literal::U32(v) => f64::from(*v.get(i)?),
            Literal::I8(v) => f64::from(*v.get(i)?),
        })
    }

    /// The dtype of the values.
    pub fn dtype(&self) -> DType {
        match self {
            Literal::F32(_) => DType::F32,
            Literal::BF16(_) => DType::BF16,
            Literal::F16(_) => DType::F16,
            Literal::F8E4M3(_) => DType::F8E4M3,
            Literal::I32(_) => DType::I32,
            Literal::U32(_) => DType::U32,
            Literal::I8(_) => DType::I8,
        }
    }

    /// One value `v` of `dtype` (converted as a cast would: rounded for floats, truncated for
    /// integers), or `None` for a dtype no literal has (`u8`, `bool`).
    pub fn scalar(v: f64, dtype: DType) -> Option<Literal> {
        Some(match dtype {
            DType::F32 => Literal::F32(vec![v as f32]),
            DType::BF16 => Literal::BF16(vec![half::bf16::from_f64(v)]),
            DType::F16 => Literal::F16(vec![half::f16::from_f64(v)]),
            DType::F8E4M3 => Literal::F8E4M3(vec![float8::F8E4M3::from_f64(v)]),
            DType::I32 => Literal::I32(vec![v as i32]),
            DType::U32 => Literal::U32(vec![v as u32]),
            DType::I8 => Literal::I8(vec![v as i8]),
            DType::U8 | DType::Bool => return None,
        })
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
    /// Per row `r` of `x` and `w` (`[rows, n]`, f32) and `target` (`[rows]`, f32): the
    /// largest value `t` whose weighted mass `sum(w[r, i] for x[r, i] >= t)` reaches
    /// `target[r]`. With unit weights and `target = k` that is the k-th largest value (ties
    /// included); with probabilities it is a nucleus's cut; with `x = -index` it is an
    /// inverse-CDF draw. `+inf` when `target <= 0`; `-inf` when even the whole row falls short
    /// (or `target` is NaN). NaN values of `x` never count, and a subnormal answer is 0 (as
    /// engines that flush subnormals find it). The sampler's exact top-k, top-p
    /// and draw, with no sort (neuronx-cc rewrites a wide sort into a top-k it caps at 16,384).
    /// HLO: a `call` of a bisection over the 32 bits of the threshold's order-preserving key,
    /// with compares and sums only (`backend::hlo::emit`).
    MassThreshold {
        /// The values.
        x: NodeId,
        /// Their weights.
        w: NodeId,
        /// The mass to reach, per row.
        target: NodeId,
    },
    /// 4-bit weight codes back to floats: `codes` (u8, `[.., half]`) holds two codes a byte,
    /// the even value in the low nibble; `scales` (f32, `[.., ceil(2 half / group)]`, the same
    /// leading dims) one scale per `group` values of a row. Output (the node's float dtype,
    /// `[.., 2 half]`): the code's value under `format` times the scale of its group, computed
    /// as the product in that dtype of the (exact) code value and the scale rounded to it. The
    /// 4-bit routed experts' dequantization: int4 (`--quantize experts-int4`) and DeepSeek-V4's
    /// published FP4 experts. HLO: a mask and a shift (bit operations, exact), the code's value
    /// in exact float arithmetic, an interleave and the group scales' broadcast, tagged as one
    /// composite (`backend::hlo::emit`).
    Dequantize4Bit {
        /// The packed codes.
        codes: NodeId,
        /// One scale per `group` values of each row.
        scales: NodeId,
        /// Values per scale.
        group: usize,
        /// What a code means.
        format: FourBit,
    },
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
    /// Elementwise `op` (sum or max) of `x` over the `ranks` ranks of the tensor-parallel group
    /// that runs the graph; every rank gets the same result. Sums add in rank order, so every
    /// rank computes bit-identical values. HLO: `all-reduce` over one replica group.
    AllReduce {
        /// How values combine.
        op: ReduceOp,
        /// This rank's part.
        x: NodeId,
        /// Ranks in the group (the graph's tensor-parallel degree).
        ranks: usize,
    },
    /// The `ranks` ranks' `x` joined along `dim` in rank order (the output's `dim` is `ranks`
    /// times `x`'s). HLO: `all-gather` over one replica group.
    AllGather {
        /// This rank's part.
        x: NodeId,
        /// The dimension the parts are joined along.
        dim: usize,
        /// Ranks in the group.
        ranks: usize,
    },
}

impl Op {
    /// Whether this is a permute that swaps the last two dims only (a matrix transpose, batched
    /// or not): the form a weight read as `[out, in]` takes, which the HLO emitter folds into
    /// `dot`'s contracting dims and the CPU backend reads as a transposed view.
    pub fn is_matrix_transpose(&self) -> bool {
        let Op::Permute(_, perm) = self else {
            return false;
        };
        let r = perm.len();
        r >= 2
            && perm[..r - 2].iter().enumerate().all(|(i, &p)| p == i)
            && perm[r - 2..] == [r - 1, r - 2]
    }

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
            Op::MassThreshold { .. } => "mass_threshold",
            Op::Dequantize4Bit { format, .. } => format.op_name(),
            Op::IndexSelect { .. } => "index_select",
            Op::Gather { .. } => "gather",
            Op::ScatterRows { .. } => "scatter_rows",
            Op::AllReduce { .. } => "all_reduce",
            Op::AllGather { .. } => "all_gather",
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
            | Op::TopK(x, _)
            | Op::AllReduce { x, .. }
            | Op::AllGather { x, .. } => vec![*x],
            Op::Binary(_, a, b) | Op::Compare(_, a, b) | Op::MatMul(a, b) => vec![*a, *b],
            Op::Select {
                pred,
                on_true,
                on_false,
            } => vec![*pred, *on_true, *on_false],
            Op::Concat(xs, _) => xs.clone(),
            Op::MassThreshold { x, w, target } => vec![*x, *w, *target],
            Op::Dequantize4Bit { codes, scales, .. } => vec![*codes, *scales],
            Op::IndexSelect { x, ids, .. } | Op::Gather { x, ids, .. } => vec![*x, *ids],
            Op::ScatterRows {
                root, rows, src, ..
            } => vec![*root, *rows, *src],
        }
    }
}
