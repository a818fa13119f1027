"""A POST body read as JSON, refused in OpenAI's error format when it is not what the
routes accept.

- Content-Type must be `application/json` (any case, parameters such as `charset=utf-8`
  allowed). OpenAI's clients always send it. Anything else is a 415, a missing header
  included: a browser sends `text/plain`, form types or no type at all cross-origin
  without asking the server first (no CORS preflight), so accepting them would let any
  web page a user visits drive a server on their machine. `application/*+json` types
  are refused too: no client of this API sends them.
- At most `limit` bytes, refused (413) as soon as the declared length or the bytes
  received pass it, before the rest is read.
- UTF-8 (RFC 8259 says JSON between systems is; a byte-order mark is skipped), decoded
  by service/api/bounded_json.py: nesting deeper than MAX_JSON_DEPTH and lone surrogates are
  400s like any invalid JSON, never a RecursionError or an unencodable string downstream.
- A client that closes its connection before the whole body came (a cancelled request,
  a client-side timeout, a half-sent body) raises `ClientGone`: a 499, not a 500
  (service/http/openai_errors.py).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from eagerlm.service.api import bounded_json
from eagerlm.service.http.openai_errors import ClientGone, OpenAIError, bad_request, brief

JSON_MEDIA_TYPE = "application/json"


async def read_json(request: Request, limit: int) -> Any:
    """The body of `request` as JSON (raises OpenAIError: 415, 413 or 400)."""
    check_content_type(request.headers.get("content-type"))
    body = await _read_at_most(request, limit)
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid UTF-8: {e}.",
                          code="invalid_json") from None
    try:
        return bounded_json.loads(text)
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.",
                          code="invalid_json") from None


def check_content_type(header: str | None) -> None:
    """Refuse (415) a body whose declared media type is not application/json."""
    media_type = (header or "").partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        got = f"got {brief(header)}" if header else "none was sent"
        raise OpenAIError(415, f"The request body must be JSON sent with 'Content-Type: "
                               f"{JSON_MEDIA_TYPE}' ({got}).",
                          code="unsupported_media_type")


async def _read_at_most(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:
        raise ClientGone(f"before its body was read ({len(body)} bytes came)") from None
    return bytes(body)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes.",
                       code="request_too_large")


__all__ = ["JSON_MEDIA_TYPE", "check_content_type", "read_json"]
