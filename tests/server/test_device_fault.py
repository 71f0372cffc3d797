"""A device fault injected through nrt-sim fails only the request in that step."""

import json

import httpx
import openai
import pytest

from conftest import AUTH, MODEL_NAME, SIM_LIB, Metrics, cli_generate, sse_events, wait_until

PROMPT_A = "ROMEO:"
PROMPT_B = "JULIET:"


def test_a_failed_execution_fails_only_the_request_in_that_step(server_factory):
    if not SIM_LIB.is_file():
        pytest.fail(f"{SIM_LIB} is missing: run `cargo build --release --workspace`",
                    pytrace=False)
    ref = cli_generate(PROMPT_A, 3)
    # A alone is exactly 3 executions: one prefill, two decodes (no early eos).
    assert len(ref.token_ids) == 3 and ref.finish_reason == "length"

    srv = server_factory("--backend", "sim", "--max-batch", "2", "--max-len", "128",
                         env={"NRT_SIM_FAIL_EXECUTE": "4"})
    # The ready line names the runner: the device runner over nrt-sim, not the CPU one.
    assert srv.backend != "cpu", srv.backend
    client = srv.client()

    # A: executions 1-3.
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT_A, max_tokens=3, temperature=0)
    assert a.choices[0].text == ref.text
    assert a.usage.completion_tokens == 3
    assert a.choices[0].finish_reason == "length"

    # B: its prefill is execution 4, which fails.
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT_B, max_tokens=3, temperature=0)
    assert e.value.status_code == 500
    assert e.value.code == "device_error"
    assert e.value.type == "server_error"
    body = e.value.response.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str)

    # The server goes on: C, identical to A, gets A's text.
    assert httpx.get(f"{srv.base_url}/health", timeout=30).status_code == 200
    c = client.completions.create(model=MODEL_NAME, prompt=PROMPT_A, max_tokens=3, temperature=0)
    assert c.choices[0].text == a.choices[0].text
    assert c.usage.completion_tokens == 3
    # ... and a chat request too, streamed.
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == cli_generate("Hello", 5, chat=True).text

    def settled():
        m = Metrics(httpx.get(f"{srv.base_url}/metrics", timeout=30).text)
        ok = (m.get("deepinfer_num_requests_running", default=None) == 0
              and m.get("deepinfer_kv_blocks_in_use", default=None) == 0)
        return m if ok else None

    m = wait_until(settled, timeout=5)
    assert m is not None, "requests still running or blocks still in use after the fault"
    assert m.outcome("error") == 1
    assert m.outcome("length") == 3
    assert m.outcome("cancelled") == 0
    r = httpx.get(f"{srv.base_url}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_a_fault_mid_stream_ends_the_stream_with_an_error_event(server_factory):
    if not SIM_LIB.is_file():
        pytest.fail(f"{SIM_LIB} is missing: run `cargo build --release --workspace`",
                    pytrace=False)
    # Executions: 1 prefill (token 1), 2 decode (token 2), 3 decode fails.
    srv = server_factory("--backend", "sim", "--max-batch", "2", "--max-len", "128",
                         env={"NRT_SIM_FAIL_EXECUTE": "3"})
    ref = cli_generate(PROMPT_A, 8)
    body = {"model": MODEL_NAME, "prompt": PROMPT_A, "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            events = list(sse_events(r.iter_lines()))
    assert "[DONE]" not in events, events
    last = json.loads(events[-1])
    assert set(last) == {"error"}, last
    assert last["error"]["code"] == "device_error", last
    assert last["error"]["type"] == "server_error", last
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch.get("choices"))
    assert ref.text.startswith(text), (text, ref.text)
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks if ch.get("choices"))

    # The server goes on.
    client = srv.client()
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT_A, max_tokens=3, temperature=0)
    assert a.choices[0].text == cli_generate(PROMPT_A, 3).text
    m = wait_until(lambda: (x := Metrics(httpx.get(f"{srv.base_url}/metrics", timeout=30).text))
                   .get("deepinfer_kv_blocks_in_use", default=None) == 0 and x, 5)
    assert m, "blocks still in use after the failed stream"
    assert m.outcome("error") == 1
    assert m.get("deepinfer_num_requests_running", default=None) == 0
