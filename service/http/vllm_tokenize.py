"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt or chat messages to the ids the
completion routes would use, and ids back to text (what a client needs to build a
`logit_bias`)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import Field

from eagerlm.service.http.openai_errors import bad_request
from eagerlm.service.http.openai_messages import ChatMessage, check_tool_fields
from eagerlm.service.http.openai_parsing import RequestBody, parse_body
from eagerlm.service.http.request_lifecycle import prepare
from eagerlm.service.http.server_context import ServerContext


class TokenizeRequest(RequestBody):
    """POST /tokenize, as vLLM's: a text `prompt` (`add_special_tokens`, default true: BOS
    where the model adds one), or chat `messages` rendered with the model's template
    (`add_generation_prompt`, default true), exactly as the completion routes encode them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        for name, applies_to in (("add_special_tokens", self.prompt),
                                 ("add_generation_prompt", self.messages)):
            if getattr(self, name) is not None and applies_to is None:
                other = "prompt" if name == "add_special_tokens" else "messages"
                raise bad_request(f"'{name}' applies to '{other}' only.", param=name)
        for i, message in enumerate(self.messages or ()):
            check_tool_fields(message, f"messages[{i}]")


class DetokenizeRequest(RequestBody):
    """POST /detokenize, as vLLM's: token ids back to their text (special tokens shown)."""

    model: str | None = None
    tokens: list[int]



def add_tokenize_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /tokenize` and `POST /detokenize`, behind the API key like the /v1 routes."""
    engine = ctx.engine

    @app.post("/tokenize", dependencies=[Depends(ctx.authorize)])
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(await ctx.read_json(request), TokenizeRequest)
        if req.model is not None:
            ctx.check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            messages = [m.for_template() for m in req.messages]
            ids = await prepare(lambda: tok.encode(engine.model.render_chat(
                messages, add_generation_prompt=req.add_generation_prompt is not False)))
        else:
            prompt = req.prompt or ""
            ids = await prepare(lambda: tok.encode(
                prompt, add_special=req.add_special_tokens is not False))
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(ctx.authorize)])
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(await ctx.read_json(request), DetokenizeRequest)
        if req.model is not None:
            ctx.check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Token {bad} is not in the vocabulary (ids 0 to {vocab - 1}).",
                              param="tokens", code="invalid_value")
        return {"prompt": engine.tokenizer.decode(req.tokens)}


__all__ = ["DetokenizeRequest", "TokenizeRequest", "add_tokenize_routes"]
