//! DeepSeek-V4's cache-free forward (`model::v4::forward`) on the CPU backend against
//! transformers 5.25 on `fixtures/tiny-v4` (scripts/make_v4_fixture.py): every position's
//! logits of a 48-token prompt (a multiple of both compress rates) and of a 23-token one (of
//! neither), and the greedy continuation's tokens from one forward over prompt + continuation.

mod common;

use candle_core::{Device, Tensor as CTensor};
use deepinfer::backend::cpu;
use deepinfer::config::v4::V4Config;
use deepinfer::graph::{DType, Graph};
use deepinfer::model::v4::forward::build_stateless;

#[derive(serde::Deserialize)]
struct V4Reference {
    token_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    token_ids_short: Vec<u32>,
    logits_short: Vec<Vec<f32>>,
    greedy: common::Greedy,
    logits_decode: Vec<Vec<f32>>,
}

fn config() -> V4Config {
    let text = std::fs::read_to_string(common::fixture_dir("tiny-v4").join("config.json")).unwrap();
    V4Config::from_json_str(&text).unwrap()
}

/// The graph's inputs from the fixture's safetensors (by the declared names; `kv_norm` under
/// either spelling) and `ids`.
fn inputs(graph: &Graph, ids: &[u32]) -> Vec<CTensor> {
    let bytes = std::fs::read(common::fixture_dir("tiny-v4").join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    graph
        .inputs()
        .iter()
        .map(|d| {
            if d.name == "input_ids" {
                let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
                return CTensor::from_vec(v, ids.len(), &Device::Cpu).unwrap();
            }
            let view = st
                .tensor(&d.name)
                .or_else(|_| st.tensor(&d.name.replace(".kv_norm.", ".norm.")))
                .unwrap_or_else(|e| panic!("{}: {e}", d.name));
            let dims = d.shape.dims().to_vec();
            let data = view.data();
            match (view.dtype(), d.dtype) {
                (safetensors::Dtype::F32, DType::F32) => {
                    let v: Vec<f32> = data
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    CTensor::from_vec(v, dims, &Device::Cpu).unwrap()
                }
                (safetensors::Dtype::I64, DType::I32) => {
                    let v: Vec<i32> = data
                        .chunks_exact(8)
                        .map(|c| {
                            let id = i64::from_le_bytes(c.try_into().expect("8 bytes"));
                            i32::try_from(id).expect("an expert id")
                        })
                        .collect();
                    CTensor::from_vec(v, dims, &Device::Cpu).unwrap()
                }
                other => panic!("{}: {other:?}", d.name),
            }
        })
        .collect()
}

fn logits_of(cfg: &V4Config, ids: &[u32]) -> Vec<Vec<f32>> {
    let g = build_stateless(cfg, ids.len()).unwrap();
    let out = cpu::run(&g, &inputs(&g, ids)).unwrap();
    out[0].to_vec2::<f32>().unwrap()
}

fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| common::max_abs_diff(a, b))
        .fold(0.0, f32::max)
}

#[test]
fn the_cache_free_forward_matches_transformers() {
    let cfg = config();
    let r: V4Reference = common::reference_file("tiny-v4", "reference.json");
    let long = worst(&logits_of(&cfg, &r.token_ids), &r.logits);
    let short = worst(&logits_of(&cfg, &r.token_ids_short), &r.logits_short);
    eprintln!("tiny-v4 cache-free logits: 48 tokens {long:.2e}, 23 tokens {short:.2e}");
    assert!(long <= 1e-4, "48-token prompt: {long}");
    assert!(short <= 1e-4, "23-token prompt: {short}");
}

#[test]
fn the_greedy_continuation_is_transformers() {
    let cfg = config();
    let r: V4Reference = common::reference_file("tiny-v4", "reference.json");
    let gen = &r.greedy.generated_token_ids;
    let mut all = r.token_ids.clone();
    all.extend(&gen[..gen.len() - 1]);
    let logits = logits_of(&cfg, &all);
    // Row p - 1 of the prompt's end onward: the logits each generated token was drawn from.
    let steps = &logits[r.token_ids.len() - 1..];
    let d = worst(steps, &r.logits_decode);
    assert!(d <= 1e-4, "{d}");
    let argmax: Vec<u32> = steps
        .iter()
        .map(|row| {
            (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap() as u32
        })
        .collect();
    assert_eq!(&argmax, gen);
}

/// The cache-free graph lowers to XLA HLO that breaks none of the rules `lower --check
/// neuron` applies to every graph a capture compiles (accepted opcodes, no 64-bit type, no
/// integer multiply, no vocabulary-wide sort, no tensor over 4 GiB, ...).
#[test]
fn the_cache_free_graph_lowers_within_neurons_rules() {
    use deepinfer::backend::hlo::emit;
    use deepinfer::backend::neuron::check::{check_module, CheckOptions};
    let g = build_stateless(&config(), 48).unwrap();
    let report = check_module(&emit::emit(&g).unwrap(), &CheckOptions::default());
    assert!(report.clean(), "{:?}", report.findings);
}
