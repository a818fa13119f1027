"""The server before its model is loaded: bound, answering, and saying it is not ready.

`eagerlm serve` binds its port first and loads the model meanwhile, so that a load balancer
or Kubernetes' readiness probe sees `/health` answer 503 `{"status": "loading"}` (and every
other route a 503 in its API's error format) instead of a refused connection it cannot tell from
a crash; once the engine is up, `WhileLoading.ready` hands every request to the real app.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from eagerlm.service.http.error_formats import OPENAI_ONLY, ErrorFormats
from eagerlm.service.http.openai_errors import OpenAIError


class WhileLoading:
    """Pure ASGI app: 503s until `ready(app)`, then `app` answers everything."""

    def __init__(self, errors: ErrorFormats = OPENAI_ONLY) -> None:
        self._app: ASGIApp | None = None
        self._errors = errors

    def ready(self, app: ASGIApp) -> None:
        self._app = app

    @property
    def loaded(self) -> bool:
        return self._app is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self._app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":  # no lifespan (the server runs with lifespan off)
            return
        if scope.get("path") == "/health":
            body = json.dumps({"status": "loading"}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", b"5")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await self._errors.send(send, OpenAIError(
            503, "The model is still loading; retry shortly.", code="model_loading"),
            scope.get("path", ""))


__all__ = ["WhileLoading"]
