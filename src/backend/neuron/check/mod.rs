//! `deepinfer lower --check neuron`: what neuronx-cc and libnrt would reject in a module, found
//! without either.
//!
//! The check reads the emitted `HloModuleProto`, exactly the bytes neuronx-cc compiles, so it
//! sees what the compiler sees (not the graph before lowering). Each [`Rule`] is one thing the
//! real toolchain is documented (or, for the integer multiply, inferred from AWS's docs) to
//! reject or mis-compute; the facts and their sources are in `accepted` (one place), the
//! instruction and compile-time estimates in `estimate`. [`check_module`] checks one module;
//! [`CheckReport`] prints the table of graphs x rules and knows whether anything failed.

pub mod accepted;
pub mod estimate;

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::backend::hlo::proto::{HloInstructionProto, HloModuleProto, ShapeProto};
use accepted::{
    accepted, known_custom_call, INSTRUCTION_BUDGET, LARGE_TENSOR_BYTES, MAX_SORT_WIDTH,
    TOPK_TARGET,
};

/// One thing a module must not contain to compile and run on trn1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// An opcode (or custom-call target) not known to be accepted by neuronx-cc
    /// ([`accepted::OPCODES`]).
    Opcode,
    /// A sort wider than [`MAX_SORT_WIDTH`] along its sorted dimension (or an `AwsNeuronTopK`
    /// with a larger k): NCC_EVRF014 (aws-neuron-sdk#1339).
    WideSort,
    /// A `transpose` of a weight (a parameter, or a convert, reshape or slice of one) that feeds
    /// a `dot`: a copy of the weight every step unless the compiler folds it; `dot` takes
    /// contracting dimensions instead.
    WeightTranspose,
    /// An integer `multiply`. NeuronCore-v2 vector engines cast arithmetic operands to fp32
    /// (NKI `nki.isa.tensor_tensor`: "the engine automatically casts input data types to
    /// float32 and performs the element-wise operation in float32 math"), so a product is exact
    /// only below 2^24 and wrap-around is lost. Shifts and bit operations are exact.
    IntMultiply,
    /// A 64-bit (or complex) element type: neuronx-cc downcasts int64 to int32 on trn1 and has
    /// no f64 or complex arithmetic (NCC_EVRF004).
    Wide64,
    /// A tensor (any instruction's shape, parameters included) of [`LARGE_TENSOR_BYTES`] or more:
    /// needs Neuron runtime 2.30.50.0 (SDK 2.28) or later.
    LargeTensor,
    /// More estimated instructions than neuronx-cc's budget ([`INSTRUCTION_BUDGET`]).
    Instructions,
    /// A narrow weight (bf16, f16, int8, packed int4, fp8) converted to f32 on its way to a
    /// `dot` (through reshapes, selections, broadcasts and a dequantization's products): the
    /// whole weight rewritten in f32 every step and multiplied at a quarter of the bf16 rate.
    /// Device graphs multiply narrow operands into f32 results instead (`model::precision`,
    /// `Dots::Split`).
    WidenedWeight,
}

impl Rule {
    /// Every rule, in table order.
    pub const ALL: [Rule; 8] = [
        Rule::Opcode,
        Rule::WideSort,
        Rule::WeightTranspose,
        Rule::WidenedWeight,
        Rule::IntMultiply,
        Rule::Wide64,
        Rule::LargeTensor,
        Rule::Instructions,
    ];

    /// The rule whose column heading is `name`.
    pub fn from_name(name: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The column heading.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Opcode => "opcode",
            Rule::WideSort => "sort>16384",
            Rule::WeightTranspose => "w-transpose",
            Rule::WidenedWeight => "w-to-f32",
            Rule::IntMultiply => "int-mul",
            Rule::Wide64 => "64-bit",
            Rule::LargeTensor => ">=4GiB",
            Rule::Instructions => "instr-budget",
        }
    }

    /// Why the rule exists, for the report's footnotes.
    pub fn why(self) -> &'static str {
        match self {
            Rule::Opcode => {
                "opcodes or custom-call targets with no public evidence that neuronx-cc \
                 accepts them (verify with `neuronx-cc list-operators --framework XLA`)"
            }
            Rule::WideSort => {
                "neuronx-cc turns sort + slice into AwsNeuronTopK with k = the row length and \
                 fails above 16,384 (NCC_EVRF014, aws-neuron-sdk#1339)"
            }
            Rule::WeightTranspose => {
                "a transposed copy of a weight every step; use dot's contracting dimensions"
            }
            Rule::WidenedWeight => {
                "a narrow weight converted to f32 before its dot: an f32 copy every step and f32 \
                 matmuls (a quarter of trn1's bf16 rate); multiply narrow operands into an f32 \
                 result"
            }
            Rule::IntMultiply => {
                "vector engines compute arithmetic in fp32 (NKI nki.isa.tensor_tensor): \
                 integer products are exact only below 2^24 and do not wrap"
            }
            Rule::Wide64 => "64-bit and complex types: int64 is downcast on trn1, no f64",
            Rule::LargeTensor => {
                "tensors of 4 GiB or more need Neuron runtime 2.30.50.0 (SDK 2.28) or later"
            }
            Rule::Instructions => {
                "neuronx-cc refuses more than 5,000,000 instructions (XTP002/XTP003, \
                 aws-neuron-sdk#819, #1003); the count here is an estimate"
            }
        }
    }
}

/// One violation: the rule, the instruction, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The rule broken.
    pub rule: Rule,
    /// The instruction's name (`sort.123`), or the module's for [`Rule::Instructions`].
    pub instruction: String,
    /// What is wrong, with the numbers.
    pub detail: String,
}

/// The check of one module.
#[derive(Debug, Clone)]
pub struct GraphCheck {
    /// The module's name (the graph's).
    pub name: String,
    /// HLO instructions in the module (every computation).
    pub hlo_instructions: usize,
    /// Estimated engine instructions ([`estimate::instructions`]).
    pub estimated_instructions: u64,
    /// The estimate per opcode, largest first ([`estimate::instructions_by_opcode`]).
    pub estimate_by_opcode: Vec<(String, u64)>,
    /// Estimated compile minutes ([`estimate::compile_minutes`]).
    pub compile_minutes: f64,
    /// Every violation found.
    pub findings: Vec<Finding>,
}

impl GraphCheck {
    /// The violations of `rule`.
    pub fn count(&self, rule: Rule) -> usize {
        self.findings.iter().filter(|f| f.rule == rule).count()
    }

    /// Whether the module breaks no rule.
    pub fn clean(&self) -> bool {
        self.findings.is_empty()
    }
}

/// Bytes per element of an HLO element type (raw value, so types outside our proto subset
/// count too); 0 for tuples and unknown types.
fn element_bits(t: i32) -> u64 {
    match t {
        1 | 2 | 6 => 8,                   // pred, s8, u8
        3 | 7 | 10 | 16 => 16,            // s16, u16, f16, bf16
        4 | 8 | 11 => 32,                 // s32, u32, f32
        5 | 9 | 12 | 15 => 64,            // s64, u64, f64, c64
        18 => 128,                        // c128
        19 | 20 | 23..=25 | 28 | 29 => 8, // fp8 variants
        21 | 22 => 4,                     // s4, u4
        _ => 0,
    }
}

/// Whether the raw element type is 64-bit or complex.
fn is_wide64(t: i32) -> bool {
    matches!(t, 5 | 9 | 12 | 15 | 18)
}

/// Whether the raw element type is an integer.
fn is_integer(t: i32) -> bool {
    matches!(t, 2..=9 | 21 | 22 | 26 | 27 | 30 | 31)
}

/// Every array shape inside `shape` (itself, or a tuple's elements).
fn arrays(shape: &ShapeProto) -> Vec<&ShapeProto> {
    if shape.element_type == 13 {
        shape.tuple_shapes.iter().flat_map(arrays).collect()
    } else {
        vec![shape]
    }
}

fn describe(shape: &ShapeProto) -> String {
    let dims: Vec<String> = shape.dimensions.iter().map(i64::to_string).collect();
    let ty = crate::backend::hlo::proto::PrimitiveType::try_from(shape.element_type)
        .map(|t| t.as_str_name().to_lowercase())
        .unwrap_or_else(|_| format!("type{}", shape.element_type));
    format!("{ty}[{}]", dims.join(","))
}

/// Ops that carry a value through unchanged in content (for tracing weights to transposes and
/// transposes to dots).
const PASS_THROUGH: &[&str] = &["convert", "reshape", "copy", "bitcast", "bitcast-convert"];

/// Ops that select part of a weight (a gathered expert, a slice) without reordering it.
const SELECTIONS: &[&str] = &["gather", "slice", "dynamic-slice"];

/// The role our emitter writes on each entry parameter (`deepinfer_role`); other emitters write
/// none, and then every parameter may be a weight.
const ROLE_ATTR: &str = "deepinfer_role";

/// The NEFF input name every emitter writes on entry parameters, for messages.
const INPUT_NAMES_ATTR: &str = "neff_input_names";

/// What the check may assume about the deployment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckOptions {
    /// The Neuron runtime library version (major, minor, patch) the graphs will run on, when
    /// known (`deepinfer doctor` reports it). At [`accepted::LARGE_TENSOR_RUNTIME`] or later,
    /// tensors of 4 GiB or more are supported and [`Rule::LargeTensor`] does not fire; unknown,
    /// it does.
    pub runtime: Option<(u64, u64, u64)>,
}

impl CheckOptions {
    fn large_tensors_supported(&self) -> bool {
        self.runtime
            .is_some_and(|v| v >= accepted::LARGE_TENSOR_RUNTIME)
    }
}

/// Checks one module against every [`Rule`].
pub fn check_module(module: &HloModuleProto, opts: &CheckOptions) -> GraphCheck {
    let mut findings = Vec::new();
    let by_id: HashMap<i64, &HloInstructionProto> = module
        .computations
        .iter()
        .flat_map(|c| c.instructions.iter())
        .map(|i| (i.id, i))
        .collect();
    let mut users: HashMap<i64, Vec<&HloInstructionProto>> = HashMap::new();
    for inst in by_id.values() {
        for o in &inst.operand_ids {
            users.entry(*o).or_default().push(inst);
        }
    }
    let shape_of = |id: i64| by_id.get(&id).and_then(|i| i.shape.as_ref());
    let mut push = |rule: Rule, inst: &HloInstructionProto, detail: String| {
        findings.push(Finding {
            rule,
            instruction: inst.name.clone(),
            detail,
        })
    };

    for comp in &module.computations {
        for inst in &comp.instructions {
            let op = inst.opcode.as_str();
            // Opcodes and custom-call targets.
            if accepted(op).is_none() {
                push(Rule::Opcode, inst, format!("opcode `{op}`"));
            } else if op == "custom-call" && !known_custom_call(&inst.custom_call_target) {
                push(
                    Rule::Opcode,
                    inst,
                    format!("custom-call target `{}`", inst.custom_call_target),
                );
            }
            // Sort width, and TopK's k.
            if op == "sort" {
                if let Some(keys) = inst.operand_ids.first().and_then(|&id| shape_of(id)) {
                    let width = estimate::sort_width(inst, keys);
                    if width > MAX_SORT_WIDTH {
                        push(
                            Rule::WideSort,
                            inst,
                            format!(
                                "sorts {} along a dimension of {width} (> {MAX_SORT_WIDTH})",
                                describe(keys)
                            ),
                        );
                    }
                }
            }
            if op == "custom-call" && inst.custom_call_target == TOPK_TARGET {
                let k = String::from_utf8_lossy(&inst.backend_config)
                    .trim()
                    .parse::<u64>()
                    .ok();
                if let Some(k) = k.filter(|&k| k > MAX_SORT_WIDTH) {
                    push(
                        Rule::WideSort,
                        inst,
                        format!("{TOPK_TARGET} with k = {k} (> {MAX_SORT_WIDTH})"),
                    );
                }
            }
            // Integer multiplies.
            if op == "multiply" {
                if let Some(s) = inst.shape.as_ref().filter(|s| is_integer(s.element_type)) {
                    push(
                        Rule::IntMultiply,
                        inst,
                        format!("integer multiply {}", describe(s)),
                    );
                }
            }
            // Element types and sizes.
            if let Some(shape) = inst.shape.as_ref() {
                for a in arrays(shape) {
                    if is_wide64(a.element_type) {
                        push(Rule::Wide64, inst, format!("{op} of {}", describe(a)));
                    }
                    let bytes = a
                        .dimensions
                        .iter()
                        .map(|&d| d.max(0) as u64)
                        .product::<u64>()
                        .saturating_mul(element_bits(a.element_type))
                        / 8;
                    if bytes >= LARGE_TENSOR_BYTES && !opts.large_tensors_supported() {
                        push(
                            Rule::LargeTensor,
                            inst,
                            format!(
                                "{op} of {} is {:.2} GiB",
                                describe(a),
                                bytes as f64 / (1u64 << 30) as f64
                            ),
                        );
                    }
                }
            }
            // Narrow weights widened to f32 before a dot.
            if op == "convert" && inst.shape.as_ref().map(|s| s.element_type) == Some(F32) {
                if let Some((param, from)) = narrow_weight_source(inst, &by_id) {
                    if reaches_dot_as_weight(inst, &users) {
                        push(
                            Rule::WidenedWeight,
                            inst,
                            format!("converts parameter `{param}` ({from}) to f32 before a dot"),
                        );
                    }
                }
            }
            // Weight transposes feeding a dot.
            if op == "transpose" {
                if let Some(param) = weight_source(inst, &by_id) {
                    if feeds_dot(inst, &users) {
                        let shape = inst.shape.as_ref().map(describe).unwrap_or_default();
                        push(
                            Rule::WeightTranspose,
                            inst,
                            format!("transposes parameter `{param}` into {shape} before a dot"),
                        );
                    }
                }
            }
        }
    }

    let by_opcode = estimate::instructions_by_opcode(module);
    let estimated: u64 = by_opcode.iter().map(|(_, n)| n).sum();
    let minutes = estimate::compile_minutes(estimated, estimate::has_wide_reduction(module));
    if estimated > INSTRUCTION_BUDGET {
        findings.push(Finding {
            rule: Rule::Instructions,
            instruction: module.name.clone(),
            detail: format!(
                "about {estimated} instructions (estimate) against the budget of \
                 {INSTRUCTION_BUDGET}"
            ),
        });
    }
    GraphCheck {
        name: module.name.clone(),
        hlo_instructions: module
            .computations
            .iter()
            .map(|c| c.instructions.len())
            .sum(),
        estimated_instructions: estimated,
        estimate_by_opcode: by_opcode,
        compile_minutes: minutes,
        findings,
    }
}

/// The name of the weight parameter a transpose's operand comes from, through pass-through ops
/// and selections, if any. A parameter our emitter marks as metadata or a cache root is not a
/// weight.
fn weight_source(
    transpose: &HloInstructionProto,
    by_id: &HashMap<i64, &HloInstructionProto>,
) -> Option<String> {
    let mut id = *transpose.operand_ids.first()?;
    for _ in 0..64 {
        let inst = by_id.get(&id)?;
        match inst.opcode.as_str() {
            "parameter" => return weight_source_param(inst),
            o if PASS_THROUGH.contains(&o) || SELECTIONS.contains(&o) => {
                id = *inst.operand_ids.first()?;
            }
            _ => return None,
        }
    }
    None
}

/// HLO's raw element type of f32.
const F32: i32 = 11;

/// The weight parameter (its name and element type) an f32 `convert` reads, when that weight
/// is narrow: traced up through pass-through ops, selections and the bit operations of an int4
/// unpacking (each instruction's first operand, which is the value's own path).
fn narrow_weight_source(
    convert: &HloInstructionProto,
    by_id: &HashMap<i64, &HloInstructionProto>,
) -> Option<(String, String)> {
    const UNPACKING: &[&str] = &["and", "shift-right-logical", "concatenate"];
    let mut id = *convert.operand_ids.first()?;
    for _ in 0..64 {
        let inst = by_id.get(&id)?;
        match inst.opcode.as_str() {
            "parameter" => {
                let shape = inst.shape.as_ref()?;
                let narrow = shape.element_type != F32 && element_bits(shape.element_type) <= 16;
                let name = weight_source_param(inst)?;
                return narrow.then(|| (name, describe(shape)));
            }
            o if PASS_THROUGH.contains(&o) || SELECTIONS.contains(&o) || UNPACKING.contains(&o) => {
                id = *inst.operand_ids.first()?;
            }
            _ => return None,
        }
    }
    None
}

/// Ops through which a widened weight still reaches a `dot` as that weight, unchanged in
/// content or only scaled: reshapes, transposes, selections, and the products and differences
/// of a dequantization. Not a `convert` (an activation rounded back to bf16 is not the weight
/// anymore) nor a `broadcast` (a norm's weight broadcast over the rows scales an activation,
/// which may then meet an f32 weight such as the router's).
const CARRIES_WEIGHT: &[&str] = &[
    "reshape",
    "copy",
    "bitcast",
    "transpose",
    "slice",
    "gather",
    "dynamic-slice",
    "multiply",
    "subtract",
];

/// Whether a widened value reaches a `dot` operand as the weight it was ([`CARRIES_WEIGHT`]).
fn reaches_dot_as_weight(
    start: &HloInstructionProto,
    users: &HashMap<i64, Vec<&HloInstructionProto>>,
) -> bool {
    reaches_dot(start, users, |o| CARRIES_WEIGHT.contains(&o))
}

/// Whether a value reaches a `dot` operand through ops that `carries` says pass it on.
fn reaches_dot(
    start: &HloInstructionProto,
    users: &HashMap<i64, Vec<&HloInstructionProto>>,
    carries: impl Fn(&str) -> bool,
) -> bool {
    let mut seen = HashSet::new();
    let mut stack = vec![start.id];
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        for u in users.get(&id).into_iter().flatten() {
            match u.opcode.as_str() {
                "dot" => return true,
                o if carries(o) => stack.push(u.id),
                _ => {}
            }
        }
    }
    false
}

/// A parameter's name when it is a weight (our emitter marks metadata and cache roots; other
/// emitters mark nothing, and then every parameter may be a weight).
fn weight_source_param(param: &HloInstructionProto) -> Option<String> {
    let attr = |k: &str| {
        param
            .frontend_attributes
            .as_ref()
            .and_then(|a| a.map.get(k))
            .cloned()
    };
    match attr(ROLE_ATTR).as_deref() {
        None | Some("weight") => Some(attr(INPUT_NAMES_ATTR).unwrap_or_else(|| param.name.clone())),
        Some(_) => None,
    }
}

/// Whether a value reaches a `dot` operand through pass-through ops and broadcasts only.
fn feeds_dot(start: &HloInstructionProto, users: &HashMap<i64, Vec<&HloInstructionProto>>) -> bool {
    reaches_dot(start, users, |o| {
        PASS_THROUGH.contains(&o) || o == "broadcast"
    })
}

/// The check of every graph a capture would compile, with the compile-time estimate.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// One entry per graph (per NEFF), in capture order.
    pub graphs: Vec<GraphCheck>,
    /// Compiler processes run at once on the target host, for the wall-time estimate.
    pub jobs: usize,
}

impl CheckReport {
    /// Whether any graph breaks any rule.
    pub fn clean(&self) -> bool {
        self.graphs.iter().all(GraphCheck::clean)
    }

    /// Estimated minutes to compile every NEFF, one after another.
    pub fn serial_minutes(&self) -> f64 {
        self.graphs.iter().map(|g| g.compile_minutes).sum()
    }

    /// The rules some graph breaks, in table order.
    pub fn broken_rules(&self) -> Vec<Rule> {
        Rule::ALL
            .into_iter()
            .filter(|&r| self.graphs.iter().any(|g| g.count(r) > 0))
            .collect()
    }

    /// Graphs with at least one violation.
    pub fn failing(&self) -> usize {
        self.graphs.iter().filter(|g| !g.clean()).count()
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .graphs
            .iter()
            .map(|g| g.name.len())
            .max()
            .unwrap_or(5)
            .max(5);
        write!(f, "{:<width$}", "graph")?;
        for r in Rule::ALL {
            write!(f, " {:>12}", r.name())?;
        }
        writeln!(f, " {:>11} {:>12}", "est. instrs", "est. minutes")?;
        for g in &self.graphs {
            write!(f, "{:<width$}", g.name)?;
            for r in Rule::ALL {
                match g.count(r) {
                    0 => write!(f, " {:>12}", "ok")?,
                    n => write!(f, " {:>12}", format!("FAIL {n}"))?,
                }
            }
            writeln!(
                f,
                " {:>11} {:>12.1}",
                g.estimated_instructions, g.compile_minutes
            )?;
        }
        // One line per rule broken: why, where first, how often.
        for r in Rule::ALL {
            let hits: Vec<&GraphCheck> = self.graphs.iter().filter(|g| g.count(r) > 0).collect();
            if let Some(first) = hits.first() {
                let total: usize = hits.iter().map(|g| g.count(r)).sum();
                let example = first.findings.iter().find(|x| x.rule == r);
                writeln!(
                    f,
                    "{}: {total} in {} graph(s): {}",
                    r.name(),
                    hits.len(),
                    r.why()
                )?;
                if let Some(x) = example {
                    writeln!(f, "  e.g. {}: {}: {}", first.name, x.instruction, x.detail)?;
                }
                let mut kinds: Vec<&str> = self
                    .graphs
                    .iter()
                    .flat_map(|g| g.findings.iter())
                    .filter(|x| x.rule == r && r == Rule::Opcode)
                    .map(|x| x.detail.as_str())
                    .collect();
                kinds.sort_unstable();
                kinds.dedup();
                if !kinds.is_empty() {
                    writeln!(f, "  all: {}", kinds.join(", "))?;
                }
            }
        }
        // What the largest estimate is made of, so a reader can judge it.
        if let Some(big) = self
            .graphs
            .iter()
            .max_by_key(|g| g.estimated_instructions)
            .filter(|g| g.estimated_instructions > 0)
        {
            let total = big.estimated_instructions as f64;
            let parts: Vec<String> = big
                .estimate_by_opcode
                .iter()
                .take(5)
                .map(|(o, n)| format!("{o} {:.0}%", 100.0 * *n as f64 / total))
                .collect();
            writeln!(
                f,
                "largest instruction estimate: {} {} ({})",
                big.name,
                big.estimated_instructions,
                parts.join(", ")
            )?;
        }
        let n = self.graphs.len();
        let serial = self.serial_minutes();
        let jobs = self.jobs.max(1);
        let longest = self
            .graphs
            .iter()
            .map(|g| g.compile_minutes)
            .fold(0.0, f64::max);
        writeln!(
            f,
            "{n} NEFFs to compile; compile time (estimate, see backend::neuron::check::estimate): \
             {serial:.0} min one at a time, about {:.0} min at {jobs} parallel jobs",
            (serial / jobs as f64).max(longest)
        )?;
        if self.clean() {
            writeln!(f, "neuron check: clean")
        } else {
            writeln!(
                f,
                "neuron check: {} of {n} graphs violate a rule",
                self.failing()
            )
        }
    }
}
