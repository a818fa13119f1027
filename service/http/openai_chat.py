"""OpenAI's Chat Completions (`POST /v1/chat/completions`): the body translated onto the
engine's chat request (service/http/chat_request.py), and the run rendered back as
OpenAI's `chat.completion` body or its stream of `chat.completion.chunk` events.

The body's fields are service/http/openai_requests.py; the bodies sent back,
openai_responses.py. A reasoning model's `<think>` block comes back as
`message.reasoning_content` (streamed as `delta.reasoning_content`); tool calls as
`message.tool_calls`, streamed as one delta per call at the end, before the chunk with
the finish reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from eagerlm.errors import EagerLMError
from eagerlm.service.api.records import Completion
from eagerlm.service.http.chat_request import (
    ChatRequest,
    ChatRun,
    ChoiceFinished,
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    chat_response,
)
from eagerlm.service.http.ignored_fields import log_once
from eagerlm.service.http.openai_errors import as_openai_error
from eagerlm.service.http.openai_requests import ChatCompletionRequest, parse_chat_request
from eagerlm.service.http.openai_responses import (
    DONE,
    ResponseIds,
    Usage,
    chat_chunk_body,
    chat_completion_body,
    chat_finish_reason,
    chat_logprobs_body,
    error_ending,
    event,
    tool_call_delta,
    usage_chunk_body,
)
from eagerlm.service.http.server_context import ServerContext


def chat_request(req: ChatCompletionRequest, ctx: ServerContext) -> ChatRequest:
    """The OpenAI body as the engine's chat request (a 400 for tools the model's chat
    template cannot show or whose calls cannot be parsed)."""
    template = ctx.engine.model.chat_template
    parser = req.tool_parser(template)
    kwargs = req.template_kwargs()
    if "reasoning_effort" in kwargs and "reasoning_effort" not in template.variables:
        log_once("reasoning_effort", "this model's chat template does not read it")
    return ChatRequest(messages=req.template_messages(), sampling=req,
                       tools=req.template_tools, template_kwargs=kwargs, tool_parser=parser,
                       forced_tools=req.forced_tools(), constraint=req.constraint(),
                       max_tokens=req.requested_max_tokens, n=req.n_choices)


def add_openai_chat_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/chat/completions`."""

    @app.post("/v1/chat/completions", dependencies=[Depends(ctx.authorize)])
    async def chat_completions(request: Request) -> Response:
        req = parse_chat_request(await ctx.read_json(request))
        ctx.check_model(req.model)
        chat = chat_request(req, ctx)
        ids = ResponseIds.new("chatcmpl", ctx.engine.name)
        return await chat_response(
            ctx, request, chat, stream=bool(req.stream),
            stream_events=lambda run: _chat_events(run, ids, req.include_usage),
            whole_body=lambda run, completions: _chat_body(run, ids, completions),
            error_ending=error_ending)


def _chat_body(run: ChatRun, ids: ResponseIds, completions: list[Completion]
               ) -> dict[str, Any]:
    results = run.results(completions)
    body = chat_completion_body(ids, completions, [r.reply for r in results])
    for choice, result in zip(body["choices"], results):
        if result.reasoning is not None:
            choice["message"]["reasoning_content"] = result.reasoning
    return body


async def _chat_events(run: ChatRun, ids: ResponseIds,
                       include_usage: bool) -> AsyncIterator[str]:
    """The run's events as chunks: first each choice's role, then its reasoning as
    `reasoning_content` deltas, its content, its calls and its finish reason; the usage
    last when asked for, then [DONE]. A failure ends the stream with an error event."""
    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        return event(chat_chunk_body(ids, index, delta, finish, include_usage, logprobs))

    for i in range(run.request.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for e in run.events():
            if isinstance(e, ReasoningDelta):
                yield chunk(e.index, {"reasoning_content": e.text})
            elif isinstance(e, ContentDelta):
                yield chunk(e.index, {"content": e.text}, None, chat_logprobs_body(e.logprobs))
            elif isinstance(e, ToolCallDelta):
                yield chunk(e.index, tool_call_delta(e.position, e.call))
            elif isinstance(e, ChoiceFinished):
                yield chunk(e.index, {}, chat_finish_reason(e.reply, e.reason))
    except EagerLMError as e:  # the engine's failure (a 500), or the request's own (a 400)
        yield error_ending(as_openai_error(e))
        return
    if include_usage:
        yield event(usage_chunk_body(ids, "chat.completion.chunk",
                                     Usage.of([run.streams.completions()])))
    yield DONE


__all__ = ["add_openai_chat_routes", "chat_request"]
