//! The application: which route goes where, the API-key check, the body limit, and the
//! OpenAI-shaped answers for a route that does not exist (404) or a method it does not take
//! (405).
//!
//! [`app`] builds the [`Router`] and nothing else, so tests drive it in process
//! (`tower::ServiceExt::oneshot`) and `serve` binds it to a socket.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use super::error::ApiError;
use super::state::AppState;
use super::{generate, info, tokenize};

/// The application: every route, the API-key check on all but `/health` and `/metrics`, the
/// body limit, and OpenAI-shaped 404 and 405 errors.
pub fn app(state: Arc<AppState>) -> Router {
    // The key is checked per route (`route_layer`), so an unknown path is a 404 with or without
    // it. The 405 fallback is set before the check: a wrong method needs the key as well.
    let keyed = Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/models", get(info::models))
        .route("/v1/models/{id}", get(info::model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .method_not_allowed_fallback(wrong_method)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let open = Router::new()
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .method_not_allowed_fallback(wrong_method);
    keyed
        .merge(open)
        .fallback(no_route)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

/// Lets the request through if the server has no key or the request carries it; otherwise a
/// 401, counted as rejected.
async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = &state.config.api_key else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme is case-insensitive (RFC 9110, section 11.1).
        .and_then(|v| {
            let (scheme, key) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(key)
        });
    match given {
        Some(g) if constant_time_eq(g.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => state.reject(ApiError::unauthorized("Incorrect API key provided.")),
        None => state.reject(ApiError::unauthorized(
            "No API key provided: send it as the header `Authorization: Bearer KEY`.",
        )),
    }
}

/// Compares two keys in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 404 for a path no route serves.
async fn no_route(uri: Uri) -> ApiError {
    ApiError::no_route(uri.path())
}

/// 405 for a route asked with a method it does not take (axum adds the `Allow` header).
async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(&method, uri.path())
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn keys_compare_equal_only_when_equal() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
