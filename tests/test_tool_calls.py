"""Tool calls in generated text: which format a chat template teaches, how each format's
calls are found and what stays content, and streaming that holds back only what may be a
call and adds up to the same reply as parsing the whole text."""

from __future__ import annotations

import json
import random
import re

import pytest

from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.service.api.tool_calls import Reply, ToolCallFormat, ToolCallParser, format_of_template
from tests.test_chat_template import LLAMA3_VOCAB, LLAMA31_TEMPLATE, QWEN25_TEMPLATE

TOOLS = ("get_weather", "get_time")
HERMES = ToolCallParser(ToolCallFormat.HERMES, TOOLS)
LLAMA3 = ToolCallParser(ToolCallFormat.LLAMA3_JSON, TOOLS)
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def block(name: str, arguments: object) -> str:
    """A hermes call as Qwen writes it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def calls(reply: Reply) -> list[tuple[str, dict]]:
    """The calls as (name, parsed arguments), checking each id's and arguments' form."""
    out = []
    for call in reply.tool_calls:
        assert CALL_ID.fullmatch(call.id), call.id
        arguments = json.loads(call.arguments)
        assert isinstance(arguments, dict)
        out.append((call.name, arguments))
    return out


# -- which format a template teaches ---------------------------------------------------------

def test_the_format_is_read_from_the_chat_template():
    assert format_of_template(ChatTemplate(QWEN25_TEMPLATE)) is ToolCallFormat.HERMES
    assert format_of_template(ChatTemplate(LLAMA31_TEMPLATE)) is ToolCallFormat.LLAMA3_JSON
    # Llama 3.2's convention without <|python_tag|>: the "parameters" key
    llama32_like = ("{% if tools %}Respond in the format {\"name\": function name, "
                    "\"parameters\": dictionary}{% endif %}{{ messages[0].content }}")
    assert format_of_template(ChatTemplate(llama32_like)) is ToolCallFormat.LLAMA3_JSON
    mistral_like = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]"
    assert format_of_template(ChatTemplate(mistral_like)) is ToolCallFormat.UNKNOWN


def test_a_template_that_never_reads_tools_supports_none():
    for arch in ("gemma3", "qwen2", "qwen3", "llama"):
        template = ChatTemplate.from_metadata({}, arch, LLAMA3_VOCAB)
        assert format_of_template(template) is None, arch
    # the marker in the text is not enough: the template must read the `tools` variable
    assert format_of_template(ChatTemplate("{# <tool_call> #}{{ messages }}")) is None


# -- hermes (Qwen2.5, Qwen3) -------------------------------------------------------------------

def test_hermes_single_call_leaves_no_content():
    reply = HERMES.parse(block("get_weather", {"city": "Paris"}))
    assert reply.content is None
    assert calls(reply) == [("get_weather", {"city": "Paris"})]


def test_hermes_several_calls_after_content_keep_their_order_and_the_content():
    text = ("Let me check both.\n\n" + block("get_weather", {"city": "Paris"}) + "\n" +
            block("get_time", {"zone": "CET"}))
    reply = HERMES.parse(text)
    assert reply.content == "Let me check both."
    assert calls(reply) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert reply.tool_calls[0].id != reply.tool_calls[1].id


def test_qwen3_thinking_stays_in_the_content():
    text = "<think>\nThe user wants the time.\n</think>\n\n" + block("get_time", {})
    reply = HERMES.parse(text)
    assert reply.content == "<think>\nThe user wants the time.\n</think>"
    assert calls(reply) == [("get_time", {})]


def test_hermes_arguments_are_compact_json_text_keeping_non_ascii():
    reply = HERMES.parse('<tool_call>{"name":"get_weather","arguments":{"city":"Zürich",'
                         '"days":3}}</tool_call>')
    assert reply.tool_calls[0].arguments == '{"city": "Zürich", "days": 3}'
    no_arguments = HERMES.parse('<tool_call>\n{"name": "get_time"}\n</tool_call>')
    assert no_arguments.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
    '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off mid-call
    "I would call <tool_call but will not.",
])
def test_hermes_text_that_is_not_a_valid_call_is_content_unchanged(text):
    """Malformed JSON, an unknown function, arguments that are not an object, a call cut
    off: the model's text as it wrote it, never an error."""
    assert HERMES.parse(text) == Reply(text)


def test_a_bad_block_stays_in_place_while_good_ones_are_taken():
    bad = block("launch_rockets", {})
    text = "Hmm.\n" + bad + "\n" + block("get_time", {})
    reply = HERMES.parse(text)
    assert reply.content == "Hmm.\n" + bad
    assert calls(reply) == [("get_time", {})]


def test_a_last_block_missing_its_end_tag_counts_when_its_json_is_whole():
    """Some models stop right after the JSON (vLLM takes such a call too)."""
    reply = HERMES.parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert calls(reply) == [("get_time", {})] and reply.content is None


def test_a_reply_cut_by_max_tokens_is_not_parsed():
    text = block("get_time", {})
    assert HERMES.reply(text, ended_normally=False) == Reply(text)
    assert calls(HERMES.reply(text, ended_normally=True)) == [("get_time", {})]


def test_without_parallel_calls_only_the_first_is_returned():
    single = ToolCallParser(ToolCallFormat.HERMES, TOOLS, parallel=False)
    reply = single.parse("Two.\n" + block("get_weather", {"city": "Oslo"}) +
                         block("get_time", {}))
    assert reply.content == "Two." and calls(reply) == [("get_weather", {"city": "Oslo"})]


def test_a_reply_without_calls_is_content_unchanged_even_blank():
    assert HERMES.parse("  Paris is sunny.\n") == Reply("  Paris is sunny.\n")
    assert HERMES.parse("") == Reply("")


# -- llama3-json (Llama 3.1, 3.2) ---------------------------------------------------------------

@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '\n  {"name": "get_weather", "arguments": {"city": "Paris"}}  \n',
    '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
])
def test_llama3_reply_that_is_a_call(text):
    reply = LLAMA3.parse(text)
    assert reply.content is None and calls(reply) == [("get_weather", {"city": "Paris"})]


def test_llama3_several_calls_separated_by_semicolons():
    text = ('{"name": "get_weather", "parameters": {"city": "a;b"}}; '
            '<|python_tag|>{"name": "get_time", "parameters": {}};')
    reply = LLAMA3.parse(text)
    assert calls(reply) == [("get_weather", {"city": "a;b"}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',  # not the whole reply
    '{"name": "Ada", "age": 36}',  # a JSON answer, not a call
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and more',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "nope"}',  # all or none
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut off
    "<|python_tag|>",
    "   ",
])
def test_llama3_text_that_is_not_all_calls_is_content_unchanged(text):
    assert LLAMA3.parse(text) == Reply(text)


# -- streaming --------------------------------------------------------------------------------

def streamed(parser: ToolCallParser, pieces: list[str], ended_normally: bool = True
             ) -> tuple[list[str], Reply]:
    stream = parser.stream()
    shown = [stream.push(p) for p in pieces]
    return shown, stream.finish(ended_normally)


def test_hermes_streaming_shows_content_at_once_and_holds_only_a_possible_marker():
    stream = HERMES.stream()
    assert stream.push("The answer") == "The answer"
    assert stream.push(" is a < b") == " is a < b"  # '<' inside the text is no marker
    assert stream.push(" <tool") == ""  # may be the start of <tool_call>, and its space
    assert stream.push("box>") == " <toolbox>"  # it was not
    assert stream.push("\n\n<tool_call>\n{") == ""
    assert stream.push('"name": "get_time", "arguments": {}}\n</tool_call>') == ""
    reply = stream.finish(ended_normally=True)
    assert reply.content is None and calls(reply) == [("get_time", {})]


def test_llama3_streaming_holds_a_reply_that_may_be_a_call_and_passes_any_other():
    stream = LLAMA3.stream()
    assert [stream.push(p) for p in ("\n", "<|py", "thon_tag|>", '{"name"')] == [""] * 4
    prose = LLAMA3.stream()
    assert [prose.push(p) for p in (" ", "<|p", "arrot|> says", " hi")] == \
        ["", "", " <|parrot|> says", " hi"]
    assert prose.finish(True) == Reply("")


def test_a_stream_cut_by_max_tokens_gives_back_the_held_text_as_content():
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    shown, rest = streamed(HERMES, ["Ok. ", text], ended_normally=False)
    assert shown == ["Ok.", ""] and rest == Reply(" " + text)


REPLIES = [
    "Paris is sunny today.\n",
    "Let me check.\n\n" + block("get_weather", {"city": "Paris"}) + "\n" +
    block("get_time", {}) + "\n",
    "<think>\nhm\n</think>\n\n" + block("get_time", {}),
    "A\n" + block("launch_rockets", {}) + " B " + block("get_time", {}) + "\n C",
    "Cut: " + block("get_weather", {"city": "Paris"})[:30],
    "x <tool_call> y",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time"}',
    '  <|python_tag|>{"name": "get_time", "parameters": {}}',
    "  <|python_tag|> is a token",
    '{"name": "Ada"}',
    "",
]


@pytest.mark.parametrize("parser", [HERMES, LLAMA3], ids=["hermes", "llama3-json"])
def test_streamed_pieces_add_up_to_parsing_the_whole_text(parser):
    """Whatever the split into tokens, what is shown plus the last reply equals `reply` of
    the whole text: the same content and the same calls, cut short or not."""
    rng = random.Random(0)
    for text in REPLIES:
        for ended_normally in (True, False):
            for _ in range(30):
                cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 6)))
                pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
                shown, rest = streamed(parser, pieces, ended_normally)
                whole = parser.reply(text, ended_normally)
                assert "".join(shown) + (rest.content or "") == (whole.content or ""), \
                    (text, pieces)
                assert calls(rest) == calls(whole), (text, pieces)
