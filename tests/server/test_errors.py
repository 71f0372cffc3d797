"""Bad requests each get the right 4xx in the OpenAI error shape, and the server keeps serving."""

import json

import httpx
import openai
import pytest

from conftest import API_KEY, AUTH, CONTEXT, MODEL_NAME, cli_generate, completion_prompt_tokens

C = "/v1/completions"
CH = "/v1/chat/completions"
GOOD = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
             "max_tokens": 4, "temperature": 0}
# > 1024 tokens (checked in the test against the tokenizer).
TOO_LONG = "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 120
INVALID = "invalid_request_error"
ANY = object()  # param: not checked


def c(**kw):
    return json.dumps({**GOOD, **kw})


def ch(**kw):
    return json.dumps({**GOOD_CHAT, **kw})


def without(d, key):
    return json.dumps({k: v for k, v in d.items() if k != key})


# (id, route, raw body, headers, status, type, code, param)
CASES = [
    ("not-json", C, "{not json", AUTH, 400, INVALID, None, ANY),
    ("not-json-chat", CH, '{"model": "default-model", "messages": [', AUTH, 400, INVALID, None, ANY),
    ("json-not-an-object", C, "[1, 2, 3]", AUTH, 400, INVALID, None, ANY),
    ("empty-body", C, "", AUTH, 400, INVALID, None, ANY),
    ("max_tokens-string", C, c(max_tokens="ten"), AUTH, 400, INVALID, None, ANY),
    ("max_tokens-float", C, c(max_tokens=2.5), AUTH, 400, INVALID, None, ANY),
    ("temperature-string", C, c(temperature="hot"), AUTH, 400, INVALID, None, ANY),
    ("prompt-number", C, c(prompt=42), AUTH, 400, INVALID, None, ANY),
    ("prompt-object", C, c(prompt={"text": "ROMEO:"}), AUTH, 400, INVALID, None, ANY),
    ("stream-string", C, c(stream="yes"), AUTH, 400, INVALID, None, ANY),
    ("stop-number", C, c(stop=7), AUTH, 400, INVALID, None, ANY),
    ("messages-string", CH, ch(messages="Hello"), AUTH, 400, INVALID, None, ANY),
    ("content-number", CH, ch(messages=[{"role": "user", "content": 5}]), AUTH, 400, INVALID,
     None, ANY),
    ("missing-model", C, without(GOOD, "model"), AUTH, 400, INVALID, None, ANY),
    ("missing-model-chat", CH, without(GOOD_CHAT, "model"), AUTH, 400, INVALID, None, ANY),
    ("missing-messages", CH, without(GOOD_CHAT, "messages"), AUTH, 400, INVALID, None, ANY),
    ("unknown-role", CH, ch(messages=[{"role": "robot", "content": "Hi"}]), AUTH, 400, INVALID,
     None, ANY),
    ("max_tokens-zero", C, c(max_tokens=0), AUTH, 400, INVALID, None, "max_tokens"),
    ("max_tokens-negative", C, c(max_tokens=-5), AUTH, 400, INVALID, None, "max_tokens"),
    ("max_tokens-negative-chat", CH, ch(max_tokens=-1), AUTH, 400, INVALID, None, "max_tokens"),
    ("temperature-negative", C, c(temperature=-0.5), AUTH, 400, INVALID, None, "temperature"),
    ("top_p-zero", C, c(top_p=0), AUTH, 400, INVALID, None, "top_p"),
    # Completions' logprobs is a count: a fraction or a huge float is refused, not ignored.
    ("logprobs-fraction", C, c(logprobs=2.5), AUTH, 400, INVALID, None, "logprobs"),
    ("logprobs-huge", C, c(logprobs=1e20), AUTH, 400, INVALID, None, "logprobs"),
    ("stop_token_ids-outside-vocab", C, c(stop_token_ids=[4096 + 5]), AUTH, 400, INVALID, None,
     "stop_token_ids"),
    ("top_p-above-one", C, c(top_p=1.5), AUTH, 400, INVALID, None, "top_p"),
    ("n-zero", C, c(n=0), AUTH, 400, INVALID, None, "n"),
    ("n-too-many-chat", CH, ch(n=17), AUTH, 400, INVALID, None, "n"),
    ("too-many-choices", C, c(prompt=["a"] * 8, n=9), AUTH, 400, INVALID, None, "n"),
    ("empty-messages", CH, ch(messages=[]), AUTH, 400, INVALID, None, "messages"),
    ("empty-prompt", C, c(prompt=""), AUTH, 400, INVALID, None, "prompt"),
    ("empty-prompt-list", C, c(prompt=[]), AUTH, 400, INVALID, None, "prompt"),
    ("best_of", C, c(best_of=2), AUTH, 400, INVALID, None, ANY),
    ("logprobs-too-many", C, c(logprobs=21), AUTH, 400, INVALID, None, "logprobs"),
    ("logprobs-string", C, c(logprobs="yes"), AUTH, 400, INVALID, None, "logprobs"),
    ("chat-logprobs-number", CH, ch(logprobs=3), AUTH, 400, INVALID, None, "logprobs"),
    ("chat-top_logprobs-without-logprobs", CH, ch(top_logprobs=2), AUTH, 400, INVALID, None,
     "top_logprobs"),
    ("chat-top_logprobs-too-many", CH, ch(logprobs=True, top_logprobs=21), AUTH, 400, INVALID,
     None, "top_logprobs"),
    ("suffix", C, c(suffix="THE END"), AUTH, 400, INVALID, None, ANY),
    ("five-stop-strings", C, c(stop=["a1", "b2", "c3", "d4", "e5"]), AUTH, 400, INVALID, None,
     ANY),
    ("token-id-outside-vocab", C, c(prompt=[0, 5, 4096]), AUTH, 400, INVALID, None, ANY),
    ("huge-max_tokens", C, c(max_tokens=10**9), AUTH, 400, INVALID, "context_length_exceeded",
     ANY),
    ("huge-max_tokens-chat", CH, ch(max_tokens=10**9), AUTH, 400, INVALID,
     "context_length_exceeded", ANY),
    ("prompt-beyond-context", C, c(prompt=TOO_LONG, max_tokens=1), AUTH, 400, INVALID,
     "context_length_exceeded", ANY),
    ("chat-beyond-context", CH, ch(messages=[{"role": "user", "content": TOO_LONG}],
                                   max_tokens=1), AUTH, 400, INVALID, "context_length_exceeded",
     ANY),
    ("chat-beyond-context-default-max", CH, without({**GOOD_CHAT, "messages": [
        {"role": "user", "content": TOO_LONG}]}, "max_tokens"), AUTH, 400, INVALID,
     "context_length_exceeded", ANY),
    ("unknown-model", C, c(model="gpt-4"), AUTH, 404, INVALID, "model_not_found", ANY),
    ("unknown-model-chat", CH, ch(model="no-such-model"), AUTH, 404, INVALID, "model_not_found",
     ANY),
    ("missing-key", C, c(), {}, 401, INVALID, "invalid_api_key", ANY),
    ("wrong-key", C, c(), {"Authorization": "Bearer not-the-key"}, 401, INVALID,
     "invalid_api_key", ANY),
    ("wrong-key-chat", CH, ch(), {"Authorization": "Bearer test-key-2"}, 401, INVALID,
     "invalid_api_key", ANY),
    ("body-too-large", C, c(prompt="a" * (2 * 1024 * 1024)), AUTH, 413, INVALID,
     "request_too_large", ANY),
]


def check_error_shape(r: httpx.Response, status, type_, code, param):
    assert r.status_code == status, f"{r.status_code}: {r.text}"
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == type_, err
    assert err["code"] == code, err
    if param is not ANY:
        assert err["param"] == param, err
    else:
        assert err["param"] is None or isinstance(err["param"], str), err


def test_the_too_long_prompt_is_beyond_the_context():
    assert len(completion_prompt_tokens(TOO_LONG)) > CONTEXT


@pytest.mark.parametrize(
    "route,body,headers,status,type_,code,param", [c_[1:] for c_ in CASES],
    ids=[c_[0] for c_ in CASES],
)
def test_bad_request(http, route, body, headers, status, type_, code, param):
    r = http.post(route, content=body.encode(),
                  headers={**headers, "Content-Type": "application/json"})
    check_error_shape(r, status, type_, code, param)


def test_the_server_still_serves_after_the_bad_requests(client, http):
    # Runs after the table (file order): the process is alive and answers correctly.
    assert http.get("/health").status_code == 200
    ref = cli_generate("ROMEO:", 4)
    r = client.completions.create(**GOOD)
    assert r.choices[0].text == ref.text
    chat = client.chat.completions.create(**{k: v for k, v in GOOD_CHAT.items()})
    assert chat.usage.completion_tokens == 4


# The same failures through the official client: the right exception classes and fields.


def test_client_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="ROMEO:", max_tokens=4)
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"
    assert e.value.type == INVALID


def test_client_wrong_key(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"


def test_client_empty_messages(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[])
    assert e.value.param == "messages"
    assert e.value.code is None


def test_client_huge_max_tokens_streaming(client):
    # Rejected before the stream starts: an HTTP 400, not an error event.
    with pytest.raises(openai.BadRequestError) as e:
        list(client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=10**9,
                                       stream=True))
    assert e.value.code == "context_length_exceeded"


def test_client_prompt_beyond_context(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=TOO_LONG, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_key_from_environment_variable(server_factory):
    srv = server_factory(env={"DEEPINFER_API_KEY": "env-key"}, api_key=None)
    r = httpx.get(f"{srv.base_url}/v1/models", timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{srv.base_url}/v1/models", headers={"Authorization": "Bearer env-key"},
                  timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["id"] == MODEL_NAME


def test_a_bad_request_generates_nothing(http, metrics):
    before = metrics()
    r = http.post(C, content=c(max_tokens=0).encode(),
                  headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    after = metrics()
    # A rejected request generates nothing and leaves nothing running.
    assert after.get("deepinfer_generation_tokens_total") == before.get(
        "deepinfer_generation_tokens_total")
    assert after.get("deepinfer_num_requests_running", default=None) == 0
    assert after.outcome("rejected") == before.outcome("rejected") + 1


def test_a_tiny_temperature_is_greedy_not_garbage(client):
    # 1e-40 passes validation (0 <= t <= 2); dividing logits by it used to overflow.
    greedy = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=8,
                                       temperature=0)
    for t in (1e-40, 1e-38, 1e-6):
        tiny = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=8,
                                         temperature=t, seed=3)
        assert tiny.choices[0].text == greedy.choices[0].text, t


def test_stream_null_is_not_streaming(http):
    r = http.post(C, content=c(stream=None).encode(),
                  headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


def test_the_bearer_scheme_is_case_insensitive(http):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = http.post(C, content=c().encode(),
                      headers={"Authorization": f"{scheme} {API_KEY}",
                               "Content-Type": "application/json"})
        assert r.status_code == 200, (scheme, r.text)
    r = http.post(C, content=c().encode(),
                  headers={"Authorization": f"Basic {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 401


# Pins (these pass on the main they were written against too): the server's own connection layer
# (src/server/conn.rs) must keep the app's 405 body, and reads bodies itself, limit included.


@pytest.mark.parametrize("method,path,allowed", [
    ("GET", C, "POST"), ("GET", CH, "POST"), ("DELETE", "/v1/models", "GET"),
    ("POST", "/health", "GET"), ("PUT", "/tokenize", "POST"),
])
def test_a_wrong_method_is_a_405_with_a_json_error_and_allow(http, method, path, allowed):
    r = http.request(method, path, headers=AUTH)
    assert r.status_code == 405, r.text
    assert allowed in r.headers.get("allow", ""), r.headers
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["type"] == INVALID and method in err["message"] and path in err["message"], err


def test_a_chunked_body_over_the_limit_is_a_413(http):
    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MB, the limit is 1 MiB

    r = http.post(C, content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    check_error_shape(r, 413, INVALID, "request_too_large", None)
    assert http.get("/health").status_code == 200
