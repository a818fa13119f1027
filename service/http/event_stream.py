"""A streamed response: server-sent events whose admission ticket is released however the
response ends (finished, client gone, server shutting down), with keep-alive comments
while no event comes.

The events themselves, and how a stream that fails ends, are the API dialect's (OpenAI's:
service/http/openai_responses.py's `event` and `error_ending`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from eagerlm.service.api.streams import MultiStream
from eagerlm.service.http.admission import Ticket
from eagerlm.service.http.error_formats import OPENAI_ONLY, ErrorFormats
from eagerlm.service.http.openai_errors import OpenAIError
from eagerlm.service.http.shutdown import Drain, shutting_down

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it


class EventStream(StreamingResponse):
    """Server-sent events whose admission ticket is released however the response ends.
    When the server's shutdown grace period ends first, the stream is cut between two
    events and closed with `error_ending(error)`, as a generation error closes it."""

    def __init__(self, events: AsyncIterator[str], ticket: Ticket, streams: MultiStream,
                 drain: Drain, error_ending: Callable[[OpenAIError], str],
                 keepalive_s: float = 0.0, errors: ErrorFormats = OPENAI_ONLY) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._ticket = ticket
        self._streams = streams
        self._drain = drain
        self._error_ending = error_ending
        self._keepalive_s = keepalive_s
        self._errors = errors  # a 503 before the stream started is a whole error body

    async def stream_response(self, send: Send) -> None:
        """Starlette's, plus a `: keep-alive` comment (which SSE clients skip) whenever no
        event came for `keepalive_s`: proxies and load balancers close connections idle
        for a minute or so, and a long prefill sends nothing for that long. The events
        are produced by a task of their own, so waiting for one never cancels it."""
        if self._keepalive_s <= 0:
            await super().stream_response(send)
            return
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        sender, receiver = anyio.create_memory_object_stream[str](1)

        async def produce() -> None:
            async with sender:
                async for event in self.body_iterator:
                    await sender.send(str(event))

        async with anyio.create_task_group() as tg, receiver:
            tg.start_soon(produce)
            while True:
                event = KEEPALIVE
                with anyio.move_on_after(self._keepalive_s):
                    try:
                        event = await receiver.receive()
                    except anyio.EndOfStream:
                        break
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = ended = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, ended
            await send(message)  # uvicorn writes a message whole or, cancelled, not at all
            started = True
            ended = message["type"] == "http.response.body" and not message.get("more_body")

        try:
            with self._drain.cancelled_on_expiry() as expiry:
                await super().__call__(scope, receive, tracking_send)
            if expiry.cancelled_caught and not ended:
                if not started:
                    await self._errors.send(send, shutting_down(), scope.get("path", ""))
                else:
                    tail = self._error_ending(shutting_down())
                    await send({"type": "http.response.body", "body": tail.encode(),
                                "more_body": False})
        finally:
            self._streams.close()
            self._ticket.release()


__all__ = ["KEEPALIVE", "EventStream"]
