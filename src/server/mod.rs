//! The OpenAI-compatible HTTP server (`deepinfer serve`).
//!
//! hyper on tokio for the connections, an axum router for the routes; the [`Engine`](crate::engine::Engine) thread for the
//! model. Routes: `POST /v1/completions`, `POST /v1/chat/completions` (whole or streamed over
//! SSE), `GET /v1/models` (and `/v1/models/{id}`), vLLM's `POST /tokenize` and
//! `POST /detokenize`, `GET /health`, `GET /metrics`. With an API key, all but `/health` and
//! `/metrics` need `Authorization: Bearer KEY`. Every error is OpenAI's JSON shape
//! ([`error::ApiError`]).
//!
//! Connections have header, body and idle timeouts and a limit on how many are open (`conn`).
//! Shutdown (SIGTERM or Ctrl-C) drains: the listener closes, new requests get 503, requests in
//! flight (streams included) run to completion; after the drain timeout whatever is left is
//! ended with a 503 `shutting_down` (a status, or a stream's error event), and a second later
//! every connection still open is closed, whatever its client does, so the process always
//! exits.
//!
//! # Modules
//!
//! Arrows point one way, top to bottom; this file only declares and re-exports.
//!
//! | module | concern |
//! |---|---|
//! | `serve` | binding a listener, signals, the drain and its deadline |
//! | `conn` | the accept loop: connection limit, header/body/idle timeouts, reading bodies |
//! | `app` | the [`Router`](axum::Router): routes, API key, body limit, 404 and 405 |
//! | `generate`, `tokenize`, `info` | the handlers |
//! | `response` | a submitted request's answer: one JSON body, or SSE chunks |
//! | `logprobs` | log-probabilities in OpenAI's two shapes |
//! | [`tools`] | tool definitions and choices, tool-call formats, reading calls out of text (a format's, or constrained JSON) |
//! | `request` | reading a body: JSON, typed fields, the model check, prompts as tokens |
//! | [`protocol`] | the request types and their field checks |
//! | `state` | what handlers share; a refused request is answered and counted there |
//! | [`error`] | [`ApiError`](error::ApiError) and every conversion into it |

mod app;
mod chat;
mod conn;
pub mod error;
mod generate;
mod info;
mod logprobs;
pub mod protocol;
mod reasoning;
mod request;
mod response;
mod serve;
mod state;
mod tokenize;
pub mod tools;

pub use app::app;
pub use conn::{ConnectionLimits, REFUSALS};
pub use serve::{serve, ABORT_GRACE};
pub use state::{AppState, ServerConfig};
