//! One conformance suite, every executor: the per-op and per-block cases in
//! `tests/conformance/*.json` (expected values from numpy, written by
//! `scripts/make_conformance.py`) run on the CPU backend, on emit -> import -> CPU and through
//! nrt-sim's C API; `scripts/xla_conformance.py` runs the same cases' HLO in XLA.
//!
//! Every (case, executor) pair that fails is listed in one assertion message, with the first
//! differing elements. A case can name executors it is known to fail on (`known_failures`, with
//! the reason): those pairs are reported as known failures, and passing one is itself a failure,
//! so an entry goes away when its bug is fixed. A missing or unlisted case file fails the suite.
//!
//! Run one family's cases with `CONFORMANCE_FAMILY=blocks cargo test --test conformance`; see
//! the counts per family and executor with `-- --nocapture`.

#[path = "conformance/case.rs"]
mod case;
#[path = "conformance/executors.rs"]
mod executors;

use std::cell::Cell;
use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use deepinfer::graph::{BinaryOp, CmpOp, Graph, Op, ReduceOp, UnaryOp};

use case::{compare, prepare, Array, Case, Prepared};
use executors::{Executor, Sim};

/// Every case file, by family. A file on disk that is not listed here fails
/// [`every_case_file_is_listed`].
const FAMILIES: &[&str] = &[
    "unary",
    "binary",
    "compare",
    "select",
    "convert",
    "shape",
    "iota",
    "constant",
    "reduce",
    "argmax",
    "matmul",
    "gather",
    "scatter",
    "topk",
    "mass_threshold",
    "dequantize_int4",
    "dequantize_e2m1",
    "blocks",
];

/// Executor names `known_failures` may use: the Rust ones and `xla` (scripts/xla_conformance.py).
const EXECUTOR_NAMES: &[&str] = &["cpu", "hlo_cpu", "nrt_sim", "xla"];

thread_local! {
    /// Set while [`guarded`] runs an executor: its panics become errors, so the panic hook
    /// stays quiet for them (and only for them: other tests' panics still print).
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, turning a panic into an error naming it.
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                default(info)
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    result.unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a non-string payload".into());
        Err(format!("panicked: {msg}"))
    })
}

/// Compares every output of one run. A run that returns more or fewer outputs than the case
/// declares fails (a zip would compare only the common ones).
fn check(p: &Prepared<'_>, got: &[Array]) -> Result<(), String> {
    let (specs, expected) = (p.case.outputs.len(), p.expected.len());
    if (specs, expected) != (got.len(), got.len()) {
        return Err(format!(
            "{} outputs for {specs} declared and {expected} expected",
            got.len()
        ));
    }
    let errors: Vec<String> = p
        .case
        .outputs
        .iter()
        .zip(&p.expected)
        .zip(got)
        .filter_map(|((spec, want), g)| compare(g, want, spec).err())
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

#[derive(Default, Clone, Copy)]
struct Counts {
    passed: usize,
    known: usize,
    failed: usize,
}

/// The families selected by `CONFORMANCE_FAMILY` (all by default).
fn selected() -> Vec<&'static str> {
    match std::env::var("CONFORMANCE_FAMILY") {
        Ok(f) if !f.is_empty() => FAMILIES.iter().copied().filter(|x| *x == f).collect(),
        _ => FAMILIES.to_vec(),
    }
}

#[test]
fn every_case_on_every_executor() {
    let families = selected();
    assert!(!families.is_empty(), "CONFORMANCE_FAMILY names no family");
    let sim = Sim::open();
    let mut failures: Vec<String> = Vec::new();
    let mut known: Vec<String> = Vec::new();
    let mut table: Vec<(String, usize, [Counts; 3])> = Vec::new();
    for family in families {
        let file = match case::load(family) {
            Ok(f) => f,
            Err(e) => {
                failures.push(e);
                continue;
            }
        };
        let mut counts = [Counts::default(); 3];
        for c in &file.cases {
            for exec in c.known_failures.keys() {
                if !EXECUTOR_NAMES.contains(&exec.as_str()) {
                    failures.push(format!(
                        "{}: known failure for unknown executor `{exec}`",
                        c.name
                    ));
                }
            }
            let prepared = guarded(|| prepare(c));
            let hlo = prepared
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|p| guarded(|| executors::emit_hlo(p)));
            for (slot, exec) in Executor::ALL.into_iter().enumerate() {
                let result = match &prepared {
                    Err(e) => Err(format!("cannot build the case: {e}")),
                    Ok(p) => run(exec, p, hlo.as_deref(), sim.as_ref()),
                };
                record(
                    c,
                    exec,
                    result,
                    &mut counts[slot],
                    &mut failures,
                    &mut known,
                );
            }
        }
        table.push((family.to_string(), file.cases.len(), counts));
    }
    let report = render(&table, &known);
    println!("{report}");
    assert!(
        failures.is_empty(),
        "{} conformance failure(s):\n  {}\n\n{report}",
        failures.len(),
        failures.join("\n  ")
    );
}

fn run(
    exec: Executor,
    p: &Prepared<'_>,
    hlo: Result<&[u8], &String>,
    sim: Result<&Sim, &String>,
) -> Result<(), String> {
    let got = match exec {
        Executor::Cpu => guarded(|| executors::cpu(p)),
        Executor::HloCpu => hlo
            .map_err(|e| format!("cannot emit: {e}"))
            .and_then(|h| guarded(|| executors::hlo_cpu(p, h))),
        Executor::NrtSim => hlo.map_err(|e| format!("cannot emit: {e}")).and_then(|h| {
            let sim = sim.map_err(Clone::clone)?;
            guarded(|| executors::nrt_sim(sim, p, h))
        }),
    }?;
    check(p, &got)
}

fn record(
    c: &Case,
    exec: Executor,
    result: Result<(), String>,
    counts: &mut Counts,
    failures: &mut Vec<String>,
    known: &mut Vec<String>,
) {
    let expected_failure = c.known_failures.get(exec.name());
    // candle's errors carry a backtrace when RUST_BACKTRACE is set: keep the message line.
    let result = result.map_err(|e| e.lines().next().unwrap_or_default().to_string());
    match (result, expected_failure) {
        (Ok(()), None) => counts.passed += 1,
        (Err(e), None) => {
            counts.failed += 1;
            failures.push(format!("{} on {}: {e}", c.name, exec.name()));
        }
        (Err(e), Some(why)) => {
            counts.known += 1;
            known.push(format!(
                "{} on {}: {why}\n      got: {e}",
                c.name,
                exec.name()
            ));
        }
        (Ok(()), Some(why)) => {
            counts.failed += 1;
            failures.push(format!(
                "{} on {}: passes, but is listed as a known failure ({why}); remove the entry \
                 from scripts/make_conformance.py and regenerate",
                c.name,
                exec.name()
            ));
        }
    }
}

fn render(table: &[(String, usize, [Counts; 3])], known: &[String]) -> String {
    let mut s =
        String::from("family     cases   cpu (pass/known/fail)  hlo_cpu            nrt_sim\n");
    let mut total = (0, [Counts::default(); 3]);
    for (family, n, counts) in table {
        s += &format!("{family:<10} {n:>5}");
        for (k, c) in counts.iter().enumerate() {
            s += &format!("   {:>4}/{:>2}/{:>2}       ", c.passed, c.known, c.failed);
            total.1[k].passed += c.passed;
            total.1[k].known += c.known;
            total.1[k].failed += c.failed;
        }
        s += "\n";
        total.0 += n;
    }
    s += &format!("{:<10} {:>5}", "total", total.0);
    for c in total.1 {
        s += &format!("   {:>4}/{:>2}/{:>2}       ", c.passed, c.known, c.failed);
    }
    if !known.is_empty() {
        s += &format!(
            "\n\nknown failures ({}):\n  {}",
            known.len(),
            known.join("\n  ")
        );
    }
    s
}

#[test]
fn every_case_file_is_listed() {
    let on_disk: BTreeSet<String> = std::fs::read_dir(case::case_dir())
        .expect("tests/conformance exists")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    let listed: BTreeSet<String> = FAMILIES.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        on_disk, listed,
        "the case files on disk and FAMILIES in tests/conformance.rs differ"
    );
}

// === Coverage: every op of src/graph/op.rs, with every dtype the builder accepts today ===

// The matches below name every variant, so a new op or op kind does not compile until it is
// given a coverage key (and then a case).
fn unary_name(u: UnaryOp) -> &'static str {
    match u {
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

fn binary_name(b: BinaryOp) -> &'static str {
    match b {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::Rem => "rem",
        BinaryOp::Max => "maximum",
        BinaryOp::Min => "minimum",
        BinaryOp::BitXor => "bitxor",
        BinaryOp::BitAnd => "bitand",
        BinaryOp::Shr => "shr",
        BinaryOp::Shl => "shl",
    }
}

fn cmp_name(c: CmpOp) -> &'static str {
    match c {
        CmpOp::Eq => "eq",
        CmpOp::Ne => "ne",
        CmpOp::Lt => "lt",
        CmpOp::Le => "le",
        CmpOp::Gt => "gt",
        CmpOp::Ge => "ge",
    }
}

fn reduce_name(r: ReduceOp) -> &'static str {
    match r {
        ReduceOp::Sum => "reduce_sum",
        ReduceOp::Max => "reduce_max",
        ReduceOp::Min => "reduce_min",
    }
}

/// `op.dtype` for each node (`cast.from->to` for a cast, `matmul.from->to` for a matmul whose
/// result dtype is not its operands'; the operand's dtype for compare, argmax and top-k).
fn coverage_keys(g: &Graph) -> Vec<String> {
    let dt = |id: deepinfer::graph::NodeId| g.node(id).dtype.name();
    g.nodes()
        .iter()
        .map(|n| {
            let d = n.dtype.name();
            match &n.op {
                Op::Input(_) => format!("input.{d}"),
                Op::Constant(_) => format!("constant.{d}"),
                Op::Iota { .. } => format!("iota.{d}"),
                Op::Unary(u, _) => format!("{}.{d}", unary_name(*u)),
                Op::Binary(b, _, _) => format!("{}.{d}", binary_name(*b)),
                Op::Compare(c, a, _) => format!("{}.{}", cmp_name(*c), dt(*a)),
                Op::Select { .. } => format!("select.{d}"),
                Op::Cast(x) => format!("cast.{}->{d}", dt(*x)),
                Op::Broadcast(_) => format!("broadcast.{d}"),
                Op::Reshape(_) => format!("reshape.{d}"),
                Op::Permute(..) => format!("permute.{d}"),
                Op::Slice { .. } => format!("slice.{d}"),
                Op::Concat(..) => format!("concat.{d}"),
                Op::MatMul(a, _) if dt(*a) != d => format!("matmul.{}->{d}", dt(*a)),
                Op::MatMul(..) => format!("matmul.{d}"),
                Op::Reduce(r, _, _) => format!("{}.{d}", reduce_name(*r)),
                Op::ArgMax(x, _) => format!("argmax.{}", dt(*x)),
                Op::TopK(x, _) => format!("topk.{}", dt(*x)),
                Op::MassThreshold { .. } => format!("mass_threshold.{d}"),
                Op::Dequantize4Bit { format, .. } => format!("{}.{d}", format.op_name()),
                Op::IndexSelect { .. } => format!("index_select.{d}"),
                Op::Gather { .. } => format!("gather.{d}"),
                Op::ScatterRows { .. } => format!("scatter_rows.{d}"),
                // Single-rank cases hold no collectives (tests/tp_lowering.rs and
                // tests/tensor_parallel.rs cover them).
                Op::AllReduce { op, .. } => format!("all_{}.{d}", reduce_name(*op)),
                Op::AllGather { .. } => format!("all_gather.{d}"),
            }
        })
        .collect()
}

/// Every op with every dtype its builder method accepts today, for f32, i32, u32 and bool; for
/// the narrow types (bf16, f16, f8e4m3fn, i8) what the model does with them: literals, casts to
/// and from f32 (and i8 to and from i32), reductions (bf16, f16), matmuls with an f32 result,
/// data movement, gathers and cache writes; for u8, the int4 experts' packed codes: inputs,
/// their selection by expert and their dequantization.
fn required_keys() -> BTreeSet<String> {
    const ALL: &[&str] = &["f32", "i32", "u32", "bool"];
    const NUM: &[&str] = &["f32", "i32", "u32"];
    const INT: &[&str] = &["i32", "u32"];
    const F: &[&str] = &["f32"];
    let table: &[(&[&str], &[&str])] = &[
        (
            &[
                "input",
                "select",
                "broadcast",
                "reshape",
                "permute",
                "slice",
                "concat",
            ],
            ALL,
        ),
        (&["index_select", "gather", "scatter_rows"], ALL),
        (&["eq", "ne", "lt", "le", "gt", "ge"], ALL),
        (
            &["constant", "add", "sub", "mul", "div", "maximum", "minimum"],
            NUM,
        ),
        (&["reduce_sum", "reduce_max", "reduce_min"], NUM),
        (&["rem", "bitxor", "bitand", "shr", "shl"], INT),
        (&["neg", "abs", "iota"], &["f32", "i32"]),
        (
            &[
                "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "silu",
            ],
            F,
        ),
        (&["matmul", "argmax", "topk", "mass_threshold"], F),
    ];
    let mut keys: BTreeSet<String> = table
        .iter()
        .flat_map(|(ops, dts)| {
            ops.iter()
                .flat_map(move |op| dts.iter().map(move |d| format!("{op}.{d}")))
        })
        .collect();
    const NARROW: &[&str] = &["bf16", "f16", "f8e4m3fn", "i8"];
    let narrow: &[(&[&str], &[&str])] = &[
        (
            &[
                "input",
                "constant",
                "broadcast",
                "reshape",
                "permute",
                "slice",
                "concat",
                "index_select",
                "scatter_rows",
            ],
            NARROW,
        ),
        (
            &["reduce_sum", "reduce_max", "reduce_min"],
            &["bf16", "f16"],
        ),
        (&["gather"], &["bf16"]),
        (&["matmul"], &["bf16->f32", "f16->f32"]),
        // int4 experts: packed codes are u8 inputs, selected by expert, then dequantized.
        (&["input", "index_select"], &["u8"]),
        (&["dequantize_int4", "dequantize_e2m1"], &["f32"]),
    ];
    keys.extend(narrow.iter().flat_map(|(ops, dts)| {
        ops.iter()
            .flat_map(move |op| dts.iter().map(move |d| format!("{op}.{d}")))
    }));
    for cast in [
        "f32->bf16",
        "f32->f16",
        "f32->f8e4m3fn",
        "bf16->f32",
        "f16->f32",
        "f8e4m3fn->f32",
        "f32->i8",
        "i8->f32",
        "i8->i32",
        "i32->i8",
        "f32->i32",
        "f32->u32",
        "i32->f32",
        "u32->f32",
        "i32->u32",
        "u32->i32",
        "bool->f32",
        "bool->i32",
        "bool->u32",
    ] {
        keys.insert(format!("cast.{cast}"));
    }
    keys
}

#[test]
fn every_op_and_dtype_is_covered() {
    let mut covered = BTreeSet::new();
    for family in FAMILIES {
        let file = case::load(family).unwrap();
        for c in &file.cases {
            let p = prepare(c).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            covered.extend(coverage_keys(&p.graph));
        }
    }
    let missing: Vec<_> = required_keys().difference(&covered).cloned().collect();
    assert!(
        missing.is_empty(),
        "no conformance case exercises: {missing:?}"
    );
}
