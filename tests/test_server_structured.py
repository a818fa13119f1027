"""Structured output through the OpenAI-compatible server, over loopback with the real
engine: `response_format` (through the official `openai` client's `parse` with a pydantic
model, and as a raw schema), llama.cpp's `json_schema` and `grammar` fields, forced tool
calls (`tool_choice` "required" and named, `strict` tools), and the 400s of invalid schemas
and grammars. The model is tests/test_server_tools.py's synthetic Qwen2.5-template model:
its random weights want anything, so whatever parses and validates here does so because
of the constraint. `jsonschema` is the independent checker."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pydantic
import pytest

from tests.test_server_tools import ASK, MODEL, chat
from tests.test_server_tools import engine as engine  # the module-scoped tools model
from tests.test_server_tools import server as server

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY,
                                            "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}


@pytest.fixture()
def client(server):
    with server.openai(60) as c:
        yield c


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)
    sunny: bool


def test_the_openai_clients_parse_gets_an_instance_of_the_pydantic_model(client):
    for seed in (1, 2):
        completion = client.chat.completions.parse(
            model=MODEL, messages=ASK, response_format=Forecast, max_tokens=48, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)


def test_a_json_schema_response_format_validates_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                  "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                           max_tokens=40, temperature=0)
    jsonschema.validate(json.loads(whole.choices[0].message.content), CITY)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                            max_tokens=40, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_json_object_gives_an_object_or_a_reply_cut_by_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30,
                                           response_format={"type": "json_object"}, seed=4)
    choice = reply.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length"


def test_llama_cpp_json_schema_and_grammar_fields_on_both_routes(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "City:",
                                               "json_schema": CITY, "max_tokens": 40})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), CITY)
        for route, body in (("/v1/completions", {"prompt": "Answer:"}),
                            ("/v1/chat/completions", {"messages": ASK})):
            r = http.post(route, json={"model": MODEL, "max_tokens": 10, **body,
                                       "grammar": 'root ::= ("yes" | "no") "!"'})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert text in ("yes!", "no!") and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_is_a_call_whose_arguments_validate(client, tool_choice):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
            max_tokens=64, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        schema = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}[
            call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_auto_stays_unconstrained_with_strict_tools(server, engine):
    """strict: true is accepted; under "auto" the model's text is free, as before."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat(
            tools=[WEATHER], tool_choice="auto", max_tokens=8, temperature=0))
        assert r.status_code == 200, r.text
        free = http.post("/v1/chat/completions", json=chat(
            tools=[{"type": "function", "function": {**WEATHER["function"], "strict": False}}],
            max_tokens=8, temperature=0))
        assert r.json()["choices"][0]["message"] == free.json()["choices"][0]["message"]


BAD = [
    # (body, param, message fragment)
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}),
     "response_format.json_schema.schema", "objectx"),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "[a-"}}}),
     "response_format.json_schema.schema", "regex"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": CITY}}),
     "response_format.json_schema.name", "name"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema",
     "json_schema"),
    (chat(response_format={"type": "yaml"}), "response_format.type", "yaml"),
    (chat(response_format={"type": "json_object", "schema": CITY}),
     "response_format.schema", "schema"),
    (chat(grammar="root ::= missing"), "grammar", "missing"),
    (chat(json_schema={"type": "integer", "minimum": "zero"}), "json_schema", "minimum"),
    (chat(json_schema=CITY, grammar='root ::= "a"'), "grammar", "at most one"),
    ({"model": MODEL, "prompt": "x", "grammar": 'root ::= ("a"'}, "grammar", "Expected"),
]


@pytest.mark.parametrize("body, param, fragment", BAD)
def test_an_invalid_schema_or_grammar_is_a_400_naming_the_field(server, body, param,
                                                                 fragment):
    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(route, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert re.search(re.escape(fragment), error["message"], re.IGNORECASE), error
        ok = http.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert ok.status_code == 200  # and the server keeps serving
