"""DeepSeek-V3.2 (sparse attention, two cache roots) served end to end: `fixtures/tiny-v32`,
whose `index_topk` is smaller than its reference sequences, against transformers'
`DeepseekV32ForCausalLM` outputs in `reference.json`: greedy continuations (whole, streamed,
and several at once in one batch) and the prompt's log-probabilities."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, start_server
from fixture_reference import FixtureReference

REF = FixtureReference(REPO / "fixtures", "tiny-v32")


@pytest.fixture(scope="module")
def v32():
    srv = start_server("--model", str(REF.dir), "--served-model-name", REF.name)
    yield srv.client()
    srv.stop()


def test_greedy_continuation_matches_transformers_whole_and_streamed(v32):
    REF.check_greedy(v32)


def test_concurrent_requests_batch_to_the_same_tokens(v32):
    want = REF.expected_text()
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: REF.greedy(v32).choices[0].text, range(6)))
    assert texts == [want] * 6


def test_prompt_logprobs_match_transformers(v32):
    REF.check_prompt_logprobs(v32, REF.ref["token_ids"], REF.ref["logits"])
