"""Tool calling on /v1/chat/completions, over loopback with the real engine.

The synthetic models carry real tool-aware chat templates (Qwen2.5's, hermes format, and
Llama 3.1's, llama3-json format) and, as single special tokens, whole scripted replies
ending in END. A request forces one script with `logit_bias` +100 and ends at it with
`stop: [END]`, so the real engine (template, tokenizer, dispatcher, stop strings) writes
exactly the text a test wants: no stub anywhere. Also here: every bad tool field, the
model whose template cannot show tools, and the protocol's conversion of OpenAI's tool
messages to what templates expect.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.tool_calls import ToolCallFormat
from eagerlm.service.http.openai_errors import OpenAIError
from eagerlm.service.http.openai_requests import parse_chat_request
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_chat_template import LLAMA31_TEMPLATE, QWEN25_TEMPLATE
from tests.test_server import LiveServer, assert_idle_and_nothing_leaked, sse_payloads

MODEL = "tiny-tools"
END = "<|end-of-script|>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
ROCKETS_CALL = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
# replies the hermes model can be made to write, each one token (see the docstring)
ONE_CALL = WEATHER_CALL + END
TWO_CALLS = "Checking both.\n" + WEATHER_CALL + "\n" + TIME_CALL + END
UNKNOWN_CALL = ROCKETS_CALL + END
LLAMA_CALL = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}' + END


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    spec = tiny_spec("qwen2", context_length=4096, chat_template=QWEN25_TEMPLATE,
                     extra_specials=("<tool_call>", "</tool_call>", ONE_CALL, TWO_CALLS,
                                     UNKNOWN_CALL))
    path = write_synthetic_model(tmp_path_factory.mktemp("tools") / "qwen.gguf", spec)
    with Engine.load(path, page_size=16384, kv_budget_bytes=64 << 20,
                     model_name=MODEL) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


@pytest.fixture()
def client(server):
    with server.openai() as c:
        yield c


def forcing(engine: Engine, script: str, **fields) -> dict:
    """Request fields that make the model write `script` (without END) and stop there."""
    return {"logit_bias": {str(engine.tokenizer.token_id(script)): 100}, "stop": [END],
            "max_tokens": 4, **fields}


def arguments(call) -> dict:
    return json.loads(call.function.arguments)


# -- replies with calls ------------------------------------------------------------------------

def test_a_call_comes_back_as_tool_calls_with_finish_reason_tool_calls(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       extra_body=forcing(engine, ONE_CALL))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert CALL_ID.fullmatch(call.id) and call.type == "function"
    assert (call.function.name, arguments(call)) == ("get_weather", {"city": "Paris"})
    assert r.usage.completion_tokens == 1  # usage counts are the engine's, unchanged


def test_content_before_calls_and_several_calls_streamed_and_not(server, engine):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **forcing(engine, TWO_CALLS)}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        with http.stream("POST", "/v1/chat/completions",
                         json={**body, "stream": True,
                               "stream_options": {"include_usage": True}}) as r:
            events = sse_payloads(list(r.iter_lines()))
    message = whole["choices"][0]["message"]
    assert message["content"] == "Checking both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"}),
                                                ("get_time", {"zone": "CET"})]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"

    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 1
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking both."
    streamed_calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["index"] for c in streamed_calls] == [0, 1]
    for got, want in zip(streamed_calls, message["tool_calls"], strict=True):
        assert CALL_ID.fullmatch(got["id"]) and got["type"] == "function"
        assert got["function"] == want["function"]
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-2]]
    assert finishes == [None] * (len(finishes) - 1) + ["tool_calls"]


def test_the_official_client_streams_calls_and_n_choices_are_independent(client, engine):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, n=2, stream=True,
        extra_body=forcing(engine, TWO_CALLS)))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        content = "".join(c.delta.content or "" for c in mine)
        calls = [t for c in mine for t in c.delta.tool_calls or ()]
        assert content == "Checking both."
        assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather"),
                                                               (1, "get_time")]
        assert mine[-1].finish_reason == "tool_calls"
    ids = [t.id for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert len(set(ids)) == 4  # every call its own id


def test_a_call_of_an_unknown_function_is_left_as_content(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       extra_body=forcing(engine, UNKNOWN_CALL))
    assert r.choices[0].message.content == ROCKETS_CALL
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_call_cut_by_max_tokens_stays_content_with_finish_reason_length(server, engine):
    """The reply hits max_tokens (no stop string): even a whole call in it is not taken,
    streamed or not."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 1,
            "logit_bias": {str(engine.tokenizer.token_id(ONE_CALL)): 100}}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        events = sse_payloads(http.post("/v1/chat/completions",
                                        json={**body, "stream": True}).text.splitlines())
    assert whole["message"] == {"role": "assistant", "content": ONE_CALL}
    assert whole["finish_reason"] == "length"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == ONE_CALL
    assert not any("tool_calls" in d for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_tool_choice_none_shows_the_tools_but_parses_nothing(client, engine):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, extra_body=forcing(engine, ONE_CALL))
    auto = client.chat.completions.create(**kwargs, tool_choice="auto")
    none = client.chat.completions.create(**kwargs, tool_choice="none")
    assert none.choices[0].message.content == WEATHER_CALL
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens  # the same prompt, tools in


def test_without_parallel_tool_calls_only_the_first_call_is_returned(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       parallel_tool_calls=False,
                                       extra_body=forcing(engine, TWO_CALLS))
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].message.content == "Checking both."


def test_without_tools_the_same_text_is_plain_content(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ASK,
                                       extra_body=forcing(engine, ONE_CALL))
    assert r.choices[0].message.content == WEATHER_CALL
    assert r.choices[0].finish_reason == "stop"


# -- the conversation that comes back -------------------------------------------------------

def test_tools_calls_and_tool_results_reach_the_template(client, engine, server,
                                                          monkeypatch):
    """The agent loop with the official client: the reply's message is sent back as it
    is (and as a dict with nulls, as other clients send it), with the tool's answer. The
    prompt the engine ran is the template's rendering of the conversation in HF's form."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           extra_body=forcing(engine, ONE_CALL))
    message = first.choices[0].message
    call_id = message.tool_calls[0].id
    answer = {"role": "tool", "tool_call_id": call_id, "content": '{"celsius": 22}'}
    prompts: list[str] = []
    prepare = engine.prepare_chat

    def spy(messages, tools=None, template_kwargs=None):
        prompt = prepare(messages, tools, template_kwargs)
        prompts.append(prompt.chat_text)
        return prompt

    monkeypatch.setattr(engine, "prepare_chat", spy)
    for sent in (message, message.model_dump()):
        r = client.chat.completions.create(model=MODEL, messages=[*ASK, sent, answer],
                                           tools=TOOLS, max_tokens=2)
        assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompts[-1]))
    hf_form = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": call_id,
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"celsius": 22}'}]
    expected = ChatTemplate(QWEN25_TEMPLATE).render(hf_form, tools=TOOLS)
    assert prompts == [expected, expected]
    assert json.dumps(WEATHER) in expected  # the schema, as the template shows it
    assert "<|im_start|>assistant\n" + WEATHER_CALL + "<|im_end|>\n" in expected
    assert '<tool_response>\n{"celsius": 22}\n</tool_response>' in expected
    assert_idle_and_nothing_leaked(engine, server)


def test_the_protocol_converts_openai_tool_messages_to_the_templates_form():
    req = parse_chat_request({
        "model": MODEL, "tools": [WEATHER, {**TIME, "function": {
            **TIME["function"], "strict": False}}],
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": "Checking.", "refusal": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "n": [1, 2]}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text",
                                                                "text": "22 C"}]},
        ]})
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "id": "c1", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "c1"},
    ]
    assert req.template_tools == [WEATHER, TIME]  # `strict` is not the model's business


# -- which models can take tools ------------------------------------------------------------

def test_the_request_gets_the_parser_its_template_calls_for():
    def parser(template, **fields):
        return parse_chat_request({"model": MODEL, "messages": ASK, "tools": TOOLS,
                                   **fields}).tool_parser(template)

    assert parser(ChatTemplate(QWEN25_TEMPLATE)).format is ToolCallFormat.HERMES
    assert parser(ChatTemplate(LLAMA31_TEMPLATE)).format is ToolCallFormat.LLAMA3_JSON
    assert parser(ChatTemplate(QWEN25_TEMPLATE)).names == {"get_weather", "get_time"}
    assert parser(ChatTemplate(QWEN25_TEMPLATE), tool_choice="none") is None
    assert parser(ChatTemplate(QWEN25_TEMPLATE), parallel_tool_calls=False).parallel is False
    no_tools = parse_chat_request({"model": MODEL, "messages": ASK, "tools": []})
    assert no_tools.tool_parser(ChatTemplate.builtin("gemma3")) is None

    mistral_like = ChatTemplate("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
                                "{% endif %}{{ messages[0].content }}[TOOL_CALLS]")
    with pytest.raises(OpenAIError, match="format this server does not parse") as e:
        parser(mistral_like)
    assert (e.value.status, e.value.param) == (400, "tools")
    assert parser(mistral_like, tool_choice="none") is None  # shown, nothing to parse
    for no_tool_template in (ChatTemplate.builtin("gemma3"), ChatTemplate.builtin("qwen3")):
        with pytest.raises(OpenAIError, match="does not support tools") as e:
            parser(no_tool_template, tool_choice="none")
        assert (e.value.status, e.value.param, e.value.code) == (
            400, "tools", "unsupported_parameter")


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    spec = tiny_spec("llama", context_length=4096, chat_template=LLAMA31_TEMPLATE,
                     extra_specials=("<|python_tag|>", "<|eom_id|>", LLAMA_CALL))
    path = write_synthetic_model(tmp_path_factory.mktemp("tools") / "llama.gguf", spec)
    with Engine.load(path, page_size=16384, kv_budget_bytes=64 << 20,
                     model_name=MODEL) as e, LiveServer(create_app(e)) as s:
        yield e, s


def test_a_llama31_model_calls_in_json_after_the_python_tag(llama_server):
    engine, server = llama_server
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **forcing(engine, LLAMA_CALL)}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        events = sse_payloads(http.post("/v1/chat/completions",
                                        json={**body, "stream": True}).text.splitlines())
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert not any(d.get("content") for d in deltas)  # the held start was never shown
    (streamed,) = [c for d in deltas for c in d.get("tool_calls", ())]
    assert streamed["function"] == call["function"] and streamed["index"] == 0
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


# -- bad tool fields: the right error, then the server still serves -------------------------

def chat(**fields):
    return {"model": MODEL, "messages": ASK, **fields}


def conversation(*messages):
    return chat(tools=TOOLS, messages=[*ASK, *messages])


def assistant_call(arguments='{"city": "Paris"}', **call):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}, **call}]}


BAD_TOOL_REQUESTS = [
    # (body, param, code)
    (chat(tools="get_weather"), "tools", "invalid_type"),
    (chat(tools=[{"type": "function"}]), "tools[0].function", None),
    (chat(tools=[{"type": "function", "function": {"description": "x"}}]),
     "tools[0].function.name", None),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name",
     "invalid_value"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type",
     "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools[0].function.parameters", "invalid_type"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "returns": {}}}]),
     "tools[0].function.returns", "unknown_parameter"),
    (chat(tools=[WEATHER, WEATHER]), "tools", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
     "tools[0].function.strict", "invalid_type"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}}),
     "tool_choice", "invalid_value"),
    (chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integr"}}}}}],
        tool_choice="required"), "tool_choice", None),
    (chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (chat(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "invalid_value"),
    (chat(tools=TOOLS, tool_choice=1), "tool_choice", "invalid_type"),
    (chat(tools=TOOLS, parallel_tool_calls="no"), "parallel_tool_calls", "invalid_type"),
    (chat(functions=[WEATHER["function"]]), "functions", "unsupported_parameter"),
    (conversation(assistant_call("{city: Paris}")),
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    (conversation(assistant_call("[1]")), "messages[1].tool_calls[0].function.arguments",
     "invalid_value"),
    (conversation(assistant_call(id=None)), "messages[1].tool_calls[0].id", None),
    (conversation(assistant_call(type="code")), "messages[1].tool_calls[0].type",
     "invalid_value"),
    (conversation(assistant_call(), {"role": "tool", "content": "22 C"}),
     "messages[2].tool_call_id", None),
    (conversation({"role": "user", "content": "x", "tool_call_id": "c1"}),
     "messages[1].tool_call_id", "invalid_value"),
    (conversation({**assistant_call(), "role": "user"}), "messages[1].tool_calls",
     "invalid_value"),
]


@pytest.mark.parametrize("body, param, code", BAD_TOOL_REQUESTS)
def test_bad_tool_fields_get_a_400_naming_them_and_the_server_keeps_serving(
        server, engine, body, param, code):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        assert error["param"] == param
        if code is not None:
            assert error["code"] == code
        good = http.post("/v1/chat/completions",
                         json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                               **forcing(engine, ONE_CALL)})
        assert good.status_code == 200
        assert good.json()["choices"][0]["finish_reason"] == "tool_calls"


# -- the Python API ------------------------------------------------------------------------------

def test_the_python_api_shows_tools_and_its_text_parses_as_the_server_does(engine):
    """Engine.chat_complete(tools=...) renders the tools into the prompt (the same ids as
    prepare_chat with them); the reply is text, and ToolCallParser makes it the call."""
    import anyio

    from eagerlm.dispatch.messages import FinishReason
    from eagerlm.kernels.sampling import SamplingParams
    from eagerlm.service.api.tool_calls import ToolCallParser, format_of_template

    params = SamplingParams(temperature=0.0, max_tokens=4, stop=(END,),
                            logit_bias={engine.tokenizer.token_id(ONE_CALL): 100})
    with_tools = anyio.run(lambda: engine.chat_complete(ASK, params, tools=TOOLS))
    without = anyio.run(lambda: engine.chat_complete(ASK, params))
    assert with_tools.prompt_tokens == len(engine.prepare_chat(ASK, TOOLS).ids)
    assert with_tools.prompt_tokens > without.prompt_tokens
    from eagerlm.service.api.sync_engine import SyncEngine

    again = SyncEngine(engine).chat_complete(ASK, params, tools=TOOLS)  # a prefix-cache hit
    assert (again.text, again.prompt_tokens) == (with_tools.text, with_tools.prompt_tokens)
    parser = ToolCallParser(format_of_template(engine.model.chat_template),
                            [t["function"]["name"] for t in TOOLS])
    reply = parser.reply(with_tools.text, with_tools.finish_reason is FinishReason.STOP)
    (call,) = reply.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
