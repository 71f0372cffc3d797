"""A client that disconnects mid-stream is cancelled at once and its KV blocks return."""

import json

import httpx

from conftest import AUTH, MODEL_NAME, cli_generate, sse_events, wait_until


def test_disconnect_mid_stream_frees_the_blocks(server, metrics):
    wait_until(lambda: metrics().get("deepinfer_num_requests_running", default=None) == 0, 10)
    before = metrics()
    assert before.get("deepinfer_kv_blocks_in_use", default=None) == 0
    assert before.get("deepinfer_num_requests_running", default=None) == 0

    # Long enough (about a second of decoding) that it is surely still running when we close.
    body = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    texts = []
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
            for _ in range(3):
                texts.append(json.loads(next(events))["choices"][0]["text"])
            during = metrics()
            # The response is closed here, mid-stream, and so is the connection.
    assert during.get("deepinfer_num_requests_running", default=None) == 1, during.text
    assert during.get("deepinfer_kv_blocks_in_use", default=None) > 0, during.text

    def freed():
        m = metrics()
        return (m.get("deepinfer_kv_blocks_in_use", default=None) == 0
                and m.get("deepinfer_num_requests_running", default=None) == 0
                and m.outcome("cancelled") == before.outcome("cancelled") + 1)

    assert wait_until(freed, timeout=10), f"not freed after 10 s:\n{metrics().text}"
    after = metrics()
    assert after.outcome("cancelled") == before.outcome("cancelled") + 1
    # It did not run to the end: far fewer than 1000 tokens were generated.
    generated = after.get("deepinfer_generation_tokens_total") - before.get(
        "deepinfer_generation_tokens_total")
    assert 3 <= generated < 1000, generated
    assert after.outcome("length") == before.outcome("length")
    # What it streamed before the disconnect was the greedy continuation.
    assert cli_generate("ROMEO:", 16).text.startswith("".join(texts))


def test_the_server_serves_after_a_disconnect(client):
    r = client.completions.create(model=MODEL_NAME, prompt="HAMLET:", max_tokens=8, temperature=0)
    assert r.choices[0].text == cli_generate("HAMLET:", 8).text
