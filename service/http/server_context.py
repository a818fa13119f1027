"""What every route of the server shares (`ServerContext`): the engine, the server's
settings, the admission gate and the shutdown, with the checks every route makes first
(the API key, the model name, a concurrency slot, the body).

Each group of routes is added by a function of its module that takes the app and this
context (`add_openai_chat_routes(app, ctx)`, ...), so a new API dialect is one module and
one line in `create_app` (service/http/server.py).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from eagerlm.dispatch.reasoning import ReasoningFormat
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.admission import AdmissionGate, QueueFull, Ticket
from eagerlm.service.http.config import ServerConfig
from eagerlm.service.http.error_formats import OPENAI_ONLY, ErrorFormats
from eagerlm.service.http.openai_errors import OpenAIError, brief
from eagerlm.service.http.request_body import read_json
from eagerlm.service.http.shutdown import Drain


@dataclass
class ServerContext:
    engine: Engine
    config: ServerConfig
    gate: AdmissionGate
    drain: Drain  # the server's shutdown, as requests see it
    reasoning_format: ReasoningFormat  # resolved for the model's chat template
    started: int  # when the server started (the model card's `created`)
    # responses by (route, status), kept by service/http/response_counts.py
    response_counts: dict[tuple[str, int], int] = field(default_factory=dict)
    # each path's error format (service/http/error_formats.py, from the dialect registry)
    errors: ErrorFormats = OPENAI_ONLY

    def authorize(self, request: Request) -> None:
        """With an API key, the request must carry `Authorization: Bearer KEY` (OpenAI's
        clients) or `x-api-key: KEY` (Anthropic's), else a 401."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(
                token.strip().encode(), key.encode()):
            return
        anthropic_key = request.headers.get("x-api-key")
        if anthropic_key is not None and secrets.compare_digest(
                anthropic_key.strip().encode(), key.encode()):
            return
        raise OpenAIError(401, "Incorrect API key provided. Send it as "
                               "'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
                          code="invalid_api_key")

    def check_model(self, name: str) -> None:
        """A 404 unless `name` is the model this server serves."""
        if name != self.engine.name:
            raise OpenAIError(404, f"The model {brief(name, 80)} does not exist; this "
                                   f"server serves '{self.engine.name}'.", param="model",
                              code="model_not_found")

    def admit(self) -> Ticket:
        """A place in the admission gate (a 429 when its queue is full)."""
        try:
            return self.gate.enter()
        except QueueFull as e:
            raise OpenAIError(429, f"The server is at capacity: {e}.",
                              code="rate_limit_exceeded") from None

    async def read_json(self, request: Request) -> Any:
        """The request's body as JSON, within the server's size limit."""
        return await read_json(request, self.config.max_body_bytes)


__all__ = ["ServerContext"]
