//! Continuous batching over one runner.
//!
//! Each call to [`Scheduler::step`] is one iteration:
//!
//! 1. **Decode**: every sequence that has finished its prefill feeds its last token in one
//!    decode step (the runner pads the batch to a captured bucket). Each needs room for one more
//!    slot; when the cache cannot give it, the most recently admitted sequence is preempted: its
//!    blocks are freed and it goes back to the head of the queue, to be recomputed (prompt and
//!    generated tokens prefilled again) once blocks free up. Nothing is dropped.
//! 2. **Prefill**: one packed prefill step: chunks of up to [`Buckets::prefill_seqs`]
//!    sequences side by side, within the step's token budget (the runner's largest prefill
//!    chunk, and [`Scheduler::set_max_num_batched_tokens`] minus the decode rows: vLLM's
//!    `max_num_batched_tokens`). Waiting requests are admitted first, while a batch slot and
//!    blocks for the whole sequence are free (a sequence admitted but not yet prefilled is the
//!    newest, so the first a full cache preempts, at no cost).
//!
//! # Fairness
//!
//! No single request can hold the engine:
//!
//! - Admission takes the waiting sequence whose group (the choices of one HTTP request, see
//!   [`GenerationParams::group`]) has the fewest sequences running, oldest first among equals,
//!   so a request for more choices than there are free slots runs the rest of its choices as
//!   slots free up, alongside other requests rather than ahead of them. A sequence preempted
//!   for memory goes back to the head of the queue, so it goes first among equals.
//! - When every slot is taken, a group running fewer than its fair share of the slots (their
//!   number divided among the groups running or waiting) takes one back from a group running
//!   more: that group's newest sequence is preempted and recomputed later. A request that
//!   filled an idle server with its choices thus makes room for the requests that arrive
//!   after it, at the cost of recomputing the choices it gives back.
//! - With fair decoding on ([`Scheduler::set_fair_decode`]; `deepinfer serve` turns it on for
//!   the CPU backend), while two or more requests are active each decode step takes at most
//!   an equal share of the batch from each (the slots divided among the groups running or
//!   waiting, rounded up); a request's rows beyond it sit that step out, keeping their cache,
//!   the least recently decoded going first next time. Where a step's cost grows with its
//!   rows, as on a CPU (the default model's 32-row step costs about 7 times its 1-row step),
//!   a request with many choices would otherwise slow every other request's tokens by as
//!   much; the price is its own throughput while others run. On a NeuronCore a decode step
//!   reads the weights once whatever its rows, so there the rows are better all taken.
//! - An equal share of 32 slots is still 16 rows beside one other request's one. Where the
//!   runner reports what its steps cost ([`Runner::decode_cost`]: the CPU runner measures
//!   them), the step is also bounded by cost: at most [`Scheduler::set_fair_decode_slowdown`]
//!   times (default 2) the cost of a step of one row per active request, the request with
//!   the most rows giving rows up first. Another request's tokens then come at about that
//!   many times their pace alone, whatever the model and machine.
//! - While some of a request's decoding sequences sit a step out, its sequences still to
//!   prefill (choices admitted as slots free up, or preempted ones to recompute) wait: they
//!   would only sit out too, and their prefill would go into the other requests' steps.
//! - Prefill alternates the order in which sequences get their chunks: on even steps the
//!   shortest remaining prompt first (a short prompt behind long ones finishes its prefill in
//!   one or two steps), on odd steps the oldest first (a long prompt advances at least every
//!   other step, however many short ones arrive). Chunks are added in that order while the
//!   budget lasts and a bucket packs them.
//! - Scoring (prompt log-probabilities) is prefill, chunked and packed the same way.
//!
//! # Prefix caching
//!
//! On by default ([`Scheduler::set_prefix_caching`]): an admitted sequence starts from the
//! longest run of cached full blocks its tokens begin with (see [`super::blocks`]), so only the
//! rest is prefilled, and every block a step fills is recorded for later requests. At least
//! the last token is always computed (its logits give the first sample). A request for prompt
//! log-probabilities computes its whole prompt (the cached part has no logits), as in vLLM.
//! A preempted sequence is recomputed from the cache too, so giving its blocks back costs less.
//! Off for a DeepSeek-V4 model, whose sequences keep state outside their blocks
//! ([`shares_prefixes`]).
//!
//! # Buckets still compiling
//!
//! A device runner that compiles its buckets in the background reports which are live
//! ([`Runner::live_buckets`]). The scheduler then runs at most as many sequences as the
//! largest live decode batch at the longest context (a running sequence must find a bucket
//! whatever it grows to), plans prefill chunks against the live prefill buckets only, and
//! lets the other requests wait in the queue: nothing fails because a bucket has not joined.
//!
//! So a burst of short prompts enters a few per step between decode steps, and the running
//! streams keep flowing. A failed step (a device fault) fails exactly the sequences in it; the
//! rest go on.
//!
//! [`Buckets::prefill_seqs`]: crate::deployment::Buckets::prefill_seqs

use std::collections::VecDeque;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::model::LogitsOutput;
use crate::runner::step::{DecodeRow, DraftChunk, LogitControls, PrefillChunk, LOGIT_BIAS_SLOTS};
use crate::runner::{LateMasks, Runner, Step, StepOutput};
use crate::tokenizer::Tokenizer;

use super::blocks::{BlockAllocator, PrefixCacheStats};
use super::detokenize::{IncrementalDecoder, StopStrings};
use super::grammar::{advance_all, fill_masks, Advance, Constraint};
use super::params::{FinishReason, GenerationParams};
use super::speculative::{accepted_prefix, draft_masks, DraftRows, SpeculativeStats};

/// The default of [`Scheduler::set_fair_decode_slowdown`]: while other requests run, a step
/// may cost twice a step of one row per request. On the default model a short request beside
/// a 64-choice one then takes about 2 to 3 times its idle latency at the median
/// (benches/LOG.md, "Fair decoding by cost").
pub const DEFAULT_FAIR_DECODE_SLOWDOWN: f64 = 2.0;

/// Identifies a request inside the engine.
pub type RequestId = u64;

/// One generated token of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The token id.
    pub token: u32,
    /// The text it releases (empty while a character or a possible stop string is incomplete;
    /// never the text of a stop token).
    pub text: String,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
    /// The token's log-probability and the most likely alternatives, when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

/// Log-probabilities of one generated token, under the model's distribution (the logits
/// before temperature, top-k and top-p, as vLLM and OpenAI report them).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// log p(token).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// The log-probability of `token` and the `top` most likely tokens under `logits`.
    pub fn from_logits(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
        TokenLogprobs {
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&x| x - lse),
            top: top_k(logits, top)
                .into_iter()
                .map(|(x, t)| (t, x - lse))
                .collect(),
        }
    }
}

/// The `k` largest of `logits` with their indices, largest first (equal values: the lower
/// index first), in one pass that keeps only the `k` best so far: each logit costs one
/// comparison with the k-th unless it enters. Selecting over the whole vocabulary instead
/// (an index vector of 102,400 and `select_nth_unstable`) took 0.6 ms per token per choice,
/// on the engine thread, for every request asking for log-probabilities.
fn top_k(logits: &[f32], k: usize) -> Vec<(f32, u32)> {
    let k = k.min(logits.len());
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (i, &x) in logits.iter().enumerate() {
        if best.len() == k && x.total_cmp(&best[k - 1].0).is_le() {
            continue;
        }
        // After every kept value at least as large: ties keep the lower index first.
        let at = best.partition_point(|&(y, _)| y.total_cmp(&x).is_ge());
        best.insert(at, (x, i as u32));
        best.truncate(k);
    }
    best
}

/// What happened to a request in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// It produced a token.
    Token(TokenEvent),
    /// Log-probabilities of prompt tokens, in order from `start` (the first prompt token has
    /// none: `None`). Sent before any [`Event::Token`].
    PromptLogprobs {
        /// The prompt position of the first entry.
        start: usize,
        /// One entry per position.
        logprobs: Vec<Option<TokenLogprobs>>,
    },
    /// It ended without generating (`max_tokens` 0).
    Finished(FinishReason),
    /// It failed; it holds no blocks any more. `kind` says whose fault it was (a device or
    /// internal error in its step, the engine shutting down, a request the cache can never
    /// hold), so a server can answer with the right status rather than parse `message`.
    Failed {
        /// The kind of the error that ended it.
        kind: ErrorKind,
        /// What went wrong, for a person.
        message: String,
    },
}

impl Event {
    /// Whether this is the request's last event.
    pub fn is_last(&self) -> bool {
        match self {
            Event::Token(t) => t.finish.is_some(),
            Event::PromptLogprobs { .. } => false,
            Event::Finished(_) | Event::Failed { .. } => true,
        }
    }
}

/// An event of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The request.
    pub id: RequestId,
    /// What happened.
    pub event: Event,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Its tokens (prompt, and generated ones after a preemption) are going into the cache.
    Prefill,
    /// Every token but the last is in the cache; the last is fed next.
    Decode,
}

#[derive(Debug)]
struct Sequence {
    id: RequestId,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    /// Hashes of the full blocks recorded for prefix caching, in order (see
    /// [`BlockAllocator::register`]).
    block_hashes: Vec<u64>,
    phase: Phase,
    params: GenerationParams,
    decoder: Option<IncrementalDecoder>,
    stops: StopStrings,
    /// Prompt positions whose log-probabilities were sent (a recompute does not send them
    /// again).
    prompt_logprobs_sent: usize,
    /// The sequence's row of the sampling-state root while it runs (0 while waiting).
    state_row: u32,
    /// This step's logit bias: the request's, and `min_tokens`' ban on stop tokens while it
    /// lasts (see [`Sequence::refresh_bias`]).
    bias: Vec<(u32, f32)>,
    /// A structured-output constraint (`response_format`): which tokens may come next.
    constraint: Option<Constraint>,
    /// The constraint's allowed-token bits for the next token (empty without a constraint).
    mask: Vec<u32>,
    /// One more than the iteration whose decode step last fed this sequence (0: none yet):
    /// with fair decoding, a request's rows that sat a step out go first next time.
    last_decoded: u64,
    /// Speculative decoding's proposals for the tokens after the last one (see
    /// [`super::speculative`]); empty without speculation.
    drafts: Vec<u32>,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Gives the sequence's blocks back and forgets what it had computed: it will be
    /// prefilled again (from the prefix cache where it can).
    fn reset(&mut self, blocks: &mut BlockAllocator) {
        blocks.release(&mut self.blocks);
        self.block_hashes.clear();
        self.computed = 0;
        self.phase = Phase::Prefill;
        self.drafts.clear();
    }

    /// Sets [`Sequence::bias`] for the next token: the request's `logit_bias`, with every end
    /// token (`eos`, unless ignored, and the stop tokens) at `-inf` while fewer than
    /// `min_tokens` are generated.
    fn refresh_bias(&mut self, eos: &[u32]) {
        self.bias.clear();
        self.bias.extend_from_slice(&self.params.logit_bias);
        if self.generated() >= self.params.min_tokens {
            return;
        }
        let eos = eos.iter().filter(|_| !self.params.ignore_eos);
        for &t in eos.chain(&self.params.stop_token_ids) {
            match self.bias.iter_mut().find(|(b, _)| *b == t) {
                Some(entry) => entry.1 = f32::NEG_INFINITY,
                None => self.bias.push((t, f32::NEG_INFINITY)),
            }
        }
    }

    /// This sequence's constraint and the mask it writes, if it has one.
    fn constraint_and_mask(&mut self) -> Option<(&mut Constraint, &mut [u32])> {
        let mask = &mut self.mask;
        self.constraint.as_mut().map(|c| (c, mask.as_mut_slice()))
    }

    /// What the step's logits go through for this sequence.
    fn controls(&self) -> LogitControls<'_> {
        LogitControls {
            state_row: self.state_row,
            prompt_len: self.prompt_len,
            bias: &self.bias,
            allowed: self.constraint.as_ref().map(|_| self.mask.as_slice()),
        }
    }
}

/// The continuous-batching scheduler: owns the runner, the queue and the running sequences.
#[derive(Debug)]
pub struct Scheduler<R: Runner> {
    runner: R,
    /// Which cache blocks each sequence owns: the scheduler decides, the runner only executes.
    blocks: BlockAllocator,
    /// Rows of the sampling-state root no running sequence holds (row 0 is padding's).
    free_state_rows: Vec<u32>,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    max_running: usize,
    /// Whether a decode step takes at most an equal share of its rows from each active
    /// request (see the module docs, "Fairness").
    fair_decode: bool,
    /// With fair decoding, how many times the cost of a step of one row per active request a
    /// step may cost (see [`Scheduler::set_fair_decode_slowdown`]).
    fair_slowdown: f64,
    /// With fair decoding, the groups some of whose decoding sequences sat the last decode
    /// step out: their sequences still to prefill wait (see the module docs, "Fairness").
    held_back: Vec<u64>,
    /// Tokens one iteration may feed, decode rows and prefill tokens together.
    token_budget: usize,
    /// Iterations so far: their parity picks the prefill order (see the module docs).
    iterations: u64,
    /// Steps handed to the runner so far (see [`Scheduler::steps_run`]).
    steps_run: u64,
    waiting: VecDeque<Sequence>,
    /// In admission order: preemption takes from the back.
    running: Vec<Sequence>,
    preemptions: u64,
    /// Steps that failed in a row, and the last failure (for health checks).
    failed_steps: u32,
    last_failure: Option<String>,
    /// Tokens drafted a sequence per step (0: no speculative decoding), see
    /// [`super::speculative`].
    speculative: usize,
    spec_stats: SpeculativeStats,
}

/// Whether sequences of `cfg` can start from another's cached prefix. A DeepSeek-V4 sequence's
/// cache is more than its blocks: its sliding window and its compressors' partial windows live
/// in rings under its state row (`model::v4::step`), which a shared block does not bring along.
/// So a V4 model never shares prefixes (until whole compression blocks and their rings are
/// shared, issue 43).
pub fn shares_prefixes(cfg: &crate::config::ModelConfig) -> bool {
    cfg.v4.is_none()
}

impl<R: Runner> Scheduler<R> {
    /// A scheduler over `runner`. With a tokenizer, token events carry text and stop strings
    /// work; `eos_token_ids` end a sequence unless it asks to ignore them.
    /// The block allocator spans the runner's whole cache.
    pub fn new(
        runner: R,
        tokenizer: Option<Arc<Tokenizer>>,
        eos_token_ids: Vec<u32>,
    ) -> Result<Self> {
        let rc = runner.runner_config();
        let max_running = rc.buckets.max_batch().max(1);
        let speculative = rc.speculative_tokens;
        if speculative > 0 && runner.config().draft_layers == 0 {
            return Err(Error::InvalidInput(
                "speculative decoding needs the model loaded with its MTP layer \
                 (ModelConfig::with_draft_layer)"
                    .into(),
            ));
        }
        let blocks = match shares_prefixes(runner.config()) {
            true => BlockAllocator::with_prefix_caching(rc.num_blocks, rc.block_size)?,
            false => BlockAllocator::new(rc.num_blocks, rc.block_size)?,
        };
        Ok(Scheduler {
            runner,
            blocks,
            free_state_rows: (1..=max_running as u32).rev().collect(),
            tokenizer,
            eos_token_ids,
            max_running,
            fair_decode: false,
            fair_slowdown: DEFAULT_FAIR_DECODE_SLOWDOWN,
            held_back: Vec::new(),
            token_budget: usize::MAX,
            iterations: 0,
            steps_run: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            failed_steps: 0,
            last_failure: None,
            speculative,
            spec_stats: SpeculativeStats::default(),
        })
    }

    /// What speculative decoding did so far (all zeros without it).
    pub fn speculative_stats(&self) -> SpeculativeStats {
        self.spec_stats
    }

    /// Turns prefix caching on (the default) or off. Only before the first request: the cache
    /// bookkeeping starts over. A model whose sequences keep state outside their blocks stays
    /// off (see [`shares_prefixes`]).
    pub fn set_prefix_caching(&mut self, on: bool) -> Result<()> {
        let on = on && shares_prefixes(self.runner.config());
        if !self.is_idle() {
            return Err(Error::InvalidInput(
                "prefix caching can only be switched before any request".into(),
            ));
        }
        let (n, bs) = (self.blocks.num_blocks(), self.blocks.block_size());
        self.blocks = match on {
            true => BlockAllocator::with_prefix_caching(n, bs)?,
            false => BlockAllocator::new(n, bs)?,
        };
        Ok(())
    }

    /// Prompt tokens looked up in the prefix cache and found there, so far.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.blocks.prefix_cache_stats()
    }

    /// References to cache block `block` (for tests: a shared prefix block has one per
    /// sequence holding it).
    pub fn block_refs(&self, block: u32) -> u32 {
        self.blocks.refs(block)
    }

    /// The block table of running request `id` (for tests).
    pub fn block_table(&self, id: RequestId) -> Option<&[u32]> {
        self.running
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.blocks.as_slice())
    }

    /// Limits the tokens one iteration feeds, decode rows and prefill tokens together (vLLM's
    /// `max_num_batched_tokens`; without it the largest prefill chunk is the only bound). It
    /// must exceed the largest decode batch, so that a step with every other slot decoding
    /// still prefills.
    pub fn set_max_num_batched_tokens(&mut self, tokens: usize) -> Result<()> {
        if tokens <= self.max_running {
            return Err(Error::InvalidInput(format!(
                "max_num_batched_tokens ({tokens}) must exceed the largest decode batch ({}): \
                 a step that decodes every other sequence must still prefill",
                self.max_running
            )));
        }
        self.token_budget = tokens;
        Ok(())
    }

    /// Turns fair decoding on or off (off by default): while several requests are active,
    /// each decode step takes at most an equal share of the batch from each (see the module
    /// docs, "Fairness"). Worth it where a step's cost grows with its rows (the CPU backend);
    /// it changes no sequence's tokens, only when they come.
    pub fn set_fair_decode(&mut self, on: bool) {
        self.fair_decode = on;
    }

    /// With fair decoding, while several requests are active, a decode step may cost at most
    /// `factor` times a step of one row per active request, by the runner's
    /// [`Runner::decode_cost`] (where it reports none, only the equal share applies); the
    /// request with the most rows gives rows up first. This bounds how much a request with
    /// many choices slows the others' tokens: about `factor` times their pace alone. Default
    /// [`DEFAULT_FAIR_DECODE_SLOWDOWN`]; `factor` must be at least 1.
    pub fn set_fair_decode_slowdown(&mut self, factor: f64) -> Result<()> {
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(Error::InvalidInput(format!(
                "the fair decoding slowdown must be a number of at least 1, not {factor}"
            )));
        }
        self.fair_slowdown = factor;
        Ok(())
    }

    /// The runner.
    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// The runner, mutably (for tools and tests that drive it between steps).
    pub fn runner_mut(&mut self) -> &mut R {
        &mut self.runner
    }

    /// The longest sequence (prompt plus generated tokens) the runner holds.
    pub fn max_len(&self) -> usize {
        self.runner.runner_config().buckets.max_len()
    }

    /// Checks a request against the model and the cache without queueing it.
    pub fn validate(&self, prompt: &[u32], params: &GenerationParams) -> Result<()> {
        validate(
            prompt,
            params,
            self.max_len(),
            self.runner.config().vocab_size,
        )?;
        let bans = if params.min_tokens > 0 {
            params.stop_token_ids.len() + usize::from(!params.ignore_eos) * self.eos_token_ids.len()
        } else {
            0
        };
        if params.logit_bias.len() + bans > LOGIT_BIAS_SLOTS {
            return Err(Error::InvalidInput(format!(
                "logit_bias has {} entries{}; at most {LOGIT_BIAS_SLOTS} fit",
                params.logit_bias.len(),
                match bans {
                    0 => String::new(),
                    n => format!(" and min_tokens bans {n} end tokens"),
                }
            )));
        }
        // A sequence the whole cache cannot hold would wait for admission forever.
        let rc = self.runner.runner_config();
        let need = (prompt.len() + params.max_tokens).div_ceil(rc.block_size);
        let usable = rc.num_blocks.saturating_sub(1);
        if need > usable {
            return Err(Error::InvalidInput(format!(
                "the prompt ({} tokens) plus max_tokens ({}) needs {need} KV-cache blocks of {}, \
                 more than the cache's {usable}",
                prompt.len(),
                params.max_tokens,
                rc.block_size
            )));
        }
        Ok(())
    }

    /// Queues a request; it is admitted in arrival order.
    pub fn add(&mut self, id: RequestId, prompt: Vec<u32>, params: GenerationParams) -> Result<()> {
        self.add_constrained(id, prompt, params, None)
    }

    /// [`Scheduler::add`] with a structured-output constraint: every token it generates is one
    /// the constraint allows (its mask enters the step's graph), and once the constraint is
    /// complete only the end-of-sequence token is.
    pub fn add_constrained(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: GenerationParams,
        constraint: Option<Constraint>,
    ) -> Result<()> {
        self.validate(&prompt, &params)?;
        let words = self.runner.config().vocab_size.div_ceil(32);
        let mask = match constraint {
            Some(_) => vec![0; words],
            None => Vec::new(),
        };
        let decoder = self
            .tokenizer
            .as_ref()
            .map(|t| IncrementalDecoder::new(t.clone(), &prompt, true));
        self.waiting.push_back(Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            phase: Phase::Prefill,
            stops: StopStrings::new(&params.stop),
            params,
            decoder,
            prompt_logprobs_sent: 0,
            state_row: 0,
            last_decoded: 0,
            bias: Vec::new(),
            constraint,
            mask,
            drafts: Vec::new(),
        });
        Ok(())
    }

    /// Drops a request wherever it is, returning its blocks at once. False if it is unknown
    /// (already finished).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(i);
            self.retire(&mut seq);
            return true;
        }
        false
    }

    /// Ends every request with [`Event::Failed`] carrying `message`, of kind
    /// [`ErrorKind::ShuttingDown`]: the engine is going away, nothing is wrong with the requests.
    pub fn abort_all(&mut self, message: &str) -> Vec<Output> {
        let mut out = Vec::new();
        let all: Vec<Sequence> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for mut seq in all {
            self.retire(&mut seq);
            out.push(Output {
                id: seq.id,
                event: Event::Failed {
                    kind: ErrorKind::ShuttingDown,
                    message: message.to_owned(),
                },
            });
        }
        out
    }

    /// Nothing queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Sequences being prefilled or decoded.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission (preempted sequences included).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Blocks held by sequences (cached blocks no sequence holds are free: they are given out
    /// when needed).
    pub fn blocks_in_use(&self) -> usize {
        let a = &self.blocks;
        a.num_blocks() - 1 - a.num_free()
    }

    /// How many steps in a row failed (0 after any step succeeds), with the last error: a
    /// device that keeps failing makes the server unhealthy rather than failing every request
    /// quietly.
    pub fn failing(&self) -> Option<(u32, &str)> {
        match (self.failed_steps, &self.last_failure) {
            (0, _) | (_, None) => None,
            (n, Some(m)) => Some((n, m.as_str())),
        }
    }

    /// A step's output (with a sampled token for each of its `rows`), or the
    /// [`Event::Failed`] its requests fail with; counts consecutive failures for
    /// [`Scheduler::failing`].
    fn check_step(
        &mut self,
        step: &str,
        result: Result<StepOutput>,
        rows: usize,
    ) -> std::result::Result<StepOutput, Event> {
        let checked = result.and_then(|o| {
            if o.next_tokens.len() < rows {
                return Err(Error::Internal(format!(
                    "the step returned {} sampled tokens for {rows} rows",
                    o.next_tokens.len()
                )));
            }
            Ok(o)
        });
        match checked {
            Ok(v) => {
                self.failed_steps = 0;
                Ok(v)
            }
            Err(e) => {
                let message = format!("{step} step failed: {e}");
                self.failed_steps += 1;
                self.last_failure = Some(message.clone());
                Err(Event::Failed {
                    kind: e.kind(),
                    message,
                })
            }
        }
    }

    /// Steps handed to the runner so far. An iteration that ran none made no progress (every
    /// sequence paused, or waiting for blocks that paused ones hold): the engine thread then
    /// sleeps instead of spinning.
    pub fn steps_run(&self) -> u64 {
        self.steps_run
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// One iteration: a decode step over every decoding sequence, then one packed prefill step
    /// with the rest of the token budget.
    pub fn step(&mut self) -> Vec<Output> {
        self.step_with(|_| false)
    }

    /// [`Scheduler::step`] leaving out the sequences for which `skip` holds: they keep their
    /// blocks and their place, and neither decode nor get a prefill chunk in this iteration
    /// (the engine thread pauses a request whose client has not read its events).
    pub fn step_with(&mut self, skip: impl Fn(RequestId) -> bool) -> Vec<Output> {
        let mut out = Vec::new();
        let decoded = self.decode_step(&mut out, &skip);
        let chunk = match self.runner.live_buckets() {
            Some(live) => live.max_prefill_tokens(),
            None => self.runner.runner_config().buckets.prefill_chunk,
        };
        let budget = self.token_budget.saturating_sub(decoded).min(chunk);
        self.prefill_step(budget, &mut out, &skip);
        self.iterations += 1;
        out
    }

    /// Takes a sequence out of the running set's resources: its blocks and its sampling-state
    /// row.
    fn retire(&mut self, seq: &mut Sequence) {
        seq.reset(&mut self.blocks);
        if seq.state_row != 0 {
            self.free_state_rows.push(seq.state_row);
            seq.state_row = 0;
        }
    }

    /// Moves the most recently admitted sequence back to the head of the queue, freeing its
    /// blocks; it will be prefilled again (prompt and generated tokens) when admitted.
    fn preempt_newest(&mut self) -> bool {
        let Some(mut seq) = self.running.pop() else {
            return false;
        };
        self.retire(&mut seq);
        self.waiting.push_front(seq);
        self.preemptions += 1;
        true
    }

    /// Prepares the next token's logit controls of the running sequences at `rows` (sorted
    /// indices): each one's bias ([`Sequence::refresh_bias`]) and, under a constraint, its
    /// allowed-token mask (all of the step's masks at once, see [`fill_masks`]).
    fn prepare_controls(&mut self, rows: &[usize]) {
        let eos = &self.eos_token_ids;
        let mut masks = Vec::new();
        for (i, seq) in self.running.iter_mut().enumerate() {
            if rows.binary_search(&i).is_err() {
                continue;
            }
            seq.refresh_bias(eos);
            masks.extend(seq.constraint_and_mask());
        }
        fill_masks(&mut masks);
    }

    /// A decode step's [`Scheduler::prepare_controls`], the masks left for later: refreshes
    /// the biases of the running sequences at `rows` and takes their constraints out for the
    /// step, with each one's row in the step. Their masks are computed while the step runs
    /// ([`Runner::replay_with_masks`]); [`Scheduler::return_constraints`] puts them back.
    fn take_constraints(&mut self, rows: &[usize]) -> Vec<(usize, Constraint)> {
        let eos = &self.eos_token_ids;
        let mut late = Vec::new();
        for (k, &i) in rows.iter().enumerate() {
            let seq = &mut self.running[i];
            seq.refresh_bias(eos);
            late.extend(seq.constraint.take().map(|c| (k, c)));
        }
        late
    }

    /// Puts the constraints [`Scheduler::take_constraints`] took for the step of `rows` back.
    fn return_constraints(&mut self, rows: &[usize], late: Vec<(usize, Constraint)>) {
        for (k, c) in late {
            self.running[rows[k]].constraint = Some(c);
        }
    }

    /// Advances the constraints of the running sequences at `rows` (sorted indices) by their
    /// `tokens`, all at once ([`advance_all`]); `None` for a row without a constraint, and
    /// rows past the answer's end have none.
    fn advance_constraints(&mut self, rows: &[usize], tokens: &[u32]) -> Vec<Option<Advance>> {
        // The common case, no constraint in the step, allocates nothing (an empty answer reads
        // as `None` for every row).
        if !rows.iter().any(|&i| self.running[i].constraint.is_some()) {
            return Vec::new();
        }
        let vocab = self.runner.config().vocab_size;
        let mut constrained = Vec::new();
        let mut has = Vec::with_capacity(rows.len());
        let mut next = rows.iter().zip(tokens).peekable();
        for (i, seq) in self.running.iter_mut().enumerate() {
            let Some(&(_, &token)) = next.peek().filter(|(&r, _)| r == i) else {
                continue;
            };
            next.next();
            // A token outside the vocabulary fails its sequence (`accept`); the grammar never
            // sees it.
            let constraint = seq.constraint.as_mut().filter(|_| (token as usize) < vocab);
            has.push(constraint.is_some());
            constrained.extend(constraint.map(|c| (c, token)));
        }
        let mut advanced = advance_all(&mut constrained).into_iter();
        has.into_iter()
            .map(|h| if h { advanced.next() } else { None })
            .collect()
    }

    /// Decodes one token for every decoding sequence not skipped; returns how many rows the
    /// step fed.
    fn decode_step(&mut self, out: &mut Vec<Output>, skip: &dyn Fn(RequestId) -> bool) -> usize {
        let (sitting_out, held_back) = self.beyond_fair_share(skip);
        self.held_back = held_back;
        let idle = |s: &Sequence| skip(s.id) || sitting_out.contains(&s.id);
        // Room for one more slot each, preempting from the newest until it fits.
        loop {
            let alloc = &self.blocks;
            let need: usize = self
                .running
                .iter()
                .filter(|s| s.phase == Phase::Decode && !idle(s))
                .map(|s| {
                    alloc
                        .blocks_for(s.tokens.len())
                        .saturating_sub(s.blocks.len())
                })
                .sum();
            if need <= alloc.num_free() || !self.preempt_newest() {
                break;
            }
        }
        let mut batch: Vec<usize> = Vec::new();
        for (i, seq) in self.running.iter_mut().enumerate() {
            if seq.phase == Phase::Decode
                && !idle(seq)
                && self.blocks.grow(&mut seq.blocks, seq.tokens.len()).is_ok()
            {
                batch.push(i);
            }
        }
        if batch.is_empty() {
            return 0;
        }
        // With speculation every decode step verifies drafts (see `super::speculative`).
        if self.speculative > 0 {
            self.refresh_biases(&batch);
            return self.verify_step(&batch, out);
        }
        let mut late = self.take_constraints(&batch);
        let rows: Vec<DecodeRow<'_>> = batch
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                DecodeRow {
                    token: s.tokens[s.tokens.len() - 1],
                    position: s.tokens.len() - 1,
                    blocks: &s.blocks,
                    sampling: s.params.sampling,
                    controls: s.controls(),
                }
            })
            .collect();
        // Logits leave the device only when some row reports log-probabilities.
        let want_logits = batch
            .iter()
            .any(|&i| self.running[i].params.logprobs.is_some());
        let logits = if want_logits {
            LogitsOutput::Sampled
        } else {
            LogitsOutput::None
        };
        self.steps_run += 1;
        let result = match late.is_empty() {
            true => self.runner.replay(&Step::Decode {
                rows: &rows,
                logits,
            }),
            false => {
                let late_rows: Vec<usize> = late.iter().map(|(k, _)| *k).collect();
                let mut fill = |masks: &mut [&mut [u32]]| {
                    let mut pairs: Vec<(&mut Constraint, &mut [u32])> = late
                        .iter_mut()
                        .map(|(_, c)| c)
                        .zip(masks.iter_mut().map(|m| &mut **m))
                        .collect();
                    fill_masks(&mut pairs);
                };
                self.runner.replay_with_masks(
                    &rows,
                    logits,
                    LateMasks {
                        rows: &late_rows,
                        fill: &mut fill,
                    },
                )
            }
        };
        drop(rows);
        self.return_constraints(&batch, late);
        match self.check_step("decode", result, batch.len()) {
            Ok(StepOutput {
                next_tokens: tokens,
                logits,
            }) => {
                let mut advances = self.advance_constraints(&batch, &tokens).into_iter();
                let vocab = self.runner.config().vocab_size;
                for (k, (&i, token)) in batch.iter().zip(tokens).enumerate() {
                    let advance = advances.next().flatten();
                    let seq = &mut self.running[i];
                    seq.computed += 1;
                    seq.last_decoded = self.iterations + 1;
                    let written = &seq.tokens[..seq.computed];
                    self.blocks
                        .register(&seq.blocks, written, &mut seq.block_hashes);
                    let row = logits.as_ref().and_then(|l| l.get(k));
                    let lp = logprobs_of(seq, row, token);
                    out.push(accept(seq, token, lp, &self.eos_token_ids, vocab, |_| {
                        advance
                    }));
                }
            }
            Err(failure) => {
                let failed: Vec<RequestId> = batch.iter().map(|&i| self.running[i].id).collect();
                for &id in &failed {
                    out.push(Output {
                        id,
                        event: failure.clone(),
                    });
                }
                self.remove_where(|s| failed.contains(&s.id));
            }
        }
        self.remove_finished(out);
        batch.len()
    }

    /// Refreshes the biases of the running sequences at `rows` for a verify step.
    fn refresh_biases(&mut self, rows: &[usize]) {
        let eos = &self.eos_token_ids;
        for &i in rows {
            self.running[i].refresh_bias(eos);
        }
    }

    /// How many of its drafts the sequence at `i` can feed this step: no more than fit the
    /// context, than its blocks can be grown to hold, or than it may still generate (the
    /// verify step adds the model's own token after them); and while `min_tokens` bans the
    /// end tokens, no more than keep every position banned (the step biases each position
    /// alike).
    fn verifiable_drafts(&mut self, i: usize) -> usize {
        let max_len = self.max_len();
        // A device verifies a sequence's positions within one decode graph (see
        // `runner::DeviceRunner`'s speculative steps): no more than its largest live batch.
        let fits = match self.runner.live_buckets() {
            Some(live) => live.max_decode_batch().saturating_sub(1),
            None => usize::MAX,
        };
        let seq = &mut self.running[i];
        let room = max_len.saturating_sub(seq.tokens.len());
        let left = seq
            .params
            .max_tokens
            .saturating_sub(seq.generated())
            .saturating_sub(1);
        let banned = match seq.params.min_tokens.checked_sub(seq.generated()) {
            Some(b) if b > 0 => b - 1,
            _ => usize::MAX,
        };
        let mut n = seq.drafts.len().min(room).min(left).min(banned).min(fits);
        while n > 0
            && self
                .blocks
                .grow(&mut seq.blocks, seq.tokens.len() + n)
                .is_err()
        {
            n -= 1;
        }
        n
    }

    /// The decode step of speculative decoding for the running sequences at `rows`: each
    /// feeds its last token and drafts (under a constraint, with a mask per position and no
    /// draft past one its grammar forbids), keeps the drafts the step accepts and the step's
    /// token after them (see [`super::speculative`]). Returns the positions fed.
    fn verify_step(&mut self, rows: &[usize], out: &mut Vec<Output>) -> usize {
        let words = self.runner.config().vocab_size.div_ceil(32);
        // Each row's tokens to feed and, under a constraint, their masks (see `draft_masks`);
        // a row whose grammar fails here fails alone.
        let mut verified_rows = Vec::with_capacity(rows.len());
        let mut fed: Vec<Vec<u32>> = Vec::with_capacity(rows.len());
        let mut masks: Vec<Vec<u32>> = Vec::with_capacity(rows.len());
        for &i in rows {
            let mut n = self.verifiable_drafts(i);
            let seq = &mut self.running[i];
            let mut mask = Vec::new();
            if let Some(c) = seq.constraint.as_mut() {
                match draft_masks(c, &seq.drafts[..n], words) {
                    Ok((kept, m)) => (n, mask) = (kept, m),
                    Err(e) => {
                        out.push(Output {
                            id: seq.id,
                            event: Event::Failed {
                                kind: e.kind(),
                                message: format!("structured output: {e}"),
                            },
                        });
                        continue;
                    }
                }
            }
            let mut t = vec![seq.tokens[seq.tokens.len() - 1]];
            t.extend_from_slice(&seq.drafts[..n]);
            verified_rows.push(i);
            fed.push(t);
            masks.push(mask);
        }
        let rows = &verified_rows[..];
        if rows.is_empty() {
            self.remove_finished(out);
            return 0;
        }
        let chunks: Vec<PrefillChunk<'_>> = rows
            .iter()
            .zip(&fed)
            .zip(&masks)
            .map(|((&i, tokens), mask)| {
                let s = &self.running[i];
                let mut controls = s.controls();
                controls.allowed = s.constraint.as_ref().map(|_| mask.as_slice());
                PrefillChunk {
                    tokens,
                    start: s.tokens.len() - 1,
                    blocks: &s.blocks,
                    sampling: s.params.sampling,
                    controls,
                }
            })
            .collect();
        let positions: usize = fed.iter().map(Vec::len).sum();
        // Every position's logits leave the device only when some row reports
        // log-probabilities.
        let logits = match rows
            .iter()
            .any(|&i| self.running[i].params.logprobs.is_some())
        {
            true => LogitsOutput::AllPositions,
            false => LogitsOutput::None,
        };
        self.steps_run += 1;
        let result = self.runner.replay(&Step::Verify {
            chunks: &chunks,
            logits,
        });
        drop(chunks);
        let (verified, logits) = match self.check_step("verify", result, positions) {
            Ok(o) => (o.next_tokens, o.logits),
            Err(failure) => {
                let failed: Vec<RequestId> = rows.iter().map(|&i| self.running[i].id).collect();
                for &id in &failed {
                    out.push(Output {
                        id,
                        event: failure.clone(),
                    });
                }
                // With any row whose grammar failed above.
                self.remove_finished(out);
                return positions;
            }
        };
        let vocab = self.runner.config().vocab_size;
        let mut drafts = Vec::with_capacity(rows.len());
        let mut offset = 0;
        self.spec_stats.verify_steps += 1;
        for (&i, fed) in rows.iter().zip(&fed) {
            let verified = &verified[offset..offset + fed.len()];
            let accepted = accepted_prefix(&fed[1..], verified);
            self.spec_stats.verified_rows += 1;
            self.spec_stats.drafted += (fed.len() - 1) as u64;
            self.spec_stats.accepted += accepted as u64;
            let seq = &mut self.running[i];
            seq.last_decoded = self.iterations + 1;
            let start = seq.tokens.len() - 1;
            let mut emitted = 0;
            for (j, &token) in verified[..=accepted].iter().enumerate() {
                seq.computed += 1;
                let written = &seq.tokens[..seq.computed];
                self.blocks
                    .register(&seq.blocks, written, &mut seq.block_hashes);
                let row = logits.as_ref().and_then(|l| l.get(offset + j));
                let lp = logprobs_of(seq, row, token);
                let event = accept(seq, token, lp, &self.eos_token_ids, vocab, |seq| {
                    seq.constraint.as_mut().map(|c| c.advance(token))
                });
                emitted += 1;
                let last = event.event.is_last();
                out.push(event);
                if last {
                    break;
                }
            }
            drafts.push(DraftRows {
                seq: i,
                start,
                next_tokens: verified[..emitted].to_vec(),
                hidden_rows: (offset..offset + emitted).collect(),
            });
            offset += fed.len();
        }
        self.draft(drafts, out);
        self.remove_finished(out);
        positions
    }

    /// Runs the MTP layer over `rows` (the positions the last step fed, see
    /// [`super::speculative`]) and chains it to `speculative` proposals for each decoding
    /// sequence. Sequences that finished in `out` are left out; a failed draft step fails its
    /// sequences as any step does.
    fn draft(&mut self, rows: Vec<DraftRows>, out: &mut Vec<Output>) {
        let finished: Vec<RequestId> = out
            .iter()
            .filter(|o| o.event.is_last())
            .map(|o| o.id)
            .collect();
        let mut rows: Vec<DraftRows> = rows
            .into_iter()
            .filter(|r| !r.next_tokens.is_empty() && !finished.contains(&self.running[r.seq].id))
            .collect();
        for r in &rows {
            self.running[r.seq].drafts.clear();
        }
        let max_len = self.max_len();
        for depth in 0..self.speculative {
            if rows.is_empty() {
                return;
            }
            let chunks: Vec<DraftChunk<'_>> = rows
                .iter()
                .map(|r| DraftChunk {
                    next_tokens: &r.next_tokens,
                    start: r.start,
                    blocks: &self.running[r.seq].blocks,
                    hidden_rows: &r.hidden_rows,
                })
                .collect();
            self.steps_run += 1;
            let result = self.runner.replay(&Step::Draft {
                chunks: &chunks,
                logits: LogitsOutput::None,
            });
            drop(chunks);
            let proposals = match self.check_step("draft", result, rows.len()) {
                Ok(o) => o.next_tokens,
                Err(failure) => {
                    let failed: Vec<RequestId> =
                        rows.iter().map(|r| self.running[r.seq].id).collect();
                    for &id in &failed {
                        out.push(Output {
                            id,
                            event: failure.clone(),
                        });
                    }
                    self.remove_where(|s| failed.contains(&s.id));
                    return;
                }
            };
            // Chain from each decoding sequence's last row, one position on, while its blocks
            // and the context hold it.
            let mut next = Vec::new();
            let mut last_row = 0;
            for (r, token) in rows.iter().zip(proposals) {
                last_row += r.next_tokens.len();
                let seq = &mut self.running[r.seq];
                if seq.phase != Phase::Decode {
                    continue;
                }
                seq.drafts.push(token);
                let position = r.start + r.next_tokens.len();
                let more = depth + 1 < self.speculative
                    && position < max_len
                    && self.blocks.grow(&mut seq.blocks, position + 1).is_ok();
                if more {
                    next.push(DraftRows {
                        seq: r.seq,
                        start: position,
                        next_tokens: vec![token],
                        hidden_rows: vec![last_row - 1],
                    });
                }
            }
            rows = next;
        }
    }

    /// With fair decoding, the decoding sequences (not skipped) that sit this step out: those
    /// of a request beyond its equal share of the slots (divided among the groups running or
    /// waiting, rounded up), and then beyond what keeps the step within its cost bound
    /// ([`Scheduler::rows_within_cost`]), the most recently decoded first; and the groups they
    /// belong to. Both empty with one active request.
    fn beyond_fair_share(&self, skip: &dyn Fn(RequestId) -> bool) -> (Vec<RequestId>, Vec<u64>) {
        if !self.fair_decode {
            return (Vec::new(), Vec::new());
        }
        // Each active group and its decoding sequences, in admission order.
        let mut groups: Vec<(u64, Vec<&Sequence>)> = Vec::new();
        let running = self.running.iter().filter(|s| !skip(s.id));
        for seq in running.chain(&self.waiting) {
            let g = group_of(seq);
            let at = match groups.iter().position(|(h, _)| *h == g) {
                Some(at) => at,
                None => {
                    groups.push((g, Vec::new()));
                    groups.len() - 1
                }
            };
            if seq.phase == Phase::Decode {
                groups[at].1.push(seq);
            }
        }
        if groups.len() < 2 {
            return (Vec::new(), Vec::new());
        }
        let share = self.slots().max(1).div_ceil(groups.len());
        let mut keep: Vec<usize> = groups.iter().map(|(_, s)| s.len().min(share)).collect();
        self.rows_within_cost(&mut keep);
        let (mut out, mut held) = (Vec::new(), Vec::new());
        for ((group, mut seqs), keep) in groups.into_iter().zip(keep) {
            if seqs.len() > keep {
                // Stable: among equally recent rows, the earlier admitted goes first.
                seqs.sort_by_key(|s| s.last_decoded);
                out.extend(seqs[keep..].iter().map(|s| s.id));
                held.push(group);
            }
        }
        (out, held)
    }

    /// Lowers the rows each group decodes (`keep`, by group) until the step's expected cost
    /// is within [`Scheduler::set_fair_decode_slowdown`]'s factor of a step of one row per
    /// active group (decoding or not yet), one row at a time from the group with the most (the
    /// later one of equals), never below one. Leaves `keep` alone where the runner reports no
    /// costs.
    fn rows_within_cost(&self, keep: &mut [usize]) {
        let cost = |rows: usize| self.runner.decode_cost(rows);
        let Some(bound) = cost(keep.len()).map(|c| c.mul_f64(self.fair_slowdown)) else {
            return;
        };
        loop {
            let rows: usize = keep.iter().sum();
            if cost(rows).is_none_or(|c| c <= bound) {
                return;
            }
            let Some(most) = keep.iter_mut().max_by_key(|k| **k) else {
                return;
            };
            if *most <= 1 {
                return;
            }
            *most -= 1;
        }
    }

    /// Chooses this step's prefill chunks, admitting waiting sequences first: (index into
    /// `running`, tokens), in the order they are packed. See the module docs for the order.
    fn plan_prefill(
        &mut self,
        budget: usize,
        skip: &dyn Fn(RequestId) -> bool,
    ) -> Vec<(usize, usize)> {
        while self.admit() {}
        let buckets = &self.runner.runner_config().buckets;
        let live = self.runner.live_buckets();
        let fits = |chunks, tokens, end| match live {
            Some(live) => live.prefill_fits(chunks, tokens, end),
            None => buckets.prefill_fits(chunks, tokens, end),
        };
        let held_back = |seq: &Sequence| self.held_back.contains(&group_of(seq));
        let mut order: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let seq = &self.running[i];
                seq.phase == Phase::Prefill && !skip(seq.id) && !held_back(seq)
            })
            .collect();
        if self.iterations.is_multiple_of(2) {
            // Stable: among equals, the oldest first.
            order.sort_by_key(|&i| self.running[i].tokens.len() - self.running[i].computed);
        }
        let mut plan = Vec::new();
        let (mut tokens, mut end) = (0, 0);
        for i in order {
            let seq = &self.running[i];
            let n = (seq.tokens.len() - seq.computed).min(budget - tokens);
            if n == 0 {
                break;
            }
            let reach = end.max(seq.computed + n);
            if fits(plan.len() + 1, tokens + n, reach) {
                plan.push((i, n));
                tokens += n;
                end = reach;
            }
        }
        plan
    }

    fn prefill_step(
        &mut self,
        budget: usize,
        out: &mut Vec<Output>,
        skip: &dyn Fn(RequestId) -> bool,
    ) {
        if budget == 0 {
            return;
        }
        let plan = self.plan_prefill(budget, skip);
        if plan.is_empty() {
            return;
        }
        // Only the chunk that ends its sequence samples a token that counts.
        let mut sampling: Vec<usize> = plan
            .iter()
            .filter(|&&(i, n)| {
                let seq = &self.running[i];
                seq.computed + n == seq.tokens.len()
            })
            .map(|&(i, _)| i)
            .collect();
        sampling.sort_unstable();
        self.prepare_controls(&sampling);
        let chunks: Vec<PrefillChunk<'_>> = plan
            .iter()
            .map(|&(i, n)| {
                let seq = &self.running[i];
                PrefillChunk {
                    tokens: &seq.tokens[seq.computed..seq.computed + n],
                    start: seq.computed,
                    blocks: &seq.blocks,
                    sampling: seq.params.sampling,
                    controls: seq.controls(),
                }
            })
            .collect();
        // Prompt positions a chunk predicts that were not reported yet.
        let wants_prompt_rows = |seq: &Sequence| {
            seq.params.prompt_logprobs.is_some()
                && seq.prompt_logprobs_sent < seq.prompt_len
                && seq.computed < seq.prompt_len
        };
        let ends = |&(i, n): &(usize, usize)| {
            let seq = &self.running[i];
            seq.computed + n == seq.tokens.len()
        };
        let want = if plan
            .iter()
            .any(|&(i, _)| wants_prompt_rows(&self.running[i]))
        {
            LogitsOutput::AllPositions
        } else if plan
            .iter()
            .any(|p| ends(p) && self.running[p.0].params.logprobs.is_some())
        {
            LogitsOutput::Sampled
        } else {
            LogitsOutput::None
        };
        self.steps_run += 1;
        let result = self.runner.replay(&Step::Prefill {
            chunks: &chunks,
            logits: want,
        });
        drop(chunks);
        match self.check_step("prefill", result, plan.len()) {
            Ok(StepOutput {
                next_tokens: tokens,
                logits,
            }) => {
                let vocab = self.runner.config().vocab_size;
                // The chunks' rows for the MTP layer's draft step: every position whose next
                // token is known once the chunk's sample is accepted.
                let mut drafts = Vec::new();
                // Each chunk's first logits row (AllPositions: one row per token).
                let mut row = 0;
                for (k, &(i, n)) in plan.iter().enumerate() {
                    if self.speculative > 0 {
                        drafts.push(DraftRows {
                            seq: i,
                            start: self.running[i].computed,
                            next_tokens: Vec::new(),
                            hidden_rows: (row..row + n).collect(),
                        });
                    }
                    let (rows, sampled_row) = match (want, &logits) {
                        (LogitsOutput::AllPositions, Some(l)) => {
                            let r = l.get(row..row + n).unwrap_or(&[]);
                            (Some(r), r.last())
                        }
                        (LogitsOutput::Sampled, Some(l)) => (None, l.get(k)),
                        _ => (None, None),
                    };
                    row += n;
                    let seq = &mut self.running[i];
                    let start = seq.computed;
                    let prompt_rows = wants_prompt_rows(seq);
                    seq.computed += n;
                    let written = &seq.tokens[..seq.computed];
                    self.blocks
                        .register(&seq.blocks, written, &mut seq.block_hashes);
                    if prompt_rows {
                        if let Some(rows) = rows {
                            out.push(prompt_logprobs(seq, start, start + n, rows));
                        }
                    }
                    if seq.computed < seq.tokens.len() {
                        continue;
                    }
                    seq.phase = Phase::Decode;
                    if seq.params.max_tokens == 0 {
                        out.push(Output {
                            id: seq.id,
                            event: Event::Finished(FinishReason::Length),
                        });
                    } else {
                        let lp = logprobs_of(seq, sampled_row, tokens[k]);
                        let token = tokens[k];
                        let advance =
                            |seq: &mut Sequence| seq.constraint.as_mut().map(|c| c.advance(token));
                        out.push(accept(seq, token, lp, &self.eos_token_ids, vocab, advance));
                    }
                }
                // The next tokens are known now (a final chunk's is its accepted sample).
                for d in &mut drafts {
                    let tokens = &self.running[d.seq].tokens;
                    let end = (d.start + 1 + d.hidden_rows.len()).min(tokens.len());
                    d.next_tokens = tokens[d.start + 1..end].to_vec();
                    d.hidden_rows.truncate(d.next_tokens.len());
                }
                self.draft(drafts, out);
                self.remove_finished(out);
            }
            Err(failure) => {
                let failed: Vec<RequestId> =
                    plan.iter().map(|&(i, _)| self.running[i].id).collect();
                for &id in &failed {
                    out.push(Output {
                        id,
                        event: failure.clone(),
                    });
                }
                self.remove_where(|s| failed.contains(&s.id));
            }
        }
    }

    /// Admits a waiting sequence when a batch slot and blocks for all its tokens are free: the
    /// oldest of the group with the fewest sequences running (see the module docs). When every slot is taken and that group runs
    /// fewer than its fair share, a slot is taken back from a group above its share first
    /// ([`Scheduler::reclaim_slot`]). False when none was admitted.
    fn admit(&mut self) -> bool {
        if self.waiting.is_empty() {
            return false;
        }
        let running_in = |r: &[Sequence], g: u64| r.iter().filter(|s| group_of(s) == g).count();
        // The oldest of the group with the fewest running (a sequence preempted for memory is
        // at the head, so it wins among equals).
        let mut best = (usize::MAX, 0);
        for (i, seq) in self.waiting.iter().enumerate() {
            let n = running_in(&self.running, group_of(seq));
            if n < best.0 {
                best = (n, i);
            }
            if n == 0 {
                break;
            }
        }
        let pick = best.1;
        if self.running.len() >= self.slots() {
            let group = group_of(&self.waiting[pick]);
            if !self.reclaim_slot(group) {
                return false;
            }
        }
        let Some(seq) = self.waiting.get_mut(pick) else {
            return false;
        };
        // Start from the cached prefix, leaving at least the last token to compute (and the
        // whole prompt when its log-probabilities are asked for).
        let cacheable = seq.params.prompt_logprobs.is_none() && !seq.params.penalised();
        if seq.computed == 0 && cacheable {
            let most = (seq.tokens.len() - 1) / self.blocks.block_size();
            let (blocks, hashes) = self.blocks.match_prefix(&seq.tokens, most);
            seq.computed = blocks.len() * self.blocks.block_size();
            (seq.blocks, seq.block_hashes) = (blocks, hashes);
        }
        if self.blocks.grow(&mut seq.blocks, seq.tokens.len()).is_err() {
            seq.reset(&mut self.blocks);
            return false;
        }
        if self.blocks.prefix_caching() && cacheable {
            self.blocks.record_lookup(seq.tokens.len(), seq.computed);
        }
        // A free row exists: rows are as many as batch slots, and a slot is free.
        seq.state_row = self.free_state_rows.pop().unwrap_or(0);
        match self.waiting.remove(pick) {
            Some(seq) => {
                self.running.push(seq);
                true
            }
            None => false,
        }
    }

    /// Frees a batch slot for a sequence of `group` when every slot is taken: if `group` runs
    /// fewer sequences than its fair share (the slots divided among the groups running or
    /// waiting, rounded up) and another group runs more, that group's most recently admitted
    /// sequence is preempted (its blocks freed, recomputed when it is admitted again) and
    /// queued behind the others. So a request for more choices than there are slots, which
    /// took every slot of an idle server, gives slots back as other requests arrive, instead
    /// of making them wait for its choices to finish; with one group, nothing is preempted.
    fn reclaim_slot(&mut self, group: u64) -> bool {
        let mut counts: Vec<(u64, usize)> = Vec::new();
        for s in &self.running {
            match counts.iter_mut().find(|(g, _)| *g == group_of(s)) {
                Some((_, n)) => *n += 1,
                None => counts.push((group_of(s), 1)),
            }
        }
        let mut groups = counts.len();
        for s in &self.waiting {
            let g = group_of(s);
            if !counts.iter().any(|(c, _)| *c == g) {
                counts.push((g, 0));
                groups += 1;
            }
        }
        let share = self.slots().div_ceil(groups.max(1));
        let mine = counts.iter().find(|(g, _)| *g == group).map_or(0, |c| c.1);
        let Some(&(victim, _)) = counts
            .iter()
            .filter(|(g, n)| *g != group && *n > share)
            .max_by_key(|(_, n)| *n)
        else {
            return false;
        };
        if mine >= share {
            return false;
        }
        let Some(i) = self.running.iter().rposition(|s| group_of(s) == victim) else {
            return false;
        };
        let mut seq = self.running.remove(i);
        self.retire(&mut seq);
        self.waiting.push_back(seq);
        self.preemptions += 1;
        true
    }

    /// The batch slots sequences may hold now: `--max-batch`, or while a device runner is still
    /// compiling its larger decode buckets, the largest batch live at the longest context
    /// (a running sequence must find a bucket whatever it grows to). Requests beyond it wait
    /// in the queue; the slots only grow as buckets join.
    fn slots(&self) -> usize {
        match self.runner.live_buckets() {
            Some(live) => live.max_decode_batch().min(self.max_running),
            None => self.max_running,
        }
    }

    /// Drops the sequences whose last event finished them (the last output of each id).
    fn remove_finished(&mut self, out: &[Output]) {
        let finished: Vec<RequestId> = out
            .iter()
            .filter(|o| o.event.is_last())
            .map(|o| o.id)
            .collect();
        if !finished.is_empty() {
            self.remove_where(|s| finished.contains(&s.id));
        }
    }

    fn remove_where(&mut self, pred: impl Fn(&Sequence) -> bool) {
        let mut i = 0;
        while i < self.running.len() {
            if pred(&self.running[i]) {
                let mut seq = self.running.remove(i);
                self.retire(&mut seq);
            } else {
                i += 1;
            }
        }
    }
}

/// The admission group of `seq`: its request's, or its own id.
fn group_of(seq: &Sequence) -> u64 {
    seq.params.group.unwrap_or(seq.id)
}

/// The log-probabilities of the prompt tokens a prefill chunk over positions `start..end`
/// predicts (row r predicts position start + r + 1), from the first not yet sent.
fn prompt_logprobs(seq: &mut Sequence, start: usize, end: usize, rows: &[Vec<f32>]) -> Output {
    let top = seq.params.prompt_logprobs.unwrap_or(0);
    let from = seq.prompt_logprobs_sent;
    let to = (end + 1).min(seq.prompt_len);
    let logprobs = (from..to)
        .map(|j| {
            // Position 0 follows nothing.
            let row = j
                .checked_sub(1)
                .and_then(|r| r.checked_sub(start))
                .and_then(|r| rows.get(r));
            row.map(|row| TokenLogprobs::from_logits(row, seq.tokens[j], top))
        })
        .collect();
    seq.prompt_logprobs_sent = to;
    Output {
        id: seq.id,
        event: Event::PromptLogprobs {
            start: from,
            logprobs,
        },
    }
}

/// The log-probabilities `seq` asked for, from the logits row its token was drawn from.
fn logprobs_of(seq: &Sequence, row: Option<&Vec<f32>>, token: u32) -> Option<TokenLogprobs> {
    let top = seq.params.logprobs?;
    Some(TokenLogprobs::from_logits(row?, token, top))
}

/// Appends a sampled token to `seq` and decides whether it ends the sequence; `advance` is
/// what the sequence's constraint made of the token (`None` without one).
///
/// A token outside the vocabulary (`vocab` ids) is a backend's fault (a device's argmax over a
/// row it could not read, a corrupted output): it fails this sequence alone, as an internal
/// error, and is never appended, decoded or handed to its constraint's grammar.
fn accept(
    seq: &mut Sequence,
    token: u32,
    logprobs: Option<TokenLogprobs>,
    eos: &[u32],
    vocab: usize,
    advance: impl FnOnce(&mut Sequence) -> Option<Advance>,
) -> Output {
    if token as usize >= vocab {
        return Output {
            id: seq.id,
            event: Event::Failed {
                kind: ErrorKind::Internal,
                message: format!(
                    "the backend sampled token {token}, outside the vocabulary (size {vocab})"
                ),
            },
        };
    }
    let advance = advance(seq);
    seq.tokens.push(token);
    // Under a constraint, the end of the document is the end (ignore_eos or not).
    let constrained_end = match advance {
        Some(Advance::WasFinished) => eos.contains(&token),
        Some(Advance::Refused(e)) => {
            // The mask allowed only what the constraint accepts: a bug, not the client's.
            return Output {
                id: seq.id,
                event: Event::Failed {
                    kind: ErrorKind::Internal,
                    message: format!("structured output: token {token}: {e}"),
                },
            };
        }
        Some(Advance::Accepted) | None => false,
    };
    let stop_token = constrained_end
        || seq.params.stop_token_ids.contains(&token)
        || (!seq.params.ignore_eos && eos.contains(&token));
    let at_limit = seq.generated() >= seq.params.max_tokens;
    let mut text = String::new();
    let mut stop_string = false;
    if !stop_token {
        let piece = match seq.decoder.as_mut().map(|d| d.push(token)) {
            Some(Ok(p)) => p,
            // A token the tokenizer cannot decode shows as nothing rather than failing the request.
            Some(Err(_)) | None => String::new(),
        };
        let check = seq.stops.push(&piece);
        text = check.text;
        stop_string = check.stopped;
    }
    let finish = if stop_token || stop_string {
        Some(FinishReason::Stop)
    } else if at_limit {
        Some(FinishReason::Length)
    } else {
        None
    };
    if finish.is_some() && !stop_string {
        // Ended for another reason than a stop string: release what was held back.
        if let Some(Ok(rest)) = seq.decoder.as_mut().map(|d| d.flush()) {
            text.push_str(&seq.stops.push(&rest).text);
        }
        text.push_str(&seq.stops.flush());
    }
    Output {
        id: seq.id,
        event: Event::Token(TokenEvent {
            token,
            text,
            finish,
            logprobs,
        }),
    }
}

/// Checks a request against a model with a context of `max_len` tokens and `vocab` tokens.
pub(crate) fn validate(
    prompt: &[u32],
    params: &GenerationParams,
    max_len: usize,
    vocab: usize,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::InvalidInput("the prompt is empty".into()));
    }
    if params.max_tokens == 0 && params.prompt_logprobs.is_none() {
        return Err(Error::InvalidInput(
            "max_tokens must be at least 1 (0 only with prompt log-probabilities)".into(),
        ));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::InvalidInput(format!(
            "token id {t} is outside the vocabulary (size {vocab})"
        )));
    }
    if prompt.len() + params.max_tokens > max_len {
        return Err(Error::InvalidInput(format!(
            "this model's context is {max_len} tokens; the prompt has {} and max_tokens asks for {} more",
            prompt.len(),
            params.max_tokens
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::top_k;

    /// Against a full sort (descending by value, the lower index first among equals), with
    /// ties, negative values, infinities and every k from 0 to past the length.
    #[test]
    fn top_k_equals_the_head_of_a_full_sort() {
        let mut state = 12345u32;
        let mut logits: Vec<f32> = (0..300)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                // Few distinct values, so ties are common.
                ((state >> 24) % 23) as f32 - 11.0
            })
            .collect();
        logits[7] = f32::INFINITY;
        logits[9] = f32::NEG_INFINITY;
        let mut sorted: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, i as u32))
            .collect();
        sorted.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for k in [0, 1, 2, 5, 20, 299, 300, 400] {
            let want = &sorted[..k.min(sorted.len())];
            assert_eq!(top_k(&logits, k), want, "k = {k}");
        }
    }
}
