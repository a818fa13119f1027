"""The messages and tools of OpenAI's Chat Completions body, and their form for the chat
template.

Tools: `tools` is a list of `{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}`. The conversation may carry an assistant message with
`tool_calls` (content null or text) and `{"role": "tool", "tool_call_id", "content"}`
answers; a call's `arguments` must be a JSON object's text, and reach the template parsed,
as Hugging Face templates expect (`check_tool_fields`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from eagerlm.service.api import bounded_json
from eagerlm.service.http.openai_errors import bad_request, brief
from eagerlm.service.http.openai_parsing import BodyPart


class TextPart(BodyPart):
    type: Literal["text"]
    text: str


class FunctionDefinition(BodyPart):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model as is
    strict: bool | None = None  # forced calls follow `parameters` whether or not it is set


class ToolDefinition(BodyPart):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """The entry as chat templates take it (OpenAI's form, as HF's
        apply_chat_template passes it), without `strict`, which tells the model nothing."""
        return {"type": "function",
                "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionCall(BodyPart):
    name: str
    arguments: str  # JSON text of an object, checked in ChatCompletionRequest.check


class AssistantToolCall(BodyPart):
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


class ChatMessage(BodyPart):
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


def check_tool_fields(message: ChatMessage, path: str) -> None:
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


__all__ = ["AssistantToolCall", "ChatMessage", "FunctionCall", "FunctionDefinition",
           "TextPart", "ToolDefinition", "check_tool_fields"]
