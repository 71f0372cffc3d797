//! The in-graph sampler against its definitions, on the CPU backend and through nrt-sim (the HLO
//! as a NEFF, with the mass threshold read back as the composite it is):
//!
//! - the generator is murmur3's finalizer bit for bit (reference: plain `u32::wrapping_mul`),
//!   though the graph multiplies in f32 limbs;
//! - 10,000 seeded draws from one row of a 32,000-token vocabulary with `top_k = 1000` and
//!   `top_p = 0.99` follow the exact renormalised distribution (computed here in f64 by sorting,
//!   top-k, renormalising, top-p), by a chi-square test at p > 0.001, and never leave its
//!   support; a sampler that cut the nucleus to fewer candidates, or applied top-p before
//!   top-k, puts draws outside it;
//! - greedy rows, `top_k = 1` and a tiny `top_p` give the argmax.
//!
//! XLA runs the same generator and mass threshold bit for bit in the conformance suite
//! (`blocks.json`, `mass_threshold.json`).

use std::sync::Arc;

use candle_core::Tensor as CTensor;
use deepinfer::backend::neuron::compile::{compile_all, CompileJob, CompilerConfig};
use deepinfer::backend::neuron::sim_neff::NeffNames;
use deepinfer::backend::{cpu, hlo};
use deepinfer::graph::{DType, Graph, GraphBuilder, InputRole};
use deepinfer::host;
use deepinfer::model::sampling::{self, SamplingInputs};
use deepinfer::model::vocab::VocabSlice;
use deepinfer::runner::{self, binding};
use neuron_sys::{Library, Model, Runtime, Tensor as NTensor, TensorSet};
use statrs::distribution::{ChiSquared, ContinuousCDF};

const VOCAB: usize = 32_000;
const DRAWS: usize = 10_000;
/// Draws per execution (rows of one graph).
const ROWS: usize = 500;
const TEMPERATURE: f32 = 0.8;
const TOP_K: i32 = 1000;
const TOP_P: f32 = 0.99;

/// murmur3's 32-bit finalizer, as published.
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The generator's definition: `fmix32(seed ^ fmix32(position ^ 0x9e3779b9))`.
fn random_bits(seed: u32, position: i32) -> u32 {
    fmix32(seed ^ fmix32(position as u32 ^ 0x9e37_79b9))
}

/// One input of a test graph: its name, dtype, shape and little-endian bytes.
struct Input {
    name: &'static str,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn input<T: bytemuck::Pod>(name: &'static str, dtype: DType, shape: &[usize], v: &[T]) -> Input {
    Input {
        name,
        dtype,
        shape: shape.to_vec(),
        bytes: bytemuck::cast_slice(v).to_vec(),
    }
}

/// A graph over `inputs` (metadata) whose outputs `build` makes.
fn graph(
    inputs: &[Input],
    build: impl FnOnce(&[deepinfer::graph::Tensor]) -> Vec<(String, deepinfer::graph::Tensor)>,
) -> Graph {
    let b = GraphBuilder::new("sampling_test");
    let xs: Vec<_> = inputs
        .iter()
        .map(|i| {
            b.input(i.name, InputRole::Metadata, i.shape.clone(), i.dtype)
                .unwrap()
        })
        .collect();
    for (name, t) in build(&xs) {
        b.output(name, &t).unwrap();
    }
    b.finish().unwrap()
}

/// The sampler over inputs (logits, temperature, top_k, top_p, seeds, positions), output
/// `next`.
fn sampler_graph(inputs: &[Input]) -> Graph {
    graph(inputs, |t| {
        let off = t[3].full_like(0.0).unwrap(); // min_p 0: off (tests/sampler_conformance covers it)
        let p = SamplingInputs {
            temperature: &t[1],
            top_k: &t[2],
            top_p: &t[3],
            min_p: &off,
            seeds: &t[4],
            positions: &t[5],
        };
        vec![(
            "next".into(),
            sampling::sample(&t[0], &p, &VocabSlice::Whole).unwrap(),
        )]
    })
}

/// Output `k` as raw little-endian bytes, on the CPU backend.
fn run_cpu(g: &Graph, inputs: &[Input]) -> Vec<Vec<u8>> {
    let args: Vec<CTensor> = inputs
        .iter()
        .map(|i| host::tensor_from_bytes(i.dtype, &i.shape, &i.bytes).unwrap())
        .collect();
    let outs = cpu::run(g, &args).unwrap();
    assert_eq!(
        outs.len(),
        g.outputs().len(),
        "outputs computed vs declared"
    );
    outs.iter()
        .zip(g.outputs())
        .map(|(t, o)| host::with_tensor_bytes(t, g.node(o.node).dtype, |b| b.to_vec()).unwrap())
        .collect()
}

/// nrt-sim over its first core, and the compile driver set up for its stand-in compiler.
struct Sim {
    rt: Runtime,
    compiler: CompilerConfig,
}

fn sim() -> Sim {
    let path = nrt_sim::library_next_to_current_exe()
        .expect("libnrt_sim.so next to the test binary (cargo test --workspace builds it)");
    let lib: Arc<Library> = Library::open(&path).unwrap();
    Sim {
        rt: Runtime::shared(lib, 0, 1).unwrap(),
        compiler: CompilerConfig {
            program: env!("CARGO_BIN_EXE_nrt-sim-neuronx-cc").into(),
            ..runner::sim_compiler_config(NeffNames::default())
        },
    }
}

/// Each output's bytes after compiling `g`'s HLO with the stand-in compiler (through the driver
/// and NEFF cache), loading it into nrt-sim and binding by the names the NEFF reports.
fn run_sim(sim: &Sim, g: &Graph, inputs: &[Input]) -> Vec<Vec<u8>> {
    let rt = &sim.rt;
    let job = CompileJob {
        name: g.name().to_string(),
        hlo: hlo::emit::to_bytes(&hlo::emit::emit(g).unwrap()),
    };
    let neff = compile_all(&sim.compiler, std::slice::from_ref(&job))
        .unwrap()
        .pop()
        .unwrap()
        .neff;
    let model = Model::load(rt, &neff, Some(0), None).unwrap();
    let io = model.io().unwrap();
    let names = binding::bind(
        g,
        &io.inputs().map(|t| t.name.clone()).collect::<Vec<_>>(),
        &io.outputs().map(|t| t.name.clone()).collect::<Vec<_>>(),
    )
    .unwrap();
    let mut ins = TensorSet::new(rt).unwrap();
    let mut outs = TensorSet::new(rt).unwrap();
    let mut keep = Vec::new();
    for (i, name) in inputs.iter().zip(&names.inputs) {
        let t = NTensor::device(rt, 0, i.bytes.len(), name).unwrap();
        t.write(0, &i.bytes).unwrap();
        ins.add(name, &t).unwrap();
        keep.push(t);
    }
    let out_tensors: Vec<NTensor> = g
        .outputs()
        .iter()
        .zip(&names.outputs)
        .map(|(o, name)| {
            let node = g.node(o.node);
            let size = node.shape.dims().iter().product::<usize>() * node.dtype.size_in_bytes();
            let t = NTensor::device(rt, 0, size, name).unwrap();
            outs.add(name, &t).unwrap();
            t
        })
        .collect();
    model.execute(&ins, &outs).unwrap();
    out_tensors
        .iter()
        .map(|t| t.read_vec(0, t.size()).unwrap())
        .collect()
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn the_generator_is_murmur3_bit_for_bit() {
    // Edge seeds and positions, then a spread of both.
    let mut seeds: Vec<u32> = vec![0, 1, u32::MAX, 0x8000_0000, 0x7fff_ffff, 0x9e37_79b9];
    let mut positions: Vec<i32> = vec![0, 1, i32::MAX, 4095, 1 << 24, 123_456];
    for k in 0..250u32 {
        seeds.push(k.wrapping_mul(0x2545_f491) ^ (k << 7));
        positions.push((k as i32) * 8191 % 1_000_003);
    }
    let n = seeds.len();
    let xs: Vec<u32> = seeds
        .iter()
        .map(|s| s.rotate_left(13) ^ 0xdead_beef)
        .collect();
    let inputs = [
        input("seeds", DType::U32, &[n], &seeds),
        input("positions", DType::I32, &[n], &positions),
        input("x", DType::U32, &[n], &xs),
    ];
    let constants = [
        0u32,
        1,
        u32::MAX,
        0x85eb_ca6b,
        0xc2b2_ae35,
        0x0000_07ff,
        0xffc0_0000,
    ];
    let g = graph(&inputs, |t| {
        let mut outs: Vec<(String, _)> = vec![
            ("bits".into(), sampling::random_bits(&t[0], &t[1]).unwrap()),
            ("uniform".into(), sampling::uniform(&t[0], &t[1]).unwrap()),
        ];
        for c in constants {
            outs.push((
                format!("x_times_{c:x}"),
                sampling::wrapping_mul(&t[2], c).unwrap(),
            ));
        }
        outs
    });
    let want_bits: Vec<u32> = seeds
        .iter()
        .zip(&positions)
        .map(|(&s, &p)| random_bits(s, p))
        .collect();
    let want_uniform: Vec<f32> = want_bits
        .iter()
        .map(|&b| ((b >> 9) as f64 + 0.5) as f32 / (1u32 << 23) as f32)
        .collect();
    let sim = sim();
    for (executor, outs) in [
        ("cpu", run_cpu(&g, &inputs)),
        ("nrt-sim", run_sim(&sim, &g, &inputs)),
    ] {
        assert_eq!(u32s(&outs[0]), want_bits, "{executor}: random bits");
        let u = f32s(&outs[1]);
        assert!(
            u.iter().all(|&u| u > 0.0 && u < 1.0),
            "{executor}: uniforms in (0, 1)"
        );
        assert_eq!(
            u.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want_uniform.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{executor}: uniforms"
        );
        for (k, c) in constants.iter().enumerate() {
            let want: Vec<u32> = xs.iter().map(|x| x.wrapping_mul(*c)).collect();
            assert_eq!(u32s(&outs[2 + k]), want, "{executor}: x * {c:#x}");
        }
    }
}

/// The test row: token `t` has rank `(t * 7919) % VOCAB` (a permutation: 7919 is prime to
/// 32,000) and logit `-rank / 235`, so the scaled logits fall by 1/294 per rank: the top 1000
/// hold 97% of the mass and top-p 0.99 of them keeps 792 tokens, so both filters bind (and the
/// crossing is 4e-5 away from either neighbour, far beyond f32 rounding).
fn test_logits() -> Vec<f32> {
    (0..VOCAB)
        .map(|t| -((t * 7919 % VOCAB) as f32) / 235.0)
        .collect()
}

/// The exact distribution after temperature, top-k and top-p (renormalised after each), in
/// f64, by sorting: token -> probability, zero outside the nucleus.
fn exact_distribution(logits: &[f32]) -> Vec<f64> {
    let z: Vec<f64> = logits.iter().map(|&l| f64::from(l / TEMPERATURE)).collect();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    let top: Vec<usize> = order[..TOP_K as usize].to_vec();
    let zmax = z[top[0]];
    let e: Vec<f64> = top.iter().map(|&t| (z[t] - zmax).exp()).collect();
    let total: f64 = e.iter().sum();
    let mut probs = vec![0.0; z.len()];
    let mut cum = 0.0;
    let mut nucleus = 0.0;
    let mut kept = Vec::new();
    for (k, &t) in top.iter().enumerate() {
        kept.push((t, e[k]));
        cum += e[k] / total;
        nucleus += e[k];
        if cum >= f64::from(TOP_P) {
            // The crossing must not be within float rounding of top_p, or f32 could cut
            // elsewhere.
            assert!(
                cum - f64::from(TOP_P) > 1e-5,
                "top-p crossing too close to call"
            );
            assert!(
                f64::from(TOP_P) - (cum - e[k] / total) > 1e-5,
                "top-p crossing too close to call"
            );
            break;
        }
    }
    for (t, m) in kept {
        probs[t] = m / nucleus;
    }
    probs
}

/// Chi-square goodness of fit of `counts` to `probs` over `n` draws, tokens binned in order of
/// probability so that every bin expects at least 5; returns (statistic, dof, p-value).
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> (f64, usize, f64) {
    let mut support: Vec<usize> = (0..probs.len()).filter(|&t| probs[t] > 0.0).collect();
    support.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut bins: Vec<(f64, usize)> = Vec::new();
    let (mut want, mut got) = (0.0, 0);
    for t in support {
        want += probs[t] * n as f64;
        got += counts[t];
        if want >= 5.0 {
            bins.push((want, got));
            (want, got) = (0.0, 0);
        }
    }
    if let Some(last) = bins.last_mut() {
        last.0 += want;
        last.1 += got;
    }
    let stat: f64 = bins.iter().map(|&(w, g)| (g as f64 - w).powi(2) / w).sum();
    let dof = bins.len() - 1;
    let p = 1.0 - ChiSquared::new(dof as f64).unwrap().cdf(stat);
    (stat, dof, p)
}

/// `count` draws of the test row, `ROWS` per execution, each row with its own seed; `sample`
/// runs the sampler over [`sampler_graph`]'s inputs and returns the tokens.
fn draws(count: usize, mut sample: impl FnMut(&[Input]) -> Vec<i32>) -> Vec<i32> {
    let row = test_logits();
    let logits: Vec<f32> = (0..ROWS).flat_map(|_| row.iter().copied()).collect();
    let mut tokens = Vec::with_capacity(count);
    for chunk in 0..count / ROWS {
        let seeds: Vec<u32> = (0..ROWS).map(|r| (chunk * ROWS + r) as u32).collect();
        let inputs = [
            input("logits", DType::F32, &[ROWS, VOCAB], &logits),
            input("temperature", DType::F32, &[ROWS], &vec![TEMPERATURE; ROWS]),
            input("top_k", DType::I32, &[ROWS], &vec![TOP_K; ROWS]),
            input("top_p", DType::F32, &[ROWS], &vec![TOP_P; ROWS]),
            input("seeds", DType::U32, &[ROWS], &seeds),
            input("positions", DType::I32, &[ROWS], &vec![17i32; ROWS]),
        ];
        tokens.extend(sample(&inputs));
    }
    tokens
}

/// [`draws`] of the whole-vocabulary sampler graph through `run`.
fn whole_draws(run: impl Fn(&Graph, &[Input]) -> Vec<Vec<u8>>) -> Vec<i32> {
    let mut g = None;
    draws(DRAWS, |inputs| {
        i32s(&run(g.get_or_insert_with(|| sampler_graph(inputs)), inputs)[0])
    })
}

fn assert_follows_the_distribution(executor: &str, tokens: &[i32]) {
    let probs = exact_distribution(&test_logits());
    let support = probs.iter().filter(|&&p| p > 0.0).count();
    // Both filters bind: fewer than top_k survive top-p, and far more than a 256-candidate cap.
    assert_eq!(support, 792, "nucleus size");
    let mut counts = vec![0usize; VOCAB];
    for &t in tokens {
        let t = usize::try_from(t).expect("a token id");
        assert!(
            probs[t] > 0.0,
            "{executor}: drew token {t}, outside the top-k/top-p nucleus"
        );
        counts[t] += 1;
    }
    let (stat, dof, p) = chi_square(&counts, &probs, tokens.len());
    eprintln!("{executor}: chi-square {stat:.1} on {dof} dof, p = {p:.4}");
    assert!(
        p > 0.001,
        "{executor}: chi-square {stat:.1} on {dof} dof, p = {p:.2e}"
    );
}

#[test]
fn draws_follow_the_renormalised_distribution_on_the_cpu() {
    assert_follows_the_distribution("cpu", &whole_draws(run_cpu));
}

#[test]
fn draws_follow_the_renormalised_distribution_through_nrt_sim() {
    let sim = sim();
    assert_follows_the_distribution("nrt-sim", &whole_draws(|g, i| run_sim(&sim, g, i)));
}

/// Six copies of `row` whose first four must all give its maximum: row 0 greedy, row 1
/// `top_k = 1`, row 2 `top_p = 1e-6`, row 3 `top_p = 0`; then sampled rows with neither filter
/// (the whole vocabulary) and with `top_k = vocab` (off).
fn argmax_rows(row: &[f32]) -> [Input; 6] {
    let rows = 6;
    let logits: Vec<f32> = (0..rows).flat_map(|_| row.iter().copied()).collect();
    [
        input("logits", DType::F32, &[rows, VOCAB], &logits),
        input(
            "temperature",
            DType::F32,
            &[rows],
            &[0.0f32, 1.0, 1.0, 1.0, 1.0, 1.0],
        ),
        input(
            "top_k",
            DType::I32,
            &[rows],
            &[0i32, 1, 0, 0, 0, VOCAB as i32],
        ),
        input(
            "top_p",
            DType::F32,
            &[rows],
            &[1.0f32, 1.0, 1e-6, 0.0, 1.0, 1.0],
        ),
        input("seeds", DType::U32, &[rows], &[1u32, 2, 3, 4, 5, 6]),
        input("positions", DType::I32, &[rows], &[0i32; 6]),
    ]
}

#[test]
fn greedy_top_k_1_and_a_tiny_top_p_give_the_argmax() {
    let row = test_logits();
    let best = row
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(t, _)| t as i32)
        .unwrap();
    let inputs = argmax_rows(&row);
    let g = sampler_graph(&inputs);
    let sim = sim();
    for (executor, outs) in [
        ("cpu", run_cpu(&g, &inputs)),
        ("nrt-sim", run_sim(&sim, &g, &inputs)),
    ] {
        let got = i32s(&outs[0]);
        assert_eq!(got[..4], [best; 4], "{executor}: {got:?}");
        assert!(
            got[4..].iter().all(|&t| (0..VOCAB as i32).contains(&t)),
            "{executor}: {got:?}"
        );
    }
}

/// The CPU kernel of the mass threshold and XLA's bisection agree on the edges in the
/// conformance suite; here the composite is plain instructions in HLO (no `call`, no
/// `bitcast-convert`), tagged, and one op again after import.
#[test]
fn the_mass_threshold_is_tagged_plain_hlo_and_one_op_after_import() {
    let inputs = [
        input(
            "x",
            DType::F32,
            &[2, 4],
            &[1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 0.5, 9.0],
        ),
        input("w", DType::F32, &[2, 4], &[1.0f32; 8]),
        input("target", DType::F32, &[2], &[2.0f32, 3.0]),
    ];
    let g = graph(&inputs, |t| {
        vec![("t".into(), t[0].mass_threshold(&t[1], &t[2]).unwrap())]
    });
    let module = hlo::emit::emit(&g).unwrap();
    let entry = module.computations.last().unwrap();
    assert!(entry
        .instructions
        .iter()
        .all(|i| i.opcode != "call" && i.opcode != "bitcast-convert" && i.opcode != "sort"));
    let tagged = |key: &str| {
        entry
            .instructions
            .iter()
            .filter(|i| {
                i.frontend_attributes
                    .as_ref()
                    .is_some_and(|f| f.map.contains_key(key))
            })
            .count()
    };
    assert_eq!(tagged("deepinfer_composite"), 1);
    assert!(tagged("deepinfer_composite_part") > 32 * 5);
    let imported = hlo::import::import(&module).unwrap();
    let out = imported.node(imported.outputs()[0].node);
    assert!(
        matches!(out.op, deepinfer::graph::Op::MassThreshold { .. }),
        "{:?}",
        out.op
    );
    let got = f32s(&run_cpu(&imported, &inputs)[0]);
    assert_eq!(got, [3.0, 0.5]);
}

/// The sampler over one of `ranks` equal slices of the vocabulary: [`sampler_graph`]'s inputs,
/// the logits being the slice's columns, plus `first` (`[1]` i32), the slice's first token id.
fn split_sampler_graph(inputs: &[Input], ranks: usize) -> Graph {
    graph(inputs, |t| {
        let off = t[3].full_like(0.0).unwrap();
        let p = SamplingInputs {
            temperature: &t[1],
            top_k: &t[2],
            top_p: &t[3],
            min_p: &off,
            seeds: &t[4],
            positions: &t[5],
        };
        let vocab = VocabSlice::Shard {
            ranks,
            first: t[6].clone(),
            vocab: t[0].dim(1) * ranks,
        };
        vec![("next".into(), sampling::sample(&t[0], &p, &vocab).unwrap())]
    })
}

/// Rank `r`'s inputs of a split graph: the columns of its slice of every `[rows, vocab]` input
/// named in `split`, the others whole, then its first token id.
fn rank_inputs(inputs: &[Input], split: &[&str], r: usize, ranks: usize) -> Vec<CTensor> {
    let mut out: Vec<CTensor> = inputs
        .iter()
        .map(|i| {
            let t = host::tensor_from_bytes(i.dtype, &i.shape, &i.bytes).unwrap();
            if split.contains(&i.name) {
                let n = i.shape[1] / ranks;
                t.narrow(1, r * n, n).unwrap().contiguous().unwrap()
            } else {
                t
            }
        })
        .collect();
    let first = (r * inputs[0].shape[1] / ranks) as i32;
    out.push(CTensor::from_slice(&[first], 1, &candle_core::Device::Cpu).unwrap());
    out
}

/// Runs `g` on `ranks` CPU threads whose collectives meet, rank `r` with
/// [`rank_inputs`]; checks that every rank computed the same outputs and returns rank 0's.
fn run_split(g: &Graph, inputs: &[Input], split: &[&str], ranks: usize) -> Vec<Vec<u8>> {
    let per_rank: Vec<Vec<CTensor>> = (0..ranks)
        .map(|r| rank_inputs(inputs, split, r, ranks))
        .collect();
    let group = cpu::Group::new(ranks, std::time::Duration::from_secs(60));
    let outs = cpu::run_group(g, &per_rank, &group, 0).unwrap();
    let bytes: Vec<Vec<Vec<u8>>> = outs
        .iter()
        .map(|o| {
            assert_eq!(o.len(), g.outputs().len(), "outputs computed vs declared");
            o.iter()
                .zip(g.outputs())
                .map(|(t, out)| {
                    host::with_tensor_bytes(t, g.node(out.node).dtype, |b| b.to_vec()).unwrap()
                })
                .collect()
        })
        .collect();
    for (r, b) in bytes.iter().enumerate() {
        assert_eq!(b, &bytes[0], "rank {r} of {ranks} disagrees with rank 0");
    }
    bytes.into_iter().next().unwrap()
}

fn with_first(inputs: &[Input], ranks: usize) -> Vec<Input> {
    let mut all: Vec<Input> = inputs
        .iter()
        .map(|i| Input {
            name: i.name,
            dtype: i.dtype,
            shape: i.shape.clone(),
            bytes: i.bytes.clone(),
        })
        .collect();
    // Declared for the graph's shape; each rank's own value comes from `rank_inputs`.
    all.push(input("first", DType::I32, &[1], &[0i32]));
    // The graph sees one slice of the logits.
    all[0].shape[1] /= ranks;
    all
}

/// Split by vocabulary over 4 ranks, the draws still follow the exact renormalised
/// distribution (the f64 reference, by chi-square, never outside the nucleus), and they are the
/// unsplit sampler's draws: the same seeds pick the same tokens, unless a draw's target falls
/// within float rounding of a boundary between two tokens' running masses (the split sums them
/// in another order); at most one in a thousand may differ. 2,000 draws (not 10,000): the
/// split search costs the CPU 15 compares per value and round where the unsplit op costs one.
#[test]
fn split_draws_follow_the_distribution_and_are_the_unsplit_draws() {
    let (ranks, count) = (4, 2_000);
    let whole = whole_draws(run_cpu);
    let mut g = None;
    let split = draws(count, |inputs| {
        let g = g.get_or_insert_with(|| split_sampler_graph(&with_first(inputs, ranks), ranks));
        i32s(&run_split(g, inputs, &["logits"], ranks)[0])
    });
    assert_follows_the_distribution(&format!("cpu, {ranks} ranks"), &split);
    assert_eq!(split.len(), count, "split draws");
    // Draw `i` is seeded with `i` in both, so the split's draws are compared with the first
    // `count` of the whole sampler's (`whole_draws` makes `DRAWS`, more than `count`).
    let whole = &whole[..count];
    let differ = whole.iter().zip(&split).filter(|(a, b)| a != b).count();
    eprintln!("{ranks} ranks: {differ} of {count} draws differ from the unsplit sampler's");
    assert!(
        differ * 1000 <= count,
        "{ranks} ranks: {differ} draws differ"
    );
}

/// Split over 4 ranks, greedy rows take the lowest token id holding the maximum (two ranks
/// hold it here), and `top_k = 1` or a tiny or zero `top_p` keep just the tied maxima; without
/// a tie all four rows give the maximum, held by the last rank. Sampled rows stay in range.
#[test]
fn split_greedy_rows_take_the_lowest_id_of_the_maximum() {
    let ranks = 4;
    for (ties, want) in [(&[9_001, 25_000][..], 9_001), (&[30_000][..], 30_000)] {
        let mut row = test_logits();
        for &t in ties {
            row[t] = 3.0;
        }
        row[100] = 2.999; // a near miss in rank 0
        let inputs = argmax_rows(&row);
        let g = split_sampler_graph(&with_first(&inputs, ranks), ranks);
        let got = i32s(&run_split(&g, &inputs, &["logits"], ranks)[0]);
        assert_eq!(got[0], want, "greedy: {got:?}");
        for &t in &got[1..4] {
            assert!(
                ties.contains(&(t as usize)),
                "{t} is not a maximum: {got:?}"
            );
        }
        assert!(
            got[4..].iter().all(|&t| (0..VOCAB as i32).contains(&t)),
            "{got:?}"
        );
    }
}

/// The mass threshold by definition, in f64: sort the values in descending order, add up the
/// weights, and take the value where the running mass first reaches the target (every value tied
/// with it counts); `+inf` for a target `<= 0`, `-inf` when the whole row falls short.
fn threshold_by_sorting(x: &[f32], w: &[f32], target: f32) -> f32 {
    if target <= 0.0 {
        return f32::INFINITY;
    }
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
    let mut mass = 0.0f64;
    for (k, &i) in order.iter().enumerate() {
        mass += f64::from(w[i]);
        let tied_next = order.get(k + 1).is_some_and(|&j| x[j] == x[i]);
        if mass >= f64::from(target) && !tied_next {
            return x[i];
        }
    }
    f32::NEG_INFINITY
}

/// Split over 4 ranks, the threshold search (8 rounds of 15 keys, the masses all-reduced) finds
/// the value the definition gives and the unsplit op finds, for unit weights (top-k's k-th
/// largest, ties included) and for weights whose sums are exact in any order, at targets from
/// below zero to beyond the whole row's mass; values include ties, negatives, zero and +-inf.
#[test]
fn the_split_mass_threshold_is_the_definitions() {
    let (ranks, rows, n) = (4, 12, 64);
    let x: Vec<f32> = (0..rows * n)
        .map(|i| match i % n {
            0 => f32::INFINITY,
            1 => f32::NEG_INFINITY,
            2 | 3 => 0.0,
            j => ((j * 37 + i / n * 11) % 23) as f32 * 0.375 - 4.0,
        })
        .collect();
    // Multiples of 1/8 below 4: every partial sum is exact in f32.
    let w: Vec<f32> = (0..rows * n)
        .map(|i| ((i * 13) % 32) as f32 / 8.0)
        .collect();
    let ones = vec![1.0f32; rows * n];
    let targets: Vec<f32> = (0..rows)
        .map(|r| {
            [
                -1.0, 0.0, 0.5, 1.0, 3.0, 7.0, 20.0, 33.0, 60.0, 64.0, 65.0, 1e9,
            ][r]
        })
        .collect();
    for weights in [&ones, &w] {
        let inputs = [
            input("x", DType::F32, &[rows, n], &x),
            input("w", DType::F32, &[rows, n], weights),
            input("target", DType::F32, &[rows], &targets),
        ];
        let whole = graph(&inputs, |t| {
            vec![("t".into(), t[0].mass_threshold(&t[1], &t[2]).unwrap())]
        });
        let mut declared = with_first(&inputs, 1);
        declared[0].shape[1] /= ranks;
        declared[1].shape[1] /= ranks;
        let split = graph(&declared, |t| {
            let vocab = VocabSlice::Shard {
                ranks,
                first: t[3].clone(),
                vocab: t[0].dim(1) * ranks,
            };
            vec![(
                "t".into(),
                vocab.mass_threshold(&t[0], &t[1], &t[2]).unwrap(),
            )]
        });
        let want: Vec<f32> = (0..rows)
            .map(|r| {
                let cols = r * n..(r + 1) * n;
                threshold_by_sorting(&x[cols.clone()], &weights[cols], targets[r])
            })
            .collect();
        let got_whole = f32s(&run_cpu(&whole, &inputs)[0]);
        let got_split = f32s(&run_split(&split, &inputs, &["x", "w"], ranks)[0]);
        assert_eq!(got_whole, want, "the unsplit op against the definition");
        assert_eq!(got_split, want, "{ranks} ranks against the definition");
    }
}
