//! `deepinfer first-contact`: one command for the first person on a fresh trn1 that says whether
//! deepinfer works there, step by step, and writes the evidence to `DIR/report.json` and
//! `DIR/report.md` (issue 42, item 9).
//!
//! The steps are the library's own, in the order a deployment meets them: doctor, plan,
//! `lower --check neuron`, compile, capture, parity against the CPU backend, a short bench.
//! Each runs through the same functions the other commands call (never the binary itself), so a
//! step that passes here passes there. The run stops at the first failure, and the later steps
//! are listed as skipped: a report is never partial in a way that looks green.
//!
//! With `--sim` the device is nrt-sim and the compiler its stand-in, so CI runs the whole thing.
//!
//! Limits are small on purpose (`--max-batch 4 --max-len 256` by default, not serve's 32 x
//! 2048): a first contact should take minutes; a full serve capture of a large model compiles
//! for hours, and `deepinfer plan` already says whether the serve defaults fit.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Args;
use deepinfer::backend::neuron::check::CheckOptions;
use deepinfer::backend::neuron::compile::{compile_all, compiler_version, jobs, CompilerConfig};
use deepinfer::backend::neuron::doctor::doctor_report;
use deepinfer::backend::neuron::minimums::parse_version_triple;
use deepinfer::config::ModelConfig;
use deepinfer::deployment::Limits;
use deepinfer::engine::{self, BlockAllocator, StopConditions};
use deepinfer::export;
use deepinfer::graph::DType;
use deepinfer::model::LogitsOutput;
use deepinfer::plan::{self, Plan};
use deepinfer::runner::step::{DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use deepinfer::runner::{self, Backend, Runner, Step};
use deepinfer::source::ModelSource;
use serde_json::{json, Value};

/// The steps, in the order they run.
const STEPS: [&str; 7] = [
    "doctor", "plan", "check", "compile", "capture", "parity", "bench",
];

/// Greedy tokens compared per parity prompt.
const PARITY_TOKENS: usize = 16;

/// The largest logit difference parity accepts between the device and the CPU backend, for
/// weights held in f32. Both run the same graph in f32; what differs is the order of the
/// reductions (XLA's on the device, candle's on the CPU), a few ulps on logits of order 10.
const TOL_F32: f64 = 1e-3;

/// The bound for bf16 or f16 weights and cache. The weights are the same bf16 values on both
/// sides and activations are f32, but each prefill writes its KV rows in bf16 and reads them
/// back: where the two backends' f32 results differ in their last bits, a row can round to the
/// neighbouring bf16 value (one ulp, ~0.4% of it), and the logits downstream move with it
/// (`scripts/test.sh` measured ~2e-4 on the tiny fixtures between XLA and the CPU; bigger
/// models accumulate more layers). 2e-2 stays far below the logit gaps greedy decoding depends
/// on, which the token comparison checks separately.
const TOL_HALF: f64 = 2e-2;

/// Decode steps timed per batch bucket in the bench (after one untimed step).
const BENCH_STEPS: usize = 8;

/// Prompt tokens per sequence before the bench's decode steps.
const BENCH_PROMPT: usize = 16;

/// The prompt length whose prefill the bench times (time to first token).
const TTFT_PROMPT: usize = 32;

/// `deepinfer first-contact`'s flags: few on purpose, since its user has just logged in to a
/// new machine; the limits are there for a model whose capture at the defaults is too slow.
#[derive(Args)]
pub(crate) struct FirstContactArgs {
    /// Run on nrt-sim with its stand-in compiler (backend `sim`) instead of libnrt and
    /// neuronx-cc: the whole check without Trainium, as CI runs it.
    #[arg(long)]
    sim: bool,
    /// Where report.json and report.md go.
    #[arg(long, default_value = "first-contact-report")]
    out: PathBuf,
    /// Checkpoint directory or GGUF file (default: the embedded default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Sequences decoded together at most (the largest batch bucket captured and benched).
    #[arg(long, default_value_t = 4)]
    max_batch: usize,
    /// Longest sequence captured (at most the model's).
    #[arg(long, default_value_t = 256)]
    max_len: usize,
}

/// What one step found.
struct Outcome {
    ok: bool,
    figures: Value,
    /// Human-readable detail: the step's table, or its error.
    output: String,
    /// One line of key figures for report.md.
    summary: String,
}

/// One entry of the report's `steps`.
struct StepRecord {
    name: &'static str,
    ok: bool,
    skipped: bool,
    seconds: f64,
    figures: Value,
    output: String,
    summary: String,
}

/// What the steps hand each other.
struct Ctx {
    backend: Backend,
    dir: PathBuf,
    cfg: ModelConfig,
    limits: Limits,
    /// NeuronCores visible (nrt-sim's count with --sim).
    cores: usize,
    /// The runtime's version, for `--check neuron`'s large-tensor rule.
    runtime: Option<(u64, u64, u64)>,
    /// The tensor-parallel degrees whose plan fits, ascending.
    fitting: Vec<usize>,
    /// The device runner parity and bench use, from capture on: the last one captured.
    device: Option<Box<dyn Runner>>,
    /// Its tensor-parallel degree.
    device_tp: usize,
    /// doctor found no Neuron at all (no libnrt or no NeuronCore) without --sim.
    no_neuron: bool,
}

impl Ctx {
    fn limits_at(&self, tp: usize) -> Limits {
        Limits {
            tp,
            ..self.limits.clone()
        }
    }
}

/// Runs the command. Exit status: 0 when every step passed, 1 when one failed, 2 when doctor
/// found no Neuron here (and not --sim).
pub(crate) fn run(args: FirstContactArgs) -> Result<ExitCode> {
    let started = utc_now();
    let dir = match &args.model {
        Some(d) => ModelSource::new(d)?.path().to_path_buf(),
        None => crate::default_model_dir()?,
    };
    let cfg = ModelSource::new(&dir)?.config()?;
    let backend = match args.sim {
        true => Backend::Sim,
        false => Backend::Neuron,
    };
    let mut ctx = Ctx {
        backend,
        dir: dir.clone(),
        cfg,
        limits: Limits::new(args.max_batch, args.max_len),
        cores: 1,
        runtime: None,
        fitting: Vec::new(),
        device: None,
        device_tp: 1,
        no_neuron: false,
    };
    let mut records = Vec::with_capacity(STEPS.len());
    let mut failed = false;
    for name in STEPS {
        if failed {
            records.push(StepRecord {
                name,
                ok: false,
                skipped: true,
                seconds: 0.0,
                figures: json!({}),
                output: String::new(),
                summary: "skipped".into(),
            });
            continue;
        }
        eprintln!("first-contact: {name} ...");
        let t = Instant::now();
        let outcome = match name {
            "doctor" => doctor(&mut ctx),
            "plan" => plan_step(&mut ctx),
            "check" => check(&ctx),
            "compile" => compile(&ctx),
            "capture" => capture(&mut ctx),
            "parity" => parity(&mut ctx),
            _ => bench(&mut ctx),
        };
        let outcome = outcome.unwrap_or_else(|e| Outcome {
            ok: false,
            figures: json!({}),
            output: format!("{e:#}"),
            summary: "error".into(),
        });
        let seconds = t.elapsed().as_secs_f64();
        eprintln!(
            "first-contact: {name} {} ({seconds:.1} s)",
            if outcome.ok { "ok" } else { "FAILED" }
        );
        failed = !outcome.ok;
        records.push(StepRecord {
            name,
            ok: outcome.ok,
            skipped: false,
            seconds,
            figures: outcome.figures,
            output: outcome.output,
            summary: outcome.summary,
        });
    }
    // Release the device before writing (and before the process exits).
    ctx.device = None;
    let first_failure = records.iter().find(|r| !r.ok).map(|r| r.name);
    let report = json!({
        "ok": first_failure.is_none(),
        "model": dir.display().to_string(),
        "backend": backend.name(),
        "started": started,
        "first_failure": first_failure,
        "steps": records.iter().map(|r| {
            let mut v = json!({
                "name": r.name,
                "ok": r.ok,
                "seconds": r.seconds,
                "figures": r.figures,
                "output": r.output,
            });
            if r.skipped {
                v["skipped"] = json!(true);
            }
            v
        }).collect::<Vec<_>>(),
    });
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let json_path = args.out.join("report.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", json_path.display()))?;
    let md_path = args.out.join("report.md");
    std::fs::write(&md_path, markdown(&dir, backend, &started, &records))
        .with_context(|| format!("writing {}", md_path.display()))?;
    eprintln!(
        "first-contact: wrote {} and {}",
        json_path.display(),
        md_path.display()
    );
    match first_failure {
        None => {
            crate::emit("first contact: every step passed")?;
            Ok(ExitCode::SUCCESS)
        }
        Some("doctor") if ctx.no_neuron => {
            let doctor = records.first().map_or("", |r| r.output.as_str());
            eprintln!("{}", doctor.trim_end());
            eprintln!("first-contact: no Neuron on this machine (run with --sim to try nrt-sim)");
            Ok(ExitCode::from(2))
        }
        Some(name) => {
            eprintln!(
                "first-contact: step `{name}` failed; see {}",
                md_path.display()
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Step 1: what `deepinfer doctor` checks (or, with --sim, nrt-sim and its stand-in compiler).
fn doctor(ctx: &mut Ctx) -> Result<Outcome> {
    if ctx.backend == Backend::Sim {
        return doctor_sim(ctx);
    }
    let report = doctor_report();
    let libnrt_version = report.libnrt.as_ref().ok().and_then(|i| i.version.clone());
    let cores = report.neuron_cores.as_ref().ok().copied().flatten();
    let cc_version = report
        .neuronx_cc
        .as_ref()
        .ok()
        .and_then(|i| i.version.clone().ok());
    ctx.no_neuron = report.libnrt.is_err() || report.neuron_cores.is_err();
    ctx.cores = cores.map_or(1, |n| n as usize);
    ctx.runtime = libnrt_version.as_deref().and_then(parse_version_triple);
    Ok(Outcome {
        ok: report.neuron_ready(),
        figures: json!({
            "libnrt_version": libnrt_version,
            "neuron_cores": cores,
            "neuronx_cc_version": cc_version,
        }),
        output: report.to_string(),
        summary: format!(
            "libnrt {}, {} cores, neuronx-cc {}",
            libnrt_version.as_deref().unwrap_or("?"),
            cores.map_or("?".into(), |n| n.to_string()),
            cc_version.as_deref().unwrap_or("?")
        ),
    })
}

/// Step 1 with --sim: nrt-sim's library and the stand-in compiler, found as `--backend sim`
/// finds them.
fn doctor_sim(ctx: &mut Ctx) -> Result<Outcome> {
    let lib_path = runner::find_sim_library()?;
    let lib = neuron_sys::Library::open(&lib_path)
        .with_context(|| format!("loading nrt-sim from {}", lib_path.display()))?;
    let version = lib.version()?.map(|v| v.to_string());
    let cores = lib.visible_nc_count()?.unwrap_or(1) as usize;
    let cc = runner::sim_compiler_config_from_env();
    let cc_version = compiler_version(&cc)
        .with_context(|| format!("asking {} its version", cc.program.display()))?;
    ctx.cores = cores;
    ctx.runtime = version.as_deref().and_then(parse_version_triple);
    let output = format!(
        "nrt-sim      ok: {}, version {}\nNeuronCores  ok: {cores} (simulated)\ncompiler     ok: {}, version {cc_version}\n",
        lib_path.display(),
        version.as_deref().unwrap_or("unknown"),
        cc.program.display()
    );
    Ok(Outcome {
        ok: true,
        figures: json!({
            "libnrt": lib_path.display().to_string(),
            "libnrt_version": version,
            "neuron_cores": cores,
            "compiler": cc.program.display().to_string(),
            "compiler_version": cc_version,
        }),
        output,
        summary: format!("nrt-sim, {cores} cores, stand-in compiler {cc_version}"),
    })
}

/// Step 2: the memory plan a capture checks, at tp 1 and at the largest tp the cores and the
/// model's shapes allow.
fn plan_step(ctx: &mut Ctx) -> Result<Outcome> {
    let mut tps = vec![1];
    if let Some(&top) = plan::valid_tps(&ctx.cfg, ctx.cores).last() {
        if top > 1 {
            tps.push(top);
        }
    }
    let mut per_tp = Vec::new();
    let mut output = String::new();
    let mut summary = Vec::new();
    for &tp in &tps {
        let limits = ctx.limits_at(tp);
        let opts = runner::device_plan_options(&limits, ctx.cfg.saved_dtype, ctx.cores)?;
        let p = Plan::compute(&ctx.cfg, &opts)?;
        let suggestion = match p.fits() {
            true => None,
            false => {
                plan::suggest::summary(&ctx.cfg, &opts, false, &plan::suggest(&ctx.cfg, &opts)?)
            }
        };
        let top = p.per_core().iter().map(|c| c.total()).max().unwrap_or(0);
        writeln!(
            output,
            "tp {tp} on {}: per core {} of {} budget, {} KV blocks: {}",
            p.instance,
            plan::human_bytes(top),
            plan::human_bytes(p.budget_per_core),
            p.kv_blocks,
            match p.fits() {
                true => "fits".to_string(),
                false => format!("does not fit: {}", p.shortfalls().join("; ")),
            }
        )?;
        if let Some(s) = &suggestion {
            writeln!(output, "  suggestion: {s}")?;
        }
        summary.push(format!(
            "tp {tp}: {}",
            if p.fits() { "fits" } else { "no fit" }
        ));
        if p.fits() {
            ctx.fitting.push(tp);
        }
        per_tp.push(plan_json(tp, &p, suggestion));
    }
    Ok(Outcome {
        ok: !ctx.fitting.is_empty(),
        figures: json!({ "cores": ctx.cores, "tps": per_tp }),
        output,
        summary: summary.join(", "),
    })
}

fn plan_json(tp: usize, p: &Plan, suggestion: Option<String>) -> Value {
    let top = p.per_core().iter().map(|c| c.total()).max().unwrap_or(0);
    let largest = p.neffs.iter().max_by_key(|g| g.footprint.private());
    json!({
        "tp": tp,
        "instance": p.instance.name(),
        "fits": p.fits(),
        "per_core_total": top,
        "budget_per_core": p.budget_per_core,
        "kv_blocks": p.kv_blocks,
        "largest_neff": largest.map(|g| json!({
            "name": g.name,
            "instructions_estimate": g.footprint.instructions,
            "code_estimate": g.footprint.code,
            "scratch": g.footprint.scratch,
        })),
        "suggestion": suggestion,
    })
}

/// Step 3: `lower --check neuron` on the graphs of every capture that fits.
fn check(ctx: &Ctx) -> Result<Outcome> {
    let opts = CheckOptions {
        runtime: ctx.runtime,
    };
    let mut graphs = 0;
    let mut violations = Vec::new();
    let mut largest: u64 = 0;
    let mut output = String::new();
    for &tp in &ctx.fitting {
        let report = export::check_neuron(&ctx.cfg, &ctx.limits_at(tp), &opts, 1)?;
        graphs += report.graphs.len();
        for g in &report.graphs {
            largest = largest.max(g.estimated_instructions);
            for f in &g.findings {
                violations.push(format!(
                    "tp {tp} {}: {} at {}: {}",
                    g.name,
                    f.rule.name(),
                    f.instruction,
                    f.detail
                ));
            }
        }
        writeln!(output, "tp {tp}:\n{}", report.to_string().trim_end())?;
    }
    Ok(Outcome {
        ok: violations.is_empty(),
        summary: format!(
            "{graphs} graphs, {} violations, largest ~{largest} instructions",
            violations.len()
        ),
        figures: json!({
            "graphs_checked": graphs,
            "violations": violations,
            "largest_instructions_estimate": largest,
        }),
        output,
    })
}

/// The compile driver's configuration for this backend, as a capture uses it.
fn compiler(ctx: &Ctx) -> CompilerConfig {
    match ctx.backend {
        Backend::Sim => runner::sim_compiler_config_from_env(),
        _ => ctx.limits.compiler_config(),
    }
}

/// Step 4: every graph of each fitting capture through the compile driver, one at a time so
/// each NEFF's seconds are its own (on a trn1.2xlarge the driver runs one compiler at a time
/// anyway). The NEFFs land in the cache the capture reads.
fn compile(ctx: &Ctx) -> Result<Outcome> {
    let cc = compiler(ctx);
    let mut neffs = Vec::new();
    let mut output = String::new();
    let (mut hits, mut total) = (0, 0.0);
    for &tp in &ctx.fitting {
        for job in export::capture_compile_jobs(&ctx.cfg, &ctx.limits_at(tp))? {
            let t = Instant::now();
            let compiled = compile_all(&cc, std::slice::from_ref(&job))?;
            let seconds = t.elapsed().as_secs_f64();
            total += seconds;
            // The largest compiler process so far: this NEFF's own peak when it grew.
            let peak = jobs::children_peak_rss();
            for n in compiled {
                hits += usize::from(n.cache_hit);
                writeln!(
                    output,
                    "tp {tp} {}: {} bytes in {seconds:.2} s{}{}",
                    n.name,
                    n.neff.len(),
                    if n.cache_hit { " (cache hit)" } else { "" },
                    peak.map_or(String::new(), |b| format!(
                        ", compiler peak RSS so far {:.1} MiB",
                        b as f64 / (1 << 20) as f64
                    ))
                )?;
                neffs.push(json!({
                    "tp": tp,
                    "name": n.name,
                    "seconds": seconds,
                    "neff_bytes": n.neff.len(),
                    "cache_hit": n.cache_hit,
                    "compiler_peak_rss_so_far": peak,
                }));
            }
        }
    }
    Ok(Outcome {
        ok: true,
        summary: format!(
            "{} NEFFs ({hits} from the cache) in {total:.1} s",
            neffs.len()
        ),
        figures: json!({
            "compiler": cc.program.display().to_string(),
            "neffs": neffs,
            "compiler_peak_rss": jobs::children_peak_rss(),
            "compiler_peak_rss_note": "bytes, the largest resident set of any compiler process \
                this run waited for (getrusage RUSAGE_CHILDREN); per NEFF, the largest so far: \
                a NEFF's own peak where the figure grows, else at most it",
        }),
        output,
    })
}

/// Step 5: capture at tp 1, then at the largest fitting tp; the last one captured is kept for
/// parity and bench (the deployment's degree: its collectives are exercised too). Each runner
/// is released before the next opens, so two never hold the same cores' memory at once; tp 1
/// goes first because it is the simplest capture, and it fails fast: when one rank of a larger
/// capture fails to load, the others wait for their collective load's timeout before the
/// capture reports it (two minutes on nrt-sim).
fn capture(ctx: &mut Ctx) -> Result<Outcome> {
    let mut runs = Vec::new();
    for tp in ctx.fitting.clone() {
        ctx.device = None;
        let t = Instant::now();
        let runner = runner::open(ctx.backend, &ctx.dir, &ctx.limits_at(tp))
            .with_context(|| format!("capture at --tp {tp} on backend {}", ctx.backend.name()))?;
        let seconds = t.elapsed().as_secs_f64();
        let graphs = runner
            .loaded_graphs()
            .map_or(runner.runner_config().buckets.graph_count(), |g| g.len());
        runs.push(json!({ "tp": tp, "seconds": seconds, "graphs_loaded": graphs }));
        ctx.device = Some(runner);
        ctx.device_tp = tp;
    }
    let summary = runs
        .iter()
        .map(|r| {
            format!(
                "tp {}: {} graphs in {:.1} s",
                r["tp"],
                r["graphs_loaded"],
                r["seconds"].as_f64().unwrap_or(0.0)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Outcome {
        ok: true,
        figures: json!({ "captures": runs, "kept_for_parity_and_bench": { "tp": ctx.device_tp } }),
        output: String::new(),
        summary,
    })
}

/// The parity prompts: fixed token ids inside any vocabulary, of three lengths.
fn parity_prompts(vocab: usize) -> Vec<Vec<u32>> {
    [5usize, 11, 23]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|j| ((j * 31 + i * 97 + 3) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// Step 6: the device runner (at the largest fitting tp) against the CPU backend at tp 1 in the
/// same dtype: greedy tokens and every position's logits of each prompt.
fn parity(ctx: &mut Ctx) -> Result<Outcome> {
    let mut cpu = runner::open(Backend::Cpu, &ctx.dir, &ctx.limits_at(1))
        .context("opening the CPU backend for reference")?;
    let Some(device) = ctx.device.as_mut() else {
        bail!("no captured runner");
    };
    // The dtype `auto` resolved to (the checkpoint's); without dtype flags the cache's is the
    // weights'.
    let dtype = cpu.runner_config().kv_dtype;
    let half = dtype != DType::F32;
    let tol = if half { TOL_HALF } else { TOL_F32 };
    let stop = StopConditions {
        max_tokens: PARITY_TOKENS,
        stop_token_ids: Vec::new(),
    };
    let mut ok = true;
    let mut prompts = Vec::new();
    let mut output = String::new();
    for (i, prompt) in parity_prompts(ctx.cfg.vocab_size).iter().enumerate() {
        let dev_tokens = engine::generate(device, prompt, SamplingParams::GREEDY, &stop)?;
        let cpu_tokens = engine::generate(&mut cpu, prompt, SamplingParams::GREEDY, &stop)?;
        let dev_logits = engine::score(device, prompt)?;
        let cpu_logits = engine::score(&mut cpu, prompt)?;
        let finite = dev_logits
            .iter()
            .chain(&cpu_logits)
            .flatten()
            .all(|x| x.is_finite());
        let shapes_match = dev_logits.len() == cpu_logits.len()
            && dev_logits
                .iter()
                .zip(&cpu_logits)
                .all(|(a, b)| a.len() == b.len());
        let max_diff = match shapes_match {
            true => dev_logits
                .iter()
                .zip(&cpu_logits)
                .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
                .fold(0.0f32, f32::max),
            false => f32::INFINITY,
        };
        let equal = dev_tokens == cpu_tokens;
        let pass = equal && finite && shapes_match && f64::from(max_diff) <= tol;
        ok &= pass;
        writeln!(
            output,
            "prompt {i} ({} tokens): tokens {}, max |logit diff| {max_diff:.3e}{}{}",
            prompt.len(),
            if equal { "equal" } else { "DIFFER" },
            if finite {
                ""
            } else {
                ", NaN or inf in the logits"
            },
            if shapes_match {
                ""
            } else {
                ", logits of different shapes"
            },
        )?;
        if !equal {
            writeln!(output, "  device: {dev_tokens:?}\n  cpu:    {cpu_tokens:?}")?;
        }
        prompts.push(json!({
            "prompt_tokens": prompt.len(),
            "tokens_equal": equal,
            "max_abs_diff": if max_diff.is_finite() { json!(max_diff) } else { Value::Null },
            "finite": finite,
            "ok": pass,
        }));
    }
    let worst = prompts
        .iter()
        .filter_map(|p| p["max_abs_diff"].as_f64())
        .fold(0.0, f64::max);
    Ok(Outcome {
        ok,
        summary: format!(
            "{} prompts, tokens {}, max diff {worst:.2e} (tol {tol:e})",
            prompts.len(),
            if prompts.iter().all(|p| p["tokens_equal"] == json!(true)) {
                "equal"
            } else {
                "differ"
            }
        ),
        figures: json!({
            "device_tp": ctx.device_tp,
            "tolerance": tol,
            "dtype": dtype.to_string(),
            "greedy_tokens": PARITY_TOKENS,
            "prompts": prompts,
        }),
        output,
    })
}

/// Step 7: decode throughput at each captured batch bucket and the time to first token of one
/// prompt, on the kept device runner.
fn bench(ctx: &mut Ctx) -> Result<Outcome> {
    let Some(runner) = ctx.device.as_mut() else {
        bail!("no captured runner");
    };
    let vocab = runner.config().vocab_size;
    let rc = runner.runner_config().clone();
    let mut decode = Vec::new();
    let mut output = String::new();
    for &batch in &rc.buckets.batch {
        let mut alloc = BlockAllocator::new(rc.num_blocks, rc.block_size)?;
        let mut tables = vec![Vec::new(); batch];
        let mut tokens = Vec::with_capacity(batch);
        for (i, table) in tables.iter_mut().enumerate() {
            let prompt: Vec<u32> = (0..BENCH_PROMPT)
                .map(|j| ((j * 7 + i * 13 + 1) % vocab) as u32)
                .collect();
            alloc.grow(table, prompt.len())?;
            let out = runner.replay(&Step::Prefill {
                chunks: &[PrefillChunk {
                    tokens: &prompt,
                    start: 0,
                    blocks: table,
                    sampling: SamplingParams::GREEDY,
                    controls: LogitControls::NONE,
                }],
                logits: LogitsOutput::None,
            })?;
            tokens.push(
                *out.next_tokens
                    .first()
                    .context("prefill sampled no token")?,
            );
        }
        let mut timed = 0.0;
        for step in 0..=BENCH_STEPS {
            let position = BENCH_PROMPT + step;
            for t in tables.iter_mut() {
                alloc.grow(t, position + 1)?;
            }
            let rows: Vec<DecodeRow> = tables
                .iter()
                .zip(&tokens)
                .map(|(t, &token)| DecodeRow {
                    token,
                    position,
                    blocks: t,
                    sampling: SamplingParams::GREEDY,
                    controls: LogitControls::NONE,
                })
                .collect();
            let t = Instant::now();
            tokens = runner
                .replay(&Step::Decode {
                    rows: &rows,
                    logits: LogitsOutput::None,
                })?
                .next_tokens;
            // The first step is not timed: it may page in what capture left cold.
            if step > 0 {
                timed += t.elapsed().as_secs_f64();
            } else {
                runner.reset_replay_timing();
            }
        }
        let ms = timed * 1e3 / BENCH_STEPS as f64;
        let tps = (batch * BENCH_STEPS) as f64 / timed.max(f64::MIN_POSITIVE);
        // The host's own share of a step: what a faster device cannot take away.
        let host_us = runner
            .replay_timing()
            .and_then(|t| t.host_per_replay())
            .map(|d| d.as_secs_f64() * 1e6);
        writeln!(
            output,
            "decode batch {batch}: {tps:.1} tokens/s, {ms:.2} ms/step{}",
            host_us.map_or(String::new(), |us| format!(", host {us:.0} µs a replay"))
        )?;
        decode.push(json!({
            "batch": batch,
            "tokens_per_s": tps,
            "ms_per_step": ms,
            "host_us_per_replay": host_us,
        }));
    }
    let mut alloc = BlockAllocator::new(rc.num_blocks, rc.block_size)?;
    let mut table = Vec::new();
    let prompt: Vec<u32> = (0..TTFT_PROMPT)
        .map(|j| ((j * 5 + 2) % vocab) as u32)
        .collect();
    alloc.grow(&mut table, prompt.len())?;
    let t = Instant::now();
    runner.replay(&Step::Prefill {
        chunks: &[PrefillChunk {
            tokens: &prompt,
            start: 0,
            blocks: &table,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        }],
        logits: LogitsOutput::None,
    })?;
    let ttft_ms = t.elapsed().as_secs_f64() * 1e3;
    writeln!(
        output,
        "prefill of {TTFT_PROMPT} tokens: {ttft_ms:.2} ms to the first token"
    )?;
    let best = decode
        .iter()
        .filter_map(|d| d["tokens_per_s"].as_f64())
        .fold(0.0, f64::max);
    Ok(Outcome {
        ok: true,
        summary: format!("up to {best:.1} tok/s; TTFT {ttft_ms:.1} ms at {TTFT_PROMPT} tokens"),
        figures: json!({
            "tp": ctx.device_tp,
            "decode": decode,
            "decode_steps_timed": BENCH_STEPS,
            "ttft_ms": ttft_ms,
            "ttft_prompt_tokens": TTFT_PROMPT,
        }),
        output,
    })
}

/// report.md: the verdict first, a table of the steps, the first failure's output.
fn markdown(model: &Path, backend: Backend, started: &str, records: &[StepRecord]) -> String {
    let mut s = String::new();
    let failure = records.iter().find(|r| !r.ok);
    let _ = match failure {
        None => writeln!(
            s,
            "PASS: deepinfer works here: all {} steps passed (backend {}).",
            records.len(),
            backend.name()
        ),
        Some(r) => writeln!(
            s,
            "FAIL: step `{}` failed (backend {}); the steps after it did not run.",
            r.name,
            backend.name()
        ),
    };
    let _ = writeln!(s, "\nModel `{}`, started {started}.\n", model.display());
    let _ = writeln!(s, "| step | ok | seconds | key figures |");
    let _ = writeln!(s, "|---|---|---|---|");
    for r in records {
        let ok = match (r.ok, r.skipped) {
            (true, _) => "yes",
            (false, true) => "skipped",
            (false, false) => "**NO**",
        };
        let _ = writeln!(
            s,
            "| {} | {ok} | {:.1} | {} |",
            r.name,
            r.seconds,
            r.summary.replace('|', "/")
        );
    }
    if let Some(r) = failure {
        let _ = writeln!(
            s,
            "\n`{}` said:\n\n```\n{}\n```",
            r.name,
            r.output.trim_end()
        );
    }
    s
}

/// Now in UTC, as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01 (the usual era arithmetic: 400-year
/// eras of 146097 days, years starting in March so the leap day is last).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::civil_from_days;

    #[test]
    fn dates_from_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(20_792), (2026, 12, 5));
    }
}
