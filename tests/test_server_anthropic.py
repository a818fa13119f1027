"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official
`anthropic` client, over loopback with the real engine, on the synthetic qwen3 model of
tests/test_server_responses.py (Qwen3's real template: tools and `<think>` blocks).

Scripted replies as there: a whole reply is one special token, forced with `logit_bias`
+100 (llama-server's extension) and ended by a stop sequence. The stream is read by the
SDK's `messages.stream` helper, which builds the message from the events and refuses
events out of order. Also here: errors in Anthropic's body on every path under
/v1/messages (a wrong key, an oversized body, a wrong content type, an unknown route),
the key from `x-api-key`, and hostile bodies (each a 4xx, never a 500).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from eagerlm.service.http.anthropic_request import parse_messages_request
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_server import LiveServer
from tests.test_server_reasoning import ANSWER, END, THINK_REPLY, THINK_THEN_CALL, THOUGHT
from tests.test_server_responses import MODEL, assert_never_a_500
from tests.test_server_responses import engine as engine  # the module-scoped model

HI = [{"role": "user", "content": "hello"}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig(api_key="sk-test",
                                                    max_body_bytes=64 << 10))) as s:
        yield s


@pytest.fixture()
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0,
                             timeout=30) as c:  # sends the key as x-api-key
        yield c


def scripted(engine, script: str) -> dict:
    return {"max_tokens": 4, "stop_sequences": [END],
            "extra_body": {"logit_bias": {str(engine.tokenizer.token_id(script)): 100}}}


def test_a_message_carries_the_thinking_then_the_text(client, engine):
    m = client.messages.create(model=MODEL, messages=HI, **scripted(engine, THINK_REPLY))
    assert (m.type, m.role, m.model) == ("message", "assistant", MODEL)
    thinking, text = m.content
    assert (thinking.type, thinking.thinking) == ("thinking", f"\n{THOUGHT}\n")
    assert (text.type, text.text) == ("text", ANSWER)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", END)
    assert m.usage.output_tokens == 1
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model=MODEL, messages=HI).input_tokens


def test_the_sdks_stream_helper_assembles_the_same_message(client, engine):
    with client.messages.stream(model=MODEL, messages=HI,
                                **scripted(engine, THINK_REPLY)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == [
        "thinking_delta", "text_delta"]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == ANSWER and final.stop_reason == "stop_sequence"
    assert final.usage.output_tokens == 1


def test_a_tool_use_and_tool_result_round_trip(client, engine):
    first = client.messages.create(model=MODEL, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        **scripted(engine, THINK_THEN_CALL))
    assert first.stop_reason == "tool_use"
    thinking, call = first.content
    assert thinking.thinking == "\nI need the weather.\n"
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                          for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "sunny"}]}]
    second = client.messages.create(model=MODEL, messages=conversation, tools=TOOLS,
                                    **scripted(engine, THINK_REPLY))
    assert second.content[-1].text == ANSWER
    # the whole earlier exchange is the new prompt's prefix: the prefix cache reuses it
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=conversation, tools=TOOLS)
    assert counted.input_tokens == (second.usage.input_tokens
                                    + second.usage.cache_read_input_tokens)
    # what the model saw, rendered by Qwen3's real template
    req = parse_messages_request({"model": MODEL, "max_tokens": 4, "tools": TOOLS,
                                  "messages": conversation})
    text = engine.prepare_chat(req.template_messages(), req.template_tools()).chat_text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_streamed_tool_use_arrives_as_one_input_json_delta(client, engine):
    with client.messages.stream(model=MODEL, messages=HI, tools=TOOLS,
                                **scripted(engine, THINK_THEN_CALL)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert [d.partial_json for d in deltas] == ['{"city": "Paris"}']
    assert final.content[-1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_tool_choice_any_forces_a_call_that_follows_the_schema(client):
    tools = [{**TOOLS[0], "input_schema": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}]
    m = client.messages.create(model=MODEL, messages=HI, tools=tools, max_tokens=64,
                               tool_choice={"type": "any"}, extra_body={"temperature": 0})
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.input["city"] in ("Paris", "Oslo") and m.stop_reason == "tool_use"


def test_output_config_format_is_a_json_schema_the_reply_follows(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "days": {"type": "integer"}}}
    m = client.messages.create(model=MODEL, messages=HI, max_tokens=64,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}},
                               extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn", m.content
    jsonschema.validate(json.loads(m.content[-1].text), schema)


def test_thinking_disabled_reaches_the_template_and_max_tokens_cuts(client, engine):
    counts = [client.messages.count_tokens(model=MODEL, messages=HI, **extra).input_tokens
              for extra in ({}, {"thinking": {"type": "disabled"}})]
    assert counts[1] > counts[0]  # Qwen3's template adds an empty <think> block
    no_end = {str(t): -100 for t in engine.tokenizer.end_ids}
    m = client.messages.create(model=MODEL, messages=HI, max_tokens=2,
                               extra_body={"logit_bias": no_end})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_errors_on_every_path_under_v1_messages_are_in_anthropics_body(server):
    def error_of(r: httpx.Response) -> tuple[int, str]:
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return r.status_code, body["error"]["type"]

    key = {"x-api-key": "sk-test"}
    body = {"model": MODEL, "max_tokens": 4, "messages": HI}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert error_of(http.post("/v1/messages", json=body)) == (401, "authentication_error")
        assert error_of(http.post("/v1/messages", json=body, headers={
            "x-api-key": "wrong"})) == (401, "authentication_error")
        assert http.post("/v1/messages", json=body, headers={
            "authorization": "Bearer sk-test"}).status_code == 200  # either header
        assert error_of(http.post("/v1/messages/nope", json=body, headers=key)) == \
            (404, "not_found_error")
        assert error_of(http.post("/v1/messages", json={**body, "model": "claude"},
                                  headers=key)) == (404, "not_found_error")
        assert error_of(http.post("/v1/messages", content=b"x" * (65 << 10),
                                  headers={**key, "content-type": "application/json"})) == \
            (413, "request_too_large")
        assert error_of(http.post("/v1/messages", content=b"{}",
                                  headers={**key, "content-type": "text/plain"})) == \
            (415, "invalid_request_error")
        # the OpenAI routes keep OpenAI's body
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


HOSTILE = [
    {"max_tokens": None},
    {"max_tokens": 0},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
    {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "user", "content": [7]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                "input": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"messages": [{"role": "system", "content": "hi"}]},
    {"messages": HI + [{"role": "assistant", "content": "Sure"}]},
    {"messages": []},
    {"system": [{"type": "image"}]},
    {"tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(200)]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [{"name": "f"}]},
    {"tools": TOOLS * 2},
    {"tool_choice": {"type": "any"}},
    {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"thinking": {"type": "enabled", "budget_tokens": 2048}},
    {"temperature": 1.5},
    {"stop_sequences": "END"},
    {"logit_bias": {"x": 1}},
    {"output_config": {"format": {"type": "json_schema"}}},
    {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
    {"tools": TOOLS, "tool_choice": {"type": "any"},
     "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    {"container": "c"},
]


@pytest.mark.parametrize("fields", HOSTILE)
def test_a_hostile_body_is_a_400_in_anthropics_format(server, fields):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "sk-test"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"]


def test_mutated_bodies_never_get_a_500(server):
    body = {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "tool_use", "id": "t", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                              "content": [{"type": "text", "text": "sun"}]}]}],
            "tools": TOOLS, "tool_choice": {"type": "auto"}, "stop_sequences": ["zz"],
            "thinking": {"type": "disabled"}, "temperature": 0.5, "top_k": 3}
    for route, sent, seed in (("/v1/messages", body, 1), ("/v1/messages/count_tokens", {
            k: v for k, v in body.items() if k in ("model", "messages", "system", "tools")},
            2)):
        counts = assert_never_a_500(server, route, sent, 50, seed, {"x-api-key": "sk-test"})
        assert counts.get(400, 0) > 15 and counts.get(200, 0) > 1, counts
