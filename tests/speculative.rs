//! Speculative decoding with the MTP layer (`engine::speculative`): greedy output with
//! `--speculative-tokens K` is token for token what K = 0 gives, which is transformers' greedy
//! continuation on `fixtures/tiny-v3-mtp` (tiny-v3's main model, whose `reference.json` holds
//! it, plus a random MTP layer). The random layer's drafts are all rejected, so the rollback
//! runs at every step; an oracle in front of the runner (the MTP layer still runs, its
//! proposals replaced by the known answer, wrong at every third position) makes the engine
//! accept one, several, or none of a row's drafts.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{drafting_runner, drafting_runner_on, fixture_dir, Intercept};
use deepinfer::engine::grammar::{GrammarCompiler, ResponseFormat};
use deepinfer::engine::speculative::SpeculativeStats;
use deepinfer::engine::{Event, GenerationParams, RequestId, Scheduler, TokenLogprobs};
use deepinfer::runner::{Backend, Runner, Step, StepOutput};
use deepinfer::tokenizer::Tokenizer;

const FIXTURE: &str = "tiny-v3-mtp";

/// A runner over the fixture drafting `k` tokens (its MTP layer loaded only when `k > 0`),
/// prompts prefilled `chunk` tokens at a time, batches up to 8.
fn fixture_runner(k: usize, chunk: usize) -> Box<dyn Runner> {
    drafting_runner(FIXTURE, k, 1, (8, 96), chunk)
}

fn scheduler(k: usize, chunk: usize) -> Scheduler<Box<dyn Runner>> {
    Scheduler::new(fixture_runner(k, chunk), None, Vec::new()).unwrap()
}

/// `inner` with its MTP layer's proposals replaced by each sequence's known next tokens (`truth`:
/// every request's prompt and greedy answer), except at positions divisible by 3, where it
/// proposes a wrong one. It tells the sequences apart by their first cache block (prefix
/// caching off), bound when their first chunk is prefilled.
fn oracle(
    inner: Box<dyn Runner>,
    truth: Vec<Vec<u32>>,
) -> Intercept<impl FnMut(&Step<'_>, &mut StepOutput)> {
    // First cache block -> index into `truth`.
    let mut owner: HashMap<u32, usize> = HashMap::new();
    let hook = move |step: &Step<'_>, out: &mut StepOutput| match step {
        Step::Prefill { chunks, .. } => {
            for c in chunks.iter().filter(|c| c.start == 0) {
                let r = truth.iter().position(|t| t.starts_with(c.tokens));
                owner.insert(c.blocks[0], r.expect("a known prompt"));
            }
        }
        Step::Draft { chunks, .. } => {
            for (c, token) in chunks.iter().zip(out.next_tokens.iter_mut()) {
                // The last row at q drafts from the token at q + 1: a guess at q + 2.
                let position = c.start + c.next_tokens.len() + 1;
                let known = owner
                    .get(&c.blocks[0])
                    .and_then(|&r| truth[r].get(position));
                *token = match known {
                    Some(&t) if position.is_multiple_of(3) => (t + 1) % 512,
                    Some(&t) => t,
                    None => *token,
                };
            }
        }
        _ => {}
    };
    Intercept { inner, hook }
}

/// Runs `prompts` (each with its own `max_tokens`) together, added one iteration apart, to the
/// end; every request's tokens, and what speculation did.
fn run<R: Runner>(
    s: &mut Scheduler<R>,
    prompts: &[(Vec<u32>, usize)],
) -> (Vec<Vec<u32>>, SpeculativeStats) {
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut pending = prompts.iter().enumerate();
    for _ in 0..10_000 {
        if let Some((id, (prompt, max_tokens))) = pending.next() {
            let params = GenerationParams::greedy(*max_tokens);
            s.add(id as RequestId, prompt.clone(), params).unwrap();
        } else if s.is_idle() {
            let out = (0..prompts.len())
                .map(|id| tokens.remove(&(id as RequestId)).unwrap_or_default())
                .collect();
            return (out, s.speculative_stats());
        }
        for o in s.step() {
            match o.event {
                Event::Token(t) => tokens.entry(o.id).or_default().push(t.token),
                Event::Failed { message, .. } => panic!("request {}: {message}", o.id),
                _ => {}
            }
        }
    }
    panic!("the scheduler did not finish");
}

/// Prompts of different lengths (and first tokens) cut from the fixture's reference prompt
/// and its continuation.
fn prompts() -> Vec<(Vec<u32>, usize)> {
    let r = common::reference("tiny-v3");
    let mut all = r.greedy.prompt_token_ids.clone();
    all.extend(&r.greedy.generated_token_ids);
    [
        (0, 16, 12),
        (1, 5, 20),
        (2, 11, 7),
        (3, 3, 25),
        (4, 12, 1),
        (5, 9, 16),
    ]
    .into_iter()
    .map(|(from, len, max_tokens)| (all[from..from + len].to_vec(), max_tokens))
    .collect()
}

/// Each prompt followed by its answer: what the oracle proposes from.
fn whole_sequences(prompts: &[(Vec<u32>, usize)], answers: &[Vec<u32>]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .zip(answers)
        .map(|((p, _), a)| p.iter().chain(a).copied().collect())
        .collect()
}

#[test]
fn one_sequence_drafting_gives_transformers_greedy_tokens() {
    let r = common::reference("tiny-v3");
    let want = r.greedy.generated_token_ids.clone();
    let prompt = vec![(r.greedy.prompt_token_ids.clone(), want.len())];
    for (k, chunk) in [(1, 64), (2, 5), (3, 16)] {
        let (got, stats) = run(&mut scheduler(k, chunk), &prompt);
        assert_eq!(got[0], want, "K = {k}, chunk {chunk}");
        assert!(stats.verify_steps > 0, "K = {k}: {stats:?}");
        assert!(stats.drafted > 0, "K = {k}: {stats:?}");
    }
}

#[test]
fn batches_drafting_give_what_each_gives_without_drafting() {
    let prompts = prompts();
    let (want, none) = run(&mut scheduler(0, 4), &prompts);
    assert_eq!(none, SpeculativeStats::default());
    for (k, chunk) in [(1, 4), (2, 7), (4, 64)] {
        let (got, stats) = run(&mut scheduler(k, chunk), &prompts);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "K = {k}, chunk {chunk}, request {i}");
        }
        // The random layer's drafts: every one rolled back.
        assert!(stats.drafted > 0, "K = {k}: {stats:?}");
    }
}

#[test]
fn accepted_drafts_give_what_each_gives_without_drafting() {
    let prompts = prompts();
    let (want, _) = run(&mut scheduler(0, 4), &prompts);
    let truth = whole_sequences(&prompts, &want);
    for (k, chunk) in [(1, 4), (2, 7), (4, 64)] {
        let oracle = oracle(fixture_runner(k, chunk), truth.clone());
        let mut s = Scheduler::new(oracle, None, Vec::new()).unwrap();
        s.set_prefix_caching(false).unwrap();
        let (got, stats) = run(&mut s, &prompts);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "K = {k}, chunk {chunk}, request {i}");
        }
        // Two of every three drafts are right, so rows keep several drafts a step.
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "K = {k}: {stats:?}"
        );
        assert!(stats.tokens_per_row_step() > 1.3, "K = {k}: {stats:?}");
        assert_eq!(s.blocks_in_use(), 0, "K = {k}: blocks leaked");
    }
}

/// Split over two ranks: the MTP layer's heads, experts and vocabulary (its drafts' argmax
/// across the ranks' slices) go through the same collectives as the main model's.
#[test]
fn drafting_at_tp_2_gives_what_one_rank_gives_without_drafting() {
    let prompts = prompts();
    let (want, _) = run(&mut scheduler(0, 4), &prompts);
    for k in [1, 3] {
        let runner = drafting_runner(FIXTURE, k, 2, (8, 96), 4);
        let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
        let (got, stats) = run(&mut s, &prompts);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "tp 2, K = {k}, request {i}");
        }
        assert!(stats.drafted > 0, "tp 2, K = {k}: {stats:?}");
    }
}

/// On nrt-sim (the device runner over libnrt's API): verify steps run on the decode buckets'
/// graphs, a sequence's positions as rows, and drafts on the draft graphs, both more than the
/// largest batch (8 rows) holds split into several graphs; every draft rolled back (the random
/// layer), or two in three accepted (the oracle). Greedy tokens are those without drafting.
#[test]
fn drafting_on_nrt_sim_gives_what_each_gives_without_drafting() {
    let prompts = prompts();
    let (want, _) = run(&mut scheduler(0, 4), &prompts);
    let truth = whole_sequences(&prompts, &want);
    for (k, chunk, tp) in [(1, 16, 1), (2, 4, 1), (2, 16, 2)] {
        let sim = || drafting_runner_on(Backend::Sim, FIXTURE, k, tp, (8, 96), chunk);
        let (got, stats) = run(
            &mut Scheduler::new(sim(), None, Vec::new()).unwrap(),
            &prompts,
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g, w,
                "nrt-sim, K = {k}, chunk {chunk}, tp {tp}, request {i}"
            );
        }
        assert!(stats.drafted > 0, "nrt-sim, K = {k}: {stats:?}");
        let mut s = Scheduler::new(oracle(sim(), truth.clone()), None, Vec::new()).unwrap();
        s.set_prefix_caching(false).unwrap();
        let (got, stats) = run(&mut s, &prompts);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g, w,
                "nrt-sim oracle, K = {k}, chunk {chunk}, tp {tp}, request {i}"
            );
        }
        assert!(
            stats.accepted > 0 && stats.tokens_per_row_step() > 1.2,
            "nrt-sim oracle, K = {k}: {stats:?}"
        );
        assert_eq!(s.blocks_in_use(), 0, "nrt-sim, K = {k}: blocks leaked");
    }
}

/// Every request's tokens and their log-probabilities (of the chosen token and the top 3).
fn run_logprobs<R: Runner>(
    s: &mut Scheduler<R>,
    prompts: &[(Vec<u32>, usize)],
) -> Vec<Vec<TokenLogprobs>> {
    for (id, (prompt, max_tokens)) in prompts.iter().enumerate() {
        let mut params = GenerationParams::greedy(*max_tokens);
        params.logprobs = Some(3);
        s.add(id as RequestId, prompt.clone(), params).unwrap();
    }
    let mut out: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); prompts.len()];
    while !s.is_idle() {
        for o in s.step() {
            match o.event {
                Event::Token(t) => out[o.id as usize].push(t.logprobs.expect("logprobs asked for")),
                Event::Failed { message, .. } => panic!("request {}: {message}", o.id),
                _ => {}
            }
        }
    }
    out
}

/// Rows that report log-probabilities verify drafts too: each token's log-probabilities come
/// from its own position of the verify step, and equal the plain path's (whose logits are held
/// to transformers' elsewhere) within 1e-4, accepted drafts and rejected ones alike.
#[test]
fn drafting_rows_report_the_log_probabilities_of_each_position() {
    let prompts = prompts();
    let want = run_logprobs(&mut scheduler(0, 4), &prompts);
    let (tokens, _) = run(&mut scheduler(0, 4), &prompts);
    let truth = whole_sequences(&prompts, &tokens);
    let mut s = Scheduler::new(oracle(fixture_runner(2, 4), truth), None, Vec::new()).unwrap();
    s.set_prefix_caching(false).unwrap();
    let got = run_logprobs(&mut s, &prompts);
    let stats = s.speculative_stats();
    assert!(
        stats.accepted > 0 && stats.accepted < stats.drafted,
        "{stats:?}"
    );
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "request {r}");
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            let close = |a: f32, b: f32| a.is_finite() && (a - b).abs() < 1e-4;
            assert!(
                close(g.logprob, w.logprob),
                "request {r}, token {i}: {g:?} vs {w:?}"
            );
            assert_eq!(g.top.len(), 3);
            for (a, b) in g.top.iter().zip(&w.top) {
                assert!(
                    a.0 == b.0 && close(a.1, b.1),
                    "request {r}, token {i}: {g:?} vs {w:?}"
                );
            }
        }
    }
}

/// Rows under a JSON schema verify drafts too, each position masked by the grammar's state
/// after the drafts before it: greedy, their tokens are those without drafting, every answer a
/// document of the schema; and drafts the grammar forbids are never fed.
#[test]
fn constrained_rows_draft_under_their_grammar() {
    let dir = fixture_dir("default-model");
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let eos: Vec<u32> = tok.eos_token_id().into_iter().collect();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    let schema = r#"{"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["calm", "angry", "sad"]}},
      "required": ["name", "age", "mood"], "additionalProperties": false}"#;
    let format = ResponseFormat::from_openai(&serde_json::json!({
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": serde_json::from_str::<serde_json::Value>(schema).unwrap()}
    }))
    .unwrap();
    let prompts = [
        "ROMEO:",
        "JULIET:\nO",
        "KING HENRY:\nOnce more",
        "HAMLET:\nTo be",
    ];
    let answers = |k: usize| -> (Vec<(Vec<u32>, String)>, SpeculativeStats) {
        let mut s = Scheduler::new(
            drafting_runner("default-model", k, 1, (8, 256), 64),
            Some(tok.clone()),
            eos.clone(),
        )
        .unwrap();
        for (i, text) in prompts.iter().enumerate() {
            let prompt = tok.encode(text, true).unwrap();
            let constraint = compiler.matcher(&format).unwrap();
            s.add_constrained(
                i as RequestId,
                prompt,
                GenerationParams::greedy(120),
                constraint,
            )
            .unwrap();
        }
        let mut out = vec![(Vec::new(), String::new()); prompts.len()];
        while !s.is_idle() {
            for o in s.step() {
                match o.event {
                    Event::Token(t) => {
                        out[o.id as usize].0.push(t.token);
                        out[o.id as usize].1.push_str(&t.text);
                    }
                    Event::Failed { message, .. } => panic!("request {}: {message}", o.id),
                    _ => {}
                }
            }
        }
        (out, s.speculative_stats())
    };
    let (want, _) = answers(0);
    let (got, stats) = answers(2);
    assert!(
        stats.accepted > 0 && stats.accepted < stats.drafted,
        "{stats:?}"
    );
    for (i, ((g, text), (w, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}");
        let doc: serde_json::Value = serde_json::from_str(text.trim_end())
            .unwrap_or_else(|e| panic!("request {i}: {text:?} is not JSON: {e}"));
        assert!(
            doc["name"]
                .as_str()
                .is_some_and(|n| n.chars().count() <= 12),
            "{doc}"
        );
        assert!(doc["age"].as_u64().is_some_and(|a| a <= 120), "{doc}");
        assert!(
            ["calm", "angry", "sad"].contains(&doc["mood"].as_str().unwrap_or("")),
            "{doc}"
        );
    }
}
