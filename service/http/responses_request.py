"""OpenAI's Responses API request body (`POST /v1/responses`), checked field by field, and
translated onto the engine's chat request (service/http/chat_request.py).

Fields: `model`, `input` (a string, or a list of items: messages with `input_text` /
`output_text` / `refusal` parts, `function_call`, `function_call_output` and `reasoning`
items), `instructions` (the system prompt; not carried over from a previous response, as
OpenAI's), `tools` (functions: `name`, `description`, `parameters`, `strict`; OpenAI's
hosted tools are refused), `tool_choice` (`auto`, `none`, `required`, or `{"type":
"function", "name"}`, as chat's), `parallel_tool_calls`, `text.format` (`text`,
`json_object`, `json_schema`: the structured-output path), `max_output_tokens`,
`temperature`, `top_p`, `reasoning` (`effort` reaches the chat template as
`reasoning_effort`, as chat's field does; `summary` is accepted, and no summary is
written: the reasoning comes back whole), `previous_response_id`, `store`, `stream`,
`include` (`reasoning.encrypted_content`: the reasoning text, for a client that sends it
back without storing), `metadata` (echoed), `stream_options`. vLLM's and SGLang's
extensions are accepted too: `top_k`, `min_p`, `seed`, `logit_bias`, `stop`. Strict as
the other routes (service/http/openai_parsing.py): fields the engine cannot honour
(`background`, `truncation: "auto"`, `text.verbosity` other than "medium", `prompt`,
`conversation`, image and file inputs) are 400s naming them.

How the items map onto a chat template's conversation (OpenAI's chat form): `developer`
is `system`; `function_call` items join the assistant turn before them (or make one), with
their arguments parsed, as templates expect; a `function_call_output` is a `tool` message
answering its `call_id`; a `reasoning` item's text becomes the next assistant turn's
`reasoning_content`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from eagerlm.kernels.sampling import Constraint
from eagerlm.service.api import bounded_json
from eagerlm.service.http.chat_request import MAX_TOOLS, ChatRequest, tool_parser_for
from eagerlm.service.http.ignored_fields import log_once
from eagerlm.service.http.openai_errors import bad_request, brief
from eagerlm.service.http.openai_parsing import BodyPart, RequestBody, parse_body
from eagerlm.service.http.openai_sampling import logit_bias_pairs
from eagerlm.service.http.request_sampling import Sampling
from eagerlm.service.http.server_context import ServerContext


class InputText(BodyPart):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # OpenAI's cache: automatic here


class OutputText(BodyPart):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(BodyPart):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _part_text(part: Any) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


class MessageItem(BodyPart):
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # an assistant message's (commentary, final_answer)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(_part_text(part) for part in self.content)


class FunctionCallItem(BodyPart):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text of an object
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BodyPart):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(BodyPart):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BodyPart):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # this server's: the reasoning text itself
    status: str | None = None

    def text(self) -> str:
        if self.content:
            return "".join(part.text for part in self.content)
        if self.encrypted_content:
            return self.encrypted_content
        return "".join(part.text for part in self.summary)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(BodyPart):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls follow `parameters` whether or not it is set

    def for_template(self) -> dict[str, Any]:
        function = self.model_dump(exclude_none=True, exclude={"type", "strict"})
        return {"type": "function", "function": function}


class TextFormat(BodyPart):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1)  # json_schema
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BodyPart):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the others would change the reply


class ReasoningConfig(BodyPart):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name


class StreamOptions(BodyPart):
    include_obfuscation: bool | None = None  # OpenAI's padding of deltas: none here


class ResponsesRequest(RequestBody):
    expected: ClassVar[dict[str, str] | None] = {
        "model": "a string", "input": "a string or a list of input items",
        "instructions": "a string", "tools": 'a list of {"type": "function", "name": ...} '
                                              "objects",
        "tool_choice": "'auto', 'none', 'required' or an object", "stream": "a boolean",
        "store": "a boolean", "text": 'an object such as {"format": {"type": "text"}}',
        "reasoning": 'an object such as {"effort": "low"}', "stop": "a string or a list "
                                                                    "of strings",
    }

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None  # checked in `check`
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's and SGLang's extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    logit_bias: dict[str, Any] | None = None
    stop: str | list[str] | None = None

    def check(self) -> None:
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise bad_request("Invalid value for 'tools': function names must be unique.",
                              param="tools", code="invalid_value")
        self._check_tool_choice(names)
        self._check_text_format()
        if self.forced and self.constraint() is not None:
            raise bad_request("Give at most one of 'text.format' and a forced 'tool_choice': "
                              "each constrains the whole reply.", param="tool_choice",
                              code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                              param="stream_options")
        self.sampling()
        self.conversation([])  # the items' own rules, checked now

    def _check_tool_choice(self, names: list[str]) -> None:
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return
        named = (isinstance(choice, dict) and choice.get("type") == "function"
                 and isinstance(choice.get("name"), str) and set(choice) <= {"type", "name"})
        if choice != "required" and not named:
            raise bad_request(f"Invalid value for 'tool_choice': expected 'auto', 'none', "
                              f"'required' or {{\"type\": \"function\", \"name\": ...}}, got "
                              f"{brief(choice)}.", param="tool_choice",
                              code="invalid_value")
        if not names:
            raise bad_request(f"'tool_choice' = {brief(choice, 80)} needs 'tools'.",
                              param="tool_choice", code="invalid_value")
        if named and choice["name"] not in names:
            raise bad_request(f"Invalid value for 'tool_choice': no tool is named "
                              f"{brief(choice['name'])}.", param="tool_choice",
                              code="invalid_value")

    def _check_text_format(self) -> None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return
        if fmt.type == "json_schema":
            if fmt.name is None:
                raise bad_request("Missing required parameter: 'text.format.name'.",
                                  param="text.format.name")
            if fmt.schema_ is None:
                raise bad_request("Missing required parameter: 'text.format.schema'.",
                                  param="text.format.schema")
            return
        given = [key for key in ("name", "schema_", "description", "strict")
                 if getattr(fmt, key) is not None]
        if given:
            name = given[0].rstrip("_")
            raise bad_request(f"'text.format.{name}' is only for the json_schema format.",
                              param=f"text.format.{name}", code="invalid_value")

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint.json_schema({"type": "object"}, "text.format")
        return Constraint.json_schema(fmt.schema_ or {}, "text.format.schema")

    def sampling(self) -> Sampling:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, seed=self.seed, stop=stop,
                        logit_bias=logit_bias_pairs(self.logit_bias))

    @property
    def forced(self) -> bool:
        """A call is forced: tool_choice "required" or a named function."""
        return bool(self.tools) and (self.tool_choice == "required"
                                     or isinstance(self.tool_choice, dict))

    @property
    def stored(self) -> bool:
        """Whether the response is kept for `previous_response_id` and GET (OpenAI's
        default: yes)."""
        return self.store is not False

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation after `history` (a previous response's), without the
        instructions, as a chat template takes it; a 400 naming the item at fault."""
        out = list(history)
        items = ([MessageItem(type="message", role="user", content=self.input)]
                 if isinstance(self.input, str) else self.input)
        thought: list[str] = []  # reasoning items waiting for their assistant turn

        def assistant_turn() -> dict[str, Any]:
            turn: dict[str, Any] = {"role": "assistant", "content": ""}
            if thought:
                turn["reasoning_content"] = "".join(thought)
                thought.clear()
            out.append(turn)
            return turn

        for i, item in enumerate(items):
            if isinstance(item, ReasoningItem):
                thought.append(item.text())
            elif isinstance(item, MessageItem) and item.role == "assistant":
                assistant_turn()["content"] = item.text()
            elif isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                last = out[-1] if out else None
                turn = (last if last is not None and last["role"] == "assistant"
                        and not thought else assistant_turn())
                turn.setdefault("tool_calls", []).append(
                    {"type": "function", "id": item.call_id,
                     "function": {"name": item.name,
                                  "arguments": _arguments(item, f"input[{i}].arguments")}})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.text()})
        return out

    def chat_request(self, ctx: ServerContext, conversation: list[dict[str, Any]]
                     ) -> ChatRequest:
        """This body as the engine's chat request, for its `conversation()`."""
        template = ctx.engine.model.chat_template
        messages = list(conversation)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        parser = None
        if self.tools:
            parser = tool_parser_for(template, [t.name for t in self.tools],
                                     parse_calls=self.tool_choice != "none",
                                     parallel=self.parallel_tool_calls is not False)
        forced = None
        if self.forced:
            wanted = self.tool_choice["name"] if isinstance(self.tool_choice, dict) else None
            forced = [(t.name, t.parameters) for t in self.tools or ()
                      if wanted in (None, t.name)]
        kwargs: dict[str, Any] = {}
        if self.effort is not None:
            kwargs["reasoning_effort"] = self.effort
            if "reasoning_effort" not in template.variables:
                log_once("reasoning.effort", "this model's chat template does not read it")
        return ChatRequest(
            messages=messages, sampling=self.sampling(),
            tools=[t.for_template() for t in self.tools] if self.tools else None,
            template_kwargs=kwargs, tool_parser=parser, forced_tools=forced,
            constraint=self.constraint(),
            max_tokens=self.max_output_tokens)


def _arguments(item: FunctionCallItem, where: str) -> dict[str, Any]:
    """A call's arguments parsed, as templates write them (`arguments | tojson`)."""
    try:
        arguments = bounded_json.loads(item.arguments)
    except ValueError as e:
        raise bad_request(f"Invalid value for '{where}': not valid JSON ({e}).",
                          param=where, code="invalid_value") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"Invalid value for '{where}': expected a JSON object, got "
                          f"{brief(item.arguments)}.", param=where, code="invalid_value")
    return arguments


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


def _check_items(body: Any) -> None:
    """Each input item's and content part's type known (a message may leave out its
    `type`, as OpenAI's easy input messages do: it is filled in), and no hosted tool,
    before the shape is checked: a clear 400 naming the item."""
    if not isinstance(body, dict):
        return
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"'tools[{i}]' is of type {brief(kind)}: this server runs "
                              f"function tools only.", param=f"tools[{i}].type",
                              code="unsupported_parameter")
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"Invalid type for '{where}': expected an input item (an "
                              f"object).", param=where, code="invalid_type")
        if "type" not in item and "role" in item:
            item["type"] = "message"
        if item.get("type") not in _ITEM_TYPES:
            raise bad_request(f"Invalid value for '{where}.type': this server takes "
                              f"{', '.join(_ITEM_TYPES)} items, got {brief(item.get('type'))}.",
                              param=f"{where}.type", code="unsupported_parameter")
        parts = item.get("content") if item["type"] == "message" else item.get("output")
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _UNSUPPORTED_PARTS:
                name = "content" if item["type"] == "message" else "output"
                raise bad_request(f"'{where}.{name}[{j}]' is an {kind} part: this server "
                                  f"serves a text-only model.",
                                  param=f"{where}.{name}[{j}].type",
                                  code="unsupported_parameter")


# fields accepted only at their default (an empty tuple: only left out)
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "background": (False,), "truncation": ("disabled",), "top_logprobs": (0,),
    "prompt": (), "conversation": (), "max_tool_calls": (),
}


def parse_responses_request(body: Any) -> ResponsesRequest:
    _check_items(body)
    return parse_body(body, ResponsesRequest, _DEFAULT_ONLY)


__all__ = ["ResponsesRequest", "parse_responses_request"]
