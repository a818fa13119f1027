"""OpenAI's Chat Completions and (legacy) Completions request bodies, checked field by
field (how: service/http/openai_parsing.py; the sampling fields they share:
openai_sampling.py; chat messages and tools: openai_messages.py).

Tools (chat): `tools` with distinct names; `tool_choice` is "auto" (the default: the
model decides, its text unconstrained), "none" (the tools are shown to the model, its text
is all content), "required" or `{"type": "function", "function": {"name": ...}}`: the reply
is then constrained to one call (of any tool, or of the named one) in the template's call
format, whose arguments follow the tool's `parameters` schema (service/api/tool_calls.py's
`forced_call`); `strict: true` is accepted (a forced call always follows the schema; under
"auto" nothing is constrained). `parallel_tool_calls` false returns at most the first call.
`ChatCompletionRequest.tool_parser` refuses tools for a template that cannot show them and
picks the parser of the template's call format (service/api/tool_calls.py).

Structured output (chat): `response_format` is `{"type": "text"}` (no constraint),
`{"type": "json_object"}` (any JSON object) or `{"type": "json_schema", "json_schema":
{"name", "schema"?, "strict"?, "description"?}}`, beside llama.cpp's fields
(openai_sampling.py).

`suffix` (completions) asks for the text between each text prompt and the suffix: a
fill-in-the-middle prompt (Tokenizer.encode_infill; the server refuses it for a model
without FIM tokens). `""` or null is no suffix.

SGLang's router adds a few of SGLang's own fields to every request; they are accepted at
the values it sends, which are this server's behaviour (`_SGLANG_ROUTER_DEFAULTS`;
docs/deployment.md).

`parse_chat_request` and `parse_completion_request` build the bodies; the server turns a
chat body into the engine's chat request in service/http/openai_chat.py. Response bodies
are service/http/openai_responses.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from eagerlm.kernels.sampling import MAX_LOGPROBS, Constraint
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.service.api.tool_calls import ToolCallParser
from eagerlm.service.http.chat_request import tool_parser_for
from eagerlm.service.http.openai_errors import bad_request, brief
from eagerlm.service.http.openai_messages import ChatMessage, ToolDefinition, check_tool_fields
from eagerlm.service.http.openai_parsing import parse_body
from eagerlm.service.http.openai_sampling import SamplingFields

MAX_PROMPTS = 64  # prompts in one /v1/completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions API


class ChatCompletionRequest(SamplingFields):
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

    def forced_tools(self) -> list[tuple[str, dict[str, Any] | None]] | None:
        """The tools a forced call may call, with their parameter schemas (None: no call
        is forced)."""
        forced = self.forced_tool
        if forced is None or not self.tools:
            return None
        return [(t.function.name, t.function.parameters) for t in self.tools
                if forced in ("", t.function.name)]

    def check(self) -> None:
        self._check_tools()
        self._check_tool_choice()
        self._check_response_format()
        super().check()  # after: it counts the constraints these fields make
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.",
                              param="top_logprobs", code="invalid_value")
        for i, message in enumerate(self.messages):
            check_tool_fields(message, f"messages[{i}]")

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
        text is all content; service/http/chat_request.py's `tool_parser_for`)."""
        if not self.tools:
            return None
        return tool_parser_for(template, [t.function.name for t in self.tools],
                               parse_calls=self.tool_choice != "none",
                               parallel=self.parallel_tool_calls is not False)

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
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


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    return parse_body(body, ChatCompletionRequest, _DEFAULT_ONLY_CHAT)


def parse_completion_request(body: Any) -> CompletionRequest:
    return parse_body(body, CompletionRequest, _DEFAULT_ONLY_COMPLETIONS)


__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "MAX_PROMPTS", "ChatCompletionRequest",
           "CompletionRequest", "parse_chat_request", "parse_completion_request"]
