"""gpt-oss's harmony replies through the server, over loopback with the official openai
client, on a synthetic gpt-oss model carrying gpt-oss's real chat template
(tests/fixtures/gpt_oss_chat_template.jinja: OpenAI's template for gpt-oss-120b, as
llama.cpp's models/templates/openai-gpt-oss-120b.jinja holds it).

As in tests/test_server_tools.py, whole scripted replies are single special tokens forced
with `logit_bias` +100 and ended with `stop: [END]`, so the real engine (template,
tokenizer, dispatcher, stop logic) writes exactly the harmony text a test wants: the
`analysis` channel must come back as `reasoning_content`, the `final` channel as `content`,
and a `commentary` message to `functions.NAME` as an OpenAI tool call. Also here: the
harmony splitter itself (any chunking equals the whole), its stop gate, `reasoning_effort`
reaching the template, an earlier turn's reasoning and call sent back, and a forced call.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import jsonschema
import pytest

from eagerlm.dispatch.harmony import HarmonyGate, HarmonyStream, split_harmony
from eagerlm.dispatch.reasoning import ReasoningFormat
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.tool_calls import ToolCallFormat, format_of_template
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_server import LiveServer, sse_payloads
from tests.test_server_tools import END, forcing

TEMPLATE = (Path(__file__).parent / "fixtures" / "gpt_oss_chat_template.jinja").read_text()
MODEL = "tiny-gpt-oss"
THOUGHT = "The user greets me. I could say END-less things."
REPLY = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
         f"<|start|>assistant<|channel|>final<|message|>Hello there!{END}")
CALL = ("<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        f'{{"city": "Paris"}}{END}')
# the recipient in the role's header, after a preamble in the commentary channel
ROLE_CALL = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant "
             "to=functions.get_weather<|channel|>commentary json<|message|>"
             f'{{"city": "Berlin"}}{END}')
UNKNOWN_CALL = ("<|channel|>commentary to=functions.launch_rockets <|constrain|>json"
                f"<|message|>{{}}{END}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HI = [{"role": "user", "content": "hello"}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# -- the splitter ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, reasoning, content", [
    ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hi.", "hmm", "Hi."),
    ("<|channel|>final<|message|>Hi.", None, "Hi."),
    ("Plain text, no harmony.", None, "Plain text, no harmony."),
    ("<|channel|>analysis<|message|>cut off by max_tokens", "cut off by max_tokens", ""),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}",
     None, "<|channel|>commentary to=functions.f<|message|>{}<|call|>"),
    # gpt-oss-20b's stray commentary channel before the analysis
    ("<|channel|>commentary<|channel|>analysis<|message|>a<|end|><|start|>assistant"
     "<|channel|>final<|message|>b", "a", "b"),
    ("", None, ""),
])
def test_split_harmony(text, reasoning, content):
    split = split_harmony(text)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_streamed_in_any_chunking_the_split_equals_the_whole_split():
    rng = random.Random(3)
    for text in (REPLY, CALL, ROLE_CALL, "plain", "<|channel|>analysis<|message|>a<|en"):
        whole = split_harmony(text)
        for _ in range(60):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(12, len(text)))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = HarmonyStream()
            r = c = ""
            for piece in pieces:
                dr, dc = stream.push(piece)
                r, c = r + dr, c + dc
            dr, dc = stream.finish()
            assert (r + dr, c + dc) == (whole.reasoning or "", whole.content), pieces
            gate = HarmonyGate()  # the raw text, unchanged, cut after the analysis
            parts = [gate.push(p) for p in pieces] + [gate.flush()]
            assert "".join(a + b for a, b in parts) == text
            assert THOUGHT not in "".join(b for _, b in parts)


def test_the_template_makes_the_format_harmony():
    template = ChatTemplate(TEMPLATE)
    assert ReasoningFormat.AUTO.resolve(template) is ReasoningFormat.HARMONY
    assert ReasoningFormat.DEEPSEEK.resolve(template) is ReasoningFormat.HARMONY
    assert ReasoningFormat.NONE.resolve(template) is ReasoningFormat.NONE
    assert format_of_template(template) is ToolCallFormat.HARMONY


# -- through the server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    spec = tiny_spec("gpt-oss", context_length=4096, rope_scaling=None,
                     rope_scaling_factor=None, rope_original_context=None,
                     vocab_size=640, chat_template=TEMPLATE,
                     extra_specials=(END, REPLY, CALL, ROLE_CALL, UNKNOWN_CALL))
    path = write_synthetic_model(tmp_path_factory.mktemp("oss") / "gpt-oss.gguf", spec)
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


def test_analysis_is_reasoning_content_and_final_is_content(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=HI,
                                       **_fields(engine, REPLY))
    message = r.choices[0].message
    assert message.content == "Hello there!"
    assert message.reasoning_content == THOUGHT  # the stop string in it did not stop it
    assert r.choices[0].finish_reason == "stop"


def test_streamed_the_channels_arrive_as_their_deltas(server, engine):
    body = {"model": MODEL, "messages": HI, "stream": True, **forcing(engine, REPLY)}
    lines = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).text
    deltas = [p["choices"][0]["delta"] for p in sse_payloads(lines.splitlines())
              if p != "[DONE]" and p["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there!"


@pytest.mark.parametrize("script, city", [(CALL, "Paris"), (ROLE_CALL, "Berlin")])
def test_a_commentary_call_comes_back_as_tool_calls(client, engine, script, city):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       **_fields(engine, script))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": city}
    if script is CALL:
        assert choice.message.content is None
        assert choice.message.reasoning_content == "I need the weather."
    else:  # the preamble is content
        assert choice.message.content == "Checking."


def test_a_streamed_call_arrives_as_a_tool_call_delta(client, engine):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                            stream=True, **_fields(engine, CALL))
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_of_an_unknown_function_stays_content(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       **_fields(engine, UNKNOWN_CALL))
    assert r.choices[0].message.tool_calls is None
    assert "launch_rockets" in r.choices[0].message.content


def test_reasoning_effort_reaches_the_template(client, engine):
    def prompt_tokens(effort: str) -> int:
        r = client.chat.completions.create(model=MODEL, messages=HI, reasoning_effort=effort,
                                           **_fields(engine, REPLY))
        return r.usage.prompt_tokens

    for effort in ("low", "medium", "high"):
        text = engine.prepare_chat(HI, template_kwargs={"reasoning_effort": effort})
        assert f"Reasoning: {effort}\n" in text.chat_text
        assert prompt_tokens(effort) == len(text.ids)
    assert len({len(engine.prepare_chat(HI, template_kwargs={"reasoning_effort": e}).ids)
                for e in ("low", "medium", "high")}) > 1  # so the counts tell them apart


def test_an_earlier_call_and_its_reasoning_go_back_to_the_template(client, engine):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           **_fields(engine, CALL))
    message = first.choices[0].message
    (call,) = message.tool_calls
    turn = {"role": "assistant", "content": None,
            "reasoning_content": message.reasoning_content,
            "tool_calls": [{"id": call.id, "type": "function",
                            "function": {"name": call.function.name,
                                         "arguments": call.function.arguments}}]}
    history = [*ASK, turn, {"role": "tool", "tool_call_id": call.id, "content": "20 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       **_fields(engine, REPLY))
    assert r.choices[0].message.content == "Hello there!"
    # what the server hands the template (as llama.cpp does): the reasoning as `thinking`,
    # in place of the content, and the arguments parsed
    sent = {"role": "assistant", "thinking": turn["reasoning_content"],
            "tool_calls": [{"type": "function", "id": call.id, "function": {
                "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}
    prompt = engine.prepare_chat([*ASK, sent], [WEATHER]).chat_text
    assert ("<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
            '<|message|>{"city": "Paris"}<|call|>') in prompt


def test_a_forced_call_is_one_harmony_call_with_valid_arguments(client):
    """The random model writes whatever the constraint allows: a bounded schema, checked
    by jsonschema."""
    city = {"type": "object", "additionalProperties": False, "required": ["city"],
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": city,
                                             "description": "Weather"}}  # the template wants one
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[tool], max_tokens=64, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), city)


def _fields(engine: Engine, script: str) -> dict:
    """The openai client's form of `forcing`: logit_bias and stop as arguments."""
    fields = forcing(engine, script)
    return {"logit_bias": fields["logit_bias"], "stop": fields["stop"],
            "max_tokens": fields["max_tokens"]}


def test_the_responses_api_gets_the_same_split(client, engine):
    """OpenAI's Responses API runs the same chat request: the analysis channel is the
    reasoning item, a commentary call a function_call item."""
    forced = {"extra_body": {"logit_bias": {str(engine.tokenizer.token_id(REPLY)): 100},
                             "stop": [END]}, "max_output_tokens": 4}
    r = client.responses.create(model=MODEL, input="hello", **forced)
    reasoning, message = r.output
    assert [c.text for c in reasoning.content] == [THOUGHT]
    assert message.type == "message" and r.output_text == "Hello there!"
    forced["extra_body"]["logit_bias"] = {str(engine.tokenizer.token_id(CALL)): 100}
    r = client.responses.create(model=MODEL, input="Weather in Paris?",
                                tools=[{"type": "function", **WEATHER["function"]}], **forced)
    call = next(item for item in r.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
