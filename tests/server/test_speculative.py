"""Speculative decoding seen from outside: a server started with `--speculative-tokens 2` on
the default model (which ships a trained MTP layer) answers greedy requests, batched and with
several choices, with exactly the text of the single-sequence CLI path without speculation,
verifies the drafts of sampled requests too, and counts its drafts in `/metrics`."""

from concurrent.futures import ThreadPoolExecutor

from conftest import MODEL_NAME, cli_generate, scrape

PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\nO Romeo, Romeo!", "HAMLET:\nTo be,",
           "KING LEAR:\nBlow, winds,", "MACBETH:\nIs this a dagger"]
N = 24


def spec_counters(base_url):
    m = scrape(base_url)
    return tuple(m.get(f"deepinfer_spec_decode_num_{k}_total")
                 for k in ("drafts", "draft_tokens", "accepted_tokens"))


def test_greedy_answers_are_those_without_speculation(server_factory):
    srv = server_factory("--speculative-tokens", "2")
    client = srv.client()
    want = [cli_generate(p, N + i).text for i, p in enumerate(PROMPTS)]
    assert spec_counters(srv.base_url) == (0, 0, 0)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(
            lambda ip: client.completions.create(model=MODEL_NAME, prompt=ip[1],
                                                 max_tokens=N + ip[0],
                                                 temperature=0).choices[0].text,
            enumerate(PROMPTS)))
    assert got == want
    # Several greedy choices of one request: each the same text.
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=N, n=3,
                                  temperature=0)
    assert [c.text for c in r.choices] == [want[0]] * 3
    drafts, drafted, accepted = spec_counters(srv.base_url)
    assert drafts > 0 and drafted >= drafts
    # The trained layer's drafts are often right (the default model's held-out acceptance is
    # in README.md); a random layer's almost never are.
    assert accepted > 0.2 * drafted, (drafts, drafted, accepted)


def test_sampled_requests_verify_drafts_and_repeat_with_their_seed(server_factory):
    """Sampled rows verify their drafts by rejection sampling (their law is the target's, which
    tests/speculative_sampling.rs tests by chi-square): the drafts are counted, one seed gives
    one answer, alone or beside another request, and `n = 2` gives each choice its own."""
    srv = server_factory("--speculative-tokens", "2")
    client = srv.client()

    def sample(seed):
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=N,
                                      temperature=0.8, top_p=0.95, seed=seed)
        assert r.usage.completion_tokens == N and r.choices[0].finish_reason == "length"
        return r.choices[0].text

    before = spec_counters(srv.base_url)
    alone = sample(1)
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(sample, (1, 2)))
    assert together[0] == alone
    # Two choices of one request: each drafts on its own, choice k seeded with seed + k.
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=N, n=2,
                                  temperature=0.8, top_p=0.95, seed=1)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == together
    drafts, drafted, accepted = (a - b for a, b in zip(spec_counters(srv.base_url), before))
    assert drafts > 0 and drafted >= drafts and 0 < accepted < drafted, (drafts, drafted,
                                                                          accepted)
