"""/health, /v1/models, /metrics and the API key on the session server."""

import re
import threading

import httpx
import pytest

from conftest import API_KEY, AUTH, CONTEXT, MODEL_NAME


def test_ready_line_names_the_default_model_and_the_cpu_backend(server):
    assert server.name == MODEL_NAME
    assert server.backend == "cpu"
    assert server.port > 0


def test_health_is_ok_without_a_key(http):
    r = http.get("/health")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok"}


def test_models_lists_the_served_model(client, http):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL_NAME]
    r = http.get("/v1/models", headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    m = body["data"][0]
    assert m["id"] == MODEL_NAME
    assert m["object"] == "model"
    assert m["owned_by"] == "deepinfer"
    assert m["max_model_len"] == CONTEXT
    assert isinstance(m["created"], int) and m["created"] > 1_600_000_000


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}],
    ids=["missing", "wrong", "no-bearer-scheme"],
)
def test_models_needs_the_key(http, headers):
    r = http.get("/v1/models", headers=headers)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_api_key"


def test_metrics_needs_no_key_and_names_every_family(server):
    r = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    text = r.text
    for name in [
        "deepinfer_prompt_tokens_total",
        "deepinfer_generation_tokens_total",
        "deepinfer_time_to_first_token_seconds",
        "deepinfer_time_per_output_token_seconds",
        "deepinfer_num_requests_running",
        "deepinfer_num_requests_waiting",
        "deepinfer_kv_blocks_in_use",
        "deepinfer_kv_blocks_total",
        "deepinfer_requests",
    ]:
        assert name in text, f"{name} missing from /metrics:\n{text}"


def test_metrics_kv_blocks_total_is_positive(metrics):
    m = metrics()
    assert m.get("deepinfer_kv_blocks_total", default=None) > 0
    assert m.get("deepinfer_kv_blocks_in_use", default=None) >= 0


def test_stats_lines_while_busy(server_factory):
    srv = server_factory("--log-stats-secs", "1")
    client = srv.client(timeout=120)

    def long():
        client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=1000,
                                  temperature=0, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=long) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [l for l in srv.stderr_text().splitlines() if "generation" in l]
    assert lines, srv.stderr_text()
    m = re.search(r"generation ([0-9.]+) tok/s, running (\d+), waiting (\d+), KV cache", lines[0])
    assert m, lines[0]
    assert float(m.group(1)) > 0 and int(m.group(2)) >= 1
