"""DeepSeek-V4 (hybrid compressed attention, hash-routed MoE, hyper-connections; its caches in
rings under each sequence's state row and compressed entries in paged roots) served end to end:
`fixtures/tiny-v4` (compress rates 4 and 8, window 8) against transformers'
`DeepseekV4ForCausalLM` outputs in `reference.json`: greedy continuations (whole, streamed, and
several at once in one batch), prompt log-probabilities of two prompts prefilled together and
in chunks that end off the compression blocks, and tool calls constrained by the sampler's
masks, each call's arguments valid against its function's schema (`jsonschema`)."""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from tokenizers import Tokenizer

from conftest import REPO, start_server
from test_tools import QUESTION, SCHEMAS, TOOLS

FIXTURE = REPO / "fixtures" / "tiny-v4"
NAME = "tiny-v4"
TEMPLATE = REPO / "fixtures" / "chat-templates" / "deepseek-v3-tools.jinja"


@pytest.fixture(scope="module")
def v4():
    srv = start_server("--model", str(FIXTURE), "--served-model-name", NAME,
                       "--chat-template", str(TEMPLATE))
    yield srv.client()
    srv.stop()


@pytest.fixture(scope="module")
def chunked():
    """Prompts prefilled at most 11 tokens a step (fewer beside decoding rows): chunks that
    end off both rates' blocks and the window."""
    srv = start_server("--model", str(FIXTURE), "--served-model-name", NAME, "--max-batch", "8",
                       "--prefill-chunk", "16", "--max-num-batched-tokens", "11")
    yield srv.client()
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURE / "reference.json").read_text())


def expected_text(ref):
    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    return tok.decode(ref["greedy"]["generated_token_ids"], skip_special_tokens=True)


def greedy(client, ref, **kw):
    g = ref["greedy"]
    return client.completions.create(
        model=NAME, prompt=g["prompt_token_ids"], max_tokens=len(g["generated_token_ids"]),
        temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_greedy_continuation_matches_transformers_whole_and_streamed(v4, ref):
    want = expected_text(ref)
    r = greedy(v4, ref)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == len(ref["greedy"]["generated_token_ids"])
    streamed = "".join(c.choices[0].text for c in greedy(v4, ref, stream=True) if c.choices)
    assert streamed == want


def test_concurrent_requests_batch_to_the_same_tokens(v4, ref):
    want = expected_text(ref)
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: greedy(v4, ref).choices[0].text, range(6)))
    assert texts == [want] * 6


def check_prompt_logprobs(client, ids, logits):
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    for j in range(1, len(ids)):
        row = logits[j - 1]
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        assert abs(lp.token_logprobs[j] - (row[ids[j]] - lse)) < 1e-4, j


@pytest.mark.parametrize("server", ["v4", "chunked"])
def test_prompt_logprobs_of_two_prompts_at_once_match_transformers(server, ref, request):
    client = request.getfixturevalue(server)
    prompts = [(ref["token_ids"], ref["logits"]), (ref["token_ids_short"], ref["logits_short"])]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: check_prompt_logprobs(client, *p), prompts * 2))


def test_greedy_continuation_after_a_chunked_prefill(chunked, ref):
    assert greedy(chunked, ref).choices[0].text == expected_text(ref)


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_calls_validate(v4, seed):
    r = v4.chat.completions.create(
        model=NAME, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=300,
        temperature=0.8, seed=seed)
    calls = r.choices[0].message.tool_calls
    assert calls
    for call in calls:
        if r.choices[0].finish_reason == "length" and call is calls[-1]:
            continue  # cut by max_tokens: returned partial (see test_tools)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_streamed_rebuilds_the_call(v4):
    kw = dict(model=NAME, messages=QUESTION, tools=TOOLS, max_tokens=300, temperature=0.8,
              seed=5, tool_choice={"type": "function", "function": {"name": "add"}})
    whole = v4.chat.completions.create(**kw).choices[0].message.tool_calls
    args, names = "", set()
    for chunk in v4.chat.completions.create(stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            args += d.function.arguments or ""
            names.add(d.function.name) if d.function.name else None
    assert [c.function.name for c in whole] == ["add"] and names == {"add"}
    assert args == whole[0].function.arguments
    jsonschema.validate(json.loads(args), SCHEMAS["add"])
