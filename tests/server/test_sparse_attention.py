"""DeepSeek-V3.2 (sparse attention, two cache roots) served end to end: `fixtures/tiny-v32`,
whose `index_topk` is smaller than its reference sequences, against transformers'
`DeepseekV32ForCausalLM` outputs in `reference.json`: greedy continuations (whole, streamed,
and several at once in one batch) and the prompt's log-probabilities."""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from conftest import REPO, start_server

FIXTURE = REPO / "fixtures" / "tiny-v32"
NAME = "tiny-v32"


@pytest.fixture(scope="module")
def v32():
    srv = start_server("--model", str(FIXTURE), "--served-model-name", NAME)
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


def test_greedy_continuation_matches_transformers_whole_and_streamed(v32, ref):
    want = expected_text(ref)
    r = greedy(v32, ref)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == len(ref["greedy"]["generated_token_ids"])
    streamed = "".join(c.choices[0].text for c in greedy(v32, ref, stream=True) if c.choices)
    assert streamed == want


def test_concurrent_requests_batch_to_the_same_tokens(v32, ref):
    want = expected_text(ref)
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: greedy(v32, ref).choices[0].text, range(6)))
    assert texts == [want] * 6


def test_prompt_logprobs_match_transformers(v32, ref):
    ids, logits = ref["token_ids"], ref["logits"]
    r = v32.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    for j in range(1, len(ids)):
        row = logits[j - 1]
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        assert abs(lp.token_logprobs[j] - (row[ids[j]] - lse)) < 1e-4, j
