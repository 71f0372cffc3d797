"""Several choices per request: `n` and lists of prompts, whole and streamed."""

from collections import defaultdict

from conftest import MODEL_NAME, cli_generate, completion_prompt_tokens

PROMPTS = ["ROMEO:", "JULIET:\nO", "HAMLET:\nTo be"]


def test_a_list_of_prompts_gets_one_choice_each(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(PROMPTS, r.choices):
        assert c.text == cli_generate(p, 8).text, p
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(len(completion_prompt_tokens(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == 3 * 8


def test_token_id_prompts_in_a_list(client):
    ids = [completion_prompt_tokens(p) for p in PROMPTS[:2]]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    for p, c in zip(PROMPTS, r.choices):
        assert c.text == cli_generate(p, 6).text, p


def test_n_choices_sample_with_consecutive_seeds(client):
    def one(seed, n=1):
        return client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=16,
                                         temperature=0.9, seed=seed, n=n)

    r = one(11, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for k, c in enumerate(r.choices):
        assert c.text == one(11 + k).choices[0].text, k
    assert len({c.text for c in r.choices}) > 1, "three samples came out alike"
    assert r.usage.prompt_tokens == len(completion_prompt_tokens("ROMEO:"))
    assert r.usage.completion_tokens == 3 * 16


def test_streamed_choices_interleave_and_add_up(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=10,
                                      temperature=0.8, seed=3, n=2)
    texts, finishes = defaultdict(str), defaultdict(list)
    usage = None
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=10,
                                           temperature=0.8, seed=3, n=2, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert sorted(texts) == [0, 1, 2, 3]
    for c in whole.choices:
        assert texts[c.index] == c.text, c.index
        assert finishes[c.index] == ["length"], c.index
    assert usage.completion_tokens == whole.usage.completion_tokens == 40
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n_choices(client):
    messages = [{"role": "user", "content": "Speak."}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                       temperature=0, n=2)
    ref = cli_generate("Speak.", 6, chat=True).text
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content == ref and c.message.role == "assistant" for c in r.choices)
    assert r.usage.completion_tokens == 12
