//! DeepSeek-V4 on the CPU backend against transformers 5.25 on `fixtures/tiny-v4`
//! (scripts/make_v4_fixture.py): the cache-free forward (`model::v4::forward`) on every
//! position of a 48-token prompt (a multiple of both compress rates) and of a 23-token one (of
//! neither), and the greedy continuation; then the step graphs over the cache roots
//! (`model::v4::step`), fed as the runner feeds MLA's: prompts in chunks split at and off the
//! compression blocks, packed several to a step, decoded token by token and in batches of
//! different lengths, each fed token's logits against transformers' at its position.

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor as CTensor};
use deepinfer::backend::cpu::{self, Group, DEFAULT_COLLECTIVE_TIMEOUT};
use deepinfer::config::v4::V4Config;
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Buckets, RunnerConfig};
use deepinfer::graph::{DType, Graph, InputRole};
use deepinfer::model::v4::forward::build_stateless;
use deepinfer::model::v4::step::{build_step, cache_roots, V4Step};
use deepinfer::model::v4::{shard, tensors};
use deepinfer::model::{
    CacheLayout, Dots, LogitsOutput, ModelWeights, MoeStrategy, Precision, Sampler,
};
use deepinfer::runner::step::{self, DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, DeviceOptions, DeviceRunner, Runner, Step};
use deepinfer::weights::Checkpoint;

#[derive(serde::Deserialize)]
struct V4Reference {
    token_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    token_ids_short: Vec<u32>,
    logits_short: Vec<Vec<f32>>,
    greedy: common::Greedy,
    logits_decode: Vec<Vec<f32>>,
}

/// tiny-v4 as transformers saves it (f32); the tests below run on it unless they say otherwise.
const F32: &str = "tiny-v4";
/// The same architecture stored as DeepSeek-V4-Flash is published: FP8 linear weights with
/// power-of-two block scales, FP4 routed experts (scripts/make_v4_fp8_fixture.py).
const FP8_FP4: &str = "tiny-v4-fp8";

fn config_of(fixture: &str) -> V4Config {
    let text = std::fs::read_to_string(common::fixture_dir(fixture).join("config.json")).unwrap();
    V4Config::from_json_str(&text).unwrap()
}

fn config() -> V4Config {
    config_of(F32)
}

/// A fixture's weights by published name (`tid2eid` as i32, FP4 experts as codes and scales),
/// as `deepinfer lower` reads them.
fn weights_of(fixture: &str) -> HashMap<String, CTensor> {
    let ckpt = Checkpoint::open(&common::fixture_dir(fixture)).unwrap();
    tensors::load(&config_of(fixture), &ckpt, DType::F32).unwrap()
}

/// The graph's inputs: `ids`, and the fixture's weights (unsplit: the routed experts stacked).
fn inputs(fixture: &str, graph: &Graph, ids: &[u32]) -> Vec<CTensor> {
    let mut w = shard::rank_weights(&config_of(fixture), &weights_of(fixture), 1, 0).unwrap();
    graph
        .inputs()
        .iter()
        .map(|d| match d.name.as_str() {
            "input_ids" => {
                let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
                CTensor::from_vec(v, ids.len(), &Device::Cpu).unwrap()
            }
            name => w.remove(name).expect("a weight"),
        })
        .collect()
}

fn logits_of(fixture: &str, ids: &[u32]) -> Vec<Vec<f32>> {
    let g = build_stateless(&config_of(fixture), ids.len()).unwrap();
    let out = cpu::run(&g, &inputs(fixture, &g, ids)).unwrap();
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
    cache_free_forward(F32);
}

/// FP8 weights dequantized with their E8M0 block scales as read, FP4 experts kept as codes
/// and dequantized in the graph where selected: transformers' logits, read from the same
/// files by its own FP8 quantizer.
#[test]
fn the_published_fp8_and_fp4_forms_match_transformers() {
    cache_free_forward(FP8_FP4);
    greedy_continuation(FP8_FP4);
}

fn cache_free_forward(fixture: &str) {
    let r: V4Reference = common::reference_file(fixture, "reference.json");
    let long = worst(&logits_of(fixture, &r.token_ids), &r.logits);
    let short = worst(&logits_of(fixture, &r.token_ids_short), &r.logits_short);
    eprintln!("{fixture} cache-free logits: 48 tokens {long:.2e}, 23 tokens {short:.2e}");
    assert!(long <= 1e-4, "{fixture} 48-token prompt: {long}");
    assert!(short <= 1e-4, "{fixture} 23-token prompt: {short}");
}

#[test]
fn the_greedy_continuation_is_transformers() {
    greedy_continuation(F32);
}

fn greedy_continuation(fixture: &str) {
    let r: V4Reference = common::reference_file(fixture, "reference.json");
    let gen = &r.greedy.generated_token_ids;
    let mut all = r.token_ids.clone();
    all.extend(&gen[..gen.len() - 1]);
    let logits = logits_of(fixture, &all);
    // Row p - 1 of the prompt's end onward: the logits each generated token was drawn from.
    let steps = &logits[r.token_ids.len() - 1..];
    let d = worst(steps, &r.logits_decode);
    assert!(d <= 1e-4, "{fixture}: {d}");
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

/// The cache-free graph and the step graphs (a packed prefill and a decode) lower to XLA HLO
/// that breaks none of the rules `lower --check neuron` applies to every graph a capture
/// compiles (accepted opcodes, no 64-bit type, no integer multiply, no vocabulary-wide sort, no
/// tensor over 4 GiB, no narrow weight widened to f32 before its dot, ...): tiny-v4's, its
/// FP4 form's as a device builds it, and DeepSeek-V4-Flash-Base's and V4-Flash's at their
/// deployment degree on a trn1.32xlarge (`--tp 32`, 2,048 positions, decode batch 8 and a
/// 64-token prefill chunk).
#[test]
fn the_graphs_lower_within_neurons_rules() {
    use deepinfer::backend::hlo::emit;
    use deepinfer::backend::neuron::check::{check_module, CheckOptions};
    let cfg = config();
    let layout = CacheLayout::new(BLOCK, 4 * CTX / BLOCK + 1, DType::F32, 4);
    let published = |file: &str| {
        let text = std::fs::read_to_string(common::fixture_dir("configs").join(file)).unwrap();
        V4Config::from_json_str(&text).unwrap()
    };
    let flash_layout = CacheLayout::new(16, 8 * 2048 / 16 + 1, DType::BF16, 8);
    // At the deployment degree, with the MoE strategy a device capture takes (dense for the
    // prefill chunk, whose 64 x 6 selections outnumber a rank's 8 experts) and a device's
    // dots (FP4 experts dequantized to bf16, never to f32).
    let at = |flash: &V4Config, spec: V4Step| V4Step {
        ctx: 2048,
        ranks: 32,
        moe: MoeStrategy::for_model(&flash.clone().into_model_config(), spec.rows, 32),
        dots: Dots::DEVICE,
        ..spec
    };
    let device = |spec: V4Step| V4Step {
        dots: Dots::DEVICE,
        ..spec
    };
    let fp4 = config_of(FP8_FP4);
    let mut graphs = vec![
        build_stateless(&cfg, 48).unwrap(),
        build_step(&cfg, &layout, &prefill(32, 4)).unwrap(),
        build_step(&cfg, &layout, &decode(4)).unwrap(),
        build_step(&fp4, &layout, &device(prefill(32, 4))).unwrap(),
        build_step(&fp4, &layout, &device(decode(4))).unwrap(),
    ];
    // V4-Flash-Base (FP8 experts, held in f32) and V4-Flash (FP4 experts).
    for flash in [
        published("deepseek-v4-flash-base.json"),
        published("deepseek-v4-flash.json"),
    ] {
        graphs.push(build_step(&flash, &flash_layout, &at(&flash, decode(8))).unwrap());
        graphs.push(build_step(&flash, &flash_layout, &at(&flash, prefill(64, 1))).unwrap());
    }
    for g in &graphs {
        let report = check_module(&emit::emit(g).unwrap(), &CheckOptions::default());
        assert!(report.clean(), "{}: {:?}", g.name(), report.findings);
    }
}

/// Token slots per cache block in the step tests: a divisor of both compress rates (4 and 8),
/// so a window's entry row is one of the window's own blocks' (`model::v4::step`).
const BLOCK: usize = 4;
/// The context bucket of the step tests: the 48-token prompt and its 16-token continuation.
const CTX: usize = 64;

/// A V4 model's cache roots on the CPU backend, fed step by step as the runner feeds MLA's:
/// sequences own blocks of the paged roots (handed out out of order, so a sequence's blocks
/// are never contiguous) and a state row of the rings (sequence `i` row `i + 1`); block 0 and
/// state row 0 are the scratch that padding writes to.
struct Cache {
    cfg: V4Config,
    layout: CacheLayout,
    /// Each rank's weights (one rank: unsplit).
    weights: Vec<HashMap<String, CTensor>>,
    roots: HashMap<String, CTensor>,
    graphs: HashMap<V4Step, Graph>,
    free: Vec<u32>,
    seqs: Vec<Vec<u32>>,
}

/// Tokens fed to one sequence in a step: `tokens` at positions `start..`.
struct Feed<'a> {
    seq: usize,
    start: usize,
    tokens: &'a [u32],
}

impl Cache {
    fn new() -> Self {
        Cache::split(F32, 1)
    }

    /// The cache of `fixture`'s model split `ranks` ways: every step runs on `ranks` ranks of
    /// the CPU backend, whose collectives meet, and the ranks' logits columns are joined.
    fn split(fixture: &str, ranks: usize) -> Self {
        let cfg = config_of(fixture);
        let blocks = 8 * CTX / BLOCK + 1;
        let layout = CacheLayout::new(BLOCK, blocks, DType::F32, 8);
        let roots = common::zero_roots(cache_roots(&cfg, &layout).unwrap());
        // Out of order: 1, 1 + 37, 1 + 74, ... (mod the usable blocks), never 0.
        let usable = (blocks - 1) as u32;
        let free = (0..usable).map(|i| 1 + (i * 37) % usable).rev().collect();
        Cache {
            weights: {
                let full = weights_of(fixture);
                (0..ranks)
                    .map(|r| shard::rank_weights(&cfg, &full, ranks, r).unwrap())
                    .collect()
            },
            cfg,
            layout,
            roots,
            graphs: HashMap::new(),
            free,
            seqs: Vec::new(),
        }
    }

    /// A new sequence's index.
    fn open(&mut self) -> usize {
        self.seqs.push(Vec::new());
        self.seqs.len() - 1
    }

    /// Gives sequence `seq` blocks for its first `len` positions.
    fn reserve(&mut self, seq: usize, len: usize) {
        while self.seqs[seq].len() * BLOCK < len {
            let b = self.free.pop().expect("a free block");
            self.seqs[seq].push(b);
        }
    }

    /// Runs one step of `spec` over `feeds` (padded to its rows with scratch tokens, the
    /// metadata filled by the runner's own `prefill_step` / `decode_step`); returns each fed
    /// token's logits, in feed order.
    fn step(&mut self, spec: V4Step, feeds: &[Feed<'_>]) -> Vec<Vec<f32>> {
        for f in feeds {
            self.reserve(f.seq, f.start + f.tokens.len());
        }
        let fed: usize = feeds.iter().map(|f| f.tokens.len()).sum();
        let vocab = self.cfg.vocab_size;
        // Sequence i's rings are in state row i + 1.
        let controls = |f: &Feed| LogitControls {
            state_row: f.seq as u32 + 1,
            ..LogitControls::NONE
        };
        let meta = match spec.decode {
            true => {
                let rows: Vec<DecodeRow> = feeds
                    .iter()
                    .map(|f| DecodeRow {
                        token: f.tokens[0],
                        position: f.start,
                        blocks: &self.seqs[f.seq],
                        sampling: SamplingParams::GREEDY,
                        controls: controls(f),
                    })
                    .collect();
                step::decode_step(&rows, spec.rows, CTX, BLOCK, vocab)
            }
            false => {
                let chunks: Vec<PrefillChunk> = feeds
                    .iter()
                    .map(|f| PrefillChunk {
                        tokens: f.tokens,
                        start: f.start,
                        blocks: &self.seqs[f.seq],
                        sampling: SamplingParams::GREEDY,
                        controls: controls(f),
                    })
                    .collect();
                step::prefill_step(&chunks, spec.rows, spec.seqs, CTX, BLOCK, vocab)
            }
        }
        .unwrap();
        let spec = V4Step {
            ranks: self.weights.len(),
            ..spec
        };
        let cfg = &self.cfg;
        let layout = &self.layout;
        let graph = self
            .graphs
            .entry(spec)
            .or_insert_with(|| build_step(cfg, layout, &spec).unwrap());
        let inputs: Vec<Vec<CTensor>> = self
            .weights
            .iter()
            .map(|weights| {
                graph
                    .inputs()
                    .iter()
                    .map(|d| match d.role {
                        // A copy per rank: the CPU backend updates a root in place.
                        InputRole::CacheRoot => self.roots[&d.name].copy().unwrap(),
                        InputRole::Weight => weights[&d.name].clone(),
                        _ => common::host_tensor(
                            meta.iter().find(|a| a.name == d.name).expect("metadata"),
                        ),
                    })
                    .collect()
            })
            .collect();
        let group = Group::new(inputs.len(), DEFAULT_COLLECTIVE_TIMEOUT);
        let mut outs = cpu::run_group(graph, &inputs, &group, 0).unwrap();
        cpu::join_logits(graph, &mut outs).unwrap();
        let mut out: HashMap<String, CTensor> = graph
            .outputs()
            .iter()
            .map(|o| o.name.clone())
            .zip(outs.swap_remove(0))
            .collect();
        let logits = out.remove("logits").unwrap().to_vec2::<f32>().unwrap();
        let next = out.remove("next_tokens").unwrap().to_vec1::<i32>().unwrap();
        self.roots.extend(out);
        // Greedy rows: the graph's sampler picks each chunk's last fed token's argmax.
        let mut last = 0;
        for (f, &token) in feeds.iter().zip(&next) {
            last += f.tokens.len();
            assert_eq!(token as u32, argmax(&logits[last - 1]), "sampled token");
        }
        logits[..fed].to_vec()
    }

    /// Prefills `tokens` into a new sequence in chunks of `splits` tokens, one step each
    /// (`rows` tokens a graph); returns every position's logits.
    fn prefill(&mut self, tokens: &[u32], splits: &[usize], rows: usize) -> (usize, Vec<Vec<f32>>) {
        let seq = self.open();
        let mut logits = Vec::new();
        let mut start = 0;
        for &len in splits {
            let feed = Feed {
                seq,
                start,
                tokens: &tokens[start..start + len],
            };
            logits.extend(self.step(prefill(rows, 1), &[feed]));
            start += len;
        }
        assert_eq!(start, tokens.len());
        (seq, logits)
    }
}

/// A prefill step, its routed experts evaluated densely (decode steps gather them): both
/// strategies against transformers.
fn prefill(rows: usize, seqs: usize) -> V4Step {
    V4Step {
        rows,
        seqs,
        ctx: CTX,
        decode: false,
        ranks: 1,
        logits: LogitsOutput::AllPositions,
        sampler: Sampler::Full,
        moe: MoeStrategy::Dense,
        weights: DType::F32,
        dots: Dots::Widen,
    }
}

fn decode(rows: usize) -> V4Step {
    V4Step {
        rows,
        seqs: rows,
        ctx: CTX,
        decode: true,
        ranks: 1,
        logits: LogitsOutput::AllPositions,
        sampler: Sampler::Full,
        moe: MoeStrategy::Gather,
        weights: DType::F32,
        dots: Dots::Widen,
    }
}

fn argmax(row: &[f32]) -> u32 {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap() as u32
}

/// A 48-token prompt prefilled in chunks that end on and off both compress rates' blocks
/// (5, 8, 16, 27, 28, 48) and the window (8), then its greedy continuation decoded one token a
/// step: every position's logits within 1e-4 of transformers' and the same greedy tokens.
#[test]
fn chunked_prefill_then_decode_matches_transformers() {
    chunked_prefill_then_decode(F32);
}

/// [`chunked_prefill_then_decode_matches_transformers`] on the FP8/FP4 checkpoint: every
/// expert of a layer dequantized for the dense prefill, the selected ones for the gathered
/// decode, at tp 1 and 2 (each rank its own experts' codes and scales).
#[test]
fn the_fp8_and_fp4_checkpoint_prefills_in_chunks_and_decodes() {
    chunked_prefill_then_decode(FP8_FP4);
    packed_and_batched(FP8_FP4, 2);
}

fn chunked_prefill_then_decode(fixture: &str) {
    let r: V4Reference = common::reference_file(fixture, "reference.json");
    let mut cache = Cache::split(fixture, 1);
    let (seq, logits) = cache.prefill(&r.token_ids, &[5, 3, 8, 11, 1, 20], 32);
    let prefill = worst(&logits, &r.logits);
    let gen = &r.greedy.generated_token_ids;
    let mut steps = vec![logits[r.token_ids.len() - 1].clone()];
    for (i, &t) in gen[..gen.len() - 1].iter().enumerate() {
        let feed = Feed {
            seq,
            start: r.token_ids.len() + i,
            tokens: &[t],
        };
        steps.extend(cache.step(decode(1), &[feed]));
    }
    let decoded = worst(&steps, &r.logits_decode);
    eprintln!("{fixture} steps: chunked prefill {prefill:.2e}, decode {decoded:.2e}");
    assert!(prefill <= 1e-4, "chunked prefill: {prefill}");
    assert!(decoded <= 1e-4, "decode: {decoded}");
    let tokens: Vec<u32> = steps.iter().map(|row| argmax(row)).collect();
    assert_eq!(&tokens, gen);
}

/// Prefix consistency: the prompt fed one token a decode step gives every position the logits
/// transformers' one forward over it gives, through every layer kind (the fixture has all
/// three) and past both rates' block boundaries and the window.
#[test]
fn token_by_token_decode_equals_the_prompts_forward() {
    let r: V4Reference = common::reference_file(F32, "reference.json");
    let mut cache = Cache::new();
    let seq = cache.open();
    let mut logits = Vec::new();
    for (p, t) in r.token_ids.iter().enumerate() {
        let feed = Feed {
            seq,
            start: p,
            tokens: std::slice::from_ref(t),
        };
        logits.extend(cache.step(decode(1), &[feed]));
    }
    let d = worst(&logits, &r.logits);
    assert!(d <= 1e-4, "{d}");
}

/// Seven sequences of different lengths (prefixes of the two prompts) prefilled several to a
/// packed step, then decoded together in a batch of 8 (one padding row), each row at its own
/// position: every fed token's logits against transformers' at its position.
#[test]
fn packed_prefill_and_batched_decode_of_different_lengths() {
    packed_and_batched(F32, 1);
}

/// [`packed_prefill_and_batched_decode_of_different_lengths`] with the model split two ways:
/// heads, output groups, experts, shared-expert channels and vocabulary (`model::v4::shard`).
#[test]
fn the_same_steps_split_across_two_ranks() {
    packed_and_batched(F32, 2);
}

/// Four ways: more ranks than the fixture's two output groups, so two ranks share each group,
/// each projecting its one head's columns of it (as V4-Flash's 8 groups do at `--tp 32`).
#[test]
fn the_same_steps_split_across_more_ranks_than_output_groups() {
    packed_and_batched(F32, 4);
}

fn packed_and_batched(fixture: &str, ranks: usize) {
    let r: V4Reference = common::reference_file(fixture, "reference.json");
    let mut cache = Cache::split(fixture, ranks);
    // (prompt, prefilled length) per sequence; each then decodes 9 more of its prompt.
    let plan: [(bool, usize); 7] = [
        (true, 13),
        (false, 11),
        (true, 6),
        (false, 4),
        (true, 29),
        (true, 1),
        (false, 8),
    ];
    let prompt = |long: bool| {
        if long {
            &r.token_ids
        } else {
            &r.token_ids_short
        }
    };
    let want = |long: bool| if long { &r.logits } else { &r.logits_short };
    let seqs: Vec<usize> = plan.iter().map(|_| cache.open()).collect();
    let mut worst_seen = 0f32;
    // Packed prefill: up to 4 sequences and 32 tokens a step, in chunks of at most 12.
    let mut done = vec![0usize; plan.len()];
    loop {
        let mut feeds = Vec::new();
        let mut room = 32;
        for (i, &(long, len)) in plan.iter().enumerate() {
            let take = (len - done[i]).min(12).min(room);
            if take == 0 || feeds.len() == 4 {
                continue;
            }
            feeds.push(Feed {
                seq: seqs[i],
                start: done[i],
                tokens: &prompt(long)[done[i]..done[i] + take],
            });
            room -= take;
        }
        if feeds.is_empty() {
            break;
        }
        let expected: Vec<Vec<f32>> = feeds
            .iter()
            .flat_map(|f| {
                let long = plan[seqs.iter().position(|&s| s == f.seq).unwrap()].0;
                want(long)[f.start..f.start + f.tokens.len()].to_vec()
            })
            .collect();
        let got = cache.step(prefill(32, 4), &feeds);
        worst_seen = worst_seen.max(worst(&got, &expected));
        for f in &feeds {
            let i = seqs.iter().position(|&s| s == f.seq).unwrap();
            done[i] += f.tokens.len();
        }
    }
    for k in 0..9 {
        let feeds: Vec<Feed> = plan
            .iter()
            .enumerate()
            .map(|(i, &(long, len))| Feed {
                seq: seqs[i],
                start: len + k,
                tokens: &prompt(long)[len + k..len + k + 1],
            })
            .collect();
        let expected: Vec<Vec<f32>> = plan
            .iter()
            .map(|&(long, len)| want(long)[len + k].clone())
            .collect();
        worst_seen = worst_seen.max(worst(&cache.step(decode(8), &feeds), &expected));
    }
    assert!(worst_seen <= 1e-4, "{worst_seen}");
}

/// The cache a token costs on DeepSeek-V4-Flash (the published config's copy in
/// `fixtures/configs`) against DeepSeek-V3.2's (MLA latents and index keys) at 4k and 128k
/// context, bf16, blocks of 16 and of 128 tokens: V4 pages only its compressed entries (the
/// window and the compressors' inputs are per-sequence rings), so a token costs under a tenth
/// of V3.2's at 128k and under 15% at 4k, where a sequence's 11.7 MB of rings still weigh. The
/// table is in `docs/deepseek-v4.md` and `benches/README.md`.
#[test]
fn a_v4_flash_token_costs_a_tenth_of_a_v32_token() {
    use deepinfer::config::v4::V4Attention;
    use deepinfer::config::ModelConfig;
    use deepinfer::model::v4::step::cache_cost;
    let dir = common::fixture_dir("configs");
    let text = std::fs::read_to_string(dir.join("deepseek-v4-flash-base.json")).unwrap();
    let flash = V4Config::from_json_str(&text).unwrap();
    let count = |k: V4Attention| flash.attention.iter().filter(|&&a| a == k).count();
    assert_eq!(
        [
            count(V4Attention::Sliding),
            count(V4Attention::CompressedSparse),
            count(V4Attention::HeavilyCompressed)
        ],
        [2, 21, 20]
    );
    let v32 = ModelConfig::from_file(&dir.join("deepseek-v3.2.json")).unwrap();
    // V3.2's paged roots per token slot (the sampling state is per sequence and tiny).
    let v32_token: usize =
        deepinfer::model::cache_roots(&v32, &CacheLayout::new(16, 1, DType::BF16, 1))
            .unwrap()
            .iter()
            .filter(|r| r.rows == 16)
            .map(|r| r.cols * 2)
            .sum();
    for block in [16, 128] {
        let cost = cache_cost(&flash, DType::BF16, block).unwrap();
        for ctx in [4096, 131072] {
            let v4 = cost.per_token_at(ctx);
            let ratio = v4 / v32_token as f64;
            eprintln!(
                "block {block}, ctx {ctx}: V4-Flash {v4:.0} B/token ({:.0} paged + {:.1} MB a \
                 sequence), V3.2 {v32_token} B/token: {:.1}%",
                cost.bytes_per_token,
                cost.bytes_per_sequence as f64 / 1e6,
                100.0 * ratio
            );
            // The paper's claim is about a tenth at 1M tokens; the rings weigh more at 4k.
            let bound = if ctx >= 131072 { 0.10 } else { 0.15 };
            assert!(ratio < bound, "block {block}, ctx {ctx}: {ratio}");
        }
    }
}

/// `deepinfer lower` on a V4 directory refuses what its graphs cannot do yet, naming it: an
/// f16 cache, and a degree that does not divide the model.
#[test]
fn lowering_v4_refuses_what_it_cannot_do_yet() {
    use deepinfer::export::{lower_sharded, LowerOptions};
    use deepinfer::model::{DTypeChoice, Dots, PrecisionChoice};
    let out = std::env::temp_dir().join(format!("deepinfer-v4-lower-{}", std::process::id()));
    let mut opts = LowerOptions {
        batch_sizes: vec![1],
        ctx: 64,
        inputs_from_token_ids: None,
        precision: PrecisionChoice {
            kv_dtype: DTypeChoice::Exactly(DType::F16),
            ..PrecisionChoice::default()
        },
        dots: Dots::Widen,
        split_sampler: false,
        speculative: false,
    };
    let dir = common::fixture_dir("tiny-v4");
    let err = lower_sharded(&dir, &out, &opts, 1).unwrap_err().to_string();
    assert!(err.contains("caches are held in f32 or bf16"), "{err}");
    opts.precision = PrecisionChoice::default();
    let err = lower_sharded(&dir, &out, &opts, 3).unwrap_err().to_string();
    assert!(
        err.contains("3 does not divide") && err.contains("num_attention_heads 4"),
        "{err}"
    );
    let manifest = lower_sharded(&dir, &out, &opts, 2).unwrap();
    assert_eq!(manifest.tp, 2);
    std::fs::remove_dir_all(&out).unwrap();
}

/// The runners drive V4 as they drive MLA, on the CPU and through nrt-sim (the device runner's
/// FFI path, its persistent metadata and roots): the 48-token prompt and the 23-token one
/// prefilled together, 9 and 7 tokens a step (the short one stopping at 15), every fed position's
/// logits returned; then one batch decodes the long prompt's greedy continuation beside the rest
/// of the short prompt, token by token, each row in its own state row. Every logit within 1e-4
/// of transformers', and the sampled tokens its greedy ones.
#[test]
fn the_runners_serve_it_on_the_cpu_and_through_nrt_sim() {
    let names = [
        "cpu",
        "cpu --tp 2",
        "nrt-sim",
        "nrt-sim --split-sampler",
        "nrt-sim --tp 2 --split-sampler",
    ];
    match_transformers(F32, &names, &Precision::F32);
}

/// Every logit `fixture` served in `precision` within 1e-4 of transformers' f32 ones, and the
/// greedy tokens its.
fn match_transformers(fixture: &str, names: &[&str], precision: &Precision) {
    let r: V4Reference = common::reference_file(fixture, "reference.json");
    let dtype = precision.weights;
    for (name, served) in through_the_runners(fixture, names, precision) {
        let worst = served.worst(&r);
        eprintln!("{fixture} ({dtype}) through the {name} runner: logits within {worst:.2e}");
        assert!(worst <= 1e-4, "{fixture} ({dtype}), {name}: {worst}");
        assert_eq!(served.tokens, r.greedy.generated_token_ids, "{name}");
    }
}

/// Both fixtures with their matrices in bf16 (`--dtype bf16`; norms, sinks, routers and
/// hyper-connections stay f32, the cache too) through the runners: the CPU's widened dots, and
/// a device's split dots (nrt-sim, at tp 1 and 2), whose activations keep about 16 of their
/// 24 bits. On every served row, the drift from transformers' f32 logits is no more than
/// transformers' own bf16 run's on the same rows (`reference-bf16.json`,
/// scripts/make_v4_bf16_reference.py: weights and activations in bf16), as many argmaxes
/// agree, and (tiny-v4, whose f32 weights bf16 rounds) bf16 does change the numbers.
#[test]
fn bf16_matrices_drift_no_more_than_transformers_bf16() {
    for fixture in [F32, FP8_FP4] {
        bf16_within_the_peers_drift(fixture, DType::F32);
    }
    bf16_within_the_peers_drift(F32, DType::BF16);
}

fn bf16_within_the_peers_drift(fixture: &str, kv_cache: DType) {
    let f32_ref: V4Reference = common::reference_file(fixture, "reference.json");
    let peer: V4Reference = common::reference_file(fixture, "reference-bf16.json");
    let names = ["cpu", "nrt-sim", "nrt-sim --tp 2 --split-sampler"];
    let precision = Precision { kv_cache, ..bf16() };
    for (name, served) in through_the_runners(fixture, &names, &precision) {
        let drift = served.worst(&f32_ref);
        let agree = served.argmax_agreement(&f32_ref);
        // The peer on exactly the rows served.
        let peer_rows = Served {
            rows: (served.rows.iter())
                .map(|(row, _)| (*row, peer.row(*row).to_vec()))
                .collect(),
            tokens: Vec::new(),
        };
        let peer_drift = peer_rows.worst(&f32_ref);
        let peer_agree = peer_rows.argmax_agreement(&f32_ref);
        eprintln!(
            "{fixture} (bf16, {kv_cache} cache) through the {name} runner: max |logit - f32| \
             {drift:.3e} vs transformers-bf16 {peer_drift:.3e}; argmax agreement {agree:.4} vs \
             {peer_agree:.4}"
        );
        assert!(
            drift <= peer_drift,
            "{fixture}, {name}: {drift} > {peer_drift}"
        );
        assert!(
            agree >= peer_agree,
            "{fixture}, {name}: {agree} < {peer_agree}"
        );
        if fixture == F32 {
            assert!(drift > 1e-5, "{name}: bf16 matched f32 exactly ({drift})");
        }
    }
}

/// The runners on the FP8/FP4 checkpoint: on a device the FP4 experts' codes and scales are
/// uploaded as stored and dequantized in the lowered graph (HLO's E2M1 decode, read back by
/// nrt-sim), per rank at tp 2. Its matrices held in bf16 on the CPU too (f32 products): an
/// E4M3 value times a power-of-two block scale is exact in bf16, as are the tensors published
/// in bf16, so bf16 holds DeepSeek-V4-Flash's weights without loss.
#[test]
fn the_runners_serve_the_fp8_and_fp4_checkpoint() {
    let names = ["cpu", "nrt-sim", "nrt-sim --tp 2 --split-sampler"];
    match_transformers(FP8_FP4, &names, &Precision::F32);
    match_transformers(FP8_FP4, &["cpu"], &bf16());
}

/// `--dtype bf16 --kv-dtype f32` for a V4 model: its matrices in bf16, everything else, the
/// caches included, in f32.
fn bf16() -> Precision {
    use deepinfer::model::{DTypeChoice, PrecisionChoice};
    PrecisionChoice {
        dtype: DTypeChoice::Exactly(DType::BF16),
        kv_dtype: DTypeChoice::Exactly(DType::F32),
        ..PrecisionChoice::default()
    }
    .v4(None)
    .unwrap()
}

/// One test at a time drives nrt-sim: a process holds one runtime.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `fixture` served through each of the runners `names` with weights in `precision`: what each
/// returned.
fn through_the_runners(
    fixture: &str,
    names: &[&str],
    precision: &Precision,
) -> Vec<(String, Served)> {
    let _serial = serial();
    let r: V4Reference = common::reference_file(fixture, "reference.json");
    let rc = |tp| RunnerConfig {
        block_size: BLOCK,
        num_blocks: 2 * 128 / BLOCK + 1,
        buckets: Buckets {
            batch: vec![1, 2],
            ctx: vec![64, 128],
            prefill_chunk: 16,
            prefill_seqs: 2,
        },
        moe: None,
        kv_dtype: precision.kv_cache,
        tp,
        speculative_tokens: 0,
    };
    let dir = common::fixture_dir(fixture);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let weights = || ModelWeights::load(&cfg, &ckpt, precision).unwrap();
    let cpu = |tp| runner::open_with_weights(Backend::Cpu, cfg.clone(), weights(), rc(tp)).unwrap();
    let sim = |tp, split_sampler| {
        let lib = nrt_sim::library_next_to_current_exe()
            .expect("libnrt_sim.so next to the test binary (cargo test --workspace builds it)");
        let lib = neuron_sys::Library::open(&lib).unwrap();
        let opts = DeviceOptions {
            split_sampler,
            ..DeviceOptions::sim()
        };
        // Read as a device runner reads them: each rank's share from the checkpoint, one
        // tensor at a time, as it uploads.
        let streamed = ModelWeights::stream(
            &cfg,
            std::sync::Arc::new(Checkpoint::open(&dir).unwrap()),
            precision,
        )
        .unwrap();
        let mut d = DeviceRunner::new(cfg.clone(), streamed, rc(tp), lib, opts).unwrap();
        d.capture(&rc(tp).buckets).unwrap();
        Box::new(d) as Box<dyn Runner>
    };
    // One at a time: a process initializes the runtime once (each device runner is dropped
    // before the next starts it).
    let mut served = Vec::new();
    for &name in names {
        let mut run = match name {
            "cpu" => cpu(1),
            "cpu --tp 2" => cpu(2),
            "nrt-sim" => sim(1, false),
            "nrt-sim --split-sampler" => sim(1, true),
            _ => sim(2, true),
        };
        served.push((name.to_string(), serve_two_prompts(&mut *run, &r)));
    }
    served
}

/// Which of a [`V4Reference`]'s logits rows a served row is: a long or short prompt's position,
/// or the long prompt's `i`th greedy step.
#[derive(Debug, Clone, Copy)]
enum Row {
    Long(usize),
    Short(usize),
    Decode(usize),
}

impl V4Reference {
    fn row(&self, row: Row) -> &[f32] {
        match row {
            Row::Long(p) => &self.logits[p],
            Row::Short(p) => &self.logits_short[p],
            Row::Decode(i) => &self.logits_decode[i],
        }
    }
}

/// What [`serve_two_prompts`] got: every fed position's logits, and the long prompt's greedy
/// tokens (sampled at its last prefill chunk, then at each decode step).
struct Served {
    rows: Vec<(Row, Vec<f32>)>,
    tokens: Vec<u32>,
}

impl Served {
    /// The largest difference of any served logit from `r`'s.
    fn worst(&self, r: &V4Reference) -> f32 {
        self.rows
            .iter()
            .map(|(row, got)| common::max_abs_diff(got, r.row(*row)))
            .fold(0.0, f32::max)
    }

    /// The share of served rows whose argmax is `r`'s.
    fn argmax_agreement(&self, r: &V4Reference) -> f64 {
        let same = self
            .rows
            .iter()
            .filter(|(row, got)| argmax(got) == argmax(r.row(*row)))
            .count();
        same as f64 / self.rows.len() as f64
    }
}

/// [`the_runners_serve_it_on_the_cpu_and_through_nrt_sim`]'s steps on `run`, feeding `r`'s
/// prompts and greedy continuation.
fn serve_two_prompts(run: &mut dyn Runner, r: &V4Reference) -> Served {
    let (long, short) = (&r.token_ids, &r.token_ids_short);
    let mut alloc = common::allocator(run);
    let mut tables = [Vec::new(), Vec::new()];
    let controls = |row: u32| LogitControls {
        state_row: row,
        ..LogitControls::NONE
    };
    let mut served = Served {
        rows: Vec::new(),
        tokens: Vec::new(),
    };
    let mut keep = |row: Row, got: Vec<f32>| {
        assert!(got.iter().all(|x| x.is_finite()), "{row:?}");
        served.rows.push((row, got));
    };
    let prefilled_short = 15;
    // Steps of 9 tokens of the long prompt and 7 of the short one: chunks ending off the
    // compression blocks (rates 4 and 8) and the window (8).
    for step in 0..long.len().div_ceil(9) {
        let (start, short_start) = (9 * step, 7 * step);
        let end = [
            (start + 9).min(long.len()),
            (short_start + 7).min(prefilled_short),
        ];
        alloc.grow(&mut tables[0], end[0]).unwrap();
        alloc.grow(&mut tables[1], end[1]).unwrap();
        let mut chunks = vec![PrefillChunk {
            tokens: &long[start..end[0]],
            start,
            blocks: &tables[0],
            sampling: SamplingParams::GREEDY,
            controls: controls(1),
        }];
        if short_start < prefilled_short {
            chunks.push(PrefillChunk {
                tokens: &short[short_start..end[1]],
                start: short_start,
                blocks: &tables[1],
                sampling: SamplingParams::GREEDY,
                controls: controls(2),
            });
        }
        let out = run
            .replay(&Step::Prefill {
                chunks: &chunks,
                logits: LogitsOutput::AllPositions,
            })
            .unwrap();
        if end[0] == long.len() {
            served.tokens.push(out.next_tokens[0]);
        }
        let logits = out.logits.unwrap();
        let short_rows = match short_start < prefilled_short {
            true => short_start..end[1],
            false => 0..0,
        };
        let rows: Vec<Row> = (start..end[0])
            .map(Row::Long)
            .chain(short_rows.map(Row::Short))
            .collect();
        assert_eq!(logits.len(), rows.len());
        for (row, got) in rows.into_iter().zip(logits) {
            keep(row, got);
        }
    }
    // Decode: the long prompt's greedy continuation (row 0) beside the rest of the short
    // prompt (row 1, at its own positions), one token a step.
    let gen = &r.greedy.generated_token_ids;
    for i in 1..gen.len() {
        let (a, b) = (long.len() + i - 1, prefilled_short + i - 1);
        alloc.grow(&mut tables[0], a + 1).unwrap();
        if b < short.len() {
            alloc.grow(&mut tables[1], b + 1).unwrap();
        }
        let mut rows = vec![DecodeRow {
            token: gen[i - 1],
            position: a,
            blocks: &tables[0],
            sampling: SamplingParams::GREEDY,
            controls: controls(1),
        }];
        let mut wants = vec![Row::Decode(i)];
        if b < short.len() {
            rows.push(DecodeRow {
                token: short[b],
                position: b,
                blocks: &tables[1],
                sampling: SamplingParams::GREEDY,
                controls: controls(2),
            });
            wants.push(Row::Short(b));
        }
        let out = run
            .replay(&Step::Decode {
                rows: &rows,
                logits: LogitsOutput::Sampled,
            })
            .unwrap();
        let logits = out.logits.unwrap();
        assert_eq!(logits.len(), wants.len());
        for (row, got) in wants.into_iter().zip(logits) {
            keep(row, got);
        }
        served.tokens.push(out.next_tokens[0]);
    }
    served
}
