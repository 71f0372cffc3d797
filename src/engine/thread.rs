//! The scheduler on a thread of its own, for the async server.
//!
//! The runner is built and owned by the engine thread (a device runner's handles never cross
//! threads). Requests arrive over a channel; the thread sleeps while there is nothing to do and
//! otherwise loops: take new requests and cancellations, run one scheduler iteration, route the
//! events, update the metrics.
//!
//! # Backpressure
//!
//! Each request's events go into a queue of its own that holds [`EVENT_QUEUE_CAPACITY`] events.
//! The engine thread serves everyone, so it never waits on one client: when a request's queue
//! has no room for what one more step could produce, its sequence is left out of the steps
//! (paused: it keeps its KV blocks and its place, and does not count as failed) until its
//! reader brings the queue down to half, which wakes the thread. No event is ever dropped (a
//! paused sequence produces none; the one that ends a request always fits, see
//! [`EVENT_QUEUE_CAPACITY`]). A sequence paused longer than the stall timeout
//! ([`DEFAULT_STALL_TIMEOUT`], `deepinfer serve --stall-timeout-secs`) is cancelled and its
//! blocks freed. When nothing can run (every sequence paused, or waiting for blocks that paused
//! ones hold) the thread sleeps until a command, a reader's wake-up or the next stall deadline,
//! instead of spinning.
//!
//! The queue used to be an unbounded channel: a client that never read grew the server by
//! every token of its request (one `n = 16`, `logprobs = 20` stream took it from 48 MB to
//! 1 GB). A bounded tokio channel was considered; its sender cannot push the one event that
//! ends a request past a full queue, and the engine would still have to learn when its reader
//! freed room, so the queue is a small mutex-guarded deque with a [`Notify`] for the reader
//! and the command channel for the engine.
//!
//! A [`RequestStream`] dropped before its request finished (a client that went away) cancels
//! the request, which frees its blocks before the next step.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::error::{Error, ErrorKind, Result};
use crate::metrics::{Metrics, Outcome};
use crate::runner::{BucketKey, LiveBuckets, Runner};
use crate::tokenizer::Tokenizer;

/// The runner the engine thread drives: whichever backend [`crate::runner::open`] chose.
type EngineRunner = Box<dyn Runner>;

use super::grammar::Constraint;
use super::params::{FinishReason, GenerationParams};
use super::scheduler::{validate, Event, RequestId, Scheduler};

/// Consecutive failed steps after which [`Engine::unhealthy`] reports the engine unhealthy.
pub const UNHEALTHY_AFTER: u32 = 3;

/// Events a request's queue holds before its sequence is paused: enough that a reader keeping
/// up never pauses it (a reader wakes on the first event and takes them all), few enough that a
/// client that stops reading costs little.
///
/// The memory a stalled request holds: a sequence steps only while its queue has room for
/// what a step adds, and the event that ends a request goes in whatever the room, so a queue
/// holds at most capacity + 1 events. An event is at most 96 bytes (a unit test checks) plus
/// its heap: a token's text (a few bytes) and, with log-probabilities, 8 bytes per alternative
/// (at most 20): about 300 bytes with the allocator's overhead, so about 20 KB per stalled
/// choice, 1.3 MB for a request of 64 choices (the most a request may ask for). The largest
/// event is a prefill chunk's prompt log-probabilities (`echo` with `logprobs` only): about
/// 200 bytes per position times the prefill chunk (64 by default), 13 KB, so 850 KB per choice
/// in the worst case. The HTTP side adds, per response, one serialized chunk (a few KB) and
/// hyper's write buffer (at most 16 chunks or about 400 KB); the socket's kernel buffers are
/// not the process's memory.
pub const EVENT_QUEUE_CAPACITY: usize = 64;

/// The most events one scheduler iteration gives one sequence: a prefill chunk's prompt
/// log-probabilities and its first token.
const MAX_EVENTS_PER_STEP: usize = 2;

/// A paused sequence resumes once its reader has brought its queue down to this: resuming at
/// the first free slot would pause and wake it on every event.
const RESUME_AT: usize = EVENT_QUEUE_CAPACITY / 2;

/// How long a request may stay paused on a full queue (its client reading nothing) before it
/// is cancelled and its KV blocks freed, unless [`Engine::set_stall_timeout`] says otherwise.
/// A minute outlasts any pause of a client that is reading, however slowly (one event per
/// second still resumes it every half minute), and bounds how long a dead connection holds
/// cache blocks.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest the thread sleeps when nothing could run and no stall deadline is nearer: a
/// safety net, as every change that lets work run (a command, a reader's wake-up) wakes it.
const STUCK_POLL: Duration = Duration::from_millis(100);

/// How often an idle engine thread looks for buckets that finished compiling in the
/// background (a busy one looks before every iteration), so that they join, and show in the
/// metrics, while no request is running.
const JOIN_POLL: Duration = Duration::from_millis(200);

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
    /// Reuse the cached KV blocks of earlier requests' prefixes (see the scheduler's docs);
    /// on by default.
    pub prefix_caching: bool,
    /// Give each active request at most an equal share of a decode step's rows (see
    /// [`Scheduler::set_fair_decode`]); for backends whose step cost grows with its rows.
    pub fair_decode: bool,
    /// With fair decoding, how many times a step of one row per active request a step may
    /// cost (see [`Scheduler::set_fair_decode_slowdown`]).
    pub fair_decode_slowdown: f64,
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
    /// Whether the model's sequences can share cached prefixes (not a DeepSeek-V4 model's:
    /// see `scheduler::shares_prefixes`), whatever the options asked.
    pub shares_prefixes: bool,
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
        /// Boxed: the other commands are a word or two.
        params: Box<GenerationParams>,
        constraint: Option<Box<Constraint>>,
        events: EventSender,
        arrival: Instant,
    },
    Cancel(RequestId),
    /// A reader freed room in a paused request's queue.
    Wake,
    AbortAll(String),
    Shutdown,
}

/// The contents of one request's event queue.
#[derive(Debug, Default)]
struct QueueState {
    events: VecDeque<Event>,
    /// The engine left the sequence out of a step for want of room; the reader wakes the
    /// engine when it brings the queue down to [`RESUME_AT`].
    paused: bool,
    /// The [`RequestStream`] is gone: nobody will read.
    reader_gone: bool,
    /// The engine dropped its end: no more events will come.
    writer_gone: bool,
}

/// One request's events between the engine thread and its [`RequestStream`].
#[derive(Debug, Default)]
struct EventQueue {
    state: Mutex<QueueState>,
    /// Wakes the reader (one, so a wake-up that finds it not waiting is kept for its next
    /// wait).
    readable: Notify,
}

impl EventQueue {
    /// The state; a panic while it was held leaves it consistent (every change is one step),
    /// so a poisoned lock is taken anyway.
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The engine thread's end of a request's queue.
#[derive(Debug)]
struct EventSender(Arc<EventQueue>);

impl EventSender {
    /// Appends `event`; `Err` if the reader is gone (the request should be cancelled). Never
    /// refuses for want of room: the engine only steps a sequence whose queue has room
    /// ([`EventSender::may_step`]), and the last event of a request must never be lost.
    fn send(&self, event: Event) -> std::result::Result<(), Event> {
        let mut s = self.0.lock();
        if s.reader_gone {
            return Err(event);
        }
        s.events.push_back(event);
        drop(s);
        self.0.readable.notify_one();
        Ok(())
    }

    /// Whether the sequence may take part in the next step: its queue has room for what a
    /// step produces. If not it is marked paused, and its reader wakes the engine once the
    /// queue is down to [`RESUME_AT`]; a paused sequence resumes only then.
    fn may_step(&self) -> bool {
        let mut s = self.0.lock();
        if s.paused {
            if s.events.len() > RESUME_AT {
                return false;
            }
            s.paused = false;
            return true;
        }
        if s.events.len() + MAX_EVENTS_PER_STEP > EVENT_QUEUE_CAPACITY {
            s.paused = true;
            return false;
        }
        true
    }

    /// Ends a stalled request: its unread events are dropped (its client is not reading
    /// them, and they are what a stall costs) and `event` is its last.
    fn replace_all(&self, event: Event) {
        let mut s = self.0.lock();
        s.events.clear();
        s.events.push_back(event);
        drop(s);
        self.0.readable.notify_one();
    }

    /// Whether the reader is gone.
    fn is_closed(&self) -> bool {
        self.0.lock().reader_gone
    }
}

impl Drop for EventSender {
    fn drop(&mut self) {
        self.0.lock().writer_gone = true;
        self.0.readable.notify_one();
    }
}

/// What a reader found in its queue.
enum Popped {
    /// An event; `wake` if taking it resumed the paused sequence (the engine must be told).
    Event { event: Event, wake: bool },
    /// Nothing yet.
    Empty,
    /// Nothing, and nothing will come.
    Closed,
}

impl EventQueue {
    fn pop(&self) -> Popped {
        let mut s = self.lock();
        match s.events.pop_front() {
            Some(event) => {
                let wake = s.paused && s.events.len() <= RESUME_AT;
                if wake {
                    s.paused = false;
                }
                Popped::Event { event, wake }
            }
            None if s.writer_gone => Popped::Closed,
            None => Popped::Empty,
        }
    }
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
    /// The stall timeout in milliseconds (see [`Engine::set_stall_timeout`]).
    stall_timeout_ms: AtomicU64,
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
/// At most [`EVENT_QUEUE_CAPACITY`] (plus the last) wait unread: a request whose events are
/// not read pauses. Dropping it early cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    prompt_tokens: usize,
    events: Arc<EventQueue>,
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
        loop {
            match self.events.pop() {
                Popped::Event { event, wake } => {
                    if wake {
                        // The engine may be gone; then nothing is waiting for the wake-up.
                        let _ = self.commands.send(Command::Wake);
                    }
                    if event.is_last() {
                        self.done = true;
                    }
                    return Some(event);
                }
                Popped::Closed => {
                    self.done = true;
                    return None;
                }
                // A push between the check and this wait leaves a permit: no wake-up is lost.
                Popped::Empty => self.events.readable.notified().await,
            }
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        {
            let mut s = self.events.lock();
            s.reader_gone = true;
            s.events.clear();
        }
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
            stall_timeout_ms: AtomicU64::new(DEFAULT_STALL_TIMEOUT.as_millis() as u64),
            metrics,
        });
        let thread_shared = shared.clone();
        let eos = options.eos_token_ids.clone();
        let log_every = options.log_stats_every;
        let token_budget = options.max_num_batched_tokens;
        let prefix_caching = options.prefix_caching;
        let fair_decode = options.fair_decode;
        let fair_slowdown = options.fair_decode_slowdown;
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
                    shares_prefixes: super::shares_prefixes(runner.config()),
                };
                let scheduler = Scheduler::new(runner, tokenizer, eos).and_then(|mut s| {
                    if let Some(n) = token_budget {
                        s.set_max_num_batched_tokens(n)?;
                    }
                    s.set_prefix_caching(prefix_caching)?;
                    s.set_fair_decode(fair_decode);
                    s.set_fair_decode_slowdown(fair_slowdown)?;
                    Ok(s)
                });
                let mut scheduler = match scheduler {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Before the engine says it is ready: a scrape right after sees them.
                let metrics = &thread_shared.metrics;
                let total = scheduler.runner().runner_config().num_blocks;
                metrics.kv_blocks_total.set(total.saturating_sub(1) as i64);
                publish_buckets(scheduler.runner(), metrics);
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

    /// Sets how long a request may stay paused because its client reads none of its events
    /// before it is cancelled (default [`DEFAULT_STALL_TIMEOUT`]). A setting of the running
    /// engine rather than an [`EngineOptions`] field: it is serving policy, and it applies to
    /// stalls from the next iteration on.
    pub fn set_stall_timeout(&self, timeout: Duration) {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self.shared.stall_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// Queues a request. It is checked against the model here, so a bad one is refused before it
    /// costs anything.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: GenerationParams,
    ) -> std::result::Result<RequestStream, SubmitError> {
        self.submit_constrained(prompt, params, None)
    }

    /// [`Engine::submit`] under a structured-output constraint (see
    /// [`Scheduler::add_constrained`]).
    pub fn submit_constrained(
        &self,
        prompt: Vec<u32>,
        params: GenerationParams,
        constraint: Option<Constraint>,
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
        let queue = Arc::new(EventQueue::default());
        let prompt_tokens = prompt.len();
        let sent = self.commands.send(Command::Add {
            id,
            prompt,
            params: Box::new(params),
            constraint: constraint.map(Box::new),
            events: EventSender(queue.clone()),
            arrival: Instant::now(),
        });
        if sent.is_err() {
            self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Draining);
        }
        Ok(RequestStream {
            id,
            prompt_tokens,
            events: queue,
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
    /// `UNHEALTHY_AFTER` or more steps all failed (a device that no longer executes).
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
    events: EventSender,
    arrival: Instant,
    last_token: Option<Instant>,
    /// Since when its queue has been too full to step (`None` while it steps).
    stalled_since: Option<Instant>,
    /// It was paused since its last token: the gap to the next is its client's, not the
    /// engine's, and stays out of the time-per-output-token histogram.
    resumed: bool,
}

fn run_loop(
    scheduler: &mut Scheduler<EngineRunner>,
    inbox: &mpsc::Receiver<Command>,
    shared: &Shared,
    log_every: Option<Duration>,
) {
    let metrics = &shared.metrics;
    let mut stats = StatsLine::new(metrics);
    let mut clients: HashMap<RequestId, Client> = HashMap::new();
    // When the last iteration could run nothing, how long to sleep for a change.
    let mut stuck: Option<Duration> = None;
    loop {
        // Sleep while idle (or stuck); otherwise take whatever arrived since the last step.
        let mut pending: Vec<Command> = Vec::new();
        let compiling = scheduler
            .runner()
            .live_buckets()
            .is_some_and(|l| l.has_pending());
        if scheduler.is_idle() && compiling {
            match inbox.recv_timeout(JOIN_POLL) {
                Ok(c) => pending.push(c),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        } else if scheduler.is_idle() {
            match inbox.recv() {
                Ok(c) => pending.push(c),
                Err(_) => return,
            }
        } else if let Some(wait) = stuck {
            match inbox.recv_timeout(wait) {
                Ok(c) => pending.push(c),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        pending.extend(inbox.try_iter());
        if compiling && !scheduler.runner_mut().join_buckets().is_empty() {
            publish_buckets(scheduler.runner(), metrics);
        }
        let mut outputs = Vec::new();
        for command in pending {
            match command {
                Command::Add {
                    id,
                    prompt,
                    params,
                    constraint,
                    events,
                    arrival,
                } => {
                    // Counted as queued before it stops counting as in transit.
                    shared.queued.fetch_add(1, Ordering::SeqCst);
                    shared.in_transit.fetch_sub(1, Ordering::SeqCst);
                    let n = prompt.len();
                    match scheduler.add_constrained(id, prompt, *params, constraint.map(|c| *c)) {
                        Ok(()) => {
                            metrics.prompt_tokens.inc_by(n as u64);
                            clients.insert(
                                id,
                                Client {
                                    events,
                                    arrival,
                                    last_token: None,
                                    stalled_since: None,
                                    resumed: false,
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
                // Only wakes the thread: the next iteration sees the room.
                Command::Wake => {}
                Command::AbortAll(message) => outputs.extend(scheduler.abort_all(&message)),
                Command::Shutdown => {
                    outputs.extend(scheduler.abort_all("the server shut down"));
                    route(outputs, &mut clients, scheduler, metrics);
                    return;
                }
            }
        }
        let stall_timeout = Duration::from_millis(shared.stall_timeout_ms.load(Ordering::Relaxed));
        let (paused, next_deadline) =
            pause_or_cancel(&mut clients, scheduler, metrics, stall_timeout);
        stuck = None;
        if !scheduler.is_idle() {
            let preempted = scheduler.preemptions();
            let cache = scheduler.prefix_cache_stats();
            let spec = scheduler.speculative_stats();
            let steps = scheduler.steps_run();
            outputs.extend(scheduler.step_with(|id| paused.contains(&id)));
            metrics
                .preemptions
                .inc_by(scheduler.preemptions() - preempted);
            let now = scheduler.prefix_cache_stats();
            metrics
                .prefix_cache_queries
                .inc_by(now.queries - cache.queries);
            metrics.prefix_cache_hits.inc_by(now.hits - cache.hits);
            let now = scheduler.speculative_stats();
            metrics
                .spec_drafts
                .inc_by(now.verified_rows - spec.verified_rows);
            metrics.spec_draft_tokens.inc_by(now.drafted - spec.drafted);
            metrics
                .spec_accepted_tokens
                .inc_by(now.accepted - spec.accepted);
            if scheduler.steps_run() == steps {
                stuck = Some(next_deadline.map_or(STUCK_POLL, |d| {
                    d.saturating_duration_since(Instant::now()).min(STUCK_POLL)
                }));
            }
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

/// Sets the bucket gauges from the runner's live buckets (every bucket live for a runner
/// that captured them all).
fn publish_buckets(runner: &dyn Runner, metrics: &Metrics) {
    match runner.live_buckets() {
        Some(live) => {
            let pending = live.pending();
            let failed: Vec<BucketKey> = live.failed().iter().map(|(k, _)| *k).collect();
            metrics.set_buckets(live.live(), &pending, &failed);
        }
        None => {
            let all = LiveBuckets::keys_of(&runner.runner_config().buckets);
            metrics.set_buckets(&all, [], []);
        }
    }
}

/// Decides which requests sit out the next step because their queues are full, and cancels
/// those that have sat out longer than `stall_timeout` (their clients get a last event saying
/// why, should they ever read). Returns the paused requests and the earliest time one of them
/// would be cancelled.
fn pause_or_cancel(
    clients: &mut HashMap<RequestId, Client>,
    scheduler: &mut Scheduler<EngineRunner>,
    metrics: &Metrics,
    stall_timeout: Duration,
) -> (HashSet<RequestId>, Option<Instant>) {
    let now = Instant::now();
    let mut paused = HashSet::new();
    let mut expired = Vec::new();
    let mut next_deadline: Option<Instant> = None;
    for (&id, client) in clients.iter_mut() {
        if client.events.may_step() {
            if client.stalled_since.take().is_some() {
                client.resumed = true;
            }
            continue;
        }
        let deadline = *client.stalled_since.get_or_insert(now) + stall_timeout;
        if deadline <= now {
            expired.push(id);
        } else {
            paused.insert(id);
            next_deadline = Some(next_deadline.map_or(deadline, |d| d.min(deadline)));
        }
    }
    for id in expired {
        let Some(client) = clients.remove(&id) else {
            continue;
        };
        scheduler.cancel(id);
        metrics.record_outcome(Outcome::Cancelled);
        tracing::info!(
            "request {id} cancelled: its client read none of its events for {} s",
            stall_timeout.as_secs_f64()
        );
        client.events.replace_all(Event::Failed {
            kind: ErrorKind::InvalidInput,
            message: format!(
                "the request was cancelled: its client read none of its stream for {} s",
                stall_timeout.as_secs_f64()
            ),
        });
    }
    (paused, next_deadline)
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

    fn maybe_print(&mut self, metrics: &Metrics, every: Duration) {
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
                    Some(_) if client.resumed => {}
                    Some(last) => metrics
                        .time_per_output_token
                        .observe((now - last).as_secs_f64()),
                }
                client.last_token = Some(now);
                client.resumed = false;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::params::FinishReason;
    use crate::engine::scheduler::TokenEvent;

    fn token(finish: Option<FinishReason>) -> Event {
        Event::Token(TokenEvent {
            token: 7,
            text: "x".into(),
            finish,
            logprobs: None,
        })
    }

    fn pair() -> (EventSender, RequestStream, mpsc::Receiver<Command>) {
        let queue = Arc::new(EventQueue::default());
        let (commands, inbox) = mpsc::channel();
        let stream = RequestStream {
            id: 1,
            prompt_tokens: 1,
            events: queue.clone(),
            commands,
            done: false,
        };
        (EventSender(queue), stream, inbox)
    }

    fn wakes(inbox: &mpsc::Receiver<Command>) -> usize {
        inbox
            .try_iter()
            .filter(|c| matches!(c, Command::Wake))
            .count()
    }

    #[test]
    fn a_full_queue_pauses_until_its_reader_takes_half() {
        let (tx, mut rx, inbox) = pair();
        let mut sent = 0;
        while tx.may_step() {
            tx.send(token(None)).unwrap();
            sent += 1;
        }
        // Room for a whole step is kept: a step adds at most MAX_EVENTS_PER_STEP.
        assert_eq!(sent, EVENT_QUEUE_CAPACITY - MAX_EVENTS_PER_STEP + 1);
        // The last event still goes in: nothing is ever dropped.
        tx.send(token(Some(FinishReason::Length))).unwrap();
        let queued = sent + 1;
        // Taking a few does not resume it (no wake-up per event)...
        for _ in 0..queued - RESUME_AT - 1 {
            assert!(futures::executor::block_on(rx.next()).is_some());
            assert!(!tx.may_step());
        }
        assert_eq!(wakes(&inbox), 0);
        // ...bringing it down to half does, and wakes the engine once.
        assert!(futures::executor::block_on(rx.next()).is_some());
        assert_eq!(wakes(&inbox), 1);
        assert!(tx.may_step());
        for _ in 0..RESUME_AT - 1 {
            assert!(futures::executor::block_on(rx.next()).is_some());
        }
        let last = futures::executor::block_on(rx.next()).unwrap();
        assert!(last.is_last());
        assert!(futures::executor::block_on(rx.next()).is_none());
        assert_eq!(wakes(&inbox), 0);
    }

    #[test]
    fn a_reader_waits_for_events_and_ends_when_the_engine_drops_its_end() {
        let (tx, mut rx, _inbox) = pair();
        let reader = std::thread::spawn(move || {
            let mut n = 0;
            while futures::executor::block_on(rx.next()).is_some() {
                n += 1;
            }
            n
        });
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(5));
            tx.send(token(None)).unwrap();
        }
        drop(tx);
        assert_eq!(reader.join().unwrap(), 3);
    }

    #[test]
    fn a_dropped_reader_frees_the_queue_and_cancels() {
        let (tx, rx, inbox) = pair();
        tx.send(token(None)).unwrap();
        drop(rx);
        assert!(tx.is_closed());
        assert!(tx.send(token(None)).is_err());
        assert!(tx.0.lock().events.is_empty());
        assert!(matches!(inbox.try_recv(), Ok(Command::Cancel(1))));
    }

    #[test]
    fn a_stalled_request_ends_with_one_failure_in_place_of_its_unread_events() {
        let (tx, mut rx, _inbox) = pair();
        while tx.may_step() {
            tx.send(token(None)).unwrap();
        }
        tx.replace_all(Event::Failed {
            kind: ErrorKind::InvalidInput,
            message: "stalled".into(),
        });
        drop(tx);
        let e = futures::executor::block_on(rx.next()).unwrap();
        assert!(matches!(e, Event::Failed { .. }), "{e:?}");
        assert!(futures::executor::block_on(rx.next()).is_none());
    }

    /// The sizes [`EVENT_QUEUE_CAPACITY`]'s memory bound is computed from.
    #[test]
    fn events_are_as_small_as_the_documented_bound_assumes() {
        assert!(
            std::mem::size_of::<Event>() <= 96,
            "{}",
            std::mem::size_of::<Event>()
        );
        assert!(std::mem::size_of::<Option<super::super::TokenLogprobs>>() <= 32);
    }
}
