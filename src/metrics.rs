//! The serving metrics, exposed by `GET /metrics` in Prometheus' text format.
//!
//! The engine thread updates them as requests arrive, produce tokens and end; the server only
//! encodes them. Names follow vLLM's where one exists (`time_to_first_token_seconds`,
//! `time_per_output_token_seconds`, `num_requests_running`, `prefix_cache_queries`,
//! `prefix_cache_hits`, `spec_decode_num_drafts`, `spec_decode_num_draft_tokens`,
//! `spec_decode_num_accepted_tokens`), under a `deepinfer_` prefix.

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::runner::BucketKey;

/// How a request ended, the label of `deepinfer_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Finished on an end-of-sequence token, a stop token or a stop string.
    Stop,
    /// Finished on `max_tokens`.
    Length,
    /// The client went away (or the server shut down) before it finished.
    Cancelled,
    /// A device or runtime failure in one of its steps.
    Error,
    /// Refused before it reached the engine: a malformed request, a full queue, a draining server.
    Rejected,
}

impl Outcome {
    const ALL: [Outcome; 5] = [
        Outcome::Stop,
        Outcome::Length,
        Outcome::Cancelled,
        Outcome::Error,
        Outcome::Rejected,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Cancelled => "cancelled",
            Outcome::Error => "error",
            Outcome::Rejected => "rejected",
        }
    }
}

type OutcomeLabel = [(&'static str, &'static str); 1];

/// A bucket's labels: `kind` (decode, prefill), `batch` (sequences a step of it carries),
/// `tokens` (tokens a step of it carries: the batch again for decode) and `ctx`.
type BucketLabels = [(&'static str, String); 4];

fn bucket_labels(key: &BucketKey) -> BucketLabels {
    [
        ("kind", key.kind.name().to_string()),
        ("batch", key.seqs.to_string()),
        ("tokens", key.rows.to_string()),
        ("ctx", key.ctx.to_string()),
    ]
}

/// Every metric the server exports, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<OutcomeLabel, Counter>,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub generation_tokens: Counter,
    /// Sequences preempted (blocks freed, recomputed later) because the KV cache was full.
    pub preemptions: Counter,
    /// Prompt tokens looked up in the prefix cache as sequences were admitted.
    pub prefix_cache_queries: Counter,
    /// Of those, tokens found cached (not prefilled again).
    pub prefix_cache_hits: Counter,
    /// Speculative decoding: rows verified (a sequence's drafts checked by one step). Tokens
    /// per target step are `(accepted + drafts) / drafts`.
    pub spec_drafts: Counter,
    /// Speculative decoding: drafted tokens verified.
    pub spec_draft_tokens: Counter,
    /// Speculative decoding: drafted tokens accepted.
    pub spec_accepted_tokens: Counter,
    /// Seconds from a request's arrival to its first generated token.
    pub time_to_first_token: Histogram,
    /// Seconds between consecutive generated tokens of one request.
    pub time_per_output_token: Histogram,
    /// Sequences being prefilled or decoded.
    pub running: Gauge,
    /// Requests queued for admission (preempted sequences included).
    pub waiting: Gauge,
    /// KV-cache blocks held by sequences (the scratch block excluded).
    pub kv_blocks_in_use: Gauge,
    /// KV-cache blocks sequences can hold.
    pub kv_blocks_total: Gauge,
    /// Per bucket (captured graph shape): 1 when steps run on it, 0 while it is still
    /// compiling in the background or after it failed to.
    live_buckets: Family<BucketLabels, Gauge>,
    /// Per bucket whose background compile or load failed: 1 (it stays absent).
    failed_buckets: Family<BucketLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All metrics at zero, every outcome label present from the start (so a scrape sees a
    /// counter go from 0 to 1, not appear).
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("deepinfer");
        let requests = Family::<OutcomeLabel, Counter>::default();
        for o in Outcome::ALL {
            drop(requests.get_or_create(&[("outcome", o.as_str())]));
        }
        let m = Metrics {
            requests,
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            preemptions: Counter::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            spec_drafts: Counter::default(),
            spec_draft_tokens: Counter::default(),
            spec_accepted_tokens: Counter::default(),
            // 1 ms .. ~65 s.
            time_to_first_token: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            // 0.5 ms .. ~16 s.
            time_per_output_token: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_blocks_in_use: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            live_buckets: Family::default(),
            failed_buckets: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "Requests that ended, by outcome",
            m.requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of requests admitted to the engine",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "num_preemptions",
            "Sequences preempted for lack of KV-cache blocks, to be recomputed",
            m.preemptions.clone(),
        );
        registry.register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache when sequences were admitted",
            m.prefix_cache_queries.clone(),
        );
        registry.register(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not prefilled again)",
            m.prefix_cache_hits.clone(),
        );
        registry.register(
            "spec_decode_num_drafts",
            "Speculative decoding: sequences' drafts verified, one per sequence and step",
            m.spec_drafts.clone(),
        );
        registry.register(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: drafted tokens verified",
            m.spec_draft_tokens.clone(),
        );
        registry.register(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: drafted tokens the model agreed with",
            m.spec_accepted_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            m.time_to_first_token.clone(),
        );
        registry.register(
            "time_per_output_token_seconds",
            "Time between consecutive generated tokens of a request",
            m.time_per_output_token.clone(),
        );
        registry.register(
            "num_requests_running",
            "Sequences being prefilled or decoded",
            m.running.clone(),
        );
        registry.register(
            "num_requests_waiting",
            "Requests waiting for admission, preempted ones included",
            m.waiting.clone(),
        );
        registry.register(
            "kv_blocks_in_use",
            "KV-cache blocks held by sequences",
            m.kv_blocks_in_use.clone(),
        );
        registry.register(
            "kv_blocks_total",
            "KV-cache blocks sequences can hold",
            m.kv_blocks_total.clone(),
        );
        registry.register(
            "live_buckets",
            "Per captured bucket: 1 when steps run on it, 0 while it is compiling (or failed to)",
            m.live_buckets.clone(),
        );
        registry.register(
            "failed_buckets",
            "Per bucket whose background compile or load failed: 1 (steps run on the others)",
            m.failed_buckets.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Sets the bucket gauges: each of `live` 1, each of `pending` 0, each of `failed` 0 live
    /// and 1 failed.
    pub fn set_buckets<'a>(
        &self,
        live: impl IntoIterator<Item = &'a BucketKey>,
        pending: impl IntoIterator<Item = &'a BucketKey>,
        failed: impl IntoIterator<Item = &'a BucketKey>,
    ) {
        for k in live {
            self.live_buckets.get_or_create(&bucket_labels(k)).set(1);
        }
        for k in pending {
            self.live_buckets.get_or_create(&bucket_labels(k)).set(0);
        }
        for k in failed {
            self.live_buckets.get_or_create(&bucket_labels(k)).set(0);
            self.failed_buckets.get_or_create(&bucket_labels(k)).set(1);
        }
    }

    /// Counts one request that ended with `outcome`.
    pub fn record_outcome(&self, outcome: Outcome) {
        self.requests
            .get_or_create(&[("outcome", outcome.as_str())])
            .inc();
    }

    /// How many requests ended with `outcome` so far.
    pub fn outcome_count(&self, outcome: Outcome) -> u64 {
        self.requests
            .get_or_create(&[("outcome", outcome.as_str())])
            .get()
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// The `Content-Type` of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
