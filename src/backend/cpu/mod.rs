//! The CPU backend: runs a [`Graph`] on real tensors with candle-core.
//!
//! Nodes run in creation order (a topological order). Each op is one candle-core call where
//! candle has it; `kernels` covers what candle lacks (wrapping integer arithmetic, top-k, the
//! strided row gather and the in-place row scatter of the KV cache) and `matmul` the
//! reduced-precision matmul (bf16 operands, f32 accumulation), which widens weights tile by
//! tile instead of converting them whole on every call.
//!
//! Memory: every value is dropped right after its last use. Cache roots are updated in place: a
//! `scatter_rows` whose root is (a chain of updates of) a cache-root input, and which is that
//! value's last use, writes into the caller's buffer instead of copying it, so the aliased output
//! *is* the input tensor and the cache is never copied per step.

mod collective;
mod four_bit;
mod kernels;
mod matmul;
mod packed;
mod pool;
pub mod profile;
mod quantized;
mod threshold;

pub use collective::{Group, RankComm, DEFAULT_COLLECTIVE_TIMEOUT};
pub use pool::pin_thread_count;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use matmul::Experts;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::graph::{
    BinaryOp, CmpOp, DType, FourBit, Graph, InputRole, Literal, NodeId, Op, ReduceOp, UnaryOp,
};
use crate::host::{candle_dtype, QuantizedWeight, Value};

/// Runs `graph` on `inputs` (one tensor per declared input, in order) and returns one tensor per
/// declared output. Cache-root inputs are updated in place; their aliased outputs are the same
/// tensors. A graph with collectives needs [`run_rank`].
pub fn run(graph: &Graph, inputs: &[CTensor]) -> Result<Vec<CTensor>> {
    run_values(graph, &tensor_values(inputs))
}

/// [`run`] with inputs that may be quantized weights.
pub fn run_values(graph: &Graph, inputs: &[Value]) -> Result<Vec<CTensor>> {
    run_with(graph, inputs, None)
}

fn tensor_values(inputs: &[CTensor]) -> Vec<Value> {
    inputs.iter().cloned().map(Value::Tensor).collect()
}

/// One rank's step of a tensor-parallel graph: [`run`], with the graph's collectives met with
/// the other ranks of `comm`'s group as step number `step` (every rank numbers its steps
/// alike, so a failure is confined to the step it happened in). A failure here fails the
/// step on every rank.
pub fn run_rank(
    graph: &Graph,
    inputs: &[CTensor],
    comm: &RankComm,
    step: u64,
) -> Result<Vec<CTensor>> {
    let out = run_with(graph, &tensor_values(inputs), Some((comm, step)));
    if let Err(e) = &out {
        if !matches!(e, Error::Collective(_)) {
            comm.fail(step, &e.to_string());
        }
    }
    out
}

/// Joins the ranks' `logits` outputs of `graph` (each rank's vocabulary slice, see
/// `model::vocab`) into whole rows, in rank 0's outputs; a graph without logits is left as is.
pub fn join_logits(graph: &Graph, outs: &mut [Vec<CTensor>]) -> Result<()> {
    if let (Some(i), false) = (graph.output_index("logits"), outs.is_empty()) {
        let slices: Vec<&CTensor> = outs.iter().map(|o| &o[i]).collect();
        let whole = CTensor::cat(&slices, 1)?;
        outs[0][i] = whole;
    }
    Ok(())
}

/// Every rank's step of a tensor-parallel graph: [`run_rank`] for each rank of `group` on its
/// own thread, with `inputs[r]` as rank `r`'s inputs, as step number `step`. Returns every
/// rank's outputs in rank order; when the step fails, the error is the first rank's own cause
/// (not the "another rank failed" the others report).
pub fn run_group(
    graph: &Graph,
    inputs: &[Vec<CTensor>],
    group: &std::sync::Arc<Group>,
    step: u64,
) -> Result<Vec<Vec<CTensor>>> {
    if inputs.len() != group.size() {
        return Err(Error::Internal(format!(
            "{} ranks' inputs for a group of {}",
            inputs.len(),
            group.size()
        )));
    }
    let outs = std::thread::scope(|s| {
        let handles: Vec<_> = inputs
            .iter()
            .enumerate()
            .map(|(r, inputs)| {
                let comm = group.rank(r);
                s.spawn(move || run_rank(graph, inputs, &comm?, step))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into())))
            })
            .collect::<Vec<_>>()
    });
    let first_cause = outs.iter().position(|o| {
        o.as_ref()
            .is_err_and(|e| !matches!(e, Error::Collective(_)))
    });
    let mut all = Vec::with_capacity(outs.len());
    let mut first_err = None;
    for (r, o) in outs.into_iter().enumerate() {
        match o {
            Ok(v) => all.push(v),
            Err(e) if first_cause.is_none_or(|i| i == r) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {}
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(all),
    }
}

fn run_with(
    graph: &Graph,
    inputs: &[Value],
    comm: Option<(&RankComm, u64)>,
) -> Result<Vec<CTensor>> {
    check_inputs(graph, inputs)?;
    let plan = Plan::new(graph, &quantized_inputs(inputs))?;
    run_planned(graph, &plan, inputs, comm)
}

/// Which inputs are quantized weights: what a [`Plan`] depends on besides the graph.
fn quantized_inputs(inputs: &[Value]) -> Vec<bool> {
    inputs.iter().map(is_quantized).collect()
}

/// Whether `v` is a weight in a GGML block format rather than a tensor.
fn is_quantized(v: &Value) -> bool {
    matches!(v, Value::Quantized(_))
}

/// A graph that keeps its execution plan between runs, for a caller that runs one graph many
/// times (a runner's step of a given shape): making the plan walks every node, 80 us of a
/// 12 ms batch-1 f32 step of the medium checkpoint (benches/LOG.md, "Tasks the threads
/// share evenly"). The plan is remade when the inputs' kinds (tensor or quantized weight)
/// differ from the last run's, so it never goes stale. Clones share the plan.
#[derive(Clone)]
pub struct Prepared {
    graph: Graph,
    /// The last plan made.
    plan: Arc<Mutex<Option<Arc<Planned>>>>,
}

/// A plan with the input kinds it was made for ([`quantized_inputs`]).
struct Planned {
    quantized: Vec<bool>,
    plan: Plan,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("graph", &self.graph.name())
            .finish_non_exhaustive()
    }
}

impl Prepared {
    /// `graph`, to be planned on its first run.
    pub fn new(graph: Graph) -> Self {
        Prepared {
            graph,
            plan: Default::default(),
        }
    }

    /// The graph itself.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// [`run_values`] of the graph, with the plan of an earlier run when the inputs are of
    /// the same kinds (compared in place: a step with a kept plan allocates nothing here).
    pub fn run(&self, inputs: &[Value]) -> Result<Vec<CTensor>> {
        let graph = &self.graph;
        check_inputs(graph, inputs)?;
        // Only a panic inside `Plan::new` could poison the lock, and it leaves the slot as it was.
        let mut slot = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        let same_kinds = |p: &Planned| {
            p.quantized
                .iter()
                .copied()
                .eq(inputs.iter().map(is_quantized))
        };
        let planned = match slot.as_ref() {
            Some(p) if same_kinds(p) => p.clone(),
            _ => {
                let quantized = quantized_inputs(inputs);
                let plan = Plan::new(graph, &quantized)?;
                slot.insert(Arc::new(Planned { quantized, plan })).clone()
            }
        };
        drop(slot);
        run_planned(graph, &planned.plan, inputs, None)
    }
}

/// Runs `graph` by `plan` (made for these inputs' kinds, which were checked).
fn run_planned(
    graph: &Graph,
    plan: &Plan,
    inputs: &[Value],
    comm: Option<(&RankComm, u64)>,
) -> Result<Vec<CTensor>> {
    let ranks = graph.ranks();
    match comm {
        None if ranks > 1 => {
            return Err(Error::Binding {
                name: graph.name().to_string(),
                msg: format!(
                    "the graph has collectives over {ranks} ranks; run it on each rank with \
                     its group (run_rank)"
                ),
            })
        }
        Some((c, _)) if c.size() != ranks && ranks > 1 => {
            return Err(Error::Binding {
                name: graph.name().to_string(),
                msg: format!(
                    "the graph's collectives span {ranks} ranks, the group has {}",
                    c.size()
                ),
            })
        }
        _ => {}
    }
    let comm_of = || comm.ok_or_else(|| Error::Internal("a collective without a group".into()));
    let mut remaining = plan.use_counts.clone();
    let mut values: Vec<Option<CTensor>> = vec![None; graph.nodes().len()];
    // For each value that shares a cache root's buffer, the index of that root input.
    let mut root_of: Vec<Option<usize>> = vec![None; graph.nodes().len()];
    // For each value that may share a cache root's storage (the root itself, its in-place
    // updates, and any view of them: candle's narrow, reshape, permute and broadcast return
    // views), the index of that root input. An update may write the storage in place only while
    // no other live value can see it (XLA semantics: a parameter read after its update sees the
    // old value).
    let mut shares: Vec<Option<usize>> = vec![None; graph.nodes().len()];

    for (i, node) in graph.nodes().iter().enumerate() {
        if plan.skipped[i] {
            continue;
        }
        let get = |id: NodeId| -> Result<&CTensor> {
            values[id.0].as_ref().ok_or_else(|| Error::Binding {
                name: graph.name().to_string(),
                msg: format!("node %{} read after it was freed", id.0),
            })
        };
        let started = profile::on().then(std::time::Instant::now);
        let value = match &node.op {
            Op::Input(k) => match &inputs[*k] {
                Value::Tensor(t) => {
                    if graph.inputs()[*k].role == InputRole::CacheRoot {
                        root_of[i] = Some(*k);
                        shares[i] = Some(*k);
                    }
                    t.clone()
                }
                // Read by its fused matmuls straight from `inputs`.
                Value::Quantized(_) => continue,
            },
            Op::Constant(lit) => constant(lit, node.shape.dims())?,
            Op::Iota { dim } => iota(node.shape.dims(), *dim, node.dtype)?,
            Op::Unary(op, x) => unary(*op, get(*x)?, node.dtype)?,
            Op::Binary(op, a, b) => binary(*op, get(*a)?, get(*b)?, node.dtype)?,
            Op::Compare(op, a, b) => {
                let (a, b) = (get(*a)?, get(*b)?);
                let op = match op {
                    CmpOp::Eq => candle_core::op::CmpOp::Eq,
                    CmpOp::Ne => candle_core::op::CmpOp::Ne,
                    CmpOp::Lt => candle_core::op::CmpOp::Lt,
                    CmpOp::Le => candle_core::op::CmpOp::Le,
                    CmpOp::Gt => candle_core::op::CmpOp::Gt,
                    CmpOp::Ge => candle_core::op::CmpOp::Ge,
                };
                a.cmp(b, op)?
            }
            Op::Select {
                pred,
                on_true,
                on_false,
            } => get(*pred)?.where_cond(get(*on_true)?, get(*on_false)?)?,
            Op::Cast(x) => cast(get(*x)?, graph.node(*x).dtype, node.dtype)?,
            Op::Broadcast(x) => {
                shares[i] = shares[x.0];
                get(*x)?.broadcast_as(node.shape.dims())?
            }
            Op::Reshape(x) => {
                shares[i] = shares[x.0];
                get(*x)?.reshape(node.shape.dims())?
            }
            Op::Permute(x, perm) => {
                shares[i] = shares[x.0];
                get(*x)?.permute(perm.as_slice())?
            }
            Op::Slice { x, dim, start, len } => {
                root_of[i] = root_of[x.0];
                shares[i] = shares[x.0];
                get(*x)?.narrow(*dim, *start, *len)?
            }
            Op::Concat(xs, dim) => {
                let ts = xs.iter().map(|x| get(*x)).collect::<Result<Vec<_>>>()?;
                CTensor::cat(&ts, *dim)?
            }
            Op::MatMul(a, _) if plan.quantized_rhs[i].is_some() => {
                let q = plan.quantized_rhs[i].ok_or_else(|| Error::Internal("plan".into()))?;
                let Value::Quantized(w) = &inputs[q.input] else {
                    return Err(Error::Internal(
                        "a quantized operand that is a tensor".into(),
                    ));
                };
                let x = get(*a)?;
                match q.form {
                    QuantizedForm::Linear => w.linear(x)?,
                    QuantizedForm::PerExpert => w.per_expert(x)?,
                    QuantizedForm::Gathered(ids) => w.gathered(x, &expert_ids(get(ids)?, w)?)?,
                }
            }
            Op::MatMul(a, _) if plan.dequantized_rhs[i].is_some() => {
                let d = plan.dequantized_rhs[i].ok_or_else(|| Error::Internal("plan".into()))?;
                let (x, q, s) = (get(*a)?, get(d.q)?, get(d.scale)?);
                match (d.ids, d.four_bit) {
                    (Some(ids), None) => gathered_matmul(x, q, get(ids)?, Experts::Int8(s))?,
                    (None, None) => x.apply_op3_no_bwd(&q.t()?, s, &matmul::ScaledMatMul)?,
                    (Some(ids), Some((g, f))) => {
                        gathered_matmul(x, q, get(ids)?, Experts::FourBit(s, g, f))?
                    }
                    // Every expert: the gathered kernel with each expert once, in order.
                    (None, Some((g, f))) => {
                        let every: Vec<usize> = (0..q.dim(0)?).collect();
                        matmul::gathered(x, q, &every, Experts::FourBit(s, g, f))?
                    }
                }
            }
            Op::MatMul(a, b) => {
                // Widening: operands of another dtype than the result (reduced-precision
                // operands with an f32 result, or a fused widening cast of the right operand).
                let a_dtype = graph.node(*a).dtype;
                match (plan.gathered_rhs[i], plan.widened_rhs[i]) {
                    (Some((w, ids)), _) => {
                        gathered_matmul(get(*a)?, get(w)?, get(ids)?, Experts::Float)?
                    }
                    (None, Some(x)) if x.transposed => matmul(get(*a)?, &get(x.node)?.t()?, true)?,
                    (None, Some(x)) => matmul(get(*a)?, get(x.node)?, true)?,
                    (None, None) => matmul(get(*a)?, get(*b)?, node.dtype != a_dtype)?,
                }
            }
            Op::Reduce(op, x, dim) => {
                let x = get(*x)?;
                match op {
                    ReduceOp::Sum if x.dtype() == CDType::F32 && *dim + 1 == x.rank() => {
                        x.contiguous()?.apply_op1_no_bwd(&kernels::RowSum)?
                    }
                    ReduceOp::Sum if x.dtype() == CDType::F32 && *dim + 1 < x.rank() => x
                        .contiguous()?
                        .apply_op1_no_bwd(&kernels::AxisSum { dim: *dim })?,
                    ReduceOp::Sum if matches!(x.dtype(), CDType::I32 | CDType::U32) => {
                        x.apply_op1_no_bwd(&kernels::IntSum { dim: *dim })?
                    }
                    ReduceOp::Sum => x.sum(*dim)?,
                    // candle refuses an empty max/min; HLO's reduce gives its init value.
                    _ if x.elem_count() == 0 => empty_reduce(*op, node.dtype, node.shape.dims())?,
                    ReduceOp::Max => x.max(*dim)?,
                    ReduceOp::Min => x.min(*dim)?,
                }
            }
            Op::ArgMax(x, dim) => {
                let x = get(*x)?;
                if x.dtype() == CDType::F32 && *dim + 1 == x.rank() && x.dims()[*dim] > 0 {
                    x.contiguous()?.apply_op1_no_bwd(&kernels::RowArgMax)?
                } else {
                    x.argmax(*dim)?.to_dtype(CDType::I32)?
                }
            }
            Op::TopK(x, k) => {
                let x = get(*x)?;
                let n = *x.dims().last().unwrap_or(&1);
                let data = x.flatten_all()?.to_vec1::<f32>()?;
                CTensor::from_vec(
                    kernels::topk_rows(&data, n, *k),
                    node.shape.dims(),
                    &Device::Cpu,
                )?
            }
            Op::MassThreshold { x, w, target } => {
                let x = get(*x)?;
                let n = x.dim(1)?;
                let rows = |t: &CTensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1()?) };
                CTensor::from_vec(
                    threshold::mass_threshold_rows(
                        &rows(x)?,
                        &rows(get(*w)?)?,
                        &rows(get(*target)?)?,
                        n,
                    )?,
                    node.shape.dims(),
                    &Device::Cpu,
                )?
            }
            Op::Dequantize4Bit {
                codes,
                scales,
                group,
                format,
            } => {
                // In a reduced float type: the scale rounded to it, the (then exact) f32
                // product rounded once, as a multiply in that type computes it.
                let out = candle_dtype(node.dtype);
                let scales = get(*scales)?;
                if out == CDType::F32 {
                    four_bit::dequantize(get(*codes)?, scales, *group, *format)?
                } else {
                    let scales = scales.to_dtype(out)?.to_dtype(CDType::F32)?;
                    four_bit::dequantize(get(*codes)?, &scales, *group, *format)?.to_dtype(out)?
                }
            }
            Op::IndexSelect { x, ids, dim } => index_select(get(*x)?, get(*ids)?, *dim)?,
            Op::Gather { x, ids, dim } => {
                let ids = get(*ids)?.to_dtype(CDType::U32)?;
                get(*x)?.contiguous()?.gather(&ids.contiguous()?, *dim)?
            }
            Op::ScatterRows {
                root,
                rows,
                col,
                src,
            } => {
                // In place only when this is the root's last use and no other live value
                // (a view taken earlier, read later) shares its storage.
                let in_place = root_of[root.0].is_some_and(|k| {
                    remaining[root.0] == 1
                        && !(0..i)
                            .any(|j| j != root.0 && shares[j] == Some(k) && values[j].is_some())
                });
                let target = if in_place {
                    root_of[i] = root_of[root.0];
                    shares[i] = shares[root.0];
                    get(*root)?.clone()
                } else {
                    // A fresh, dense copy (the value may be a broadcast constant).
                    let value = get(*root)?;
                    match value.is_contiguous() {
                        true => value.copy()?,
                        false => value.contiguous()?,
                    }
                };
                let src = get(*src)?.contiguous()?;
                let rows = get(*rows)?.contiguous()?;
                target.inplace_op3(&rows, &src, &kernels::ScatterRowsInPlace { col: *col })?;
                target
            }
            Op::AllReduce { op, x, .. } => {
                let (c, step) = comm_of()?;
                c.all_reduce(step, get(*x)?, *op)?
            }
            Op::AllGather { x, dim, .. } => {
                let (c, step) = comm_of()?;
                c.all_gather(step, get(*x)?, *dim)?
            }
        };
        if let Some(t0) = started {
            profile::record(plan.label(graph, i), t0.elapsed());
        }
        values[i] = Some(value);
        for operand in plan.operands(graph, i) {
            remaining[operand.0] -= 1;
            if remaining[operand.0] == 0 {
                values[operand.0] = None;
            }
        }
    }

    // Two passes: an output that views a root's storage (a slice of the parameter, returned
    // as is) is copied before any copy-back below writes that storage, so it keeps the value
    // the graph computed: the parameter's old one.
    let mut outputs = Vec::with_capacity(graph.outputs().len());
    for out in graph.outputs() {
        let value = values[out.node.0].clone().ok_or_else(|| Error::Binding {
            name: out.name.clone(),
            msg: "output was never computed".into(),
        })?;
        let is_root_update = out.aliases.is_some() && out.aliases == root_of[out.node.0];
        outputs.push(if shares[out.node.0].is_some() && !is_root_update {
            value.copy()?
        } else {
            value
        });
    }
    for (out, value) in graph.outputs().iter().zip(outputs.iter_mut()) {
        match out.aliases {
            // The update went elsewhere (the root was still needed): copy it back so the
            // caller's buffer holds the new cache, as the alias promises.
            Some(k) if root_of[out.node.0] != Some(k) => {
                let Value::Tensor(root) = &inputs[k] else {
                    return Err(Error::Internal("a quantized cache root".into()));
                };
                root.slice_set(&value.contiguous()?, 0, 0)?;
                *value = root.clone();
            }
            _ => {}
        }
    }
    Ok(outputs)
}

/// How the nodes of a graph are executed: which ones are fused away, and the resulting use
/// counts.
///
/// Two fusions matter on the CPU, both to avoid copying weights on every step:
/// - a `cast` to f32 of a reduced-precision operand that only a matmul reads (how the model
///   widens bf16 weights and caches, see `model::ops::matmul`) is not executed: the matmul
///   reads the bf16 values and widens them tile by tile ([`matmul::WidenMatMul`]). The cast
///   may also sit under a transpose of the last two dims, `permute(cast(w))`, as an imported
///   HLO `dot` of a converted weight reads back: then the matmul reads `w`'s transposed view,
///   so both forms run the same kernel (and an HLO round trip stays bit for bit the same).
/// - `matmul(a, [cast](permute(index_select(w, ids, 0), [0, 2, 1])))`, the gather MoE strategy.
///   Executed literally it copies every selected expert's weights each step (tens of MB per
///   layer); fused, each row multiplies against its expert's slice of the stacked weight in
///   place, reading only what it needs.
///
/// A weight input bound as a [`QuantizedWeight`] (`--quantize q8_0|q4_k`) has no tensor at
/// all: every matmul that reads it, in the linear, gathered or dense-expert form, becomes one
/// quantized matmul, and any other read of it is an error when the plan is made.
struct Plan {
    /// `quantized_rhs[m]` for a matmul `m` whose right operand is (a view of) a quantized
    /// weight input.
    quantized_rhs: Vec<Option<QuantizedRhs>>,
    /// `gathered_rhs[m] = Some((w, ids))` for a fused gathered matmul `m`.
    gathered_rhs: Vec<Option<(NodeId, NodeId)>>,
    /// `dequantized_rhs[m]` for a matmul `m` whose right operand is int8 experts dequantized
    /// in the graph (gathered or all of them).
    dequantized_rhs: Vec<Option<Dequantized>>,
    /// `widened_rhs[m] = Some(w)` for a matmul `m` whose right operand is a fused cast of `w`
    /// (or, with [`Widened::transposed`], of `w` with its last two dims swapped).
    widened_rhs: Vec<Option<Widened>>,
    /// Nodes computed inside a fused node instead of on their own.
    skipped: Vec<bool>,
    /// Reads of each node by executed nodes and outputs.
    use_counts: Vec<usize>,
}

impl Plan {
    /// The plan of `graph` whose inputs `k` with `quantized[k]` are quantized weights; an error
    /// when the graph reads one of those other than as a matmul's weight.
    fn new(graph: &Graph, quantized: &[bool]) -> Result<Self> {
        let n = graph.nodes().len();
        let counts = graph.use_counts();
        let mut plan = Plan {
            quantized_rhs: vec![None; n],
            gathered_rhs: vec![None; n],
            dequantized_rhs: vec![None; n],
            widened_rhs: vec![None; n],
            skipped: vec![false; n],
            use_counts: vec![0; n],
        };
        let single_use = |id: NodeId| counts[id.0] == 1;
        for (m, node) in graph.nodes().iter().enumerate() {
            let Op::MatMul(_, b) = node.op else { continue };
            if let Some((w, fused)) = transposed_widening(graph, b, single_use) {
                plan.widened_rhs[m] = Some(Widened {
                    node: w,
                    transposed: true,
                });
                for f in fused {
                    plan.skipped[f.0] = true;
                }
                continue;
            }
            // A widening cast that only this matmul reads.
            let (rhs, cast) = match graph.node(b).op {
                Op::Cast(x)
                    if single_use(b)
                        && graph.node(b).dtype == DType::F32
                        && graph.node(x).dtype.is_reduced_float() =>
                {
                    (x, Some(b))
                }
                _ => (b, None),
            };
            if let Some((q, fused)) = quantized_operand(graph, rhs, quantized) {
                if fused.iter().all(|&f| single_use(f)) {
                    plan.quantized_rhs[m] = Some(q);
                    for f in fused.into_iter().chain(cast) {
                        plan.skipped[f.0] = true;
                    }
                    continue;
                }
            }
            if let Some((d, fused)) = dequantized_operand(graph, rhs) {
                if fused.iter().all(|&f| single_use(f)) {
                    plan.dequantized_rhs[m] = Some(d);
                    for f in fused {
                        plan.skipped[f.0] = true;
                    }
                    continue;
                }
            }
            if let Some((p, s, x, ids)) = gathered_operand(graph, rhs) {
                if single_use(p) && single_use(s) {
                    plan.gathered_rhs[m] = Some((x, ids));
                    plan.skipped[p.0] = true;
                    plan.skipped[s.0] = true;
                    if let Some(c) = cast {
                        plan.skipped[c.0] = true;
                    }
                    continue;
                }
            }
            if let Some(c) = cast {
                plan.widened_rhs[m] = Some(Widened {
                    node: rhs,
                    transposed: false,
                });
                plan.skipped[c.0] = true;
            }
        }
        for i in 0..n {
            for operand in plan.operands(graph, i) {
                plan.use_counts[operand.0] += 1;
            }
        }
        for out in graph.outputs() {
            plan.use_counts[out.node.0] += 1;
        }
        // What reads a quantized weight must be one of the fused matmuls above.
        let is_quantized = |id: NodeId| match graph.node(id).op {
            Op::Input(k) => quantized.get(k).copied().unwrap_or(false),
            _ => false,
        };
        let stray = (0..n)
            .flat_map(|i| plan.operands(graph, i))
            .chain(graph.outputs().iter().map(|o| o.node))
            .find(|&id| is_quantized(id));
        if let Some(id) = stray {
            let Op::Input(k) = graph.node(id).op else {
                return Err(Error::Internal("plan".into()));
            };
            return Err(Error::Binding {
                name: graph.inputs()[k].name.clone(),
                msg: "this weight is held in a GGML block format, but the graph reads it other \
                      than as a matmul's weight"
                    .into(),
            });
        }
        Ok(plan)
    }

    /// Node `i`'s label in a profile: its op, and for a matmul the kernel that runs it.
    fn label(&self, graph: &Graph, i: usize) -> &'static str {
        let op = &graph.nodes()[i].op;
        if !matches!(op, Op::MatMul(..)) {
            return op.name();
        }
        match (
            self.quantized_rhs[i].map(|q| q.form),
            self.dequantized_rhs[i],
            self.gathered_rhs[i],
            self.widened_rhs[i],
        ) {
            (Some(QuantizedForm::Linear), ..) => "matmul: ggml-quantized weight",
            (Some(_), ..) => "matmul: ggml-quantized experts",
            (None, Some(_), ..) => "matmul: int8 experts",
            (None, None, Some(_), _) => "matmul: gathered experts",
            (None, None, None, Some(_)) => "matmul: widened (reduced-precision operand)",
            (None, None, None, None) => "matmul: f32",
        }
    }

    /// The values node `i` reads as executed.
    fn operands(&self, graph: &Graph, i: usize) -> Vec<NodeId> {
        if self.skipped[i] {
            return vec![];
        }
        let op = &graph.nodes()[i].op;
        if let (Op::MatMul(a, _), Some(q)) = (op, self.quantized_rhs[i]) {
            return match q.form {
                QuantizedForm::Gathered(ids) => vec![*a, ids],
                _ => vec![*a],
            };
        }
        if let (Op::MatMul(a, _), Some(d)) = (op, self.dequantized_rhs[i]) {
            return [*a, d.q, d.scale].into_iter().chain(d.ids).collect();
        }
        match (op, self.gathered_rhs[i], self.widened_rhs[i]) {
            (Op::MatMul(a, _), Some((w, ids)), _) => vec![*a, w, ids],
            (Op::MatMul(a, _), None, Some(x)) => vec![*a, x.node],
            (op, _, _) => op.operands(),
        }
    }
}

/// A matmul's right operand read in its reduced precision, the cast to f32 fused away.
#[derive(Debug, Clone, Copy)]
struct Widened {
    /// The reduced-precision value the cast read.
    node: NodeId,
    /// Whether the operand is that value with its last two dims swapped (`permute(cast(w))`).
    transposed: bool,
}

/// `permute(cast(w))` with the permute swapping the last two dims only and the cast widening a
/// reduced float to f32, each read by nothing else: `w` and the two nodes to skip.
fn transposed_widening(
    graph: &Graph,
    rhs: NodeId,
    single_use: impl Fn(NodeId) -> bool,
) -> Option<(NodeId, [NodeId; 2])> {
    let op = &graph.node(rhs).op;
    let Op::Permute(cast, _) = *op else {
        return None;
    };
    let Op::Cast(w) = graph.node(cast).op else {
        return None;
    };
    let widens = graph.node(cast).dtype == DType::F32 && graph.node(w).dtype.is_reduced_float();
    (op.is_matrix_transpose() && widens && single_use(rhs) && single_use(cast))
        .then_some((w, [rhs, cast]))
}

/// A matmul's right operand read from a quantized weight input.
#[derive(Debug, Clone, Copy)]
struct QuantizedRhs {
    /// The input holding the weight.
    input: usize,
    form: QuantizedForm,
}

/// How the matmul reads its quantized weight.
#[derive(Debug, Clone, Copy)]
enum QuantizedForm {
    /// `x @ w^T` of a matrix: `permute(w, [1, 0])`.
    Linear,
    /// Every expert of stacked `w` on its own rows: `permute(w, [0, 2, 1])`.
    PerExpert,
    /// The experts these ids select: `permute(index_select(w, ids, 0), [0, 2, 1])`.
    Gathered(NodeId),
}

/// The quantized weight a matmul's right operand `rhs` reads, with the nodes the fusion
/// replaces.
fn quantized_operand(
    graph: &Graph,
    rhs: NodeId,
    quantized: &[bool],
) -> Option<(QuantizedRhs, Vec<NodeId>)> {
    let input_of = |id: NodeId| match graph.node(id).op {
        Op::Input(k) if quantized.get(k).copied().unwrap_or(false) => Some(k),
        _ => None,
    };
    let Op::Permute(x, ref perm) = graph.node(rhs).op else {
        return None;
    };
    let rank = graph.node(x).shape.rank();
    if let Some(input) = input_of(x) {
        let form = match (rank, perm.as_slice()) {
            (2, [1, 0]) => QuantizedForm::Linear,
            (3, [0, 2, 1]) => QuantizedForm::PerExpert,
            _ => return None,
        };
        return Some((QuantizedRhs { input, form }, vec![rhs]));
    }
    let Op::IndexSelect { x: w, ids, dim: 0 } = graph.node(x).op else {
        return None;
    };
    let input = input_of(w)?;
    (rank == 3 && perm == &[0, 2, 1]).then_some((
        QuantizedRhs {
            input,
            form: QuantizedForm::Gathered(ids),
        },
        vec![rhs, x],
    ))
}

/// Quantized experts dequantized in the graph, as `model::moe` writes it:
/// - int8: `permute(cast(q') * broadcast(reshape(s')), [0, 2, 1])`;
/// - 4-bit (int4 or FP4): `permute(dequantize_4bit(q', s'), [0, 2, 1])`;
///
/// where `q'`, `s'` are `q`, `s` or `index_select(q, ids)`, `index_select(s, ids)` (the same
/// `ids`).
#[derive(Debug, Clone, Copy)]
struct Dequantized {
    /// `[experts, out, in]` int8 codes, or `[experts, out, in / 2]` 4-bit codes.
    q: NodeId,
    /// `[experts, out]` f32 scales (int8), or `[experts, out, groups]` (4-bit).
    scale: NodeId,
    /// The selected experts, when gathered.
    ids: Option<NodeId>,
    /// For 4-bit codes, the values per scale and what a code means.
    four_bit: Option<(usize, FourBit)>,
}

/// `(q, s, ids)` and the index selects to skip, when `q'` and `s'` are `index_select(q, ids)`
/// and `index_select(s, ids)` of the same `ids`; else `(q', s', None)`.
fn selected_pair(graph: &Graph, qs: NodeId, ss: NodeId) -> (NodeId, NodeId, Option<NodeId>) {
    match (&graph.node(qs).op, &graph.node(ss).op) {
        (
            Op::IndexSelect { x: q, ids, dim: 0 },
            Op::IndexSelect {
                x: s,
                ids: ids2,
                dim: 0,
            },
        ) if ids == ids2 => (*q, *s, Some(*ids)),
        _ => (qs, ss, None),
    }
}

/// The dequantization feeding a matmul's right operand, with the nodes the fusion replaces.
fn dequantized_operand(graph: &Graph, rhs: NodeId) -> Option<(Dequantized, Vec<NodeId>)> {
    let Op::Permute(mul, ref perm) = graph.node(rhs).op else {
        return None;
    };
    if let Op::Dequantize4Bit {
        codes,
        scales,
        group,
        format,
    } = graph.node(mul).op
    {
        // The fused kernel widens to f32; a dequantization into bf16 runs as written.
        if graph.node(mul).dtype != DType::F32 {
            return None;
        }
        let (q, scale, ids) = selected_pair(graph, codes, scales);
        let mut fused = vec![rhs, mul];
        if ids.is_some() {
            fused.extend([codes, scales]);
        }
        let ok = perm == &[0, 2, 1] && graph.node(q).shape.rank() == 3;
        let d = Dequantized {
            q,
            scale,
            ids,
            four_bit: Some((group, format)),
        };
        return ok.then_some((d, fused));
    }
    let Op::Binary(BinaryOp::Mul, cast, bcast) = graph.node(mul).op else {
        return None;
    };
    let Op::Cast(qs) = graph.node(cast).op else {
        return None;
    };
    let Op::Broadcast(reshaped) = graph.node(bcast).op else {
        return None;
    };
    let Op::Reshape(ss) = graph.node(reshaped).op else {
        return None;
    };
    if perm != &[0, 2, 1]
        || graph.node(qs).dtype != DType::I8
        || graph.node(cast).dtype != DType::F32
    {
        return None;
    }
    let mut fused = vec![rhs, mul, cast, bcast, reshaped];
    let (q, scale, ids) = selected_pair(graph, qs, ss);
    if ids.is_some() {
        fused.extend([qs, ss]);
    }
    let ok = graph.node(q).shape.rank() == 3
        && graph.node(scale).shape.dims() == &graph.node(q).shape.dims()[..2]
        && graph.node(scale).dtype == DType::F32;
    let d = Dequantized {
        q,
        scale,
        ids,
        four_bit: None,
    };
    ok.then_some((d, fused))
}

/// `(permute, index_select, w, ids)` when `rhs` is `permute(index_select(w, ids, 0), [0, 2, 1])`
/// of a 3-D float `w`: the selected experts' weights, transposed.
fn gathered_operand(graph: &Graph, rhs: NodeId) -> Option<(NodeId, NodeId, NodeId, NodeId)> {
    let Op::Permute(s, ref perm) = graph.node(rhs).op else {
        return None;
    };
    let Op::IndexSelect { x, ids, dim: 0 } = graph.node(s).op else {
        return None;
    };
    let w = graph.node(x);
    (perm == &[0, 2, 1] && w.shape.rank() == 3 && w.dtype.is_float()).then_some((rhs, s, x, ids))
}

/// `out[i] = a[i] @ w[ids[i]]^T` for `a: [n, m, k]` and stacked experts `w` held as `experts`
/// says, `ids: [n]`: [`matmul::gathered`], after checking the
/// ids.
fn gathered_matmul(a: &CTensor, w: &CTensor, ids: &CTensor, experts: Experts) -> Result<CTensor> {
    let ids = checked_expert_ids(ids, w.dim(0)?)?;
    Ok(matmul::gathered(a, w, &ids, experts)?)
}

/// The expert ids `ids` (`[n]` i32) selects from quantized stacked experts `w`, checked.
fn expert_ids(ids: &CTensor, w: &QuantizedWeight) -> Result<Vec<usize>> {
    checked_expert_ids(ids, w.dims().first().copied().unwrap_or(0))
}

fn checked_expert_ids(ids: &CTensor, experts: usize) -> Result<Vec<usize>> {
    ids.to_vec1::<i32>()?
        .into_iter()
        .map(|e| match usize::try_from(e) {
            Ok(e) if e < experts => Ok(e),
            _ => Err(Error::Internal(format!(
                "expert index {e} out of range 0..{experts}"
            ))),
        })
        .collect::<Result<Vec<usize>>>()
}

fn check_inputs(graph: &Graph, inputs: &[Value]) -> Result<()> {
    if inputs.len() != graph.inputs().len() {
        return Err(Error::Binding {
            name: graph.name().to_string(),
            msg: format!(
                "{} inputs given, the graph declares {}",
                inputs.len(),
                graph.inputs().len()
            ),
        });
    }
    for (decl, v) in graph.inputs().iter().zip(inputs) {
        let t = match v {
            Value::Tensor(t) => t,
            Value::Quantized(q) if decl.role == InputRole::Weight => {
                if q.dims() != decl.shape.dims() {
                    return Err(Error::Binding {
                        name: decl.name.clone(),
                        msg: format!("expected {}, got a quantized {:?}", decl.shape, q.dims()),
                    });
                }
                continue;
            }
            Value::Quantized(_) => {
                return Err(Error::Binding {
                    name: decl.name.clone(),
                    msg: "only weights can be quantized".into(),
                })
            }
        };
        if t.dims() != decl.shape.dims() || t.dtype() != candle_dtype(decl.dtype) {
            return Err(Error::Binding {
                name: decl.name.clone(),
                msg: format!(
                    "expected {} {}, got {:?} {:?}",
                    decl.shape,
                    decl.dtype,
                    t.dims(),
                    t.dtype()
                ),
            });
        }
        if decl.role == InputRole::CacheRoot && !t.is_contiguous() {
            return Err(Error::Binding {
                name: decl.name.clone(),
                msg: "a cache root must be contiguous".into(),
            });
        }
    }
    Ok(())
}

fn constant(lit: &Literal, dims: &[usize]) -> Result<CTensor> {
    let dev = &Device::Cpu;
    Ok(match lit {
        Literal::F32(v) => CTensor::from_slice(v, dims, dev)?,
        Literal::BF16(v) => CTensor::from_slice(v, dims, dev)?,
        Literal::F16(v) => CTensor::from_slice(v, dims, dev)?,
        Literal::F8E4M3(v) => CTensor::from_slice(v, dims, dev)?,
        Literal::I32(v) => CTensor::from_slice(v, dims, dev)?,
        Literal::U32(v) => CTensor::from_slice(v, dims, dev)?,
        Literal::I8(v) => {
            CTensor::from_vec(v.iter().map(|&x| x as u8).collect::<Vec<_>>(), dims, dev)?
        }
    })
}

/// Converts `x` (graph dtype `from`) to `to`. candle converts between its own types; `i8`
/// (held as `u8` bytes) goes through i32 with HLO's semantics: float to integer truncates
/// toward zero and saturates at the type's range (NaN becomes 0), integer to i8 wraps.
fn cast(x: &CTensor, from: DType, to: DType) -> Result<CTensor> {
    if to == DType::F8E4M3 && from != DType::I8 {
        return to_f8e4m3fn(x);
    }
    if from != DType::I8 && to != DType::I8 {
        return Ok(x.to_dtype(candle_dtype(to))?);
    }
    let dims = x.dims().to_vec();
    let dev = &Device::Cpu;
    let as_i32: Vec<i32> = if from == DType::I8 {
        let bytes = x.flatten_all()?.to_vec1::<u8>()?;
        bytes.iter().map(|&b| i32::from(b as i8)).collect()
    } else if from.is_float() {
        let v = x.flatten_all()?.to_dtype(CDType::F32)?.to_vec1::<f32>()?;
        return Ok(CTensor::from_vec(
            v.iter()
                .map(|&f| f.clamp(-128.0, 127.0) as i8 as u8)
                .collect::<Vec<_>>(),
            dims,
            dev,
        )?);
    } else {
        x.flatten_all()?.to_dtype(CDType::I32)?.to_vec1::<i32>()?
    };
    if to == DType::I8 {
        let bytes: Vec<u8> = as_i32.iter().map(|&v| v as i8 as u8).collect();
        return Ok(CTensor::from_vec(bytes, dims, dev)?);
    }
    Ok(CTensor::from_vec(as_i32, dims, dev)?.to_dtype(candle_dtype(to))?)
}

/// Converts to f8e4m3fn as HLO's `convert` does: round to nearest even, and NaN (the type has
/// no infinity) for NaN, ±inf and magnitudes beyond the 464 tie between 448 and the next
/// power (float8's own conversion saturates those to ±448 instead, CUDA's `SATFINITE`).
fn to_f8e4m3fn(x: &CTensor) -> Result<CTensor> {
    let dims = x.dims().to_vec();
    let v = x.flatten_all()?.to_dtype(CDType::F32)?.to_vec1::<f32>()?;
    let out: Vec<float8::F8E4M3> = v
        .iter()
        .map(|&f| {
            if f.is_nan() || f.abs() > 464.0 {
                float8::F8E4M3::from_bits(0x7f | if f.is_sign_negative() { 0x80 } else { 0 })
            } else {
                float8::F8E4M3::from_f32(f)
            }
        })
        .collect();
    Ok(CTensor::from_vec(out, dims, &Device::Cpu)?)
}

/// The result of reducing an empty input with `op`: every element (if any: only the reduced
/// dim may be empty) is the reduction's identity, the init value of the HLO `reduce` the
/// emitter writes (-inf for an f32 or bf16 max, +inf for a min, the extremes of the integer
/// types).
fn empty_reduce(op: ReduceOp, dtype: DType, dims: &[usize]) -> Result<CTensor> {
    let v = crate::backend::hlo::emit::reduce_identity(op, dtype);
    let lit = Literal::scalar(v, dtype)
        .ok_or_else(|| Error::shape(op.name(), format!("a reduction of {dtype} values")))?;
    Ok(constant(&lit, &[])?.broadcast_as(dims)?.contiguous()?)
}

fn iota(dims: &[usize], dim: usize, dtype: DType) -> Result<CTensor> {
    let n = dims[dim];
    let mut line_shape = vec![1; dims.len()];
    line_shape[dim] = n;
    let line = match dtype {
        DType::F32 => CTensor::from_vec(
            (0..n).map(|i| i as f32).collect::<Vec<_>>(),
            line_shape,
            &Device::Cpu,
        )?,
        _ => CTensor::from_vec(
            (0..n).map(|i| i as i32).collect::<Vec<_>>(),
            line_shape,
            &Device::Cpu,
        )?,
    };
    Ok(line.broadcast_as(dims)?)
}

fn unary(op: UnaryOp, x: &CTensor, dtype: DType) -> Result<CTensor> {
    if dtype.is_int() {
        let v = x.flatten_all()?.to_vec1::<i32>()?;
        let out: Vec<i32> = match op {
            UnaryOp::Neg => v.iter().map(|a| a.wrapping_neg()).collect(),
            _ => v.iter().map(|a| a.wrapping_abs()).collect(),
        };
        return Ok(CTensor::from_vec(out, x.dims(), &Device::Cpu)?);
    }
    Ok(match op {
        UnaryOp::Neg => x.neg()?,
        UnaryOp::Abs => x.abs()?,
        UnaryOp::Exp => x.exp()?,
        UnaryOp::Log => x.log()?,
        UnaryOp::Sqrt => x.sqrt()?,
        UnaryOp::Rsqrt => x.sqrt()?.recip()?,
        UnaryOp::Sin => x.sin()?,
        UnaryOp::Cos => x.cos()?,
        UnaryOp::Tanh => x.tanh()?,
        UnaryOp::Sigmoid => (x.neg()?.exp()? + 1.0)?.recip()?,
        UnaryOp::Silu => x.silu()?,
    })
}

fn binary(op: BinaryOp, a: &CTensor, b: &CTensor, dtype: DType) -> Result<CTensor> {
    if matches!(dtype, DType::I32 | DType::U32) {
        return Ok(a.apply_op2_no_bwd(b, &kernels::IntBinary(op))?);
    }
    Ok(match op {
        BinaryOp::Add => a.add(b)?,
        BinaryOp::Sub => a.sub(b)?,
        BinaryOp::Mul => a.mul(b)?,
        BinaryOp::Div => a.div(b)?,
        BinaryOp::Max => a.maximum(b)?,
        BinaryOp::Min => a.minimum(b)?,
        other => {
            return Err(Error::shape(
                other.name(),
                format!("float operands {dtype}"),
            ));
        }
    })
}

/// `a @ b`; with `widen`, reduced-precision operands give an f32 result accumulated in f32
/// ([`matmul::WidenMatMul`]).
fn matmul(a: &CTensor, b: &CTensor, widen: bool) -> Result<CTensor> {
    // f32 too goes through the widening kernel, at any row count: it reads each weight row
    // once at any strides (candle's GEMM copies operands it cannot stride), and a row's
    // result does not depend on the other rows (see `matmul`'s module docs).
    if widen || (a.dtype() == CDType::F32 && b.dtype() == CDType::F32) {
        return Ok(a.apply_op2_no_bwd(b, &matmul::WidenMatMul)?);
    }
    match a.matmul(b) {
        Ok(t) => Ok(t),
        // candle accepts plain and transposed layouts; anything else (broadcast batch strides,
        // odd offsets) is made contiguous first.
        Err(_) => Ok(a.contiguous()?.matmul(&b.contiguous()?)?),
    }
}

fn index_select(x: &CTensor, ids: &CTensor, dim: usize) -> Result<CTensor> {
    if dim == 0 && x.rank() == 2 {
        return Ok(x.apply_op2_no_bwd(&ids.contiguous()?, &kernels::RowGather)?);
    }
    let ids = ids.to_dtype(CDType::U32)?;
    Ok(x.contiguous()?.index_select(&ids, dim)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::GraphBuilder;
    use crate::test_util::max_abs_diff;
    use candle_core::quantized::GgmlDType;

    /// `x @ w^T` for `x: [2, 64]` and a weight `w: [32, 64]`.
    fn linear_graph() -> Graph {
        let b = GraphBuilder::new("linear");
        let x = b
            .input("x", InputRole::Metadata, [2, 64], DType::F32)
            .unwrap();
        let w = b
            .input("w", InputRole::Weight, [32, 64], DType::F32)
            .unwrap();
        b.output("y", &x.matmul(&w.t().unwrap()).unwrap()).unwrap();
        b.finish().unwrap()
    }

    /// A prepared graph computes what the graph means on every run, and makes a new plan when
    /// a weight changes kind (a quantized weight read by a plan made for a tensor would not be
    /// read at all), then goes back to the tensor's plan.
    #[test]
    fn a_prepared_graph_plans_again_when_the_input_kinds_change() {
        let xs: Vec<f32> = (0..128)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0)
            .collect();
        let ws: Vec<f32> = (0..2048)
            .map(|i| ((i * 5 % 19) as f32 - 9.0) / 16.0)
            .collect();
        let want: Vec<f64> = (0..2)
            .flat_map(|r| (0..32).map(move |c| (r, c)))
            .map(|(r, c)| {
                (0..64)
                    .map(|k| f64::from(xs[r * 64 + k]) * f64::from(ws[c * 64 + k]))
                    .sum()
            })
            .collect();
        let x = CTensor::from_vec(xs, (2, 64), &Device::Cpu).unwrap();
        let w = CTensor::from_vec(ws, (32, 64), &Device::Cpu).unwrap();
        let q = QuantizedWeight::quantize(&w, GgmlDType::Q8_0).unwrap();
        let prepared = Prepared::new(linear_graph());
        let run = |w: Value| -> Vec<f32> {
            let out = prepared.run(&[Value::Tensor(x.clone()), w]).unwrap();
            out[0].flatten_all().unwrap().to_vec1().unwrap()
        };
        let worst = |got: &[f32]| max_abs_diff(got, &want);
        let tensor = run(Value::Tensor(w.clone()));
        assert!(worst(&tensor) < 1e-4, "f32: {}", worst(&tensor));
        assert_eq!(run(Value::Tensor(w.clone())), tensor);
        // q8_0 rounds each weight to 1/254 of its block's largest (and the left side too).
        let quantized = run(Value::Quantized(q));
        assert!(worst(&quantized) < 0.1, "q8_0: {}", worst(&quantized));
        assert_ne!(quantized, tensor);
        assert_eq!(run(Value::Tensor(w)), tensor);
    }
}
