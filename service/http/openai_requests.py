"""The OpenAI wire format's request bodies, checked field by field.

Every request field is one of:
- supported: validated strictly (a string where a number belongs is a 400, not coerced);
- accepted only at its default (e.g. `echo: false`, `best_of: 1`): any other value is
  refused, because the engine cannot honour it and silently ignoring it would return
  something the client did not ask for;
- informational (`user`, and those in service/http/ignored_fields.py: `store`,
  `metadata`, `service_tier`, `prompt_cache_key`...): accepted, no effect on generation;
- anything else: refused with a 400 naming the field.
`null` counts as absent, as the OpenAI API treats it, in messages too (a client sending a
response message back whole includes `"refusal": null` and the like).

Tools (chat): `tools` is a list of `{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}` with distinct names; `tool_choice` is "auto" (the default: the
model decides, its text unconstrained), "none" (the tools are shown to the model, its text
is all content), "required" or `{"type": "function", "function": {"name": ...}}`: the reply
is then constrained to one call (of any tool, or of the named one) in the template's call
format, whose arguments follow the tool's `parameters` schema (service/tool_calls.py's
`forced_call`); `strict: true` is accepted (a forced call always follows the schema; under
"auto" nothing is constrained). `parallel_tool_calls` false returns at most the first call.
The conversation may carry an assistant message
with `tool_calls` (content null or text) and `{"role": "tool", "tool_call_id", "content"}`
answers; a call's `arguments` must be a JSON object's text, and reach the template parsed,
as Hugging Face templates expect. `ChatCompletionRequest.tool_parser` refuses tools for a
template that cannot show them and picks the parser of the template's call format
(service/tool_calls.py).

Extensions many OpenAI-compatible servers accept are supported too: `top_k`, `min_p`,
`ignore_eos`, `repetition_penalty` (vLLM's: > 0, 1 = off, over prompt and output tokens),
`skip_special_tokens` (vLLM's and SGLang's: control tokens left out of the text; off by
default here, so they show, as before). SGLang's router adds a few of SGLang's own fields
to every request; they are accepted at the values it sends, which are this server's
behaviour (`_SGLANG_ROUTER_DEFAULTS`; docs/deployment.md).

`suffix` (completions) asks for the text between each text prompt and the suffix: a
fill-in-the-middle prompt (Tokenizer.encode_infill; the server refuses it for a model
without FIM tokens). `""` or null is no suffix.

Structured output (constrained decoding, dispatch/grammar.py): `response_format` (chat) is
`{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object) or
`{"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?, "description"?}}`;
llama.cpp's `json_schema` (a schema object) and `grammar` (GBNF text) are accepted on both
routes. At most one constraint per request (a forced tool call counts as one). An invalid
schema or grammar, or one beyond the grammar limits (dispatch/grammar.py's `GrammarLimits`:
size, shape, compile time), is a 400 naming the field, with llguidance's message, when the
request is submitted; one whose token step outgrows the limits while generating ends the
request with a 400 naming the field too (streamed: an error event, then [DONE]). A reply
cut by max_tokens ends with `length` and need not parse; a grammar that completes ends the
reply with `stop`.

`logit_bias` (both routes) is OpenAI's: a JSON object whose keys are token ids as decimal
strings and whose values are numbers in [-100, 100], e.g. `{"50256": -100}`; `{}` or null
is no bias. The bias is added to the logits before the penalties and every filter, greedy
included (+100 all but forces a token, -100 all but bans it). A key that is not a decimal
integer or a value that is not a number in range is a 400 naming `logit_bias`; a token id
outside the model's vocabulary is a 400 when the request is submitted.

Each route's body is a pydantic model (`ChatCompletionRequest`, `CompletionRequest`,
`TokenizeRequest`, `DetokenizeRequest`) built by its `parse_*` function, which refuses
unknown and unsupported fields, maps pydantic's errors to OpenAI's 400s and runs the
model's cross-field `check`. `resolve_max_tokens` applies the limits that need the
prompt's length. Response bodies are service/http/openai_responses.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eagerlm.kernels.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    Constraint,
    InvalidSamplingParams,
    SamplingParams,
)
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.service.api import bounded_json
from eagerlm.service.api.tool_calls import (
    ToolCallFormat,
    ToolCallParser,
    forced_call,
    format_of_template,
)
from eagerlm.service.http.ignored_fields import is_ignored
from eagerlm.service.http.openai_errors import OpenAIError, bad_request, brief

MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one /v1/completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions API


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model as is
    strict: bool | None = None  # forced calls follow `parameters` whether or not it is set


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """The entry as chat templates take it (OpenAI's form, as HF's
        apply_chat_template passes it), without `strict`, which tells the model nothing."""
        return {"type": "function",
                "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of an object, checked in ChatCompletionRequest.check


class AssistantToolCall(_Strict):
    """A call an earlier assistant turn made, as the client sends the conversation back."""

    id: str
    type: Literal["function"]
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """HF's form: templates write `tool_call.arguments | tojson`, so the arguments
        are the parsed object, not OpenAI's JSON text (vLLM converts them the same way)."""
        return {"type": "function", "id": self.id,
                "function": {"name": self.function.name,
                             "arguments": bounded_json.loads(self.function.arguments)}}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this answers
    # an earlier reply's reasoning, as this server returns it (assistant messages only)
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """null counts as absent here too: clients that send back a response message
        whole include fields such as `"refusal": null` and `"audio": null`."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: {"role", "content"} ("developer"
        is OpenAI's new name for "system", content a string even when the client sent
        null), plus `tool_calls` on an assistant turn that made calls and `tool_call_id`
        on a tool's answer. A template tests `'tool_calls' in message`, so the key is
        there only when there are calls."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            # as llama.cpp hands it over: Qwen3's templates read `reasoning_content`,
            # gpt-oss's `thinking`, which with tool calls takes the place of the content
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
            if self.tool_calls:
                del message["content"]
        return message


_TOKEN_ID = re.compile(r"[0-9]+")  # a logit_bias key
_TOKEN_ID_DIGITS = 18  # more can be no vocabulary's id (and could overflow an int64)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class _Request(_Strict):
    """A request body: its fields checked one by one by pydantic, then `check`."""

    def check(self) -> None:
        """Rules across fields, once the fields are valid (raises OpenAIError)."""


class _Sampling(_Request):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None  # vLLM's and SGLang's; off by default here
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, Any] | None = None  # checked in `check`: ids and biases
    user: str | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's: the output's JSON schema
    grammar: str | None = Field(None, min_length=1)  # llama.cpp's: a GBNF grammar

    def check(self) -> None:
        """Rules across fields, once the fields are valid (raises OpenAIError)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                              param="stream_options")
        self.logit_bias_pairs()
        given = self.constraint_fields()
        if len(given) > 1:
            raise bad_request(f"Give at most one of {', '.join(repr(f) for f in given)}: "
                              f"each constrains the whole reply.", param=given[1],
                              code="invalid_value")

    def constraint_fields(self) -> list[str]:
        """The request fields that constrain the reply, as given."""
        return [name for name in ("json_schema", "grammar") if getattr(self, name) is not None]

    def constraint(self) -> Constraint | None:
        """The reply's constraint from the request's fields (None: free text)."""
        if self.json_schema is not None:
            return Constraint.json_schema(self.json_schema, "json_schema")
        if self.grammar is not None:
            return Constraint.gbnf(self.grammar, "grammar")
        return None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; a 400 naming `logit_bias` for a key that
        is not a token id in decimal, an id given twice ("7" and "07"), or a value that is
        not a number in [-100, 100]."""
        def invalid(message: str, code: str = "invalid_value") -> OpenAIError:
            kind = "type" if code == "invalid_type" else "value"
            return bad_request(f"Invalid {kind} for 'logit_bias': {message}.",
                               param="logit_bias", code=code)

        pairs: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise invalid(f"keys must be token ids written in decimal digits, got "
                              f"{brief(key)}")
            if len(key) > _TOKEN_ID_DIGITS:
                raise invalid(f"token id {brief(key)} is out of range")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise invalid(f"the bias of token {key} must be a number, got "
                              f"{brief(value)}", code="invalid_type")
            if not abs(value) <= MAX_LOGIT_BIAS:  # NaN fails too
                raise invalid(f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}], got {brief(value)}")
            if int(key) in pairs:
                raise invalid(f"token {int(key)} is given twice")
            pairs[int(key)] = float(value)
        return tuple(pairs.items())

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return None

    def sampling_params(self, max_tokens: int, choice: int,
                        constraint: Constraint | None = None) -> SamplingParams:
        """The engine's parameters for choice `choice` of this request. With a seed,
        choice i draws from seed + i, so choices differ but the request is reproducible.
        `constraint`: the reply's (`constraint()`, or a forced tool call's)."""
        seed = None if self.seed is None else (self.seed + choice) % (1 << 64)
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0.0:  # the smallest nucleus is the most likely token: greedy
            temperature, top_p = 0.0, 1.0
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature,
                top_k=max(0, self.top_k or 0), top_p=top_p, min_p=self.min_p or 0.0,
                seed=seed, stop=stop, ignore_eos=bool(self.ignore_eos),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                logprobs=self.logprob_count, logit_bias=self.logit_bias_pairs(),
                constraint=constraint,
                skip_special_tokens=bool(self.skip_special_tokens))
        except InvalidSamplingParams as e:
            raise bad_request(f"Invalid value for '{e.field}': {e}", param=e.field,
                              code="invalid_value") from None

    @property
    def n_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked in `check`
    parallel_tool_calls: bool | None = None
    # variables for the chat template (Qwen3's `enable_thinking`), as vLLM's; and OpenAI's
    # `reasoning_effort`, which reaches the template as `reasoning_effort` (templates that
    # read it, e.g. gpt-oss's, act on it; for the others it changes nothing)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The extra variables for the chat template."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    response_format: dict[str, Any] | None = None  # checked in `check`

    def constraint_fields(self) -> list[str]:
        given = super().constraint_fields()
        if self.response_format is not None and self.response_format.get("type") != "text":
            given.insert(0, "response_format")
        if self.forced_tool is not None:
            given.append("tool_choice")
        return given

    def constraint(self) -> Constraint | None:
        """`response_format`'s constraint, or llama.cpp's fields' (a forced tool call's
        needs the template: `tool_constraint`)."""
        fmt = self.response_format
        if fmt is None or fmt["type"] == "text":
            return super().constraint()
        if fmt["type"] == "json_object":
            return Constraint.json_schema({"type": "object"}, "response_format")
        schema = fmt["json_schema"].get("schema", {"type": "object"})
        return Constraint.json_schema(schema, "response_format.json_schema.schema")

    @property
    def forced_tool(self) -> str | None:
        """"" when tool_choice is "required" (any tool), the function's name when it names
        one, None when the model decides or no call may be made."""
        choice = self.tool_choice
        if choice == "required":
            return ""
        if isinstance(choice, dict):
            return choice["function"]["name"]
        return None

    def tool_constraint(self, parser: ToolCallParser | None,
                        is_special: Callable[[str], bool]) -> Constraint | None:
        """The constraint of a forced tool call in the parser's format (None: no call is
        forced)."""
        forced = self.forced_tool
        if forced is None or parser is None or not self.tools:
            return None
        tools = [(t.function.name, t.function.parameters) for t in self.tools
                 if forced in ("", t.function.name)]
        return forced_call(parser.format, tools, is_special)

    def check(self) -> None:
        self._check_tools()
        self._check_tool_choice()
        self._check_response_format()
        super().check()  # after: it counts the constraints these fields make
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.",
                              param="top_logprobs", code="invalid_value")
        for i, message in enumerate(self.messages):
            _check_tool_fields(message, f"messages[{i}]")

    def _check_tools(self) -> None:
        seen: set[str] = set()
        for tool in self.tools or ():
            name = tool.function.name
            if name in seen:
                raise bad_request(f"Invalid value for 'tools': the function name {name!r} "
                                  f"is given twice.", param="tools", code="invalid_value")
            seen.add(name)

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return
        named = (isinstance(choice, dict) and choice.get("type") == "function"
                 and isinstance(choice.get("function"), dict)
                 and isinstance(choice["function"].get("name"), str))
        if choice == "required" or named:
            if not self.tools:
                raise bad_request(f"'tool_choice' = {brief(choice, 80)} needs 'tools'.",
                                  param="tool_choice", code="invalid_value")
            names = {t.function.name for t in self.tools}
            if named and choice["function"]["name"] not in names:
                raise bad_request(f"Invalid value for 'tool_choice': no tool is named "
                                  f"{brief(choice['function']['name'])}.",
                                  param="tool_choice", code="invalid_value")
            return
        raise bad_request(f"Invalid value for 'tool_choice': expected 'auto', 'none', "
                          f"'required' or {{\"type\": \"function\", \"function\": "
                          f"{{\"name\": ...}}}}, got {brief(choice)}.",
                          param="tool_choice", code="invalid_value")

    def _check_response_format(self) -> None:
        fmt = self.response_format
        if fmt is None:
            return
        kind = fmt.get("type")
        allowed = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}}
        if kind not in allowed:
            raise bad_request(f"Invalid value for 'response_format.type': expected 'text', "
                              f"'json_object' or 'json_schema', got {brief(kind)}.",
                              param="response_format.type", code="invalid_value")
        extra = set(fmt) - {"type"} - allowed[kind]
        if extra:
            name = sorted(extra)[0]
            raise bad_request(f"Unrecognized argument: 'response_format.{brief(name, 40)}'.",
                              param=f"response_format.{name}", code="unknown_parameter")
        if kind != "json_schema":
            return
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("Missing required parameter: 'response_format.json_schema'.",
                              param="response_format.json_schema")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise bad_request("Missing required parameter: "
                              "'response_format.json_schema.name'.",
                              param="response_format.json_schema.name")
        for key, value in spec.items():
            where = f"response_format.json_schema.{key}"
            if key not in ("name", "schema", "strict", "description"):
                raise bad_request(f"Unrecognized argument: '{brief(where, 80)}'.",
                                  param=where, code="unknown_parameter")
            kind, what = {"schema": (dict, "an object"), "strict": (bool, "a boolean"),
                          "description": (str, "a string")}.get(key, (str, "a string"))
            if value is not None and not isinstance(value, kind):
                raise bad_request(f"Invalid type for '{where}': expected {what}.",
                                  param=where, code="invalid_type")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (None: no tools). With tool_choice "none" they
        are still shown, as OpenAI does: the model knows them but is not to call them."""
        return [tool.for_template() for tool in self.tools] if self.tools else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]

    def tool_parser(self, template: ChatTemplate) -> ToolCallParser | None:
        """The parser of this request's tool calls from the model's text (None: the
        text is all content). A 400 when tools are given to a model whose chat template
        cannot show them, or whose call format this server cannot parse."""
        if not self.tools:
            return None
        fmt = format_of_template(template)
        if fmt is None:
            raise bad_request(
                f"This model's chat template ({template.origin}) does not support tools: it "
                f"never reads the 'tools' variable, so the model would not see them.",
                param="tools", code="unsupported_parameter")
        if self.tool_choice == "none":
            return None
        if fmt is ToolCallFormat.UNKNOWN:
            raise bad_request(
                "This model's chat template shows tools, but its tool calls are written in "
                "a format this server does not parse (it parses Hermes/Qwen <tool_call> "
                "blocks and Llama 3 JSON calls). Send tool_choice 'none' to show the tools "
                "without parsing calls.", param="tools", code="unsupported_parameter")
        return ToolCallParser(fmt, (t.function.name for t in self.tools),
                              parallel=self.parallel_tool_calls is not False)

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _check_tool_fields(message: ChatMessage, path: str) -> None:
    """The rules across a message's fields that the shape alone does not state."""
    if message.tool_calls is not None and message.role != "assistant":
        raise bad_request(f"Invalid value for '{path}.tool_calls': only assistant messages "
                          f"carry tool calls.", param=f"{path}.tool_calls",
                          code="invalid_value")
    if message.role == "tool" and message.tool_call_id is None:
        raise bad_request(f"Missing required parameter: '{path}.tool_call_id'.",
                          param=f"{path}.tool_call_id")
    if message.reasoning_content is not None and message.role != "assistant":
        raise bad_request(f"Invalid value for '{path}.reasoning_content': only assistant "
                          f"messages carry reasoning.", param=f"{path}.reasoning_content",
                          code="invalid_value")
    if message.role != "tool" and message.tool_call_id is not None:
        raise bad_request(f"Invalid value for '{path}.tool_call_id': only tool messages "
                          f"answer a tool call.", param=f"{path}.tool_call_id",
                          code="invalid_value")
    for j, call in enumerate(message.tool_calls or ()):
        where = f"{path}.tool_calls[{j}].function.arguments"
        try:
            arguments = bounded_json.loads(call.function.arguments)
        except ValueError as e:
            raise bad_request(f"Invalid value for '{where}': not valid JSON ({e}).",
                              param=where, code="invalid_value") from None
        if not isinstance(arguments, dict):
            raise bad_request(f"Invalid value for '{where}': expected a JSON object, got "
                              f"{brief(call.function.arguments)}.", param=where,
                              code="invalid_value")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None  # fill in the middle: the text after the completion

    def check(self) -> None:
        super().check()
        if self.suffix and not all(isinstance(p, str) for p in self.prompts()):
            raise bad_request("'suffix' needs text prompts (the text before the middle), "
                              "not token ids.", param="suffix")

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text, several texts, ids, or several id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("'prompt' must not be an empty list", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# SGLang's own fields, which its router (sglang-router) adds to every request it forwards,
# at values that are this server's behaviour: stop strings trimmed, no hidden states, a
# new assistant turn rather than the last one continued, and no reasoning parser (so
# separating reasoning out is a no-op, as on SGLang started without --reasoning-parser).
_SGLANG_ROUTER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "no_stop_trim": (False,), "return_hidden_states": (False,),
}
# Fields of OpenAI's APIs accepted only with these values (the engine cannot do others).
_DEFAULT_ONLY_CHAT: dict[str, tuple[Any, ...]] = {
    "modalities": (["text"],), **_SGLANG_ROUTER_DEFAULTS,
    "continue_final_message": (False,), "separate_reasoning": (True,),
    "stream_reasoning": (True,),
}
_DEFAULT_ONLY_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), **_SGLANG_ROUTER_DEFAULTS,
}
# Known OpenAI fields with no support at all.
_KNOWN_UNSUPPORTED = {
    "audio", "function_call", "functions", "web_search_options", "verbosity",
    "prompt_cache_options", "moderation",
}


_M = TypeVar("_M", bound=_Request)


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    return _parse(body, ChatCompletionRequest, _DEFAULT_ONLY_CHAT)


def parse_completion_request(body: Any) -> CompletionRequest:
    return _parse(body, CompletionRequest, _DEFAULT_ONLY_COMPLETIONS)


class TokenizeRequest(_Request):
    """POST /tokenize, as vLLM's: a text `prompt` (`add_special_tokens`, default true: BOS
    where the model adds one), or chat `messages` rendered with the model's template
    (`add_generation_prompt`, default true), exactly as the completion routes encode them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        for name, applies_to in (("add_special_tokens", self.prompt),
                                 ("add_generation_prompt", self.messages)):
            if getattr(self, name) is not None and applies_to is None:
                other = "prompt" if name == "add_special_tokens" else "messages"
                raise bad_request(f"'{name}' applies to '{other}' only.", param=name)
        for i, message in enumerate(self.messages or ()):
            _check_tool_fields(message, f"messages[{i}]")


class DetokenizeRequest(_Request):
    """POST /detokenize, as vLLM's: token ids back to their text (special tokens shown)."""

    model: str | None = None
    tokens: list[int]


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    return _parse(body, TokenizeRequest, {})


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    return _parse(body, DetokenizeRequest, {})


def _parse(body: Any, model: type[_M],
           default_only: dict[str, tuple[Any, ...]]) -> _M:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    fields = set(model.model_fields)
    kept: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue
        if key in fields:
            kept[key] = value
        elif is_ignored(key):  # cannot change the output (service/http/ignored_fields.py)
            continue
        elif key in default_only:
            if not any(_same(value, ok) for ok in default_only[key]):
                raise bad_request(f"'{key}' = {brief(value)} is not supported by this server; "
                                  f"only its default is.", param=key,
                                  code="unsupported_parameter")
        elif key in _KNOWN_UNSUPPORTED:
            raise bad_request(f"'{key}' is not supported by this server.", param=key,
                              code="unsupported_parameter")
        else:
            raise bad_request(f"Unrecognized request argument supplied: {brief(key, 80)}.",
                              param=key,
                              code="unknown_parameter")
    try:
        request = model.model_validate(kept)
    except ValidationError as e:
        raise _validation_error(e) from None
    request.check()
    return request


def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not let True pass for 1 (or False for 0)."""
    if isinstance(value, bool) != isinstance(allowed, bool):
        return False
    return bool(value == allowed)


_EXPECTED = {
    "model": "a string", "messages": "a non-empty list of messages",
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of ids",
    "stop": "a string or a list of strings", "stream": "a boolean",
    "ignore_eos": "a boolean", "skip_special_tokens": "a boolean", "user": "a string",
    "logit_bias": "an object mapping token ids (decimal strings) to biases in [-100, 100]",
    "tools": 'a list of {"type": "function", "function": {"name": ...}} objects',
    "tool_choice": "'auto', 'none' or an object",
    "response_format": 'an object such as {"type": "json_object"}',
    "json_schema": "a JSON schema (an object)", "grammar": "a GBNF grammar (a string)",
}
_NAMED_PARTS = frozenset().union(*(m.model_fields for m in (
    ChatMessage, TextPart, StreamOptions, ToolDefinition, FunctionDefinition,
    AssistantToolCall, FunctionCall)))


def _validation_error(e: ValidationError) -> OpenAIError:
    first = e.errors()[0]
    loc = [str(x) for x in first["loc"]]
    field = loc[0] if loc else None
    path = field or ""
    named = _NAMED_PARTS  # field names; an unknown one is named when it is the error
    if first["type"] == "extra_forbidden":
        named = named | {loc[-1]}
    for part in loc[1:]:  # messages[0].role; skip pydantic's union branch names
        if part.isdigit():
            path += f"[{part}]"
        elif part in named:
            path += f".{part}"
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{path}'.", param=path)
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized argument: {brief(path, 80)}.", param=path,
                           code="unknown_parameter")
    if field in _EXPECTED and len(loc) <= 2:
        return bad_request(f"Invalid type for '{path}': expected {_EXPECTED[field]}.",
                           param=path, code="invalid_type")
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    kind = "type" if code == "invalid_type" else "value"
    return bad_request(f"Invalid {kind} for '{path}': {first['msg']}.", param=path, code=code)


# -- limits that need the prompt --------------------------------------------------------

def resolve_max_tokens(requested: int | None, n_prompt: int, context: int,
                       default: int | None, prompt_param: str) -> int:
    """The max_tokens to run with, or a 400 as OpenAI answers: the prompt must leave room,
    and prompt + max_tokens must fit the context. Without a request, `default` (None: all
    the room left)."""
    room = context - n_prompt
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your "
            f"prompt has {n_prompt} tokens, which leaves no room for a completion. Please "
            f"reduce the length of the prompt.", param=prompt_param,
            code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    return requested
