"""Anthropic's Messages API request body (`POST /v1/messages`, and the count_tokens body),
checked field by field, and translated onto the engine's chat request
(service/http/chat_request.py): the conversation and tools in the chat template's form.

Fields: `model`, `max_tokens` (required, as Anthropic requires it), `messages` (user and
assistant turns; content a string or a list of `text`, `tool_use`, `tool_result`,
`thinking` and `redacted_thinking` blocks), `system` (a string or text blocks), `tools`
(custom tools: `name`, `description`, `input_schema`; Anthropic's server tools are
refused), `tool_choice` (`auto`, `any`, `tool` with a `name`, `none`;
`disable_parallel_tool_use`), `stop_sequences`, `temperature` (0 to 1), `top_p`, `top_k`
(older SDKs send them; the current one only through `extra_body`), `thinking` (`enabled`
with `budget_tokens`, `disabled`, `adaptive`; `display`), `output_config` (`format`: a
JSON schema the reply follows, by constrained decoding; `effort`, which reaches the
template as `reasoning_effort`), `stream`, `metadata` (informational), `cache_control`
(no effect). llama-server's `logit_bias` extension is accepted as on the OpenAI routes.
Strict as the other routes (service/http/openai_parsing.py): a field or block type this
server does not know is a 400 naming it, never ignored; `cache_control` on a block is
accepted and changes nothing (the prefix cache is automatic).

How Anthropic's conversation maps onto a chat template's (OpenAI's form, as Hugging Face
templates take it): consecutive turns of one role are one turn (as Anthropic combines
them); a user turn's `tool_result` blocks become `tool` messages answering their
`tool_use_id`, before the turn's text; an assistant turn's `tool_use` blocks become its
`tool_calls` (the input as the object templates expect), its `thinking` blocks its
`reasoning_content` (`redacted_thinking` is dropped: nothing can read it). A conversation
that ends with an assistant turn (Anthropic's prefill) is refused: templates would close
that turn, not continue it.

`thinking`: `enabled` and `disabled` reach the chat template as `enable_thinking` (Qwen3's
switch; a template that never reads it gets no say); `budget_tokens` must be below
`max_tokens`, as Anthropic requires, and is not a separate limit here. A reasoning model's
thinking comes back as `thinking` blocks whenever it thinks (whole: nothing summarises
it; empty with `display: "omitted"`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from eagerlm.kernels.sampling import Constraint
from eagerlm.service.http.chat_request import MAX_TOOLS, ChatRequest, tool_parser_for
from eagerlm.service.http.openai_errors import bad_request, brief
from eagerlm.service.http.openai_parsing import BodyPart, RequestBody, parse_body
from eagerlm.service.http.openai_sampling import logit_bias_pairs
from eagerlm.service.http.request_sampling import Sampling
from eagerlm.service.http.server_context import ServerContext


class TextBlock(BodyPart):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # Anthropic's prompt caching: automatic here
    citations: list[Any] | None = None  # Anthropic's own annotations; they tell the model nothing


class ToolUseBlock(BodyPart):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BodyPart):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(BodyPart):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server's are empty; any is accepted back


class RedactedThinkingBlock(BodyPart):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]


class Message(BodyPart):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(BodyPart):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    def for_template(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BodyPart):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BodyPart):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None  # omitted: blocks left empty


class OutputFormat(BodyPart):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BodyPart):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(RequestBody):
    """`POST /v1/messages/count_tokens`: what the prompt is made of."""

    expected: ClassVar[dict[str, str] | None] = {
        "model": "a string", "messages": "a non-empty list of messages",
        "system": "a string or a list of text blocks",
        "tools": "a list of {\"name\", \"input_schema\"} objects",
        "tool_choice": "an object such as {\"type\": \"auto\"}",
        "stop_sequences": "a list of strings", "stream": "a boolean",
        "max_tokens": "an integer", "logit_bias": "an object mapping token ids to biases",
    }

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # Anthropic's prompt caching: automatic here

    def check(self) -> None:
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise bad_request("Invalid value for 'tools': tool names must be unique.",
                              param="tools", code="invalid_value")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if choice.name is None:
                raise bad_request("Missing required parameter: 'tool_choice.name'.",
                                  param="tool_choice.name")
            if choice.name not in names:
                raise bad_request(f"Invalid value for 'tool_choice.name': no tool is named "
                                  f"{brief(choice.name)}.", param="tool_choice.name",
                                  code="invalid_value")
        elif choice is not None and choice.name is not None:
            raise bad_request("'tool_choice.name' is only for tool_choice type 'tool'.",
                              param="tool_choice.name", code="invalid_value")
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise bad_request(f"tool_choice type {choice.type!r} needs 'tools'.",
                              param="tool_choice", code="invalid_value")
        self.template_messages()  # the conversation's own rules, checked now

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as a chat template takes it (the module docstring says how),
        the system prompt first; a 400 naming the block that breaks a rule."""
        out: list[dict[str, Any]] = []
        system = self.system
        if isinstance(system, list):
            system = "\n".join(block.text for block in system)
        if system:
            out.append({"role": "system", "content": system})
        turns = _merged_turns(self.messages)
        if turns[-1][0] == "assistant":
            raise bad_request("The conversation ends with an assistant turn (a prefill): "
                              "this server cannot continue a turn; end with a user turn.",
                              param="messages", code="invalid_value")
        for role, blocks in turns:
            out.extend(_user_turn(blocks) if role == "user" else [_assistant_turn(blocks)])
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.for_template() for tool in self.tools] if self.tools else None

    def template_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.thinking is not None and self.thinking.type != "adaptive":
            kwargs["enable_thinking"] = self.thinking.type == "enabled"
        if self.output_config is not None and self.output_config.effort is not None:
            kwargs["reasoning_effort"] = self.output_config.effort
        return kwargs

    @property
    def thinking_shown(self) -> bool:
        """Whether thinking blocks carry the thinking (`display: "omitted"`: empty)."""
        return self.thinking is None or self.thinking.display != "omitted"


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = None
    metadata: dict[str, Any] | None = None  # Anthropic's `user_id`: informational
    logit_bias: dict[str, Any] | None = None  # llama-server's extension

    def check(self) -> None:
        super().check()
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than "
                              f"'max_tokens' ({self.max_tokens}).",
                              param="thinking.budget_tokens", code="invalid_value")
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        if forced and self.constraint() is not None:
            raise bad_request("Give at most one of 'output_config.format' and a forced "
                              "'tool_choice': each constrains the whole reply.",
                              param="tool_choice", code="invalid_value")
        self.sampling()

    def constraint(self) -> Constraint | None:
        """`output_config.format`'s JSON schema (structured output), if any."""
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        return Constraint.json_schema(fmt.schema_, "output_config.format.schema")

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        stop=tuple(self.stop_sequences or ()),
                        logit_bias=logit_bias_pairs(self.logit_bias))

    def chat_request(self, ctx: ServerContext) -> ChatRequest:
        """This body as the engine's chat request."""
        choice = self.tool_choice or ToolChoice(type="auto")
        parser = None
        if self.tools:
            parser = tool_parser_for(
                ctx.engine.model.chat_template, [t.name for t in self.tools],
                parse_calls=choice.type != "none",
                parallel=not choice.disable_parallel_tool_use)
        forced = None
        if choice.type in ("any", "tool") and self.tools:
            forced = [(t.name, t.input_schema) for t in self.tools
                      if choice.type == "any" or t.name == choice.name]
        return ChatRequest(messages=self.template_messages(), sampling=self.sampling(),
                           tools=self.template_tools(), template_kwargs=self.template_kwargs(),
                           tool_parser=parser, forced_tools=forced,
                           constraint=self.constraint(), max_tokens=self.max_tokens)


def _merged_turns(messages: list[Message]) -> list[tuple[str, list[Any]]]:
    """Consecutive messages of one role as one turn, each with the path of its blocks."""
    turns: list[tuple[str, list[Any]]] = []
    for i, message in enumerate(messages):
        blocks = [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(message.blocks())]
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    return turns


def _misplaced(path: str, block: Any, role: str) -> Exception:
    article = "an" if role == "assistant" else "a"
    return bad_request(f"Invalid value for '{path}': a {block.type} block cannot be in "
                       f"{article} {role} message.", param=path, code="invalid_value")


def _user_turn(blocks: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages, then its text."""
    results, texts = [], []
    for path, block in blocks:
        if isinstance(block, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": block.text()})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise _misplaced(path, block, "user")
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _assistant_turn(blocks: list[tuple[str, Any]]) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for path, block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"type": "function", "id": block.id,
                          "function": {"name": block.name, "arguments": block.input}})
        elif not isinstance(block, RedactedThinkingBlock):
            raise _misplaced(path, block, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
_UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")


def _check_block_types(body: Any) -> None:
    """Each content block's type known, and no server tool, before the shape is checked:
    a clear 400 naming the block (pydantic's message for an unknown member of a union
    names none)."""
    tools = body.get("tools") if isinstance(body, dict) else None
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise bad_request(f"'tools[{i}]' is Anthropic's server tool {brief(kind)}: this "
                              f"server runs custom tools only (name, input_schema).",
                              param=f"tools[{i}].type", code="unsupported_parameter")
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(block, dict):
                raise bad_request(f"Invalid type for '{where}': expected a content block "
                                  f"(an object with a 'type').", param=where,
                                  code="invalid_type")
            if kind in _UNSUPPORTED_BLOCKS:
                raise bad_request(f"'{where}' is a {kind} block: this server serves a "
                                  f"text-only model.", param=f"{where}.type",
                                  code="unsupported_parameter")
            if kind not in _BLOCK_TYPES:
                raise bad_request(f"Invalid value for '{where}.type': expected one of "
                                  f"{', '.join(_BLOCK_TYPES)}, got {brief(kind)}.",
                                  param=f"{where}.type", code="invalid_value")


def parse_messages_request(body: Any) -> MessagesRequest:
    _check_block_types(body)
    return parse_body(body, MessagesRequest)


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    _check_block_types(body)
    return parse_body(body, CountTokensRequest)


__all__ = ["CountTokensRequest", "MessagesRequest", "parse_count_tokens_request",
           "parse_messages_request"]
