//! The server's error mapping, in process: the app's `Router` over a real [`Engine`] (the CPU
//! runner, `fixtures/default-model`), driven with `tower::ServiceExt::oneshot`, no socket.
//!
//! Every refusal the openai-client suite (`tests/server/`) checks end to end is checked here
//! too, status and body, in milliseconds; and what that suite cannot reach without a device
//! is reached here by wrapping the runner: a request held in a step (a full queue), a step
//! that fails on the device (500 `device_error`) or inside deepinfer (500 `internal_error`,
//! details kept out of the body).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::response::Response;
use axum::Router;
use deepinfer::config::ModelConfig;
use deepinfer::deployment::{Buckets, Limits, RunnerConfig};
use deepinfer::engine::{Engine, EngineOptions};
use deepinfer::error::{Error, ErrorKind, Result};
use deepinfer::metrics::{Metrics, Outcome};
use deepinfer::runner::{self, Backend, Runner, Step, StepOutput};
use deepinfer::server::{app, AppState, ServerConfig};
use deepinfer::tokenizer::Tokenizer;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

const MODEL: &str = "default-model";
const KEY: &str = "router-test-key";
/// The body limit of every app here: small, so the 413 needs no large body.
const MAX_BODY: usize = 64 * 1024;

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(MODEL)
}

// === The runner wrapper: hold a step, or fail it ===

/// What the wrapped runner does on its next replays.
#[derive(Debug, Default)]
struct Control {
    state: Mutex<ControlState>,
    changed: Condvar,
    /// Replays entered so far (held ones included).
    entered: AtomicUsize,
}

#[derive(Debug, Default)]
struct ControlState {
    /// Replays wait while this is set.
    held: bool,
    /// Replays fail with an error of this kind while it is set.
    fail: Option<ErrorKind>,
}

impl Control {
    fn hold(&self, held: bool) {
        self.state.lock().unwrap().held = held;
        self.changed.notify_all();
    }

    fn fail(&self, fail: Option<ErrorKind>) {
        self.state.lock().unwrap().fail = fail;
    }

    /// Waits until `n` replays have entered (the engine is inside its step).
    fn wait_entered(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.entered.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "the engine never ran a step");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A runner that runs its inner runner's steps, unless told to hold or fail them.
struct Wrapped {
    inner: Box<dyn Runner>,
    control: Arc<Control>,
}

impl Runner for Wrapped {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn runner_config(&self) -> &RunnerConfig {
        self.inner.runner_config()
    }
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn capture(&mut self, buckets: &Buckets) -> Result<()> {
        self.inner.capture(buckets)
    }
    fn replay(&mut self, step: &Step<'_>) -> Result<StepOutput> {
        self.control.entered.fetch_add(1, Ordering::SeqCst);
        let fail = {
            let mut s = self.control.state.lock().unwrap();
            while s.held {
                s = self.control.changed.wait(s).unwrap();
            }
            s.fail
        };
        match fail {
            None => self.inner.replay(step),
            Some(ErrorKind::Device) => Err(Error::Device {
                graph: "decode_b1_c256".into(),
                nrt: neuron_sys::Error::status("nrt_execute", 1006),
            }),
            Some(ErrorKind::Internal) => Err(Error::Internal(
                "SECRET-DETAIL: the step returned 0 sampled tokens for 1 rows".into(),
            )),
            Some(other) => panic!("no fault of kind {other:?} is injected here"),
        }
    }
    fn destroy(&mut self) -> Result<()> {
        self.inner.destroy()
    }
}

// === Building the app ===

/// A server over a fresh engine whose runner is [`Wrapped`] around the CPU runner.
struct Server {
    app: Router,
    engine: Arc<Engine>,
    control: Arc<Control>,
}

fn start(limits: Limits, max_waiting: usize, api_key: Option<&str>) -> Server {
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir()).unwrap());
    let control = Arc::new(Control::default());
    let runner_control = control.clone();
    let engine = Engine::start(
        move || {
            let inner = runner::open(Backend::Cpu, &model_dir(), &limits)?;
            Ok(Box::new(Wrapped {
                inner,
                control: runner_control,
            }) as Box<dyn Runner>)
        },
        Some(tokenizer.clone()),
        EngineOptions {
            max_waiting,
            max_num_batched_tokens: None,
            prefix_caching: true,
            fair_decode: false,
            fair_decode_slowdown: deepinfer::engine::DEFAULT_FAIR_DECODE_SLOWDOWN,
            eos_token_ids: tokenizer.eos_token_id().into_iter().collect(),
            log_stats_every: None,
        },
        Arc::new(Metrics::new()),
    )
    .unwrap();
    let engine = Arc::new(engine);
    let config = ServerConfig {
        served_model_name: MODEL.into(),
        api_key: api_key.map(str::to_owned),
        max_body_bytes: MAX_BODY,
        drain_timeout: Duration::from_secs(1),
        tool_call_format: None,
        json: Default::default(),
    };
    let state = Arc::new(AppState::new(config, engine.clone(), Some(tokenizer)));
    Server {
        app: app(state),
        engine,
        control,
    }
}

fn default_limits() -> Limits {
    Limits::new(4, 256)
}

/// The app most tests share (their requests are refused before any step, or are short):
/// one engine load for all of them.
fn shared() -> &'static Server {
    static SHARED: OnceLock<Server> = OnceLock::new();
    SHARED.get_or_init(|| start(default_limits(), 256, Some(KEY)))
}

// === Requests and responses ===

fn request(method: Method, uri: &str, body: impl Into<Body>, key: Option<&str>) -> Request<Body> {
    let mut r = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        r = r.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    r.body(body.into()).unwrap()
}

fn post(uri: &str, body: &Value) -> Request<Body> {
    request(Method::POST, uri, body.to_string(), Some(KEY))
}

async fn send(app: &Router, req: Request<Body>) -> Response {
    app.clone().oneshot(req).await.unwrap()
}

async fn body_text(r: Response) -> String {
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The error a response carries, after checking it is OpenAI's shape with `status`.
async fn error_of(r: Response, status: StatusCode) -> Value {
    assert_eq!(r.status(), status);
    let ct = r.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(ct.starts_with("application/json"), "content-type {ct}");
    let body: Value = serde_json::from_str(&body_text(r).await).unwrap();
    check_shape(&body)
}

/// Checks `{"error": {message, type, param, code}}` and returns the inner object.
fn check_shape(body: &Value) -> Value {
    let obj = body.as_object().unwrap();
    assert_eq!(obj.len(), 1, "{body}");
    let err = &body["error"];
    for field in ["message", "type", "param", "code"] {
        assert!(err.get(field).is_some(), "no `{field}` in {body}");
    }
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    err.clone()
}

fn completion(extra: Value) -> Value {
    let mut v = json!({"model": MODEL, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn chat(extra: Value) -> Value {
    let mut v = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "ROMEO:"}],
        "max_tokens": 4,
        "temperature": 0
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

/// The `data:` payloads of an SSE body.
fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_owned)
        .collect()
}

// === Bad requests: the request's fault, 4xx ===

#[tokio::test]
async fn malformed_json_is_a_400_naming_no_field() {
    let s = shared();
    let r = send(
        &s.app,
        request(Method::POST, "/v1/completions", "{not json", Some(KEY)),
    )
    .await;
    let e = error_of(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["code"], Value::Null);
    assert_eq!(e["param"], Value::Null);
    assert!(
        e["message"].as_str().unwrap().contains("not valid JSON"),
        "{e}"
    );

    let r = send(
        &s.app,
        request(Method::POST, "/v1/chat/completions", "[1, 2]", Some(KEY)),
    )
    .await;
    let e = error_of(r, StatusCode::BAD_REQUEST).await;
    assert!(
        e["message"].as_str().unwrap().contains("JSON object"),
        "{e}"
    );
}

#[tokio::test]
async fn a_field_of_the_wrong_type_is_a_400_naming_it() {
    let s = shared();
    for (field, value) in [
        ("max_tokens", json!("ten")),
        ("temperature", json!("hot")),
        ("logprobs", json!("yes")),
    ] {
        let r = send(
            &s.app,
            post("/v1/completions", &completion(json!({ field: value }))),
        )
        .await;
        let e = error_of(r, StatusCode::BAD_REQUEST).await;
        assert_eq!(e["type"], "invalid_request_error", "{field}");
        assert_eq!(e["param"], field, "{e}");
    }
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": 5}]});
    let r = send(&s.app, post("/v1/chat/completions", &chat)).await;
    let e = error_of(r, StatusCode::BAD_REQUEST).await;
    assert!(
        e["param"]
            .as_str()
            .is_some_and(|p| p.starts_with("messages")),
        "{e}"
    );
}

#[tokio::test]
async fn a_value_out_of_range_is_a_400_naming_it() {
    let s = shared();
    for (field, value) in [
        ("max_tokens", json!(-5)),
        ("top_p", json!(1.5)),
        ("n", json!(0)),
    ] {
        let r = send(
            &s.app,
            post("/v1/completions", &completion(json!({ field: value }))),
        )
        .await;
        let e = error_of(r, StatusCode::BAD_REQUEST).await;
        assert_eq!(e["param"], field, "{e}");
    }
    let r = send(
        &s.app,
        post(
            "/v1/completions",
            &completion(json!({"max_tokens": 1_000_000_000})),
        ),
    )
    .await;
    let e = error_of(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(e["code"], "context_length_exceeded");
    // A token outside the vocabulary: the engine refuses the submission, naming the prompt.
    let r = send(
        &s.app,
        post(
            "/v1/completions",
            &completion(json!({"prompt": [0, 5, 1_000_000]})),
        ),
    )
    .await;
    let e = error_of(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(e["param"], "prompt", "{e}");
}

#[tokio::test]
async fn an_unknown_model_is_a_404_model_not_found() {
    let s = shared();
    let r = send(
        &s.app,
        post("/v1/completions", &completion(json!({"model": "gpt-4"}))),
    )
    .await;
    let e = error_of(r, StatusCode::NOT_FOUND).await;
    assert_eq!(e["code"], "model_not_found");
    assert_eq!(e["param"], "model");
    assert_eq!(e["type"], "invalid_request_error");

    let r = send(
        &s.app,
        request(Method::GET, "/v1/models/gpt-4", Body::empty(), Some(KEY)),
    )
    .await;
    let e = error_of(r, StatusCode::NOT_FOUND).await;
    assert_eq!(e["code"], "model_not_found");
}

#[tokio::test]
async fn a_missing_or_wrong_key_is_a_401() {
    let s = shared();
    let body = completion(json!({})).to_string();
    for key in [None, Some("not-the-key")] {
        let r = send(
            &s.app,
            request(Method::POST, "/v1/completions", body.clone(), key),
        )
        .await;
        let e = error_of(r, StatusCode::UNAUTHORIZED).await;
        assert_eq!(e["code"], "invalid_api_key", "{key:?}");
        assert_eq!(e["type"], "invalid_request_error");
    }
    // The tokenizer routes need it too; /health and /metrics do not.
    let r = send(
        &s.app,
        request(Method::POST, "/tokenize", r#"{"prompt": "a"}"#, None),
    )
    .await;
    error_of(r, StatusCode::UNAUTHORIZED).await;
    for open in ["/health", "/metrics"] {
        let r = send(&s.app, request(Method::GET, open, Body::empty(), None)).await;
        assert_eq!(r.status(), StatusCode::OK, "{open}");
    }
}

#[tokio::test]
async fn a_body_over_the_limit_is_a_413() {
    let s = shared();
    let big = completion(json!({"prompt": "a".repeat(2 * MAX_BODY)}));
    let r = send(&s.app, post("/v1/completions", &big)).await;
    let e = error_of(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(e["code"], "request_too_large");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains(&MAX_BODY.to_string()),
        "{e}"
    );
}

#[tokio::test]
async fn an_unknown_route_is_a_404_with_or_without_the_key() {
    let s = shared();
    for key in [Some(KEY), None] {
        for path in ["/v1/nothing", "/nothing", "/v1/models/x/y"] {
            let r = send(&s.app, request(Method::GET, path, Body::empty(), key)).await;
            let e = error_of(r, StatusCode::NOT_FOUND).await;
            assert!(e["message"].as_str().unwrap().contains(path), "{e}");
            assert_eq!(e["type"], "invalid_request_error");
        }
    }
}

#[tokio::test]
async fn a_wrong_method_is_a_405_in_the_error_shape_with_allow() {
    let s = shared();
    for (method, path, allowed) in [
        (Method::GET, "/v1/completions", "POST"),
        (Method::GET, "/v1/chat/completions", "POST"),
        (Method::DELETE, "/v1/models", "GET"),
        (Method::POST, "/health", "GET"),
        (Method::PUT, "/tokenize", "POST"),
    ] {
        let r = send(
            &s.app,
            request(method.clone(), path, Body::empty(), Some(KEY)),
        )
        .await;
        let allow = r
            .headers()
            .get(header::ALLOW)
            .map(|v| v.to_str().unwrap().to_owned());
        assert!(
            allow.as_deref().is_some_and(|a| a.contains(allowed)),
            "{method} {path}: Allow {allow:?}"
        );
        let e = error_of(r, StatusCode::METHOD_NOT_ALLOWED).await;
        assert_eq!(e["type"], "invalid_request_error", "{method} {path}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains(path) && m.contains(method.as_str()), "{m}");
    }
    // Behind the key, the key comes first.
    let r = send(
        &s.app,
        request(Method::GET, "/v1/completions", Body::empty(), None),
    )
    .await;
    error_of(r, StatusCode::UNAUTHORIZED).await;
}

/// The optional fields both endpoints read (`SamplingFields` in `src/server/protocol.rs`).
const OPTIONAL_SAMPLING_FIELDS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "response_format",
    "logprobs",
    "top_logprobs",
    "user",
];

/// The body of a 200 response (not streamed), after checking the status.
async fn ok_body(r: Response, what: &str) -> Value {
    let status = r.status();
    let text = body_text(r).await;
    assert_eq!(status, StatusCode::OK, "{what}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// `null` is every optional field's default, as in OpenAI's API and vLLM (clients serialize
/// unset fields as `null`): each field alone, then all of them at once, on both endpoints.
/// `echo` and `ignore_eos` were once refused with a 400 for it.
#[tokio::test]
async fn null_is_every_optional_fields_default() {
    let s = shared();
    let completion_fields = [OPTIONAL_SAMPLING_FIELDS, &["echo", "best_of", "suffix"]].concat();
    let chat_fields = [
        OPTIONAL_SAMPLING_FIELDS,
        &[
            "max_completion_tokens",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
        ],
    ]
    .concat();
    let all_null = |fields: &[&str]| {
        Value::Object(
            fields
                .iter()
                .map(|f| (f.to_string(), Value::Null))
                .collect(),
        )
    };
    for field in &completion_fields {
        let r = send(
            &s.app,
            post("/v1/completions", &completion(json!({ *field: null }))),
        )
        .await;
        let body = ok_body(r, &format!("completions, {field}: null")).await;
        assert_eq!(body["object"], "text_completion", "{body}");
        assert_eq!(body["choices"].as_array().unwrap().len(), 1, "{body}");
    }
    let r = send(
        &s.app,
        post("/v1/completions", &completion(all_null(&completion_fields))),
    )
    .await;
    ok_body(r, "completions, every optional field null").await;
    for field in &chat_fields {
        let r = send(
            &s.app,
            post("/v1/chat/completions", &chat(json!({ *field: null }))),
        )
        .await;
        let body = ok_body(r, &format!("chat, {field}: null")).await;
        assert_eq!(body["object"], "chat.completion", "{body}");
    }
    let r = send(
        &s.app,
        post("/v1/chat/completions", &chat(all_null(&chat_fields))),
    )
    .await;
    ok_body(r, "chat, every optional field null").await;
    // `max_tokens` too (the default: 16 for a completion, the rest of the context for chat).
    let r = send(
        &s.app,
        post("/v1/completions", &completion(json!({"max_tokens": null}))),
    )
    .await;
    let body = ok_body(r, "completions, max_tokens: null").await;
    assert_eq!(body["usage"]["completion_tokens"], 16, "{body}");
    let r = send(
        &s.app,
        post("/v1/chat/completions", &chat(json!({"max_tokens": null}))),
    )
    .await;
    ok_body(r, "chat, max_tokens: null").await;
    // And null means the default, not merely "accepted": greedy text as with `false`.
    for field in ["echo", "ignore_eos"] {
        let mut texts = Vec::new();
        for value in [json!(false), Value::Null] {
            let r = send(
                &s.app,
                post("/v1/completions", &completion(json!({ field: value }))),
            )
            .await;
            let body = ok_body(r, &format!("completions, {field}: {value}")).await;
            texts.push(body["choices"][0]["text"].clone());
        }
        assert_eq!(texts[0], texts[1], "{field}: null vs false");
    }
}

/// `stream_options` is an object or `null`; anything else is a 400 naming it, as OpenAI's. A
/// JSON array used to be read as the options' fields in order (`[]` as no options).
#[tokio::test]
async fn stream_options_must_be_an_object_or_null() {
    let s = shared();
    for (uri, body) in [
        ("/v1/completions", completion(json!({"stream": true}))),
        ("/v1/chat/completions", chat(json!({"stream": true}))),
    ] {
        for bad in [
            json!([]),
            json!([true]),
            json!("include_usage"),
            json!(true),
            json!(1),
        ] {
            let mut body = body.clone();
            body["stream_options"] = bad.clone();
            let r = send(&s.app, post(uri, &body)).await;
            let e = error_of(r, StatusCode::BAD_REQUEST).await;
            assert_eq!(e["type"], "invalid_request_error", "{uri} {bad}: {e}");
            assert_eq!(e["param"], "stream_options", "{uri} {bad}: {e}");
            assert_eq!(e["code"], Value::Null, "{uri} {bad}: {e}");
            let message = e["message"].as_str().unwrap();
            assert!(message.contains("stream_options"), "{uri} {bad}: {e}");
        }
        // A field of the object keeps its own name in the error.
        let mut wrong = body.clone();
        wrong["stream_options"] = json!({"include_usage": "yes"});
        let e = error_of(
            send(&s.app, post(uri, &wrong)).await,
            StatusCode::BAD_REQUEST,
        )
        .await;
        assert_eq!(e["param"], "stream_options.include_usage", "{uri}: {e}");
        // An object, `null`, and an object whose field is `null`, are served.
        for good in [
            json!({"include_usage": true}),
            json!({"include_usage": null}),
            json!({}),
            Value::Null,
        ] {
            let mut body = body.clone();
            body["stream_options"] = good.clone();
            let r = send(&s.app, post(uri, &body)).await;
            let status = r.status();
            let text = body_text(r).await;
            assert_eq!(status, StatusCode::OK, "{uri} {good}: {text}");
            let data = sse_data(&text);
            assert_eq!(
                data.last().map(String::as_str),
                Some("[DONE]"),
                "{uri} {good}"
            );
            // Only `include_usage: true` adds the last chunk with the counts.
            let usage = data.iter().rev().nth(1).and_then(|d| {
                serde_json::from_str::<Value>(d)
                    .ok()
                    .filter(|c| !c["usage"].is_null())
            });
            assert_eq!(
                usage.is_some(),
                good["include_usage"] == true,
                "{uri} {good}: {text}"
            );
        }
    }
}

#[tokio::test]
async fn a_good_request_after_the_bad_ones_is_served() {
    let s = shared();
    let r = send(&s.app, post("/v1/completions", &completion(json!({})))).await;
    assert_eq!(r.status(), StatusCode::OK);
    let body: Value = serde_json::from_str(&body_text(r).await).unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

// === The engine's refusals and failures ===

#[tokio::test]
async fn a_full_queue_is_a_429_and_the_held_request_still_finishes() {
    let s = start(default_limits(), 1, Some(KEY));
    s.control.hold(true);
    let stream = completion(json!({"stream": true, "max_tokens": 2}));
    // A enters its first step and is held there.
    let a = send(&s.app, post("/v1/completions", &stream)).await;
    assert_eq!(a.status(), StatusCode::OK);
    s.control.wait_entered(1);
    // Four batch slots and one waiting place: counting A, at most 4 + 1 requests are taken
    // (free slots come on top of --max-waiting; while A's step is held the engine's counts
    // are those of before it, so A's slot may still count as free), and the next is refused.
    let mut accepted = Vec::new();
    let mut refused = None;
    for _ in 0..8 {
        let r = send(&s.app, post("/v1/completions", &stream)).await;
        if r.status() == StatusCode::OK {
            accepted.push(r);
        } else {
            refused = Some(r);
            break;
        }
    }
    let refused = refused.expect("more than --max-batch + --max-waiting requests were taken");
    assert!(
        (1..=4).contains(&accepted.len()),
        "{} taken besides A",
        accepted.len()
    );
    assert_eq!(
        refused.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let e = error_of(refused, StatusCode::TOO_MANY_REQUESTS).await;
    assert_eq!(e["code"], "queue_full");
    assert_eq!(e["type"], "rate_limit_error");
    assert_eq!(s.engine.metrics().outcome_count(Outcome::Rejected), 1);
    // Released, every accepted stream ends normally.
    s.control.hold(false);
    for r in std::iter::once(a).chain(accepted) {
        let events = sse_data(&body_text(r).await);
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
    }
}

#[tokio::test]
async fn a_draining_server_refuses_with_503_shutting_down() {
    let s = start(default_limits(), 256, None);
    s.engine.begin_drain();
    let r = send(&s.app, post("/v1/completions", &completion(json!({})))).await;
    let e = error_of(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(e["code"], "shutting_down");
    assert_eq!(e["type"], "server_error");
    let r = send(&s.app, request(Method::GET, "/health", Body::empty(), None)).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body_text(r).await, r#"{"status":"draining"}"#);
}

#[tokio::test]
async fn a_device_fault_is_a_500_device_error_never_the_requests_fault() {
    let s = start(default_limits(), 256, Some(KEY));
    s.control.fail(Some(ErrorKind::Device));
    let r = send(&s.app, post("/v1/completions", &completion(json!({})))).await;
    let e = error_of(r, StatusCode::INTERNAL_SERVER_ERROR).await;
    assert_eq!(e["code"], "device_error");
    assert_eq!(e["type"], "server_error");
    assert!(
        e["message"].as_str().unwrap().contains("nrt_execute"),
        "{e}"
    );
    // Streamed: the stream starts, then ends with the error event and no [DONE].
    let r = send(
        &s.app,
        post(
            "/v1/chat/completions",
            &json!({
                "model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 3, "stream": true,
            }),
        ),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let events = sse_data(&body_text(r).await);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(check_shape(&last)["code"], "device_error", "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    // Failures are the engine's to count, not refusals.
    let m = s.engine.metrics();
    assert_eq!(m.outcome_count(Outcome::Error), 2);
    assert_eq!(m.outcome_count(Outcome::Rejected), 0);
    // The device recovers: the server serves again.
    s.control.fail(None);
    let r = send(&s.app, post("/v1/completions", &completion(json!({})))).await;
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test]
async fn an_internal_fault_is_a_500_internal_error_keeping_its_details_out() {
    let s = start(default_limits(), 256, Some(KEY));
    s.control.fail(Some(ErrorKind::Internal));
    let r = send(&s.app, post("/v1/completions", &completion(json!({})))).await;
    let e = error_of(r, StatusCode::INTERNAL_SERVER_ERROR).await;
    assert_eq!(e["code"], "internal_error");
    assert_eq!(e["type"], "server_error");
    assert!(
        !e["message"].as_str().unwrap().contains("SECRET-DETAIL"),
        "{e}"
    );
    let r = send(
        &s.app,
        post("/v1/completions", &completion(json!({"stream": true}))),
    )
    .await;
    let events = sse_data(&body_text(r).await);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    let e = check_shape(&last);
    assert_eq!(e["code"], "internal_error", "{events:?}");
    assert!(!e["message"].as_str().unwrap().contains("SECRET-DETAIL"));
}
