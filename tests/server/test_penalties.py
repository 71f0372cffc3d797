"""Penalties, `logit_bias`, `min_p` and `min_tokens` over HTTP (the formulas themselves are
checked against reference implementations in tests/penalties.rs), and the 400s for values
outside their ranges."""

import pytest

from conftest import MODEL_NAME, cli_generate, completion_prompt_tokens

PROMPT = "ROMEO:"
N = 12


def complete(client, **kw):
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0)
    extra = kw.pop("extra_body", {})
    args.update(kw)
    r = client.completions.create(**args, extra_body={"ignore_eos": True, **extra})
    return r.choices[0]


def test_logit_bias_of_100_forces_a_token(client):
    forced = completion_prompt_tokens(" the")[-1]
    c = complete(client, logit_bias={str(forced): 100})
    assert len(c.logprobs.tokens) == N and len(set(c.logprobs.tokens)) == 1, c.logprobs.tokens


def test_logit_bias_of_minus_100_bans_the_greedy_token(client):
    plain = complete(client, max_tokens=1)
    assert plain.text == cli_generate(PROMPT, 1).text
    first = cli_generate(PROMPT, 1).token_ids[0]
    banned = complete(client, logit_bias={str(first): -100}, max_tokens=1)
    assert banned.logprobs.tokens != plain.logprobs.tokens


def test_penalties_change_greedy_text_and_zero_is_off(client):
    plain = cli_generate(PROMPT, N).text
    assert complete(client, presence_penalty=0, frequency_penalty=0).text == plain
    assert complete(client, frequency_penalty=2.0).text != plain
    assert complete(client, extra_body={"repetition_penalty": 1.8}).text != plain


def test_min_tokens_holds_back_a_stop_token(client):
    plain = cli_generate(PROMPT, N)
    stop = plain.token_ids[2]
    first = plain.token_ids.index(stop)
    # Without min_tokens the stop token ends the text at once; with it, not before 6 tokens.
    early = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    assert early.usage.completion_tokens == first + 1
    late = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "min_tokens": 6})
    assert late.usage.completion_tokens >= 6


def test_min_p_one_is_greedy(client):
    plain = cli_generate(PROMPT, N).text
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N, temperature=1.0,
                                  seed=9, extra_body={"min_p": 1.0, "ignore_eos": True})
    assert r.choices[0].text == plain


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("min_p", 1.5),
    ("min_tokens", -1),
    ("logit_bias", {"999999": 1}),
    ("logit_bias", {"5": 101}),
    ("logit_bias", {"five": 1}),
    ("logit_bias", {str(i): 1 for i in range(33)}),
])
def test_out_of_range_values_are_400s_naming_the_field(http, field, value):
    r = http.post("/v1/completions", headers={"Authorization": "Bearer test-key"},
                  json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
