//! Binding and serving: the app on a listener until SIGTERM or Ctrl-C, then the drain.
//!
//! Kept apart from [`app`] so that tests drive the app without a socket or a signal.

use std::net::SocketAddr;
use std::sync::Arc;

use super::app::app;
use super::state::AppState;

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

/// Serves `state` on `listener` until SIGTERM or Ctrl-C, then drains and stops the engine.
/// `on_ready` is called with the bound address once the server accepts connections.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    on_ready: impl FnOnce(SocketAddr),
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let engine = state.engine.clone();
    let drain_timeout = state.config.drain_timeout;
    let (drained_tx, drained_rx) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app(state)).with_graceful_shutdown({
        let engine = engine.clone();
        async move {
            shutdown_signal().await;
            tracing::info!(
                "shutting down; finishing the requests in flight (at most {}s)",
                drain_timeout.as_secs()
            );
            engine.begin_drain();
            let _ = drained_tx.send(true);
        }
    });
    on_ready(addr);
    // After the signal, give requests in flight `drain_timeout`, then end them so their
    // streams close and the server can stop.
    let deadline = {
        let engine = engine.clone();
        let mut rx = drained_rx;
        async move {
            while !*rx.borrow() {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            tokio::time::sleep(drain_timeout).await;
            engine.abort_all("the server is shutting down");
            std::future::pending::<()>().await
        }
    };
    let result = tokio::select! {
        r = server => r,
        () = deadline => Ok(()),
    };
    engine.shutdown();
    result
}
