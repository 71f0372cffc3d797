//! `deepinfer plan`: per-core device bytes of a tensor-parallel deployment, before anything is
//! compiled, whether it fits, and what would (see `deepinfer::plan`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use deepinfer::config::ModelConfig;
use deepinfer::error::ErrorKind;
use deepinfer::model::{DTypeChoice, Quantize};
use deepinfer::plan::{
    self, gib, CoreBytes, Experts, Instance, KvBlocks, Plan, PlanOptions, Suggestion, WeightDType,
    WeightFormat,
};
use deepinfer::weights::Checkpoint;
use serde_json::{json, Value};

use crate::emit;

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// Checkpoint directory whose config.json to plan (default: the embedded default model).
    /// With safetensors files present, `--dtype auto` is their dtype.
    #[arg(long, conflicts_with = "config")]
    model: Option<PathBuf>,
    /// A config.json to plan without a checkpoint (`--dtype auto` is its torch_dtype).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The instance type: trn1.2xlarge, trn1.32xlarge or trn2.48xlarge.
    #[arg(long, default_value = "trn1.2xlarge")]
    instance: Instance,
    /// Instances the ranks span (through the Neuron runtime's collectives).
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// Tensor-parallel degree: 1, 2, 4, 8, 16, 32 or 64 ranks, one per NeuronCore.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// The weights' dtype: auto (the checkpoint's; FP8 checkpoints are dequantized to bf16, as
    /// the runner does), bf16, f16, f32, or fp8 (the published V3 storage: f8e4m3 linear
    /// weights with 128x128 f32 block scales).
    #[arg(long, default_value = "auto")]
    dtype: WeightDType,
    /// The KV cache's dtype: auto (the weights' float dtype), bf16, f16 or f32.
    #[arg(long, default_value = "auto")]
    kv_dtype: DTypeChoice,
    /// Weight-only quantization: none, experts-int8 or experts-int4 (q8_0 and q4_k are CPU
    /// formats).
    #[arg(long, default_value = "none")]
    quantize: Quantize,
    /// Sequences decoded together at most (the largest batch bucket), as for `serve`.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Longest sequence (default: the model's, at most 2048), as for `serve`.
    #[arg(long)]
    max_len: Option<usize>,
    /// Most prompt tokens per prefill step (default 64), as for `serve`.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Most sequences one prefill step packs (default 8), as for `serve`.
    #[arg(long)]
    max_prefill_seqs: Option<usize>,
    /// KV-cache blocks of 16 tokens, or `auto`: as many as fit after everything else within
    /// HBM x --hbm-utilization (default: --max-batch sequences of --max-len).
    #[arg(long)]
    kv_blocks: Option<KvBlocks>,
    /// Share of each core's HBM the plan may fill.
    #[arg(long, default_value_t = deepinfer::deployment::DEFAULT_HBM_UTILIZATION)]
    hbm_utilization: f64,
    /// Tokens drafted a sequence per decode step with the model's MTP layer, as for `serve`:
    /// the layer's weights, cache rows and draft and verify graphs are planned too.
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// Print the plan as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs the command. Exit status: 0 when the plan fits, 1 when it does not (or on a failure
/// reading the model), 2 on a flag the model or instance cannot take.
pub(crate) fn run(args: PlanArgs) -> Result<ExitCode> {
    let (config_path, saved_dtype) = match (&args.config, &args.model) {
        (Some(file), _) => (file.clone(), None),
        (None, model) => {
            let dir = match model {
                Some(d) if deepinfer::gguf::is_gguf(d) => anyhow::bail!(
                    "plan reads a checkpoint directory or a config.json, not a GGUF file ({})",
                    d.display()
                ),
                Some(d) if d.is_dir() => d.clone(),
                Some(d) => anyhow::bail!(
                    "model directory {} does not exist or is not a directory",
                    d.display()
                ),
                None => crate::default_model_dir()?,
            };
            let has_weights = std::fs::read_dir(&dir)?
                .filter_map(|e| e.ok())
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
            let saved = if has_weights {
                Checkpoint::open(&dir)?.float_dtype()
            } else {
                None
            };
            (dir.join("config.json"), saved)
        }
    };
    let mut cfg = ModelConfig::from_file(&config_path)?;
    if args.speculative_tokens > 0 {
        cfg = cfg.with_draft_layer()?;
    }
    let opts = PlanOptions {
        instance: args.instance,
        instances: args.instances,
        tp: args.tp,
        dtype: args.dtype,
        kv_dtype: args.kv_dtype,
        experts: Experts::try_from(args.quantize)?,
        max_batch: args.max_batch,
        max_len: args.max_len.unwrap_or(2048),
        prefill_chunk: args.prefill_chunk,
        prefill_seqs: args.max_prefill_seqs,
        kv_blocks: args.kv_blocks.unwrap_or_default(),
        hbm_utilization: args.hbm_utilization,
        // An offline plan: the instance's HBM (a runner asks the runtime).
        hbm_per_core: None,
        saved_dtype,
        split_sampler: false,
    };
    let plan = match Plan::compute(&cfg, &opts) {
        Ok(p) => p,
        Err(e) if e.kind() == ErrorKind::InvalidInput => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    let suggestions = plan::suggest(&cfg, &opts)?;
    let summary = plan::suggest::summary(&cfg, &opts, plan.fits(), &suggestions);
    if args.json {
        emit(&to_json(&cfg, &opts, &plan, &suggestions, summary.as_deref()).to_string())?;
    } else {
        print_table(&cfg, &config_path, &opts, &plan, summary.as_deref())?;
    }
    Ok(if plan.fits() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn quantize_name(e: Experts) -> &'static str {
    match e {
        Experts::AsWeights => "none",
        Experts::Int8 => "experts-int8",
        Experts::Int4 => "experts-int4",
        Experts::Fp4 => "fp4",
    }
}

fn dtype_name(w: WeightFormat) -> String {
    match w {
        WeightFormat::Float(d) => d.to_string(),
        WeightFormat::Fp8Block(_) => "fp8".into(),
    }
}

fn core_json(c: &CoreBytes, budget: u64) -> Value {
    json!({
        "rank": c.rank,
        "weights": c.weights,
        "kv_cache": c.kv_cache,
        "metadata": c.metadata,
        "outputs": c.outputs,
        "neff_code_estimate": c.neff_code,
        "scratchpad_estimate": c.scratchpad,
        "total": c.total(),
        "budget": budget,
        "fits": c.total() <= budget,
    })
}

fn suggestion_json(s: &Suggestion) -> Value {
    json!({
        "instance": s.instance.name(),
        "instances": s.instances,
        "tp": s.tp,
        "quantize": quantize_name(s.experts),
        "kv_blocks": match s.kv_blocks {
            KvBlocks::Auto => json!("auto"),
            KvBlocks::Exactly(n) => json!(n),
            KvBlocks::Default => Value::Null,
        },
        "kv_block_count": s.kv_block_count,
        "max_core_total": s.max_core_total,
        "budget_per_core": s.budget_per_core,
        "flags": s.flags(),
    })
}

fn to_json(
    cfg: &ModelConfig,
    opts: &PlanOptions,
    plan: &Plan,
    suggestions: &[Suggestion],
    summary: Option<&str>,
) -> Value {
    json!({
        "fits": plan.fits(),
        "instance": plan.instance.name(),
        "instances": plan.instances,
        "tp": plan.tp,
        "dtype": dtype_name(plan.weights),
        "kv_dtype": plan.kv_dtype.to_string(),
        "quantize": quantize_name(plan.experts),
        "max_batch": plan.buckets.max_batch(),
        "max_len": plan.buckets.max_len(),
        "graphs": plan.neffs.len(),
        "block_size": plan.block_size,
        "kv_blocks": plan.kv_blocks,
        "kv_blocks_auto": plan.kv_blocks_auto,
        "min_kv_blocks": plan.min_kv_blocks,
        "layers": cfg.num_hidden_layers,
        "params": plan.params,
        "weights_bytes_total": plan.weights_bytes_total,
        "replicated_bytes": plan.replicated_bytes,
        "hbm_per_core": plan.hbm_per_core,
        "hbm_utilization": opts.hbm_utilization,
        "budget_per_core": plan.budget_per_core,
        "per_core": plan.per_core().iter().map(|c| core_json(c, plan.budget_per_core)).collect::<Vec<_>>(),
        "neffs": plan.neffs.iter().map(|g| json!({
            "name": g.name,
            "instructions_estimate": g.footprint.instructions,
            "code_estimate": g.footprint.code,
            "collectives_estimate": g.footprint.collectives,
            "scratch_computed": g.footprint.scratch,
        })).collect::<Vec<_>>(),
        "host": {
            "peak": plan.host.peak(),
            "largest_checkpoint_tensor": plan.host.largest_checkpoint_tensor,
            "largest_shard": plan.host.largest_shard,
            "quantize_staging": plan.host.quantize_staging,
            "ranks_at_once": plan.host.ranks_at_once,
            "ram": plan.host.ram,
            "fits": plan.host.peak() <= plan.host.ram,
        },
        "shortfalls": plan.shortfalls(),
        "suggestion": summary,
        "suggestions": suggestions.iter().map(suggestion_json).collect::<Vec<_>>(),
    })
}

fn print_table(
    cfg: &ModelConfig,
    config_path: &std::path::Path,
    opts: &PlanOptions,
    plan: &Plan,
    summary: Option<&str>,
) -> Result<()> {
    let on = if plan.instances > 1 {
        format!("{} x {}", plan.instances, plan.instance)
    } else {
        format!("one {}", plan.instance)
    };
    emit(&format!(
        "plan for {} ({:.2}B params, {} layers) on {on} at --tp {}",
        config_path.display(),
        plan.params as f64 / 1e9,
        cfg.num_hidden_layers,
        plan.tp
    ))?;
    emit(&format!(
        "weights {}, quantize {}, KV cache {}: {} blocks of {} tokens{}; {} NEFFs (batch up to {}, context up to {})",
        plan.weights,
        quantize_name(plan.experts),
        plan.kv_dtype,
        plan.kv_blocks,
        plan.block_size,
        if plan.kv_blocks_auto { " (auto)" } else { "" },
        plan.neffs.len(),
        plan.buckets.max_batch(),
        plan.buckets.max_len(),
    ))?;
    emit(&format!(
        "weights in all: {} (each tensor once, scales included); on every rank whole: {}",
        gib(plan.weights_bytes_total),
        gib(plan.replicated_bytes)
    ))?;
    emit("")?;
    let cols = [
        "rank",
        "weights",
        "kv cache",
        "metadata",
        "outputs",
        "neff code*",
        "scratch*",
        "total",
        "budget",
    ];
    let row = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i == 0 {
                    format!("{c:<7}")
                } else {
                    format!("{c:>12}")
                }
            })
            .collect::<String>()
    };
    emit(&row(cols.iter().map(|s| s.to_string()).collect()))?;
    // Identical ranks (the usual case) share one row.
    let cores = plan.per_core();
    let mut start = 0;
    while start < cores.len() {
        let same = |c: &CoreBytes| CoreBytes { rank: 0, ..*c };
        let mut end = start;
        while end + 1 < cores.len() && same(&cores[end + 1]) == same(&cores[start]) {
            end += 1;
        }
        let c = &cores[start];
        let ranks = if end > start {
            format!("{start}-{end}")
        } else {
            format!("{start}")
        };
        let mut cells = vec![ranks];
        cells.extend(
            [
                c.weights,
                c.kv_cache,
                c.metadata,
                c.outputs,
                c.neff_code,
                c.scratchpad,
                c.total(),
                plan.budget_per_core,
            ]
            .map(plan::human_bytes),
        );
        emit(&row(cells))?;
        start = end + 1;
    }
    emit(&format!(
        "* from each bucket's graph (deepinfer::plan::neff): scratch is computed (the largest \
         NEFF's live intermediates); neff code is 96 MiB of runtime micro-code per physical \
         core plus, per NEFF, {} B per estimated instruction and twice the largest collective \
         (guesses; not yet measured on a trn1)\nbudget = {} HBM per core x {}",
        deepinfer::backend::neuron::footprint::BYTES_PER_INSTRUCTION,
        gib(plan.hbm_per_core),
        opts.hbm_utilization
    ))?;
    if let Some(big) = plan.neffs.iter().max_by_key(|g| g.footprint.private()) {
        emit(&format!(
            "largest NEFF: {} (~{} instructions, code {}, scratch {})",
            big.name,
            big.footprint.instructions,
            plan::human_bytes(big.footprint.private()),
            plan::human_bytes(big.footprint.scratch)
        ))?;
    }
    emit(&format!(
        "host RAM while loading: {} peak ({} ranks at once, each: largest checkpoint tensor {} \
         + largest shard {}{}) of {}",
        plan::human_bytes(plan.host.peak()),
        plan.host.ranks_at_once,
        plan::human_bytes(plan.host.largest_checkpoint_tensor),
        plan::human_bytes(plan.host.largest_shard),
        if plan.host.quantize_staging > 0 {
            format!(
                " + one expert in f32 {}",
                plan::human_bytes(plan.host.quantize_staging)
            )
        } else {
            String::new()
        },
        gib(plan.host.ram)
    ))?;
    emit("")?;
    if plan.fits() {
        emit("fits: yes")?;
    } else {
        emit(&format!("fits: no: {}", plan.shortfalls().join("; ")))?;
    }
    if let Some(s) = summary {
        emit(&format!("suggestion: {s}"))?;
    }
    Ok(())
}
