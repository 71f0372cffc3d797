//! What every handler sees: the server's settings, the engine, the tokenizer; and the one way a
//! refused request is answered (so that every refusal is counted).

use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};

use crate::engine::grammar::{GrammarCompiler, JsonOptions};
use crate::engine::Engine;
use crate::metrics::Outcome;
use crate::tokenizer::Tokenizer;

use super::error::ApiError;
use super::tools::format::{CallFormat, ToolCallFormat};
use crate::tokenizer::ChatEncoding;

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
    /// The tool-call format (`--tool-call-parser`); `None`: the one the chat template
    /// renders, if any (DSML for V4's encoder).
    pub tool_call_format: Option<CallFormat>,
    /// How JSON schemas (`response_format`, tool arguments) are read where they leave the
    /// output open: `--schema-allow-additional-properties` and `--json-whitespace`.
    pub json: JsonOptions,
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
    pub(super) id_prefix: String,
    /// When the server started, as `/v1/models` reports the model's `created`.
    pub(super) created: u64,
    /// The structured-output compiler, built from the tokenizer on first use (its token trie
    /// takes a moment for a large vocabulary), or why it cannot be.
    grammar: std::sync::OnceLock<Result<Arc<GrammarCompiler>, String>>,
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
            grammar: std::sync::OnceLock::new(),
        }
    }

    /// The structured-output compiler (a 400 naming `param`, the field that asked for a
    /// constraint, when the model has no tokenizer to build it from).
    pub(super) fn grammar(&self, param: &str) -> Result<Arc<GrammarCompiler>, ApiError> {
        let built = self.grammar.get_or_init(|| match &self.tokenizer {
            None => Err("this model has no tokenizer.json to constrain outputs with".into()),
            Some(t) => GrammarCompiler::new(t)
                .map(Arc::new)
                .map_err(|e| e.to_string()),
        });
        built.clone().map_err(|e| ApiError::invalid_field(param, e))
    }

    /// How this model writes tool calls: `--tool-call-parser`'s format, or the one its chat
    /// encoding renders; `None` when it has no known format.
    pub(super) fn tool_format(&self) -> Option<CallFormat> {
        self.config.tool_call_format.or_else(|| {
            let tokenizer = self.tokenizer.as_ref()?;
            if self.v4_encoding() {
                return Some(CallFormat::Dsml);
            }
            ToolCallFormat::detect(tokenizer.chat_template()?).map(CallFormat::Markers)
        })
    }

    /// Whether chat prompts are written by V4's encoder ([`crate::chat_v4`]).
    pub(super) fn v4_encoding(&self) -> bool {
        self.tokenizer
            .as_ref()
            .is_some_and(|t| t.chat_encoding() == ChatEncoding::DeepseekV4)
    }

    /// Answers a request the server refuses before the engine runs it (a bad request, a wrong
    /// key, a full queue, a draining server), counting it as rejected. Failures after the
    /// engine took the request are counted by the engine instead, so none counts twice.
    pub(super) fn reject(&self, e: impl Into<ApiError>) -> Response {
        self.engine.metrics().record_outcome(Outcome::Rejected);
        e.into().into_response()
    }
}
