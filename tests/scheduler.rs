//! The continuous-batching scheduler: batched, chunked and preempted sequences produce exactly
//! the tokens transformers' greedy decoding does; stop conditions, cancellation and a device
//! fault affect only the sequences they concern.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::fixture_dir;
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Buckets, RunnerConfig};
use deepinfer::engine::{
    self, Event, FinishReason, GenerationParams, Output, RequestId, Scheduler, StopConditions,
};
use deepinfer::model::{ModelWeights, Precision};
use deepinfer::runner::step::SamplingParams;
use deepinfer::runner::{self, Backend, Runner, Step, StepOutput};
use deepinfer::tokenizer::Tokenizer;
use deepinfer::weights::Checkpoint;

/// What one request produced.
#[derive(Debug, Default, Clone, PartialEq)]
struct Result {
    tokens: Vec<u32>,
    text: String,
    finish: Option<FinishReason>,
    failed: Option<String>,
}

fn collect(outputs: Vec<Output>, results: &mut HashMap<RequestId, Result>) {
    for o in outputs {
        let r = results.entry(o.id).or_default();
        assert!(
            r.finish.is_none() && r.failed.is_none(),
            "event after the end: {o:?}"
        );
        match o.event {
            Event::Token(t) => {
                r.tokens.push(t.token);
                r.text.push_str(&t.text);
                r.finish = t.finish;
            }
            Event::Finished(f) => r.finish = Some(f),
            Event::PromptLogprobs { .. } => {}
            Event::Failed { message, .. } => r.failed = Some(message),
        }
    }
}

fn run_to_end<R: Runner>(s: &mut Scheduler<R>, results: &mut HashMap<RequestId, Result>) {
    for _ in 0..10_000 {
        if s.is_idle() {
            return;
        }
        collect(s.step(), results);
    }
    panic!("the scheduler did not finish");
}

fn load(name: &str) -> (ModelConfig, ModelWeights) {
    let dir = fixture_dir(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights =
        ModelWeights::load(&cfg, &Checkpoint::open(&dir).unwrap(), &Precision::F32).unwrap();
    (cfg, weights)
}

/// Prompts prefilled 3 tokens at a time, batches up to 8.
fn tiny_config() -> RunnerConfig {
    let mut rc = RunnerConfig::for_limits(8, 64);
    rc.buckets.prefill_chunk = 3;
    rc
}

fn greedy(max_tokens: usize) -> GenerationParams {
    GenerationParams::greedy(max_tokens)
}

/// Sampling at temperature 0.9 with top-k 40 and top-p 0.95, seeded.
fn sampled(seed: u32, max_tokens: usize) -> GenerationParams {
    GenerationParams {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed,
            ..SamplingParams::GREEDY
        },
        ..greedy(max_tokens)
    }
}

/// Adds six copies of fixture `name`'s greedy prompt at staggered times and checks every one
/// continues exactly as transformers did.
fn six_staggered_copies_match_transformers(name: &str, rc: RunnerConfig) -> u64 {
    six_staggered_copies(name, rc, true).0
}

/// [`six_staggered_copies_match_transformers`] with prefix caching on or off; returns the
/// preemptions and the prompt tokens found in the prefix cache.
fn six_staggered_copies(name: &str, rc: RunnerConfig, caching: bool) -> (u64, u64) {
    let reference = common::reference(name).greedy;
    let (cfg, weights) = load(name);
    let runner = runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap();
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    s.set_prefix_caching(caching).unwrap();
    let n = reference.generated_token_ids.len();
    let mut results = HashMap::new();
    for id in 0..6u64 {
        s.add(id, reference.prompt_token_ids.clone(), greedy(n))
            .unwrap();
        // Later arrivals join while the earlier ones are mid-prefill or decoding.
        for _ in 0..id {
            collect(s.step(), &mut results);
        }
    }
    run_to_end(&mut s, &mut results);
    for id in 0..6u64 {
        let r = &results[&id];
        assert_eq!(
            r.tokens, reference.generated_token_ids,
            "{name} request {id}"
        );
        assert_eq!(r.finish, Some(FinishReason::Length), "{name} request {id}");
    }
    assert_eq!(s.blocks_in_use(), 0);
    (s.preemptions(), s.prefix_cache_stats().hits)
}

/// tiny-v3, and tiny-v32 whose sparse attention keeps a second cache root (its index keys must
/// follow their sequences through chunking, batching and preemption just as the latents do).
const SCHEDULED_FIXTURES: [&str; 2] = ["tiny-v3", "tiny-v32"];

#[test]
fn batched_and_chunked_sequences_match_transformers_greedy() {
    for name in SCHEDULED_FIXTURES {
        let preemptions = six_staggered_copies_match_transformers(name, tiny_config());
        assert_eq!(preemptions, 0);
    }
}

#[test]
fn preempted_sequences_are_recomputed_to_the_same_tokens() {
    for name in SCHEDULED_FIXTURES {
        // 8 + 24 tokens need 2 blocks of 16 each; 7 usable blocks cannot hold all six.
        let mut rc = tiny_config();
        rc.num_blocks = 8;
        let preemptions = six_staggered_copies_match_transformers(name, rc);
        assert!(
            preemptions > 0,
            "{name}: the cache was large enough: nothing tested"
        );
    }
}

/// Blocks of 4 tokens: the 8-token greedy prompt fills two, so later copies reuse the first
/// (the last token's block is always computed) and, once preempted, their generated blocks too.
fn small_blocks(num_blocks: usize) -> RunnerConfig {
    let mut rc = tiny_config();
    rc.block_size = 4;
    rc.num_blocks = num_blocks;
    rc
}

#[test]
fn prefix_cached_sequences_match_transformers_and_share_blocks() {
    for name in SCHEDULED_FIXTURES {
        let (preemptions, hits) = six_staggered_copies(name, small_blocks(64), true);
        assert_eq!(preemptions, 0);
        // The copies admitted after the first's first block was written reuse it.
        assert!(hits >= 4, "{name}: {hits} tokens from the cache");
        // Without caching, the same tokens and no hits.
        assert_eq!(six_staggered_copies(name, small_blocks(64), false), (0, 0));
        // A cache too small for the six: preempted sequences come back through the cache.
        let (preemptions, hits) = six_staggered_copies(name, small_blocks(20), true);
        assert!(preemptions > 0 && hits > 0, "{name}: {preemptions} {hits}");
    }
}

#[test]
fn two_concurrent_requests_share_prefix_blocks_and_free_them_once() {
    let (runner, tok, _) = default_model(4);
    let mut s = Scheduler::new(runner, Some(tok.clone()), Vec::new()).unwrap();
    let prompt = tok
        .encode("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet \
             is the sun. Arise, fair sun, and kill the envious moon, who is already sick and \
             pale with grief.", true)
        .unwrap();
    let bs = 16;
    assert!(prompt.len() > 2 * bs, "{}", prompt.len());
    let shared = (prompt.len() - 1) / bs;
    let mut results = HashMap::new();
    // The first request fills the cache; then two at once reuse its full prompt blocks.
    s.add(0, prompt.clone(), greedy(4)).unwrap();
    run_to_end(&mut s, &mut results);
    assert_eq!(s.blocks_in_use(), 0);
    s.add(1, prompt.clone(), greedy(4)).unwrap();
    s.add(2, prompt.clone(), greedy(4)).unwrap();
    collect(s.step(), &mut results);
    let (a, b) = (s.block_table(1).unwrap(), s.block_table(2).unwrap());
    assert_eq!(a[..shared], b[..shared]);
    assert_ne!(a[shared..], b[shared..]);
    for &blk in &a[..shared] {
        assert_eq!(s.block_refs(blk), 2);
    }
    let stats = s.prefix_cache_stats();
    assert_eq!(stats.queries, 3 * prompt.len() as u64);
    assert_eq!(stats.hits, 2 * (shared * bs) as u64);
    // One is cancelled, one finishes: every block is released exactly once.
    let kept: Vec<u32> = a[..shared].to_vec();
    assert!(s.cancel(1));
    for &blk in &kept {
        assert_eq!(s.block_refs(blk), 1);
    }
    run_to_end(&mut s, &mut results);
    for &blk in &kept {
        assert_eq!(s.block_refs(blk), 0);
    }
    assert_eq!(s.blocks_in_use(), 0);
    assert_eq!(results[&2].tokens, results[&0].tokens);
}

fn default_model(max_batch: usize) -> (Box<dyn Runner>, Arc<Tokenizer>, Vec<u32>) {
    let dir = fixture_dir("default-model");
    let (cfg, weights) = load("default-model");
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let eos: Vec<u32> = tok.eos_token_id().into_iter().collect();
    let runner = runner::open_with_weights(
        Backend::Cpu,
        cfg,
        weights,
        RunnerConfig::for_limits(max_batch, 256),
    )
    .unwrap();
    (runner, tok, eos)
}

const PROMPTS: &[&str] = &[
    "ROMEO:",
    "JULIET:\nO",
    "KING HENRY:\nOnce more",
    "First Citizen:\nBefore we proceed",
    "HAMLET:\nTo be",
    "LADY MACBETH:",
    "Enter a Messenger",
    "MERCUTIO:\nNay",
];

#[test]
fn distinct_prompts_batched_give_what_each_gives_alone() {
    let (mut alone, tok, _) = default_model(1);
    let (runner, _, _) = default_model(8);
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tok.encode(p, true).unwrap())
        .collect();
    let stop = StopConditions {
        max_tokens: 12,
        stop_token_ids: Vec::new(),
    };
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine::generate(&mut alone, p, SamplingParams::GREEDY, &stop).unwrap())
        .collect();
    let mut s = Scheduler::new(runner, Some(tok.clone()), Vec::new()).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        s.add(i as u64, p.clone(), greedy(12)).unwrap();
    }
    let mut results = HashMap::new();
    run_to_end(&mut s, &mut results);
    for (i, w) in want.iter().enumerate() {
        let r = &results[&(i as u64)];
        assert_eq!(&r.tokens, w, "prompt {:?}", PROMPTS[i]);
        // The streamed pieces add up to the tokenizer's decode of the whole.
        assert_eq!(
            r.text,
            tok.decode(w, true).unwrap(),
            "prompt {:?}",
            PROMPTS[i]
        );
    }
}

#[test]
fn sampled_sequences_are_reproducible_per_seed_whatever_the_batch() {
    let (alone, tok, _) = default_model(1);
    let (runner, _, _) = default_model(8);
    let params = |seed| sampled(seed, 16);
    let prompt = tok.encode("ROMEO:", true).unwrap();
    let mut one = Scheduler::new(alone, None, Vec::new()).unwrap();
    one.add(0, prompt.clone(), params(7)).unwrap();
    let mut solo = HashMap::new();
    run_to_end(&mut one, &mut solo);
    let mut many = Scheduler::new(runner, None, Vec::new()).unwrap();
    for id in 0..4 {
        many.add(id, prompt.clone(), params(7 + id as u32)).unwrap();
    }
    let mut batched = HashMap::new();
    run_to_end(&mut many, &mut batched);
    assert_eq!(batched[&0].tokens, solo[&0].tokens);
    assert_ne!(
        batched[&0].tokens, batched[&1].tokens,
        "seeds 7 and 8 drew alike"
    );
}

/// Seeded sampling draws the same tokens whether a shared prefix comes from the prefix cache
/// or is prefilled again (and the cache is really used).
#[test]
fn seeded_sampling_is_the_same_with_and_without_prefix_caching() {
    let (_, tok, _) = default_model(1);
    let system = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and \
                  Juliet is the sun. Arise, fair sun, and kill the envious moon.\n";
    let params = |seed| sampled(seed, 12);
    let run = |caching: bool| {
        let (runner, _, _) = default_model(4);
        let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
        s.set_prefix_caching(caching).unwrap();
        let mut results = HashMap::new();
        for (id, q) in ["JULIET:", "NURSE:", "ROMEO:", "JULIET:\nAy"]
            .iter()
            .enumerate()
        {
            let prompt = tok.encode(&format!("{system}{q}"), true).unwrap();
            s.add(id as u64, prompt, params(11 + id as u32)).unwrap();
            // Each arrives once the one before is under way, so its prefix is cached.
            for _ in 0..3 {
                collect(s.step(), &mut results);
            }
        }
        run_to_end(&mut s, &mut results);
        let tokens: Vec<Vec<u32>> = (0..4).map(|id| results[&id].tokens.clone()).collect();
        (tokens, s.prefix_cache_stats().hits)
    };
    let (cached, hits) = run(true);
    let (fresh, no_hits) = run(false);
    assert!(hits >= 3 * 16, "{hits}");
    assert_eq!(no_hits, 0);
    assert_eq!(cached, fresh);
}

#[test]
fn stop_strings_stop_tokens_eos_and_max_tokens() {
    let (runner, tok, eos) = default_model(4);
    let prompt = tok.encode("ROMEO:", true).unwrap();
    let mut s = Scheduler::new(runner, Some(tok.clone()), eos.clone()).unwrap();
    s.add(0, prompt.clone(), greedy(20)).unwrap();
    let mut base = HashMap::new();
    run_to_end(&mut s, &mut base);
    let base = base.remove(&0).unwrap();
    assert_eq!(base.tokens.len(), 20);
    assert_eq!(base.finish, Some(FinishReason::Length));
    assert_eq!(base.text, tok.decode(&base.tokens, true).unwrap());

    // A stop string taken from the middle of the text: the text ends right before it.
    let at = base.text.len() / 2;
    let at = (at..).find(|&i| base.text.is_char_boundary(i)).unwrap();
    let stop: String = base.text[at..].chars().take(3).collect();
    let cut = base.text.find(&stop).unwrap();
    // A stop token: the 6th generated one (its text is not shown, it is counted).
    let stop_token = base.tokens[5];
    let first_stop = base.tokens.iter().position(|&t| t == stop_token).unwrap();
    s.add(
        1,
        prompt.clone(),
        GenerationParams {
            stop: vec![stop.clone()],
            ..greedy(20)
        },
    )
    .unwrap();
    s.add(
        2,
        prompt.clone(),
        GenerationParams {
            stop_token_ids: vec![stop_token],
            ..greedy(20)
        },
    )
    .unwrap();
    // The eos token as a stop token: it never appears, so length wins.
    s.add(3, prompt.clone(), greedy(7)).unwrap();
    let mut r = HashMap::new();
    run_to_end(&mut s, &mut r);
    assert_eq!(r[&1].text, base.text[..cut]);
    assert_eq!(r[&1].finish, Some(FinishReason::Stop));
    assert_eq!(r[&2].tokens, base.tokens[..=first_stop]);
    assert_eq!(
        r[&2].text,
        tok.decode(&base.tokens[..first_stop], true).unwrap()
    );
    assert_eq!(r[&2].finish, Some(FinishReason::Stop));
    assert_eq!(r[&3].tokens, base.tokens[..7]);
    assert_eq!(r[&3].finish, Some(FinishReason::Length));
    assert_eq!(s.blocks_in_use(), 0);
}

#[test]
fn eos_ends_a_sequence_unless_ignored() {
    let (runner, tok, _) = default_model(2);
    let prompt = tok.encode("ROMEO:", true).unwrap();
    // Declare the 3rd greedy token an end-of-sequence token.
    let mut probe = Scheduler::new(runner, None, Vec::new()).unwrap();
    probe.add(0, prompt.clone(), greedy(5)).unwrap();
    let mut base = HashMap::new();
    run_to_end(&mut probe, &mut base);
    let eos = base[&0].tokens[2];
    let first = base[&0].tokens.iter().position(|&t| t == eos).unwrap();
    let (runner, _, _) = default_model(2);
    let mut s = Scheduler::new(runner, None, vec![eos]).unwrap();
    s.add(0, prompt.clone(), greedy(5)).unwrap();
    s.add(
        1,
        prompt,
        GenerationParams {
            ignore_eos: true,
            ..greedy(5)
        },
    )
    .unwrap();
    let mut r = HashMap::new();
    run_to_end(&mut s, &mut r);
    assert_eq!(r[&0].tokens, base[&0].tokens[..=first]);
    assert_eq!(r[&0].finish, Some(FinishReason::Stop));
    assert_eq!(r[&1].tokens, base[&0].tokens);
    assert_eq!(r[&1].finish, Some(FinishReason::Length));
}

#[test]
fn cancelling_frees_blocks_at_once_and_the_rest_finish() {
    let (runner, tok, _) = default_model(4);
    let prompt = tok.encode("ROMEO:", true).unwrap();
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    for id in 0..3 {
        s.add(id, prompt.clone(), greedy(40)).unwrap();
    }
    let mut r = HashMap::new();
    for _ in 0..6 {
        collect(s.step(), &mut r);
    }
    assert_eq!(s.num_running(), 3);
    let before = s.blocks_in_use();
    assert!(s.cancel(1));
    assert!(s.blocks_in_use() < before);
    assert!(!s.cancel(1), "cancelled twice");
    run_to_end(&mut s, &mut r);
    assert_eq!(r[&0].tokens.len(), 40);
    assert_eq!(r[&2].tokens, r[&0].tokens);
    assert!(r[&1].tokens.len() < 40 && r[&1].finish.is_none());
    assert_eq!(s.blocks_in_use(), 0);
}

#[test]
fn requests_beyond_the_context_or_vocabulary_are_refused() {
    let (runner, _, _) = default_model(1);
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    let err = s.add(0, vec![5; 250], greedy(10)).unwrap_err();
    assert!(err.to_string().contains("context is 256 tokens"), "{err}");
    let err = s.add(0, vec![4096], greedy(1)).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert!(s.add(0, Vec::new(), greedy(1)).is_err());
    assert!(s.add(0, vec![5], greedy(0)).is_err());
    assert!(s.is_idle());
}

// === A device fault, in a child process (nrt-sim reads its fault variables at init) ===

#[test]
fn a_device_fault_fails_only_the_requests_in_that_step() {
    nrt_sim::run_test_in_child("child_device_fault", &[(nrt_sim::ENV_FAIL_EXECUTE, "4")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_device_fault() {
    if !nrt_sim::is_fault_child() {
        // Run directly (`--ignored`): do the parent's job rather than pass doing nothing.
        return a_device_fault_fails_only_the_requests_in_that_step();
    }
    let reference = common::reference("tiny-v3").greedy;
    let (cfg, weights) = load("tiny-v3");
    let mut rc = RunnerConfig::for_limits(4, 64);
    rc.buckets.ctx = vec![64];
    let runner = runner::open_with_weights(Backend::Sim, cfg, weights, rc).unwrap();
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    for id in 0..4 {
        s.add(id, reference.prompt_token_ids.clone(), greedy(5))
            .unwrap();
    }
    // Executions: 1 prefill A; 2 decode [A], 3 prefill B; 4 decode [A, B] (fails);
    // then C and D go on alone.
    let mut r = HashMap::new();
    run_to_end(&mut s, &mut r);
    for id in [0, 1] {
        let m = r[&id].failed.as_deref().expect("A and B fail");
        assert!(m.contains("NRT_EXEC_COMPLETED_WITH_ERR"), "{m}");
    }
    for id in [2, 3] {
        assert_eq!(r[&id].failed, None);
        assert_eq!(r[&id].tokens, reference.generated_token_ids[..5]);
    }
    assert_eq!(s.blocks_in_use(), 0);
}

#[test]
fn a_request_larger_than_the_whole_cache_is_refused_not_queued_forever() {
    let (cfg, weights) = load("tiny-v3");
    let mut rc = tiny_config();
    rc.num_blocks = 3; // two usable blocks of 16: 32 tokens
    let runner = runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap();
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    let err = s.add(0, vec![5; 8], greedy(30)).unwrap_err();
    assert!(err.to_string().contains("KV-cache blocks"), "{err}");
    s.add(1, vec![5; 8], greedy(24)).unwrap();
    let mut r = HashMap::new();
    run_to_end(&mut s, &mut r);
    assert_eq!(r[&1].tokens.len(), 24);
}

#[test]
fn logprobs_match_the_log_softmax_of_the_prefill_path() {
    let (runner, tok, _) = default_model(4);
    let (mut scorer, _, _) = default_model(1);
    let prompts: Vec<Vec<u32>> = PROMPTS[..3]
        .iter()
        .map(|p| tok.encode(p, true).unwrap())
        .collect();
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let params = GenerationParams {
            logprobs: Some(4),
            ..greedy(6)
        };
        s.add(i as u64, p.clone(), params).unwrap();
    }
    // One more without logprobs shares the decode steps.
    s.add(9, prompts[0].clone(), greedy(6)).unwrap();
    let mut events: HashMap<RequestId, Vec<deepinfer::engine::TokenEvent>> = HashMap::new();
    for _ in 0..1000 {
        if s.is_idle() {
            break;
        }
        for o in s.step() {
            if let Event::Token(t) = o.event {
                events.entry(o.id).or_default().push(t);
            }
        }
    }
    assert!(events[&9].iter().all(|t| t.logprobs.is_none()));
    for (i, p) in prompts.iter().enumerate() {
        let evs = &events[&(i as u64)];
        let generated: Vec<u32> = evs.iter().map(|t| t.token).collect();
        let all: Vec<u32> = p.iter().chain(&generated).copied().collect();
        let logits = engine::score(&mut scorer, &all).unwrap();
        for (k, t) in evs.iter().enumerate() {
            let row = &logits[p.len() - 1 + k];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
            let lp = t.logprobs.as_ref().expect("asked for logprobs");
            assert!((lp.logprob - (row[t.token as usize] - lse)).abs() < 1e-4);
            assert_eq!(lp.top.len(), 4);
            assert_eq!(lp.top[0].0, t.token, "greedy picks the most likely token");
            let mut sorted = row.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            for (j, &(id, l)) in lp.top.iter().enumerate() {
                assert!((l - (sorted[j] - lse)).abs() < 1e-4);
                assert!((row[id as usize] - sorted[j]).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn prompt_logprobs_cover_every_position_once_across_chunks_and_preemption() {
    let reference = common::reference("tiny-v3");
    let prompt = reference.token_ids.clone(); // 16 tokens: 6 chunks of 3
                                              // transformers' own logits of this sequence: position j-1 predicts token j.
    let want: Vec<f32> = (1..prompt.len())
        .map(|j| {
            let row = &reference.logits[j - 1];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
            row[prompt[j] as usize] - lse
        })
        .collect();
    for blocks in [64, 4] {
        let (cfg, weights) = load("tiny-v3");
        let mut rc = tiny_config();
        rc.num_blocks = blocks; // 4: three usable blocks for four sequences of 16 + 8 tokens
        let runner = runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap();
        let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
        for id in 0..4u64 {
            let params = GenerationParams {
                prompt_logprobs: Some(2),
                // Request 0 only scores; the others generate too and may be preempted.
                ..greedy(if id == 0 { 0 } else { 8 })
            };
            s.add(id, prompt.clone(), params).unwrap();
        }
        let mut got: HashMap<RequestId, Vec<Option<f32>>> = HashMap::new();
        let mut ends: HashMap<RequestId, Event> = HashMap::new();
        for _ in 0..10_000 {
            if s.is_idle() {
                break;
            }
            for o in s.step() {
                match &o.event {
                    Event::PromptLogprobs { start, logprobs } => {
                        let v = got.entry(o.id).or_default();
                        assert_eq!(
                            *start,
                            v.len(),
                            "request {}: positions in order, once",
                            o.id
                        );
                        v.extend(logprobs.iter().map(|l| l.as_ref().map(|l| l.logprob)));
                    }
                    e if e.is_last() => {
                        ends.insert(o.id, e.clone());
                    }
                    _ => {}
                }
            }
        }
        for id in 0..4u64 {
            let v = &got[&id];
            assert_eq!(v.len(), prompt.len(), "request {id}");
            assert_eq!(
                v[1..].len(),
                want.len(),
                "request {id}: positions with a token before"
            );
            assert_eq!(v[0], None);
            for (j, (g, w)) in v[1..].iter().zip(&want).enumerate() {
                let g = g.expect("a log-probability");
                assert!(
                    (g - w).abs() < 1e-4,
                    "request {id} position {}: {g} vs {w}",
                    j + 1
                );
            }
        }
        assert_eq!(ends[&0], Event::Finished(FinishReason::Length));
        assert!(matches!(&ends[&3], Event::Token(t) if t.finish == Some(FinishReason::Length)));
        if blocks == 4 {
            assert!(s.preemptions() > 0, "nothing was preempted");
        }
        assert_eq!(s.blocks_in_use(), 0);
    }
}

/// A CPU runner whose steps can be made to fail, as a device that stopped executing, or hand
/// back an id past the vocabulary (what a device's argmax over a row it could not read
/// returns) for the prefill rows of prompts starting with `poisoned`.
struct Flaky {
    inner: Box<dyn Runner>,
    fail: bool,
    poisoned: Option<u32>,
}

impl Runner for Flaky {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn runner_config(&self) -> &RunnerConfig {
        self.inner.runner_config()
    }
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn capture(&mut self, buckets: &Buckets) -> deepinfer::Result<()> {
        self.inner.capture(buckets)
    }
    fn replay(&mut self, step: &Step<'_>) -> deepinfer::Result<StepOutput> {
        if self.fail {
            return Err(deepinfer::Error::Internal("injected".into()));
        }
        let mut out = self.inner.replay(step)?;
        if let (Some(first), Step::Prefill { chunks, .. }) = (self.poisoned, step) {
            let vocab = self.inner.config().vocab_size as u32;
            for (t, c) in out.next_tokens.iter_mut().zip(chunks.iter()) {
                if c.start == 0 && c.tokens.first() == Some(&first) {
                    *t = vocab + 7;
                }
            }
        }
        Ok(out)
    }
    fn destroy(&mut self) -> deepinfer::Result<()> {
        self.inner.destroy()
    }
}

#[test]
fn consecutive_failed_steps_are_reported_until_a_step_succeeds() {
    let (cfg, weights) = load("tiny-v3");
    let inner = runner::open_with_weights(Backend::Cpu, cfg, weights, tiny_config()).unwrap();
    let flaky = Flaky {
        inner,
        fail: true,
        poisoned: None,
    };
    let mut s = Scheduler::new(flaky, None, Vec::new()).unwrap();
    let mut r = HashMap::new();
    for id in 0..3 {
        s.add(id, vec![5, 6, 7], greedy(2)).unwrap();
        collect(s.step(), &mut r);
    }
    let (n, last) = s.failing().expect("failing");
    assert_eq!(n, 3);
    assert!(last.contains("injected"), "{last}");
    assert!((0..3).all(|id| r[&id].failed.is_some()));
    assert_eq!(s.blocks_in_use(), 0);
    // The device recovers: the next request succeeds and the count resets.
    s.runner_mut().fail = false;
    s.add(9, vec![5, 6, 7], greedy(2)).unwrap();
    run_to_end(&mut s, &mut r);
    assert_eq!(r[&9].tokens.len(), 2);
    assert!(s.failing().is_none());
}

/// A runner that records how many chunks each prefill step packed, and each step's tokens
/// (decode: its rows; prefill: `0` then the chunks' tokens, so a prefill is told apart), and
/// reports decode costs from `cost` when given (else none, as a device runner).
struct Recording<R> {
    inner: R,
    prefill_chunks: Vec<usize>,
    steps: Vec<(bool, usize)>,
    cost: Option<fn(usize) -> Duration>,
}

impl<R: Runner> Runner for Recording<R> {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn runner_config(&self) -> &RunnerConfig {
        self.inner.runner_config()
    }
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn capture(&mut self, buckets: &Buckets) -> deepinfer::Result<()> {
        self.inner.capture(buckets)
    }
    fn replay(&mut self, step: &Step<'_>) -> deepinfer::Result<StepOutput> {
        match step {
            Step::Prefill { chunks, .. } => {
                self.prefill_chunks.push(chunks.len());
                let tokens = chunks.iter().map(|c| c.tokens.len()).sum();
                self.steps.push((true, tokens));
            }
            Step::Decode { rows, .. } => self.steps.push((false, rows.len())),
            Step::Draft { .. } | Step::Verify { .. } => {}
        }
        self.inner.replay(step)
    }
    fn destroy(&mut self) -> deepinfer::Result<()> {
        self.inner.destroy()
    }
    fn decode_cost(&self, rows: usize) -> Option<Duration> {
        self.cost.map(|cost| cost(rows))
    }
}

fn recording_tiny_v3(rc: RunnerConfig) -> Scheduler<Recording<Box<dyn Runner>>> {
    let (cfg, weights) = load("tiny-v3");
    let inner = runner::open_with_weights(Backend::Cpu, cfg, weights, rc).unwrap();
    let runner = Recording {
        inner,
        prefill_chunks: Vec::new(),
        steps: Vec::new(),
        cost: None,
    };
    Scheduler::new(runner, None, Vec::new()).unwrap()
}

/// Six prompts arriving together enter in two packed prefill steps (four sequences fit the
/// context-64 bucket's packing), and every one continues exactly as transformers did.
#[test]
fn a_burst_of_prompts_is_packed_and_matches_transformers_greedy() {
    let reference = common::reference("tiny-v3").greedy;
    // Contexts 64 and 256; 64-token chunks; the context-64 graphs pack four sequences.
    let rc = RunnerConfig::for_limits(8, 256);
    assert_eq!(rc.buckets.packed_seqs(64, 64), 4);
    let mut s = recording_tiny_v3(rc);
    let n = reference.generated_token_ids.len();
    for id in 0..6u64 {
        s.add(id, reference.prompt_token_ids.clone(), greedy(n))
            .unwrap();
    }
    let mut results = HashMap::new();
    run_to_end(&mut s, &mut results);
    for id in 0..6u64 {
        assert_eq!(
            results[&id].tokens, reference.generated_token_ids,
            "request {id}"
        );
    }
    assert_eq!(s.runner().prefill_chunks, [4, 2]);
    assert_eq!(s.blocks_in_use(), 0);
}

/// With four batch slots, eight choices of one request take four; a request arriving after
/// them gets the first slot that frees, before the other four choices.
#[test]
fn a_request_for_more_choices_than_slots_does_not_hold_the_engine() {
    let prompt = common::reference("tiny-v3").greedy.prompt_token_ids;
    let mut s = recording_tiny_v3(RunnerConfig::for_limits(4, 64));
    let choice = |max_tokens| GenerationParams {
        group: Some(1),
        ..greedy(max_tokens)
    };
    for id in 0..8u64 {
        // The first choice ends first and frees its slot.
        s.add(id, prompt.clone(), choice(if id == 0 { 4 } else { 20 }))
            .unwrap();
    }
    s.add(100, prompt.clone(), greedy(4)).unwrap();
    let mut first_token_order = Vec::new();
    while !s.is_idle() {
        for o in s.step() {
            if matches!(o.event, Event::Token(_)) && !first_token_order.contains(&o.id) {
                first_token_order.push(o.id);
            }
        }
    }
    let late = first_token_order.iter().position(|&id| id == 100).unwrap();
    let fifth = first_token_order
        .iter()
        .position(|&id| (4..8).contains(&id))
        .unwrap();
    assert!(
        late < fifth,
        "the later request started after the extra choices: {first_token_order:?}"
    );
}

/// A short prompt added while a long one is prefilling gets its first token within two
/// steps, and the long one still finishes its prefill.
#[test]
fn a_short_prompt_is_not_stuck_behind_a_long_prefill() {
    let ids = common::reference("tiny-v3").greedy.prompt_token_ids;
    let long: Vec<u32> = ids.iter().copied().cycle().take(200).collect();
    let mut rc = RunnerConfig::for_limits(4, 256);
    rc.buckets.prefill_chunk = 16;
    let mut s = recording_tiny_v3(rc);
    s.add(1, long, greedy(2)).unwrap();
    let mut results = HashMap::new();
    collect(s.step(), &mut results);
    collect(s.step(), &mut results);
    s.add(2, ids[..4].to_vec(), greedy(2)).unwrap();
    let mut steps = 0;
    while results.get(&2).is_none_or(|r| r.tokens.is_empty()) {
        collect(s.step(), &mut results);
        steps += 1;
    }
    assert!(steps <= 2, "the short prompt waited {steps} steps");
    assert!(
        results.get(&1).is_none_or(|r| r.tokens.is_empty()),
        "the long prompt was already done: nothing tested"
    );
    run_to_end(&mut s, &mut results);
    assert_eq!(results[&1].tokens.len(), 2);
    assert_eq!(results[&2].tokens.len(), 2);
}

/// With a token budget of 6 and four slots, no iteration feeds more than 6 tokens (decode
/// rows plus prefill tokens), prompts still all finish, and what they generate is unchanged.
#[test]
fn max_num_batched_tokens_bounds_every_iteration() {
    let reference = common::reference("tiny-v3").greedy;
    let n = reference.generated_token_ids.len();
    let mut s = recording_tiny_v3(RunnerConfig::for_limits(4, 64));
    assert!(
        s.set_max_num_batched_tokens(4).is_err(),
        "not above the batch"
    );
    s.set_max_num_batched_tokens(6).unwrap();
    let mut results = HashMap::new();
    for id in 0..4u64 {
        s.add(id, reference.prompt_token_ids.clone(), greedy(n))
            .unwrap();
        collect(s.step(), &mut results);
    }
    run_to_end(&mut s, &mut results);
    for id in 0..4u64 {
        assert_eq!(
            results[&id].tokens, reference.generated_token_ids,
            "request {id}"
        );
    }
    let steps = &s.runner().steps;
    for (i, &(prefill, tokens)) in steps.iter().enumerate() {
        // A prefill right after a decode belongs to the same iteration.
        let decoded = match i.checked_sub(1).map(|j| steps[j]) {
            Some((false, rows)) if prefill => rows,
            _ => 0,
        };
        assert!(tokens + decoded <= 6, "step {i}: {steps:?}");
    }
    assert!(
        steps
            .iter()
            .any(|&(p, t)| p && t < reference.prompt_token_ids.len()),
        "no prompt was cut by the budget: nothing tested ({steps:?})"
    );
}

/// Adds `count` greedy choices of one request (group 1, ids from 0) for `prompt`.
fn add_choices<R: Runner>(s: &mut Scheduler<R>, count: u64, prompt: &[u32], max_tokens: usize) {
    let choice = GenerationParams {
        group: Some(1),
        ..greedy(max_tokens)
    };
    for id in 0..count {
        s.add(id, prompt.to_vec(), choice.clone()).unwrap();
    }
}

/// Eight choices of one request fill all four slots of an idle engine; a request arriving
/// while they decode takes a slot back (one choice is preempted and later recomputed) and
/// starts within a few steps instead of after the first choices finish, and every choice
/// still continues exactly as transformers did.
#[test]
fn a_later_request_takes_a_slot_back_from_one_that_filled_the_engine() {
    let reference = common::reference("tiny-v3").greedy;
    let n = reference.generated_token_ids.len();
    let mut s = recording_tiny_v3(RunnerConfig::for_limits(4, 64));
    add_choices(&mut s, 8, &reference.prompt_token_ids, n);
    let mut results = HashMap::new();
    for _ in 0..3 {
        collect(s.step(), &mut results);
    }
    assert_eq!(s.num_running(), 4);
    s.add(100, reference.prompt_token_ids[..4].to_vec(), greedy(2))
        .unwrap();
    let mut steps = 0;
    while results.get(&100).is_none_or(|r| r.tokens.is_empty()) {
        collect(s.step(), &mut results);
        steps += 1;
    }
    assert!(steps <= 2, "the later request waited {steps} steps");
    assert!(
        results.values().all(|r| r.finish.is_none()),
        "a choice had already finished: nothing tested"
    );
    assert!(s.preemptions() >= 1);
    run_to_end(&mut s, &mut results);
    for id in 0..8u64 {
        assert_eq!(
            results[&id].tokens, reference.generated_token_ids,
            "choice {id}"
        );
    }
    assert_eq!(results[&100].tokens.len(), 2);
}

/// With fair decoding, while a later request runs beside eight choices of one request, no
/// decode step takes more than its equal share (4 of 8 slots) from the choices, they take
/// turns (each one running decodes within every two steps), and every choice still continues
/// exactly as transformers did. Without it, the choices fill the other 7 rows of each step.
#[test]
fn fair_decoding_gives_each_request_an_equal_share_of_a_step() {
    let reference = common::reference("tiny-v3").greedy;
    let n = reference.generated_token_ids.len();
    for fair in [true, false] {
        let mut s = recording_tiny_v3(RunnerConfig::for_limits(8, 64));
        s.set_fair_decode(fair);
        add_choices(&mut s, 8, &reference.prompt_token_ids, n);
        let mut results = HashMap::new();
        // Until a decode step feeds all eight (one prompt enters per step here).
        for _ in 0..16 {
            collect(s.step(), &mut results);
            if s.runner().steps.iter().rev().find(|(p, _)| !p) == Some(&(false, 8)) {
                break;
            }
        }
        let alone = s.runner().steps.len();
        let last_decode = s.runner().steps.iter().rev().find(|(p, _)| !p);
        assert_eq!(last_decode, Some(&(false, 8)), "fair: {fair}");
        s.add(100, reference.prompt_token_ids[..4].to_vec(), greedy(6))
            .unwrap();
        // Tokens per choice, step by step, while request 100 is in the engine.
        let mut progress: Vec<Vec<usize>> = Vec::new();
        while results.get(&100).is_none_or(|r| r.finish.is_none()) {
            collect(s.step(), &mut results);
            progress.push((0..8).map(|id| results[&id].tokens.len()).collect());
        }
        let decode_rows: Vec<usize> = s.runner().steps[alone..]
            .iter()
            .filter(|(prefill, _)| !prefill)
            .map(|&(_, rows)| rows)
            .collect();
        assert!(decode_rows.len() >= 5, "{decode_rows:?}");
        if fair {
            assert!(decode_rows.iter().all(|&r| r <= 5), "{decode_rows:?}");
            // Between its first and last token in the window, no choice (the one preempted
            // for request 100 included, once back) waits two steps in a row.
            for id in 0..8 {
                let moved: Vec<bool> = progress.windows(2).map(|w| w[1][id] > w[0][id]).collect();
                let (Some(first), Some(last)) = (
                    moved.iter().position(|&m| m),
                    moved.iter().rposition(|&m| m),
                ) else {
                    continue;
                };
                assert!(
                    moved[first..=last].windows(3).all(|w| w.iter().any(|&m| m)),
                    "choice {id} waited two steps: {progress:?}"
                );
            }
        } else {
            assert!(decode_rows.contains(&8), "{decode_rows:?}");
        }
        let want = &reference.generated_token_ids;
        finish_beside_request_100(&mut s, &mut results, 8, want, &format!("fair: {fair}"));
    }
}

/// Runs `s` to the end, then checks that choices `0..choices` each generated `want` (what
/// transformers did), that request 100 got its 6 tokens, and that every block came back;
/// `case` names the variant in a failure.
fn finish_beside_request_100<R: Runner>(
    s: &mut Scheduler<R>,
    results: &mut HashMap<RequestId, Result>,
    choices: u64,
    want: &[u32],
    case: &str,
) {
    run_to_end(s, results);
    for id in 0..choices {
        assert_eq!(results[&id].tokens, want, "choice {id}, {case}");
    }
    assert_eq!(results[&100].tokens.len(), 6);
    assert_eq!(s.blocks_in_use(), 0);
}

/// A decode step's cost on a CPU-like runner: 1 ms and 1 ms a row.
fn linear_cost(rows: usize) -> Duration {
    Duration::from_millis(1 + rows as u64)
}

/// With fair decoding and a runner that reports its decode costs, while a later request runs
/// beside sixteen choices of one request, no decode step costs more than twice a step of one
/// row per request (2 x 3 ms: at most 5 rows), where the equal share alone would allow 9; the
/// choices that sit steps out hold back the prefill of the choice preempted for the later
/// request (it would only sit out too); and every choice still continues exactly as
/// transformers did. A slowdown below 1 is refused.
#[test]
fn fair_decoding_bounds_a_step_by_its_cost_and_holds_back_prefill() {
    let reference = common::reference("tiny-v3").greedy;
    let n = reference.generated_token_ids.len();
    for cost in [Some(linear_cost as fn(usize) -> Duration), None] {
        let mut s = recording_tiny_v3(RunnerConfig::for_limits(16, 64));
        s.runner_mut().cost = cost;
        s.set_fair_decode(true);
        assert!(s.set_fair_decode_slowdown(0.5).is_err());
        assert!(s.set_fair_decode_slowdown(f64::NAN).is_err());
        s.set_fair_decode_slowdown(2.0).unwrap();
        add_choices(&mut s, 16, &reference.prompt_token_ids, n);
        let mut results = HashMap::new();
        for _ in 0..32 {
            collect(s.step(), &mut results);
            if s.runner().steps.last() == Some(&(false, 16)) {
                break;
            }
        }
        assert_eq!(s.runner().steps.last(), Some(&(false, 16)), "{cost:?}");
        let alone = s.runner().steps.len();
        s.add(100, reference.prompt_token_ids[..4].to_vec(), greedy(6))
            .unwrap();
        while results.get(&100).is_none_or(|r| r.finish.is_none()) {
            collect(s.step(), &mut results);
        }
        let during = &s.runner().steps[alone..];
        let decode_rows: Vec<usize> = during.iter().filter(|s| !s.0).map(|s| s.1).collect();
        // Request 100's own prompt is the one prefill while it runs.
        let prefills: Vec<usize> = during.iter().filter(|s| s.0).map(|s| s.1).collect();
        assert_eq!(prefills, [4], "{cost:?}: {during:?}");
        assert!(decode_rows.len() >= 5, "{decode_rows:?}");
        match cost {
            Some(_) => assert!(decode_rows.iter().all(|&r| r <= 5), "{decode_rows:?}"),
            None => assert!(decode_rows.contains(&9), "{decode_rows:?}"),
        }
        let want = &reference.generated_token_ids;
        finish_beside_request_100(&mut s, &mut results, 16, want, &format!("{cost:?}"));
    }
}

/// A token outside the vocabulary from the backend fails that request alone, as an internal
/// fault naming the token; the requests batched with it finish with the tokens they give alone.
#[test]
fn an_out_of_vocabulary_token_fails_only_its_request() {
    let alone = {
        let (cfg, weights) = load("tiny-v3");
        let inner = runner::open_with_weights(Backend::Cpu, cfg, weights, tiny_config()).unwrap();
        let mut s = Scheduler::new(inner, None, Vec::new()).unwrap();
        let mut r = HashMap::new();
        s.add(1, vec![5, 6, 7], greedy(4)).unwrap();
        run_to_end(&mut s, &mut r);
        r[&1].tokens.clone()
    };
    assert_eq!(alone.len(), 4);
    let (cfg, weights) = load("tiny-v3");
    let inner = runner::open_with_weights(Backend::Cpu, cfg, weights, tiny_config()).unwrap();
    let runner = Flaky {
        inner,
        fail: false,
        poisoned: Some(9),
    };
    let mut s = Scheduler::new(runner, None, Vec::new()).unwrap();
    let mut r = HashMap::new();
    s.add(0, vec![9, 9, 9], greedy(4)).unwrap();
    s.add(1, vec![5, 6, 7], greedy(4)).unwrap();
    run_to_end(&mut s, &mut r);
    let failed = r[&0].failed.as_deref().expect("the poisoned request fails");
    assert!(failed.contains("outside the vocabulary"), "{failed}");
    assert!(r[&0].tokens.is_empty(), "{:?}", r[&0].tokens);
    assert_eq!(r[&1].failed, None);
    assert_eq!(r[&1].tokens, alone);
    assert!(s.failing().is_none(), "one bad row is not a failing device");
    assert_eq!(s.blocks_in_use(), 0);
}
