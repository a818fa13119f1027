"""Errors answered in OpenAI's format, and how their messages quote the client.

Every refusal the HTTP server sends, whatever its cause (a bad field, a full queue, an
unknown route, a server shutting down), is an `OpenAIError`: a status and OpenAI's body
`{"error": {"message", "type", "param", "code"}}`. It lives apart from the request and
response modules because both the request checks (service/http/openai_requests.py,
service/http/request_body.py) and the server's own refusals (server.py, shutdown.py)
raise it.

How each API writes it back (OpenAI's body, or Anthropic's under /v1/messages) and the
handlers that answer every exception a route raises: service/http/error_formats.py.

A client that goes away before it is answered (`ClientGone`: while its body is read,
while it waits for a slot, while it generates) is no error of the server's: it is
answered 499, "client closed request", as nginx and vLLM log it (nobody reads that
answer, but the response counter counts it as that, not as a 5xx), with one line at info
level and no traceback; nothing is generated for it, or what was is cancelled.
"""

from __future__ import annotations

import logging
from typing import Any

from eagerlm.errors import EagerLMError, EngineClosed, EngineFailure

log = logging.getLogger("eagerlm.server")

CLIENT_CLOSED_REQUEST = 499  # nginx's and vLLM's status for a client that went away


class OpenAIError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ClientGone(Exception):
    """The client closed its connection before its request was answered; the message
    says when ("before its body was read", ...)."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def brief(value: Any, limit: int = 40) -> str:
    """repr(value), cut short: how an error message quotes what the client sent. An
    error need not echo a huge input, and repr escapes what could not be encoded (a lone
    surrogate) or would confuse a reader (control characters)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def as_openai_error(e: EagerLMError) -> OpenAIError:
    """The one mapping of eagerlm's errors to HTTP: the request's own mistakes (invalid
    parameters, a prompt or context too long, a chat template that refuses the messages)
    are 400s naming the parameter at fault, a closed engine is a 503, and the engine's own
    failure a 500."""
    if isinstance(e, EngineFailure):
        log.error("request failed", exc_info=e)
        return OpenAIError(500, f"Generation failed: {e}")
    if isinstance(e, EngineClosed):
        return OpenAIError(503, f"The engine is shut down ({e}); retry on another instance "
                                f"or once it is back.", code="engine_closed")
    return bad_request(str(e), param=e.param)


__all__ = ["CLIENT_CLOSED_REQUEST", "ClientGone", "OpenAIError", "as_openai_error",
           "bad_request", "brief", "log"]
