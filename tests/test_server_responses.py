"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client, over
loopback with the real engine, on a synthetic qwen3 model carrying Qwen3's real chat
template (it shows tools and writes `<think>` blocks).

As in tests/test_server_tools.py, whole scripted replies are single special tokens, forced
with `logit_bias` +100 and ended with `stop` (vLLM's and SGLang's extensions of this API),
so the real engine writes exactly the text a test wants. The stream is read by the SDK's
own `responses.stream` helper, which checks the events' order and identities; the
structured output is checked with `jsonschema`, the independent checker. Also here: the
store's bounds and 404s, and hostile bodies (each a 4xx in OpenAI's error format).
"""

from __future__ import annotations

import copy
import json
import random

import httpx
import jsonschema
import openai
import pytest

from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.responses_request import parse_responses_request
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_server import LiveServer, sse_payloads
from tests.test_server_reasoning import (
    ANSWER,
    END,
    QWEN3_TEMPLATE,
    THINK_REPLY,
    THINK_THEN_CALL,
    THOUGHT,
)

MODEL = "tiny-apis"
MARKDOWN = "Here is **bold** and code:\n```python\nprint('hi')\n```"
MARKDOWN_REPLY = MARKDOWN + END
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Shared with tests/test_server_anthropic.py and tests/test_webui.py."""
    spec = tiny_spec("qwen3", context_length=4096, chat_template=QWEN3_TEMPLATE,
                     extra_specials=("<tool_call>", "</tool_call>", THINK_REPLY,
                                     THINK_THEN_CALL, MARKDOWN_REPLY))
    path = write_synthetic_model(tmp_path_factory.mktemp("apis") / "qwen3.gguf", spec)
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


def scripted(engine: Engine, script: str) -> dict:
    """Extension fields that make the model write `script` (without END) and stop."""
    return {"extra_body": {"logit_bias": {str(engine.tokenizer.token_id(script)): 100},
                           "stop": [END]}, "max_output_tokens": 4}


def test_a_response_carries_the_reasoning_item_then_the_message(client, engine):
    r = client.responses.create(model=MODEL, input="hello", **scripted(engine, THINK_REPLY))
    assert (r.object, r.status, r.model) == ("response", "completed", MODEL)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [f"\n{THOUGHT}\n"]
    assert (message.type, message.role, message.status) == ("message", "assistant",
                                                            "completed")
    assert r.output_text == ANSWER
    assert r.usage.output_tokens == 1 and r.usage.total_tokens == r.usage.input_tokens + 1
    assert client.responses.retrieve(r.id).output_text == ANSWER  # stored by default


def test_the_sdks_stream_helper_assembles_the_same_response(client, engine):
    with client.responses.stream(model=MODEL, input="hello",
                                 **scripted(engine, THINK_REPLY)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == f"\n{THOUGHT}\n"
    assert final.output_text == ANSWER and final.status == "completed"
    # the streamed items are the final response's, ids and all
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in final.output]


def test_a_function_call_round_trip_continues_the_stored_conversation(client, engine):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                    **scripted(engine, THINK_THEN_CALL))
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.status == "completed"

    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        **scripted(engine, THINK_REPLY))
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # the earlier turn is the new prompt's prefix: the prefix cache reuses all of it
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_the_continued_conversation_shows_the_call_and_its_output_to_the_template(engine):
    """What the round trip above sends the model, rendered by Qwen3's real template."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "id": "call_1",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    req = parse_responses_request({"model": MODEL, "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    text = engine.prepare_chat(req.conversation(history)).chat_text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_items_sent_back_whole_render_as_the_same_conversation(engine):
    """Stateless clients send the output items back (reasoning, call, its output)."""
    req = parse_responses_request({"model": MODEL, "instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I need the weather."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]}]})
    assert req.conversation([]) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the weather.",
         "tool_calls": [{"type": "function", "id": "call_1", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "system", "content": "Answer now."}]


def test_a_forced_call_streams_its_arguments_and_follows_the_schema(client):
    tools = [{**TOOLS[0], "parameters": {  # bounded, so the random model ends it soon
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 8},
                       "days": {"type": "integer"}}}}]
    with client.responses.stream(model=MODEL, input="weather", tools=tools,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=96, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and final.status == "completed"
    jsonschema.validate(json.loads(call.arguments), tools[0]["parameters"])
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments


def test_text_format_json_schema_output_validates(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "days": {"type": "integer"}}}
    r = client.responses.create(model=MODEL, input="A trip as JSON.", temperature=0,
                                max_output_tokens=64, text={"format": {
                                    "type": "json_schema", "name": "trip", "schema": schema}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client, server, engine):
    no_end = {"logit_bias": {str(t): -100 for t in engine.tokenizer.end_ids}}
    r = client.responses.create(model=MODEL, input="go on", max_output_tokens=3,
                                extra_body=no_end, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete"
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(r.id)
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 3, "stream": True,
            **no_end}
    lines = httpx.post(server.url + "/v1/responses", json=body, timeout=30).text.splitlines()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = sse_payloads(lines)
    assert names == [p["type"] for p in payloads] and names[-1] == "response.incomplete"


def test_stored_responses_are_bounded_and_a_missing_one_is_an_openai_404(engine):
    with LiveServer(create_app(engine, ServerConfig(responses_stored=2))) as s, \
            s.openai() as c:
        ids = [c.responses.create(model=MODEL, input="hi", max_output_tokens=1).id
               for _ in range(3)]
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.retrieve(ids[0])  # the oldest, evicted
        assert e.value.body["type"] == "invalid_request_error"
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model=MODEL, input="hi", previous_response_id=ids[0])
        assert e.value.body["param"] == "previous_response_id"
        c.responses.delete(ids[1])
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[1])
    with LiveServer(create_app(engine, ServerConfig(responses_store_bytes=100))) as s, \
            s.openai() as c:
        r = c.responses.create(model=MODEL, input="hi", max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):  # over the byte budget alone: not kept
            c.responses.retrieve(r.id)


HOSTILE = [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [7]}, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
     "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": f"f{i}"} for i in range(200)]},
     "tools"),
    ({"input": "hi", "tools": TOOLS * 2}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "hi", "text": {"verbosity": "high"}}, "text.verbosity"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({}, "input"),
]


@pytest.mark.parametrize("fields, param", HOSTILE, ids=[p for _, p in HOSTILE])
def test_a_hostile_body_is_a_400_in_openais_format_naming_the_field(server, fields, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


# values a careless or hostile client puts anywhere in a body
ODD_VALUES = (None, 0, -1, 2**70, 1.5, -1e308, True, "", "x", "user", "text", "function",
              [], {}, [{}], [None], {"type": "text"}, {"type": "x"}, "é" * 300)


def mutated(body: dict, rng: random.Random) -> dict:
    """`body` with one to three values replaced, removed or added at random places."""
    def places(node, path=()):
        yield path
        children = (node.items() if isinstance(node, dict)
                    else enumerate(node) if isinstance(node, list) else ())
        for key, child in children:
            yield from places(child, (*path, key))

    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        *parent_path, key = rng.choice([p for p in places(body) if p])
        parent = body
        for step in parent_path:
            parent = parent[step]
        roll = rng.random()
        if roll < 0.15 and isinstance(parent, dict):
            del parent[key]
        elif roll < 0.25 and isinstance(parent, dict):
            parent[f"extra_{rng.randint(0, 9)}"] = rng.choice(ODD_VALUES)
        else:
            parent[key] = copy.deepcopy(rng.choice(ODD_VALUES))
    return body


def assert_never_a_500(server, route: str, body: dict, n: int, seed: int,
                       headers: dict | None = None) -> dict[int, int]:
    """`n` mutations of a valid body: every answer a 2xx or a 4xx in the route's error
    format; returns the count of each status."""
    rng, counts = random.Random(seed), {}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as http:
        assert http.post(route, json=body).status_code == 200
        for _ in range(n):
            sent = mutated(body, rng)
            r = http.post(route, json=sent)
            assert r.status_code < 500, (sent, r.text)
            assert r.status_code < 300 or r.json()["error"]["message"], (sent, r.text)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
    return counts


def test_mutated_bodies_never_get_a_500(server):
    body = {"model": MODEL, "max_output_tokens": 2, "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "reasoning", "id": "rs", "summary": [],
                       "content": [{"type": "reasoning_text", "text": "hmm"}]},
                      {"type": "function_call", "call_id": "c", "name": "get_weather",
                       "arguments": '{"city": "Paris"}'},
                      {"type": "function_call_output", "call_id": "c", "output": "sunny"}],
            "tools": TOOLS, "tool_choice": "auto", "text": {"format": {"type": "text"}},
            "reasoning": {"effort": "low"}, "temperature": 0.5, "store": False}
    counts = assert_never_a_500(server, "/v1/responses", body, 80, seed=1)
    assert counts.get(400, 0) > 25 and counts.get(200, 0) > 2  # both kinds were tried


def test_a_body_that_is_no_object_or_no_json_is_a_400_and_a_wrong_model_a_404(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for raw in (b"[1, 2]", b"{", b'"text"'):
            r = http.post("/v1/responses", content=raw,
                          headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json(), raw
        r = http.post("/v1/responses", json={"model": "gpt-9", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
