"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`):
the body translated onto the engine's chat request (service/http/responses_request.py,
then service/http/chat_request.py: the same templates, tool-call parsing, reasoning split
and constraints as every other chat route), and the run rendered back as OpenAI's
`response` object or its stream of typed events, as the official `openai` SDK parses them.

A response's `output` is items in this order: a `reasoning` item (a reasoning model's
thinking as one `reasoning_text` part; `summary` empty: nothing here summarises), a
`message` with one `output_text` part, then one `function_call` per call (its `call_id`
what a `function_call_output` answers). `status` is `completed`, or `incomplete` with
`incomplete_details.reason` "max_output_tokens" when the reply was cut. Usage counts the
prompt's tokens (the prefix cache's in `input_tokens_details.cached_tokens`) and the
generated ones; `reasoning_tokens` is the reasoning text encoded again (the engine does
not count tokens on each side of `</think>`).

A stream is `response.created` and `response.in_progress`, then per item
`response.output_item.added`, its part's `response.content_part.added`, deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, or one
`response.function_call_arguments.delta` with a call's whole arguments), their `.done`
events and `response.output_item.done`; last `response.completed` (or
`response.incomplete`) with the whole response. Every event is named in its `event:` line
and numbered (`sequence_number`). A failure ends it with an `error` event and
`response.failed`. Errors outside a stream are OpenAI's error body.

Stored responses (`store`, the default) are kept in memory for `previous_response_id` and
GET (service/http/response_store.py); an id not kept (never stored, evicted, deleted, or
from before a restart) is a 404 in OpenAI's format.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from eagerlm.dispatch.messages import FinishReason
from eagerlm.errors import EagerLMError
from eagerlm.service.api.records import Completion
from eagerlm.service.api.tool_calls import ToolCall
from eagerlm.service.http.chat_request import (
    ChatRun,
    ChoiceFinished,
    ChoiceResult,
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    chat_response,
)
from eagerlm.service.http.openai_errors import OpenAIError, as_openai_error, brief
from eagerlm.service.http.response_store import ResponseStore
from eagerlm.service.http.responses_request import ResponsesRequest, parse_responses_request
from eagerlm.service.http.server_context import ServerContext


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Output:
    """A response's output items as they form, and the events that form them (each with
    its sequence number). Whole replies are built the same way, their events dropped, so
    a streamed response and a whole one have the same items."""

    encrypted_reasoning: bool = False  # `include: ["reasoning.encrypted_content"]`
    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    sequence: int = 0
    _open: dict[str, Any] | None = None  # the item being written
    _text: str = ""  # its text so far

    def emit(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        self.events.append(f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n")

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events

    @property
    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def reasoning(self, text: str) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._begin({"id": _new_id("rs"), "type": "reasoning", "summary": [],
                         "content": [], "status": "in_progress"},
                        {"type": "reasoning_text", "text": ""})
        self._text += text
        self.emit("response.reasoning_text.delta", **self._where, content_index=0, delta=text)

    def text(self, text: str) -> None:
        if self._open is None or self._open["type"] != "message":
            self._begin({"id": _new_id("msg"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []},
                        _output_text(""))
        self._text += text
        self.emit("response.output_text.delta", **self._where, content_index=0, delta=text,
                  logprobs=[])

    def call(self, call: ToolCall) -> None:
        """A call, whole: its item, its arguments as one delta, its end."""
        self.close("completed")
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": call.id, "name": call.name}
        self.emit("response.output_item.added", output_index=len(self.items), item=item)
        where = {"item_id": item["id"], "output_index": len(self.items)}
        self.emit("response.function_call_arguments.delta", **where, delta=call.arguments)
        self.emit("response.function_call_arguments.done", **where, arguments=call.arguments,
                  name=call.name)
        item = {**item, "arguments": call.arguments, "status": "completed"}
        self.emit("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)

    def close(self, status: str) -> None:
        """End the item being written (a message cut by max_output_tokens: `status`
        "incomplete")."""
        item = self._open
        if item is None:
            return
        where, text = self._where, self._text
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            self.emit("response.reasoning_text.done", **where, content_index=0, text=text)
            done = {**item, "content": [part], "status": "completed"}
            if self.encrypted_reasoning:
                done["encrypted_content"] = text
        else:
            part = _output_text(text)
            self.emit("response.output_text.done", **where, content_index=0, text=text,
                      logprobs=[])
            done = {**item, "content": [part], "status": status}
        self.emit("response.content_part.done", **where, content_index=0, part=part)
        self.emit("response.output_item.done", output_index=len(self.items), item=done)
        self.items.append(done)
        self._open, self._text = None, ""

    def finish(self, status: str) -> None:
        """The reply is over: an empty reply is one empty message, as OpenAI's."""
        if self._open is None and not self.items:
            self.text("")
        self.close(status)

    def _begin(self, item: dict[str, Any], part: dict[str, Any]) -> None:
        self.close("completed")
        self._open = item
        self.emit("response.output_item.added", output_index=len(self.items), item=item)
        self.emit("response.content_part.added", **self._where, content_index=0, part=part)


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _Response:
    """One response on its way: what its body echoes of the request, its output, and
    the conversation it continues."""

    req: ResponsesRequest
    ctx: ServerContext
    store: ResponseStore
    conversation: list[dict[str, Any]]  # before this response, without the instructions
    id: str = field(default_factory=lambda: _new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    output: _Output = field(default_factory=_Output)

    def body(self, status: str, usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format else None
        reasoning = req.reasoning
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": self.ctx.engine.name,
            "output": list(self.output.items),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "service_tier": "default", "store": req.stored,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                                else {"type": "text"}), "verbosity": "medium"},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": 0, "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def finish(self, completion: Completion) -> dict[str, Any]:
        """The whole response once its reply is over (its items written); kept when it
        is to be stored, with the conversation it ends: its items as an assistant turn."""
        c = completion
        status = "incomplete" if c.finish_reason is FinishReason.LENGTH else "completed"
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output.items:
            if item["type"] == "reasoning":
                turn["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                turn["content"] = item["content"][0]["text"]
            else:
                turn.setdefault("tool_calls", []).append(
                    {"type": "function", "id": item["call_id"],
                     "function": {"name": item["name"],
                                  "arguments": json.loads(item["arguments"])}})
        reasoning_tokens = 0
        if "reasoning_content" in turn:
            encoded = self.ctx.engine.tokenizer.encode(turn["reasoning_content"],
                                                       add_special=False)
            reasoning_tokens = min(len(encoded), c.completion_tokens)
        body = self.body(status, {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.cached_tokens},
            "output_tokens": c.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": c.prompt_tokens + c.completion_tokens})
        if self.req.stored:
            self.store.put(body, [*self.conversation, turn])
        return body

    def error_ending(self, error: OpenAIError) -> str:
        """How a stream that fails or is cut ends: an `error` event, then
        `response.failed`."""
        out = self.output
        out.emit("error", code=error.code, message=error.message, param=error.param)
        out.emit("response.failed", response=self.body("failed", error={
            "code": error.code or ("server_error" if error.status >= 500
                                   else "invalid_request"),
            "message": error.message}))
        return "".join(out.take())


def add_responses_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`."""
    store = ResponseStore(ctx.config.responses_stored, ctx.config.responses_store_bytes)

    def stored(response_id: str, param: str | None = None) -> Any:
        entry = store.get(response_id)
        if entry is None:
            raise OpenAIError(404, f"No response found with id {brief(response_id, 80)}: "
                                   f"it was never stored, or is no longer (responses are "
                                   f"kept in memory, the oldest evicted first).",
                              param=param, code="not_found")
        return entry

    @app.post("/v1/responses", dependencies=[Depends(ctx.authorize)])
    async def create(request: Request) -> Response:
        req = parse_responses_request(await ctx.read_json(request))
        ctx.check_model(req.model)
        history = (stored(req.previous_response_id, "previous_response_id").conversation
                   if req.previous_response_id else [])
        conversation = req.conversation(history)
        chat = req.chat_request(ctx, conversation)
        response = _Response(req, ctx, store, conversation)
        response.output.encrypted_reasoning = bool(req.include)
        return await chat_response(
            ctx, request, chat, stream=bool(req.stream),
            stream_events=lambda run: _response_events(run, response),
            whole_body=lambda run, completions: _whole_response(run, response, completions),
            error_ending=response.error_ending)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(ctx.authorize)])
    async def retrieve(response_id: str) -> dict[str, Any]:
        return stored(response_id).body

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(ctx.authorize)])
    async def delete(response_id: str) -> dict[str, Any]:
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _fold(out: _Output, result: ChoiceResult) -> None:
    """A whole reply's items, as a stream would have formed them."""
    if result.reasoning is not None:
        out.reasoning(result.reasoning)
    if result.reply.content:
        out.text(result.reply.content)
    for call in result.reply.tool_calls:
        out.call(call)
    length = result.completion.finish_reason is FinishReason.LENGTH
    out.finish("incomplete" if length else "completed")
    out.take()


def _whole_response(run: ChatRun, response: _Response, completions: list[Completion]
                    ) -> dict[str, Any]:
    (result,) = run.results(completions)
    _fold(response.output, result)
    return response.finish(result.completion)


async def _response_events(run: ChatRun, response: _Response) -> AsyncIterator[str]:
    out = response.output
    out.emit("response.created", response=response.body("in_progress"))
    out.emit("response.in_progress", response=response.body("in_progress"))
    for event in out.take():
        yield event
    try:
        async for e in run.events():
            if isinstance(e, ReasoningDelta):
                out.reasoning(e.text)
            elif isinstance(e, ContentDelta) and e.text:
                out.text(e.text)
            elif isinstance(e, ToolCallDelta):
                out.call(e.call)
            elif isinstance(e, ChoiceFinished):
                out.finish("incomplete" if e.reason is FinishReason.LENGTH else "completed")
            for event in out.take():
                yield event
    except EagerLMError as e:  # the engine's failure, or the request's own (a 400)
        yield response.error_ending(as_openai_error(e))
        return
    (completion,) = run.streams.completions()
    body = response.finish(completion)
    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    out.emit(kind, response=body)
    for event in out.take():
        yield event


__all__ = ["add_responses_routes"]
