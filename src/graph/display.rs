//! A readable text dump of a graph, one node per line: `%12 = matmul(%10, %11) : [4, 64] f32`.

use std::fmt;

use super::{Graph, Op};

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph {} {{", self.name())?;
        for (i, node) in self.nodes().iter().enumerate() {
            write!(f, "  %{i} = {}", node.op.name())?;
            let operands: Vec<String> = node
                .op
                .operands()
                .iter()
                .map(|o| format!("%{}", o.0))
                .collect();
            match &node.op {
                Op::Input(k) => {
                    let decl = &self.inputs()[*k];
                    write!(f, " {} ({})", decl.name, decl.role.name())?;
                }
                Op::Constant(lit) if lit.len() <= 8 => write!(f, " {lit:?}")?,
                Op::Constant(lit) => write!(f, " <{} values>", lit.len())?,
                Op::Iota { dim } => write!(f, " dim={dim}")?,
                Op::Compare(c, ..) => write!(f, " {}({})", c.name(), operands.join(", "))?,
                Op::Permute(_, perm) => write!(f, "({}) perm={perm:?}", operands.join(", "))?,
                Op::Slice {
                    dim, start, len, ..
                } => write!(
                    f,
                    "({}) dim={dim} start={start} len={len}",
                    operands.join(", ")
                )?,
                Op::Concat(_, dim)
                | Op::Reduce(_, _, dim)
                | Op::ArgMax(_, dim)
                | Op::IndexSelect { dim, .. }
                | Op::Gather { dim, .. } => write!(f, "({}) dim={dim}", operands.join(", "))?,
                Op::TopK(_, k) => write!(f, "({}) k={k}", operands.join(", "))?,
                Op::ScatterRows { col, .. } => write!(f, "({}) col={col}", operands.join(", "))?,
                Op::AllReduce { op, ranks, .. } => {
                    write!(f, "({}) {} ranks={ranks}", operands.join(", "), op.name())?
                }
                Op::AllGather { dim, ranks, .. } => {
                    write!(f, "({}) dim={dim} ranks={ranks}", operands.join(", "))?
                }
                _ => write!(f, "({})", operands.join(", "))?,
            }
            writeln!(f, " : {} {}", node.shape, node.dtype)?;
        }
        for out in self.outputs() {
            write!(f, "  output {} = %{}", out.name, out.node.0)?;
            if let Some(k) = out.aliases {
                write!(f, " (updates {} in place)", self.inputs()[k].name)?;
            }
            writeln!(f)?;
        }
        write!(f, "}}")
    }
}
