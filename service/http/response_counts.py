"""Responses counted by route and status, for /metrics' `eagerlm_http_responses_total`,
the 500s of unexpected exceptions included."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# the routes counted by name; every other path is counted as "other"
COUNTED_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                  "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/health",
                  "/metrics", "/")


class ResponseCounter:
    """Pure ASGI middleware counting responses into `counts[(route, status)]`. (Starlette's
    BaseHTTPMiddleware would sit between a streaming response and the client's
    disconnect, so it is avoided.)"""

    def __init__(self, app: ASGIApp, counts: dict[tuple[str, int], int]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in COUNTED_ROUTES else "other"

        started = False

        def count(status: int) -> None:
            self.counts[route, status] = self.counts.get((route, status), 0) + 1

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # Starlette's ServerErrorMiddleware, outside every user middleware, answers
            # the 500 once the exception has passed here: counted here for it.
            if not started:
                count(500)
            raise


__all__ = ["COUNTED_ROUTES", "ResponseCounter"]
