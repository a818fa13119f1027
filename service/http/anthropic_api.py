"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
body translated onto the engine's chat request (service/http/anthropic_request.py, then
service/http/chat_request.py: the same templates, tool-call parsing, reasoning split and
constraints as every other chat route), and the run rendered back as Anthropic's `message`
or its stream of typed events, as the official `anthropic` SDK parses them.

A reply is content blocks in this order: `thinking` (a reasoning model's reasoning, with an
empty `signature`: nothing here signs it), `text`, then one `tool_use` per call (the input
as the object the model wrote). `stop_reason`: `tool_use` when it made calls,
`max_tokens` when cut, `stop_sequence` (with `stop_sequence` naming it) when one of the
request's stop sequences ended it, else `end_turn`. Usage: `input_tokens` are the prompt
tokens prefilled, `cache_read_input_tokens` those the prefix cache reused (Anthropic counts
them apart), `output_tokens` the generated ones.

A stream is `message_start` (the message with no content), a `ping`, each block as
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, or one
`input_json_delta` holding a call's whole input) and `content_block_stop`, then
`message_delta` with the stop reason and the usage, and `message_stop`; every event named
in its `event:` line, as Anthropic's SDKs require. A failure ends it with an `error` event
in Anthropic's error body. Errors, whole or in-band, are `{"type": "error", "error":
{"type", "message"}}` with Anthropic's error types (`anthropic_error_body`): every path
under /v1/messages answers in that format (service/http/api_dialects.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from eagerlm.dispatch.messages import FinishReason
from eagerlm.errors import EagerLMError
from eagerlm.service.api.records import Completion
from eagerlm.service.api.tool_calls import Reply, ToolCall
from eagerlm.service.http.anthropic_request import (
    parse_count_tokens_request,
    parse_messages_request,
)
from eagerlm.service.http.chat_request import (
    ChatRun,
    ChoiceFinished,
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    chat_response,
    tool_parser_for,
)
from eagerlm.service.http.openai_errors import OpenAIError, as_openai_error
from eagerlm.service.http.request_lifecycle import prepare
from eagerlm.service.http.server_context import ServerContext

# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(error: OpenAIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status,
                            "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def sse(name: str, body: dict[str, Any]) -> str:
    """One named server-sent event (Anthropic's SDKs skip events without a name)."""
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_ending(error: OpenAIError) -> str:
    """How a stream that fails or is cut ends: an `error` event (ASCII, so it encodes
    whatever the message holds)."""
    return f"event: error\ndata: {json.dumps(anthropic_error_body(error))}\n\n"


@dataclass(frozen=True)
class _Reply:
    """What a reply's rendering needs of its request."""

    id: str
    model: str
    stops: tuple[str, ...]
    thinking_shown: bool = True


def add_anthropic_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens`."""

    @app.post("/v1/messages", dependencies=[Depends(ctx.authorize)])
    async def messages(request: Request) -> Response:
        req = parse_messages_request(await ctx.read_json(request))
        ctx.check_model(req.model)
        chat = req.chat_request(ctx)
        reply = _Reply(f"msg_{uuid.uuid4().hex}", ctx.engine.name,
                       tuple(req.stop_sequences or ()), req.thinking_shown)
        return await chat_response(
            ctx, request, chat, stream=bool(req.stream),
            stream_events=lambda run: _message_events(run, reply, ctx),
            whole_body=lambda run, completions: _message_body(run, reply, ctx, completions),
            error_ending=error_ending)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(ctx.authorize)])
    async def count_tokens(request: Request) -> dict[str, Any]:
        req = parse_count_tokens_request(await ctx.read_json(request))
        ctx.check_model(req.model)
        if req.tools:  # a 400 for a template that cannot show them, as /v1/messages
            tool_parser_for(ctx.engine.model.chat_template, [t.name for t in req.tools],
                            parse_calls=False, parallel=True)
        prompt = await prepare(lambda: ctx.engine.prepare_chat(
            req.template_messages(), req.template_tools(), req.template_kwargs()))
        return {"input_tokens": len(prompt.ids)}


def _usage(completion: Completion) -> dict[str, Any]:
    return {"input_tokens": completion.prompt_tokens - completion.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": completion.cached_tokens,
            "output_tokens": completion.completion_tokens}


def _stop(reply: Reply, completion: Completion, s: _Reply, ctx: ServerContext
          ) -> tuple[str, str | None]:
    """The stop reason and the stop sequence that ended the reply, if one did."""
    if reply.tool_calls:
        return "tool_use", None
    if completion.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    matched = _stop_sequence(ctx, completion, s.stops)
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _stop_sequence(ctx: ServerContext, completion: Completion,
                   stops: Sequence[str]) -> str | None:
    """Which stop sequence ended a reply, if one did. The engine drops the stop string
    and what followed it from the text, so the generated tokens' whole text is the
    reply's text, then the stop string: the stop sequence found where the text ends (one
    character of slack: a first piece may lose its space prefix) is the one that
    matched. None when the reply ended by an end token or its grammar."""
    if completion.finish_reason is not FinishReason.STOP or not stops:
        return None
    ids = completion.token_ids
    if ids and ids[-1] in ctx.engine.tokenizer.end_ids:
        return None
    whole = ctx.engine.tokenizer.decode(ids)
    start = max(0, len(completion.text) - 1)
    found = [(at, i) for i, stop in enumerate(stops)
             if (at := whole.find(stop, start)) >= 0]
    return stops[min(found)[1]] if found else None


def _tool_use(call: ToolCall, with_input: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments) if with_input else {}}


def _message(s: _Reply, content: list[dict[str, Any]], stop: tuple[str | None,
             str | None], usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": s.id, "type": "message", "role": "assistant", "model": s.model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": usage}


def _message_body(run: ChatRun, s: _Reply, ctx: ServerContext,
                  completions: list[Completion]) -> dict[str, Any]:
    (result,) = run.results(completions)
    reply = result.reply
    content: list[dict[str, Any]] = []
    if result.reasoning is not None:
        content.append({"type": "thinking", "signature": "",
                        "thinking": result.reasoning if s.thinking_shown else ""})
    if reply.content or not reply.tool_calls:
        content.append({"type": "text", "text": reply.content or ""})
    content.extend(_tool_use(call) for call in reply.tool_calls)
    return _message(s, content, _stop(reply, result.completion, s, ctx),
                    _usage(result.completion))


@dataclass
class _Blocks:
    """The content blocks of a streamed reply as they form: which one is open, and how
    many were opened."""

    count: int = 0
    open: str | None = None  # the open block's type
    events: list[str] = field(default_factory=list)

    def delta(self, kind: str, delta: dict[str, Any]) -> None:
        """Extend the open block of this kind, opening it (and closing another) first."""
        if self.open != kind:
            self.close()
            empty = ({"type": "thinking", "thinking": "", "signature": ""}
                     if kind == "thinking" else {"type": "text", "text": ""})
            self._start(kind, empty)
        self.events.append(sse("content_block_delta", {"type": "content_block_delta",
                                                       "index": self.count - 1,
                                                       "delta": delta}))

    def tool_use(self, call: ToolCall) -> None:
        """A call, whole: its block, its input as one JSON delta, its end."""
        self.close()
        self._start("tool_use", _tool_use(call, with_input=False))
        self.events.append(sse("content_block_delta", {
            "type": "content_block_delta", "index": self.count - 1,
            "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
        self.close()

    def close(self) -> None:
        if self.open is not None:
            self.events.append(sse("content_block_stop", {"type": "content_block_stop",
                                                          "index": self.count - 1}))
            self.open = None

    def _start(self, kind: str, block: dict[str, Any]) -> None:
        self.events.append(sse("content_block_start", {"type": "content_block_start",
                                                       "index": self.count,
                                                       "content_block": block}))
        self.open = kind
        self.count += 1

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events


async def _message_events(run: ChatRun, s: _Reply, ctx: ServerContext
                          ) -> AsyncIterator[str]:
    usage = {"input_tokens": run.prompt_tokens, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0, "output_tokens": 0}
    yield sse("message_start", {"type": "message_start",
                                "message": _message(s, [], (None, None), usage)})
    yield sse("ping", {"type": "ping"})
    blocks = _Blocks()
    reply = Reply(None)
    try:
        async for e in run.events():
            if isinstance(e, ReasoningDelta):
                blocks.delta("thinking", {"type": "thinking_delta",
                                          "thinking": e.text if s.thinking_shown else ""})
            elif isinstance(e, ContentDelta) and e.text:
                blocks.delta("text", {"type": "text_delta", "text": e.text})
            elif isinstance(e, ToolCallDelta):
                blocks.tool_use(e.call)
            elif isinstance(e, ChoiceFinished):
                reply = e.reply
                if blocks.count == 0:  # an empty reply is one empty text block, as whole
                    blocks.delta("text", {"type": "text_delta", "text": ""})
                blocks.close()
            for event in blocks.take():
                yield event
    except EagerLMError as e:  # the engine's failure, or the request's own (a 400)
        yield error_ending(as_openai_error(e))
        return
    (completion,) = run.streams.completions()
    stop_reason, stop_sequence = _stop(reply, completion, s, ctx)
    yield sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason,
                                          "stop_sequence": stop_sequence},
                                "usage": _usage(completion)})
    yield sse("message_stop", {"type": "message_stop"})


__all__ = ["add_anthropic_routes", "anthropic_error_body", "error_ending"]
