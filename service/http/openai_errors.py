"""Errors answered in OpenAI's format, and how their messages quote the client.

Every refusal the HTTP server sends, whatever its cause (a bad field, a full queue, an
unknown route, a server shutting down), is an `OpenAIError`: a status and OpenAI's body
`{"error": {"message", "type", "param", "code"}}`. It lives apart from the request and
response modules because both the request checks (service/http/openai_requests.py,
service/http/request_body.py) and the server's own refusals (server.py, shutdown.py)
raise it.
"""

from __future__ import annotations

from typing import Any


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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def brief(value: Any, limit: int = 40) -> str:
    """repr(value), cut short: how an error message quotes what the client sent. An
    error need not echo a huge input, and repr escapes what could not be encoded (a lone
    surrogate) or would confuse a reader (control characters)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
