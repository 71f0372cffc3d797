//! `deepinfer lower`: a model's bucket graphs as HLO files, a manifest, and optionally the
//! inputs (and CPU-backend outputs) of one real step, so anyone can run our HLO in XLA and compare.
//!
//! Layout of the output directory, per graph `NAME` (`decode_b{B}_c{CTX}`, `prefill_t{T}_c{CTX}`,
//! and the packed prefill of two sequences `prefill_t{T}_s2_c{CTX}`):
//! `NAME.hlo.pb` (the `HloModuleProto`), `NAME.hlo.txt` (for humans), and with token ids
//! `NAME.inputs.safetensors` (every parameter's value, keyed by parameter name) and
//! `NAME.outputs.safetensors` (what the CPU backend computes from them, keyed by output name).
//! Graphs return the logits the device runner binds (decode: the sampled rows'; prefill: every
//! position's), so their statistics count what a device step really writes. The decode step's
//! inputs feed one sequence's next token on every row: row 0 greedy (its logits are what
//! transformers is checked against), the others sampled with each filter, a logit bias and an
//! allowed-token mask in turn, so the sampler's draws are compared too.
//! `manifest.json` lists every graph's parameters (HLO parameter order), outputs (root tuple
//! order) and aliases, and the tensor-parallel degree `tp`.
//!
//! Tensor parallelism ([`lower_sharded`] with `ranks > 1`, `deepinfer lower --tp N`): every rank
//! runs the same module, so there is still one `NAME.hlo.pb` per graph (its collectives name the
//! replica group `{0..N}`); what differs per rank is its weight shards and
//! [`crate::model::shard::SHARD_OFFSETS`], so the inputs are one `NAME.rank{r}.inputs.safetensors`
//! per rank (that rank's shards, the shared metadata, and the KV root: rank 0's, as every
//! rank's root holds the same values). All ranks compute the same outputs (checked here) but
//! the logits, of which each rank computes its vocabulary slice's columns, so
//! `NAME.outputs.safetensors` is written once, with the whole logits rows (rank `r`'s are
//! columns `r * vocab / N` onwards). At `tp = 1` the files are exactly those of an unsharded
//! model.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor as CTensor;
use serde::Serialize;

use crate::backend::cpu::{self, Group, DEFAULT_COLLECTIVE_TIMEOUT};
use crate::backend::hlo;
use crate::backend::hlo::proto::HloModuleProto;
use crate::backend::neuron::check::{check_module, CheckOptions, CheckReport};
use crate::backend::neuron::compile::CompileJob;
use crate::config::v4::V4Config;
use crate::config::ModelConfig;
use crate::deployment::{Limits, RunnerConfig, StepKind};
use crate::error::{Error, Result};
use crate::graph::stats::{stats, GraphStats};
use crate::graph::{Graph, InputRole};
use crate::model::cost::{decode_floor, DecodeFloor};
use crate::model::{
    self, mtp, shard, Dots, GraphSpec, LogitsOutput, ModelWeights, MoeStrategy, PrecisionChoice,
    Sampler, WeightSpecs,
};
use crate::runner::step::{
    self, DecodeRow, DraftChunk, HostArray, HostData, LogitControls, PrefillChunk, SamplingParams,
    StepArrays,
};
use crate::runner::{CpuRunner, Runner, Step};
use crate::weights::Checkpoint;

mod v4;

/// The sequences of the packed prefill graph `lower` writes besides the unpacked one.
pub const PACKED_SEQS: usize = 2;

/// What to lower.
#[derive(Debug, Clone)]
pub struct LowerOptions {
    /// Decode batch sizes, one graph each.
    pub batch_sizes: Vec<usize>,
    /// The context bucket every graph is built for (a multiple of the block size).
    pub ctx: usize,
    /// When set: prefill all but the last of these tokens, then decode the last in row 0, and
    /// write each graph's inputs and CPU outputs for that step.
    pub inputs_from_token_ids: Option<Vec<u32>>,
    /// `--dtype`, `--kv-dtype`, `--quantize`.
    pub precision: PrecisionChoice,
    /// `--dots`: in which dtype the graphs multiply; a device's [`Dots::DEVICE`] by default
    /// (the graphs are what a NeuronCore compiles), [`Dots::Widen`] for the CPU's.
    pub dots: Dots,
    /// `--split-sampler`: each decode batch as the two graphs a split capture compiles (the
    /// forward pass to the logits, then the sampling graph reading them) instead of one.
    pub split_sampler: bool,
    /// `--speculative-tokens`: the model with its MTP layer, and speculative decoding's graphs
    /// besides: each decode batch's verify and draft graphs and the prefill chunk's draft
    /// graph (see `runner::DeviceRunner`'s speculative steps).
    pub speculative: bool,
}

/// One parameter in the manifest.
#[derive(Debug, Clone, Serialize)]
pub struct ManifestParam {
    /// HLO parameter number.
    pub index: usize,
    /// The graph input's name. Its `neff_input_names` is this name, with
    /// [`crate::backend::hlo::MUST_ALIAS_SUFFIX`] when an output aliases it.
    pub name: String,
    /// `weight`, `metadata` or `cache_root`.
    pub role: &'static str,
    /// Element type.
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
}

/// One output in the manifest.
#[derive(Debug, Clone, Serialize)]
pub struct ManifestOutput {
    /// Root tuple index.
    pub index: usize,
    /// Output name (`neff_output_names`).
    pub name: String,
    /// Element type.
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
}

/// An output that updates a parameter in place.
#[derive(Debug, Clone, Serialize)]
pub struct ManifestAlias {
    /// Root tuple index.
    pub output: usize,
    /// Parameter number.
    pub parameter: usize,
}

/// One lowered graph.
#[derive(Debug, Clone, Serialize)]
pub struct ManifestGraph {
    /// Graph name (file stem).
    pub name: String,
    /// `decode` or `prefill`.
    pub kind: &'static str,
    /// Rows (sequences for decode, tokens for prefill).
    pub batch: usize,
    /// Sequences the graph carries (decode: its rows; prefill: the chunks it packs).
    pub seqs: usize,
    /// Context bucket.
    pub ctx: usize,
    /// When inputs are written: for each row of the `logits` output, the position of the
    /// token sequence (`--inputs-from-token-ids`) whose next-token logits it holds, or `None`
    /// for a padding row. A reference run over those tokens (transformers) then checks every
    /// real row, not only decode's row 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_positions: Option<Vec<Option<usize>>>,
    /// The `.hlo.pb` file.
    pub hlo: String,
    /// The inputs file, when written for an unsharded model (`tp = 1`).
    pub inputs: Option<String>,
    /// With `tp > 1`, when inputs are written: one inputs file per rank, in rank order (empty,
    /// and left out of the manifest, otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rank_inputs: Vec<String>,
    /// The CPU backend's outputs for those inputs, when written.
    pub cpu_outputs: Option<String>,
    /// Parameters in HLO order.
    pub parameters: Vec<ManifestParam>,
    /// Outputs in root-tuple order.
    pub outputs: Vec<ManifestOutput>,
    /// In-place updates.
    pub aliases: Vec<ManifestAlias>,
}

/// `manifest.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Manifest {
    /// The tensor-parallel degree: how many ranks (replicas) run each graph.
    pub tp: usize,
    /// The model's vocabulary. The ranks' logits joined are wider when `tp` does not divide it:
    /// the last rank's slice ends in padding whose logits are `-inf` (see `model::shard`).
    pub vocab_size: usize,
    /// Every lowered graph.
    pub graphs: Vec<ManifestGraph>,
    /// Each graph's static cost, in the same order (printed by `--stats`, not written).
    #[serde(skip)]
    pub costs: Vec<GraphCost>,
}

impl Manifest {
    /// An empty manifest for `tp` ranks of a model of `vocab_size` tokens.
    fn new(tp: usize, vocab_size: usize) -> Self {
        Manifest {
            tp,
            vocab_size,
            graphs: Vec::new(),
            costs: Vec::new(),
        }
    }
}

/// The static cost of one lowered graph, next to the decode floor.
#[derive(Debug, Clone)]
pub struct GraphCost {
    /// Graph name.
    pub name: String,
    /// HLO instructions in the module (all computations).
    pub instructions: usize,
    /// Reads, writes and FLOPs of one step.
    pub stats: GraphStats,
    /// Bytes of metadata inputs.
    pub metadata_bytes: u64,
    /// For decode graphs: the unavoidable reads at the graph's dtypes.
    pub floor: Option<DecodeFloor>,
}

impl GraphCost {
    /// Bytes read per step.
    pub fn bytes_read(&self) -> u64 {
        self.stats.bytes_read(self.metadata_bytes)
    }
}

/// The `--stats` table ("cache MB" is the cache rows read: the latents gathered, and
/// V3.2's index keys).
pub fn stats_table(costs: &[GraphCost]) -> String {
    let mb = |b: f64| b / 1e6;
    let mut out = format!(
        "{:<22} {:>7} {:>12} {:>12} {:>10} {:>11} {:>10} {:>12} {:>10}\n",
        "graph",
        "instrs",
        "params MB",
        "read MB",
        "cache MB",
        "written MB",
        "GFLOP",
        "floor MB",
        "read/floor"
    );
    for c in costs {
        let written = c.stats.cache_bytes_written + c.stats.output_bytes_written;
        let (floor, ratio) = match c.floor {
            Some(f) => (
                format!("{:.1}", mb(f.total())),
                format!("{:.3}", c.bytes_read() as f64 / f.total()),
            ),
            None => ("-".into(), "-".into()),
        };
        out.push_str(&format!(
            "{:<22} {:>7} {:>12.1} {:>12.1} {:>10.1} {:>11.2} {:>10.2} {:>12} {:>10}\n",
            c.name,
            c.instructions,
            mb(c.stats.parameter_bytes as f64),
            mb(c.bytes_read() as f64),
            mb(c.stats.cache_bytes_read as f64),
            mb(written as f64),
            c.stats.flops as f64 / 1e9,
            floor,
            ratio
        ));
    }
    out
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn describe(
    graph: &Graph,
    kind: &'static str,
    batch: usize,
    seqs: usize,
    ctx: usize,
) -> ManifestGraph {
    ManifestGraph {
        name: graph.name().to_string(),
        kind,
        batch,
        seqs,
        ctx,
        reference_positions: None,
        hlo: format!("{}.hlo.pb", graph.name()),
        inputs: None,
        rank_inputs: Vec::new(),
        cpu_outputs: None,
        parameters: graph
            .inputs()
            .iter()
            .enumerate()
            .map(|(index, d)| ManifestParam {
                index,
                name: d.name.clone(),
                role: d.role.name(),
                dtype: d.dtype.name(),
                shape: d.shape.dims().to_vec(),
            })
            .collect(),
        outputs: graph
            .outputs()
            .iter()
            .enumerate()
            .map(|(index, o)| {
                let n = graph.node(o.node);
                ManifestOutput {
                    index,
                    name: o.name.clone(),
                    dtype: n.dtype.name(),
                    shape: n.shape.dims().to_vec(),
                }
            })
            .collect(),
        aliases: graph
            .outputs()
            .iter()
            .enumerate()
            .filter_map(|(output, o)| {
                o.aliases
                    .map(|parameter| ManifestAlias { output, parameter })
            })
            .collect(),
    }
}

fn host_tensor(a: &HostArray) -> Result<CTensor> {
    let dev = &candle_core::Device::Cpu;
    Ok(match &a.data {
        HostData::I32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
        HostData::F32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
        HostData::U32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
    })
}

/// Whether two tensors hold the same values bit for bit (same shape and dtype).
fn bit_identical(a: &CTensor, b: &CTensor) -> Result<bool> {
    if a.shape() != b.shape() || a.dtype() != b.dtype() {
        return Ok(false);
    }
    // Every dtype a graph outputs widens to f64 exactly (i32/u32 fit in its 53-bit mantissa).
    let wide = |t: &CTensor| -> Result<Vec<u64>> {
        Ok(t.flatten_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1::<f64>()?
            .into_iter()
            .map(f64::to_bits)
            .collect())
    };
    Ok(wide(a)? == wide(b)?)
}

/// A copy of every cache root, by name (the runner updates its roots in place).
fn snapshot(roots: &[(&'static str, CTensor)]) -> Result<Vec<(&'static str, CTensor)>> {
    roots
        .iter()
        .map(|(name, t)| Ok((*name, t.copy()?)))
        .collect()
}

/// Binds every input of `graph` for each rank (rank `r`'s weights `weights[r]`, `metadata`, a
/// copy of each of `roots`), runs it on the CPU backend (every rank on its own thread when there are
/// several), and writes the inputs (one file per rank when sharded) and rank 0's outputs as
/// safetensors. Every rank must compute the same outputs; a difference is an internal error.
/// A carried input (a split step's logits) is taken from `metadata` as whole rows, each rank
/// its vocabulary slice. Returns rank 0's outputs by name, the logits as whole rows.
/// Writes graph `g`'s HLO (`NAME.hlo.pb` and `NAME.hlo.txt`) into `out`, and its entry and
/// static cost into `manifest`.
#[allow(clippy::too_many_arguments)]
fn write_graph(
    g: &Graph,
    kind: &'static str,
    rows: usize,
    seqs: usize,
    ctx: usize,
    floor: Option<DecodeFloor>,
    out: &Path,
    manifest: &mut Manifest,
) -> Result<()> {
    let module = hlo::emit::emit(g)?;
    let metadata_bytes = g
        .inputs()
        .iter()
        .filter(|d| d.role == InputRole::Metadata)
        .map(|d| (d.shape.elem_count() * d.dtype.size_in_bytes()) as u64)
        .sum();
    manifest.costs.push(GraphCost {
        name: g.name().to_string(),
        instructions: module
            .computations
            .iter()
            .map(|c| c.instructions.len())
            .sum(),
        stats: stats(g),
        metadata_bytes,
        floor,
    });
    let pb = out.join(format!("{}.hlo.pb", g.name()));
    std::fs::write(&pb, hlo::emit::to_bytes(&module)).map_err(io_err(&pb))?;
    let txt = out.join(format!("{}.hlo.txt", g.name()));
    std::fs::write(&txt, hlo::text::render(&module)).map_err(io_err(&txt))?;
    manifest.graphs.push(describe(g, kind, rows, seqs, ctx));
    Ok(())
}

/// Where [`write_step`] finds a graph's weight inputs by name: a runner's loaded weights (one
/// per rank), or DeepSeek-V4's f32 tensors by published name.
trait WeightSource {
    fn weight(&self, name: &str) -> Result<&CTensor>;
}

impl WeightSource for ModelWeights {
    fn weight(&self, name: &str) -> Result<&CTensor> {
        self.get(name)
    }
}

impl WeightSource for HashMap<String, CTensor> {
    fn weight(&self, name: &str) -> Result<&CTensor> {
        self.get(name).ok_or_else(|| Error::Binding {
            name: name.to_string(),
            msg: "no such weight".into(),
        })
    }
}

/// Rank `r`'s (of `ranks`) inputs of `graph`, in its input order and by name: its weights,
/// copies of the cache roots, and the step's metadata (a carried input cut to the rank's
/// vocabulary slice).
fn bind(
    graph: &Graph,
    weights: &impl WeightSource,
    metadata: &[HostArray],
    roots: &[(&'static str, CTensor)],
    r: usize,
    ranks: usize,
) -> Result<(Vec<CTensor>, HashMap<String, CTensor>)> {
    let mut inputs = Vec::new();
    let mut named = HashMap::new();
    for d in graph.inputs() {
        let t =
            match d.role {
                InputRole::Weight => weights.weight(&d.name)?.clone(),
                InputRole::CacheRoot => roots
                    .iter()
                    .find(|(name, _)| *name == d.name)
                    .ok_or_else(|| Error::Binding {
                        name: d.name.clone(),
                        msg: "no cache root of that name".into(),
                    })?
                    .1
                    .copy()?,
                InputRole::Metadata | InputRole::Carried => {
                    let a = metadata.iter().find(|a| a.name == d.name).ok_or_else(|| {
                        Error::Binding {
                            name: d.name.clone(),
                            msg: "no metadata for it".into(),
                        }
                    })?;
                    let t = host_tensor(a)?;
                    // Carried logits are each rank's vocabulary slice; carried hidden states
                    // are whole on every rank.
                    match d.role {
                        InputRole::Carried if ranks > 1 && d.name == model::STEP_LOGITS => {
                            let width = t.dim(1)? / ranks;
                            t.narrow(1, r * width, width)?.contiguous()?
                        }
                        _ => t,
                    }
                }
            };
        named.insert(d.name.clone(), t.clone());
        inputs.push(t);
    }
    Ok((inputs, named))
}

fn write_step(
    graph: &Graph,
    weights: &[impl WeightSource],
    metadata: &[HostArray],
    roots: &[(&'static str, CTensor)],
    out: &Path,
    entry: &mut ManifestGraph,
) -> Result<HashMap<String, CTensor>> {
    let ranks = weights.len();
    let mut rank_inputs = Vec::with_capacity(ranks);
    for (r, weights) in weights.iter().enumerate() {
        let (inputs, named) = bind(graph, weights, metadata, roots, r, ranks)?;
        // Saved before the run: the run updates the cache root in place.
        let inputs_file = match ranks {
            1 => format!("{}.inputs.safetensors", graph.name()),
            _ => format!("{}.rank{r}.inputs.safetensors", graph.name()),
        };
        candle_core::safetensors::save(&named, out.join(&inputs_file))?;
        match ranks {
            1 => entry.inputs = Some(inputs_file),
            _ => entry.rank_inputs.push(inputs_file),
        }
        rank_inputs.push(inputs);
    }
    let outputs = match ranks {
        1 => cpu::run(graph, &rank_inputs[0])?,
        _ => {
            let group = Group::new(ranks, DEFAULT_COLLECTIVE_TIMEOUT);
            let mut all = cpu::run_group(graph, &rank_inputs, &group, 0)?;
            for (r, outs) in all.iter().enumerate().skip(1) {
                for ((o, a), b) in graph.outputs().iter().zip(outs).zip(&all[0]) {
                    if o.name != "logits" && !bit_identical(a, b)? {
                        return Err(Error::Internal(format!(
                            "{}: rank {r}'s output {} differs from rank 0's",
                            graph.name(),
                            o.name
                        )));
                    }
                }
            }
            // Each rank's logits are its vocabulary slice; the file holds the whole rows.
            cpu::join_logits(graph, &mut all)?;
            all.swap_remove(0)
        }
    };
    let named_out: HashMap<String, CTensor> = graph
        .outputs()
        .iter()
        .map(|o| o.name.clone())
        .zip(outputs)
        .collect();
    let outputs_file = format!("{}.outputs.safetensors", graph.name());
    candle_core::safetensors::save(&named_out, out.join(&outputs_file))?;
    entry.cpu_outputs = Some(outputs_file);
    Ok(named_out)
}

/// Lowers the model in `model_dir` into `out`, unsharded; see the module docs for the layout.
pub fn lower(model_dir: &Path, out: &Path, opts: &LowerOptions) -> Result<Manifest> {
    lower_sharded(model_dir, out, opts, 1)
}

/// Lowers the model in `model_dir` into `out` for `ranks`-way tensor parallelism (1: unsharded,
/// as [`lower`]); see the module docs for the layout. A degree that does not divide the model
/// is an error ([`shard::validate`]'s) before anything is written.
///
/// The degree is an argument rather than a [`LowerOptions`] field so that callers building the
/// options by struct literal (tests in several crates) keep compiling.
pub fn lower_sharded(
    model_dir: &Path,
    out: &Path,
    opts: &LowerOptions,
    ranks: usize,
) -> Result<Manifest> {
    if let Some(cfg) = V4Config::from_file_if_v4(&model_dir.join("config.json"))? {
        return v4::lower(&cfg, model_dir, out, opts, ranks);
    }
    let mut cfg = ModelConfig::from_file(&model_dir.join("config.json"))?;
    shard::validate(&cfg, ranks)?;
    let max_batch = opts.batch_sizes.iter().copied().max().unwrap_or(1);
    // Statistics need only config.json; the weights are read when inputs are written.
    let checkpoint = match &opts.inputs_from_token_ids {
        Some(_) => Some(Checkpoint::open(model_dir)?),
        None => None,
    };
    if opts.speculative {
        cfg = cfg.with_draft_layer()?;
        if let Some(c) = &checkpoint {
            mtp::share_absent_embeddings(&mut cfg, c);
        }
    }
    let saved = match &checkpoint {
        Some(c) => c.float_dtype(),
        None => cfg.saved_dtype,
    };
    let precision = opts.precision.resolve(saved, &cfg)?.with_dots(opts.dots);
    if precision.quantize.is_cpu_only() {
        return Err(precision.quantize.cpu_only_error("`deepinfer lower` (HLO)"));
    }
    let mut rc = RunnerConfig::for_limits(max_batch, opts.ctx);
    rc.kv_dtype = precision.kv_cache;
    rc.tp = ranks;
    // Room for the two sequences of the packed prefill's inputs at full length.
    rc.num_blocks = rc.num_blocks.max(2 * (opts.ctx / rc.block_size) + 2);
    if rc.buckets.max_len() != opts.ctx {
        return Err(Error::InvalidInput(format!(
            "--ctx {} must be a multiple of the block size {}",
            opts.ctx, rc.block_size
        )));
    }
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    // The same shapes `check_neuron` and the runners build graphs with (the whole model at 1).
    let specs = WeightSpecs::sharded(&cfg, &precision, ranks)?;
    let moe = |rows: usize| MoeStrategy::for_model(&cfg, rows, specs.ranks());
    let layout = rc.cache_layout();

    let mut graphs = Vec::new();
    let t = rc.buckets.prefill_chunk;
    // The unpacked prefill and a packed one of two sequences (the packing the scheduler uses
    // for a burst of prompts), then each decode batch.
    for seqs in [1, PACKED_SEQS] {
        let prefill = model::build_prefill(
            &cfg,
            &specs,
            &layout,
            &GraphSpec {
                rows: t,
                seqs,
                ctx: opts.ctx,
                logits: StepKind::Prefill.device_logits(),
                moe: moe(t),
                sampler: Sampler::Full,
            },
        )?;
        graphs.push((prefill, "prefill", t, seqs));
    }
    for &b in &opts.batch_sizes {
        let g = model::build_decode(
            &cfg,
            &specs,
            &layout,
            &GraphSpec {
                rows: b,
                seqs: b,
                ctx: opts.ctx,
                logits: StepKind::Decode.device_logits(),
                moe: moe(b),
                sampler: match opts.split_sampler {
                    true => Sampler::Deferred,
                    false => Sampler::Full,
                },
            },
        )?;
        graphs.push((g, "decode", b, b));
        if opts.split_sampler {
            graphs.push((
                model::build_sample(&cfg, &specs, &layout, b)?,
                "sample",
                b,
                b,
            ));
        }
    }

    // A drafting model's speculative graphs: each decode batch's verify graph (the rejection
    // sampler over a sequence's positions as rows) and draft graph, and the chunk's draft graph.
    if cfg.draft_layers > 0 {
        for &b in &opts.batch_sizes {
            let spec = GraphSpec {
                rows: b,
                seqs: b,
                ctx: opts.ctx,
                logits: StepKind::Verify.device_logits(),
                moe: moe(b),
                sampler: Sampler::Rejection,
            };
            graphs.push((
                StepKind::Verify.build(&cfg, &specs, &layout, &spec)?,
                "verify",
                b,
                b,
            ));
            let spec = GraphSpec {
                logits: StepKind::DecodeDraft.device_logits(),
                sampler: Sampler::Full,
                ..spec
            };
            graphs.push((
                StepKind::DecodeDraft.build(&cfg, &specs, &layout, &spec)?,
                "draft",
                b,
                b,
            ));
        }
        let spec = GraphSpec {
            rows: t,
            seqs: 1,
            ctx: opts.ctx,
            logits: StepKind::Draft.device_logits(),
            moe: moe(t),
            sampler: Sampler::Full,
        };
        let g = StepKind::Draft.build(&cfg, &specs, &layout, &spec)?;
        graphs.push((g, "draft_prefill", t, 1));
    }

    let mut manifest = Manifest::new(ranks, cfg.vocab_size);
    for (g, kind, rows, seqs) in &graphs {
        let floor =
            (*kind == "decode").then(|| decode_floor(&cfg, &specs, rc.kv_dtype, *rows, opts.ctx));
        write_graph(g, kind, *rows, *seqs, opts.ctx, floor, out, &mut manifest)?;
    }

    if let (Some(tokens), Some(checkpoint)) = (&opts.inputs_from_token_ids, &checkpoint) {
        if tokens.len() < 2 || tokens.len() > opts.ctx.min(t + 1) {
            return Err(Error::InvalidInput(format!(
                "--inputs-from-token-ids needs 2 to {} tokens (one prefill chunk, then one decode step)",
                opts.ctx.min(t + 1)
            )));
        }
        let weights = ModelWeights::load(&cfg, checkpoint, &precision)?;
        let mut runner = CpuRunner::new(cfg.clone(), weights, rc.clone())?;
        let (prompt, last) = tokens.split_at(tokens.len() - 1);
        if cfg.draft_layers > 0 && prompt.len() + SPECULATIVE_FED > opts.ctx {
            return Err(Error::InvalidInput(format!(
                "with --speculative-tokens the verify graphs feed {SPECULATIVE_FED} positions \
                 after the prompt: at most {} tokens fit --ctx {}",
                opts.ctx + 1 - SPECULATIVE_FED,
                opts.ctx
            )));
        }
        // A fresh cache: the unpacked prefill and the decode use the blocks after the scratch
        // block, the packed prefill's second sequence the ones after those.
        let per_seq = prompt.len().div_ceil(rc.block_size) as u32;
        let first = step::SCRATCH_BLOCK + 1;
        let blocks: Vec<u32> =
            (first..first + tokens.len().div_ceil(rc.block_size) as u32).collect();
        // The verify graphs' rows reach further (their extra block, if any, is one the packed
        // prefill's second sequence holds: written and read alike by both executors).
        let fed = prompt.len() + SPECULATIVE_FED;
        let spec_blocks: Vec<u32> = (first..first + fed.div_ceil(rc.block_size) as u32).collect();
        let next = first + blocks.len() as u32;
        let other: Vec<u32> = (next..next + per_seq).collect();
        let chunk = PrefillChunk {
            tokens: prompt,
            start: 0,
            blocks: &blocks,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        };
        let prefill_meta = step::prefill_step(
            std::slice::from_ref(&chunk),
            t,
            1,
            opts.ctx,
            rc.block_size,
            cfg.vocab_size,
        )?;
        let empty_root = snapshot(runner.roots())?;
        // The packed step: the prompt's first half fresh, and its second half continuing a
        // sequence whose first half is cached (in other blocks). Both halves' rows predict
        // known positions of the prompt.
        let half = prompt.len().div_ceil(2);
        let head = PrefillChunk {
            tokens: &prompt[..half],
            start: 0,
            blocks: &other,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        };
        runner.replay(&Step::Prefill {
            chunks: &[head],
            logits: LogitsOutput::None,
        })?;
        let half_root = snapshot(runner.roots())?;
        let packed = [
            PrefillChunk {
                tokens: &prompt[..half],
                start: 0,
                blocks: &blocks,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            },
            PrefillChunk {
                tokens: &prompt[half..],
                start: half,
                blocks: &other,
                sampling: SamplingParams::GREEDY,
                controls: LogitControls::NONE,
            },
        ];
        let packed_meta = step::prefill_step(
            &packed,
            t,
            PACKED_SEQS,
            opts.ctx,
            rc.block_size,
            cfg.vocab_size,
        )?;
        let packed_rows: Vec<Option<usize>> = (0..half)
            .chain(half..prompt.len())
            .map(Some)
            .chain(std::iter::repeat_n(None, t - prompt.len()))
            .collect();
        runner.replay(&Step::Prefill {
            chunks: &[chunk],
            logits: LogitsOutput::None,
        })?;
        let root = snapshot(runner.roots())?;
        // A split decode step's logits, from its forward graph to its sampling graph.
        let mut carried: Option<CTensor> = None;
        // The unpacked prefill's hidden states, which the draft graphs draft from.
        let mut hidden: Option<Vec<f32>> = None;
        for ((g, kind, rows, seqs), entry) in graphs.iter().zip(manifest.graphs.iter_mut()) {
            if matches!(*kind, "verify" | "draft" | "draft_prefill") {
                let speculative = Speculative {
                    cfg: &cfg,
                    prompt,
                    last: last[0],
                    blocks: &spec_blocks,
                    hidden: hidden.as_deref(),
                    block_size: rc.block_size,
                    ctx: opts.ctx,
                };
                let (meta, positions) = speculative.metadata(kind, *rows)?;
                entry.reference_positions = positions;
                write_step(g, runner.rank_weights(), &meta, &root, out, entry)?;
            } else if *kind == "prefill" && *seqs == 1 {
                let positions = (0..prompt.len()).map(Some);
                entry.reference_positions = Some(
                    positions
                        .chain(std::iter::repeat_n(None, t - prompt.len()))
                        .collect(),
                );
                let outs = write_step(
                    g,
                    runner.rank_weights(),
                    &prefill_meta,
                    &empty_root,
                    out,
                    entry,
                )?;
                hidden = match outs.get(mtp::HIDDEN) {
                    Some(h) => Some(h.flatten_all()?.to_vec1::<f32>()?),
                    None => None,
                };
            } else if *kind == "prefill" {
                entry.reference_positions = Some(packed_rows.clone());
                write_step(
                    g,
                    runner.rank_weights(),
                    &packed_meta,
                    &half_root,
                    out,
                    entry,
                )?;
            } else {
                // Row 0 is the greedy step transformers' logits check; the others feed the same
                // token again with sampled rows, so that XLA draws through the sampler too.
                let allowed = probe_mask(cfg.vocab_size);
                let decode_rows: Vec<DecodeRow> = (0..*rows)
                    .map(|i| DecodeRow {
                        token: last[0],
                        position: prompt.len(),
                        blocks: &blocks,
                        sampling: probe_sampling(i),
                        controls: probe_controls(i, prompt.len(), &allowed),
                    })
                    .collect();
                let mut meta = step::decode_step(
                    &decode_rows,
                    *rows,
                    opts.ctx,
                    rc.block_size,
                    cfg.vocab_size,
                )?;
                if *kind == "sample" {
                    meta.push(carried_logits(g, carried.take())?);
                    write_step(g, runner.rank_weights(), &meta, &root, out, entry)?;
                    continue;
                }
                entry.reference_positions = Some(
                    std::iter::once(Some(prompt.len()))
                        .chain(std::iter::repeat_n(None, rows - 1))
                        .collect(),
                );
                let outs = write_step(g, runner.rank_weights(), &meta, &root, out, entry)?;
                carried = outs.get(model::STEP_LOGITS).cloned();
            }
        }
    }
    write_manifest(out, manifest)
}

/// Which position of the reference each output row is, if any (`ManifestGraph`'s field).
type ReferencePositions = Option<Vec<Option<usize>>>;

/// The positions a lowered verify step feeds each sequence: its last token and two drafts.
const SPECULATIVE_FED: usize = 3;

/// What the speculative graphs' lowered inputs are made of: the prompt the prefill cached, the
/// token after it, the blocks holding them and the prefill's hidden states.
struct Speculative<'a> {
    cfg: &'a ModelConfig,
    prompt: &'a [u32],
    last: u32,
    blocks: &'a [u32],
    hidden: Option<&'a [f32]>,
    block_size: usize,
    ctx: usize,
}

impl Speculative<'_> {
    /// The metadata of graph `kind` of `rows` rows, and its rows' positions transformers'
    /// reference knows (a verify graph's first row: the decode step's).
    ///
    /// - `verify`: chunks of the last token and two drafts (the prompt's first and last
    ///   tokens), as many as fit the rows, every chunk the same tokens (so that their cache
    ///   writes agree) under its own probe sampler and controls, the first greedy.
    /// - `draft`: the MTP layer over the prompt's last `rows` positions (one chunk).
    /// - `draft_prefill`: over every position of the prompt.
    fn metadata(&self, kind: &str, rows: usize) -> Result<(Vec<HostArray>, ReferencePositions)> {
        let (n, vocab, width) = (self.prompt.len(), self.cfg.vocab_size, self.cfg.hidden_size);
        let fed = [self.last, self.prompt[0], self.prompt[n - 1]];
        let tokens: Vec<u32> = self.prompt.iter().copied().chain([self.last]).collect();
        let mut arrays = StepArrays::default();
        match kind {
            "verify" => {
                let lens: Vec<usize> = (0..rows)
                    .step_by(SPECULATIVE_FED)
                    .map(|r| SPECULATIVE_FED.min(rows - r))
                    .collect();
                let masks: Vec<Vec<u32>> = lens
                    .iter()
                    .map(|&len| probe_mask(vocab).repeat(len))
                    .collect();
                let chunks: Vec<PrefillChunk<'_>> = lens
                    .iter()
                    .zip(&masks)
                    .enumerate()
                    .map(|(i, (&len, mask))| PrefillChunk {
                        tokens: &fed[..len],
                        start: n,
                        blocks: self.blocks,
                        sampling: probe_sampling(i),
                        controls: probe_controls(i, n, mask),
                    })
                    .collect();
                let decode_rows = step::verify_rows(&chunks, vocab)?;
                arrays.fill_decode(&decode_rows, rows, self.ctx, self.block_size, vocab)?;
                arrays.push_chunks(&lens, rows)?;
                let positions = std::iter::once(Some(n))
                    .chain(std::iter::repeat_n(None, rows - 1))
                    .collect();
                return Ok((arrays.arrays().to_vec(), Some(positions)));
            }
            "draft" => {
                let from = n.saturating_sub(rows);
                let hidden_rows: Vec<usize> = (from..n).collect();
                let chunk = DraftChunk {
                    next_tokens: &tokens[from + 1..=n],
                    start: from,
                    blocks: self.blocks,
                    hidden_rows: &hidden_rows,
                };
                let chunks = [chunk];
                let decode_rows = step::draft_rows(&chunks);
                arrays.fill_decode(&decode_rows, rows, self.ctx, self.block_size, vocab)?;
                arrays.push_draft_hidden(self.hidden, width, &chunks, rows)?;
            }
            _ => {
                let hidden_rows: Vec<usize> = (0..n).collect();
                let chunks = [DraftChunk {
                    next_tokens: &tokens[1..],
                    start: 0,
                    blocks: self.blocks,
                    hidden_rows: &hidden_rows,
                }];
                let prefill = [chunks[0].as_prefill()];
                arrays.fill_prefill(&prefill, rows, 1, self.ctx, self.block_size, vocab)?;
                arrays.push_draft_hidden(self.hidden, width, &chunks, rows)?;
            }
        }
        Ok((arrays.arrays().to_vec(), None))
    }
}

/// The input a split step's sampling graph `g` reads: the logits its forward graph (the graph
/// before it) returned, `carried`.
fn carried_logits(g: &Graph, carried: Option<CTensor>) -> Result<HostArray> {
    let logits = carried
        .ok_or_else(|| Error::Internal(format!("{}: no forward graph before it", g.name())))?;
    Ok(HostArray {
        name: model::STEP_LOGITS,
        shape: logits.dims().to_vec(),
        data: HostData::F32(logits.flatten_all()?.to_vec1()?),
    })
}

/// Writes `out/manifest.json`.
fn write_manifest(out: &Path, manifest: Manifest) -> Result<Manifest> {
    let path = out.join("manifest.json");
    let json =
        serde_json::to_string_pretty(&manifest).map_err(|e| Error::Internal(e.to_string()))?;
    std::fs::write(&path, json).map_err(io_err(&path))?;
    Ok(manifest)
}

/// The sampling of row `i` of a lowered decode step's inputs: row 0 greedy, the others
/// sampled with each filter in turn (top-k with top-p, top-p with min-p, the whole vocabulary,
/// a small top-k), each with its own seed.
fn probe_sampling(i: usize) -> SamplingParams {
    let (temperature, top_k, top_p, min_p) = match i % 4 {
        _ if i == 0 => return SamplingParams::GREEDY,
        1 => (0.8, 20, 0.9, 0.0),
        2 => (1.0, 0, 0.6, 0.02),
        3 => (1.3, 0, 1.0, 0.0),
        _ => (0.7, 5, 1.0, 0.0),
    };
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: 1000 + i as u32,
        ..SamplingParams::GREEDY
    }
}

/// Biases some lowered decode rows carry (token, bias).
const PROBE_BIAS: [(u32, f32); 3] = [(1, 4.0), (5, 2.5), (9, -100.0)];

/// An allowed-token mask that keeps every third token.
fn probe_mask(vocab: usize) -> Vec<u32> {
    (0..vocab.div_ceil(32))
        .map(|w| {
            (0..32)
                .filter(|j| (32 * w + j) % 3 == 0)
                .fold(0, |m, j| m | 1 << j)
        })
        .collect()
}

/// The logit controls of row `i` of a lowered decode step's inputs: its own state row past
/// the first, a bias on every third row and the mask on every fourth.
fn probe_controls<'a>(i: usize, prompt_len: usize, allowed: &'a [u32]) -> LogitControls<'a> {
    LogitControls {
        state_row: i as u32,
        prompt_len,
        bias: if i % 3 == 1 { &PROBE_BIAS } else { &[] },
        allowed: (i % 4 == 2).then_some(allowed),
    }
}

/// `deepinfer lower --check neuron`: builds and lowers every graph a Neuron capture within
/// `limits` would compile (each decode and prefill bucket, the MoE strategy chosen per bucket as
/// the Neuron runner chooses it), and checks each emitted module
/// ([`crate::backend::neuron::check`]). Needs only the model's configuration (weights are graph
/// inputs, so their shapes come from it; precision `auto` resolves to the saved dtype in
/// config.json). `opts` says what the deployment's runtime supports; `jobs` is the number of compiler processes for the wall-time estimate.
///
/// Graphs are built, emitted and checked one at a time, so memory stays at one module.
pub fn check_neuron(
    cfg: &ModelConfig,
    limits: &Limits,
    opts: &CheckOptions,
    jobs: usize,
) -> Result<CheckReport> {
    let mut graphs = Vec::new();
    for_each_capture_graph(
        cfg,
        limits,
        "`deepinfer lower --check neuron`",
        |_, module| {
            graphs.push(check_module(module, opts));
            Ok(())
        },
    )?;
    Ok(CheckReport { graphs, jobs })
}

/// The compile jobs (one HLO module per graph, by name, each once) of a device capture within
/// `limits`, from the model's configuration alone: what `deepinfer first-contact` compiles
/// through the compile driver before capturing, so each NEFF's compile is timed and reported on
/// its own, and the capture that follows finds them in the NEFF cache. The graphs are
/// [`check_neuron`]'s (one loop builds both), with precision `auto` resolved to config.json's
/// saved dtype, as a capture's plan does.
pub fn capture_compile_jobs(cfg: &ModelConfig, limits: &Limits) -> Result<Vec<CompileJob>> {
    let mut jobs: Vec<CompileJob> = Vec::new();
    for_each_capture_graph(cfg, limits, "a device capture", |g, module| {
        if !jobs.iter().any(|j| j.name == g.name()) {
            jobs.push(CompileJob {
                name: g.name().to_string(),
                hlo: hlo::emit::to_bytes(module),
            });
        }
        Ok(())
    })?;
    Ok(jobs)
}

/// Builds and emits every graph a device capture within `limits` compiles, one at a time (so
/// memory stays at one graph), and hands each with its HLO module to `f`; `what` names the
/// caller in a CPU-only quantization's error.
fn for_each_capture_graph(
    cfg: &ModelConfig,
    limits: &Limits,
    what: &str,
    mut f: impl FnMut(&Graph, &HloModuleProto) -> Result<()>,
) -> Result<()> {
    let precision = limits
        .precision
        .resolve(cfg.saved_dtype, cfg)?
        .with_dots(Dots::DEVICE);
    if precision.quantize.is_cpu_only() {
        return Err(precision.quantize.cpu_only_error(what));
    }
    let mut rc = limits.runner_config(cfg)?;
    rc.kv_dtype = precision.kv_cache;
    rc.buckets.validate(rc.block_size)?;
    let specs = WeightSpecs::sharded(cfg, &precision, rc.tp)?;
    let layout = rc.cache_layout();
    // A sampling graph is the same for every context of its batch size: built once. Each
    // decode graph's instruction estimate is kept for its greedy variant's rule, which comes
    // after it in the list.
    let mut seen = std::collections::HashSet::new();
    let mut decode_instructions = std::collections::HashMap::new();
    for (kind, spec) in rc.buckets.capture_specs(cfg, rc.tp, limits.split_sampler) {
        if matches!(kind, StepKind::Sample | StepKind::Argmax) && !seen.insert((kind, spec.rows)) {
            continue;
        }
        let g = kind.build(cfg, &specs, &layout, &spec)?;
        let module = hlo::emit::emit(&g)?;
        let instructions = || crate::backend::neuron::check::estimate::instructions(&module);
        match kind {
            StepKind::Decode => {
                decode_instructions.insert((spec.rows, spec.ctx), instructions());
            }
            StepKind::Greedy => {
                let full = decode_instructions
                    .get(&(spec.rows, spec.ctx))
                    .copied()
                    .unwrap_or(0);
                if !crate::deployment::greedy_graph_pays(full, instructions()) {
                    continue;
                }
            }
            _ => {}
        }
        f(&g, &module)?;
    }
    Ok(())
}
