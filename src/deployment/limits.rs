//! What a user sizes and types a deployment by ([`Limits`]): the flags the CLI, the server and
//! the memory plan share, resolved into a [`RunnerConfig`] before any runner exists.

use std::time::Duration;

use crate::backend::neuron::compile::CompilerConfig;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::PrecisionChoice;

use super::{InstanceSecret, RankSpan, RunnerConfig};

/// The default share of each core's HBM a plan may use.
pub const DEFAULT_HBM_UTILIZATION: f64 = 0.9;

/// What a user sizes and types a runner by: [`Limits::runner_config`] turns it into buckets and
/// a cache; its `precision` resolves into the dtypes weights and cache are held in.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Sequences decoded together at most (the largest batch bucket).
    pub max_batch: usize,
    /// Longest sequence, prompt plus completion; capped at the model's
    /// `max_position_embeddings`.
    pub max_len: usize,
    /// KV-cache blocks, scratch included (default: every sequence at full length).
    pub kv_blocks: Option<usize>,
    /// `--kv-blocks auto`: on a device, as many blocks as fit each NeuronCore's HBM after the
    /// weights, metadata, outputs and NEFF (the memory plan's [`crate::plan::auto_kv_blocks`]);
    /// overrides `kv_blocks`. On the CPU, the default.
    pub kv_blocks_auto: bool,
    /// `--hbm-utilization`: the share of each NeuronCore's HBM the memory plan may fill.
    pub hbm_utilization: f64,
    /// Most prompt tokens per prefill step (default: 64, at most `max_len`).
    pub prefill_chunk: Option<usize>,
    /// Most sequences one prefill step packs (default
    /// [`super::DEFAULT_PREFILL_SEQS`], at most `max_batch`; 1 turns packing off).
    pub prefill_seqs: Option<usize>,
    /// `--dtype`, `--kv-dtype`, `--quantize`.
    pub precision: PrecisionChoice,
    /// `--compile-timeout`: how long one neuronx-cc process may run (default
    /// [`crate::backend::neuron::compile::DEFAULT_TIMEOUT`]).
    pub compile_timeout: Option<Duration>,
    /// `--tp`: the tensor-parallel degree (default 1).
    pub tp: usize,
    /// `--ranks`: the global ranks this process runs (default: all of them); fewer when the
    /// model spans several instances (see [`crate::runner::instances`]).
    pub ranks: Option<RankSpan>,
    /// `--followers`: the addresses of the processes running the other ranks, in rank order,
    /// for the leader of a model over several instances; empty for one instance.
    pub followers: Vec<String>,
    /// The secret the leader proves to its followers ([`super::ENV_SECRET`]);
    /// required with `followers`.
    pub instance_secret: Option<InstanceSecret>,
    /// `--split-sampler`: device decode steps run the forward pass and the sampler as two
    /// graphs, so constrained rows' masks are computed while the forward pass runs
    /// ([`crate::runner::DeviceOptions::split_sampler`]). The CPU backend ignores it.
    pub split_sampler: bool,
    /// Capture returns once the first buckets are loaded and the rest compile in the
    /// background ([`DeviceOptions::background_compile`](crate::runner::DeviceOptions::background_compile);
    /// `deepinfer serve`'s default). Only
    /// where this process runs every rank with no followers; otherwise, and on the CPU, every
    /// bucket is captured first.
    pub background_compile: bool,
    /// `--speculative-tokens`: tokens drafted a sequence per decode step with the model's MTP
    /// layer (0: off). The CPU backend only, for now.
    pub speculative_tokens: usize,
}

impl Limits {
    /// `max_batch` sequences of up to `max_len` tokens, default cache and chunk.
    pub fn new(max_batch: usize, max_len: usize) -> Self {
        Limits {
            max_batch,
            max_len,
            kv_blocks: None,
            kv_blocks_auto: false,
            hbm_utilization: DEFAULT_HBM_UTILIZATION,
            prefill_chunk: None,
            prefill_seqs: None,
            precision: PrecisionChoice::default(),
            compile_timeout: None,
            tp: 1,
            ranks: None,
            followers: Vec::new(),
            instance_secret: None,
            split_sampler: false,
            background_compile: false,
            speculative_tokens: 0,
        }
    }

    /// The compiler configuration a Neuron capture within these limits uses: the defaults
    /// ([`CompilerConfig::default`]) with `compile_timeout` applied.
    pub fn compiler_config(&self) -> CompilerConfig {
        let mut cc = CompilerConfig::default();
        if let Some(t) = self.compile_timeout {
            cc.timeout = t;
        }
        cc
    }

    /// The runner configuration for `cfg` within these limits, or an error naming the limit
    /// that cannot work.
    pub fn runner_config(&self, cfg: &ModelConfig) -> Result<RunnerConfig> {
        if self.max_batch == 0 {
            return Err(Error::InvalidInput("--max-batch must be at least 1".into()));
        }
        if self.max_len == 0 {
            return Err(Error::InvalidInput("--max-len must be at least 1".into()));
        }
        crate::model::shard::validate(cfg, self.tp)?;
        let max_len = self.max_len.min(cfg.max_position_embeddings);
        let mut rc = RunnerConfig::for_limits(self.max_batch, max_len);
        rc.tp = self.tp;
        // A verify step feeds a token and its drafts: they must fit the longest sequence.
        if self.speculative_tokens >= max_len {
            return Err(Error::InvalidInput(format!(
                "--speculative-tokens {} leaves no room in sequences of {max_len} tokens: at \
                 most {} works (or raise --max-len)",
                self.speculative_tokens,
                max_len.saturating_sub(1)
            )));
        }
        rc.speculative_tokens = self.speculative_tokens;
        let longest = rc.buckets.max_len();
        if let Some(blocks) = self.kv_blocks {
            let one_sequence = longest.div_ceil(rc.block_size) + 1;
            if blocks < one_sequence {
                return Err(Error::InvalidInput(format!(
                    "--kv-blocks {blocks} cannot hold even one sequence of {longest} tokens: at \
                     least {one_sequence} blocks are needed (or lower --max-len)"
                )));
            }
            rc.num_blocks = blocks;
        }
        if let Some(chunk) = self.prefill_chunk {
            if chunk == 0 {
                return Err(Error::InvalidInput(
                    "--prefill-chunk must be at least 1".into(),
                ));
            }
            rc.buckets.prefill_chunk = chunk.min(longest);
        }
        if let Some(seqs) = self.prefill_seqs {
            if seqs == 0 {
                return Err(Error::InvalidInput(
                    "--max-prefill-seqs must be at least 1".into(),
                ));
            }
            rc.buckets.prefill_seqs = seqs.min(self.max_batch);
        }
        Ok(rc)
    }
}
