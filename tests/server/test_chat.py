"""/v1/chat/completions: greedy text against `deepinfer generate --chat`, prompt tokens against
transformers' apply_chat_template, streaming deltas."""

import pytest

from conftest import CONTEXT, MODEL_NAME, chat_prompt_tokens, cli_generate

USER_PROMPTS = ["Hello", "Who are you?", "Speak of the king."]


def stream_chat(client, **kw):
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks, "no choice chunk"
    first = choice_chunks[0].choices[0].delta
    assert first.role == "assistant", f"first delta: {first}"
    for c in choice_chunks[1:]:
        assert c.choices[0].delta.role in (None, "assistant")
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    finishes = [c.choices[0].finish_reason for c in choice_chunks if c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert choice_chunks[-1].choices[0].finish_reason is not None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    for c in chunks:
        assert c.object == "chat.completion.chunk"
        assert c.id.startswith("chatcmpl-")
        assert c.model == MODEL_NAME
    assert len({c.id for c in chunks}) == 1
    return text, finishes[0], chunks[-1].usage


@pytest.mark.parametrize("content", USER_PROMPTS)
def test_greedy_chat_matches_the_cli(client, content):
    messages = [{"role": "user", "content": content}]
    ref = cli_generate(content, 20, chat=True)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL_NAME
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert c.message.content == ref.text
    assert c.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(chat_prompt_tokens(messages))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("content", USER_PROMPTS[:2])
def test_streamed_chat_joins_to_the_non_streamed_one(client, content):
    messages = [{"role": "user", "content": content}]
    ref = cli_generate(content, 20, chat=True)
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0
    )
    text, finish, usage = stream_chat(client, messages=messages, max_tokens=20, temperature=0)
    assert text == full.choices[0].message.content == ref.text
    assert finish == full.choices[0].finish_reason == ref.finish_reason
    assert usage.prompt_tokens == full.usage.prompt_tokens == len(chat_prompt_tokens(messages))
    assert usage.completion_tokens == full.usage.completion_tokens == len(ref.token_ids)


def test_max_completion_tokens_is_honoured(client):
    messages = [{"role": "user", "content": "Hello"}]
    ref = cli_generate("Hello", 7, chat=True)
    assert ref.finish_reason == "length"  # precondition
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=7, temperature=0
    )
    assert r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == ref.text


def test_content_parts_equal_a_plain_string(client):
    plain = [{"role": "user", "content": "Who are you?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who are you?"}]}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=plain, max_tokens=12,
                                       temperature=0)
    b = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=12,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_multi_turn_prompt_tokens_match_the_template(client):
    messages = [
        {"role": "system", "content": "Thou art a player."},
        {"role": "user", "content": "Who goes there?"},
        {"role": "assistant", "content": "A friend to this ground."},
        {"role": "user", "content": "Stand and unfold yourself."},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(chat_prompt_tokens(messages))
    assert r.usage.completion_tokens == 4


def test_max_tokens_defaults_to_the_rest_of_the_context(client):
    messages = [{"role": "user", "content": "Hello"}]
    n = len(chat_prompt_tokens(messages))
    ref = cli_generate("Hello", CONTEXT - n, chat=True)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0)
    assert r.usage.prompt_tokens == n
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason == ref.finish_reason
    if ref.finish_reason == "length":
        assert r.usage.total_tokens == CONTEXT
    assert r.choices[0].message.content == ref.text


def test_chat_seed_reproduces_sampling(client):
    messages = [{"role": "user", "content": "Speak of the king."}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0.8)
    a = client.chat.completions.create(seed=9, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=9, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=10, **kw).choices[0].message.content
    assert a == b
    assert a != c
