//! `lower --check neuron`: one hand-built HLO module per rule that must fail it (and, where the
//! rule has an edge, the module just inside it that must pass), one clean module that passes
//! every rule, the graphs we emit for the tiny fixtures (every opcode we emit is on the accepted
//! list), and the CLI table and exit status on the published V2-Lite config.

mod common;

use std::collections::BTreeMap;
use std::process::Command;

use deepinfer::backend::hlo::emit::array_shape;
use deepinfer::backend::hlo::proto::{
    DotDimensionNumbers, FrontendAttributes, HloComputationProto, HloInstructionProto,
    HloModuleProto, PrimitiveType, ShapeProto,
};
use deepinfer::backend::neuron::check::{
    check_module, CheckOptions, CheckReport, GraphCheck, Rule,
};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::Limits;

/// An entry computation being written: instructions in order, ids from 1.
struct Module {
    insts: Vec<HloInstructionProto>,
    params: i64,
}

impl Module {
    fn new() -> Self {
        Module {
            insts: Vec::new(),
            params: 0,
        }
    }

    fn push(&mut self, opcode: &str, shape: ShapeProto, operands: &[i64]) -> i64 {
        self.push_with(opcode, shape, operands, |_| {})
    }

    fn push_with(
        &mut self,
        opcode: &str,
        shape: ShapeProto,
        operands: &[i64],
        f: impl FnOnce(&mut HloInstructionProto),
    ) -> i64 {
        let id = self.insts.len() as i64 + 1;
        let mut inst = HloInstructionProto {
            name: format!("{}.{id}", opcode.replace('-', "_")),
            opcode: opcode.into(),
            shape: Some(shape),
            id,
            operand_ids: operands.to_vec(),
            ..Default::default()
        };
        f(&mut inst);
        self.insts.push(inst);
        id
    }

    /// An entry parameter named `name` with our emitter's role attribute (`None`: none, as
    /// another emitter writes it).
    fn param(&mut self, name: &str, role: Option<&str>, shape: ShapeProto) -> i64 {
        let n = self.params;
        self.params += 1;
        let mut map = BTreeMap::from([("neff_input_names".to_string(), name.to_string())]);
        if let Some(r) = role {
            map.insert("deepinfer_role".into(), r.into());
        }
        self.push_with("parameter", shape, &[], |i| {
            i.parameter_number = n;
            i.frontend_attributes = Some(FrontendAttributes { map });
        })
    }

    /// `[m, k] x [k, n]` (or a transposed rhs when `rhs_contracting` is 1).
    fn dot(&mut self, lhs: i64, rhs: i64, shape: ShapeProto, rhs_contracting: i64) -> i64 {
        self.push_with("dot", shape, &[lhs, rhs], |i| {
            i.dot_dimension_numbers = Some(DotDimensionNumbers {
                lhs_contracting_dimensions: vec![1],
                rhs_contracting_dimensions: vec![rhs_contracting],
                ..Default::default()
            })
        })
    }

    /// The module, rooted at a tuple of `outputs`.
    fn finish(mut self, name: &str, outputs: &[i64]) -> HloModuleProto {
        let shapes: Vec<ShapeProto> = outputs
            .iter()
            .map(|&o| self.insts[o as usize - 1].shape.clone().unwrap())
            .collect();
        let root = self.push(
            "tuple",
            ShapeProto {
                element_type: PrimitiveType::Tuple as i32,
                tuple_shapes: shapes,
                ..Default::default()
            },
            outputs,
        );
        let id = root + 1;
        HloModuleProto {
            name: name.into(),
            entry_computation_name: "main".into(),
            computations: vec![HloComputationProto {
                name: "main".into(),
                instructions: self.insts,
                program_shape: None,
                id,
                root_id: root,
            }],
            host_program_shape: None,
            id: 1,
            entry_computation_id: id,
            input_output_alias: None,
        }
    }
}

fn f32s(dims: &[usize]) -> ShapeProto {
    array_shape(dims, PrimitiveType::F32)
}

fn check(m: &HloModuleProto) -> GraphCheck {
    check_module(m, &CheckOptions::default())
}

/// Asserts that `g` breaks `rule` (at least once) and no other rule.
fn fails_only(g: &GraphCheck, rule: Rule) {
    assert!(
        g.count(rule) > 0,
        "{} should break {rule:?}: {:?}",
        g.name,
        g.findings
    );
    for other in Rule::ALL.into_iter().filter(|&r| r != rule) {
        assert_eq!(
            g.count(other),
            0,
            "{} breaks {other:?} too: {:?}",
            g.name,
            g.findings
        );
    }
}

/// x[2,3] . w[3,4], tanh: plain HLO with every rule met.
fn clean_module() -> HloModuleProto {
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), f32s(&[2, 3]));
    let w = m.param("w", Some("weight"), f32s(&[3, 4]));
    let d = m.dot(x, w, f32s(&[2, 4]), 0);
    let t = m.push("tanh", f32s(&[2, 4]), &[d]);
    m.finish("clean", &[t])
}

#[test]
fn a_clean_module_passes_every_rule() {
    let g = check(&clean_module());
    assert!(g.clean(), "{:?}", g.findings);
    assert_eq!(g.hlo_instructions, 5);
    assert!(g.estimated_instructions > 0);
}

#[test]
fn an_unknown_opcode_or_custom_call_target_fails() {
    let mut m = Module::new();
    let x = m.param("x", None, f32s(&[4]));
    let w = m.push("while", f32s(&[4]), &[x]);
    let g = check(&m.finish("while", &[w]));
    fails_only(&g, Rule::Opcode);
    assert!(g.findings[0].detail.contains("`while`"), "{:?}", g.findings);

    let mut m = Module::new();
    let x = m.param("x", None, f32s(&[4]));
    let c = m.push_with("custom-call", f32s(&[4]), &[x], |i| {
        i.custom_call_target = "MyKernel".into()
    });
    let g = check(&m.finish("custom", &[c]));
    fails_only(&g, Rule::Opcode);
    assert!(g.findings[0].detail.contains("MyKernel"));

    let mut m = Module::new();
    let x = m.param("x", None, f32s(&[4]));
    let c = m.push_with("custom-call", f32s(&[4]), &[x], |i| {
        i.custom_call_target = "AwsNeuronSilu".into()
    });
    assert!(check(&m.finish("silu", &[c])).clean());
}

/// A descending sort of (values, iota) along dim 1 of `[2, width]`.
fn sort_module(width: usize) -> HloModuleProto {
    let mut m = Module::new();
    let x = m.param("logits", None, f32s(&[2, width]));
    let s32 = array_shape(&[2, width], PrimitiveType::S32);
    let iota = m.push_with("iota", s32.clone(), &[], |i| i.dimensions = vec![1]);
    let sorted = m.push_with(
        "sort",
        ShapeProto {
            element_type: PrimitiveType::Tuple as i32,
            tuple_shapes: vec![f32s(&[2, width]), s32.clone()],
            ..Default::default()
        },
        &[x, iota],
        |i| {
            i.dimensions = vec![1];
            i.is_stable = true;
        },
    );
    let idx = m.push_with("get-tuple-element", s32, &[sorted], |i| i.tuple_index = 1);
    m.finish(&format!("sort{width}"), &[idx])
}

#[test]
fn a_sort_wider_than_16384_fails_and_16384_passes() {
    let g = check(&sort_module(16_385));
    fails_only(&g, Rule::WideSort);
    assert!(g.findings[0].detail.contains("16385"), "{:?}", g.findings);
    assert!(check(&sort_module(16_384)).clean());

    let mut m = Module::new();
    let x = m.param("logits", None, f32s(&[2, 102_400]));
    let t = m.push_with("custom-call", f32s(&[2, 20_000]), &[x], |i| {
        i.custom_call_target = "AwsNeuronTopK".into();
        i.backend_config = b"20000".to_vec();
    });
    fails_only(&check(&m.finish("topk", &[t])), Rule::WideSort);
}

#[test]
fn a_transposed_weight_feeding_a_dot_fails() {
    // transpose(w) . x
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), f32s(&[2, 3]));
    let w = m.param("layers.0.q_proj", Some("weight"), f32s(&[4, 3]));
    let wt = m.push_with("transpose", f32s(&[3, 4]), &[w], |i| {
        i.dimensions = vec![1, 0]
    });
    let d = m.dot(x, wt, f32s(&[2, 4]), 0);
    let g = check(&m.finish("transposed", &[d]));
    fails_only(&g, Rule::WeightTranspose);
    assert!(
        g.findings[0].detail.contains("layers.0.q_proj"),
        "{:?}",
        g.findings
    );

    // convert(transpose(convert(w))) . x, from another emitter (no role attribute)
    let mut m = Module::new();
    let x = m.param("x", None, f32s(&[2, 3]));
    let w = m.param("w", None, array_shape(&[4, 3], PrimitiveType::Bf16));
    let wc = m.push("convert", f32s(&[4, 3]), &[w]);
    let wt = m.push_with("transpose", f32s(&[3, 4]), &[wc], |i| {
        i.dimensions = vec![1, 0]
    });
    let d = m.dot(x, wt, f32s(&[2, 4]), 0);
    // The bf16 weight widened to f32 before the dot breaks w-to-f32 as well.
    let g = check(&m.finish("converted", &[d]));
    assert_eq!(
        (g.count(Rule::WeightTranspose), g.count(Rule::WidenedWeight)),
        (1, 1),
        "{:?}",
        g.findings
    );
    assert_eq!(g.findings.len(), 2, "{:?}", g.findings);

    // The same product with contracting dimensions needs no transpose: clean.
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), f32s(&[2, 3]));
    let w = m.param("w", Some("weight"), f32s(&[4, 3]));
    let d = m.dot(x, w, f32s(&[2, 4]), 1);
    assert!(check(&m.finish("contracting", &[d])).clean());

    // A transposed cache root (keys) is not a weight; a transposed weight that feeds no dot is
    // not a matmul operand.
    let mut m = Module::new();
    let q = m.param("q", Some("metadata"), f32s(&[2, 3]));
    let k = m.param("kv_cache", Some("cache_root"), f32s(&[4, 3]));
    let kt = m.push_with("transpose", f32s(&[3, 4]), &[k], |i| {
        i.dimensions = vec![1, 0]
    });
    let s = m.dot(q, kt, f32s(&[2, 4]), 0);
    let w = m.param("w", Some("weight"), f32s(&[4, 3]));
    let wt = m.push_with("transpose", f32s(&[3, 4]), &[w], |i| {
        i.dimensions = vec![1, 0]
    });
    assert!(check(&m.finish("not-weights", &[s, wt])).clean());
}

#[test]
fn an_integer_multiply_fails_and_a_float_one_passes() {
    for t in [PrimitiveType::U32, PrimitiveType::S32, PrimitiveType::S8] {
        let mut m = Module::new();
        let a = m.param("a", None, array_shape(&[8], t));
        let b = m.param("b", None, array_shape(&[8], t));
        let p = m.push("multiply", array_shape(&[8], t), &[a, b]);
        let g = check(&m.finish("intmul", &[p]));
        fails_only(&g, Rule::IntMultiply);
    }
    let mut m = Module::new();
    let a = m.param("a", None, f32s(&[8]));
    let p = m.push("multiply", f32s(&[8]), &[a, a]);
    assert!(check(&m.finish("floatmul", &[p])).clean());
    // A shift is exact: clean.
    let mut m = Module::new();
    let a = m.param("a", None, array_shape(&[8], PrimitiveType::U32));
    let p = m.push("shift-left", array_shape(&[8], PrimitiveType::U32), &[a, a]);
    assert!(check(&m.finish("shift", &[p])).clean());
}

#[test]
fn a_64_bit_type_fails() {
    // S64 and F64 are outside our proto subset's enum, so they are written as raw values, as a
    // module from another emitter carries them.
    for raw in [5, 12] {
        let mut m = Module::new();
        let shape = ShapeProto {
            element_type: raw,
            ..array_shape(&[3], PrimitiveType::F32)
        };
        let x = m.param("ids", None, shape.clone());
        let y = m.push("negate", shape, &[x]);
        fails_only(&check(&m.finish("wide", &[y])), Rule::Wide64);
    }
}

#[test]
fn a_tensor_of_4_gib_fails_unless_the_runtime_supports_it() {
    let at = |elems: usize| {
        let mut m = Module::new();
        let x = m.param("kv_cache", Some("cache_root"), f32s(&[elems]));
        m.finish("big", &[x])
    };
    let g = check(&at(1 << 30));
    fails_only(&g, Rule::LargeTensor);
    assert!(
        g.findings[0].detail.contains("4.00 GiB"),
        "{:?}",
        g.findings
    );
    assert!(check(&at((1 << 30) - 1)).clean(), "one element under 4 GiB");
    let runtime = |v| CheckOptions { runtime: Some(v) };
    assert!(check_module(&at(1 << 30), &runtime((2, 30, 50))).clean());
    assert!(check_module(&at(1 << 30), &runtime((2, 34, 0))).clean());
    fails_only(
        &check_module(&at(1 << 30), &runtime((2, 29, 40))),
        Rule::LargeTensor,
    );
}

#[test]
fn a_graph_over_the_instruction_budget_fails() {
    // bf16[8192,16384] . bf16[16384,8192]: 64 x 128 x 16 = 131,072 matmul tiles (+ 1,024
    // evacuations) per product; 40 chained products are about 5.3M estimated instructions.
    let mut m = Module::new();
    let bf = |d: &[usize]| array_shape(d, PrimitiveType::Bf16);
    let x = m.param("x", Some("metadata"), bf(&[8192, 16_384]));
    let w = m.param("w", Some("weight"), bf(&[16_384, 8192]));
    let mut outs = Vec::new();
    for _ in 0..40 {
        outs.push(m.dot(x, w, bf(&[8192, 8192]), 0));
    }
    let g = check(&m.finish("huge", &outs));
    fails_only(&g, Rule::Instructions);
    assert_eq!(g.estimated_instructions, 40 * (131_072 + 1024));
    // Half of it fits.
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), bf(&[8192, 16_384]));
    let w = m.param("w", Some("weight"), bf(&[16_384, 8192]));
    let outs: Vec<i64> = (0..20).map(|_| m.dot(x, w, bf(&[8192, 8192]), 0)).collect();
    assert!(check(&m.finish("large", &outs)).clean());
}

/// Every graph we emit for the tiny fixtures, at a small bucket set: the rules no other change
/// is expected to break (every opcode on the accepted list, no 64-bit type, no 4 GiB tensor,
/// within the instruction budget) hold, and the capture's NEFFs are the buckets' and the
/// greedy graphs that pay.
#[test]
fn emitted_fixture_graphs_use_only_accepted_opcodes() {
    for name in common::FIXTURES {
        let cfg = ModelConfig::from_file(&common::fixture_dir(name).join("config.json")).unwrap();
        let limits = Limits::new(4, 256);
        let report =
            deepinfer::export::check_neuron(&cfg, &limits, &CheckOptions::default(), 1).unwrap();
        let rc = limits.runner_config(&cfg).unwrap();
        let greedy = greedy_graphs_by_the_rule(&report);
        assert_eq!(
            report.graphs.len(),
            rc.buckets.graph_count() + greedy,
            "{name}"
        );
        for g in &report.graphs {
            for rule in [
                Rule::Opcode,
                Rule::Wide64,
                Rule::LargeTensor,
                Rule::Instructions,
            ] {
                assert_eq!(g.count(rule), 0, "{name} {}: {:?}", g.name, g.findings);
            }
        }
        let text = report.to_string();
        assert!(
            text.contains(&format!(
                "{} NEFFs to compile",
                rc.buckets.graph_count() + greedy
            )),
            "{text}"
        );
    }
}

/// Checks that every decode bucket's greedy graph in `report` saves at least 10% of the
/// bucket's decode graph (its estimate at most 90% of the decode graph's; the buckets where it
/// would not are dropped, `deployment::keep_paying_greedy`'s unit tests), and returns how many
/// there are.
fn greedy_graphs_by_the_rule(report: &CheckReport) -> usize {
    let estimate = |name: &str| {
        report
            .graphs
            .iter()
            .find(|g| g.name == name)
            .map(|g| g.estimated_instructions)
    };
    let mut greedy = 0;
    for g in report
        .graphs
        .iter()
        .filter(|g| g.name.starts_with("decode_b"))
    {
        let cheap = estimate(&g.name.replace("decode_b", "decode_greedy_b"));
        let full = g.estimated_instructions;
        if let Some(cheap) = cheap {
            assert!(10 * cheap <= 9 * full, "{}: {cheap} of {full}", g.name);
            greedy += 1;
        }
    }
    assert_eq!(
        greedy,
        report
            .graphs
            .iter()
            .filter(|g| g.name.starts_with("decode_greedy_b"))
            .count()
    );
    greedy
}

/// The CLI on the published V2-Lite config at the serve defaults: one row per NEFF (42), a
/// column per rule, and an exit status that agrees with the verdict line.
#[test]
fn cli_prints_one_table_and_exits_by_the_verdict() {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/configs/deepseek-v2-lite.json");
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["lower", "--check", "neuron", "--model"])
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    let header = text
        .lines()
        .find(|l| l.starts_with("graph"))
        .unwrap_or_default();
    for rule in Rule::ALL {
        assert!(header.contains(rule.name()), "{header}");
    }
    let rows = text
        .lines()
        .filter(|l| l.starts_with("decode_b") || l.starts_with("prefill_t"))
        .count();
    // 6 x 3 decode, 2 x 3 prefill, packed prefill at contexts 128 and 512.
    assert_eq!(rows, 28, "{text}");
    // The greedy graphs where the sampler is at least 10% of the decode graph: from batch 2
    // at contexts 128 and 512, from batch 4 at 2,048; never at batch 1.
    let greedy: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("decode_greedy_b"))
        .collect();
    assert_eq!(greedy.len(), 14, "{text}");
    assert!(!greedy.iter().any(|n| n.starts_with("decode_greedy_b1_")));
    assert!(text.contains("42 NEFFs to compile"), "{text}");
    assert!(text.contains("estimate"), "{text}");
    // No vocabulary-wide sort, weight transpose or integer multiply is left: V2-Lite is clean.
    assert!(text.contains("neuron check: clean"), "{text}");
    assert!(out.status.success(), "{text}{err}");
}

/// V3 on one NeuronCore breaks only the instruction budget at batch 8: without `--allow` the
/// check fails naming the rule; `--allow instr-budget` keeps the FAIL cells but exits 0; an
/// unknown rule name is refused.
#[test]
fn cli_allow_reports_a_rule_without_failing_on_it() {
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/deepseek-v3.json");
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .args(["lower", "--check", "neuron", "--model"])
            .arg(&config)
            .args([
                "--max-batch",
                "8",
                "--max-len",
                "256",
                "--neuron-runtime",
                "2.30.50",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let strict = run(&[]);
    let err = String::from_utf8_lossy(&strict.stderr);
    assert!(!strict.status.success());
    assert!(err.contains("(instr-budget;"), "{err}");
    let allowed = run(&["--allow", "instr-budget"]);
    let text = String::from_utf8_lossy(&allowed.stdout);
    assert!(allowed.status.success(), "{text}");
    assert!(text.contains("FAIL 1"), "{text}");
    assert!(text.contains("allowed by --allow"), "{text}");
    let bogus = run(&["--allow", "no-such-rule"]);
    assert!(!bogus.status.success());
    assert!(String::from_utf8_lossy(&bogus.stderr).contains("is not a rule"));
}

/// A narrow weight converted to f32 on its way to a dot fails; a norm's weight widened to
/// scale an activation, which then meets an f32 router weight, does not.
#[test]
fn a_narrow_weight_widened_before_its_dot_fails() {
    let bf16 = |dims: &[usize]| array_shape(dims, PrimitiveType::Bf16);
    // dot(x, convert(w)) with w bf16: the weight rewritten in f32.
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), f32s(&[2, 3]));
    let w = m.param("layers.0.q_proj", Some("weight"), bf16(&[4, 3]));
    let wc = m.push("convert", f32s(&[4, 3]), &[w]);
    let d = m.dot(x, wc, f32s(&[2, 4]), 1);
    let g = check(&m.finish("widened", &[d]));
    fails_only(&g, Rule::WidenedWeight);
    assert!(g.findings[0].detail.contains("layers.0.q_proj"), "{g:?}");

    // int8 codes dequantized in f32 (convert, then the scale's product) before the dot.
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), f32s(&[2, 3]));
    let q = m.param(
        "experts",
        Some("weight"),
        array_shape(&[4, 3], PrimitiveType::S8),
    );
    let s = m.param("experts_scale", Some("weight"), f32s(&[4, 3]));
    let qc = m.push("convert", f32s(&[4, 3]), &[q]);
    let deq = m.push("multiply", f32s(&[4, 3]), &[qc, s]);
    let d = m.dot(x, deq, f32s(&[2, 4]), 1);
    fails_only(&check(&m.finish("dequantized", &[d])), Rule::WidenedWeight);

    // Narrow operands into an f32 result: clean. So is a bf16 norm weight widened to scale the
    // activation that meets an f32 router weight.
    let mut m = Module::new();
    let x = m.param("x", Some("metadata"), f32s(&[2, 3]));
    let xb = m.push("convert", bf16(&[2, 3]), &[x]);
    let w = m.param("layers.0.q_proj", Some("weight"), bf16(&[4, 3]));
    let d = m.dot(xb, w, f32s(&[2, 4]), 1);
    let norm = m.param("layers.0.norm", Some("weight"), bf16(&[3]));
    let nc = m.push("convert", f32s(&[3]), &[norm]);
    let nb = m.push_with("broadcast", f32s(&[2, 3]), &[nc], |i| {
        i.dimensions = vec![1]
    });
    let h = m.push("multiply", f32s(&[2, 3]), &[x, nb]);
    let router = m.param("layers.0.gate", Some("weight"), f32s(&[4, 3]));
    let r = m.dot(h, router, f32s(&[2, 4]), 1);
    let g = check(&m.finish("narrow", &[d, r]));
    assert!(g.clean(), "{:?}", g.findings);
}

/// The graphs themselves, bf16 with int8 and with int4 experts: built under the CPU's policy
/// (`Dots::Widen`) they widen every projection and expert weight, and the rule says so; under
/// the device's (`Dots::DEVICE`, what a capture compiles) not one weight is widened.
#[test]
fn device_graphs_never_widen_a_weight_and_cpu_graphs_do() {
    use deepinfer::graph::DType;
    use deepinfer::model::{self, Dots, GraphSpec, LogitsOutput, Precision, Quantize, Sampler};
    use deepinfer::model::{MoeStrategy, WeightSpecs};
    let cfg = ModelConfig::from_file(&common::fixture_dir("tiny-v3").join("config.json")).unwrap();
    let rc = deepinfer::deployment::RunnerConfig::for_limits(8, 64);
    let layout = rc.cache_layout();
    for quantize in [Quantize::None, Quantize::ExpertsInt8, Quantize::ExpertsInt4] {
        for moe in [MoeStrategy::Gather, MoeStrategy::Dense] {
            let spec = GraphSpec {
                rows: 4,
                seqs: 1,
                ctx: 64,
                logits: LogitsOutput::None,
                moe,
                sampler: Sampler::Full,
            };
            let widened = |dots: Dots| {
                let precision = Precision {
                    quantize,
                    ..Precision::all(DType::BF16)
                }
                .with_dots(dots);
                let specs = WeightSpecs::new(&cfg, &precision);
                let g = model::build_decode(&cfg, &specs, &layout, &spec).unwrap();
                let m = deepinfer::backend::hlo::emit::emit(&g).unwrap();
                check(&m).count(Rule::WidenedWeight)
            };
            let what = format!("{quantize} {moe:?}");
            assert_eq!(widened(Dots::DEVICE), 0, "{what}");
            assert_eq!(widened(Dots::Narrow), 0, "{what}");
            // Every layer's projections and its experts: at least one per layer.
            assert!(widened(Dots::Widen) >= cfg.num_hidden_layers, "{what}");
        }
    }
}
