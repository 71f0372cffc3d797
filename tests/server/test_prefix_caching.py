"""Automatic prefix caching seen from outside: requests sharing a long prompt prefix get the
same text as the single-sequence CLI path (which never caches) while `/metrics` shows the
shared tokens served from the cache; with `--no-prefix-caching` nothing is looked up. (The
whole suite also runs a second time with `--no-prefix-caching`, see scripts/test.sh.)"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MODEL_NAME, PREFIX_CACHING, cli_generate, completion_prompt_tokens, scrape

SYSTEM = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and "
          "Juliet is the sun. Arise, fair sun, and kill the envious moon, who is already sick "
          "and pale with grief that thou her maid art far more fair than she.\n")
QUESTIONS = ["JULIET:\nAy me!", "ROMEO:\nShe speaks.", "NURSE:\nMadam!", "JULIET:\nRomeo,"]
N = 8


def cached_tokens(base_url):
    m = scrape(base_url)
    return (m.get("deepinfer_prefix_cache_queries_total"),
            m.get("deepinfer_prefix_cache_hits_total"))


@pytest.mark.skipif(not PREFIX_CACHING, reason="this run has prefix caching off")
def test_a_shared_prefix_is_served_from_the_cache_with_the_same_text(server, client):
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = [cli_generate(p, N).text for p in prompts]
    shared = len(completion_prompt_tokens(SYSTEM)) // 16 * 16  # whole 16-token blocks
    assert shared >= 32
    # One request first, so the prefix is cached; then the rest at once.
    first = client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=N,
                                      temperature=0)
    assert first.choices[0].text == want[0]
    queries, hits = cached_tokens(server.base_url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(
            lambda p: client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=N,
                                                temperature=0).choices[0].text, prompts))
    assert got == want
    queries2, hits2 = cached_tokens(server.base_url)
    prompt_tokens = sum(len(completion_prompt_tokens(p)) for p in prompts)
    assert queries2 - queries == prompt_tokens
    # Every one reused at least the system prompt's whole blocks (the first one its own
    # prompt's, all but the block with its last token).
    assert hits2 - hits >= len(prompts) * (shared - 16)


def test_without_prefix_caching_nothing_is_looked_up(server_factory):
    # The suite's second run already passes the flag to every server (and clap refuses it twice).
    srv = server_factory(*(["--no-prefix-caching"] if PREFIX_CACHING else []))
    client = srv.client()
    prompt = SYSTEM + QUESTIONS[0]
    want = cli_generate(prompt, N).text
    for _ in range(2):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=N,
                                      temperature=0)
        assert r.choices[0].text == want
    assert cached_tokens(srv.base_url) == (0, 0)
