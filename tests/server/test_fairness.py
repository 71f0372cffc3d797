"""No single request holds the engine (issue 15, class 4): a short request sent after a
request for more choices than there are batch slots, after queued long prompts, or after a
long scoring (echo + logprobs) request, finishes before them. Asserted on the order requests
finish, not on timings (the latency figures are the serve_load bench's)."""

import json
import threading
import time

import httpx

from conftest import AUTH, MODEL_NAME, sse_events

SHORT = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0,
         "ignore_eos": True}


def _post_in_thread(base_url, body, done, key):
    """POSTs `body` on a thread; records (status, monotonic finish time) under `key`."""

    def run():
        with httpx.Client(base_url=base_url, timeout=300) as c:
            r = c.post("/v1/completions", json=body, headers=AUTH)
            done[key] = (r.status_code, time.monotonic(), r.json())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_running(base_url, at_least, timeout=60):
    """Waits until the engine runs `at_least` sequences (so the big work is under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith("deepinfer_num_requests_running "):
                if float(line.split()[1]) >= at_least:
                    return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {at_least} sequences ever ran")


def _short(base_url):
    with httpx.Client(base_url=base_url, timeout=300) as c:
        r = c.post("/v1/completions", json=SHORT, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    return time.monotonic()


def test_a_short_request_overtakes_the_extra_choices_of_a_big_one(server_factory):
    srv = server_factory("--max-batch", "8")
    # 4 prompts x n = 16: 64 choices, the most one request may ask for, streamed so that the
    # time each choice finishes is seen.
    big = {"model": MODEL_NAME, "prompt": ["HAMLET:", "ROMEO:", "JULIET:", "KING LEAR:"],
           "n": 16, "max_tokens": 48, "temperature": 0.8, "seed": 1, "ignore_eos": True,
           "stream": True}
    finished = []

    def run_big():
        with httpx.Client(base_url=srv.base_url, timeout=300) as c:
            with c.stream("POST", "/v1/completions", json=big, headers=AUTH) as r:
                assert r.status_code == 200
                for data in sse_events(r.iter_lines()):
                    if data == "[DONE]":
                        break
                    for ch in json.loads(data)["choices"]:
                        if ch.get("finish_reason"):
                            finished.append(time.monotonic())

    t = threading.Thread(target=run_big, daemon=True)
    t.start()
    _wait_running(srv.base_url, 8)
    short_done = _short(srv.base_url)
    t.join(300)
    assert len(finished) == 64
    # The big request's choices run eight at a time. The short request takes one of the
    # first slots that free instead of waiting behind the other 56 choices: when it is done,
    # at most the first waves of choices are.
    before = sum(1 for f in finished if f < short_done)
    assert before <= 24, f"{before} of 64 choices finished before the short request"


def test_a_short_request_overtakes_queued_long_prompts(server_factory):
    srv = server_factory("--max-batch", "16", "--prefill-chunk", "16")
    done = {}
    long_prompt = "ROMEO:\n" + "O " * 880
    threads = [
        _post_in_thread(srv.base_url, {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 1,
                                       "temperature": 0}, done, i)
        for i in range(8)
    ]
    _wait_running(srv.base_url, 1)
    short_done = _short(srv.base_url)
    for t in threads:
        t.join(300)
    finished = sorted(v[1] for v in done.values())
    assert len(finished) == 8 and all(v[0] == 200 for v in done.values()), done
    # Prefill alternates shortest-first and oldest-first: the short prompt is in within two
    # steps, while the long ones take 56 chunks of 16 each, one at a time.
    after = sum(1 for f in finished if f > short_done)
    assert after >= 6, f"only {after} of 8 long prompts finished after the short request"


def test_a_short_request_overtakes_a_long_scoring_request(server_factory):
    srv = server_factory("--prefill-chunk", "16")
    done = {}
    scoring = {"model": MODEL_NAME, "prompt": "ROMEO:\n" + "O " * 900, "max_tokens": 1,
               "echo": True, "logprobs": 5, "temperature": 0}
    t = _post_in_thread(srv.base_url, scoring, done, "scoring")
    _wait_running(srv.base_url, 1)
    short_done = _short(srv.base_url)
    t.join(300)
    status, scoring_done, body = done["scoring"]
    assert status == 200, body
    assert len(body["choices"][0]["logprobs"]["tokens"]) > 900
    assert short_done < scoring_done, "the short request waited for the whole scoring prefill"
