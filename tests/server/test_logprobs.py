"""Log-probabilities: the sampled token's and the top alternatives', in both OpenAI shapes,
checked against the log-softmax of `deepinfer score` (the prefill path, itself checked against
transformers) over the prompt and the generated tokens."""

import json
import math
import subprocess

from conftest import AUTH, BIN, MODEL_NAME, REPO, cli_generate, completion_prompt_tokens

PROMPT = "ROMEO:"
N = 6
TOP = 3


def score_logprobs(token_ids):
    """log-softmax rows of every position, from `deepinfer score`."""
    out = subprocess.run(
        [str(BIN), "score", "--token-ids", ",".join(map(str, token_ids))],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["logits"]
    result = []
    for row in rows:
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        result.append([x - lse for x in row])
    return result


def expected(prompt_ids, generated_ids):
    rows = score_logprobs(list(prompt_ids) + list(generated_ids))
    # The logprobs of generated token i come from the position before it.
    return [rows[len(prompt_ids) - 1 + i] for i in range(len(generated_ids))]


def test_completion_logprobs_match_the_prefill_path(client):
    ref = cli_generate(PROMPT, N)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N,
                                  temperature=0, logprobs=TOP)
    choice = r.choices[0]
    assert choice.text == ref.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    want = expected(completion_prompt_tokens(PROMPT), ref.token_ids)
    for i, (tok_id, row) in enumerate(zip(ref.token_ids, want)):
        assert abs(lp.token_logprobs[i] - row[tok_id]) < 1e-4, (i, lp.token_logprobs[i])
        top = lp.top_logprobs[i]
        assert len(top) == TOP
        best = sorted(row, reverse=True)[:TOP]
        assert all(abs(a - b) < 1e-4 for a, b in zip(sorted(top.values(), reverse=True), best))
        # Greedy: the chosen token is the most likely one.
        assert abs(max(top.values()) - lp.token_logprobs[i]) < 1e-6


def test_streamed_logprobs_equal_the_whole_response(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N,
                                      temperature=0, logprobs=2)
    tokens, lps = [], []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N,
                                           temperature=0, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            lps += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.choices[0].logprobs.tokens
    assert lps == whole.choices[0].logprobs.token_logprobs


def token_bytes(tok, tok_id):
    """A token's own bytes by transformers' byte-level BPE map (added tokens: their text)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    piece = tok.convert_ids_to_tokens(tok_id)
    if tok_id in tok.added_tokens_decoder:
        return piece.encode()
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in piece)


def test_chat_logprobs_shape_and_values(client, tok):
    messages = [{"role": "user", "content": "Speak."}]
    ref = cli_generate("Speak.", N, chat=True)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=N,
                                       temperature=0, logprobs=True, top_logprobs=TOP)
    content = r.choices[0].logprobs.content
    assert len(content) == N == r.usage.completion_tokens
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    want = expected(prompt_ids, ref.token_ids)
    for entry, tok_id, row in zip(content, ref.token_ids, want):
        assert abs(entry.logprob - row[tok_id]) < 1e-4
        assert bytes(entry.bytes) == token_bytes(tok, tok_id)
        assert len(entry.top_logprobs) == TOP
        assert entry.top_logprobs[0].token == entry.token
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    # Without logprobs: none.
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                       temperature=0)
    assert r.choices[0].logprobs is None


def test_zero_alternatives_reports_only_the_sampled_token(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                  temperature=0.8, seed=5, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert all(t == {} for t in lp.top_logprobs)


def test_echo_scores_the_prompt_like_an_evaluation_harness(client):
    # lm-eval's loglikelihood request: echo the prompt, generate nothing, read the logprobs.
    prompt = "ROMEO:\nBut soft, what light"
    ids = completion_prompt_tokens(prompt)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert c.text == prompt
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = score_logprobs(ids)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - rows[j - 1][ids[j]]) < 1e-4, j
        (best, value), = lp.top_logprobs[j].items()
        assert abs(value - max(rows[j - 1])) < 1e-4, j
    # Offsets index the echoed text: each token's text starts where the offset says.
    for tok_text, off in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert c.text[off:].startswith(tok_text), (tok_text, off)


def test_echo_with_generation_streamed_and_whole(client):
    ref = cli_generate(PROMPT, 4)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                      temperature=0, echo=True, logprobs=0)
    assert whole.choices[0].text == PROMPT + ref.text
    n_prompt = len(completion_prompt_tokens(PROMPT))
    assert len(whole.choices[0].logprobs.tokens) == n_prompt + 4
    text, tokens = "", []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                           temperature=0, echo=True, logprobs=0, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
    assert text == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens


def test_max_tokens_zero_needs_echo(http):
    for route, body in [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0}),
        ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 0,
                                  "messages": [{"role": "user", "content": "Hi"}]}),
    ]:
        r = http.post(route, json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_tokens"
