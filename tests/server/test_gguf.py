"""A llama.cpp GGUF file served end to end (`--model FILE.gguf`): `fixtures/gguf/tiny-v3-f32.gguf`,
converted by llama.cpp's own `convert_hf_to_gguf.py` from `fixtures/tiny-v3`, against
transformers' greedy continuation of that checkpoint (`reference.json`) and its own tokenizer
(the checkpoint's `tokenizer.json`, read by the `tokenizers` library): the server takes its
tokenizer and chat template from the file alone."""

import json

import pytest
from tokenizers import Tokenizer

from conftest import REPO, start_server

FIXTURE = REPO / "fixtures" / "tiny-v3"
GGUF = REPO / "fixtures" / "gguf" / "tiny-v3-f32.gguf"


@pytest.fixture(scope="module")
def client():
    srv = start_server("--model", str(GGUF))
    yield srv.client()
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURE / "reference.json").read_text())


def test_the_model_is_named_after_the_file(client):
    assert [m.id for m in client.models.list().data] == ["tiny-v3-f32"]


def test_greedy_continuation_matches_transformers(client, ref):
    g = ref["greedy"]
    out = client.completions.create(
        model="tiny-v3-f32", prompt=g["prompt_token_ids"],
        max_tokens=len(g["generated_token_ids"]), temperature=0,
        extra_body={"ignore_eos": True})
    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    want = tok.decode(g["generated_token_ids"], skip_special_tokens=True)
    assert out.choices[0].text == want


def test_prompts_are_tokenized_as_the_checkpoint_tokenizes_them(client):
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?"
    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    # The checkpoint's tokenizer adds the bos token (its post-processor), as the server must.
    want = len(tok.encode(text).ids)
    out = client.completions.create(model="tiny-v3-f32", prompt=text, max_tokens=1)
    assert out.usage.prompt_tokens == want
