"""End-to-end tests of `deepinfer serve` with the official `openai` Python client.

A session-scoped server runs on the embedded default model (`fixtures/default-model`, context
1024) with `--api-key test-key`; a few tests start servers of their own (nrt-sim with an
injected fault, SIGTERM drain, a tiny waiting queue). Every expectation is checked against an
independent reference:

- token counts against transformers' tokenizer (`AutoTokenizer` + `apply_chat_template`);
- greedy text and token counts against the single-sequence CLI path,
  `deepinfer generate --prompt P --max-tokens N --json`.

Needs `cargo build --release --workspace` (the binary and `libnrt_sim.so`) and the packages of
scripts/requirements-test.txt; `scripts/test.sh` does both.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

# The tokenizer is read from fixtures/default-model; never ask a hub for anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "target" / "release" / "deepinfer"
SIM_LIB = REPO / "target" / "release" / "libnrt_sim.so"
MODEL_DIR = REPO / "fixtures" / "default-model"
MODEL_NAME = "default-model"
API_KEY = "test-key"
CONTEXT = 1024  # the default model's max_position_embeddings, the server's default --max-len
BOS_ID = 0
EOS_ID = 1
READY_TIMEOUT = 120.0
# Flags every server of the run gets: scripts/test.sh runs the suite a second time with
# `--no-prefix-caching`, so every output is checked with and without the prefix cache.
EXTRA_SERVE_ARGS = shlex.split(os.environ.get("DEEPINFER_TEST_SERVE_ARGS", ""))
PREFIX_CACHING = "--no-prefix-caching" not in EXTRA_SERVE_ARGS
READY_RE = re.compile(r'deepinfer: serving "([^"]+)" on http://([^ ]+):(\d+) \(backend ([^)]+)\)')


def _need_binary() -> None:
    if not BIN.is_file():
        pytest.fail(
            f"{BIN} is missing: run `cargo build --release --workspace` first "
            "(scripts/test.sh does)",
            pytrace=False,
        )


# ---------------------------------------------------------------------------------------------
# Server processes


@dataclass
class Server:
    """One running `deepinfer serve`."""

    proc: subprocess.Popen
    name: str
    host: str
    port: int
    backend: str
    api_key: str | None
    stderr_lines: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        # max_retries=0 always: a retry must never hide a failure.
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=kw.pop("timeout", 120.0),
            **kw,
        )

    def stderr_text(self) -> str:
        return "".join(self.stderr_lines[-200:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_server(
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    api_key: str | None = API_KEY,
) -> Server:
    """Starts `deepinfer serve --port 0 ...` and waits for its ready line on stderr."""
    _need_binary()
    args = [str(BIN), "serve", "--host", "127.0.0.1", "--port", "0"]
    if api_key is not None:
        args += ["--api-key", api_key]
    args += EXTRA_SERVE_ARGS + list(extra_args)
    full_env = dict(os.environ)
    full_env.pop("DEEPINFER_API_KEY", None)
    full_env.pop("NEURON_RT_LIB", None)
    full_env.pop("NRT_SIM_FAIL_EXECUTE", None)
    if env:
        full_env.update(env)
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    lines: list[str] = []
    ready: queue.Queue = queue.Queue()

    def drain() -> None:
        # Keeps reading for the whole life of the process so the pipe never fills.
        for line in proc.stderr:
            lines.append(line)
            m = READY_RE.search(line)
            if m:
                ready.put(m)
        ready.put(None)

    threading.Thread(target=drain, daemon=True).start()
    try:
        m = ready.get(timeout=READY_TIMEOUT)
    except queue.Empty:
        m = None
        proc.kill()
        proc.wait()
        pytest.fail(
            f"`{' '.join(args)}` printed no ready line within {READY_TIMEOUT:.0f} s; "
            f"stderr:\n{''.join(lines)}",
            pytrace=False,
        )
    if m is None:
        proc.wait(timeout=10)
        pytest.fail(
            f"`{' '.join(args)}` exited ({proc.returncode}) before it was ready; "
            f"stderr:\n{''.join(lines)}",
            pytrace=False,
        )
    return Server(
        proc=proc,
        name=m.group(1),
        host=m.group(2),
        port=int(m.group(3)),
        backend=m.group(4),
        api_key=api_key,
        stderr_lines=lines,
    )


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture
def server_factory():
    """Starts extra servers for one test; every one is stopped at teardown."""
    started: list[Server] = []

    def make(*args: str, env: Mapping[str, str] | None = None, api_key: str | None = API_KEY):
        srv = start_server(*args, env=env, api_key=api_key)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def http(server):
    """A raw httpx client on the server (no auth header by default)."""
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c


AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ---------------------------------------------------------------------------------------------
# References


@functools.lru_cache(maxsize=None)
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="session")
def tok():
    return _tokenizer()


def completion_prompt_tokens(prompt: str) -> list[int]:
    """The prompt as the server must encode it for /v1/completions: bos prepended."""
    ids = list(_tokenizer()(prompt).input_ids)
    assert ids[0] == BOS_ID, f"the reference tokenizer did not prepend bos: {ids[:4]}"
    assert ids[1:2] != [BOS_ID]
    return ids


def chat_prompt_tokens(messages: list[dict]) -> list[int]:
    """The chat prompt as rendered by the model's template with the generation prompt."""
    out = _tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (return_dict=True by default), 4.x a list.
    ids = list(out["input_ids"]) if isinstance(out, Mapping) or hasattr(out, "keys") else list(out)
    assert ids and isinstance(ids[0], int), f"unexpected apply_chat_template result: {out!r}"
    assert ids[0] == BOS_ID and ids[1] != BOS_ID, f"the template must emit bos once: {ids[:4]}"
    return ids


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.token_ids and self.token_ids[-1] == EOS_ID else "length"


@functools.lru_cache(maxsize=None)
def cli_generate(
    prompt: str,
    max_tokens: int,
    chat: bool = False,
    temperature: float | None = None,
    seed: int | None = None,
    backend: str | None = None,
) -> Generation:
    """The single-sequence CLI path: `deepinfer generate --prompt P --max-tokens N --json`."""
    _need_binary()
    args = [str(BIN), "generate", f"--prompt={prompt}", "--max-tokens", str(max_tokens), "--json"]
    if chat:
        args.append("--chat")
    if temperature is not None:
        args += ["--temperature", str(temperature)]
    if seed is not None:
        args += ["--seed", str(seed)]
    if backend is not None:
        args += ["--backend", backend]
    env = dict(os.environ)
    env.pop("NRT_SIM_FAIL_EXECUTE", None)
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"`{' '.join(args)}` failed: {out.stderr}"
    d = json.loads(out.stdout)
    return Generation(text=d["text"], token_ids=tuple(d["token_ids"]))


@pytest.fixture(scope="session")
def reference():
    return cli_generate


# ---------------------------------------------------------------------------------------------
# /metrics

_SAMPLE_RE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)(?:\s+\S+)?\s*$"
)
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Metrics:
    """Samples of one /metrics scrape, keyed by (name, frozenset of label pairs)."""

    def __init__(self, text: str):
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE_RE.match(line)
            if not m:
                continue
            labels = frozenset(_LABEL_RE.findall(m.group(2) or ""))
            self.samples[(m.group(1), labels)] = float(m.group(3))

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def get(self, name: str, default: float | None = 0.0, **labels: str) -> float:
        """A sample's value; a labelled counter never incremented is absent, so `default`."""
        v = self.samples.get((name, frozenset(labels.items())))
        if v is None:
            if default is None:
                raise AssertionError(f"no sample {name}{labels or ''} in /metrics:\n{self.text}")
            return default
        return v

    def outcome(self, outcome: str) -> float:
        return self.get("deepinfer_requests_total", outcome=outcome)


def scrape(base_url: str) -> Metrics:
    r = httpx.get(f"{base_url}/metrics", timeout=30.0)
    assert r.status_code == 200, f"/metrics -> {r.status_code}: {r.text}"
    return Metrics(r.text)


@pytest.fixture(scope="session")
def metrics(server):
    return lambda: scrape(server.base_url)


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """Polls `predicate` until it returns a truthy value; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# Raw SSE


def sse_events(lines):
    """Yields the `data:` payloads of an SSE stream of lines (strings), '[DONE]' included."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()
