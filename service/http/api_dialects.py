"""The registry of the API dialects the server speaks: each is one module that adds its
routes (`add_routes(app, ctx)`) and, for a chat dialect, translates its body onto the one
internal chat request (service/http/chat_request.py) and renders the run back; plus the
paths it owns, whose errors are written in its format (service/http/error_formats.py).

Adding an API is one module and one row here: `create_app` (service/http/server.py) adds
every dialect's routes and builds the error formats from this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI

from eagerlm.service.http.anthropic_api import add_anthropic_routes, anthropic_error_body
from eagerlm.service.http.error_formats import ErrorBody, ErrorFormats, openai_error_body
from eagerlm.service.http.openai_chat import add_openai_chat_routes
from eagerlm.service.http.openai_completions import add_openai_completions_routes
from eagerlm.service.http.openai_embeddings import add_openai_embeddings_routes
from eagerlm.service.http.responses_api import add_responses_routes
from eagerlm.service.http.server_context import ServerContext
from eagerlm.service.http.vllm_tokenize import add_tokenize_routes


@dataclass(frozen=True)
class ApiDialect:
    name: str
    add_routes: Callable[[FastAPI, ServerContext], None]
    paths: tuple[str, ...]  # the paths it answers (and those below them)
    error_body: ErrorBody = openai_error_body  # how its errors are written


API_DIALECTS: tuple[ApiDialect, ...] = (
    ApiDialect("OpenAI Chat Completions", add_openai_chat_routes, ("/v1/chat/completions",)),
    ApiDialect("OpenAI Completions", add_openai_completions_routes, ("/v1/completions",)),
    ApiDialect("OpenAI Embeddings", add_openai_embeddings_routes, ("/v1/embeddings",)),
    ApiDialect("OpenAI Responses", add_responses_routes, ("/v1/responses",)),
    ApiDialect("Anthropic Messages", add_anthropic_routes, ("/v1/messages",),
               anthropic_error_body),
    ApiDialect("vLLM tokenize", add_tokenize_routes, ("/tokenize", "/detokenize")),
)


def error_formats(dialects: tuple[ApiDialect, ...] = API_DIALECTS) -> ErrorFormats:
    """Each dialect's paths with its error format (OpenAI's is the default: only the
    others are listed)."""
    return ErrorFormats(tuple((path, d.error_body) for d in dialects for path in d.paths
                              if d.error_body is not openai_error_body))


__all__ = ["API_DIALECTS", "ApiDialect", "error_formats"]
