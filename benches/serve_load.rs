//! Load generator for `deepinfer serve`: requests/s, output tokens/s, and TTFT / TPOT p50 and
//! p99 at 1, 8 and 32 concurrent streaming clients.
//!
//! The decode bench measures one engine step in isolation; this one measures what a client of
//! the HTTP server sees, scheduler, tokenizer, SSE framing and batching included, so a change
//! to continuous batching shows up here as throughput at 32 clients against latency at 1.
//!
//! By default it starts `deepinfer serve --port 0 --backend cpu --max-batch 32` (the binary
//! cargo built alongside this bench: the release one under `cargo bench`) with the embedded
//! default model and stops it at the end. With `DEEPINFER_BENCH_URL=http://host:port` it drives
//! that server instead and spawns nothing (optional `DEEPINFER_BENCH_MODEL`, else the first id
//! of `GET /v1/models`; optional `DEEPINFER_BENCH_API_KEY`, sent as a bearer token).
//! `DEEPINFER_BENCH_REQUESTS_PER_CLIENT=N` replaces the per-level request counts and
//! `DEEPINFER_BENCH_CLIENTS=1,8,32` the levels.
//!
//! Every request is `POST /v1/completions` with `stream: true`, greedy, `ignore_eos` and
//! `max_tokens: 32`, so each one does the same amount of decode work whatever the model writes.
//!
//! Run with `cargo bench --bench serve_load`. Prints an aligned table, then one JSON object
//! per level on its own line (`grep '^{'`) for recording.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

/// How the spawned server runs: a free port, the CPU backend, and room to batch every client
/// of the largest level.
const SERVE_ARGS: [&str; 7] = [
    "serve",
    "--port",
    "0",
    "--backend",
    "cpu",
    "--max-batch",
    "32",
];
/// Tokens generated per request. With `ignore_eos` every request produces exactly this many.
const MAX_TOKENS: u64 = 32;
/// (concurrent clients, requests per client): about 1000 requests per level, enough samples
/// for a p99 that is not just the maximum. The default model serves 20 to 40 requests/s on
/// the 2-core development machine, so the levels take about 2 minutes together.
const LEVELS: [(usize, usize); 3] = [(1, 1000), (8, 125), (32, 32)];
/// Distinct prompts in the style of the default model's training text (Shakespeare's plays);
/// cycling through them keeps any prefix reuse from flattering the numbers.
const PROMPTS: [&str; 16] = [
    "ROMEO:",
    "JULIET:\nO",
    "HAMLET:\nTo be",
    "KING LEAR:\nBlow, winds",
    "MACBETH:\nIs this a",
    "OTHELLO:\nIt is the cause",
    "PORTIA:\nThe quality of mercy",
    "PROSPERO:\nOur revels now",
    "FIRST WITCH:\nWhen shall we",
    "BRUTUS:\nThere is a tide",
    "MARK ANTONY:\nFriends, Romans",
    "LADY MACBETH:\nOut, damned",
    "HENRY V:\nOnce more unto",
    "VIOLA:\nIf music be",
    "PUCK:\nIf we shadows",
    "GLOUCESTER:\nNow is the winter",
];
/// Upper bound on one request, so a stuck server fails the bench instead of hanging it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// How long model loading may take before the spawned server counts as failed to start.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// Server stderr lines kept for the failure report.
const LOG_TAIL: usize = 40;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The server under test. When spawned here, dropping it kills the process (also when the
/// bench panics), and its last stderr lines are printed if the bench failed.
struct Target {
    base: String,
    model: String,
    api_key: Option<String>,
    /// The spawned server, if any (behind a mutex so the shared `Target` can poll it).
    child: Mutex<Option<Child>>,
    log_tail: Arc<Mutex<VecDeque<String>>>,
}

impl Target {
    /// Spawns `deepinfer serve` on a free port and waits for its ready line.
    fn spawn() -> Result<Self> {
        let exe = env!("CARGO_BIN_EXE_deepinfer");
        let mut cmd = Command::new(exe);
        cmd.args(SERVE_ARGS)
            // The server reads its key from this variable too; the bench sends none.
            .env_remove("DEEPINFER_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawning {exe} serve"))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let log_tail = Arc::new(Mutex::new(VecDeque::new()));
        let mut target = Target {
            base: String::new(),
            model: String::new(),
            api_key: None,
            child: Mutex::new(Some(child)),
            log_tail: Arc::clone(&log_tail),
        };
        // The thread keeps draining stderr after the ready line so the server never blocks
        // on a full pipe.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(ready) = parse_ready_line(&line) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(ready);
                    }
                }
                let mut tail = log_tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == LOG_TAIL {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        let (model, base) = match rx.recv_timeout(READY_TIMEOUT) {
            Ok(ready) => ready,
            Err(e) => {
                target.print_log_tail();
                let why = match e {
                    mpsc::RecvTimeoutError::Timeout => format!("within {READY_TIMEOUT:?}"),
                    mpsc::RecvTimeoutError::Disconnected => match target.child_status() {
                        Some(status) => format!("before it exited ({status})"),
                        None => "before closing its stderr".to_string(),
                    },
                };
                bail!("{exe} serve printed no ready line {why}; its stderr is above");
            }
        };
        eprintln!("serve_load: spawned {exe} serve: \"{model}\" on {base}");
        target.base = base;
        target.model = model;
        Ok(target)
    }

    /// Targets the server at `DEEPINFER_BENCH_URL`.
    async fn external(url: String, client: &HttpClient) -> Result<Self> {
        let mut target = Target {
            base: url.trim_end_matches('/').to_string(),
            model: String::new(),
            api_key: std::env::var("DEEPINFER_BENCH_API_KEY").ok(),
            child: Mutex::new(None),
            log_tail: Arc::default(),
        };
        target.model = match std::env::var("DEEPINFER_BENCH_MODEL") {
            Ok(model) => model,
            Err(_) => {
                let (status, body) = target.get(client, "/v1/models").await?;
                ensure!(
                    status == StatusCode::OK,
                    "GET /v1/models -> {status}: {body}"
                );
                let models: Value = serde_json::from_str(&body)
                    .with_context(|| format!("GET /v1/models: not JSON: {body}"))?;
                models["data"][0]["id"]
                    .as_str()
                    .with_context(|| format!("GET /v1/models: no data[0].id in {body}"))?
                    .to_string()
            }
        };
        Ok(target)
    }

    fn request(&self, method: &str, path: &str) -> hyper::http::request::Builder {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(key) = &self.api_key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        req
    }

    async fn get(&self, client: &HttpClient, path: &str) -> Result<(StatusCode, String)> {
        let req = self.request("GET", path).body(Full::default())?;
        let resp = client
            .request(req)
            .await
            .with_context(|| format!("GET {}{path}", self.base))?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    fn spawned(&self) -> bool {
        self.child.lock().is_ok_and(|c| c.is_some())
    }

    /// The spawned server's exit status, if it has exited.
    fn child_status(&self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.lock().ok()?;
        child.as_mut()?.try_wait().ok()?
    }

    /// Best effort: write errors are ignored, as this also runs while unwinding, where a
    /// second panic (say stderr is a closed pipe) would abort before the server is killed.
    fn print_log_tail(&self) {
        let tail = self.log_tail.lock().unwrap_or_else(|e| e.into_inner());
        if !tail.is_empty() {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(
                err,
                "--- last {} lines of the server's stderr ---",
                tail.len()
            );
            for line in tail.iter() {
                let _ = writeln!(err, "{line}");
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(mut child) = child.take() {
            let _ = child.kill();
            let _ = child.wait();
            if std::thread::panicking() {
                self.print_log_tail();
            }
        }
    }
}

/// Parses `deepinfer: serving "NAME" on http://HOST:PORT (backend cpu)` into (NAME, base URL).
fn parse_ready_line(line: &str) -> Option<(String, String)> {
    let rest = line.split_once("deepinfer: serving \"")?.1;
    let (name, rest) = rest.split_once('"')?;
    let url = rest.split_once("http://")?.1.split(' ').next()?;
    let (_, port) = url.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    Some((name.to_string(), format!("http://{url}")))
}

/// What one streamed request measured.
struct Sample {
    ttft: Duration,
    /// `None` when only one token came back (no inter-token interval to measure).
    tpot: Option<Duration>,
    completion_tokens: u64,
}

/// Sends one streaming completion and times it. TTFT runs from just before the request is
/// sent to the first choice chunk with non-empty text (the first choice chunk if none has
/// text); TPOT is the time from there to the last choice chunk over `completion_tokens - 1`.
/// Any deviation from the protocol fails the request with what the server sent.
async fn stream_completion(client: &HttpClient, target: &Target, prompt: &str) -> Result<Sample> {
    let body = json!({
        "model": target.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let req = target
        .request("POST", "/v1/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let start = Instant::now();
    let resp = client
        .request(req)
        .await
        .with_context(|| format!("POST {}/v1/completions", target.base))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if status != StatusCode::OK {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        bail!(
            "POST /v1/completions {prompt:?} -> {status}: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let (mut first_choice, mut first_text, mut last_choice) = (None, None, None);
    let (mut usage_tokens, mut finish_reason, mut done) = (None, None, false);
    let mut buf: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.context("reading the SSE stream")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = std::str::from_utf8(&event).context("SSE event is not UTF-8")?;
            // An event's `data:` lines joined by newlines; other fields (comments) are ignored.
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if data.is_empty() {
                continue;
            }
            let data = data.join("\n");
            ensure!(!done, "data after [DONE]: {data}");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(&data)
                .with_context(|| format!("SSE data is not JSON: {data}"))?;
            ensure!(chunk.get("error").is_none(), "error event: {data}");
            let choices = chunk["choices"]
                .as_array()
                .with_context(|| format!("chunk without choices: {data}"))?;
            if let Some(choice) = choices.first() {
                first_choice.get_or_insert(now);
                if first_text.is_none() && choice["text"].as_str().is_some_and(|t| !t.is_empty()) {
                    first_text = Some(now);
                }
                last_choice = Some(now);
                if let Some(reason) = choice["finish_reason"].as_str() {
                    finish_reason = Some(reason.to_string());
                }
            }
            if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                usage_tokens = Some(
                    usage["completion_tokens"]
                        .as_u64()
                        .with_context(|| format!("usage without completion_tokens: {data}"))?,
                );
            }
        }
    }
    ensure!(
        done,
        "stream ended without data: [DONE] (unparsed tail: {buf:?})"
    );
    let completion_tokens = usage_tokens.context("no usage chunk before [DONE]")?;
    ensure!(
        completion_tokens == MAX_TOKENS,
        "completion_tokens {completion_tokens} != max_tokens {MAX_TOKENS} despite ignore_eos"
    );
    ensure!(
        finish_reason.as_deref() == Some("length"),
        "finish_reason {finish_reason:?}, expected \"length\""
    );
    let first = first_text
        .or(first_choice)
        .context("no choice chunk in the stream")?;
    let last = last_choice.expect("set with first_choice");
    let tpot = (completion_tokens > 1)
        .then(|| (last - first) / u32::try_from(completion_tokens - 1).unwrap_or(u32::MAX));
    Ok(Sample {
        ttft: first - start,
        tpot,
        completion_tokens,
    })
}

/// Nearest-rank percentile: the smallest sample with at least `p`% of the samples at or below
/// it (`sorted[ceil(p/100 * n) - 1]`). It always returns a measured value, which suits the
/// dozens of samples a level has better than interpolation. `sorted` must be non-empty.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Table columns: header and the key of the level's JSON summary.
const COLUMNS: [(&str, &str); 9] = [
    ("clients", "clients"),
    ("requests", "requests"),
    ("wall s", "wall_s"),
    ("req/s", "req_per_s"),
    ("out tok/s", "output_tok_per_s"),
    ("TTFT p50 ms", "ttft_ms_p50"),
    ("TTFT p99 ms", "ttft_ms_p99"),
    ("TPOT p50 ms", "tpot_ms_p50"),
    ("TPOT p99 ms", "tpot_ms_p99"),
];

/// Runs `clients` concurrent clients, each sending `per_client` requests back to back, after
/// one warm-up request; returns the level's summary (the keys of [`COLUMNS`] and more).
async fn run_level(
    client: &HttpClient,
    target: &Arc<Target>,
    clients: usize,
    per_client: usize,
) -> Result<Value> {
    stream_completion(client, target, PROMPTS[0])
        .await
        .context("warm-up request")?;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(clients);
    for c in 0..clients {
        let (client, target) = (client.clone(), Arc::clone(target));
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::with_capacity(per_client);
            for r in 0..per_client {
                let prompt = PROMPTS[(c * per_client + r) % PROMPTS.len()];
                let request = stream_completion(&client, &target, prompt);
                let sample = tokio::time::timeout(REQUEST_TIMEOUT, request)
                    .await
                    .map_err(|_| anyhow!("no complete response within {REQUEST_TIMEOUT:?}"))
                    .and_then(|r| r)
                    .with_context(|| format!("client {c}, request {r}, prompt {prompt:?}"))?;
                samples.push(sample);
            }
            anyhow::Ok(samples)
        }));
    }
    let mut samples = Vec::with_capacity(clients * per_client);
    for task in tasks {
        samples.extend(task.await.context("client task panicked")??);
    }
    let secs = start.elapsed().as_secs_f64();
    let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
    let mut tpot: Vec<Duration> = samples.iter().filter_map(|s| s.tpot).collect();
    ttft.sort();
    tpot.sort();
    // Milliseconds at percentile `p`, rounded to microseconds; null without samples.
    let ms = |sorted: &[Duration], p| {
        (!sorted.is_empty()).then(|| round3(percentile(sorted, p).as_secs_f64() * 1e3))
    };
    let tokens: u64 = samples.iter().map(|s| s.completion_tokens).sum();
    Ok(json!({
        "clients": clients,
        "requests": samples.len(),
        "max_tokens": MAX_TOKENS,
        "wall_s": round3(secs),
        "req_per_s": round3(samples.len() as f64 / secs),
        "output_tok_per_s": round3(tokens as f64 / secs),
        "ttft_ms_p50": ms(&ttft, 50.0),
        "ttft_ms_p99": ms(&ttft, 99.0),
        "tpot_ms_p50": ms(&tpot, 50.0),
        "tpot_ms_p99": ms(&tpot, 99.0),
    }))
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// A comma-separated list of positive integers from the environment, if set.
fn env_counts(name: &str) -> Result<Option<Vec<usize>>> {
    let Ok(value) = std::env::var(name) else {
        return Ok(None);
    };
    value
        .split(',')
        .map(|n| n.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<_>>>()
        .map(Some)
        .with_context(|| format!("{name}={value:?}: expected positive integers"))
}

/// (clients, requests per client) for each level: [`LEVELS`], or the levels of
/// `DEEPINFER_BENCH_CLIENTS` (2 requests each), with `DEEPINFER_BENCH_REQUESTS_PER_CLIENT`
/// replacing every count.
fn levels_from_env() -> Result<Vec<(usize, usize)>> {
    let per_client = match env_counts("DEEPINFER_BENCH_REQUESTS_PER_CLIENT")?.as_deref() {
        None => None,
        Some(&[n]) => Some(n),
        Some(_) => bail!("DEEPINFER_BENCH_REQUESTS_PER_CLIENT takes one number"),
    };
    let levels: Vec<(usize, usize)> = match env_counts("DEEPINFER_BENCH_CLIENTS")? {
        Some(clients) => clients.into_iter().map(|c| (c, 2)).collect(),
        None => LEVELS.to_vec(),
    };
    Ok(levels
        .into_iter()
        .map(|(c, n)| (c, per_client.unwrap_or(n)))
        .collect())
}

async fn run(target: Arc<Target>, client: HttpClient, levels: &[(usize, usize)]) -> Result<()> {
    let backend = if target.spawned() { "cpu" } else { "external" };
    println!(
        "serve_load: model \"{}\" at {} (backend {backend}), max_tokens {MAX_TOKENS}, streaming",
        target.model, target.base
    );
    let header: Vec<String> = COLUMNS.iter().map(|(h, _)| format!("{h:>11}")).collect();
    println!("{}", header.join(" "));
    let mut rows = Vec::new();
    for &(clients, per_client) in levels {
        let mut row = run_level(&client, &target, clients, per_client)
            .await
            .with_context(|| format!("level of {clients} clients"))?;
        let cells: Vec<String> = COLUMNS
            .iter()
            .map(|(_, key)| match (row[key].as_u64(), row[key].as_f64()) {
                (Some(count), _) => format!("{count:>11}"),
                (None, Some(x)) => format!("{x:>11.2}"),
                (None, None) => format!("{:>11}", "-"),
            })
            .collect();
        println!("{}", cells.join(" "));
        row["bench"] = json!("serve_load");
        row["backend"] = json!(backend);
        row["model"] = json!(target.model);
        rows.push(row);
    }
    for row in rows {
        println!("{row}");
    }
    Ok(())
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench` (and any filter); this bench takes its settings from the
    // environment instead.
    let levels = levels_from_env()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    // One current-thread runtime is plenty to drive 32 streams and leaves the cores to the
    // server under test.
    rt.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(64)
            .build_http();
        let target = match std::env::var("DEEPINFER_BENCH_URL") {
            Ok(url) => Target::external(url, &client).await?,
            Err(_) => Target::spawn()?,
        };
        let target = Arc::new(target);
        let result = run(Arc::clone(&target), client, &levels).await;
        if result.is_err() {
            target.print_log_tail();
            if let Some(status) = target.child_status() {
                eprintln!("the server exited: {status}");
            }
        }
        result
    })
}
