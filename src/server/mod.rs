//! The OpenAI-compatible HTTP server (`deepinfer serve`).
//!
//! axum on tokio for the connections; the [`Engine`] thread for the model. Routes:
//! `POST /v1/completions`, `POST /v1/chat/completions` (whole or streamed over SSE),
//! `GET /v1/models` (and `/v1/models/{id}`), vLLM's `POST /tokenize` and `POST /detokenize`,
//! `GET /health`, `GET /metrics`. With an API key, all but `/health` and `/metrics` need
//! `Authorization: Bearer KEY`. Every error is OpenAI's JSON shape ([`error::ApiError`]).
//!
//! Shutdown (SIGTERM or Ctrl-C) drains: the listener closes, new requests get 503, requests in
//! flight (streams included) run to completion; after the drain timeout whatever is left is
//! ended with an error event, so every stream ends cleanly.

pub mod error;
mod generate;
mod logprobs;
pub mod protocol;
mod response;
mod tokenize;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::engine::Engine;
use crate::tokenizer::Tokenizer;

use error::ApiError;

/// How the server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name clients pass as `model` (and `/v1/models` lists).
    pub served_model_name: String,
    /// When set, `/v1/*` requests must carry `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Request bodies larger than this get a 413.
    pub max_body_bytes: usize,
    /// How long shutdown waits for requests in flight before ending them.
    pub drain_timeout: Duration,
}

/// What every handler sees.
#[derive(Debug)]
pub struct AppState {
    /// The server's settings.
    pub config: ServerConfig,
    /// The engine thread.
    pub engine: Arc<Engine>,
    /// The model's tokenizer (absent: only token-id prompts are served).
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Makes response ids unique across restarts.
    id_prefix: String,
    created: u64,
}

impl AppState {
    /// The state for `engine` serving under `config`.
    pub fn new(
        config: ServerConfig,
        engine: Arc<Engine>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        AppState {
            config,
            engine,
            tokenizer,
            id_prefix: format!("{created:x}-"),
            created,
        }
    }
}

/// The application: every route, the API-key check on `/v1`, the body limit.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/completions", post(generate::completions))
        .route("/chat/completions", post(generate::chat_completions))
        .route("/models", get(models))
        .route("/models/{id}", get(model))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let tokenizer = Router::new()
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .nest("/v1", v1)
        .merge(tokenizer)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(no_route)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = &state.config.api_key else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if constant_time_eq(g.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => {
            state
                .engine
                .metrics()
                .record_outcome(crate::metrics::Outcome::Rejected);
            ApiError::unauthorized("Incorrect API key provided.").into_response()
        }
        None => {
            state
                .engine
                .metrics()
                .record_outcome(crate::metrics::Outcome::Rejected);
            ApiError::unauthorized(
                "No API key provided: send it as the header `Authorization: Bearer KEY`.",
            )
            .into_response()
        }
    }
}

/// Compares two keys in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The served model as OpenAI describes a model.
fn model_object(state: &AppState) -> serde_json::Value {
    json!({
        "id": state.config.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "deepinfer",
        "max_model_len": state.engine.info().max_len,
    })
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

async fn model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == state.config.served_model_name {
        Json(model_object(&state)).into_response()
    } else {
        ApiError::model_not_found(&id, &state.config.served_model_name).into_response()
    }
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let unavailable = |body| (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    if let Some(reason) = state.engine.unhealthy() {
        unavailable(json!({"status": "unhealthy", "reason": reason}))
    } else if state.engine.is_draining() {
        unavailable(json!({"status": "draining"}))
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.engine.metrics().encode(),
    )
        .into_response()
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::no_route(uri.path())
}

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
    let app = router(state);
    let server = axum::serve(listener, app).with_graceful_shutdown({
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
