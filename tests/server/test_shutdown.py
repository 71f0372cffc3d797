"""SIGTERM drains: in-flight streams finish, then the process exits 0 and accepts nothing."""

import json
import signal
import subprocess
import time

import httpx
import pytest

from conftest import AUTH, MODEL_NAME, sse_events


def test_sigterm_lets_the_stream_finish_then_exits_zero(server_factory):
    srv = server_factory()
    max_tokens = 600  # about half a second of decoding: surely in flight at the SIGTERM
    body = {"model": MODEL_NAME, "prompt": "KING HENRY:", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    health_during = None
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
            first = json.loads(next(events))
            assert first["choices"][0]["finish_reason"] is None
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            # Draining: a new request is refused (503 or no connection), never served.
            try:
                h = httpx.get(f"{srv.base_url}/health", timeout=5)
                health_during = (h.status_code, h.json())
            except httpx.TransportError as e:
                health_during = type(e).__name__
            rest = list(events)
    assert rest, "the stream ended right after the SIGTERM"
    assert rest[-1] == "[DONE]", f"the stream did not end normally: {rest[-3:]}"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert not any("error" in ch for ch in chunks), [ch for ch in chunks if "error" in ch]
    finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    assert finishes[-1] == "length"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == max_tokens

    if isinstance(health_during, tuple):
        assert health_during == (503, {"status": "draining"}), health_during
    else:
        assert health_during in ("ConnectError",), health_during

    try:
        code = srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 30 s after SIGTERM; stderr:\n{srv.stderr_text()}")
    assert code == 0, f"exit code {code}; stderr:\n{srv.stderr_text()}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.base_url}/health", timeout=5)


def test_sigterm_while_idle_exits_zero_at_once(server_factory):
    srv = server_factory()
    assert httpx.get(f"{srv.base_url}/health", timeout=30).status_code == 200
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"idle server still running 10 s after SIGTERM; stderr:\n{srv.stderr_text()}")
    assert code == 0, srv.stderr_text()


def test_a_new_generation_request_while_draining_gets_503(server_factory):
    # The stream in flight must end normally during the drain: give it far more than the 800
    # tokens take (about 2 s idle) so a machine busy with other work cannot end it at the
    # default 30 s (a loaded CI rehearsal did once).
    srv = server_factory("--drain-timeout-secs", "300")
    body = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 800, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        # A second connection, opened before the SIGTERM, for the request made while draining.
        with httpx.Client(base_url=srv.base_url, timeout=30) as other:
            assert other.get("/health").status_code == 200
            with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
                events = sse_events(r.iter_lines())
                next(events)
                srv.proc.send_signal(signal.SIGTERM)
                time.sleep(0.1)
                try:
                    late = other.post("/v1/completions", headers=AUTH,
                                      json={**body, "stream": False, "max_tokens": 4})
                except httpx.TransportError as e:
                    late = e
                rest = list(events)
    assert rest[-1] == "[DONE]"
    if isinstance(late, httpx.Response):
        # Served on a kept-alive connection: it must be refused with the draining error.
        assert late.status_code == 503, late.text
        err = late.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "shutting_down", err
    assert srv.proc.wait(timeout=30) == 0
