//! `deepinfer lower`: every bucket graph as XLA HLO with a manifest, optionally compiled to
//! NEFFs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use deepinfer::backend::neuron::compile::{compile_all, CompileJob, CompilerConfig};
use deepinfer::export::{self, LowerOptions};

use crate::{default_model_dir, emit, PrecisionArgs};

#[derive(Args)]
pub(crate) struct LowerArgs {
    /// Checkpoint directory (only config.json is needed unless --inputs-from-token-ids is given).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Decode batch sizes, one graph each.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch_sizes: Vec<usize>,
    /// Context bucket of every graph (a multiple of 16).
    #[arg(long, default_value_t = 128)]
    ctx: usize,
    /// Also write each graph's inputs (and CPU outputs) for the step that decodes the last of
    /// these tokens in row 0 after the others were prefilled.
    #[arg(long, value_delimiter = ',')]
    inputs_from_token_ids: Option<Vec<u32>>,
    /// Print each graph's instruction count, bytes read/written and FLOPs per step, next to the
    /// decode floor (works from config.json alone).
    #[arg(long)]
    stats: bool,
    /// Also compile every graph with neuronx-cc into `NAME.neff` (through the NEFF cache).
    #[arg(long)]
    compile: bool,
    /// The neuronx-cc executable.
    #[arg(long, default_value = "neuronx-cc")]
    neuronx_cc: PathBuf,
    /// neuronx-cc's `--target`.
    #[arg(long, default_value = "trn1")]
    neuron_target: String,
    /// Compiler processes run at once (default: one per 8 CPUs).
    #[arg(long)]
    compile_jobs: Option<usize>,
    /// The NEFF cache directory.
    #[arg(long, env = "DEEPINFER_NEFF_CACHE")]
    neff_cache: Option<PathBuf>,
    #[command(flatten)]
    precision: PrecisionArgs,
}

/// Runs the command.
pub(crate) fn run(args: LowerArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model_dir()?,
    };
    let opts = LowerOptions {
        batch_sizes: args.batch_sizes,
        ctx: args.ctx,
        inputs_from_token_ids: args.inputs_from_token_ids,
        precision: args.precision.choice(),
    };
    let manifest = export::lower(&dir, &args.out, &opts)?;
    if args.compile {
        let mut cfg = CompilerConfig {
            program: args.neuronx_cc.clone(),
            target: args.neuron_target.clone(),
            ..Default::default()
        };
        if let Some(j) = args.compile_jobs {
            cfg.jobs = j.max(1);
        }
        if let Some(d) = &args.neff_cache {
            cfg.cache_dir = d.clone();
        }
        let jobs = manifest
            .graphs
            .iter()
            .map(|g| {
                let hlo = std::fs::read(args.out.join(&g.hlo))
                    .with_context(|| format!("reading {}", g.hlo))?;
                Ok(CompileJob {
                    name: g.name.clone(),
                    hlo,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for neff in compile_all(&cfg, &jobs)? {
            let path = args.out.join(format!("{}.neff", neff.name));
            std::fs::write(&path, &neff.neff)
                .with_context(|| format!("writing {}", path.display()))?;
            let how = if neff.cache_hit { "cached" } else { "compiled" };
            emit(&format!("{} -> {} ({how})", neff.name, path.display()))?;
        }
    }
    if args.stats {
        emit(export::stats_table(&manifest.costs).trim_end())?;
    } else {
        for g in &manifest.graphs {
            emit(&format!(
                "{} -> {}",
                g.name,
                args.out.join(&g.hlo).display()
            ))?;
        }
    }
    Ok(())
}
