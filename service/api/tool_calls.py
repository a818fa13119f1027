"""Tool calls in generated text: found, parsed, and kept out of the content.

With `tools` in the prompt, the model writes a call as text in the format its chat template
taught it, and the server parses that text, as vLLM's and llama.cpp's servers do. Under
`tool_choice` "auto" that text is free; a forced call ("required", or a named function) is
constrained to one call in the same format whose arguments follow the tool's parameter
schema (`forced_call`), so the same parser reads it. Two formats cover the supported model families:

- hermes (Qwen2.5, Qwen3, Hermes): one block per call, anywhere in the reply,
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`; the text outside the
  blocks is content (Qwen3's `<think>...</think>` included). A last block the generation
  ended inside of without its `</tool_call>` still counts if its JSON is whole, as in vLLM.
- llama3-json (Llama 3.1, 3.2): the whole reply is the call, `{"name": "f", "parameters":
  {...}}` ("arguments" accepted too), optionally after `<|python_tag|>`, several separated
  by `;`. All or nothing: the reply is calls only if every part of it is one.
- harmony (gpt-oss): a message to a recipient, `to=functions.f`, whose body is the
  arguments. The server's harmony split (dispatch/harmony.py) has already taken the
  reasoning out and left each such message in the answer as one marked block,
  `<|channel|>commentary to=functions.f<|message|>{...}<|call|>`, parsed here as hermes
  blocks are.

The format comes from the chat template (`format_of_template`), because the template is
what taught the model: a template that never reads `tools` cannot show the model any
(None); one that writes harmony's `<|channel|>` is harmony; one that writes `<tool_call>`
is hermes; else one that writes `<|python_tag|>` or the `"parameters"` key of Llama 3's
convention is llama3-json; any other tool-aware template uses a format this module does
not parse (UNKNOWN).

A call is taken only when its JSON parses to an object naming one of the request's tools,
with an object (or no) arguments. Anything else stays in the content as the model wrote
it: a malformed call is the model's mistake, shown to the client, never a server error.
With calls found, the content is the text outside them, the whitespace around each call
removed, or None when nothing is left; without calls it is the text unchanged. Without
parallel calls only the first call is returned and the others are dropped.

Streaming (`ToolCallStream`, one per choice) shows content as it comes and holds back only
text that may belong to a call: for hermes, text that may be the start of `<tool_call>`
(held the way `StopMatcher` holds a partial stop string) and trailing whitespace, which
is dropped if a call follows; for llama3-json, the start of the reply while it may open a
call. From the first marker on, the text is buffered and parsed when the generation ends.
What was shown and the last `Reply` add up to what `parse` gives for the whole text.
"""

from __future__ import annotations

import copy
import enum
import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagerlm.dispatch.grammar import JSON_OPTIONS
from eagerlm.dispatch.reasoning import HARMONY_CHANNEL
from eagerlm.dispatch.schema_integers import bound_integers
from eagerlm.dispatch.stop_strings import StopMatcher
from eagerlm.kernels.sampling import Constraint
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.service.api import bounded_json

TOOL_CALL_START = "<tool_call>"  # hermes
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # llama3-json: Llama 3.1's marker before a call

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# harmony: the blocks dispatch/harmony.py's `call_text` leaves in the answer
HARMONY_CALL_START = "<|channel|>commentary to="
_HARMONY_BLOCK = re.compile(r"<\|channel\|>commentary to=(?:functions\.)?([^\s<]+)"
                            r"<\|message\|>(.*?)(?:<\|call\|>|\Z)", re.DOTALL)


def _skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace (as str.strip sees it)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolCallFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3-json"
    HARMONY = "harmony"
    UNKNOWN = "unknown"  # the template shows tools but the model writes calls otherwise


def format_of_template(template: ChatTemplate) -> ToolCallFormat | None:
    """How a model with this chat template writes tool calls; None if the template cannot
    show it tools at all (it never reads the `tools` variable). The rule is in the module
    docstring; hermes is checked first."""
    if "tools" not in template.variables:
        return None
    source = template.source
    if HARMONY_CHANNEL in source:
        return ToolCallFormat.HARMONY
    if TOOL_CALL_START in source:
        return ToolCallFormat.HERMES
    if PYTHON_TAG in source or '"parameters"' in source:
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.UNKNOWN


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: the function's name and its arguments as JSON text
    (OpenAI's `function.arguments`), with an id the tool's answer refers back to."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class Reply:
    """A reply split into content (None: no text besides the calls) and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


class ToolCallParser:
    """Finds the calls of one request's tools in text written in `fmt`."""

    def __init__(self, fmt: ToolCallFormat, names: Iterable[str], parallel: bool = True
                 ) -> None:
        if fmt is ToolCallFormat.UNKNOWN:
            raise ValueError("no parser for this model's tool-call format")
        self.format = fmt
        self.names = frozenset(names)
        self.parallel = parallel

    def reply(self, text: str, ended_normally: bool) -> Reply:
        """The reply of a finished generation. Only one that ended by itself (an end token
        or a stop string) is parsed: one cut by max_tokens may end inside a call, so its
        text stays content as it is."""
        return self.parse(text) if ended_normally else Reply(text)

    def parse(self, text: str) -> Reply:
        if self.format is ToolCallFormat.HERMES:
            return self._parse_blocks(text)
        if self.format is ToolCallFormat.HARMONY:
            return self._parse_blocks(text, harmony=True)
        return self._parse_leading_json(text)

    def stream(self) -> ToolCallStream:
        """A new splitter for one streamed choice."""
        if self.format is ToolCallFormat.HERMES:
            return _BlockStream(self, TOOL_CALL_START)
        if self.format is ToolCallFormat.HARMONY:
            return _BlockStream(self, HARMONY_CALL_START)
        return _LeadingCallStream(self)

    def _parse_blocks(self, text: str, harmony: bool = False) -> Reply:
        calls: list[ToolCall] = []
        pieces: list[str] = []
        pos = 0
        for block in (_HARMONY_BLOCK if harmony else _HERMES_BLOCK).finditer(text):
            if harmony:  # the recipient names the function, the body is its arguments
                call = self._call_of({"name": block.group(1),
                                      "arguments": _json_or_none(block.group(2))},
                                     ("arguments",))
            else:
                call = self._call(block.group(1), ("arguments",))
            if call is None:
                continue  # stays in the content
            calls.append(call)
            pieces.append(text[pos:block.start()].rstrip())
            pos = _skip_space(text, block.end())
        if not calls:
            return Reply(text)
        pieces.append(text[pos:])
        return self._reply("".join(pieces), calls)

    def _parse_leading_json(self, text: str) -> Reply:
        if bounded_json.nesting_depth(text) > bounded_json.MAX_JSON_DEPTH:
            return Reply(text)  # too deep for calls the parser reads without recursing
        calls: list[ToolCall] = []
        pos = _skip_space(text, 0)
        while pos < len(text):
            if text.startswith(PYTHON_TAG, pos):
                pos = _skip_space(text, pos + len(PYTHON_TAG))
            try:
                value, pos = bounded_json.raw_decode(text, pos, depth_checked=True)
            except ValueError:
                return Reply(text)
            call = self._call_of(value, ("parameters", "arguments"))
            if call is None:
                return Reply(text)
            calls.append(call)
            pos = _skip_space(text, pos)
            if pos < len(text):
                if text[pos] != ";":
                    return Reply(text)
                pos = _skip_space(text, pos + 1)
        if not calls:
            return Reply(text)
        return self._reply("", calls)

    def _call(self, body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
        value = _json_or_none(body)
        return None if value is None else self._call_of(value, argument_keys)

    def _call_of(self, value: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
        """A call if `value` is {"name": one of the tools, <argument key>: {...}}."""
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not isinstance(name, str) or name not in self.names:
            return None
        arguments = next((value[k] for k in argument_keys if k in value), {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def _reply(self, content: str, calls: list[ToolCall]) -> Reply:
        kept = calls if self.parallel else calls[:1]
        return Reply(content or None, tuple(kept))


def _json_or_none(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON (within the nesting bound)."""
    try:
        return bounded_json.loads(text)
    except ValueError:
        return None


def forced_call(fmt: ToolCallFormat, tools: Sequence[tuple[str, dict[str, Any] | None]],
                is_special: Callable[[str], bool], field: str = "tool_choice") -> Constraint:
    """The constraint of a reply that is exactly one call of one of `tools` ((name,
    parameter schema or None: any object) pairs), in the model's format: hermes a
    `<tool_call>` block (the markers as the special tokens they are in the vocabulary, when
    `is_special` says so), llama3-json the bare JSON call, harmony one commentary message
    to the function (`<|channel|>commentary to=functions.f <|constrain|>json<|message|>`
    and the arguments, as gpt-oss writes a call). Its arguments follow the tool's
    parameters, their integers bounded as a JSON-schema constraint's are
    (dispatch/schema_integers.py). One call: "required" asks for at least one, and one
    always parses."""

    def marker(text: str) -> str:
        return text if is_special(text) else json.dumps(text)

    if fmt is ToolCallFormat.HARMONY:
        rules = []
        for i, (name, parameters) in enumerate(tools):
            args = {**(bound_integers(copy.deepcopy(parameters)) if parameters
                       else {"type": "object"}), "x-guidance": JSON_OPTIONS}
            rules.append(f'call{i}: {marker("<|channel|>")} '
                         f'{json.dumps(f"commentary to=functions.{name} ")} '
                         f'{marker("<|constrain|>")} "json" {marker("<|message|>")} '
                         f'%json {json.dumps(args)}')
        alternatives = " | ".join(f"call{i}" for i in range(len(tools)))
        return Constraint.lark(f"start: {alternatives}\n" + "\n".join(rules), field)
    key = "arguments" if fmt is ToolCallFormat.HERMES else "parameters"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": name},
                             key: (bound_integers(copy.deepcopy(parameters)) if parameters
                                   else {"type": "object"})}}
             for name, parameters in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt is ToolCallFormat.LLAMA3_JSON:
        return Constraint.json_schema(schema, field)
    if fmt is not ToolCallFormat.HERMES:
        raise ValueError(f"no forced-call grammar for the {fmt.value} format")
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # as a schema constraint's JSON

    return Constraint.lark(f'start: {marker(TOOL_CALL_START)} "\\n" '
                           f'%json {json.dumps(schema)} "\\n" {marker(TOOL_CALL_END)}', field)


class ToolCallStream(ABC):
    """One streamed choice's text on its way to the client: `push` each new piece and show
    what it returns as content; `finish` gives the rest, content and calls."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser

    @abstractmethod
    def push(self, text: str) -> str:
        """The content that can be shown now."""

    @abstractmethod
    def finish(self, ended_normally: bool) -> Reply:
        """The content not shown yet and the calls, once the generation has ended."""


class _BlockStream(ToolCallStream):
    """hermes and harmony: content until the first call's marker (`<tool_call>`, or the
    harmony split's marked call), everything after it buffered."""

    def __init__(self, parser: ToolCallParser, marker: str) -> None:
        super().__init__(parser)
        self._marker = StopMatcher([marker])
        self._space = ""  # whitespace the shown text ended with: a call may follow it
        self._tail: list[str] | None = None  # the text from the first marker on

    def push(self, text: str) -> str:
        if self._tail is not None:
            self._tail.append(text)
            return ""
        released = self._space + self._marker.push(text)
        if self._marker.stopped:
            self._tail = [self._marker.cut_off]
        shown = released.rstrip()
        self._space = released[len(shown):]
        return shown

    def finish(self, ended_normally: bool) -> Reply:
        rest = self._space + self._marker.flush() + "".join(self._tail or ())
        self._space, self._tail = "", None
        return self.parser.reply(rest, ended_normally)


class _LeadingCallStream(ToolCallStream):
    """llama3-json: a reply that starts like a call is buffered whole; any other is
    content from its first non-space character on."""

    def __init__(self, parser: ToolCallParser) -> None:
        super().__init__(parser)
        self._held: list[str] = []
        self._deciding = True  # the reply so far is whitespace or a prefix of a call's start
        self._passing = False  # not a call: everything is content

    def push(self, text: str) -> str:
        if self._passing:
            return text
        self._held.append(text)
        if self._deciding:
            start = "".join(self._held).lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self._deciding = False
            elif start and not PYTHON_TAG.startswith(start):
                self._passing = True
                shown, self._held = "".join(self._held), []
                return shown
        return ""

    def finish(self, ended_normally: bool) -> Reply:
        rest, self._held = "".join(self._held), []
        return self.parser.reply(rest, ended_normally)


__all__ = [
    "PYTHON_TAG",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "Reply",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolCallStream",
    "forced_call",
    "format_of_template",
    "new_call_id",
]
