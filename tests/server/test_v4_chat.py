"""DeepSeek-V4's chat format served end to end on `fixtures/tiny-v4` (no --chat-template: a
`deepseek_v4` model is encoded by `chat_v4`, as DeepSeek's own encoder does), checked against
DeepSeek's reference encoder and parser, the `deepseek-recipe` package (what vLLM and SGLang serve
V4 through), in non-thinking mode:

- every conversation's prompt tokens (`/tokenize`) equal the tokens of the prompt
  `deepseek-recipe` renders, tokenized by the fixture's own tokenizer.json: system messages lifted
  and joined, tools stated, tool results merged into the user turn in call order, DSML calls in
  history, list contents; a forced call's and a `json_schema` response format's prompts by count;
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
    """deepseek-recipe's conversion of a chat request (non-thinking mode)."""
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


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_prompts_match_deepseeks_encoder(srv, name, with_tools):
    messages = CONVERSATIONS[name]
    tools = {"tools": TOOLS} if with_tools else {}
    r = httpx.post(f"{srv.base_url}/tokenize", headers=AUTH,
                   json={"model": NAME, "messages": messages, **tools})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == recipe_prompt_ids(messages, **tools)


def test_forced_calls_and_response_format_prompts_match_by_count(srv):
    client = srv.client()
    cases = [
        dict(tools=TOOLS, tool_choice="required"),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
        dict(response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": SCHEMAS["add"]}}),
    ]
    for extra in cases:
        r = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=1, **extra)
        assert r.usage.prompt_tokens == len(recipe_prompt_ids(QUESTION, **extra)), extra


def raw_text(choice):
    """The reply as the model wrote it: its tokens' bytes (log-probabilities' `bytes`)."""
    return b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode(errors="replace")


def recipe_parse(text, **body):
    """deepseek-recipe's reading of a reply: (content, [(name, arguments)])."""
    request = recipe_request(QUESTION, tools=TOOLS, **body)
    generator = recipe.ChatCompletionRequest.chunk_generator(request, "id", NAME)
    processor = recipe.StreamProcessor(generator, request.parsing_options)
    response = recipe.ChatCompletionResponse("id", NAME, 0, 1, 0)
    chunks = processor.push(recipe.InferenceChunk.text(text, 1))
    chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    chunks += processor.finish()
    for c in chunks:
        response.accumulate(c)
    message = json.loads(response.to_json())["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]
    return message.get("content") or None, calls


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
