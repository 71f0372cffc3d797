//! The read-only routes: the served model (`GET /v1/models`, `GET /v1/models/{id}`), liveness
//! (`GET /health`) and the Prometheus metrics (`GET /metrics`).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::error::ApiError;
use super::state::AppState;

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

/// `GET /v1/models`: the one model served.
pub(super) async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

/// `GET /v1/models/{id}`: the served model, or 404 for any other id.
pub(super) async fn model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if id == state.config.served_model_name {
        Ok(Json(model_object(&state)))
    } else {
        Err(ApiError::model_not_found(
            &id,
            &state.config.served_model_name,
        ))
    }
}

/// `GET /health`: 200 `ok`, or 503 `unhealthy` (with the reason) or `draining`.
pub(super) async fn health(State(state): State<Arc<AppState>>) -> Response {
    let unavailable = |body| (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    if let Some(reason) = state.engine.unhealthy() {
        unavailable(json!({"status": "unhealthy", "reason": reason}))
    } else if state.engine.is_draining() {
        unavailable(json!({"status": "draining"}))
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

/// `GET /metrics`: Prometheus' text format.
pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.engine.metrics().encode(),
    )
        .into_response()
}
