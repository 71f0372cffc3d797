//! Static cost of one execution of a graph: what a step reads, writes and computes.
//!
//! Decode is memory-bound, so bytes are the figure that matters. A weight input counts in full
//! when any use reads it whole; when every use is an `index_select` along dim 0 (an embedding
//! lookup, gathered experts) only the selected slices count, capped at the whole tensor. Cache
//! roots count the rows gathered and scattered. FLOPs count matrix products (2·m·k·n per batch
//! element); elementwise work is negligible next to them.

use super::{Graph, InputRole, Op};

/// What one execution of a graph costs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GraphStats {
    /// Bytes of all inputs (weights, metadata, cache roots) as bound.
    pub parameter_bytes: u64,
    /// Bytes of weights actually read.
    pub weight_bytes_read: u64,
    /// Bytes of cache rows read.
    pub cache_bytes_read: u64,
    /// Bytes of cache rows written.
    pub cache_bytes_written: u64,
    /// Bytes of non-aliased outputs written.
    pub output_bytes_written: u64,
    /// Multiply-add FLOPs of the matrix products.
    pub flops: u64,
}

impl GraphStats {
    /// Total bytes read from device memory per step (weights, cache, metadata).
    pub fn bytes_read(&self, metadata_bytes: u64) -> u64 {
        self.weight_bytes_read + self.cache_bytes_read + metadata_bytes
    }
}

/// Computes the static cost of `graph`.
pub fn stats(graph: &Graph) -> GraphStats {
    let nodes = graph.nodes();
    let bytes = |id: usize| (nodes[id].shape.elem_count() * nodes[id].dtype.size_in_bytes()) as u64;
    let mut s = GraphStats::default();
    // Users of each node.
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        for o in n.op.operands() {
            users[o.0].push(i);
        }
    }
    for decl in graph.inputs() {
        let full = bytes(decl.node.0);
        s.parameter_bytes += full;
        if decl.role != InputRole::Weight {
            continue;
        }
        let mut read = 0u64;
        let mut whole = false;
        for &u in &users[decl.node.0] {
            match &nodes[u].op {
                Op::IndexSelect { x, dim: 0, .. } if x.0 == decl.node.0 => read += bytes(u),
                _ => whole = true,
            }
        }
        s.weight_bytes_read += if whole { full } else { read.min(full) };
    }
    for (i, n) in nodes.iter().enumerate() {
        match &n.op {
            Op::MatMul(a, b) => {
                let ad = nodes[a.0].shape.dims();
                let bd = nodes[b.0].shape.dims();
                let r = ad.len();
                let batch: usize = ad[..r - 2].iter().product();
                s.flops += 2 * (batch * ad[r - 2] * ad[r - 1] * bd[r - 1]) as u64;
            }
            Op::ScatterRows { src, .. } => s.cache_bytes_written += bytes(src.0),
            Op::IndexSelect { x, .. } if is_root_derived(graph, x.0) => {
                s.cache_bytes_read += bytes(i)
            }
            _ => {}
        }
    }
    for out in graph.outputs() {
        if out.aliases.is_none() {
            s.output_bytes_written += bytes(out.node.0);
        }
    }
    s
}

/// Whether a value is a view of a cache root (through slices and scatter updates).
fn is_root_derived(graph: &Graph, mut id: usize) -> bool {
    loop {
        match &graph.nodes()[id].op {
            Op::Input(k) => return graph.inputs()[*k].role == InputRole::CacheRoot,
            Op::Slice { x, .. } | Op::Reshape(x) => id = x.0,
            Op::ScatterRows { root, .. } => id = root.0,
            _ => return false,
        }
    }
}
