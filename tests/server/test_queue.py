"""A full waiting queue answers 429 queue_full, and the server goes on serving."""

import threading

import httpx
import openai
import pytest

from conftest import AUTH, MODEL_NAME, Metrics, cli_generate, sse_events, wait_until


def test_queue_full_is_429(server_factory):
    srv = server_factory("--max-batch", "1", "--max-waiting", "1")
    client = srv.client()

    def m():
        return Metrics(httpx.get(f"{srv.base_url}/metrics", timeout=30).text)

    long = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    release = threading.Event()

    def second():
        # Its response headers may come only once it is scheduled, so it runs in a thread.
        with httpx.Client(base_url=srv.base_url, timeout=60) as c2:
            with c2.stream("POST", "/v1/completions", json=long, headers=AUTH):
                release.wait(30)

    t2 = threading.Thread(target=second, daemon=True)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c1:
        with c1.stream("POST", "/v1/completions", json=long, headers=AUTH) as r1:
            assert r1.status_code == 200
            # Kept referenced: a dropped line iterator would close the response.
            events1 = sse_events(r1.iter_lines())
            next(events1)  # running: the only batch slot
            t2.start()
            try:
                seen = []

                def one_waiting():
                    x = m()
                    seen.append((x.get("deepinfer_num_requests_running", default=None),
                                 x.get("deepinfer_num_requests_waiting", default=None)))
                    return seen[-1] == (1, 1)

                waiting = wait_until(one_waiting, 5)
                assert waiting, f"(running, waiting) seen: {seen}"
                with pytest.raises(openai.RateLimitError) as e:
                    client.completions.create(model=MODEL_NAME, prompt="HAMLET:", max_tokens=4,
                                              temperature=0)
                assert e.value.status_code == 429
                assert e.value.type == "rate_limit_error"
                assert e.value.code == "queue_full"
                # When to come back: the openai clients honour Retry-After.
                assert e.value.response.headers.get("retry-after") == "1"
                assert m().get("deepinfer_num_requests_running", default=None) == 1
            finally:
                release.set()
    t2.join(30)
    # Both long streams were dropped: everything is freed and the server serves again.
    assert wait_until(
        lambda: (x := m()).get("deepinfer_num_requests_running", default=None) == 0
        and x.get("deepinfer_num_requests_waiting", default=None) == 0
        and x.get("deepinfer_kv_blocks_in_use", default=None) == 0, 10), m().text
    r = client.completions.create(model=MODEL_NAME, prompt="HAMLET:", max_tokens=4, temperature=0)
    assert r.choices[0].text == cli_generate("HAMLET:", 4).text



def test_an_idle_server_admits_max_batch_plus_max_waiting_at_once(server_factory):
    # 8 simultaneous requests, 4 batch slots free and 2 places to wait: exactly 6 are taken,
    # the other 2 get 429 with Retry-After (free slots used to count as waiting places).
    import concurrent.futures

    srv = server_factory("--max-batch", "4", "--max-waiting", "2", "--max-len", "256")
    client = srv.client()
    barrier = threading.Barrier(8)

    def one(i):
        barrier.wait()
        try:
            client.completions.create(model=MODEL_NAME, prompt=f"ROMEO {i}:", max_tokens=96,
                                      temperature=0, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after") == "1"
            return "429"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert results.count("ok") == 6 and results.count("429") == 2, results
