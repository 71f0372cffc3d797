//! `deepinfer serve`: the OpenAI-compatible HTTP server over the continuous-batching engine.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use deepinfer::deployment::Limits;
use deepinfer::engine::grammar::{JsonOptions, JsonWhitespace};
use deepinfer::engine::{Engine, EngineOptions};
use deepinfer::metrics::Metrics;
use deepinfer::plan::KvBlocks;
use deepinfer::runner;
use deepinfer::server::tools::format::CallFormat;
use deepinfer::server::{AppState, ConnectionLimits, ServerConfig};
use deepinfer::source::ModelSource;

use crate::ModelArgs;

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind; the default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind; 0 picks a free one (the ready line on stderr says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health and /metrics.
    #[arg(long, env = "DEEPINFER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model name clients pass (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// A Jinja chat template file to use instead of the model's own (vLLM's flag): for a
    /// model whose template lacks something, such as the tool-call format.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// The format the model writes tool calls in: deepseek_v3 (also R1's), deepseek_v31 or
    /// deepseek_v4 (DSML) (default: the one the chat template renders, DSML for a V4 model;
    /// without one, `tool_choice: "auto"` is refused).
    #[arg(long, value_parser = tool_call_parser)]
    tool_call_parser: Option<CallFormat>,
    /// Let an object schema (in `response_format` or a tool's parameters) that lists
    /// `properties` but says nothing of `additionalProperties` admit other keys too, as JSON
    /// Schema reads it. By default it admits only its listed keys, as OpenAI's strict mode,
    /// xgrammar and outlines read it: a model left free to add keys may add them until
    /// max_tokens. See docs/structured-outputs-defaults.md.
    #[arg(long)]
    schema_allow_additional_properties: bool,
    /// Whitespace between the tokens of constrained JSON (`response_format`, tool
    /// arguments): `compact`, none at all (`{"a":1,"b":[2]}`, as OpenAI writes it), or
    /// `flexible`, at most a line break and 12 spaces at each place JSON allows whitespace
    /// (a bound, so a model cannot fill its answer with blank lines).
    #[arg(long, value_enum, default_value_t = Whitespace::Compact)]
    json_whitespace: Whitespace,
    /// Sequences decoded together at most (the largest batch bucket).
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Tokens to draft a step per sequence with the model's multi-token-prediction layer and
    /// verify in one forward pass (speculative decoding; 0 off). Steps whose rows are all
    /// greedy without penalties, bias, structured output or logprobs verify; others decode
    /// one token a row. The CPU backend only, for now.
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// Longest sequence, prompt plus completion (default: the model's, at most 2048).
    #[arg(long)]
    max_len: Option<usize>,
    /// KV-cache blocks of 16 tokens (default: enough for --max-batch sequences of --max-len),
    /// or `auto`: on a device, as many as fit each NeuronCore's HBM after the weights (see
    /// `deepinfer plan`).
    #[arg(long)]
    kv_blocks: Option<KvBlocks>,
    /// With `--kv-blocks auto`, and when checking that the model fits before capture: the
    /// share of each NeuronCore's HBM the memory plan may fill.
    #[arg(long, default_value_t = deepinfer::deployment::DEFAULT_HBM_UTILIZATION)]
    hbm_utilization: f64,
    /// Most prompt tokens per prefill step. Prefill graphs are built for 16, 64, ... up to this
    /// size, and a chunk runs on the smallest that holds it; larger chunks take long prompts in
    /// fewer steps but stall the decoding streams longer.
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// Most sequences one prefill step packs together, so a burst of short prompts enters in
    /// a few steps instead of one step each (at most --max-batch; 1 turns packing off). Each
    /// packing adds a prefill graph per chunk size at the context buckets it fits.
    #[arg(long, default_value_t = deepinfer::deployment::DEFAULT_PREFILL_SEQS)]
    max_prefill_seqs: usize,
    /// Most tokens one engine step feeds, decode rows and prefill tokens together (vLLM's
    /// --max-num-batched-tokens): lower it to keep decode steps short while prompts arrive.
    /// Must exceed --max-batch. Default: only --prefill-chunk bounds the prefill.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Recompute every prompt from scratch instead of reusing the KV-cache blocks of earlier
    /// requests with the same prefix (automatic prefix caching is on by default, as in vLLM).
    #[arg(long)]
    no_prefix_caching: bool,
    /// While several requests are active, give each at most an equal share of a decode step's
    /// rows (the rest of a request's choices sit the step out, keeping their cache). On the
    /// CPU a step's cost grows with its rows, so one request with many choices would slow
    /// every other request's tokens; on a NeuronCore a step reads the weights once whatever
    /// its rows. `auto`: on for the CPU backend, off on a device.
    #[arg(long, value_enum, default_value_t = FairDecode::Auto)]
    fair_decode: FairDecode,
    /// With fair decoding, while several requests are active a decode step may cost at most
    /// this many times a step of one row per request (as the CPU runner measured its steps);
    /// the request with the most rows gives rows up first. Bounds how much a request with many
    /// choices slows the others' tokens; larger favours its throughput. At least 1.
    #[arg(long, default_value_t = deepinfer::engine::DEFAULT_FAIR_DECODE_SLOWDOWN,
          value_parser = parse_slowdown)]
    fair_decode_slowdown: f64,
    /// Requests that may wait for a batch slot before new ones get 429 (with Retry-After);
    /// free batch slots come on top, so an idle server accepts --max-batch + --max-waiting at
    /// once, and 0 accepts a request only when a slot is free.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds between stats lines on stderr while serving (throughput, running, waiting, KV
    /// cache use); 0 turns them off.
    #[arg(long, default_value_t = 10)]
    log_stats_secs: u64,
    /// Seconds shutdown waits for requests in flight before ending them (with 503
    /// `shutting_down`); a second later every connection still open is closed, whatever its
    /// client does. 0 ends them at once.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
    /// Connections open at once; beyond it, a new connection is answered 503
    /// `too_many_connections` with `Retry-After` and closed. Keep it below the process's
    /// file-descriptor limit (`ulimit -n`) less a hundred or so.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Seconds a client has to send a request's headers (from the request's first byte, or
    /// from the connection's opening for its first request) before its connection is closed.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    header_timeout_secs: u64,
    /// Seconds a client has to send a request's whole body once its headers are in, before a
    /// 408 `request_timeout` (the time a response takes does not count).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    body_timeout_secs: u64,
    /// Seconds a kept-alive connection may wait for its next request before it is closed.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_secs: u64,
    /// Seconds a streamed request may stay paused because its client reads nothing before it
    /// is cancelled and its KV-cache blocks freed. A request whose client falls behind by 64
    /// events stops generating (keeping its blocks) until the client catches up; this bounds
    /// how long.
    #[arg(long, default_value_t = deepinfer::engine::DEFAULT_STALL_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    stall_timeout_secs: u64,
    /// On a device, compile and load every bucket before serving. By default the server
    /// answers once the smallest decode batch and the largest prefill chunk (at the longest
    /// context) are loaded, and the other buckets join as they are compiled in the background
    /// (`/metrics`' `deepinfer_live_buckets` and the log say which are live; requests wait for
    /// a batch slot meanwhile). Always on with --followers or --ranks.
    #[arg(long)]
    compile_all_first: bool,
}

/// `--fair-decode-slowdown`: a finite number of at least 1.
fn parse_slowdown(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 1.0 => Ok(f),
        _ => Err(format!("expected a number of at least 1, got {s:?}")),
    }
}

/// `--fair-decode`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum FairDecode {
    /// On for the CPU backend, off on a device (nrt-sim included).
    Auto,
    /// On whatever the backend.
    On,
    /// Off: every running choice decodes in every step.
    Off,
}

/// `--json-whitespace`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Whitespace {
    /// No whitespace between JSON tokens.
    Compact,
    /// A bounded run of whitespace wherever JSON allows one.
    Flexible,
}

/// `--tool-call-parser`'s value: a format by name.
fn tool_call_parser(name: &str) -> std::result::Result<CallFormat, String> {
    CallFormat::by_name(name).ok_or_else(|| {
        format!(
            "unknown tool-call format {name:?}; known: {}",
            CallFormat::names().join(", ")
        )
    })
}

/// Runs the command.
pub(crate) fn run(args: ServeArgs) -> Result<()> {
    let dir = args.model.dir()?;
    let cfg = ModelSource::new(&dir)?.config()?;
    let mut tokenizer = crate::tokenizer_of(&dir)?;
    if let Some(path) = &args.chat_template {
        let Some(tokenizer) = tokenizer.as_mut() else {
            anyhow::bail!(
                "--chat-template needs the model's tokenizer.json, which {} lacks",
                dir.display()
            );
        };
        let template = std::fs::read_to_string(path)
            .with_context(|| format!("reading --chat-template {}", path.display()))?;
        tokenizer
            .set_chat_template(template)
            .with_context(|| format!("--chat-template {}", path.display()))?;
    }
    let tokenizer = tokenizer.map(Arc::new);
    let limits = args.model.limits(&Limits {
        kv_blocks: match args.kv_blocks {
            Some(KvBlocks::Exactly(n)) => Some(n),
            _ => None,
        },
        kv_blocks_auto: args.kv_blocks == Some(KvBlocks::Auto),
        hbm_utilization: args.hbm_utilization,
        prefill_chunk: Some(args.prefill_chunk),
        prefill_seqs: Some(args.max_prefill_seqs),
        background_compile: !args.compile_all_first,
        speculative_tokens: args.speculative_tokens,
        ..Limits::new(args.max_batch, args.max_len.unwrap_or(2048))
    })?;
    // Checked here, so a bad flag fails before the model loads.
    limits.runner_config(&cfg)?;
    if let Some(n) = args.max_num_batched_tokens {
        if n <= args.max_batch {
            anyhow::bail!(
                "--max-num-batched-tokens {n} must exceed --max-batch {}: a step that decodes \
                 every other sequence must still prefill",
                args.max_batch
            );
        }
    }
    let eos: Vec<u32> = tokenizer
        .as_ref()
        .and_then(|t| t.eos_token_id())
        .into_iter()
        .chain(cfg.eos_token_ids.iter().copied())
        .collect();
    let served_model_name = match args.served_model_name {
        Some(n) => n,
        None => dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_stem().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into()),
    };
    let metrics = Arc::new(Metrics::new());
    let backend = runner::choose_backend(args.model.backend);
    crate::announce_capture(backend, &dir, &limits)?;
    let runner_dir = dir.clone();
    let engine = Engine::start(
        move || runner::open(backend, &runner_dir, &limits),
        tokenizer.clone(),
        EngineOptions {
            max_waiting: args.max_waiting,
            max_num_batched_tokens: args.max_num_batched_tokens,
            prefix_caching: !args.no_prefix_caching,
            fair_decode: match args.fair_decode {
                FairDecode::Auto => backend == runner::Backend::Cpu,
                FairDecode::On => true,
                FairDecode::Off => false,
            },
            fair_decode_slowdown: args.fair_decode_slowdown,
            eos_token_ids: eos,
            log_stats_every: (args.log_stats_secs > 0)
                .then(|| Duration::from_secs(args.log_stats_secs)),
        },
        metrics,
    )?;
    engine.set_stall_timeout(Duration::from_secs(args.stall_timeout_secs));
    if !args.no_prefix_caching && !engine.info().shares_prefixes {
        eprintln!(
            "deepinfer: prefix caching is off for this DeepSeek-V4 model: its sliding-window and \
             compressor rings live outside the cache blocks a prefix would share"
        );
    }
    let engine = Arc::new(engine);
    let config = ServerConfig {
        served_model_name: served_model_name.clone(),
        api_key: args.api_key.filter(|k| !k.is_empty()),
        max_body_bytes: args.max_body_bytes,
        drain_timeout: Duration::from_secs(args.drain_timeout_secs),
        tool_call_format: args.tool_call_parser,
        json: JsonOptions {
            additional_properties: args.schema_allow_additional_properties,
            whitespace: match args.json_whitespace {
                Whitespace::Compact => JsonWhitespace::Compact,
                Whitespace::Flexible => JsonWhitespace::Flexible,
            },
        },
    };
    let limits = ConnectionLimits {
        max_connections: args.max_connections,
        header_timeout: Duration::from_secs(args.header_timeout_secs),
        body_timeout: Duration::from_secs(args.body_timeout_secs),
        idle_timeout: Duration::from_secs(args.idle_timeout_secs),
    };
    let state = Arc::new(AppState::new(config, engine, tokenizer));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        deepinfer::server::serve(listener, state, limits, |bound| {
            eprintln!(
                "deepinfer: serving \"{served_model_name}\" on http://{bound} (backend {backend})"
            );
        })
        .await
        .context("serving")
    })
}
