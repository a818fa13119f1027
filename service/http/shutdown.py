"""Stopping the HTTP server on SIGTERM or SIGINT without cutting anyone off mid-body.

uvicorn alone waits a while for open connections, then cancels what is left, so a
client reading a stream sees the connection close mid-body; and it re-raises the signal
once it has stopped, so the process dies of it (exit status -15) before the engine has
shut down. `GracefulServer` does this instead:

1. stop admitting: the listening sockets close, idle keep-alive connections close,
   responses under way close their connection when done, and a request that still
   arrives gets a 503 (`RefuseWhileDraining`), /health included, so probes see it;
2. wait up to the grace period (`ServerConfig.shutdown_grace_s`) for the requests in
   flight to finish on their own;
3. then end the rest (`Drain.expire`): a stream gets its API's in-band error ending
   (OpenAI's chat: `data: {"error": {...}}` then `data: [DONE]`), and a request not yet
   answered (queued for a slot, or generating a whole reply) gets a 503 in its API's
   error format (service/http/error_formats.py);
4. uvicorn's own shutdown follows, with a short backstop for connections that do not
   take those last bytes; `serve` returns, the caller shuts the engine down, and the
   process exits 0.

A second signal during the grace period ends it at once (step 3 without waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from types import FrameType

import anyio
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from eagerlm.service.http.error_formats import OPENAI_ONLY, ErrorFormats
from eagerlm.service.http.openai_errors import OpenAIError

AFTER_GRACE_S = 5  # uvicorn's backstop once streams have been ended: bytes left unsent


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "The server is shutting down; retry on another instance or "
                            "once it is back.", code="server_shutting_down")


class Drain:
    """A server's shutdown as its requests see it: `stopping` once it no longer admits
    requests, `expired` once the grace period is over and the requests left are ended.
    Every method runs on the server's event loop."""

    def __init__(self) -> None:
        self.stopping = False
        self.expired = False
        self._scopes: set[anyio.CancelScope] = set()

    def stop(self) -> None:
        self.stopping = True

    def expire(self) -> None:
        """End the grace period: cancel every scope from `cancelled_on_expiry`."""
        self.stopping = self.expired = True
        for scope in list(self._scopes):
            scope.cancel()

    @contextlib.contextmanager
    def cancelled_on_expiry(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that the end of the grace period cancels; its owner checks
        `cancelled_caught` afterwards and answers as a shutdown."""
        with anyio.CancelScope() as scope:
            if self.expired:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)


class RefuseWhileDraining:
    """Pure ASGI middleware: once the server is stopping, every new request gets a 503
    in its API's error format and its connection closes."""

    def __init__(self, app: ASGIApp, drain: Drain, errors: ErrorFormats = OPENAI_ONLY) -> None:
        self.app = app
        self.drain = drain
        self.errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.stopping:
            await self.app(scope, receive, send)
            return
        await self.errors.send(send, shutting_down(), scope.get("path", ""), close=True)


class GracefulServer(uvicorn.Server):
    """uvicorn's Server with the shutdown described in this module's docstring."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s
        self._signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler. Unlike uvicorn's it records nothing to re-raise once the
        server has stopped (the process exits 0, after the engine's shutdown), and a
        second signal shortens the grace period instead of skipping the shutdown."""
        self._signals += 1
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.stop()
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle: closed now; busy: closed after its response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while (self.server_state.connections and loop.time() < deadline
               and self._signals < 2):
            await asyncio.sleep(0.05)
        self.drain.expire()
        await super().shutdown(sockets)


__all__ = ["AFTER_GRACE_S", "Drain", "GracefulServer", "RefuseWhileDraining",
           "shutting_down"]
