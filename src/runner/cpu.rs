//! The CPU twin of the device runner: the same graphs, run by candle-core on the host.
//!
//! It owns the weights (bound to every graph by name), the KV root (bound as input and
//! aliased output of every graph, updated in place) and the graphs it has run. Capture records
//! the buckets (the limits a step must fit) and forgets the graphs of earlier captures.
//!
//! Unlike a NeuronCore, which can only replay the NEFFs compiled at capture, the CPU runs a
//! graph of any shape, and building one is cheap (0.2 ms for the default model, 1 ms for
//! V2-Lite). So a step does not pad to its bucket here: a decode step runs on a graph of exactly
//! its rows, and every step on a context of its longest sequence rounded up to a cache block
//! (see [`cpu_context`]). Padding would be pure waste: the default context buckets grow by 4x,
//! so a batch of sequences 300 tokens long would attend over 1,024 positions at `--max-len
//! 1024`, and the padded rows of a batch bucket would run the whole model. The graphs are kept
//! in a small least-recently-used cache ([`GraphCache`]), since a server sees the same shapes
//! again and again but may, over hours, see every one.
//!
//! With tensor parallelism (`tp > 1`) each rank holds its own weight shards and its own copy
//! of the (replicated) KV root, and a step runs every rank's graph on its own thread; the
//! graphs' collectives meet in one [`Group`]. This is the CPU meaning of a sharded graph: what
//! nrt-sim runs per NeuronCore, and what the tests hold against `tp = 1` and transformers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor as CTensor};

use crate::backend::cpu::{self, Group, DEFAULT_COLLECTIVE_TIMEOUT};
use crate::config::ModelConfig;
use crate::deployment::{Buckets, RunnerConfig, StepKind};
use crate::error::{Error, Result};
use crate::graph::{Graph, InputRole};
use crate::host::{self, Value};
use crate::model::{
    self, mtp, CacheLayout, GraphSpec, LogitsOutput, ModelWeights, MoeStrategy, Sampler,
    WeightSpecs,
};

use super::step::{self, DraftChunk, HostArray, HostData, PrefillChunk, StepArrays};
use super::{Backend, DecodeCosts, Runner, Step, StepOutput};

/// The CPU graph runner for one model.
pub struct CpuRunner {
    cfg: ModelConfig,
    specs: WeightSpecs,
    /// One set of weights per rank (the whole model at `tp = 1`).
    weights: Vec<ModelWeights>,
    layout: CacheLayout,
    /// Every rank's cache roots (the KV root, and V3.2's state root), by graph input name.
    roots: Vec<Vec<(&'static str, CTensor)>>,
    /// Where the ranks' collectives meet (`tp > 1`).
    group: Option<Arc<Group>>,
    /// Steps run so far: the step number the ranks' collectives are tagged with.
    steps: u64,
    runner_cfg: RunnerConfig,
    graphs: GraphCache,
    /// Decode steps' times by row count, for the scheduler's fair decoding.
    decode_costs: DecodeCosts,
    /// The last step's hidden states (`[rows, hidden]`, row-major) when its graph returned
    /// them (a drafting model's step, or a draft step): what the next draft step reads.
    hidden: Option<Vec<f32>>,
}

/// What a CPU graph is built for: kind, rows, sequences, context, logits, sampler.
type GraphKey = (StepKind, usize, usize, usize, LogitsOutput, Sampler);

/// How many built graphs the CPU runner keeps. A server's steady state cycles through a few
/// dozen shapes (batch sizes near its load, a context per 16 tokens of its longest sequence,
/// the two samplers); a V2-Lite decode graph is about 5,600 nodes, under a megabyte, and the
/// execution plan kept with it once it has run (`cpu::Prepared`) 121 bytes a node more.
const CACHED_GRAPHS: usize = 128;

/// The graphs built so far, each with its execution plan once it has run (see
/// [`cpu::Prepared`]), at most `capacity` ([`CACHED_GRAPHS`] in a runner), the least recently
/// used dropped first.
#[derive(Debug)]
struct GraphCache {
    graphs: HashMap<GraphKey, (cpu::Prepared, u64)>,
    capacity: usize,
    /// Lookups so far: the clock each entry's last use is stamped with.
    clock: u64,
}

impl GraphCache {
    fn new(capacity: usize) -> Self {
        GraphCache {
            graphs: HashMap::new(),
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    /// The graph for `key`, built by `build` if it is not kept.
    fn get_or_build(
        &mut self,
        key: GraphKey,
        build: impl FnOnce() -> Result<Graph>,
    ) -> Result<cpu::Prepared> {
        self.clock += 1;
        if let Some((g, used)) = self.graphs.get_mut(&key) {
            *used = self.clock;
            return Ok(g.clone());
        }
        let g = cpu::Prepared::new(build()?);
        if self.graphs.len() >= self.capacity {
            let oldest = self
                .graphs
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.graphs.remove(&k);
            }
        }
        self.graphs.insert(key, (g.clone(), self.clock));
        Ok(g)
    }

    fn len(&self) -> usize {
        self.graphs.len()
    }

    fn clear(&mut self) {
        self.graphs.clear();
    }
}

/// The context a CPU step attends over: its longest sequence (`end` positions) rounded up to a
/// whole cache block, the least a graph can take (see the module docs for why not a bucket).
fn cpu_context(end: usize, block_size: usize) -> usize {
    end.max(1).div_ceil(block_size) * block_size
}

impl std::fmt::Debug for CpuRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuRunner")
            .field("runner_cfg", &self.runner_cfg)
            .field("graphs", &self.graphs.len())
            .finish()
    }
}

impl CpuRunner {
    /// A runner with zeroed cache roots sized by `runner_cfg`; not yet captured (see
    /// [`super::open`], which captures). `weights` are the whole model's; with
    /// `runner_cfg.tp > 1` each rank takes its shards of them.
    pub fn new(cfg: ModelConfig, weights: ModelWeights, runner_cfg: RunnerConfig) -> Result<Self> {
        runner_cfg.buckets.validate(runner_cfg.block_size)?;
        let layout = runner_cfg.cache_layout();
        let tp = runner_cfg.tp;
        let weights = match tp {
            1 => vec![weights],
            _ => (0..tp)
                .map(|r| weights.shard(&cfg, r, tp))
                .collect::<Result<Vec<_>>>()?,
        };
        let roots = (0..tp)
            .map(|_| {
                model::cache_roots(&cfg, &layout)?
                    .into_iter()
                    .map(|r| {
                        let t = CTensor::zeros(
                            (r.rows, r.cols),
                            host::candle_dtype(r.dtype),
                            &Device::Cpu,
                        );
                        Ok((r.name, t?))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CpuRunner {
            specs: weights[0].specs().clone(),
            cfg,
            weights,
            layout,
            roots,
            group: (tp > 1).then(|| Group::new(tp, DEFAULT_COLLECTIVE_TIMEOUT)),
            steps: 0,
            runner_cfg,
            graphs: GraphCache::new(CACHED_GRAPHS),
            decode_costs: DecodeCosts::default(),
            hidden: None,
        })
    }

    /// Rank 0's cache roots by graph input name, the KV root first (for tools that snapshot
    /// the cache, e.g. `deepinfer lower`; every rank's roots hold the same values).
    pub fn roots(&self) -> &[(&'static str, CTensor)] {
        &self.roots[0]
    }

    /// Rank 0's prepared weights (the whole model at `tp = 1`).
    pub fn weights(&self) -> &ModelWeights {
        &self.weights[0]
    }

    /// Every rank's prepared weights, in rank order.
    pub fn rank_weights(&self) -> &[ModelWeights] {
        &self.weights
    }

    /// The cache geometry graphs are built for.
    pub fn cache_layout(&self) -> CacheLayout {
        self.layout
    }

    fn graph(
        &mut self,
        kind: StepKind,
        rows: usize,
        seqs: usize,
        ctx: usize,
        logits: LogitsOutput,
        sampler: Sampler,
    ) -> Result<cpu::Prepared> {
        let key = (kind, rows, seqs, ctx, logits, sampler);
        let (cfg, specs, layout) = (&self.cfg, &self.specs, &self.layout);
        // On the CPU the fused gather reads only the selected experts and computes only their
        // rows, so it wins at every batch size; the dense strategy only pays off on a device
        // whose bottleneck is memory traffic, not arithmetic (see `MoeStrategy::for_tokens`).
        let moe = self.runner_cfg.moe.unwrap_or(MoeStrategy::Gather);
        let spec = GraphSpec {
            rows,
            seqs,
            ctx,
            logits,
            moe,
            sampler,
        };
        self.graphs
            .get_or_build(key, || kind.build(cfg, specs, layout, &spec))
    }

    /// Rank `rank`'s inputs for `graph`, its metadata inputs from `metadata` (the step's
    /// metadata as tensors, shared by every rank: see [`metadata_tensors`]).
    fn inputs(
        &self,
        graph: &Graph,
        metadata: &[(&'static str, CTensor)],
        rank: usize,
    ) -> Result<Vec<Value>> {
        let mut inputs = Vec::with_capacity(graph.inputs().len());
        for decl in graph.inputs() {
            let t = match decl.role {
                InputRole::Weight => {
                    inputs.push(self.weights[rank].value(&decl.name)?);
                    continue;
                }
                InputRole::CacheRoot => self.roots[rank]
                    .iter()
                    .find(|(name, _)| *name == decl.name)
                    .map(|(_, t)| t.clone())
                    .ok_or_else(|| Error::Binding {
                        name: decl.name.clone(),
                        msg: "the model keeps no cache root of that name".into(),
                    })?,
                // The CPU runner runs no split decode step (it has no device to overlap).
                InputRole::Metadata | InputRole::Carried => metadata
                    .iter()
                    .find(|(name, _)| *name == decl.name)
                    .map(|(_, t)| t.clone())
                    .ok_or_else(|| Error::Binding {
                        name: decl.name.clone(),
                        msg: "no metadata given for it".into(),
                    })?,
            };
            inputs.push(Value::Tensor(t));
        }
        Ok(inputs)
    }

    /// Runs `prepared`'s graph (on every rank, each on its own thread, when `tp > 1`) and
    /// returns rank 0's outputs, with the logits (each rank's vocabulary slice) joined into
    /// whole rows; every rank samples the same tokens (see `model::vocab`).
    fn run(&mut self, prepared: &cpu::Prepared, metadata: &[HostArray]) -> Result<Vec<CTensor>> {
        let metadata = metadata_tensors(metadata)?;
        let graph = prepared.graph();
        let Some(group) = self.group.clone() else {
            return prepared.run(&self.inputs(graph, &metadata, 0)?);
        };
        let step = self.steps;
        self.steps += 1;
        // Sharded weights are tensors (a GGML-quantized model is not sharded).
        let tensor = |v: Value| match v {
            Value::Tensor(t) => Ok(t),
            Value::Quantized(_) => Err(Error::Internal("a sharded quantized weight".into())),
        };
        let inputs = (0..group.size())
            .map(|r| {
                self.inputs(graph, &metadata, r)?
                    .into_iter()
                    .map(tensor)
                    .collect()
            })
            .collect::<Result<Vec<Vec<CTensor>>>>()?;
        let mut outs = cpu::run_group(graph, &inputs, &group, step)?;
        cpu::join_logits(graph, &mut outs)?;
        Ok(outs.swap_remove(0))
    }

    /// The shape a verify or draft step of `chunks` runs at: every position of one chunk per
    /// sequence, within the decode buckets (as many sequences as the largest batch, the
    /// context they reach), the context rounded up to a block (see [`cpu_context`]).
    fn speculative_shape(&self, chunks: &[PrefillChunk<'_>]) -> Result<(usize, usize, usize)> {
        let vocab = self.cfg.vocab_size;
        if chunks.is_empty() || chunks.iter().any(|c| c.tokens.is_empty()) {
            return Err(Error::InvalidInput(
                "a verify or draft step with no rows, or a chunk of none".into(),
            ));
        }
        if let Some(t) = chunks
            .iter()
            .flat_map(|c| c.tokens)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(Error::InvalidInput(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
        let last: Vec<_> = chunks.iter().map(last_token_row).collect();
        self.runner_cfg.buckets.decode_bucket(&last, vocab)?;
        let t = chunks.iter().map(|c| c.tokens.len()).sum();
        let end = chunks.iter().map(|c| c.start + c.tokens.len()).max();
        Ok((
            t,
            chunks.len(),
            cpu_context(end.unwrap_or(1), self.layout.block_size),
        ))
    }

    /// Runs `prepared`'s graph and keeps the first `real_samples` sampled tokens and
    /// `real_logits` logits rows (the rest are padding).
    fn execute(
        &mut self,
        prepared: &cpu::Prepared,
        metadata: &[HostArray],
        real_samples: usize,
        real_logits: usize,
    ) -> Result<StepOutput> {
        let outputs = self.run(prepared, metadata)?;
        let graph = prepared.graph();
        let get = |name: &str| graph.output_index(name).map(|i| &outputs[i]);
        self.hidden = match get(mtp::HIDDEN).or_else(|| get(mtp::DRAFT_HIDDEN)) {
            Some(h) => Some(h.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        let next = get("next_tokens")
            .ok_or_else(|| Error::Binding {
                name: "next_tokens".into(),
                msg: "missing output".into(),
            })?
            .to_vec1::<i32>()?;
        let logits = match get("logits") {
            Some(t) => {
                let mut rows = t.to_vec2::<f32>()?;
                rows.truncate(real_logits);
                // Joined from the ranks' slices, which may end in padding past the vocabulary.
                for row in &mut rows {
                    row.truncate(self.cfg.vocab_size);
                }
                Some(rows)
            }
            None => None,
        };
        Ok(StepOutput {
            next_tokens: next
                .into_iter()
                .take(real_samples)
                .map(|x| x as u32)
                .collect(),
            logits,
        })
    }
}

/// A verify chunk's last position as the decode row the buckets check (its batch slot and the
/// context it reaches).
fn last_token_row<'a>(c: &PrefillChunk<'a>) -> step::DecodeRow<'a> {
    step::DecodeRow {
        token: c.tokens.last().copied().unwrap_or(0),
        position: c.start + c.tokens.len().saturating_sub(1),
        blocks: c.blocks,
        sampling: c.sampling,
        controls: c.controls,
    }
}

/// The step's host metadata as tensors, made once per step and shared by every rank.
fn metadata_tensors(metadata: &[HostArray]) -> Result<Vec<(&'static str, CTensor)>> {
    let dev = &Device::Cpu;
    metadata
        .iter()
        .map(|a| {
            let t = match &a.data {
                HostData::I32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
                HostData::F32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
                HostData::U32(v) => CTensor::from_slice(v, a.shape.as_slice(), dev)?,
            };
            Ok((a.name, t))
        })
        .collect()
}

impl Runner for CpuRunner {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn runner_config(&self) -> &RunnerConfig {
        &self.runner_cfg
    }

    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    fn capture(&mut self, buckets: &Buckets) -> Result<()> {
        buckets.validate(self.runner_cfg.block_size)?;
        self.runner_cfg.buckets = buckets.clone();
        self.graphs.clear();
        Ok(())
    }

    fn replay(&mut self, step: &Step<'_>) -> Result<StepOutput> {
        let vocab = self.cfg.vocab_size;
        let block_size = self.layout.block_size;
        match step {
            Step::Prefill { chunks, logits } => {
                // The bucket's chunk size (checked against the runner's limits), packing just
                // these chunks, on the context they reach.
                let (t, _, _) = self.runner_cfg.buckets.prefill_bucket(chunks, vocab)?;
                let seqs = chunks.len();
                let end = chunks.iter().map(|c| c.start + c.tokens.len()).max();
                let ctx = cpu_context(end.unwrap_or(1), block_size);
                let graph = self.graph(StepKind::Prefill, t, seqs, ctx, *logits, Sampler::Full)?;
                let meta = step::prefill_step(chunks, t, seqs, ctx, block_size, vocab)?;
                let real = match logits {
                    LogitsOutput::AllPositions => chunks.iter().map(|c| c.tokens.len()).sum(),
                    _ => chunks.len(),
                };
                self.execute(&graph, &meta, chunks.len(), real)
            }
            Step::Verify { chunks, logits } => {
                let (t, seqs, ctx) = self.speculative_shape(chunks)?;
                let want = match logits {
                    LogitsOutput::None => LogitsOutput::None,
                    _ => LogitsOutput::AllPositions,
                };
                // Greedy rows without logit controls need only every position's argmax.
                let greedy = chunks
                    .iter()
                    .all(|c| c.sampling.is_plain_greedy() && c.controls.is_identity());
                let (sampler, meta) = match greedy {
                    true => (
                        Sampler::Greedy,
                        step::prefill_step(chunks, t, seqs, ctx, block_size, vocab)?,
                    ),
                    false => (
                        Sampler::Rejection,
                        step::verify_step(chunks, t, seqs, ctx, block_size, vocab)?,
                    ),
                };
                let graph = self.graph(StepKind::Prefill, t, seqs, ctx, want, sampler)?;
                self.execute(&graph, &meta, t, t)
            }
            Step::Draft { chunks, logits } => {
                let prefill: Vec<PrefillChunk> =
                    chunks.iter().map(DraftChunk::as_prefill).collect();
                let (t, seqs, ctx) = self.speculative_shape(&prefill)?;
                let graph = self.graph(StepKind::Draft, t, seqs, ctx, *logits, Sampler::Full)?;
                let mut meta = StepArrays::default();
                meta.fill_prefill(&prefill, t, seqs, ctx, block_size, vocab)?;
                let width = self.cfg.hidden_size;
                meta.push_draft_hidden(self.hidden.as_deref(), width, chunks, t)?;
                let real = match logits {
                    LogitsOutput::AllPositions => chunks.iter().map(|c| c.next_tokens.len()).sum(),
                    _ => chunks.len(),
                };
                self.execute(&graph, meta.arrays(), chunks.len(), real)
            }
            Step::Decode { rows, logits } => {
                // Checked against the buckets (the runner's limits), run at its own size.
                self.runner_cfg.buckets.decode_bucket(rows, vocab)?;
                let batch = rows.len().max(1);
                let end = rows.iter().map(|r| r.position + 1).max();
                let ctx = cpu_context(end.unwrap_or(1), block_size);
                let want = match logits {
                    LogitsOutput::None => LogitsOutput::None,
                    _ => LogitsOutput::Sampled,
                };
                // A step of greedy rows without logit controls needs only the argmax.
                let sampler = match rows.iter().all(step::DecodeRow::is_plain_greedy) {
                    true => Sampler::Greedy,
                    false => Sampler::Full,
                };
                let graph = self.graph(StepKind::Decode, batch, batch, ctx, want, sampler)?;
                let meta = step::decode_step(rows, batch, ctx, block_size, vocab)?;
                // Timed without the graph's building, which a new shape pays once.
                let started = Instant::now();
                let out = self.execute(&graph, &meta, rows.len(), rows.len())?;
                self.decode_costs.record(rows.len(), started.elapsed());
                Ok(out)
            }
        }
    }

    fn destroy(&mut self) -> Result<()> {
        self.graphs.clear();
        Ok(())
    }

    fn decode_cost(&self, rows: usize) -> Option<Duration> {
        self.decode_costs.estimate(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DType, GraphBuilder};

    fn key(rows: usize) -> GraphKey {
        let logits = LogitsOutput::None;
        (StepKind::Decode, rows, rows, 16, logits, Sampler::Greedy)
    }

    fn graph(name: &str) -> Result<Graph> {
        let b = GraphBuilder::new(name);
        let x = b.input("x", InputRole::Metadata, [1], DType::F32)?;
        b.output("y", &x)?;
        b.finish()
    }

    #[test]
    fn the_graph_cache_builds_once_and_drops_the_least_recently_used() {
        let mut cache = GraphCache::new(2);
        let mut built = Vec::new();
        let mut get = |cache: &mut GraphCache, rows: usize| {
            cache
                .get_or_build(key(rows), || {
                    built.push(rows);
                    graph(&format!("g{rows}"))
                })
                .map(|g| g.graph().name().to_string())
        };
        assert_eq!(get(&mut cache, 1).unwrap(), "g1");
        assert_eq!(get(&mut cache, 2).unwrap(), "g2");
        assert_eq!(get(&mut cache, 1).unwrap(), "g1");
        // Full: 2 is the least recently used, so 3 takes its place.
        assert_eq!(get(&mut cache, 3).unwrap(), "g3");
        assert_eq!(cache.len(), 2);
        assert_eq!(get(&mut cache, 1).unwrap(), "g1");
        assert_eq!(get(&mut cache, 2).unwrap(), "g2");
        assert_eq!(built, [1, 2, 3, 2]);
    }

    #[test]
    fn a_failed_build_keeps_nothing() {
        let mut cache = GraphCache::new(2);
        let err = cache.get_or_build(key(1), || Err(Error::Internal("no".into())));
        assert!(err.is_err());
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_cpu_step_attends_over_its_longest_sequence_in_whole_blocks() {
        assert_eq!(cpu_context(1, 16), 16);
        assert_eq!(cpu_context(16, 16), 16);
        assert_eq!(cpu_context(17, 16), 32);
        assert_eq!(cpu_context(300, 16), 304);
        assert_eq!(cpu_context(0, 16), 16);
    }
}
