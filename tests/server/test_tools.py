"""Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) through the official `openai`
client, on the default model served with a chat template in DeepSeek-V3's tool format
(`fixtures/chat-templates/deepseek-v3-tools.jinja`, via `--chat-template`), and on the session
server, whose template writes no tool calls: there a named function and `required` are served
as vLLM serves them, the reply constrained to JSON (docs/structured-outputs-defaults.md).

The prompt the server renders (tools, past calls, tool outputs) is checked against
transformers' `apply_chat_template` with the same template. The default model was never trained
to call tools, so with `auto` it writes prose; `required` and a named function constrain its
reply to calls, whose arguments must validate against each function's schema (Python's
`jsonschema`) however the model samples. The whole flow (request, `tool_calls`, tool message,
final answer) runs streamed and not, and the streamed deltas rebuild the same calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import AUTH, MODEL_NAME, REPO, start_server, _tokenizer

TEMPLATE = REPO / "fixtures" / "chat-templates" / "deepseek-v3-tools.jinja"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -100, "maximum": 100},
            "b": {"type": "integer", "minimum": -100, "maximum": 100}},
            "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
           for t in TOOLS}
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Verona, and what is 2 + 3?"}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tool_server():
    srv = start_server("--chat-template", str(TEMPLATE))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tc(tool_server) -> openai.OpenAI:
    return tool_server.client()


def check_calls(calls, allow_empty=False):
    """Every call names an offered function and its arguments validate against its schema."""
    assert calls or allow_empty, "no tool calls"
    for call in calls:
        assert call.type == "function"
        assert call.id and call.id.startswith("call_")
        assert call.function.name in SCHEMAS, call.function.name
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls), "tool call ids must be unique"


def streamed(tc, **kw):
    """A streamed chat completion rebuilt from its deltas: (content, calls, finish_reason)."""
    content, calls, finish, first = "", {}, None, True
    for chunk in tc.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            if first:
                assert d.role == "assistant"
                first = False
            content += d.content or ""
            for tcd in d.tool_calls or []:
                slot = calls.setdefault(tcd.index, {"id": None, "name": None, "arguments": ""})
                if tcd.id:
                    assert slot["id"] is None, "a call's id is sent once"
                    slot["id"] = tcd.id
                if tcd.function and tcd.function.name:
                    assert slot["name"] is None, "a call's name is sent once"
                    slot["name"] = tcd.function.name
                if tcd.function and tcd.function.arguments:
                    slot["arguments"] += tcd.function.arguments
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_prompt_with_tools_calls_and_outputs_matches_transformers(tool_server):
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Verona", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    r = httpx.post(f"{tool_server.base_url}/tokenize", headers=AUTH, timeout=30,
                   json={"model": MODEL_NAME, "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    ref = _tokenizer().apply_chat_template(
        messages, tools=TOOLS, chat_template=TEMPLATE.read_text(), add_generation_prompt=True,
        tokenize=True)
    ref = list(ref["input_ids"]) if hasattr(ref, "keys") else list(ref)
    assert r.json()["tokens"] == ref


# TOOLS with `get_time`'s empty parameter list written out (an omitted `parameters` is the
# same since issue 46: OpenAI reads it as no arguments; before, it admitted any object, which
# the default model extended until max_tokens at seed 6); every argument here is bounded.
BOUNDED_TOOLS = TOOLS[:2] + [{"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_required_calls_validate_and_the_flow_completes(tc, seed):
    # One call per reply, and every argument bounded, so every reply ends by itself (the
    # untrained model, left to choose between another call and the end of the calls, often
    # goes on until max_tokens: see test_parallel_calls).
    r = tc.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=BOUNDED_TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1

    # The client's usual next turn: the assistant message as received, one tool message per
    # call, then the final answer (tools still offered; `none` keeps it prose).
    follow = QUESTION + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": f"result {k}"}
        for k, c in enumerate(choice.message.tool_calls)]
    final = tc.chat.completions.create(
        model=MODEL_NAME, messages=follow, tools=BOUNDED_TOOLS, tool_choice="none",
        temperature=1.0, seed=seed, max_tokens=24)
    assert isinstance(final.choices[0].message.content, str)
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_streamed_deltas_rebuild_the_same_calls(tc, seed):
    kw = dict(model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
    whole = tc.chat.completions.create(**kw).choices[0]
    content, calls, finish = streamed(tc, **kw)
    assert finish == "tool_calls"
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)

    follow = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": "done"} for c in calls]
    text, more, finish = streamed(tc, model=MODEL_NAME, messages=follow, tools=TOOLS,
                                  temperature=1.0, seed=seed, max_tokens=24)
    assert text and finish in ("stop", "length") and not more


def test_named_function_gets_exactly_one_call_of_it(tc):
    # Written in the model's format, a call forced by a named tool_choice still finishes
    # with "stop", as OpenAI and vLLM report a forced call (issue 46); streamed the same.
    for seed in (11, 12, 13):
        kw = dict(model=MODEL_NAME, messages=QUESTION, tools=TOOLS, temperature=1.0,
                  seed=seed, tool_choice={"type": "function", "function": {"name": "add"}},
                  max_tokens=MAX_TOKENS)
        r = tc.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        check_calls(calls)
        assert [c.function.name for c in calls] == ["add"]
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        content, streamed_calls, finish = streamed(tc, **kw)
        assert finish == "stop"
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
            (c.function.name, c.function.arguments) for c in calls]


def test_parallel_calls(tc):
    # With parallel calls the grammar allows another call after each one. Every finished call
    # validates; a reply cut by max_tokens may end in a partial call (finish_reason `length`,
    # as OpenAI reports it), and the streamed deltas rebuild the same calls either way.
    most = 0
    for seed in (21, 22, 23):
        kw = dict(model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice="required",
                  temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        whole = tc.chat.completions.create(**kw).choices[0]
        calls = whole.message.tool_calls
        assert whole.finish_reason in ("tool_calls", "length")
        finished = calls if whole.finish_reason == "tool_calls" else calls[:-1]
        check_calls(finished, allow_empty=True)
        most = max(most, len(calls))
        content, streamed_calls, finish = streamed(tc, **kw)
        assert finish == whole.finish_reason and content == ""
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
            (c.function.name, c.function.arguments) for c in calls]
    assert most > 1, "no reply made more than one call"


def test_auto_and_none_leave_the_untrained_model_writing_prose(tc):
    # The default model never saw tool calls in training: offered tools with `auto`, it
    # answers in text (documented in README); `none` never parses calls.
    for choice in ("auto", "none"):
        r = tc.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=choice,
            temperature=0.0, max_tokens=32)
        m = r.choices[0].message
        assert isinstance(m.content, str) and m.content
        assert not m.tool_calls
        assert r.choices[0].finish_reason in ("stop", "length")


def bad(tc, param, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        tc.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=8, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


def test_bad_tools_are_400s_naming_the_field(tc):
    bad(tc, "tools[0].function.name", tools=[{"type": "function", "function": {}}])
    bad(tc, "tools[1].function.name",
        tools=[TOOLS[0], {"type": "function", "function": {"name": "has space"}}])
    bad(tc, "tools[0].type", tools=[{"type": "retrieval", "function": {"name": "f"}}])
    bad(tc, "tools[0].function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": "no"}}])
    bad(tc, "tools[0].function.parameters",
        tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object",
                                        "properties": {"x": {"$ref": "#/$defs/missing"}}}}}])
    bad(tc, "tool_choice", tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "not_offered"}})
    bad(tc, "tool_choice", tool_choice="required")
    bad(tc, "tool_choice", tools=TOOLS, tool_choice="always")
    bad(tc, "response_format", tools=TOOLS, tool_choice="required",
        response_format={"type": "json_object"})


def test_bad_tool_messages_are_400s(tc):
    msgs = QUESTION + [{"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        tc.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8)
    assert e.value.body["param"] == "messages[2].tool_calls[0].function.name"


def test_a_template_without_a_tool_format_refuses_auto(client):
    # The session server uses the default model's own template, which has no tool format:
    # only the model could say whether it calls a tool, so `auto` needs the format.
    msg = bad(client, "tools", tools=TOOLS)
    assert "--chat-template" in msg
    assert "required" in msg


# ---------------------------------------------------------------------------------------------
# Without a tool-call format (issue 46, item 2): the session server, the default model's own
# template. vLLM serves a named function and `required` without a parser by constraining the
# reply to JSON, and so do we: a named function's reply is its arguments object; `required`'s
# a JSON array of {"name", "parameters"} calls. Before, both were 400s asking for a parser.
#
# Finish reasons as vLLM's (vllm/entrypoints/openai/serving_chat.py, non-streaming and
# streaming alike): a named function's call reports the engine's reason, "stop" (OpenAI also
# reports "stop" for a call forced by tool_choice); `required`'s "tool_calls".

NAMED_ADD = {"type": "function", "function": {"name": "add"}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_named_function_without_a_format_is_a_call_of_it(client):
    for seed in (31, 32, 33):
        for choice in (NAMED_ADD, NAMED_WEATHER):
            name = choice["function"]["name"]
            kw = dict(model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                      temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
            whole = client.chat.completions.create(**kw).choices[0]
            assert whole.finish_reason == "stop", whole
            assert not whole.message.content
            check_calls(whole.message.tool_calls)
            assert [c.function.name for c in whole.message.tool_calls] == [name]
            # Compact JSON, as OpenAI writes arguments.
            args = whole.message.tool_calls[0].function.arguments
            assert args == json.dumps(json.loads(args), separators=(",", ":"), ensure_ascii=False)
            content, calls, finish = streamed(client, **kw)
            assert (content, finish) == ("", "stop")
            assert [(c["name"], c["arguments"]) for c in calls] == [(name, args)]


def test_named_function_without_parameters_takes_no_arguments(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=16)
    assert r.choices[0].finish_reason == "stop"
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] \
        == [("get_time", "{}")]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_without_a_format_gives_calls_of_offered_tools(client, parallel):
    for seed in (41, 42, 43):
        kw = dict(model=MODEL_NAME, messages=QUESTION, tools=BOUNDED_TOOLS,
                  tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
                  seed=seed, max_tokens=MAX_TOKENS)
        whole = client.chat.completions.create(**kw).choices[0]
        calls = whole.message.tool_calls
        if not parallel:
            assert whole.finish_reason == "tool_calls", whole
            assert len(calls) == 1
        assert whole.finish_reason in ("tool_calls", "length")
        check_calls(calls if whole.finish_reason == "tool_calls" else calls[:-1],
                    allow_empty=whole.finish_reason == "length")
        assert not whole.message.content
        content, streamed_calls, finish = streamed(client, **kw)
        assert (content, finish) == ("", whole.finish_reason)
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
            (c.function.name, c.function.arguments) for c in calls]


def test_a_call_cut_by_max_tokens_comes_back_partial(client):
    # Issue 46: a call cut by max_tokens came back as empty content and no tool_calls. It
    # comes back as the call it was cut in, arguments as far as they got, finish_reason
    # "length" (vLLM's answer), streamed and not; the same seed uncut writes the same start.
    for choice, tools in ((NAMED_WEATHER, TOOLS), ("required", BOUNDED_TOOLS)):
        kw = dict(model=MODEL_NAME, messages=QUESTION, tools=tools, tool_choice=choice,
                  parallel_tool_calls=False, temperature=1.0, seed=51)
        full = client.chat.completions.create(max_tokens=MAX_TOKENS, **kw).choices[0]
        assert full.finish_reason in ("stop", "tool_calls")
        (whole_call,) = full.message.tool_calls
        cuts = 0
        for max_tokens in (3, 6, 9):
            r = client.chat.completions.create(max_tokens=max_tokens, **kw)
            cut = r.choices[0]
            if cut.finish_reason != "length":
                continue  # the call was that short
            cuts += 1
            assert r.usage.completion_tokens == max_tokens
            assert cut.message.tool_calls or cut.message.content, cut
            if cut.message.tool_calls:
                (call,) = cut.message.tool_calls
                assert whole_call.function.name.startswith(call.function.name), call
                assert whole_call.function.arguments.startswith(call.function.arguments), call
            content, calls, finish = streamed(client, max_tokens=max_tokens, **kw)
            assert finish == "length"
            assert content == (cut.message.content or "")
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.function.name, c.function.arguments) for c in cut.message.tool_calls or []]
        assert cuts, f"no cut reply for {choice}"


def test_a_call_cut_in_the_format_is_never_dropped(tc):
    # Cut anywhere (in the markers, the name, the arguments), a reply in the model's own
    # format gives back what it holds: a partial call, or its text as content.
    for max_tokens in range(1, 12):
        for stream in (False, True):
            kw = dict(model=MODEL_NAME, messages=QUESTION, tools=TOOLS,
                      tool_choice=NAMED_ADD, temperature=1.0, seed=61, max_tokens=max_tokens)
            if stream:
                content, calls, finish = streamed(tc, **kw)
            else:
                cut = tc.chat.completions.create(**kw).choices[0]
                content, finish = cut.message.content, cut.finish_reason
                calls = cut.message.tool_calls or []
            if finish == "length":
                assert content or calls, (max_tokens, stream)
