//! The scheduler on a thread of its own, for the async server.
//!
//! The runner is built and owned by the engine thread (a device runner's handles never cross
//! threads). Requests arrive over a channel; each gets an unbounded channel of its own for its
//! events, so the engine never waits on a slow client. The thread sleeps while there is nothing
//! to do and otherwise loops: take new requests and cancellations, run one scheduler iteration,
//! route the events, update the metrics.
//!
//! A [`RequestStream`] dropped before its request finished (a client that went away) cancels
//! the request, which frees its blocks before the next step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc as async_mpsc;

use crate::error::{Error, Result};
use crate::metrics::{Metrics, Outcome};
use crate::runner::Runner;

/// The runner the engine thread drives: whichever backend [`crate::runner::open`] chose.
type EngineRunner = Box<dyn Runner>;
use crate::tokenizer::Tokenizer;

use super::params::{FinishReason, GenerationParams};
use super::scheduler::{validate, Event, RequestId, Scheduler};

/// Consecutive failed steps after which [`Engine::unhealthy`] reports the engine unhealthy.
pub const UNHEALTHY_AFTER: u32 = 3;

/// Limits of the engine's queue.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Requests that may wait for a batch slot before new ones are refused: a request is
    /// accepted while fewer than `max_waiting` plus the free batch slots are waiting (so an
    /// idle server takes `max_batch + max_waiting` at once, and 0 means "only when a slot is
    /// free").
    pub max_waiting: usize,
    /// Most tokens one step feeds, decode rows and prefill tokens together (see
    /// [`Scheduler::set_max_num_batched_tokens`]); `None`: the largest prefill chunk bounds it.
    pub max_num_batched_tokens: Option<usize>,
    /// End-of-sequence tokens (unless a request ignores them).
    pub eos_token_ids: Vec<u32>,
    /// Print a line of throughput and occupancy to stderr this often while there is work
    /// (vLLM's periodic stats line); `None` for silence.
    pub log_stats_every: Option<std::time::Duration>,
}

/// What the server needs to know about the loaded model.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The longest sequence (prompt plus generated tokens).
    pub max_len: usize,
    /// The vocabulary size.
    pub vocab_size: usize,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// `cpu` or `device`.
    pub backend: &'static str,
}

/// Why a request was not queued.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The request cannot be served by this model (empty prompt, beyond the context, ...).
    #[error("{0}")]
    Invalid(String),
    /// `max_waiting` requests are already queued.
    #[error("the server is at capacity: {0} requests are already waiting; retry later")]
    QueueFull(usize),
    /// The server is shutting down.
    #[error("the server is shutting down and takes no new requests")]
    Draining,
}

enum Command {
    Add {
        id: RequestId,
        prompt: Vec<u32>,
        params: GenerationParams,
        events: async_mpsc::UnboundedSender<Event>,
        arrival: Instant,
    },
    Cancel(RequestId),
    AbortAll(String),
    Shutdown,
}

/// State shared by the handle and the engine thread.
#[derive(Debug)]
struct Shared {
    /// Steps failed in a row and the last error, as of the last iteration.
    failing: std::sync::Mutex<Option<(u32, String)>>,
    /// Submitted, not yet taken by the engine thread.
    in_transit: AtomicUsize,
    /// In the scheduler's queue (as of the last iteration, plus arrivals since).
    queued: AtomicUsize,
    /// Sequences running, as of the last iteration.
    running: AtomicUsize,
    draining: AtomicBool,
    metrics: Arc<Metrics>,
}

/// A handle on the engine thread; the server shares one behind an `Arc`.
#[derive(Debug)]
pub struct Engine {
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    info: EngineInfo,
    options: EngineOptions,
    next_id: AtomicU64,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// The events of one request, in order, up to the one for which [`Event::is_last`] holds.
/// Dropping it early cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    prompt_tokens: usize,
    events: async_mpsc::UnboundedReceiver<Event>,
    commands: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The engine's id of the request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Tokens in the prompt, for the usage count.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The next event; `None` after the last one (or if the engine stopped).
    pub async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let event = self.events.recv().await;
        if event.as_ref().is_none_or(Event::is_last) {
            self.done = true;
        }
        event
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            // The engine may already be gone; then there is nothing to free.
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

impl Engine {
    /// Starts the engine thread. `make_runner` runs on that thread (a device runner is created,
    /// captured and used there); its error is returned here, before anything is served.
    pub fn start<F>(
        make_runner: F,
        tokenizer: Option<Arc<Tokenizer>>,
        options: EngineOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Engine>
    where
        F: FnOnce() -> Result<EngineRunner> + Send + 'static,
    {
        let (commands, inbox) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let shared = Arc::new(Shared {
            failing: std::sync::Mutex::new(None),
            in_transit: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            metrics,
        });
        let thread_shared = shared.clone();
        let eos = options.eos_token_ids.clone();
        let log_every = options.log_stats_every;
        let token_budget = options.max_num_batched_tokens;
        let thread = std::thread::Builder::new()
            .name("deepinfer-engine".into())
            .spawn(move || {
                let runner = match make_runner() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let rc = runner.runner_config();
                let info = EngineInfo {
                    max_len: rc.buckets.max_len(),
                    vocab_size: runner.config().vocab_size,
                    max_batch: rc.buckets.max_batch(),
                    backend: runner.backend().name(),
                };
                let scheduler = Scheduler::new(runner, tokenizer, eos).and_then(|mut s| {
                    if let Some(n) = token_budget {
                        s.set_max_num_batched_tokens(n)?;
                    }
                    Ok(s)
                });
                let mut scheduler = match scheduler {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                if ready_tx.send(Ok(info)).is_err() {
                    return;
                }
                run_loop(&mut scheduler, &inbox, &thread_shared, log_every);
            })
            .map_err(|e| Error::Engine(format!("cannot start the engine thread: {e}")))?;
        let info = match ready_rx.recv() {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Engine(
                    "the engine thread ended while loading the model".into(),
                ))
            }
        };
        Ok(Engine {
            commands,
            shared,
            info,
            options,
            next_id: AtomicU64::new(1),
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// The loaded model's limits.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The metrics the engine updates.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Queues a request. It is checked against the model here, so a bad one is refused before it
    /// costs anything.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: GenerationParams,
    ) -> std::result::Result<RequestStream, SubmitError> {
        if self.shared.draining.load(Ordering::SeqCst) {
            return Err(SubmitError::Draining);
        }
        validate(&prompt, &params, self.info.max_len, self.info.vocab_size)
            .map_err(|e| SubmitError::Invalid(e.to_string()))?;
        // Reserve a place in the queue; it is freed when the request gets a batch slot.
        let in_transit = self.shared.in_transit.fetch_add(1, Ordering::SeqCst);
        let waiting = in_transit + self.shared.queued.load(Ordering::SeqCst);
        // The free batch slots take waiting requests first: they do not count against
        // `max_waiting` (an idle server must not refuse what it can run at once).
        let free = self
            .info
            .max_batch
            .saturating_sub(self.shared.running.load(Ordering::SeqCst));
        if waiting >= self.options.max_waiting + free {
            self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(waiting));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = async_mpsc::unbounded_channel();
        let prompt_tokens = prompt.len();
        let sent = self.commands.send(Command::Add {
            id,
            prompt,
            params,
            events: tx,
            arrival: Instant::now(),
        });
        if sent.is_err() {
            self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Draining);
        }
        Ok(RequestStream {
            id,
            prompt_tokens,
            events: rx,
            commands: self.commands.clone(),
            done: false,
        })
    }

    /// Refuses new requests from now on; queued and running ones go on.
    pub fn begin_drain(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the engine thread is still running (false after a shutdown, or if it died).
    pub fn is_alive(&self) -> bool {
        self.thread
            .lock()
            .ok()
            .and_then(|t| t.as_ref().map(|h| !h.is_finished()))
            .unwrap_or(false)
    }

    /// Why the engine is unhealthy, if it is: its thread has stopped, or its last
    /// [`UNHEALTHY_AFTER`] or more steps all failed (a device that no longer executes).
    pub fn unhealthy(&self) -> Option<String> {
        if !self.is_alive() {
            return Some("the engine thread has stopped".into());
        }
        let failing = self.shared.failing.lock().ok()?.clone();
        match failing {
            Some((n, last)) if n >= UNHEALTHY_AFTER => {
                Some(format!("the last {n} steps failed; the last with: {last}"))
            }
            _ => None,
        }
    }

    /// Whether [`Engine::begin_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::SeqCst)
    }

    /// Ends every queued and running request with an error carrying `message`.
    pub fn abort_all(&self, message: &str) {
        let _ = self.commands.send(Command::AbortAll(message.to_owned()));
    }

    /// Stops the engine thread (failing whatever is still in flight) and waits for it.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// A request the engine thread is serving.
struct Client {
    events: async_mpsc::UnboundedSender<Event>,
    arrival: Instant,
    last_token: Option<Instant>,
}

fn run_loop(
    scheduler: &mut Scheduler<EngineRunner>,
    inbox: &mpsc::Receiver<Command>,
    shared: &Shared,
    log_every: Option<std::time::Duration>,
) {
    let metrics = &shared.metrics;
    let mut stats = StatsLine::new(metrics);
    let mut clients: HashMap<RequestId, Client> = HashMap::new();
    {
        let total = scheduler
            .runner()
            .runner_config()
            .num_blocks
            .saturating_sub(1);
        metrics.kv_blocks_total.set(total as i64);
    }
    loop {
        // Sleep while idle; otherwise take whatever arrived since the last step.
        let mut pending: Vec<Command> = Vec::new();
        if scheduler.is_idle() {
            match inbox.recv() {
                Ok(c) => pending.push(c),
                Err(_) => return,
            }
        }
        pending.extend(inbox.try_iter());
        let mut outputs = Vec::new();
        for command in pending {
            match command {
                Command::Add {
                    id,
                    prompt,
                    params,
                    events,
                    arrival,
                } => {
                    // Counted as queued before it stops counting as in transit.
                    shared.queued.fetch_add(1, Ordering::SeqCst);
                    shared.in_transit.fetch_sub(1, Ordering::SeqCst);
                    let n = prompt.len();
                    match scheduler.add(id, prompt, params) {
                        Ok(()) => {
                            metrics.prompt_tokens.inc_by(n as u64);
                            clients.insert(
                                id,
                                Client {
                                    events,
                                    arrival,
                                    last_token: None,
                                },
                            );
                        }
                        Err(e) => {
                            metrics.record_outcome(Outcome::Rejected);
                            let _ = events.send(Event::Failed {
                                kind: e.kind(),
                                message: e.to_string(),
                            });
                        }
                    }
                }
                Command::Cancel(id) => {
                    if clients.remove(&id).is_some() {
                        scheduler.cancel(id);
                        metrics.record_outcome(Outcome::Cancelled);
                    }
                }
                Command::AbortAll(message) => outputs.extend(scheduler.abort_all(&message)),
                Command::Shutdown => {
                    outputs.extend(scheduler.abort_all("the server shut down"));
                    route(outputs, &mut clients, scheduler, metrics);
                    return;
                }
            }
        }
        if !scheduler.is_idle() {
            let preempted = scheduler.preemptions();
            outputs.extend(scheduler.step());
            metrics
                .preemptions
                .inc_by(scheduler.preemptions() - preempted);
        }
        route(outputs, &mut clients, scheduler, metrics);
        shared
            .queued
            .store(scheduler.num_waiting(), Ordering::SeqCst);
        shared
            .running
            .store(scheduler.num_running(), Ordering::SeqCst);
        metrics.running.set(scheduler.num_running() as i64);
        metrics
            .waiting
            .set((scheduler.num_waiting() + shared.in_transit.load(Ordering::SeqCst)) as i64);
        metrics
            .kv_blocks_in_use
            .set(scheduler.blocks_in_use() as i64);
        if let Ok(mut f) = shared.failing.lock() {
            *f = scheduler.failing().map(|(n, m)| (n, m.to_owned()));
        }
        if let Some(every) = log_every {
            stats.maybe_print(metrics, every);
        }
    }
}

/// The periodic stats line: throughput since the last line, and what is running now.
struct StatsLine {
    at: Instant,
    prompt_tokens: u64,
    generation_tokens: u64,
}

impl StatsLine {
    fn new(metrics: &Metrics) -> Self {
        StatsLine {
            at: Instant::now(),
            prompt_tokens: metrics.prompt_tokens.get(),
            generation_tokens: metrics.generation_tokens.get(),
        }
    }

    fn maybe_print(&mut self, metrics: &Metrics, every: std::time::Duration) {
        let elapsed = self.at.elapsed();
        if elapsed < every {
            return;
        }
        let now = StatsLine::new(metrics);
        let secs = elapsed.as_secs_f64();
        let total = metrics.kv_blocks_total.get().max(1);
        let used = metrics.kv_blocks_in_use.get();
        tracing::info!(
            "prompt {:.1} tok/s, generation {:.1} tok/s, running {}, waiting {}, \
             KV cache {:.1}% ({used}/{total} blocks), preemptions {}",
            (now.prompt_tokens - self.prompt_tokens) as f64 / secs,
            (now.generation_tokens - self.generation_tokens) as f64 / secs,
            metrics.running.get(),
            metrics.waiting.get(),
            100.0 * used as f64 / total as f64,
            metrics.preemptions.get(),
        );
        *self = now;
    }
}

fn outcome_of(f: FinishReason) -> Outcome {
    match f {
        FinishReason::Stop => Outcome::Stop,
        FinishReason::Length => Outcome::Length,
    }
}

/// Sends each output to its request, recording timings and outcomes; a request whose client
/// has gone is cancelled on the spot.
fn route(
    outputs: Vec<super::scheduler::Output>,
    clients: &mut HashMap<RequestId, Client>,
    scheduler: &mut Scheduler<EngineRunner>,
    metrics: &Metrics,
) {
    let now = Instant::now();
    for out in outputs {
        let Some(client) = clients.get_mut(&out.id) else {
            continue;
        };
        let outcome = match &out.event {
            Event::Token(t) => {
                metrics.generation_tokens.inc();
                match client.last_token {
                    None => metrics
                        .time_to_first_token
                        .observe((now - client.arrival).as_secs_f64()),
                    Some(last) => metrics
                        .time_per_output_token
                        .observe((now - last).as_secs_f64()),
                }
                client.last_token = Some(now);
                t.finish.map(outcome_of)
            }
            Event::PromptLogprobs { .. } => None,
            Event::Finished(f) => Some(outcome_of(*f)),
            Event::Failed { .. } => Some(Outcome::Error),
        };
        if let Some(outcome) = outcome {
            // Counted before the last event goes out, so whoever reads that event (a client,
            // a test) already sees the request in the metrics.
            let cancelled = client.events.is_closed();
            metrics.record_outcome(if cancelled {
                Outcome::Cancelled
            } else {
                outcome
            });
            let _ = client.events.send(out.event);
            clients.remove(&out.id);
        } else if client.events.send(out.event).is_err() {
            clients.remove(&out.id);
            scheduler.cancel(out.id);
            metrics.record_outcome(Outcome::Cancelled);
        }
    }
}
