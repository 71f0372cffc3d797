"""GET /v1/models/{id}, and vLLM's /tokenize and /detokenize against transformers' tokenizer."""

import openai
import pytest

from conftest import (AUTH, CONTEXT, MODEL_NAME, _tokenizer, chat_prompt_tokens,
                      completion_prompt_tokens)

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def test_retrieve_model(client):
    m = client.models.retrieve(MODEL_NAME)
    assert m.id == MODEL_NAME and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found"


def test_tokenize_a_prompt_as_completions_would(http):
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXT}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == completion_prompt_tokens(TEXT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT
    r = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}, headers=AUTH)
    assert r.json()["tokens"] == _tokenizer()(TEXT, add_special_tokens=False).input_ids


def test_tokenize_messages_as_chat_would(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    r = http.post("/tokenize", json={"messages": messages}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == chat_prompt_tokens(messages)


def test_detokenize_round_trips(http):
    ids = completion_prompt_tokens(TEXT)
    r = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == _tokenizer().decode(ids)


@pytest.mark.parametrize("route,body,status", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),
    ("/tokenize", {}, 400),
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404),
    ("/detokenize", {"tokens": [1, 4096]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
])
def test_bad_tokenizer_requests(http, route, body, status):
    r = http.post(route, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenizer_routes_need_the_key(http):
    assert http.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert http.post("/detokenize", json={"tokens": [5]}).status_code == 401
