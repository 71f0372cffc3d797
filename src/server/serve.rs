//! Binding and serving: the app on a listener until SIGTERM or Ctrl-C, then the drain, which
//! ends by its deadline whatever the clients do.
//!
//! Kept apart from [`app`](super::app) so that tests drive the app without a socket or a
//! signal; the connections themselves (limits, timeouts) are [`conn`](super::conn)'s.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::conn::{ConnectionLimits, Connections, Phase};
use super::error::SHUTDOWN_MESSAGE;
use super::state::AppState;

/// How long after the drain deadline the requests it ended have to send their error (a status
/// or a stream's error event) before their connections are closed regardless.
pub const ABORT_GRACE: Duration = Duration::from_secs(1);

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

/// Serves `state` on `listener` under `limits` until SIGTERM or Ctrl-C, then drains and stops
/// the engine. `on_ready` is called with the bound address once the server accepts
/// connections.
///
/// The shutdown: the listener closes and new requests on open connections get 503; requests in
/// flight have the drain timeout to finish; then the engine ends the rest (each gets 503
/// `shutting_down`, as a status or a stream's error event) and, [`ABORT_GRACE`] later, every
/// connection still open is closed, whatever it is doing. So the process ends at most the drain
/// timeout plus [`ABORT_GRACE`] after the signal, and sooner when nothing is in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    limits: ConnectionLimits,
    on_ready: impl FnOnce(SocketAddr),
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let engine = state.engine.clone();
    let drain_timeout = state.config.drain_timeout;
    let conns = Connections::new(state, limits);
    on_ready(addr);
    tokio::select! {
        () = conns.accept(listener) => {}
        () = shutdown_signal() => {}
    }
    // The accept loop, and with it the listener, is gone: new connections are refused.
    tracing::info!(
        "shutting down; finishing the requests in flight (at most {}s)",
        drain_timeout.as_secs()
    );
    engine.begin_drain();
    conns.set_phase(Phase::Draining);
    if tokio::time::timeout(drain_timeout, conns.all_closed())
        .await
        .is_err()
    {
        tracing::warn!(
            "the drain timeout passed with {} connections open; ending their requests",
            conns.open()
        );
        engine.abort_all(SHUTDOWN_MESSAGE);
        if tokio::time::timeout(ABORT_GRACE, conns.all_closed())
            .await
            .is_err()
        {
            conns.set_phase(Phase::Closing);
            // Each task drops its connection as soon as it runs: this wait is for the
            // scheduler, not for any client.
            let _ = tokio::time::timeout(ABORT_GRACE, conns.all_closed()).await;
        }
    }
    engine.shutdown();
    Ok(())
}
