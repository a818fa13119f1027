"""POST /v1/embeddings in OpenAI's wire format: the body, the route, the response.

The request: `model`, `input` (a string, a list of strings, a list of token ids or a list
of such lists; at most MAX_INPUTS), `encoding_format` ("float", the default, or "base64":
the float32 vector's little-endian bytes in base64, as OpenAI's clients decode them),
`dimensions` (accepted only as the model's own width: a shorter vector would need a
model trained for truncation), `user` (ignored). Checked field by field as the other
routes' bodies are (service/http/openai_parsing.py).

Served for embedding GGUFs (a pooling type in the file) and for any model when the
server was started with `--embeddings` (service/api/embeddings.py).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import anyio
import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from eagerlm.service.http.openai_errors import bad_request
from eagerlm.service.http.openai_parsing import RequestBody, parse_body
from eagerlm.service.http.request_lifecycle import prepare, unless_disconnected
from eagerlm.service.http.server_context import ServerContext

MAX_INPUTS = 256


class EmbeddingRequest(RequestBody):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The texts or id lists to embed, one vector each."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise bad_request("'input' must not be an empty list", param="input")
        if all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        items: list[Any] = list(x)
        if len(items) > MAX_INPUTS:
            raise bad_request(f"At most {MAX_INPUTS} inputs per request.", param="input")
        if any(len(item) == 0 for item in items):
            raise bad_request("'input' must not hold an empty string or list", param="input")
        return items


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    return parse_body(body, EmbeddingRequest)


def embedding_body(model: str, vectors: Sequence[np.ndarray], n_tokens: int,
                   encoding_format: str | None) -> dict[str, Any]:
    def encode(v: np.ndarray) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.astype(np.float32).tolist()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def add_openai_embeddings_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/embeddings`."""
    engine, cfg = ctx.engine, ctx.config

    @app.post("/v1/embeddings", dependencies=[Depends(ctx.authorize)])
    async def embeddings(request: Request) -> Response:
        req = parse_embedding_request(await ctx.read_json(request))
        ctx.check_model(req.model)
        if not (cfg.embeddings or engine.pooling is not None):
            raise bad_request("This model is not an embedding model (its file declares no "
                              "pooling); start the server with --embeddings to embed with "
                              "it (mean pooling).", param="model",
                              code="unsupported_parameter")
        width = engine.model.config.d_model
        if req.dimensions is not None and req.dimensions != width:
            raise bad_request(f"'dimensions' must be this model's {width}.",
                              param="dimensions", code="unsupported_parameter")
        items = req.inputs()
        ids = await prepare(lambda: [engine.tokenizer.encode(x) if isinstance(x, str)
                                     else x for x in items])
        ticket = ctx.admit()
        try:
            await unless_disconnected(request, ticket.wait)
            vectors = await unless_disconnected(
                request, lambda: anyio.to_thread.run_sync(engine.embed, ids))
        finally:
            ticket.release()
        return JSONResponse(embedding_body(engine.name, vectors, sum(map(len, ids)),
                                           req.encoding_format))


__all__ = ["EmbeddingRequest", "add_openai_embeddings_routes", "embedding_body",
           "parse_embedding_request"]
