"""A generation request's way through the server, whatever its API: a concurrency slot,
the prompt prepared off the event loop, the requests submitted, then a whole body or a
stream; a client that goes away, while queued or running, cancels its requests (so their
KV pages go back to the pool) and gets a 499 (`ClientGone`, answered by
service/http/openai_errors.py's handler); the server's shutdown grace period ending
first gives a 503.

`generation_response` is that way for one route: the route (one per API dialect) gives
how to submit its requests and how to render what they produce.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from eagerlm.errors import EagerLMError
from eagerlm.service.api.records import Completion
from eagerlm.service.api.streams import MultiStream
from eagerlm.service.http.admission import Ticket
from eagerlm.service.http.config import ServerConfig
from eagerlm.service.http.event_stream import EventStream
from eagerlm.service.http.openai_errors import ClientGone, OpenAIError, as_openai_error
from eagerlm.service.http.server_context import ServerContext
from eagerlm.service.http.shutdown import Drain, shutting_down

T = TypeVar("T")


class Submitted(Protocol):
    """What a route's `submit` returns: its requests as one stream, with whatever the
    route needs to render them."""

    streams: MultiStream


S = TypeVar("S", bound=Submitted)


async def generation_response(
        ctx: ServerContext, request: Request, *, stream: bool,
        submit: Callable[[], Awaitable[S]],
        stream_events: Callable[[S], AsyncIterator[str]],
        whole_body: Callable[[S, list[Completion]], Any],
        error_ending: Callable[[OpenAIError], str]) -> Response:
    """Admit the request, `submit` it (prompts prepared, requests made, nothing running
    yet), wait for a slot and start it, then answer: `stream_events` as server-sent
    events, or `whole_body` of the finished completions as JSON. `error_ending` ends a
    stream that fails (the dialect's error event)."""
    ticket = ctx.admit()
    submitted: S | None = None
    handed_over = False  # a streaming response releases the ticket when it ends
    try:
        submitted = await submit()
        queued = streams_while_queued(stream, ticket, ctx.config)
        if not queued:
            await admitted_and_started(request, ticket, submitted.streams)
        if stream:
            events = stream_events(submitted)
            if queued:
                events = after_admission(ticket, submitted.streams, events, error_ending)
            handed_over = True
            return EventStream(events, ticket, submitted.streams, ctx.drain, error_ending,
                               ctx.config.sse_keepalive_s, ctx.errors)
        completions = await unless_disconnected(request, submitted.streams.collect)
        return JSONResponse(whole_body(submitted, completions))
    finally:
        if not handed_over:
            if submitted is not None:
                submitted.streams.close()
            ticket.release()


async def prepare(fn: Callable[[], T]) -> T:
    """Render and tokenize on a worker thread. The request's own mistakes raise
    `EagerLMError`s, which the app's handler answers with 400s."""
    return await anyio.to_thread.run_sync(fn)


async def admitted_and_started(request: Request, ticket: Ticket,
                               streams: MultiStream) -> None:
    """Wait for a concurrency slot, then submit; a client leaving meanwhile cancels."""
    async def run() -> None:
        await ticket.wait()
        await streams.start()  # a request the engine refuses raises an EagerLMError
    await unless_disconnected(request, run)


def streams_while_queued(stream: bool | None, ticket: Ticket, cfg: ServerConfig) -> bool:
    """Whether a streamed request that must wait for a slot starts its response now, so
    that keep-alive comments flow while it is queued (proxies close a connection that
    sends nothing, headers included, for a minute or so). The price: a request the engine
    refuses once admitted gets an in-band error event instead of a 4xx."""
    return bool(stream) and not ticket.admitted and cfg.sse_keepalive_s > 0


async def after_admission(ticket: Ticket, streams: MultiStream, events: AsyncIterator[str],
                          error_ending: Callable[[OpenAIError], str]) -> AsyncIterator[str]:
    """`events` once the ticket holds a slot and the requests are submitted; a refusal
    (an `EagerLMError`) as `error_ending`. The client leaving while queued is seen at the
    next keep-alive, which cancels this."""
    try:
        await ticket.wait()
        await streams.start()
    except EagerLMError as e:
        yield error_ending(as_openai_error(e))
        return
    async for event in events:
        yield event


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, cancelling it if the client disconnects first (raises ClientGone: a
    499) or
    the server's shutdown grace period ends first (a 503).

    Once the body has been read, the next ASGI message can only be the disconnect.
    """
    drain: Drain = request.app.state.drain
    results: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        with drain.cancelled_on_expiry() as expiry:
            try:
                results.append(await work())
            except Exception as e:  # raised as itself below, not in an ExceptionGroup
                errors.append(e)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]
    if expiry.cancelled_caught:
        raise shutting_down()
    if not results:
        raise ClientGone("while its request waited or ran")
    return results[0]


__all__ = ["Submitted", "admitted_and_started", "after_admission", "generation_response",
           "prepare", "streams_while_queued", "unless_disconnected"]
