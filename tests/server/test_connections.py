"""Hostile connections: timeouts, the connection limit, and a shutdown that always ends.

Raw sockets play the clients no library would be: headers that never end, a body shorter than
its Content-Length, a stream nobody reads. Every bound asserted here is generous (the machine
may be loaded): the server's timeouts are 1-2 s, the assertions allow 10-15 s.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from conftest import AUTH, MODEL_NAME, API_KEY, scrape, sse_events, wait_until

PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def connect(srv, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        # Before connect, so the window the server sees is small from the start.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((srv.host, srv.port))
    return s


def closed_within(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` within `timeout` (whatever it sent before the close)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        s.settimeout(left)
        try:
            if not s.recv(65536):
                return True
        except socket.timeout:
            return False
        except OSError:  # reset
            return True


def read_response(s: socket.socket, timeout: float):
    """One HTTP/1.1 response with a Content-Length body: (status, headers, body), or None if the
    server closed without one or said nothing within `timeout`."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _expected_len(data):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except (socket.timeout, OSError):
            return None
        if not chunk:
            break
        data += chunk
    if b"\r\n\r\n" not in data:
        return None
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body


def _expected_len(data: bytes) -> int:
    if b"\r\n\r\n" not in data:
        return 1 << 62
    head, _ = data.split(b"\r\n\r\n", 1)
    for line in head.decode("latin-1").split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            return len(head) + 4 + int(v)
    return len(data)


def error_of(resp, status: int) -> dict:
    assert resp is not None, f"no response (expected {status})"
    got, headers, body = resp
    assert got == status, (got, headers, body[:500])
    assert headers.get("content-type", "").startswith("application/json"), headers
    return json.loads(body)["error"]


def health(srv) -> int:
    return httpx.get(f"{srv.base_url}/health", timeout=30).status_code


# ---------------------------------------------------------------------------------------------
# Timeouts


def test_partial_headers_are_closed_after_the_header_timeout(server_factory):
    srv = server_factory("--header-timeout-secs", "1")
    slow = connect(srv)
    slow.sendall(PARTIAL_HEAD)
    # Others are served meanwhile.
    assert health(srv) == 200
    assert closed_within(slow, 10), "a connection with partial headers was still open after 10 s"
    assert health(srv) == 200


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(server_factory):
    srv = server_factory("--idle-timeout-secs", "1")
    s = connect(srv)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, _ = read_response(s, 30)
    assert status == 200 and headers.get("connection", "").lower() != "close", headers
    assert closed_within(s, 10), "an idle keep-alive connection was still open after 10 s"


def test_a_stalled_body_gets_a_408(server_factory):
    srv = server_factory("--body-timeout-secs", "1")
    s = connect(srv)
    s.sendall(PARTIAL_HEAD + f"Authorization: Bearer {API_KEY}\r\n".encode()
              + b"Content-Length: 100\r\n\r\n" + b'{"model": ')
    e = error_of(read_response(s, 10), 408)
    assert e["type"] == "invalid_request_error" and e["code"] == "request_timeout", e
    assert closed_within(s, 10)
    # Only the wait for the body counts: a stream longer than the timeout (1000 tokens take
    # seconds on the CPU backend) runs to its end.
    body = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]", events[-3:]


def test_a_huge_declared_body_is_refused_at_once(server):
    s = connect(server)
    s.sendall(PARTIAL_HEAD + f"Authorization: Bearer {API_KEY}\r\n".encode()
              + b"Content-Length: 10000000000\r\n\r\n" + b'{"model": ')
    # At once: not after the body timeout (30 s by default), nor never.
    e = error_of(read_response(s, 5), 413)
    assert e["type"] == "invalid_request_error" and e["code"] == "request_too_large", e
    s.close()


# ---------------------------------------------------------------------------------------------
# The connection limit


def test_beyond_max_connections_a_connection_gets_503_until_one_closes(server_factory):
    srv = server_factory("--max-connections", "4", "--header-timeout-secs", "3")
    holders = [connect(srv) for _ in range(4)]
    for h in holders:
        h.sendall(PARTIAL_HEAD)
    fifth = connect(srv)
    fifth.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got = read_response(fifth, 10)
    e = error_of(got, 503)
    assert e["type"] == "server_error" and e["code"] == "too_many_connections", e
    assert got[1].get("retry-after") == "1", got[1]
    # 64 refusals may wait for their headers at once; beyond them, the 503 is written at once.
    waiting = [connect(srv) for _ in range(64)]
    for w in waiting:
        w.sendall(b"GET /health HTTP/1.1\r\n")
    last = connect(srv)
    last.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got = read_response(last, 10)
    e = error_of(got, 503)
    assert e["code"] == "too_many_connections" and got[1].get("retry-after") == "1", got
    # They all time out (3 s), and then everyone is served again.
    for h in holders + waiting:
        assert closed_within(h, 10), "a connection holding partial headers was not closed"
    assert wait_until(lambda: health(srv) == 200, 10)


# ---------------------------------------------------------------------------------------------
# Shutdown


def _stuck_partial_headers(srv):
    s = connect(srv)
    s.sendall(PARTIAL_HEAD)
    time.sleep(0.5)  # the server has read them (hyper closes a connection that sent nothing)
    return s


def _stuck_partial_body(srv):
    s = connect(srv)
    s.sendall(PARTIAL_HEAD + f"Authorization: Bearer {API_KEY}\r\n".encode()
              + b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
    time.sleep(0.5)
    return s


# Every SSE chunk names the model: with a 16 kB name, a stream of four choices writes
# megabytes a second, far more than the socket buffers hold (4 MB by default on Linux), so the
# server soon blocks writing to a client that reads nothing.
LONG_NAME = "m" * 16384


def _stuck_unread_stream(srv):
    body = json.dumps({"model": LONG_NAME, "prompt": "ROMEO:", "max_tokens": 1000, "n": 4,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    s = connect(srv, rcvbuf=4096)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
              .encode())
    assert wait_until(lambda: scrape(srv.base_url).get(
        "deepinfer_num_requests_running", default=None), 30), "the stream never started"
    time.sleep(2.0)  # let its output back up
    return s


@pytest.mark.parametrize("stuck", [_stuck_partial_headers, _stuck_partial_body,
                                   _stuck_unread_stream],
                         ids=["partial-headers", "partial-body", "unread-stream"])
def test_sigterm_exits_by_the_drain_deadline_whatever_a_connection_does(server_factory, stuck):
    srv = server_factory("--drain-timeout-secs", "2", "--served-model-name", LONG_NAME)
    s = stuck(srv)
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 15 s after SIGTERM (drain timeout 2 s); stderr:\n"
                    f"{srv.stderr_text()}")
    assert code == 0, srv.stderr_text()
    s.close()


def test_a_request_cut_by_shutdown_is_a_503_shutting_down(server_factory):
    # No drain at all: the requests in flight are ended at the SIGTERM.
    srv = server_factory("--drain-timeout-secs", "0")
    body = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    whole: list = []

    def post_whole():
        try:
            whole.append(httpx.post(f"{srv.base_url}/v1/completions", headers=AUTH,
                                    json={**body, "n": 4}, timeout=60))
        except httpx.TransportError as e:
            whole.append(e)

    t = threading.Thread(target=post_whole)
    t.start()
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True},
                      headers=AUTH) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
            next(events)
            # The whole request's four choices and the stream are all in the engine.
            assert wait_until(lambda: scrape(srv.base_url).get(
                "deepinfer_num_requests_running", default=0) >= 5, 30)
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(events)
    t.join(30)
    assert rest, "the stream ended without an error event"
    err = json.loads(rest[-1])["error"]
    assert (err["type"], err["code"]) == ("server_error", "shutting_down"), err
    resp = whole[0]
    assert isinstance(resp, httpx.Response), resp
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "shutting_down"), err
    assert srv.proc.wait(timeout=15) == 0, srv.stderr_text()
