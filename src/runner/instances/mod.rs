//! One model over several instances: a leader that schedules and its followers.
//!
//! A model split over more NeuronCores than one instance has (DeepSeek-V3 at `--tp 64` over
//! two trn1.32xlarge) runs one process per instance, each with a contiguous span of the global
//! ranks. libnrt's collectives join the ranks across instances over EFA, but every rank must
//! also execute the same graph with the same step metadata at every step, and only one process
//! schedules. So the process that schedules (the leader: `serve`, `generate`, with `--ranks
//! 0..K --followers HOST:PORT,..`) sends each step to the others (the followers, `deepinfer
//! follow --ranks K..N --listen ADDR`), which run it on their ranks and answer.
//!
//! - **Launch.** A follower is started with only its model, backend, ranks and address; the
//!   leader connects and sends its [`Launch`] (the tensor-parallel degree and every limit that
//!   decides what is captured). Each follower opens its model within it and answers with its
//!   [`Setup`] before capturing anything: the leader checks that the model, the runner
//!   configuration and the dtypes are its own and that the followers' ranks, after its own,
//!   cover the degree. A mismatch is one error naming what differs (the followers are told
//!   and end), before any NEFF is loaded: a follower of another model would otherwise leave
//!   every rank waiting in libnrt's collectives bootstrap for ranks that never load the same
//!   NEFF. Only when all agree does the leader tell them to capture, and capture its own
//!   ranks meanwhile: every rank of every instance loads each NEFF at the same time, as the
//!   bootstrap requires. Each follower says when it is captured.
//! - **Steps.** The leader sends a step (its graph's key, the metadata arrays, and which logits
//!   rows it wants back) to every follower before it executes its own ranks, then waits for
//!   every answer. A follower's failure fails the step like a local rank's; a follower that
//!   does not answer within [`Timeouts::step`], or whose connection drops, fails that step and
//!   every later one (a lost instance cannot be replaced under libnrt's collectives), promptly
//!   and with its address in the message.
//! - **The logits** are each rank's vocabulary slice: a follower returns its ranks' columns of
//!   the rows asked for (only for requests that want logprobs; sampling never needs them).
//!
//! - **Who may lead.** A follower answers only a leader that proves it holds the secret both
//!   were given ([`ENV_SECRET`](crate::deployment::ENV_SECRET)): a challenge-response at the handshake
//!   (`deployment::secret`); any other connection is refused before it can send a step
//!   or read an output, and the follower goes on waiting (the follower's side is
//!   [`crate::runner::follow`]).
//!
//! The wire format is in `wire`. Only the handshake is authenticated (the steps are not
//! encrypted): run followers on the cluster's private network, as libnrt's collectives are.

pub(crate) mod wire;

use std::io::ErrorKind as IoKind;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::deployment::secret::{self, InstanceSecret};
use crate::deployment::{Limits, RankSpan};
use crate::error::{Error, Result};
use crate::model::PrecisionChoice;

use wire::{read_frame, text, write_text, Tag};
pub(crate) use wire::{Done, StepMessage};

/// How long a leader waits on its followers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// To connect to a follower (retried until then: followers may still be starting).
    pub connect: Duration,
    /// For a follower to capture (compile and load) and answer the launch.
    pub capture: Duration,
    /// For a follower to answer one step.
    pub step: Duration,
}

impl Default for Timeouts {
    /// Ten minutes to connect; capture as long as the longest compile may take
    /// ([`crate::backend::neuron::compile::DEFAULT_TIMEOUT`]) plus loading; five minutes a step
    /// (a step takes milliseconds; the margin covers libnrt's own collective timeouts, so the
    /// leader reports the follower's error rather than its own timeout).
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(600),
            capture: crate::backend::neuron::compile::DEFAULT_TIMEOUT + Duration::from_secs(600),
            step: Duration::from_secs(300),
        }
    }
}

/// What a leader sends a follower to capture: the degree and every limit a capture depends on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    /// The leader's deepinfer version; a follower of another version refuses.
    pub version: String,
    /// `--tp`.
    pub tp: usize,
    /// `--max-batch`.
    pub max_batch: usize,
    /// `--max-len`.
    pub max_len: usize,
    /// `--kv-blocks N`.
    pub kv_blocks: Option<usize>,
    /// `--kv-blocks auto`.
    pub kv_blocks_auto: bool,
    /// `--hbm-utilization`.
    pub hbm_utilization: f64,
    /// `--prefill-chunk`.
    pub prefill_chunk: Option<usize>,
    /// `--max-prefill-seqs`.
    pub prefill_seqs: Option<usize>,
    /// `--dtype`, `--kv-dtype`, `--quantize`, as typed.
    pub dtype: String,
    /// See `dtype`.
    pub kv_dtype: String,
    /// See `dtype`.
    pub quantize: String,
    /// `--compile-timeout`, in seconds.
    pub compile_timeout_secs: Option<u64>,
    /// `--split-sampler`: the followers capture the same split decode graphs.
    #[serde(default)]
    pub split_sampler: bool,
    /// `--speculative-tokens`: the followers load the MTP layer and capture the same draft and
    /// verify graphs.
    #[serde(default)]
    pub speculative_tokens: usize,
}

impl Launch {
    /// The launch of a leader running within `limits`.
    pub fn of(limits: &Limits) -> Launch {
        Launch {
            version: env!("CARGO_PKG_VERSION").to_string(),
            tp: limits.tp,
            max_batch: limits.max_batch,
            max_len: limits.max_len,
            kv_blocks: limits.kv_blocks,
            kv_blocks_auto: limits.kv_blocks_auto,
            hbm_utilization: limits.hbm_utilization,
            prefill_chunk: limits.prefill_chunk,
            prefill_seqs: limits.prefill_seqs,
            dtype: limits.precision.dtype.to_string(),
            kv_dtype: limits.precision.kv_dtype.to_string(),
            quantize: limits.precision.quantize.to_string(),
            compile_timeout_secs: limits.compile_timeout.map(|d| d.as_secs()),
            split_sampler: limits.split_sampler,
            speculative_tokens: limits.speculative_tokens,
        }
    }

    /// The limits a follower running `ranks` captures within.
    pub fn limits(&self, ranks: RankSpan) -> Result<Limits> {
        if self.version != env!("CARGO_PKG_VERSION") {
            return Err(Error::InvalidInput(format!(
                "the leader runs deepinfer {}, this follower {}: run the same build everywhere",
                self.version,
                env!("CARGO_PKG_VERSION")
            )));
        }
        Ok(Limits {
            kv_blocks: self.kv_blocks,
            kv_blocks_auto: self.kv_blocks_auto,
            hbm_utilization: self.hbm_utilization,
            prefill_chunk: self.prefill_chunk,
            prefill_seqs: self.prefill_seqs,
            precision: PrecisionChoice {
                dtype: self.dtype.parse()?,
                kv_dtype: self.kv_dtype.parse()?,
                quantize: self.quantize.parse()?,
            },
            compile_timeout: self.compile_timeout_secs.map(Duration::from_secs),
            tp: self.tp,
            ranks: Some(ranks),
            split_sampler: self.split_sampler,
            speculative_tokens: self.speculative_tokens,
            ..Limits::new(self.max_batch, self.max_len)
        })
    }
}

/// What a process captured, for the leader to check its followers against: the same model,
/// runner configuration and dtypes on every instance, and where each one's ranks are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// The first global rank the process runs.
    pub first: usize,
    /// How many ranks it runs.
    pub count: usize,
    /// The model's configuration, as the runner read it (`Debug` text).
    pub model: String,
    /// The runner configuration: degree, buckets, cache (`Debug` text).
    pub runner: String,
    /// The resolved dtypes and quantization (`Debug` text).
    pub precision: String,
}

impl Setup {
    /// The first difference from `leader`'s that makes the two unable to run one model, named.
    fn mismatch(&self, leader: &Setup) -> Option<String> {
        if self.model != leader.model {
            return Some("its model (config.json) is not the leader's".into());
        }
        if self.runner != leader.runner {
            return Some(format!(
                "its runner configuration {} is not the leader's {}",
                self.runner, leader.runner
            ));
        }
        if self.precision != leader.precision {
            return Some(format!(
                "its dtypes {} are not the leader's {} (does its checkpoint hold other dtypes?)",
                self.precision, leader.precision
            ));
        }
        None
    }
}

/// One follower's answer to a step: the first rank it runs, and the logits asked for or the
/// error (with whether it was a collective's).
pub(crate) type Answer = (usize, Result<Vec<f32>, (Error, bool)>);

/// A follower as the leader sees it.
struct Link {
    addr: String,
    span: RankSpan,
    stream: TcpStream,
}

/// Followers connected and sent the launch, opening the model; [`Pending::agree`] checks
/// their setups and lets them capture.
pub struct Pending {
    links: Vec<(String, TcpStream)>,
    timeouts: Timeouts,
}

/// Followers whose setups agree with the leader's, capturing; [`Capturing::join`] waits for
/// them.
pub struct Capturing {
    links: Vec<Link>,
    timeouts: Timeouts,
}

/// A leader's followers, ready for steps (see the module docs).
pub struct Followers {
    links: Vec<Link>,
    step_timeout: Duration,
    /// The address of the follower lost and why the followers can no longer run steps.
    lost: Option<(String, String)>,
}

impl std::fmt::Debug for Followers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<_> = self.links.iter().map(|l| (&l.addr, l.span)).collect();
        f.debug_struct("Followers")
            .field("links", &addrs)
            .field("lost", &self.lost)
            .finish()
    }
}

/// An error of the instance at `addr`: `what` failed with `e`.
pub(crate) fn lost(addr: &str, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Instance {
        addr: addr.to_string(),
        msg: format!("{what}: {e}"),
    }
}

/// Connects to `addr`, retrying refused connections until `deadline`.
fn connect(addr: &str, deadline: Instant) -> Result<TcpStream> {
    let resolved: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| Error::InvalidInput(format!("--followers {addr}: {e} (expected HOST:PORT)")))?
        .collect();
    let mut said = false;
    loop {
        let mut last = None;
        for a in &resolved {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(a, left.max(Duration::from_millis(1))) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() >= deadline {
            let e = last.map_or("no address".to_string(), |e| e.to_string());
            return Err(lost(
                addr,
                "no follower answered (is `deepinfer follow` running there?)",
                e,
            ));
        }
        if !said {
            tracing::info!("waiting for the follower at {addr} (`deepinfer follow`) to listen");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Followers {
    /// Connects to the followers at `addrs` (in the order of their ranks) and sends each
    /// `launch` with the proof of `secret` for its challenge; returns while they open the
    /// model ([`Pending::agree`] goes on).
    pub fn launch(
        addrs: &[String],
        launch: &Launch,
        secret: &InstanceSecret,
        timeouts: Timeouts,
    ) -> Result<Pending> {
        let deadline = Instant::now() + timeouts.connect;
        let json = serde_json::to_string(launch)
            .map_err(|e| Error::Internal(format!("launch as JSON: {e}")))?;
        let mut links = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let mut stream = connect(addr, deadline)?;
            let left = deadline.saturating_duration_since(Instant::now());
            stream
                .set_nodelay(true)
                .and_then(|()| stream.set_read_timeout(Some(left.max(Duration::from_secs(30)))))
                .map_err(|e| lost(addr, "configuring the connection", e))?;
            let challenge = match read_frame(&mut stream) {
                Ok(Ok((Tag::Challenge, body))) => secret::from_hex(&text(body)?)
                    .filter(|c| c.len() == secret::CHALLENGE_BYTES)
                    .ok_or_else(|| lost(addr, "its challenge", "not 32 bytes of hex"))?,
                Ok(Ok((tag, _))) => return Err(lost(addr, "expected a challenge, got", tag as u8)),
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(lost(addr, "waiting for its challenge", e)),
            };
            let proof = secret.prove(&challenge, &json)?;
            write_text(&mut stream, Tag::Hello, &format!("{proof}\n{json}"))
                .map_err(|e| lost(addr, "sending the launch", e))?;
            links.push((addr.clone(), stream));
        }
        Ok(Pending { links, timeouts })
    }

    /// Sends `step` to every follower; their answers are [`Followers::wait`]'s.
    pub(crate) fn send(&mut self, step: &StepMessage) -> Result<()> {
        if let Some((addr, msg)) = &self.lost {
            return Err(Error::Instance {
                addr: addr.clone(),
                msg: msg.clone(),
            });
        }
        for i in 0..self.links.len() {
            let l = &mut self.links[i];
            if let Err(e) = step.write(&mut l.stream)? {
                return Err(self.lose(i, "sending a step", e));
            }
        }
        Ok(())
    }

    /// Every follower's answer to the step [`Followers::send`] sent, in rank order: the logits
    /// asked for with the first rank they start at, or the error (and whether it was a
    /// collective's, caused elsewhere).
    pub(crate) fn wait(&mut self) -> Vec<Answer> {
        let mut answers = Vec::with_capacity(self.links.len());
        for i in 0..self.links.len() {
            let l = &mut self.links[i];
            let (first, addr) = (l.span.first, l.addr.clone());
            let answer = match read_frame(&mut l.stream) {
                Ok(Ok((Tag::Done, body))) => match Done::read(&body) {
                    Ok(Done::Ran(logits)) => Ok(logits),
                    Ok(Done::Failed {
                        message,
                        collective,
                    }) => Err((Error::Instance { addr, msg: message }, collective)),
                    Err(e) => Err((self.lose(i, "reading its answer", e), false)),
                },
                Ok(Ok((tag, body))) => {
                    let why = match tag {
                        Tag::Failed => text(body).unwrap_or_default(),
                        _ => format!("an unexpected {tag:?} message"),
                    };
                    Err((self.lose(i, "it stopped", why), false))
                }
                Ok(Err(e)) => Err((self.lose(i, "reading its answer", e), false)),
                Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {
                    let why = format!("no answer within {:?}", self.step_timeout);
                    Err((self.lose(i, "a step", why), false))
                }
                Err(e) => Err((self.lose(i, "the connection", e), false)),
            };
            answers.push((first, answer));
        }
        answers
    }

    /// Marks the followers lost because of link `i`'s failure and returns that error; later
    /// steps fail at once with it.
    fn lose(&mut self, i: usize, what: &str, e: impl std::fmt::Display) -> Error {
        let l = &self.links[i];
        let err = lost(&l.addr, what, e);
        let msg = format!(
            "the follower running ranks {}..{} is lost ({err}); restart every instance",
            l.span.first,
            l.span.first + l.span.count
        );
        self.lost = Some((l.addr.clone(), msg));
        err
    }

    /// How many ranks the followers run between them.
    pub fn rank_count(&self) -> usize {
        self.links.iter().map(|l| l.span.count).sum()
    }
}

impl Drop for Followers {
    /// Tells every follower to stop (best effort: a lost one is gone already).
    fn drop(&mut self) {
        for l in &mut self.links {
            let _ = write_text(&mut l.stream, Tag::Bye, "");
        }
    }
}

impl Pending {
    /// Waits for every follower's setup and checks it against the leader's (`leader`, whose
    /// ranks start at 0) and `tp`: the same model, runner configuration and dtypes, and ranks
    /// that continue the leader's without gap or overlap up to `tp`. When all agree, tells
    /// them to capture (the leader captures its own ranks meanwhile); otherwise tells every
    /// follower why and returns that error, before anything is loaded.
    pub fn agree(mut self, leader: &Setup, tp: usize) -> Result<Capturing> {
        match self.check(leader, tp) {
            Ok(spans) => {
                let mut links = Vec::with_capacity(spans.len());
                for ((addr, mut stream), span) in self.links.into_iter().zip(spans) {
                    write_text(&mut stream, Tag::Capture, "")
                        .map_err(|e| lost(&addr, "telling it to capture", e))?;
                    links.push(Link { addr, span, stream });
                }
                Ok(Capturing {
                    links,
                    timeouts: self.timeouts,
                })
            }
            Err(e) => {
                for (_, stream) in &mut self.links {
                    let _ = write_text(stream, Tag::Failed, &format!("the leader refused: {e}"));
                }
                Err(e)
            }
        }
    }

    /// Every follower's setup, checked; their rank spans in order.
    fn check(&mut self, leader: &Setup, tp: usize) -> Result<Vec<RankSpan>> {
        let deadline = Instant::now() + self.timeouts.capture;
        let mut spans = Vec::with_capacity(self.links.len());
        let mut next = leader.first + leader.count;
        for (addr, stream) in &mut self.links {
            let addr = addr.as_str();
            let left = deadline.saturating_duration_since(Instant::now());
            stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(|e| lost(addr, "configuring the connection", e))?;
            let setup: Setup = match read_frame(stream) {
                Ok(Ok((Tag::Welcome, body))) => serde_json::from_str(&text(body)?)
                    .map_err(|e| lost(addr, "reading its setup", e))?,
                Ok(Ok((Tag::Failed, body))) => {
                    return Err(lost(addr, "the follower could not start", text(body)?))
                }
                Ok(Ok((tag, _))) => return Err(lost(addr, "an unexpected message", tag as u8)),
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(lost(addr, "waiting for its setup", e)),
            };
            if let Some(why) = setup.mismatch(leader) {
                return Err(Error::InvalidInput(format!(
                    "the follower at {addr} cannot run this model with the leader: {why}"
                )));
            }
            if setup.first != next {
                return Err(Error::InvalidInput(format!(
                    "the follower at {addr} runs ranks {}..{}, but the next ranks to cover are \
                     {next}..: list --followers in rank order, their --ranks continuing the \
                     leader's without gap or overlap",
                    setup.first,
                    setup.first + setup.count
                )));
            }
            next += setup.count;
            spans.push(RankSpan {
                first: setup.first,
                count: setup.count,
            });
        }
        if next != tp {
            return Err(Error::InvalidInput(format!(
                "the leader and its followers run ranks 0..{next}, but --tp is {tp}: start \
                 followers for ranks {next}..{tp}"
            )));
        }
        Ok(spans)
    }
}

impl Capturing {
    /// Waits for every follower to say it has captured; then they are ready for steps.
    pub fn join(self) -> Result<Followers> {
        let deadline = Instant::now() + self.timeouts.capture;
        let mut links = Vec::with_capacity(self.links.len());
        for mut l in self.links {
            let addr = l.addr.as_str();
            let left = deadline.saturating_duration_since(Instant::now());
            l.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(|e| lost(addr, "configuring the connection", e))?;
            match read_frame(&mut l.stream) {
                Ok(Ok((Tag::Captured, _))) => {}
                Ok(Ok((Tag::Failed, body))) => {
                    return Err(lost(addr, "the follower could not capture", text(body)?))
                }
                Ok(Ok((tag, _))) => return Err(lost(addr, "an unexpected message", tag as u8)),
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(lost(addr, "waiting for it to capture", e)),
            }
            // A follower that stops reading must not stall the leader's writes either.
            let step = Some(self.timeouts.step);
            l.stream
                .set_read_timeout(step)
                .and_then(|()| l.stream.set_write_timeout(step))
                .map_err(|e| lost(addr, "configuring the connection", e))?;
            links.push(l);
        }
        Ok(Followers {
            links,
            step_timeout: self.timeouts.step,
            lost: None,
        })
    }
}
