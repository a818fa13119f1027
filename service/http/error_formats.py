"""Every refusal answered in the format of the API its path belongs to.

The server raises one kind of error whatever the API (`OpenAIError`: a status, a message,
the parameter at fault; service/http/openai_errors.py); how it is written back is the API
dialect's: OpenAI's `{"error": {"message", "type", "param", "code"}}` by default,
Anthropic's `{"type": "error", "error": {"type", "message"}}` under /v1/messages. Which path
speaks which is the registry of API dialects' (service/http/api_dialects.py:
`ErrorFormats` is built from it), so an unknown route, a wrong key, an oversized body or a
server shutting down is answered under /v1/messages as an Anthropic client expects, and
everywhere else as an OpenAI client does.

`add_error_handlers` answers every exception a route raises that way: `OpenAIError`s as
they are, eagerlm's own errors through `as_openai_error` (the one mapping of
`EagerLMError` to HTTP), Starlette's 404s and 405s, FastAPI's validation errors (400), and
anything else, a bug, as a logged 500. A client that went away (`ClientGone`) gets a 499
nobody reads (service/http/openai_errors.py says why).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from eagerlm.errors import EagerLMError
from eagerlm.service.http.openai_errors import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    OpenAIError,
    as_openai_error,
    bad_request,
    log,
)

# An API's error body for an error.
ErrorBody = Callable[[OpenAIError], dict[str, Any]]


def openai_error_body(error: OpenAIError) -> dict[str, Any]:
    return error.body()


def error_json(body: dict[str, Any]) -> bytes:
    """An error body as ASCII JSON: a message that quotes what the client sent, or an
    exception's text, always encodes."""
    return json.dumps(body, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True)
class ErrorFormats:
    """Which error body each path gets: the format of the first prefix it falls under (the
    path itself or below it), else OpenAI's."""

    by_prefix: tuple[tuple[str, ErrorBody], ...] = ()

    def body(self, error: OpenAIError, path: str) -> dict[str, Any]:
        for prefix, body in self.by_prefix:
            if path == prefix or path.startswith(prefix + "/"):
                return body(error)
        return openai_error_body(error)

    def response(self, error: OpenAIError, path: str) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return Response(error_json(self.body(error, path)), status_code=error.status,
                        headers=headers, media_type="application/json")

    async def send(self, send: Send, error: OpenAIError, path: str,
                   close: bool = False) -> None:
        """A whole error response, through the raw ASGI `send` (middleware, a stream
        refused before it started)."""
        body = error_json(self.body(error, path))
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


OPENAI_ONLY = ErrorFormats()


def add_error_handlers(app: FastAPI, formats: ErrorFormats) -> None:
    """Every error a route raises, answered in its path's API format."""

    def answer(request: Request, error: OpenAIError) -> Response:
        return formats.response(error, request.url.path)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return answer(request, exc)

    @app.exception_handler(EagerLMError)
    async def eagerlm_error(request: Request, exc: EagerLMError) -> Response:
        return answer(request, as_openai_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"Unknown route {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}
        return answer(request, OpenAIError(exc.status_code,
                                           message.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return answer(request, bad_request(str(exc)))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        log.info("%s %s: %d, the client closed the connection %s", request.method,
                 request.url.path, CLIENT_CLOSED_REQUEST, exc)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse | Response:
        log.exception("request failed")
        return answer(request, OpenAIError(500, f"Internal server error: {exc!r}"))


__all__ = ["OPENAI_ONLY", "ErrorBody", "ErrorFormats", "add_error_handlers", "error_json",
           "openai_error_body"]
