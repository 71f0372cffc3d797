//! The CPU twin of the device runner: the same graphs, run by candle-core on the host.
//!
//! It owns the weights (bound to every graph by name), the KV root (bound as input and
//! aliased output of every graph, updated in place) and one graph per bucket. Capture records
//! the buckets and forgets the graphs of earlier captures; each graph is built the first time
//! a step needs it and kept, because on the CPU building is cheap and a server configured for
//! `--max-batch 32 --max-len 2048` would otherwise build a hundred graphs it may never run.
//!
//! With tensor parallelism (`tp > 1`) each rank holds its own weight shards and its own copy
//! of the (replicated) KV root, and a step runs every rank's graph on its own thread; the
//! graphs' collectives meet in one [`Group`]. This is the CPU meaning of a sharded graph: what
//! nrt-sim runs per NeuronCore, and what the tests hold against `tp = 1` and transformers.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor as CTensor};

use crate::backend::cpu::{self, Group, Value, DEFAULT_COLLECTIVE_TIMEOUT};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::graph::{Graph, InputRole};
use crate::model::{
    self, CacheLayout, GraphSpec, LogitsOutput, ModelWeights, MoeStrategy, Sampler, WeightSpecs,
};

use super::step::{self, HostArray, HostData};
use super::{Backend, Buckets, Runner, RunnerConfig, Step, StepKind, StepOutput};

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
    graphs: HashMap<(StepKind, usize, usize, usize, LogitsOutput, Sampler), Graph>,
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
                model::cache_roots(&cfg, &layout)
                    .into_iter()
                    .map(|r| {
                        let t = CTensor::zeros(
                            (r.rows, r.cols),
                            cpu::candle_dtype(r.dtype),
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
            graphs: HashMap::new(),
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
    ) -> Result<Graph> {
        let key = (kind, rows, seqs, ctx, logits, sampler);
        if let Some(g) = self.graphs.get(&key) {
            return Ok(g.clone());
        }
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
        let g = match kind {
            StepKind::Decode => model::build_decode(&self.cfg, &self.specs, &self.layout, &spec)?,
            StepKind::Prefill => model::build_prefill(&self.cfg, &self.specs, &self.layout, &spec)?,
        };
        self.graphs.insert(key, g.clone());
        Ok(g)
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
                InputRole::Metadata => metadata
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

    /// Runs `graph` (on every rank, each on its own thread, when `tp > 1`) and returns rank
    /// 0's outputs; every rank samples the same tokens from the same gathered logits.
    fn run(&mut self, graph: &Graph, metadata: &[HostArray]) -> Result<Vec<CTensor>> {
        let metadata = metadata_tensors(metadata)?;
        let Some(group) = self.group.clone() else {
            return cpu::run_values(graph, &self.inputs(graph, &metadata, 0)?);
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
        Ok(outs.swap_remove(0))
    }

    /// Runs `graph` and keeps the first `real_samples` sampled tokens and `real_logits` logits
    /// rows (the rest are padding).
    fn execute(
        &mut self,
        graph: &Graph,
        metadata: &[HostArray],
        real_samples: usize,
        real_logits: usize,
    ) -> Result<StepOutput> {
        let outputs = self.run(graph, metadata)?;
        let get = |name: &str| graph.output_index(name).map(|i| &outputs[i]);
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
                let (t, seqs, ctx) = self.runner_cfg.buckets.prefill_bucket(chunks, vocab)?;
                let graph = self.graph(StepKind::Prefill, t, seqs, ctx, *logits, Sampler::Full)?;
                let meta = step::prefill_step(chunks, t, seqs, ctx, block_size, vocab)?;
                let real = match logits {
                    LogitsOutput::AllPositions => chunks.iter().map(|c| c.tokens.len()).sum(),
                    _ => chunks.len(),
                };
                self.execute(&graph, &meta, chunks.len(), real)
            }
            Step::Decode { rows, logits } => {
                let (batch, ctx) = self.runner_cfg.buckets.decode_bucket(rows, vocab)?;
                let want = match logits {
                    LogitsOutput::None => LogitsOutput::None,
                    _ => LogitsOutput::Sampled,
                };
                // A step of greedy rows without logit controls needs only the argmax.
                let sampler = match rows
                    .iter()
                    .all(|r| r.sampling.is_plain_greedy() && r.controls.is_identity())
                {
                    true => Sampler::Greedy,
                    false => Sampler::Full,
                };
                let graph = self.graph(StepKind::Decode, batch, batch, ctx, want, sampler)?;
                let meta = step::decode_step(rows, batch, ctx, block_size, vocab)?;
                self.execute(&graph, &meta, rows.len(), rows.len())
            }
        }
    }

    fn destroy(&mut self) -> Result<()> {
        self.graphs.clear();
        Ok(())
    }
}
