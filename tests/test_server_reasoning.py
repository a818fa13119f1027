"""A reasoning model's `<think>` block split into `reasoning_content`, over loopback with the
official openai client, on a synthetic qwen3 model carrying Qwen3's real chat template.

As in tests/test_server_tools.py, whole scripted replies are single special tokens, forced
with `logit_bias` +100 and ended with `stop: [END]`, so the real engine writes exactly the
text a test wants. Also here: the splitter itself (streamed in any chunking equals split
whole), the stop logic skipping the reasoning, `chat_template_kwargs` (Qwen3's
`enable_thinking`), `reasoning_effort`, and `--reasoning-format none`.
"""

from __future__ import annotations

import json
import logging
import random

import httpx
import openai
import pytest

from eagerlm.dispatch.reasoning import (
    ReasoningFormat,
    ReasoningGate,
    ReasoningStream,
    split_reasoning,
)
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_server import LiveServer, sse_payloads
from tests.test_server_tools import END, forcing

# Qwen3's chat template (Qwen/Qwen3-8B, tokenizer_config.json)
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')\
.split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MODEL = "tiny-thinker"
THOUGHT = "The user greets me. I could say STOP, but a greeting deserves one back."
ANSWER = "Hello! How can I help?"
THINK_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}{END}"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_THEN_CALL = f"<think>\nI need the weather.\n</think>\n\n{CALL}{END}"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
HI = [{"role": "user", "content": "hello"}]


# -- the splitter ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nhmm\n</think>\n\nHi.", False, "\nhmm\n", "Hi."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Hi, no thinking.", False, None, "Hi, no thinking."),
    ("<thinking is a word", False, None, "<thinking is a word"),
    ("<thi", False, None, "<thi"),
    ("hmm\n</think>\n\nHi.", True, "hmm\n", "Hi."),  # the prompt opened the block
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("", False, None, ""),
])
def test_split_reasoning(text, opened, reasoning, content):
    split = split_reasoning(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_streamed_in_any_chunking_the_split_equals_the_whole_split():
    rng = random.Random(7)
    texts = ["<think>\nhmm </thin k></think>\n\n Hi.", "  <think></think>", "plain <think>",
             "x</think>y", "<think>a</thi", THINK_REPLY]
    for text in texts:
        for opened in (False, True):
            whole = split_reasoning(text, opened)
            for _ in range(50):
                cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
                stream = ReasoningStream(opened)
                r = c = ""
                for piece in pieces:
                    dr, dc = stream.push(piece)
                    r, c = r + dr, c + dc
                dr, dc = stream.finish()
                assert (r + dr, c + dc) == (whole.reasoning or "", whole.content), pieces

                gate = ReasoningGate(opened)  # the raw text, cut once after </think>
                parts = [gate.push(p) for p in pieces] + [gate.flush()]
                assert "".join(a + b for a, b in parts) == text
                answer = "".join(b for _, b in parts)
                assert answer.lstrip() == whole.content.lstrip() or whole.reasoning is None


def test_auto_format_follows_the_template():
    assert ReasoningFormat.AUTO.resolve(ChatTemplate(QWEN3_TEMPLATE)) is \
        ReasoningFormat.DEEPSEEK
    assert ReasoningFormat.AUTO.resolve(ChatTemplate.builtin("gemma3")) is ReasoningFormat.NONE
    assert ReasoningFormat.NONE.resolve(ChatTemplate(QWEN3_TEMPLATE)) is ReasoningFormat.NONE


# -- through the server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    spec = tiny_spec("qwen3", context_length=2048, chat_template=QWEN3_TEMPLATE,
                     extra_specials=("<tool_call>", "</tool_call>", THINK_REPLY,
                                     THINK_THEN_CALL))
    path = write_synthetic_model(tmp_path_factory.mktemp("think") / "qwen3.gguf", spec)
    with Engine.load(path, page_size=16384, kv_budget_bytes=32 << 20,
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



def test_the_thinking_comes_back_as_reasoning_content(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=HI,
                                       **forcing(engine, THINK_REPLY))
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == f"\n{THOUGHT}\n"
    assert r.choices[0].finish_reason == "stop"


def test_streamed_reasoning_arrives_as_reasoning_content_deltas(client, engine):
    reasoning = content = ""
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                **forcing(engine, THINK_REPLY)):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (f"\n{THOUGHT}\n", ANSWER, "stop")


def test_a_stop_string_inside_the_reasoning_does_not_end_the_reply(client, engine):
    fields = forcing(engine, THINK_REPLY)
    fields["stop"] = ["STOP", END]
    r = client.chat.completions.create(model=MODEL, messages=HI, **fields)
    assert r.choices[0].message.content == ANSWER
    fields["stop"] = ["help", END]  # in the answer: it stops there
    r = client.chat.completions.create(model=MODEL, messages=HI, **fields)
    assert r.choices[0].message.content == "Hello! How can I "


def test_the_tool_call_parser_sees_the_answer_after_the_reasoning(client, engine):
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER],
                                           stream=stream,
                                           **forcing(engine, THINK_THEN_CALL))
        if stream:
            calls, reasoning, finish = [], "", None
            for chunk in r:
                delta = chunk.choices[0].delta
                calls += delta.tool_calls or []
                reasoning += getattr(delta, "reasoning_content", None) or ""
                finish = chunk.choices[0].finish_reason or finish
        else:
            message = r.choices[0].message
            calls, reasoning = message.tool_calls, message.reasoning_content
            finish = r.choices[0].finish_reason
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", {"city": "Paris"})], stream
        assert reasoning == "\nI need the weather.\n"
        assert finish == "tool_calls"


def test_chat_template_kwargs_reach_the_template(client, engine):
    thinking = engine.prepare_chat(HI).chat_text
    quiet = engine.prepare_chat(HI, template_kwargs={"enable_thinking": False}).chat_text
    assert quiet == thinking + "<think>\n\n</think>\n\n"
    usage = [client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, extra_body=extra).usage.prompt_tokens
        for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    assert usage[1] > usage[0]


def test_reasoning_effort_is_accepted_and_reaches_the_template(client, engine, caplog):
    with caplog.at_level(logging.INFO, logger="eagerlm.server"):
        r = client.chat.completions.create(model=MODEL, messages=HI, reasoning_effort="low",
                                           **forcing(engine, THINK_REPLY))
    assert r.choices[0].message.content == ANSWER
    # Qwen3's template never reads it: said once in the log (once per process)
    assert sum("'reasoning_effort'" in m for m in caplog.messages) <= 1
    spy = engine.prepare_chat(HI, template_kwargs={"reasoning_effort": "low"})
    assert spy.chat_text == engine.prepare_chat(HI).chat_text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI,
                                       extra_body={"reasoning_effort": "extreme"})
    assert e.value.body["param"] == "reasoning_effort"


def test_reasoning_format_none_leaves_the_text_whole(engine):
    with LiveServer(create_app(engine, ServerConfig(reasoning_format="none"))) as s:
        body = {"model": MODEL, "messages": HI, **forcing(engine, THINK_REPLY)}
        message = httpx.post(s.url + "/v1/chat/completions", json=body,
                             timeout=30).json()["choices"][0]["message"]
        assert message["content"] == THINK_REPLY.removesuffix(END)
        assert "reasoning_content" not in message
        lines = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": True},
                           timeout=30).text.splitlines()
        deltas = [p["choices"][0]["delta"] for p in sse_payloads(lines) if p != "[DONE]"]
        assert "".join(d.get("content") or "" for d in deltas) == \
            THINK_REPLY.removesuffix(END)
