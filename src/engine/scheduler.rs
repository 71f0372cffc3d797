//! Continuous batching over one runner.
//!
//! Each call to [`Scheduler::step`] is one iteration:
//!
//! 1. **Decode**: every sequence that has finished its prefill feeds its last token in one
//!    decode step (the runner pads the batch to a captured bucket). Each needs room for one more
//!    slot; when the cache cannot give it, the most recently admitted sequence is preempted: its
//!    blocks are freed and it goes back to the head of the queue, to be recomputed (prompt and
//!    generated tokens prefilled again) once blocks free up. Nothing is dropped.
//! 2. **Prefill**: one chunk of the oldest sequence still prefilling, admitting the head of the
//!    queue first if none is, when a batch slot and blocks for its whole prompt are free.
//!
//! So prompts enter chunk by chunk between decode steps and the running streams keep flowing.
//! A failed step (a device fault) fails exactly the sequences in it; the rest go on.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::model::LogitsOutput;
use crate::runner::step::{DecodeRow, PrefillChunk};
use crate::runner::{Runner, Step, StepOutput};
use crate::tokenizer::Tokenizer;

use super::blocks::BlockAllocator;
use super::detokenize::{IncrementalDecoder, StopStrings};
use super::params::{FinishReason, GenerationParams};

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
        let mut best: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
        let top = top.min(best.len());
        if top > 0 && top < best.len() {
            best.select_nth_unstable_by(top - 1, by_logit);
        }
        best.truncate(top);
        best.sort_by(by_logit);
        TokenLogprobs {
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&x| x - lse),
            top: best
                .into_iter()
                .map(|t| (t, logits[t as usize] - lse))
                .collect(),
        }
    }
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
    phase: Phase,
    params: GenerationParams,
    decoder: Option<IncrementalDecoder>,
    stops: StopStrings,
    /// Prompt positions whose log-probabilities were sent (a recompute does not send them
    /// again).
    prompt_logprobs_sent: usize,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// The continuous-batching scheduler: owns the runner, the queue and the running sequences.
#[derive(Debug)]
pub struct Scheduler<R: Runner> {
    runner: R,
    /// Which cache blocks each sequence owns: the scheduler decides, the runner only executes.
    blocks: BlockAllocator,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    max_running: usize,
    waiting: VecDeque<Sequence>,
    /// In admission order: preemption takes from the back.
    running: Vec<Sequence>,
    preemptions: u64,
    /// Steps that failed in a row, and the last failure (for health checks).
    failed_steps: u32,
    last_failure: Option<String>,
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
        let blocks = BlockAllocator::new(rc.num_blocks, rc.block_size)?;
        Ok(Scheduler {
            runner,
            blocks,
            tokenizer,
            eos_token_ids,
            max_running,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            failed_steps: 0,
            last_failure: None,
        })
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
        self.validate(&prompt, &params)?;
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
            phase: Phase::Prefill,
            stops: StopStrings::new(&params.stop),
            params,
            decoder,
            prompt_logprobs_sent: 0,
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
            self.blocks.release(&mut seq.blocks);
            return true;
        }
        false
    }

    /// Ends every request with [`Event::Failed`] carrying `message`, of kind
    /// [`ErrorKind::Unavailable`]: the engine is going away, nothing is wrong with the requests.
    pub fn abort_all(&mut self, message: &str) -> Vec<Output> {
        let mut out = Vec::new();
        let all: Vec<Sequence> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for mut seq in all {
            self.blocks.release(&mut seq.blocks);
            out.push(Output {
                id: seq.id,
                event: Event::Failed {
                    kind: ErrorKind::Unavailable,
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

    /// Blocks held by sequences.
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

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// One iteration: a decode step over every decoding sequence, then one prefill chunk.
    pub fn step(&mut self) -> Vec<Output> {
        self.step_with(|_| false)
    }

    /// [`Scheduler::step`] leaving out the sequences for which `skip` holds: they keep their
    /// blocks and their place, and neither decode nor get a prefill chunk in this iteration
    /// (the engine thread pauses a request whose client has not read its events).
    pub fn step_with(&mut self, skip: impl Fn(RequestId) -> bool) -> Vec<Output> {
        let mut out = Vec::new();
        self.decode_step(&mut out, &skip);
        self.prefill_step(&mut out, &skip);
        out
    }

    /// Moves the most recently admitted sequence back to the head of the queue, freeing its
    /// blocks; it will be prefilled again (prompt and generated tokens) when admitted.
    fn preempt_newest(&mut self) -> bool {
        let Some(mut seq) = self.running.pop() else {
            return false;
        };
        self.blocks.release(&mut seq.blocks);
        seq.computed = 0;
        seq.phase = Phase::Prefill;
        self.waiting.push_front(seq);
        self.preemptions += 1;
        true
    }

    fn decode_step(&mut self, out: &mut Vec<Output>, skip: &dyn Fn(RequestId) -> bool) {
        // Room for one more slot each, preempting from the newest until it fits.
        loop {
            let alloc = &self.blocks;
            let need: usize = self
                .running
                .iter()
                .filter(|s| s.phase == Phase::Decode && !skip(s.id))
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
                && !skip(seq.id)
                && self.blocks.grow(&mut seq.blocks, seq.tokens.len()).is_ok()
            {
                batch.push(i);
            }
        }
        if batch.is_empty() {
            return;
        }
        let rows: Vec<DecodeRow<'_>> = batch
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                DecodeRow {
                    token: s.tokens[s.tokens.len() - 1],
                    position: s.tokens.len() - 1,
                    blocks: &s.blocks,
                    sampling: s.params.sampling,
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
        let result = self.runner.replay(&Step::Decode {
            rows: &rows,
            logits,
        });
        drop(rows);
        match self.check_step("decode", result, batch.len()) {
            Ok(StepOutput {
                next_tokens: tokens,
                logits,
            }) => {
                for (k, (&i, token)) in batch.iter().zip(tokens).enumerate() {
                    let seq = &mut self.running[i];
                    seq.computed += 1;
                    let row = logits.as_ref().and_then(|l| l.get(k));
                    let lp = logprobs_of(seq, row, token);
                    out.push(accept(seq, token, lp, &self.eos_token_ids));
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
    }

    fn prefill_step(&mut self, out: &mut Vec<Output>, skip: &dyn Fn(RequestId) -> bool) {
        let i = match self
            .running
            .iter()
            .position(|s| s.phase == Phase::Prefill && !skip(s.id))
        {
            Some(i) => i,
            None => match self.admit() {
                // A skipped sequence (a preempted one back at the head) is admitted but waits.
                Some(i) if !skip(self.running[i].id) => i,
                _ => return,
            },
        };
        let chunk_size = self.runner.runner_config().buckets.prefill_chunk;
        let seq = &self.running[i];
        let end = (seq.computed + chunk_size).min(seq.tokens.len());
        let chunk = PrefillChunk {
            tokens: &seq.tokens[seq.computed..end],
            start: seq.computed,
            blocks: &seq.blocks,
            sampling: seq.params.sampling,
        };
        let start = seq.computed;
        let last = end == seq.tokens.len();
        // Prompt positions this chunk predicts that were not reported yet.
        let prompt_rows = seq.params.prompt_logprobs.is_some()
            && seq.prompt_logprobs_sent < seq.prompt_len
            && start < seq.prompt_len;
        let want = if prompt_rows {
            LogitsOutput::AllPositions
        } else if last && seq.params.logprobs.is_some() {
            LogitsOutput::Sampled
        } else {
            LogitsOutput::None
        };
        let result = self.runner.replay(&Step::Prefill {
            chunk: &chunk,
            logits: want,
        });
        match self.check_step("prefill", result, 1) {
            Ok(StepOutput {
                next_tokens: tokens,
                logits,
            }) => {
                let seq = &mut self.running[i];
                seq.computed = end;
                if prompt_rows {
                    if let Some(rows) = &logits {
                        out.push(prompt_logprobs(seq, start, end, rows));
                    }
                }
                if last {
                    seq.phase = Phase::Decode;
                    if seq.params.max_tokens == 0 {
                        out.push(Output {
                            id: seq.id,
                            event: Event::Finished(FinishReason::Length),
                        });
                    } else {
                        // The row the token was drawn from: the chunk's last.
                        let row = logits.as_ref().and_then(|l| l.last());
                        let lp = logprobs_of(seq, row, tokens[0]);
                        out.push(accept(seq, tokens[0], lp, &self.eos_token_ids));
                    }
                    self.remove_finished(out);
                }
            }
            Err(failure) => {
                let mut seq = self.running.remove(i);
                self.blocks.release(&mut seq.blocks);
                out.push(Output {
                    id: seq.id,
                    event: failure,
                });
            }
        }
    }

    /// Admits the head of the queue when a batch slot and blocks for all its tokens are free.
    fn admit(&mut self) -> Option<usize> {
        if self.running.len() >= self.max_running {
            return None;
        }
        let seq = self.waiting.front_mut()?;
        self.blocks.grow(&mut seq.blocks, seq.tokens.len()).ok()?;
        let seq = self.waiting.pop_front()?;
        self.running.push(seq);
        Some(self.running.len() - 1)
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
                self.blocks.release(&mut seq.blocks);
            } else {
                i += 1;
            }
        }
    }
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

/// Appends a sampled token to `seq` and decides whether it ends the sequence.
fn accept(seq: &mut Sequence, token: u32, logprobs: Option<TokenLogprobs>, eos: &[u32]) -> Output {
    seq.tokens.push(token);
    let stop_token = seq.params.stop_token_ids.contains(&token)
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
