"""DeepSeek-V4 (hybrid compressed attention, hash-routed MoE, hyper-connections; its caches in
rings under each sequence's state row and compressed entries in paged roots) served end to end:
`fixtures/tiny-v4` (compress rates 4 and 8, window 8) against transformers'
`DeepseekV4ForCausalLM` outputs in `reference.json`: greedy continuations (whole, streamed, and
several at once in one batch), prompt log-probabilities of two prompts prefilled together and
in chunks that end off the compression blocks, and tool calls constrained by the sampler's
masks, each call's arguments valid against its function's schema (`jsonschema`)."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from conftest import REPO, start_server
from fixture_reference import FixtureReference
from test_tools import QUESTION, SCHEMAS, TOOLS

REF = FixtureReference(REPO / "fixtures", "tiny-v4")
NAME = REF.name
TEMPLATE = REPO / "fixtures" / "chat-templates" / "deepseek-v3-tools.jinja"


@pytest.fixture(scope="module")
def v4():
    srv = start_server("--model", str(REF.dir), "--served-model-name", NAME,
                       "--chat-template", str(TEMPLATE))
    yield srv.client()
    srv.stop()


@pytest.fixture(scope="module")
def chunked():
    """Prompts prefilled at most 11 tokens a step (fewer beside decoding rows): chunks that
    end off both rates' blocks and the window."""
    srv = start_server("--model", str(REF.dir), "--served-model-name", NAME, "--max-batch", "8",
                       "--prefill-chunk", "16", "--max-num-batched-tokens", "11")
    yield srv.client()
    srv.stop()


def test_greedy_continuation_matches_transformers_whole_and_streamed(v4):
    REF.check_greedy(v4)


def test_concurrent_requests_batch_to_the_same_tokens(v4):
    want = REF.expected_text()
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: REF.greedy(v4).choices[0].text, range(6)))
    assert texts == [want] * 6


@pytest.mark.parametrize("server", ["v4", "chunked"])
def test_prompt_logprobs_of_two_prompts_at_once_match_transformers(server, request):
    client = request.getfixturevalue(server)
    r = REF.ref
    prompts = [(r["token_ids"], r["logits"]), (r["token_ids_short"], r["logits_short"])]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: REF.check_prompt_logprobs(client, *p), prompts * 2))


def test_greedy_continuation_after_a_chunked_prefill(chunked):
    assert REF.greedy(chunked).choices[0].text == REF.expected_text()


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
