//! Speculative decoding of sampled rows (`model::sampling::verify`): with temperature, top-p
//! and penalties, the tokens `--speculative-tokens K` gives are distributed exactly as the
//! target's own sampler says, draft accepted or not.
//!
//! The default model drafts with its trained MTP layer, whose proposals the main model accepts
//! often but not always at temperature 0.8, so both branches of the rejection sampler run.
//! Thousands of requests, each with its own seed, generate three tokens from one prompt; the
//! joint distribution of their first two, and of all three, is tested by chi-square against the
//! target's probabilities: the main model's logits after each prefix (a plain prefill),
//! through the penalties, temperature and top-p computed here in f64 from their published
//! formulas (vLLM's order). The third token is decided at a verify step's second position
//! when both drafts before it were accepted, which is where the counts of the drafts fed in
//! the same step must already penalise it. K = 0 runs against the same reference first, so a
//! wrong reference cannot pass as a right sampler.

mod common;

use std::collections::HashMap;

use common::{drafting_runner_on, fixture_dir, Intercept, RunnerExt};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::speculative::SpeculativeStats;
use deepinfer::engine::{Event, GenerationParams, RequestId, Scheduler};
use deepinfer::model::LogitsOutput;
use deepinfer::model::{ModelWeights, Precision};
use deepinfer::runner::step::{LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{Backend, CpuRunner, Runner, Step, StepOutput};
use deepinfer::weights::Checkpoint;
use statrs::distribution::{ChiSquared, ContinuousCDF};

/// Requests per run, each with its own seed.
const REQUESTS: usize = 3000;

/// One model, prompt and sampler to test speculation with.
#[derive(Clone)]
struct Case {
    fixture: &'static str,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    /// Whether the drafts are each row's last token repeated (see [`runner`]) rather than the
    /// MTP layer's.
    repeat_drafts: bool,
    /// Where the model runs: the CPU, or nrt-sim (the device runner, which verifies on its
    /// decode buckets' graphs).
    backend: Backend,
}

/// The default model drafting with its trained MTP layer from the start of its held-out text,
/// at temperature 0.8 with top-p 0.9 and all three penalties.
fn trained_case() -> Case {
    #[derive(serde::Deserialize)]
    struct Heldout {
        token_ids: Vec<u32>,
    }
    let h: Heldout = common::reference_file("default-model", "heldout.json");
    Case {
        fixture: "default-model",
        prompt: h.token_ids[..12].to_vec(),
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 0,
            min_p: 0.0,
            presence_penalty: 0.4,
            frequency_penalty: 0.3,
            repetition_penalty: 1.2,
        },
        repeat_drafts: false,
        backend: Backend::Cpu,
    }
}

/// A runner over `case`'s model drafting `k` tokens, split over `tp` ranks; with
/// `repeat_drafts`, each draft is the sequence's last token again in place of the MTP layer's
/// proposal: under a negative frequency penalty the target favours repeats, so these drafts
/// are often accepted and a verify step's later positions decide tokens whose penalties count
/// the drafts before them.
fn runner(case: &Case, k: usize, tp: usize) -> Box<dyn Runner> {
    // Batches of 32 and long packed prefills: the requests are many and short.
    let inner = drafting_runner_on(case.backend, case.fixture, k, tp, (32, 256), 256);
    if !case.repeat_drafts {
        return inner;
    }
    let hook = |step: &Step<'_>, out: &mut StepOutput| {
        if let Step::Draft { chunks, .. } = step {
            for (c, token) in chunks.iter().zip(out.next_tokens.iter_mut()) {
                *token = *c.next_tokens.last().expect("a draft row");
            }
        }
    };
    Box::new(Intercept { inner, hook })
}

/// The first three tokens (of four, so that a verify step after the first can feed two
/// drafts) of `requests` requests of `case`, each seeded with its index, and what speculation
/// did.
fn generate(
    case: &Case,
    k: usize,
    tp: usize,
    requests: usize,
) -> (Vec<[u32; 3]>, SpeculativeStats) {
    let mut s = Scheduler::new(runner(case, k, tp), None, Vec::new()).unwrap();
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    for id in 0..requests {
        let mut params = GenerationParams::greedy(4);
        params.sampling = SamplingParams {
            seed: id as u32,
            ..case.sampling
        };
        params.ignore_eos = true;
        s.add(id as RequestId, case.prompt.clone(), params).unwrap();
    }
    while !s.is_idle() {
        for o in s.step() {
            match o.event {
                Event::Token(t) => tokens.entry(o.id).or_default().push(t.token),
                Event::Failed { message, .. } => panic!("request {}: {message}", o.id),
                _ => {}
            }
        }
    }
    let out = (0..requests)
        .map(|id| {
            let t = &tokens[&(id as RequestId)];
            [t[0], t[1], t[2]]
        })
        .collect();
    (out, s.speculative_stats())
}

/// The target's next-token probabilities after `prompt` and `generated`, in f64: vLLM's
/// repetition penalty on tokens in the prompt or generated, OpenAI's frequency and presence
/// penalties on generated ones, then temperature and top-p (renormalised). `None` where the
/// top-p cut is too close to call (within 1e-5, where f32 could cut elsewhere).
struct Target {
    runner: Box<dyn Runner>,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    cache: HashMap<Vec<u32>, Option<Vec<f64>>>,
}

impl Target {
    fn probs(&mut self, generated: &[u32]) -> Option<&[f64]> {
        if !self.cache.contains_key(generated) {
            let p = self.compute(generated);
            self.cache.insert(generated.to_vec(), p);
        }
        self.cache[generated].as_deref()
    }

    fn compute(&mut self, generated: &[u32]) -> Option<Vec<f64>> {
        let tokens: Vec<u32> = self.prompt.iter().chain(generated).copied().collect();
        let blocks: Vec<u32> = (1..=4).collect();
        let chunk = PrefillChunk {
            tokens: &tokens,
            start: 0,
            blocks: &blocks,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        };
        let out = self.runner.prefill(&chunk, LogitsOutput::Sampled).unwrap();
        let logits = &out.logits.unwrap()[0];
        let s = self.sampling;
        let z: Vec<f64> = logits
            .iter()
            .enumerate()
            .map(|(v, &l)| {
                let mut l = f64::from(l);
                assert!(l.is_finite(), "logit {v} is {l}");
                let count = generated.iter().filter(|&&g| g as usize == v).count() as f64;
                let seen = count > 0.0 || self.prompt.contains(&(v as u32));
                if seen {
                    let r = f64::from(s.repetition_penalty);
                    l = if l > 0.0 { l / r } else { l * r };
                }
                l -= count * f64::from(s.frequency_penalty);
                if count > 0.0 {
                    l -= f64::from(s.presence_penalty);
                }
                l / f64::from(s.temperature)
            })
            .collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|&x| (x - max).exp()).collect();
        let total: f64 = e.iter().sum();
        let mut order: Vec<usize> = (0..e.len()).collect();
        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
        let (mut cum, mut kept) = (0.0, 0.0);
        let mut probs = vec![0.0; e.len()];
        let top_p = f64::from(s.top_p);
        for &v in &order {
            if (cum - top_p).abs() < 1e-5 {
                return None;
            }
            cum += e[v] / total;
            kept += e[v];
            probs[v] = e[v];
            if cum >= top_p {
                if cum - top_p < 1e-5 {
                    return None;
                }
                break;
            }
        }
        probs.iter_mut().for_each(|p| *p /= kept);
        Some(probs)
    }
}

/// Chi-square of `observed` outcomes against `expected` probabilities over `n` draws: outcomes
/// merged in order of probability into bins that expect at least 5, then one last bin of
/// everything else (`rest` draws were of outcomes `expected` does not list); returns
/// (statistic, dof, p-value).
fn chi_square(
    observed: &HashMap<Vec<u32>, usize>,
    expected: &[(Vec<u32>, f64)],
    rest: usize,
    n: usize,
) -> (f64, usize, f64) {
    let mut sorted: Vec<&(Vec<u32>, f64)> = expected.iter().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut bins: Vec<(f64, usize)> = Vec::new();
    let (mut want, mut got) = (0.0, 0);
    for (k, p) in sorted {
        want += p * n as f64;
        got += observed.get(k).copied().unwrap_or(0);
        if want >= 5.0 {
            bins.push((want, got));
            (want, got) = (0.0, 0);
        }
    }
    let listed: f64 = bins.iter().map(|b| b.0).sum::<f64>() + want;
    bins.push((want + (n as f64 - listed).max(0.0), got + rest));
    let stat: f64 = bins
        .iter()
        .filter(|b| b.0 > 0.0)
        .map(|&(w, g)| (g as f64 - w).powi(2) / w)
        .sum();
    let dof = bins.len() - 1;
    let p = 1.0 - ChiSquared::new(dof as f64).unwrap().cdf(stat);
    (stat, dof, p)
}

/// Tests the joint distribution of each request's first `len` tokens against `target`. The
/// outcomes listed are the continuations of every prefix the target expects at least once in
/// `draws.len()` and can call (chosen from the target alone, not from the draws); the rest is
/// one bin.
fn assert_follows_the_target(what: &str, draws: &[[u32; 3]], len: usize, target: &mut Target) {
    let n = draws.len() as f64;
    let mut heads: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 1.0)];
    for _ in 1..len {
        let mut next = Vec::new();
        for (head, mass) in heads {
            let Some(probs) = target.probs(&head) else {
                continue;
            };
            for (v, &p) in probs.iter().enumerate() {
                if n * mass * p >= 1.0 {
                    let mut h = head.clone();
                    h.push(v as u32);
                    next.push((h, mass * p));
                }
            }
        }
        heads = next;
    }
    heads.retain(|(head, _)| target.probs(head).is_some());
    let mut expected: Vec<(Vec<u32>, f64)> = Vec::new();
    for (head, mass) in &heads {
        for (v, &p) in target.probs(head).unwrap_or_default().iter().enumerate() {
            if p > 0.0 {
                let mut key = head.clone();
                key.push(v as u32);
                expected.push((key, mass * p));
            }
        }
    }
    let listed: std::collections::HashSet<&[u32]> = heads.iter().map(|h| &h.0[..]).collect();
    let (mut observed, mut rest) = (HashMap::<Vec<u32>, usize>::new(), 0);
    for d in draws {
        let prefix = &d[..len];
        if let Some(probs) = target.probs(&prefix[..len - 1]) {
            let p = probs[prefix[len - 1] as usize];
            assert!(
                p > 0.0,
                "{what}: drew {prefix:?}, outside the top-p nucleus"
            );
        }
        match listed.contains(&prefix[..len - 1]) {
            true => *observed.entry(prefix.to_vec()).or_default() += 1,
            false => rest += 1,
        }
    }
    let (stat, dof, p) = chi_square(&observed, &expected, rest, draws.len());
    eprintln!("{what}: chi-square {stat:.1} on {dof} dof, p = {p:.4}");
    assert!(dof >= 10, "{what}: too few bins ({dof} dof) to tell");
    assert!(
        p > 0.001,
        "{what}: chi-square {stat:.1} on {dof} dof, p = {p:.2e}"
    );
}

/// Tests how often a request's three tokens are one token thrice, against `target`: the
/// event where the third token's penalties must count two tokens before it (both fed in the
/// same verify step when the drafts repeat the last token and the first is accepted). By a
/// binomial z-test at the same 0.001 level, over every first token (those whose law can be
/// called).
fn assert_repeats_as_the_target(what: &str, draws: &[[u32; 3]], target: &mut Target) {
    let n = draws.len() as f64;
    let mut q = 0.0;
    let mut counted = std::collections::HashSet::new();
    let firsts = target.probs(&[]).expect("the first token's law").to_vec();
    for (t, p1) in firsts.into_iter().enumerate().filter(|&(_, p)| p > 0.0) {
        let t = t as u32;
        let Some(p2) = target.probs(&[t]).map(|p| p[t as usize]) else {
            continue;
        };
        let Some(p3) = target.probs(&[t, t]).map(|p| p[t as usize]) else {
            continue;
        };
        q += p1 * p2 * p3;
        counted.insert(t);
    }
    let thrice = draws
        .iter()
        .filter(|d| d[0] == d[1] && d[1] == d[2] && counted.contains(&d[0]))
        .count() as f64;
    let z = (thrice - n * q) / (n * q * (1.0 - q)).sqrt();
    eprintln!("{what}: {thrice} thrice, {:.1} expected, z = {z:.2}", n * q);
    assert!(n * q >= 50.0, "{what}: too few expected ({:.1})", n * q);
    assert!(
        z.abs() < 3.29,
        "{what}: {thrice} thrice, {:.1} expected",
        n * q
    );
}

impl Target {
    /// The target of `case`: its model without drafting.
    fn of(case: &Case) -> Self {
        Target {
            runner: runner(
                &Case {
                    repeat_drafts: false,
                    ..case.clone()
                },
                0,
                1,
            ),
            prompt: case.prompt.clone(),
            sampling: case.sampling,
            cache: HashMap::new(),
        }
    }
}

/// Runs `case` with `k` drafts a step and tests the joint law of its draws' first `lens`
/// tokens against the target; returns them.
fn assert_case(case: &Case, k: usize, lens: &[usize], target: &mut Target) -> Vec<[u32; 3]> {
    let (draws, stats) = generate(case, k, 1, REQUESTS);
    let what = format!("{} on {}, K = {k}", case.fixture, case.backend);
    eprintln!("{what}: {stats:?}");
    if k > 0 {
        // Both branches of the rejection sampler ran, many times.
        let rejected = stats.drafted - stats.accepted;
        assert!(stats.accepted > 100 && rejected > 100, "{what}: {stats:?}");
    }
    for &len in lens {
        assert_follows_the_target(&format!("{what}, first {len} tokens"), &draws, len, target);
    }
    draws
}

#[test]
fn sampled_drafting_keeps_the_targets_distribution() {
    let _heavy = common::cpu_heavy();
    let case = trained_case();
    let mut target = Target::of(&case);
    // Without drafting first: the reference itself is right.
    assert_case(&case, 0, &[2, 3], &mut target);
    let drafted = assert_case(&case, 2, &[2, 3], &mut target);
    // Split over two ranks, each draws from its slice of the vocabulary (`model::vocab`) and
    // every rank the same tokens: those of one rank, request for request.
    let (split, _) = generate(&case, 2, 2, 100);
    assert_eq!(split, drafted[..100], "K = 2 at tp 2");
}

/// Under a negative frequency penalty each repeat of a token makes it likelier, so the law of
/// a third repeat depends on counting both tokens before it; drafts that repeat the last
/// token are accepted often, so such a third token is decided at a verify step's second
/// position, after the first and a draft fed in the same step.
#[test]
fn a_verify_step_counts_the_drafts_before_each_position() {
    let _heavy = common::cpu_heavy();
    let case = Case {
        fixture: "tiny-v3-mtp",
        prompt: (1..13).collect(),
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            seed: 0,
            min_p: 0.0,
            presence_penalty: -2.0,
            frequency_penalty: -2.0,
            repetition_penalty: 1.0,
        },
        repeat_drafts: true,
        backend: Backend::Cpu,
    };
    let mut target = Target::of(&case);
    let sim = Case {
        backend: Backend::Sim,
        ..case.clone()
    };
    for (case, k) in [(&case, 0), (&case, 2), (&sim, 2)] {
        // The random model's law of three tokens is too wide to bin; its repeats are not.
        let draws = assert_case(case, k, &[2], &mut target);
        let what = format!("K = {k} on {}", case.backend);
        assert_repeats_as_the_target(&what, &draws, &mut target);
    }
}

/// On nrt-sim a verify step of sampled rows runs on a decode bucket's `Verify` graph (the
/// rejection sampler over a sequence's positions as rows, `seq_ids` and `last_index` naming
/// its chunks), its drafts on the draft graphs: the same law.
#[test]
fn sampled_drafting_on_nrt_sim_keeps_the_targets_distribution() {
    let _heavy = common::cpu_heavy();
    let case = Case {
        backend: Backend::Sim,
        ..trained_case()
    };
    let mut target = Target::of(&case);
    assert_case(&case, 2, &[2, 3], &mut target);
}

/// Each chunk of a verify step leaves its row of the sampling-state root counting what the
/// sequence keeps: its last token and the drafts accepted (those equal to the step's tokens
/// before them), not the rejected ones, which the penalties of its next step must not see.
/// Checked on the counts themselves, over seeds that accept none, one and both drafts.
#[test]
fn a_verify_step_counts_only_the_tokens_it_keeps() {
    let _heavy = common::cpu_heavy();
    let case = Case {
        repeat_drafts: false,
        ..trained_case()
    };
    let dir = fixture_dir(case.fixture);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights =
        ModelWeights::load(&cfg, &Checkpoint::open(&dir).unwrap(), &Precision::F32).unwrap();
    let vocab = cfg.vocab_size;
    let mut runner = CpuRunner::new(cfg, weights, RunnerConfig::for_limits(8, 64)).unwrap();
    let prompt = &case.prompt;
    let blocks: Vec<u32> = (1..=4).collect();
    let state_row = 3;
    let controls = LogitControls {
        state_row,
        prompt_len: prompt.len(),
        ..LogitControls::NONE
    };
    // The row's generated-token counts, as (token, count) for the tokens counted.
    let counts = |runner: &CpuRunner| -> Vec<(usize, f32)> {
        let (_, root) = runner
            .roots()
            .iter()
            .find(|(name, _)| *name == deepinfer::model::logits::STATE_ROOT)
            .expect("a sampling-state root");
        let row = root
            .get(state_row as usize)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        row[..vocab]
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c != 0.0)
            .map(|(t, &c)| (t, c))
            .collect()
    };
    let mut kept = [0usize; 3];
    for seed in 0..60u32 {
        // No penalty, so that the greedy drafts are likely: the counts are kept all the same.
        let sampling = SamplingParams {
            seed,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            ..case.sampling
        };
        let chunk = PrefillChunk {
            tokens: prompt,
            start: 0,
            blocks: &blocks,
            sampling,
            controls,
        };
        let first = runner
            .prefill(&chunk, LogitsOutput::None)
            .unwrap()
            .next_tokens[0];
        assert_eq!(counts(&runner), [], "a prompt is not generated");
        // The greedy continuation as drafts: the likeliest tokens, often but not always kept.
        let mut fed = vec![first];
        for _ in 0..2 {
            let tokens: Vec<u32> = prompt.iter().chain(&fed).copied().collect();
            let chunk = PrefillChunk {
                tokens: &tokens,
                start: 0,
                blocks: &[5, 6, 7, 8],
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            };
            fed.push(
                runner
                    .prefill(&chunk, LogitsOutput::None)
                    .unwrap()
                    .next_tokens[0],
            );
        }
        let chunk = PrefillChunk {
            tokens: &fed,
            start: prompt.len(),
            blocks: &blocks,
            sampling,
            controls,
        };
        let out = runner
            .replay(&Step::Verify {
                chunks: std::slice::from_ref(&chunk),
                logits: LogitsOutput::None,
            })
            .unwrap()
            .next_tokens;
        let accepted = fed[1..]
            .iter()
            .zip(&out)
            .take_while(|(d, t)| d == t)
            .count();
        kept[accepted] += 1;
        let mut want = vec![0.0f32; vocab];
        for &t in &fed[..=accepted] {
            want[t as usize] += 1.0;
        }
        let want: Vec<(usize, f32)> = want
            .into_iter()
            .enumerate()
            .filter(|&(_, c)| c != 0.0)
            .collect();
        assert_eq!(
            counts(&runner),
            want,
            "seed {seed}: {fed:?} fed, {out:?} out"
        );
    }
    assert!(
        kept.iter().all(|&k| k > 0),
        "accepted none, one, both: {kept:?}"
    );
}
