"""The server over a model split across NeuronCores (`--tp 2` on nrt-sim): the same completions
as the unsplit model on the CPU, and a fault on one rank fails only the request in that step."""

import httpx
import openai
import pytest

from conftest import MODEL_NAME, SIM_LIB, cli_generate

PROMPT_A = "ROMEO:"
PROMPT_B = "JULIET:"


def _need_sim():
    if not SIM_LIB.is_file():
        pytest.fail(f"{SIM_LIB} is missing: run `cargo build --release --workspace`",
                    pytrace=False)


@pytest.mark.parametrize("tp", ["2", "4"])
def test_a_split_model_serves_what_the_unsplit_model_generates(server_factory, tp):
    _need_sim()
    srv = server_factory("--backend", "sim", "--tp", tp, "--max-batch", "2", "--max-len", "128",
                         env={"NRT_SIM_NC_COUNT": "4"})
    assert srv.backend != "cpu", srv.backend
    client = srv.client()
    ref = cli_generate(PROMPT_A, 8, backend="cpu")
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT_A, max_tokens=8, temperature=0)
    assert a.choices[0].text == ref.text
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        temperature=0, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == cli_generate("Hello", 6, chat=True, backend="cpu").text


def test_a_fault_on_one_rank_fails_only_the_request_in_that_step(server_factory):
    _need_sim()
    ref = cli_generate(PROMPT_A, 3, backend="cpu")
    assert len(ref.token_ids) == 3 and ref.finish_reason == "length"
    # nrt-sim counts executions over the process, and at --tp 2 a step is two (one per rank):
    # A's three steps are executions 1-6, and execution 7 is one rank's share of B's prefill.
    srv = server_factory("--backend", "sim", "--tp", "2", "--max-batch", "2", "--max-len", "128",
                         env={"NRT_SIM_FAIL_EXECUTE": "7"})
    client = srv.client()
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT_A, max_tokens=3, temperature=0)
    assert a.choices[0].text == ref.text
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT_B, max_tokens=3, temperature=0)
    assert e.value.status_code == 500
    assert e.value.code == "device_error"
    # The next step, on both ranks, works.
    assert httpx.get(f"{srv.base_url}/health", timeout=30).status_code == 200
    c = client.completions.create(model=MODEL_NAME, prompt=PROMPT_A, max_tokens=3, temperature=0)
    assert c.choices[0].text == a.choices[0].text
