"""DeepSeek-V4's chat format served end to end on `fixtures/tiny-v4` (no --chat-template: a
`deepseek_v4` model is encoded by `chat_v4`, as DeepSeek's own encoder does), checked against
DeepSeek's reference encoder and parser, the `deepseek-recipe` package (what vLLM and SGLang serve
V4 through), in non-thinking mode:

- every conversation's prompt tokens (`/tokenize`) equal the tokens of the prompt
  `deepseek-recipe` renders, tokenized by the fixture's own tokenizer.json: system messages lifted
  and joined, tools stated (only the named one for a named choice, none for `none`), tool results
  merged into the user turn in call order, DSML calls in history, list contents, a forced call's
  opened block, a `json_schema` response format; in thinking mode too, at every effort, with
  earlier reasoning kept beside tools and dropped otherwise;
- thinking-mode replies come back as `reasoning_content` (whole and streamed), as the recipe's
  parser reads the same raw text;
- DSML tool calls the model is constrained to write (`tool_choice` required or named) are read
  back exactly as `deepseek-recipe`'s parser reads the same raw text (from the log-probabilities'
  tokens), whole and streamed, and their arguments validate against the schemas;
- malformed tool conversations are 400s naming the message."""

import json

import deepseek_recipe as recipe
import httpx
import jsonschema
import pytest
import tokenizers

from conftest import AUTH, REPO, start_server
from test_tools import QUESTION, SCHEMAS, TOOLS

MODEL = REPO / "fixtures" / "tiny-v4"
NAME = "tiny-v4"
TOKENIZER = tokenizers.Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """tiny-v4 with room for V4's tools section (about 1,100 of this byte-level tokenizer's
    tokens): its config's 1,024 positions raised to 4,096. The weights are the fixture's; what
    is checked here is the prompt format and the calls, not the logits."""
    model = tmp_path_factory.mktemp("tiny-v4-long")
    for f in MODEL.iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((MODEL / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    s = start_server("--model", str(model), "--served-model-name", NAME)
    yield s
    s.stop()


def recipe_request(messages, **body):
    """deepseek-recipe's conversion of a chat request (non-thinking unless `body` says)."""
    body = {"model": "DeepSeek-V4-Pro", "messages": messages, "thinking": {"type": "disabled"},
            **body}
    return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())


def recipe_prompt_ids(messages, **body):
    conversation = recipe_request(messages, **body).conversation
    text = recipe.DeepseekV4Encoding().render_conversation(conversation).prompt
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER_ARGS = json.dumps({"city": "Verona", "unit": "celsius"})
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi"}],
    "system lifted and joined": [
        {"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
        {"role": "system", "content": "B"}, {"role": "user", "content": "Yo"}],
    "multi-turn": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And?"}],
    "ends with an assistant turn": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
    "list contents": [
        {"role": "system", "content": [{"type": "text", "text": "S1"},
                                       {"type": "text", "text": "S2"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}],
    "tool round trip, results out of order": QUESTION + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("c1", "get_weather", WEATHER_ARGS),
            call("c2", "add", json.dumps({"a": 2, "b": 3})),
            call("c3", "add", "not json")]},
        {"role": "tool", "tool_call_id": "c3", "content": "?"},
        {"role": "tool", "tool_call_id": "c2", "content": "5"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"},
                                                           {"type": "text", "text": "21C"}]},
        {"role": "user", "content": "Thanks. Summarise."}],
    "nested and unicode arguments": [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "tool_calls": [call("x", "add", json.dumps(
            {"s": "é\n\"q\"", "n": 1.5, "b": True, "z": None, "o": {"k": [1, "x"]},
             "e": 1e20, "t": 1e-7}))]},
        {"role": "tool", "tool_call_id": "x", "content": "ok"}],
}


CONVERSATIONS["reasoning in history"] = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": None, "reasoning_content": "R2",
     "tool_calls": [call("t", "add", json.dumps({"a": 1, "b": 2}))]},
    {"role": "tool", "tool_call_id": "t", "content": "3"},
    {"role": "assistant", "content": "A3", "reasoning_content": "R3"},
]
THINKING = {"off": {}, "on": {"thinking": {"type": "enabled"}},
            "kwarg low": {"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "low"},
            "max": {"thinking": {"type": "enabled"}, "reasoning_effort": "max"}}


def tokenize(srv, body):
    r = httpx.post(f"{srv.base_url}/tokenize", headers=AUTH, json={"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("thinking", list(THINKING))
def test_prompts_match_deepseeks_encoder(srv, name, with_tools, thinking):
    messages = CONVERSATIONS[name]
    body = {**({"tools": TOOLS} if with_tools else {}), **THINKING[thinking]}
    recipe_body = dict(body)
    if "chat_template_kwargs" in recipe_body:  # the recipe reads DeepSeek's switch only
        del recipe_body["chat_template_kwargs"]
        recipe_body["thinking"] = {"type": "enabled"}
    assert tokenize(srv, {"messages": messages, **body}) == recipe_prompt_ids(
        messages, **recipe_body)


@pytest.mark.parametrize("extra", [
    dict(tools=TOOLS, tool_choice="required"),
    dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
    dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
    dict(tools=TOOLS, tool_choice="none"),
    dict(tools=TOOLS, tool_choice="none", thinking={"type": "enabled"}),
    dict(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": SCHEMAS["add"]}}),
], ids=["required", "one call", "named", "none", "none thinking", "json_schema"])
def test_choices_and_formats_shape_the_prompt_as_deepseeks_encoder(srv, extra):
    assert tokenize(srv, {"messages": QUESTION, **extra}) == recipe_prompt_ids(QUESTION, **extra)


def raw_text(choice):
    """The reply as the model wrote it: its tokens' bytes (log-probabilities' `bytes`)."""
    return b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode(errors="replace")


def recipe_parse(text, **body):
    """deepseek-recipe's reading of a reply: (content, [(name, arguments)])."""
    message = recipe_parse_message(text, **body)
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]
    return message.get("content") or None, calls


def recipe_parse_message(text, **body):
    """deepseek-recipe's reading of a reply, as its chat completion message."""
    request = recipe_request(QUESTION, tools=TOOLS, **body)
    generator = recipe.ChatCompletionRequest.chunk_generator(request, "id", NAME)
    processor = recipe.StreamProcessor(generator, request.parsing_options)
    response = recipe.ChatCompletionResponse("id", NAME, 0, 1, 0)
    chunks = processor.push(recipe.InferenceChunk.text(text, 1))
    chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    chunks += processor.finish()
    for c in chunks:
        response.accumulate(c)
    return json.loads(response.to_json())["choices"][0]["message"]


@pytest.mark.parametrize("choice", ["required", "add", "get_weather"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_constrained_dsml_calls_read_as_deepseeks_parser_reads_them(srv, choice, seed):
    tool_choice = (choice if choice == "required"
                   else {"type": "function", "function": {"name": choice}})
    kw = dict(model=NAME, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
              max_tokens=200, temperature=0.9, seed=seed)
    r = srv.client().chat.completions.create(logprobs=True, **kw)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "stop"), c.finish_reason
    text = raw_text(c)
    ours = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    content, theirs = recipe_parse(text, tool_choice=tool_choice)
    assert ours == theirs and ours, text
    assert not c.message.content and not content
    for name, arguments in ours:
        if choice != "required":
            assert name == choice
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    # Streamed, the same calls.
    streamed = {}
    for chunk in srv.client().chat.completions.create(stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, args = streamed.get(d.index, ("", ""))
            streamed[d.index] = (name + (d.function.name or ""),
                                 args + (d.function.arguments or ""))
    assert [streamed[i] for i in sorted(streamed)] == ours


def test_free_replies_read_as_deepseeks_parser_reads_them(srv):
    r = srv.client().chat.completions.create(
        model=NAME, messages=QUESTION, tools=TOOLS, max_tokens=40, temperature=0.9, seed=4,
        logprobs=True)
    c = r.choices[0]
    content, calls = recipe_parse(raw_text(c))
    ours = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert (c.message.content, ours) == (content, calls)


def test_thinking_replies_come_back_as_reasoning(srv):
    kw = dict(model=NAME, messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0.9,
              seed=7, extra_body={"thinking": {"type": "enabled"}})
    r = srv.client().chat.completions.create(logprobs=True, **kw)
    c = r.choices[0]
    message = c.message.model_dump()
    reasoning, content = message["reasoning_content"], c.message.content
    recipe = recipe_parse_message(raw_text(c), thinking={"type": "enabled"})
    assert (reasoning, content or "") == (recipe["reasoning_content"], recipe["content"] or "")
    assert reasoning
    streamed_reasoning, streamed_content = "", ""
    for chunk in srv.client().chat.completions.create(stream=True, **kw):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            streamed_reasoning += delta.get("reasoning_content") or ""
            streamed_content += delta.get("content") or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, content or "")


@pytest.mark.parametrize("body, param", [
    ({"thinking": {"type": "enabled"}, "tools": TOOLS, "tool_choice": "required"},
     "tool_choice"),
    ({"thinking": {"type": "enabled"}, "response_format": {"type": "json_object"}},
     "response_format"),
    ({"thinking": {"type": "enabled"}, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
])
def test_bad_thinking_requests_are_refused_naming_the_field(srv, body, param):
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", headers=AUTH,
                   json={"model": NAME, "messages": QUESTION, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_thinking_is_refused_for_a_model_with_a_template(client):
    """The default model writes prompts with its Jinja template: no thinking mode."""
    r = httpx.post(f"{client.base_url}chat/completions", headers=AUTH,
                   json={"model": client.models.list().data[0].id, "messages": QUESTION,
                         "chat_template_kwargs": {"thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking", r.text


@pytest.mark.parametrize("messages, index", [
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "r"}], 1),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": None, "tool_calls": [call("a", "add", "{}")]},
      {"role": "user", "content": "y"}], 1),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": None, "tool_calls": [call("a", "add", "{}")]},
      {"role": "tool", "tool_call_id": "zz", "content": "r"}], 2),
])
def test_malformed_tool_conversations_are_refused_naming_the_message(srv, messages, index):
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", headers=AUTH,
                   json={"model": NAME, "messages": messages})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and f"messages[{index}]" in error["message"], error
    # deepseek-recipe refuses them too.
    with pytest.raises(Exception):
        recipe_prompt_ids(messages)
