//! Connections: the accept loop, the limit on open connections, the timeouts of each (the
//! request body's included), and the phases of a shutdown.
//!
//! `axum::serve` was replaced by this loop (hyper's HTTP/1 connection under the axum
//! [`Router`]) because it has none of these: it waits for every connection forever at shutdown,
//! and a client that sends half a request holds its connection, and a file descriptor, for as
//! long as it likes.
//!
//! # The policy
//!
//! - **Header timeout** (`--header-timeout-secs`): a new connection, or one whose next request
//!   has begun, must complete the request's headers within it, or it is closed (there is no
//!   request to answer yet).
//! - **Idle timeout** (`--idle-timeout-secs`): a kept-alive connection with no request for that
//!   long is closed.
//! - **Body timeout** (`--body-timeout-secs`): a request's whole body must arrive within it,
//!   counted from the end of its headers; otherwise 408 `request_timeout`, and the connection
//!   closes. It bounds only the wait for the body: a response may stream for as long as it
//!   runs.
//! - **Body size**: a `Content-Length` over `--max-body-bytes` is answered 413 at once, without
//!   waiting for the bytes (a chunked body is still cut off by the app's limit as it is read).
//! - **Connection limit** (`--max-connections`): beyond it, a connection is answered 503
//!   `too_many_connections` with `Retry-After: 1`, then closed. An answer rather than a queue
//!   (leaving the connection in the listen backlog until one closes): a queued client cannot
//!   tell a full server from a dead one, the backlog is short (the kernel drops connections
//!   beyond it silently), and the `openai` clients retry a 503 after `Retry-After` by
//!   themselves. At most [`REFUSALS`] such answers are under way at once, each bounded by the
//!   header timeout; a connection beyond those too gets the same 503 written at once, without
//!   its request being read, and is closed. So the server holds at most `--max-connections` +
//!   [`REFUSALS`] sockets.
//!
//! Every timeout is watched per connection by the task that drives it ([`Activity`]), not by
//! hyper's own header timer: hyper starts that timer as soon as a response is written, so an
//! idle kept-alive connection would count as one whose headers are late, and the two timeouts
//! could not differ.
//!
//! # Shutdown
//!
//! [`Phase::Draining`] asks each connection to finish its request in flight and close (hyper's
//! graceful shutdown: an idle one closes at once). [`Phase::Closing`] drops every connection,
//! whatever it is doing: reading headers or a body, writing a stream nobody reads, idling.
//! `serve` moves from one to the other on the drain deadline; [`Connections::all_closed`] says
//! when none is left.

use std::convert::Infallible;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response};
use axum::response::IntoResponse as _;
use axum::Router;
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::{service_fn, Service as _};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::metrics::Outcome;

use super::app::app;
use super::error::{ApiError, RETRY_AFTER_SECS};
use super::state::AppState;

/// How many connections beyond `--max-connections` may be getting their 503 at once. The
/// answer needs the request's headers (so that it is a well-formed HTTP response), which an
/// over-limit client may send slowly: without a cap, a flood of those would hold sockets as
/// the connections it is refused for would have.
pub const REFUSALS: u32 = 64;

/// How long the accept loop pauses after `accept` fails for want of a resource (out of file
/// descriptors: the connections it would take cannot be served anyway).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits of every connection (the flags of the same names on `deepinfer serve`).
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Connections open at once; beyond it, a 503.
    pub max_connections: u32,
    /// How long a request's headers may take, from the request's first byte (or the
    /// connection's opening, for its first request).
    pub header_timeout: Duration,
    /// How long a request's whole body may take, from the end of its headers.
    pub body_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request.
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    /// The CLI's defaults: generous for a client on a slow link, short enough that a thousand
    /// stalled connections do not outlive a minute.
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Where the server is in its life, as every connection task sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Serving as usual.
    Serving,
    /// Shutting down: finish the request in flight, keep nothing alive.
    Draining,
    /// The drain deadline passed: close now, whatever the state.
    Closing,
}

/// The open connections and what they share.
pub(super) struct Connections {
    state: Arc<AppState>,
    router: Router,
    limits: ConnectionLimits,
    /// One permit per served connection.
    slots: Arc<Semaphore>,
    /// One permit per connection being answered 503.
    refusals: Arc<Semaphore>,
    phase: watch::Sender<Phase>,
    /// When the limit was last reported in the log (once a minute at most, not per refusal).
    last_full_warning: Mutex<Option<Instant>>,
    /// The whole 503 response [`Connections::refuse_at_once`] writes.
    canned_refusal: Vec<u8>,
}

impl Connections {
    /// The connections of the app over `state`, under `limits`.
    pub(super) fn new(state: Arc<AppState>, limits: ConnectionLimits) -> Arc<Self> {
        let limits = ConnectionLimits {
            max_connections: limits.max_connections.max(1),
            ..limits
        };
        Arc::new(Connections {
            router: app(state.clone()),
            state,
            slots: Arc::new(Semaphore::new(limits.max_connections as usize)),
            refusals: Arc::new(Semaphore::new(REFUSALS as usize)),
            canned_refusal: canned_refusal(limits.max_connections),
            limits,
            phase: watch::Sender::new(Phase::Serving),
            last_full_warning: Mutex::new(None),
        })
    }

    /// Accepts connections on `listener` and serves each on a task of its own, until the
    /// future is dropped (which closes the listener).
    pub(super) async fn accept(self: &Arc<Self>, listener: TcpListener) {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) if is_per_connection(&e) => continue,
                Err(e) => {
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            // Every streamed token is a small write: without TCP_NODELAY, Nagle's algorithm
            // holds each one until the client's delayed ACK (about 40 ms on Linux) on a
            // kept-alive connection, so a stream arrived in one burst at the end.
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY: {e}");
            }
            if let Ok(permit) = self.slots.clone().try_acquire_owned() {
                tokio::spawn(self.clone().serve(stream, permit));
            } else {
                self.warn_full();
                if let Ok(permit) = self.refusals.clone().try_acquire_owned() {
                    tokio::spawn(self.clone().refuse(stream, permit));
                } else {
                    self.refuse_at_once(&stream);
                }
            }
        }
    }

    /// Moves every connection to `phase`.
    pub(super) fn set_phase(&self, phase: Phase) {
        self.phase.send_replace(phase);
    }

    /// Resolves once no connection is open (served or being refused).
    pub(super) async fn all_closed(&self) {
        // Every connection holds a permit of one of the two until its task ends.
        let _served = self.slots.acquire_many(self.limits.max_connections).await;
        let _refused = self.refusals.acquire_many(REFUSALS).await;
    }

    /// How many connections are open.
    pub(super) fn open(&self) -> usize {
        (self.limits.max_connections as usize + REFUSALS as usize)
            - self.slots.available_permits()
            - self.refusals.available_permits()
    }

    fn warn_full(&self) {
        let mut last = self
            .last_full_warning
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if last.is_none_or(|t| now - t >= Duration::from_secs(60)) {
            *last = Some(now);
            tracing::warn!(
                "{} connections are open, the limit (--max-connections): refusing new ones with 503",
                self.limits.max_connections
            );
        }
    }

    /// Serves one connection until it ends, times out, or the shutdown closes it.
    async fn serve(self: Arc<Self>, stream: TcpStream, permit: OwnedSemaphorePermit) {
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(Watched {
            stream,
            activity: activity.clone(),
        });
        let service = {
            let conns = self.clone();
            let activity = activity.clone();
            service_fn(move |req: Request<Incoming>| {
                let conns = conns.clone();
                // Called once the request's headers are in: it is open until the last byte of
                // its response is handed to the socket (or it is dropped).
                let open = activity.begin();
                async move {
                    let response = conns.respond(req).await;
                    Ok::<_, Infallible>(response.map(|inner| Tracked { inner, _open: open }))
                }
            })
        };
        let mut builder = http1::Builder::new();
        // Timed by `activity` instead (see the module docs).
        builder.keep_alive(true).header_read_timeout(None);
        let conn = builder.serve_connection(io, service);
        let mut conn = std::pin::pin!(conn);
        let mut phase = self.phase.subscribe();
        // A shutdown that began before this task ran must be seen too.
        phase.mark_changed();
        let mut draining = false;
        loop {
            let deadline = activity.deadline(&self.limits);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!("connection ended: {e}");
                    }
                    break;
                }
                () = sleep_until(deadline) => {
                    if activity.deadline(&self.limits).is_some_and(|d| d <= Instant::now()) {
                        tracing::debug!("closing a connection that timed out");
                        break;
                    }
                }
                () = activity.changed.notified() => {}
                r = phase.changed() => match r.map(|()| *phase.borrow_and_update()) {
                    Ok(Phase::Serving) => {}
                    Ok(Phase::Draining) => {
                        if !draining {
                            draining = true;
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                    Ok(Phase::Closing) | Err(_) => break,
                },
            }
        }
        drop(permit);
    }

    /// Answers one connection beyond the limit with a 503, then closes it.
    async fn refuse(self: Arc<Self>, stream: TcpStream, permit: OwnedSemaphorePermit) {
        let state = self.state.clone();
        let limit = self.limits.max_connections;
        let service = service_fn(move |_req: Request<Incoming>| {
            let mut r = closing(state.reject(ApiError::too_many_connections(limit)));
            r.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
            async move { Ok::<_, Infallible>(r) }
        });
        let mut builder = http1::Builder::new();
        builder.keep_alive(false).header_read_timeout(None);
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let mut phase = self.phase.subscribe();
        tokio::select! {
            _ = tokio::time::timeout(self.limits.header_timeout, conn) => {}
            _ = phase.wait_for(|p| *p == Phase::Closing) => {}
        }
        drop(permit);
    }

    /// Answers a connection beyond even the refusals under way: the same 503, written at once
    /// without reading the request (a fresh socket's buffer takes it whole), and the socket
    /// closed. Best effort: a client still sending may see the connection reset instead.
    fn refuse_at_once(&self, stream: &TcpStream) {
        self.state
            .engine
            .metrics()
            .record_outcome(Outcome::Rejected);
        let _ = stream.try_write(&self.canned_refusal);
    }

    /// The app's response to `req`, its body under the body timeout; a declared length over
    /// the limit is refused before a byte of the body is read.
    ///
    /// The body is not read here but by the handler, as before: after the API-key check, so a
    /// client without the key cannot make the server hold `--max-body-bytes` per connection.
    async fn respond(&self, req: Request<Incoming>) -> Response<Body> {
        let limit = self.state.config.max_body_bytes;
        if req.body().size_hint().lower() > limit as u64 {
            return closing(self.state.reject(ApiError::too_large(limit)));
        }
        let timed_out = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + self.limits.body_timeout;
        let req = req.map(|inner| {
            Body::new(DeadlineBody {
                inner,
                deadline,
                sleep: None,
                timed_out: timed_out.clone(),
            })
        });
        let response = match TowerToHyperService::new(self.router.clone())
            .call(req)
            .await
        {
            Ok(r) => r,
            Err(never) => match never {},
        };
        if timed_out.load(Ordering::Relaxed) {
            // The handler saw its body fail and answered (and counted) a 400; the cause was
            // the client's silence, which is a 408.
            return closing(
                ApiError::body_timeout(self.limits.body_timeout.as_secs()).into_response(),
            );
        }
        response
    }
}

/// The bytes of the 503 `too_many_connections` response, as hyper would have written it.
fn canned_refusal(limit: u32) -> Vec<u8> {
    let body = ApiError::too_many_connections(limit).body().to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: {RETRY_AFTER_SECS}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Whether an `accept` error concerns only the connection being accepted (the next accept
/// may succeed at once), rather than the process (out of file descriptors or memory).
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// `response`, asking hyper to close the connection after it: sent when the request's body
/// was not read to its end, so the connection cannot carry another request.
fn closing(mut response: Response<Body>) -> Response<Body> {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    /// The body timeout passed before the body's end.
    #[error("the request body did not arrive in time")]
    TimedOut,
    /// The connection failed while it was read.
    #[error(transparent)]
    Read(#[from] hyper::Error),
}

/// A request body that fails once its deadline passes while the next bytes are awaited, and
/// says so through `timed_out`. Time spent elsewhere (the handler working, the response
/// streaming) does not count: the deadline matters only while the body is being read.
struct DeadlineBody {
    inner: Incoming,
    deadline: Instant,
    /// Armed at the first wait (most bodies arrive with their headers and need no timer).
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(BodyError::Read)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            this.timed_out.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(BodyError::TimedOut)));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// What one connection is doing, as its timeouts need it: whether a request is open, and
/// since when it has been idle or reading a request's headers.
struct Activity {
    times: Mutex<Times>,
    /// Wakes the connection's task when its deadline may have moved.
    changed: Notify,
}

#[derive(Debug)]
struct Times {
    /// Requests whose headers are in and whose response is not yet written.
    open: usize,
    /// When the connection opened or its last response was written.
    since: Instant,
    /// When the first byte of the next request's headers arrived, if one has.
    head_started: Option<Instant>,
    /// Whether a response was written (after that, waiting is idling, timed by the idle
    /// timeout; before, it is a late first request, timed by the header timeout).
    served: bool,
}

impl Activity {
    fn new() -> Self {
        Activity {
            times: Mutex::new(Times {
                open: 0,
                since: Instant::now(),
                head_started: None,
                served: false,
            }),
            changed: Notify::new(),
        }
    }

    fn times(&self) -> std::sync::MutexGuard<'_, Times> {
        self.times.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes arrived: between requests, they start the next request's headers.
    fn on_bytes(&self) {
        let mut t = self.times();
        if t.open == 0 && t.head_started.is_none() {
            t.head_started = Some(Instant::now());
            drop(t);
            self.changed.notify_one();
        }
    }

    /// A request's headers are in: it is open until the returned guard drops.
    fn begin(self: &Arc<Self>) -> OpenRequest {
        let mut t = self.times();
        t.open += 1;
        t.head_started = None;
        drop(t);
        self.changed.notify_one();
        OpenRequest(self.clone())
    }

    /// When the connection times out if nothing changes; none while a request is open.
    fn deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        let t = self.times();
        if t.open > 0 {
            None
        } else if let Some(start) = t.head_started {
            Some(start + limits.header_timeout)
        } else if t.served {
            Some(t.since + limits.idle_timeout)
        } else {
            Some(t.since + limits.header_timeout)
        }
    }
}

/// A request in flight on its connection; dropped with its response's body, once written.
struct OpenRequest(Arc<Activity>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        let mut t = self.0.times();
        t.open = t.open.saturating_sub(1);
        t.since = Instant::now();
        t.served = true;
        t.head_started = None;
        drop(t);
        self.0.changed.notify_one();
    }
}

/// A response body that keeps its request open (for the connection's timeouts) until hyper
/// has written it and drops it.
struct Tracked {
    inner: Body,
    _open: OpenRequest,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's socket, telling its [`Activity`] when bytes arrive.
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_bytes();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            max_connections: 4,
            header_timeout: Duration::from_secs(2),
            body_timeout: Duration::from_secs(3),
            idle_timeout: Duration::from_secs(5),
        }
    }

    /// How long after the moment it counts from the connection times out, if it does.
    fn timeout_of(a: &Activity) -> Option<Duration> {
        let from = {
            let t = a.times();
            t.head_started.unwrap_or(t.since)
        };
        a.deadline(&limits()).map(|d| d - from)
    }

    #[test]
    fn a_connection_times_out_by_what_it_waits_for() {
        let a = Arc::new(Activity::new());
        // A new connection waits for its first headers: the header timeout.
        assert_eq!(timeout_of(&a), Some(limits().header_timeout));
        // A request in flight has no deadline here (its body has its own timeout).
        let open = a.begin();
        assert_eq!(a.deadline(&limits()), None);
        // Written: the connection idles.
        drop(open);
        assert_eq!(timeout_of(&a), Some(limits().idle_timeout));
        // The next request's first bytes: its headers are timed from them, not from later ones.
        a.on_bytes();
        let first = a.times().head_started;
        assert!(first.is_some());
        a.on_bytes();
        assert_eq!(a.times().head_started, first);
        assert_eq!(timeout_of(&a), Some(limits().header_timeout));
    }

    #[test]
    fn bytes_of_an_open_request_are_not_a_new_request() {
        let a = Arc::new(Activity::new());
        let open = a.begin();
        a.on_bytes(); // its body
        drop(open);
        assert_eq!(a.times().head_started, None);
        assert_eq!(timeout_of(&a), Some(limits().idle_timeout));
    }

    #[test]
    fn the_canned_refusal_is_a_whole_503_with_its_json_body() {
        let bytes = canned_refusal(7);
        let text = std::str::from_utf8(&bytes).expect("ascii");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(head.contains("\r\nretry-after: 1\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        assert!(
            head.ends_with(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains('7')));
    }
}
