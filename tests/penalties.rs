//! The logits adjustments of `model::logits` (allowed-token mask, `logit_bias`, repetition,
//! frequency and presence penalties) and the sampler's `min_p`, on fixed logits, against
//! reference implementations of OpenAI's and vLLM's formulas written here in f64; and the
//! penalties end to end through the scheduler, whose counts live on the device, against a
//! greedy loop that applies the same formulas to the model's own prefill logits.

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor as CTensor};
use common::RunnerExt;
use deepinfer::backend::cpu;
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::{self, Event, GenerationParams, Scheduler};
use deepinfer::graph::{DType, GraphBuilder, InputRole};
use deepinfer::model::logits::{self, LogitInputs, LOGIT_BIAS_SLOTS};
use deepinfer::model::vocab::VocabSlice;
use deepinfer::model::LogitsOutput;
use deepinfer::model::{ModelWeights, Precision};
use deepinfer::runner::step::{DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend};
use deepinfer::weights::Checkpoint;

const V: usize = 40;
const R: usize = 3;

/// OpenAI's documented formula (`mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence`)
/// after vLLM's repetition penalty (tokens in the prompt or generated: `l / r` if `l > 0`,
/// else `l * r`), with the mask and the bias first, as vLLM orders them.
#[allow(clippy::too_many_arguments)]
fn reference(
    l: f64,
    allowed: bool,
    bias: f64,
    count: f64,
    in_prompt: bool,
    rep: f64,
    freq: f64,
    pres: f64,
) -> f64 {
    if !allowed {
        return f64::NEG_INFINITY;
    }
    let mut l = l + bias;
    if count > 0.0 || in_prompt {
        l = if l > 0.0 { l / rep } else { l * rep };
    }
    l - count * freq - if count > 0.0 { pres } else { 0.0 }
}

/// A deterministic value in [-1, 1).
fn noise(i: usize) -> f64 {
    let x = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17);
    (x % 20_000) as f64 / 10_000.0 - 1.0
}

#[test]
fn mask_bias_and_penalties_match_the_reference_formulas() {
    let logits: Vec<f32> = (0..R * V).map(|i| (3.0 * noise(i)) as f32).collect();
    let counts: Vec<f32> = (0..R * V)
        .map(|i| ((noise(i + 999) + 1.0) * 1.6).floor() as f32)
        .collect();
    let prompt: Vec<f32> = (0..R * V).map(|i| f32::from(noise(i + 5) > 0.3)).collect();
    let (rep, freq, pres) = ([1.0f32, 1.3, 0.7], [0.0f32, 0.5, -0.4], [0.0f32, 1.5, 0.25]);
    // Row 1 allows only even tokens; the others everything.
    let words = V.div_ceil(32);
    let mut allowed = vec![u32::MAX; R * words];
    for w in 0..words {
        allowed[words + w] = 0x5555_5555;
    }
    let bias: [&[(u32, f32)]; R] = [&[(3, 5.0), (7, -100.0)], &[], &[(0, 2.5), (39, -1.0)]];
    let k = LOGIT_BIAS_SLOTS;
    let mut index = Vec::new();
    let mut values = Vec::new();
    for (r, b) in bias.iter().enumerate() {
        for j in 0..k {
            match b.get(j) {
                Some(&(t, v)) => {
                    index.push((r * (V + k) + t as usize) as i32);
                    values.push(v);
                }
                None => {
                    index.push((r * (V + k) + V + j) as i32);
                    values.push(0.0);
                }
            }
        }
    }
    let b = GraphBuilder::new("penalties");
    let input = |name: &str, shape: Vec<usize>, dtype| {
        b.input(name, InputRole::Metadata, shape, dtype).unwrap()
    };
    let l = input("logits", vec![R, V], DType::F32);
    let c = input("counts", vec![R, V], DType::F32);
    let p = input("prompt", vec![R, V], DType::F32);
    let a = input("allowed", vec![R, words], DType::U32);
    let bi = input("bias_index", vec![R * k], DType::I32);
    let bv = input("bias_values", vec![R * k], DType::F32);
    let pr = input("presence", vec![R], DType::F32);
    let fr = input("frequency", vec![R], DType::F32);
    let re = input("repetition", vec![R], DType::F32);
    let out = logits::adjust(
        &l,
        &c,
        &p,
        &LogitInputs {
            allowed: &a,
            bias_index: &bi,
            bias_values: &bv,
            presence: &pr,
            frequency: &fr,
            repetition: &re,
        },
        &VocabSlice::Whole,
    )
    .unwrap();
    b.output("out", &out).unwrap();
    let g = b.finish().unwrap();
    let dev = &Device::Cpu;
    let t = |v: &[f32], shape: &[usize]| CTensor::from_slice(v, shape, dev).unwrap();
    let args = vec![
        t(&logits, &[R, V]),
        t(&counts, &[R, V]),
        t(&prompt, &[R, V]),
        CTensor::from_slice(&allowed, (R, words), dev).unwrap(),
        CTensor::from_slice(&index, R * k, dev).unwrap(),
        t(&values, &[R * k]),
        t(&pres, &[R]),
        t(&freq, &[R]),
        t(&rep, &[R]),
    ];
    let got = cpu::run(&g, &args).unwrap()[0].to_vec2::<f32>().unwrap();
    for (r, got_row) in got.iter().enumerate() {
        for (v, &g) in got_row.iter().enumerate() {
            let i = r * V + v;
            let bias_v = bias[r]
                .iter()
                .find(|e| e.0 as usize == v)
                .map_or(0.0, |e| f64::from(e.1));
            let want = reference(
                f64::from(logits[i]),
                r != 1 || v % 2 == 0,
                bias_v,
                f64::from(counts[i]),
                prompt[i] > 0.0,
                f64::from(rep[r]),
                f64::from(freq[r]),
                f64::from(pres[r]),
            );
            let g = f64::from(g);
            if want.is_infinite() {
                assert_eq!(g, want, "row {r} token {v}");
            } else {
                assert!((g - want).abs() < 1e-5, "row {r} token {v}: {g} vs {want}");
            }
        }
    }
}

fn load(name: &str) -> (ModelConfig, ModelWeights) {
    let dir = common::fixture_dir(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let w = ModelWeights::load(&cfg, &Checkpoint::open(&dir).unwrap(), &Precision::F32).unwrap();
    (cfg, w)
}

/// Greedy decoding with penalties and bias applied to the prefill path's logits on the host:
/// the reference for the scheduler's device-side counts.
fn reference_greedy(prompt: &[u32], params: &GenerationParams, n: usize, eos: &[u32]) -> Vec<u32> {
    let (cfg, w) = load("default-model");
    let mut run =
        runner::open_with_weights(Backend::Cpu, cfg, w, RunnerConfig::for_limits(1, 256)).unwrap();
    let s = params.sampling;
    let mut tokens = prompt.to_vec();
    for step in 0..n {
        let logits = engine::score(run.as_mut(), &tokens).unwrap();
        let row = logits.last().unwrap();
        let mut best = (f64::NEG_INFINITY, 0u32);
        for (v, &l) in row.iter().enumerate() {
            let count = tokens[prompt.len()..]
                .iter()
                .filter(|&&t| t as usize == v)
                .count() as f64;
            let mut bias = params
                .logit_bias
                .iter()
                .find(|e| e.0 as usize == v)
                .map_or(0.0, |e| f64::from(e.1));
            if step < params.min_tokens && eos.contains(&(v as u32)) {
                bias = f64::NEG_INFINITY;
            }
            let x = reference(
                f64::from(l),
                true,
                bias,
                count,
                prompt.contains(&(v as u32)),
                f64::from(s.repetition_penalty),
                f64::from(s.frequency_penalty),
                f64::from(s.presence_penalty),
            );
            if x > best.0 {
                best = (x, v as u32);
            }
        }
        tokens.push(best.1);
    }
    tokens[prompt.len()..].to_vec()
}

#[test]
fn device_side_counts_give_the_reference_greedy_tokens() {
    let dir = common::fixture_dir("default-model");
    let tok = deepinfer::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let eos: Vec<u32> = tok.eos_token_id().into_iter().collect();
    let prompts = [
        "ROMEO:",
        "JULIET:\nO Romeo, Romeo",
        "HAMLET:\nTo be, or not to be",
    ];
    let n = 24;
    let cases = [
        SamplingParams {
            frequency_penalty: 1.2,
            ..SamplingParams::GREEDY
        },
        SamplingParams {
            presence_penalty: 1.5,
            repetition_penalty: 1.3,
            ..SamplingParams::GREEDY
        },
        SamplingParams {
            repetition_penalty: 0.8,
            frequency_penalty: -0.3,
            ..SamplingParams::GREEDY
        },
    ];
    // Small blocks and a small cache: sequences are preempted and recomputed, and the
    // sampling-state rows are reused by later requests.
    let (cfg, w) = load("default-model");
    let mut rc = RunnerConfig::for_limits(4, 256);
    rc.num_blocks = 9;
    let runner = runner::open_with_weights(Backend::Cpu, cfg, w, rc).unwrap();
    let mut s = Scheduler::new(runner, None, eos.clone()).unwrap();
    let mut want = HashMap::new();
    let mut id = 0u64;
    for p in prompts {
        let prompt = tok.encode(p, true).unwrap();
        for (c, sampling) in cases.iter().enumerate() {
            let params = GenerationParams {
                sampling: *sampling,
                logit_bias: vec![(prompt[1], -3.0)],
                min_tokens: if c == 0 { 8 } else { 0 },
                ignore_eos: true,
                ..GenerationParams::greedy(n)
            };
            want.insert(id, reference_greedy(&prompt, &params, n, &eos));
            s.add(id, prompt.clone(), params).unwrap();
            id += 1;
        }
    }
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    while !s.is_idle() {
        for o in s.step() {
            match o.event {
                Event::Token(t) => got.entry(o.id).or_default().push(t.token),
                Event::Failed { message, .. } => panic!("{message}"),
                _ => {}
            }
        }
    }
    assert!(
        s.preemptions() > 0,
        "the cache was large enough: nothing tested"
    );
    for (id, w) in &want {
        assert_eq!(&got[id], w, "request {id}");
    }
    // Not vacuous: the penalties change the greedy tokens.
    let plain = reference_greedy(
        &tok.encode(prompts[0], true).unwrap(),
        &GenerationParams::greedy(n),
        n,
        &eos,
    );
    assert_ne!(plain, want[&0]);
}

/// Steps of plain greedy rows run the CPU's argmax-only decode graph (`Sampler::Greedy`); the
/// same rows with an allowed-token mask of all ones (no change to any logit) run the full
/// sampler. Both must give transformers' greedy continuation, at batch 3, step by step.
#[test]
fn the_argmax_graph_and_the_full_sampler_give_the_same_greedy_tokens() {
    let r = common::reference("tiny-v3");
    let (prompt, want) = (&r.greedy.prompt_token_ids, &r.greedy.generated_token_ids);
    let vocab = ModelConfig::from_file(&common::fixture_dir("tiny-v3").join("config.json"))
        .unwrap()
        .vocab_size;
    let all_ones = vec![u32::MAX; vocab.div_ceil(32)];
    for masked in [false, true] {
        let mut run = common::runner("tiny-v3", 4, None);
        let mut alloc = common::allocator(&*run);
        let controls = LogitControls {
            allowed: masked.then_some(all_ones.as_slice()),
            ..LogitControls::NONE
        };
        let rows = 3;
        let mut tables = vec![Vec::new(); rows];
        let mut tokens = Vec::new();
        for table in tables.iter_mut() {
            alloc.grow(table, prompt.len()).unwrap();
            let chunk = PrefillChunk {
                tokens: prompt,
                start: 0,
                blocks: table,
                sampling: SamplingParams::GREEDY,
                controls,
            };
            let out = run.prefill(&chunk, LogitsOutput::None).unwrap();
            tokens.push(out.next_tokens[0]);
        }
        let mut got: Vec<Vec<u32>> = tokens.iter().map(|&t| vec![t]).collect();
        for step in 0..want.len() - 1 {
            let position = prompt.len() + step;
            for table in tables.iter_mut() {
                alloc.grow(table, position + 1).unwrap();
            }
            let batch: Vec<DecodeRow> = tables
                .iter()
                .zip(&tokens)
                .map(|(t, &token)| DecodeRow {
                    token,
                    position,
                    blocks: t,
                    sampling: SamplingParams::GREEDY,
                    controls,
                })
                .collect();
            tokens = run.decode(&batch, false).unwrap().next_tokens;
            for (g, &t) in got.iter_mut().zip(&tokens) {
                g.push(t);
            }
        }
        for g in &got {
            assert_eq!(g, want, "masked {masked}");
        }
    }
}
