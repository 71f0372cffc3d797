//! `deepinfer bench`: decode throughput at one batch size on the CPU runner.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use deepinfer::backend::cpu::profile::{self, OpTime};
use deepinfer::config::ModelConfig;
use deepinfer::deployment::RunnerConfig;
use deepinfer::engine::{BlockAllocator, Event, GenerationParams, Scheduler};
use deepinfer::model::{LogitsOutput, ModelWeights};
use deepinfer::runner::step::{DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, Step};
use deepinfer::source::ModelSource;

use crate::{emit, PrecisionArgs};

/// `--tokens`: what the benchmark feeds its rows.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Tokens {
    Greedy,
    Random,
    Zeros,
}

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Checkpoint directory or GGUF file to benchmark.
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    model: Option<PathBuf>,
    /// A config.json to benchmark with random weights instead.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prompt tokens prefilled per sequence before timing (in chunks of --prefill-chunk, as
    /// `serve` prefills; their throughput is reported too).
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Most prompt tokens per prefill step, as `serve --prefill-chunk` (same default).
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// The tokens fed: `greedy`, distinct arithmetic prompts and then each row's own greedy
    /// token; `random`, prompts and every step's tokens drawn uniformly from the vocabulary
    /// (seeded by --seed; llama-bench's generation stream); `zeros`, token 0 at every position
    /// of every row, so the rows are one sequence repeated (llama-batched-bench's stream in the
    /// sources `scripts/bench_vs_llamacpp.sh` checks for). Which experts a MoE step reads
    /// depends on the tokens, so a comparison feeds both engines the same kind.
    #[arg(long, value_enum, default_value_t = Tokens::Greedy)]
    tokens: Tokens,
    /// The seed of `--tokens random`.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON line.
    #[arg(long)]
    json: bool,
    /// Also print where the timed steps' time went, per op kind (the CPU backend's profile),
    /// and the prefill's.
    #[arg(long)]
    profile: bool,
    /// Decode through the engine's scheduler with this many tokens drafted a step by the
    /// model's multi-token-prediction layer (speculative decoding; 0 is the scheduler without
    /// it, the like-for-like baseline). Greedy unless `--temperature`; reports the acceptance
    /// too.
    #[arg(long)]
    speculative_tokens: Option<usize>,
    /// With `--speculative-tokens`: sample at this temperature (request `i` seeded with `i`),
    /// so sampled rows verify their drafts by rejection sampling; 0 is greedy.
    #[arg(long, default_value_t = 0.0, requires = "speculative_tokens")]
    temperature: f32,
    #[command(flatten)]
    precision: PrecisionArgs,
}

/// Runs the command.
pub(crate) fn run(args: BenchArgs) -> Result<()> {
    if args.prompt_len == 0 {
        bail!(
            "--prompt-len must be at least 1 (each sequence's first token comes from its prefill)"
        );
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let max_len = args.prompt_len + args.steps + 1;
    let mut rc = RunnerConfig::for_limits(args.batch, max_len);
    rc.buckets.prefill_chunk = args.prefill_chunk.min(max_len);
    if args.speculative_tokens.is_some() && (args.tokens != Tokens::Greedy || args.profile) {
        bail!("--speculative-tokens measures greedy decoding, without --profile");
    }
    let drafting = args.speculative_tokens.unwrap_or(0) > 0;
    rc.speculative_tokens = args.speculative_tokens.unwrap_or(0);
    let (cfg, weights) = match (&args.model, &args.config) {
        (Some(dir), _) => {
            let (mut cfg, ckpt) = ModelSource::new(dir)?.open()?;
            if drafting {
                cfg = cfg.with_draft_layer()?;
                deepinfer::model::mtp::share_absent_embeddings(&mut cfg, &ckpt);
            }
            let p = args.precision.choice().resolve(ckpt.float_dtype(), &cfg)?;
            rc.kv_dtype = p.kv_cache;
            deepinfer::plan::host::check_cpu_load(
                &cfg,
                &ckpt,
                &p,
                &rc,
                &dir.display().to_string(),
            )?;
            let w = ModelWeights::load(&cfg, &ckpt, &p)?;
            (cfg, w)
        }
        (None, Some(_)) if drafting => {
            bail!("--speculative-tokens needs --model (random weights draft nothing useful)")
        }
        (None, Some(file)) => {
            let cfg = ModelConfig::from_file(file)?;
            let p = args.precision.choice().resolve(cfg.saved_dtype, &cfg)?;
            rc.kv_dtype = p.kv_cache;
            let w = ModelWeights::random(&cfg, 0, &p)?;
            (cfg, w)
        }
        (None, None) => bail!("pass --model or --config"),
    };
    let vocab = cfg.vocab_size as u32;
    let mut alloc = BlockAllocator::new(rc.num_blocks, rc.block_size)?;
    let mut runner = runner::open_with_weights(Backend::Cpu, cfg, weights, rc)?;
    if args.speculative_tokens.is_some() {
        return scheduled(&args, runner);
    }
    let mut tables = vec![Vec::new(); args.batch];
    let mut tokens = Vec::with_capacity(args.batch);
    let mut random = SplitMix64(args.seed);
    let mut feed = move |fallback: u32| match args.tokens {
        Tokens::Greedy => fallback,
        Tokens::Random => random.below(vocab),
        Tokens::Zeros => 0,
    };
    // Each prompt is prefilled in chunks of the runner's prefill chunk, as `serve` does, so a
    // long context (`--prompt-len 4096`) is a series of steps rather than one refused graph.
    let chunk_len = runner.runner_config().buckets.prefill_chunk.max(1);
    if args.profile {
        profile::start();
    }
    let prefill_started = Instant::now();
    for (i, table) in tables.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..args.prompt_len as u32)
            .map(|j| feed((j * 7 + i as u32 * 13 + 1) % vocab))
            .collect();
        alloc.grow(table, args.prompt_len)?;
        let mut next = None;
        for (c, piece) in prompt.chunks(chunk_len).enumerate() {
            let chunk = PrefillChunk {
                tokens: piece,
                start: c * chunk_len,
                blocks: table,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            };
            let out = runner.replay(&Step::Prefill {
                chunks: &[chunk],
                logits: LogitsOutput::None,
            })?;
            next = out.next_tokens.first().copied();
        }
        tokens.extend(next.map(&mut feed));
    }
    let prefill_secs = prefill_started.elapsed().as_secs_f64();
    let prefill_ops = if args.profile {
        profile::stop()
    } else {
        Vec::new()
    };
    let prefill_tps = (args.batch * args.prompt_len) as f64 / prefill_secs;
    let mut run_step = |step: usize, tokens: &mut Vec<u32>| -> Result<()> {
        let position = args.prompt_len + step;
        for t in tables.iter_mut() {
            alloc.grow(t, position + 1)?;
        }
        let rows: Vec<DecodeRow> = tables
            .iter()
            .zip(tokens.iter())
            .map(|(t, &token)| DecodeRow {
                token,
                position,
                blocks: t,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            })
            .collect();
        let step = Step::Decode {
            rows: &rows,
            logits: LogitsOutput::None,
        };
        *tokens = runner
            .replay(&step)?
            .next_tokens
            .into_iter()
            .map(&mut feed)
            .collect();
        Ok(())
    };
    run_step(0, &mut tokens)?; // builds the decode graph
    if args.profile {
        profile::start();
    }
    let start = Instant::now();
    for step in 1..=args.steps {
        run_step(step, &mut tokens)?;
    }
    let secs = start.elapsed().as_secs_f64();
    let ops = if args.profile {
        profile::stop()
    } else {
        Vec::new()
    };
    let tps = (args.batch * args.steps) as f64 / secs;
    let ms = secs * 1e3 / args.steps as f64;
    let per_step = |t: &OpTime| t.total.as_secs_f64() * 1e3 / args.steps as f64;
    if args.json {
        let ops: Vec<_> = ops
            .iter()
            .map(|(op, t)| serde_json::json!({ "op": op, "ms_per_step": per_step(t), "nodes_per_step": t.count / args.steps as u64 }))
            .collect();
        let mut v = serde_json::json!({
            "batch": args.batch,
            "tokens_per_s": tps,
            "ms_per_step": ms,
            "prompt_len": args.prompt_len,
            "prefill_tokens_per_s": prefill_tps,
        });
        if args.profile {
            v["profile"] = serde_json::Value::Array(ops);
            let prefill: Vec<_> = prefill_ops
                .iter()
                .map(|(op, t)| serde_json::json!({ "op": op, "ms": t.total.as_secs_f64() * 1e3, "nodes": t.count }))
                .collect();
            v["prefill_profile"] = serde_json::Value::Array(prefill);
        }
        emit(&v.to_string())?;
    } else {
        emit(&format!(
            "batch {}: {tps:.1} tokens/s, {ms:.2} ms/step (after a prefill of {} tokens a \
             sequence at {prefill_tps:.1} tokens/s, in chunks of {chunk_len}, graphs built on \
             first use included)",
            args.batch, args.prompt_len
        ))?;
        for (op, t) in &ops {
            emit(&format!(
                "  {op:<48} {:>8.3} ms/step {:>5.1}%  ({} nodes/step)",
                per_step(t),
                100.0 * per_step(t) / ms,
                t.count / args.steps as u64
            ))?;
        }
        if !prefill_ops.is_empty() {
            emit(&format!(
                "prefill ({:.0} ms in all, graph building included):",
                prefill_secs * 1e3
            ))?;
        }
        for (op, t) in &prefill_ops {
            let op_ms = t.total.as_secs_f64() * 1e3;
            emit(&format!(
                "  {op:<48} {op_ms:>9.1} ms {:>5.1}%  ({} nodes)",
                100.0 * op_ms / (prefill_secs * 1e3),
                t.count
            ))?;
        }
    }
    Ok(())
}

/// `--speculative-tokens`: the benchmark's greedy prompts as requests to the scheduler, each
/// generating `--steps` tokens after its first; times from the moment every request has its
/// first token to the end, and reports what speculation did.
fn scheduled(args: &BenchArgs, runner: Box<dyn deepinfer::runner::Runner>) -> Result<()> {
    let vocab = runner.config().vocab_size as u32;
    let mut scheduler = Scheduler::new(runner, None, Vec::new())?;
    scheduler.set_prefix_caching(false)?;
    for i in 0..args.batch {
        let prompt: Vec<u32> = (0..args.prompt_len as u32)
            .map(|j| (j * 7 + i as u32 * 13 + 1) % vocab)
            .collect();
        let mut params = GenerationParams {
            ignore_eos: true,
            ..GenerationParams::greedy(args.steps + 1)
        };
        params.sampling.temperature = args.temperature;
        params.sampling.seed = i as u32;
        scheduler.add(i as u64, prompt, params)?;
    }
    let prefill_started = Instant::now();
    let mut started: Option<(Instant, usize)> = None;
    let mut first = vec![false; args.batch];
    let mut generated = 0;
    while !scheduler.is_idle() {
        for o in scheduler.step() {
            match o.event {
                Event::Token(_) => {
                    generated += 1;
                    first[o.id as usize] = true;
                }
                Event::Failed { message, .. } => bail!("{message}"),
                _ => {}
            }
        }
        if started.is_none() && first.iter().all(|&f| f) {
            started = Some((Instant::now(), generated));
        }
    }
    let prefill_secs = match started {
        Some((t, _)) => t.duration_since(prefill_started).as_secs_f64(),
        None => 0.0,
    };
    let (start, before) = started.unwrap_or((Instant::now(), generated));
    let secs = start.elapsed().as_secs_f64();
    let tps = (generated - before) as f64 / secs;
    let s = scheduler.speculative_stats();
    if args.json {
        emit(
            &serde_json::json!({
                "batch": args.batch,
                "tokens_per_s": tps,
                "prompt_len": args.prompt_len,
                "prefill_secs": prefill_secs,
                "speculative_tokens": args.speculative_tokens,
                "temperature": args.temperature,
                "verify_steps": s.verify_steps,
                "drafted": s.drafted,
                "accepted": s.accepted,
                "acceptance_rate": s.acceptance_rate(),
                "tokens_per_row_step": s.tokens_per_row_step(),
            })
            .to_string(),
        )?;
    } else {
        emit(&format!(
            "batch {}: {tps:.1} tokens/s through the scheduler at temperature {} with {} drafted \
             tokens a step ({} of {} drafts accepted, {:.1}%; {:.2} tokens a row per verify step)",
            args.batch,
            args.temperature,
            args.speculative_tokens.unwrap_or(0),
            s.accepted,
            s.drafted,
            100.0 * s.acceptance_rate(),
            s.tokens_per_row_step()
        ))?;
    }
    Ok(())
}

/// `--tokens random`'s generator: SplitMix64 (Steele, Lea and Flood, 2014), seeded, so a run's
/// token stream is the same on every machine.
struct SplitMix64(u64);

impl SplitMix64 {
    /// Uniform in `0..n` (`n` > 0): the next value's top 32 bits scaled by `n`.
    fn below(&mut self, n: u32) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (((z >> 32) * n as u64) >> 32) as u32
    }
}
