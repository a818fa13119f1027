"""OpenAI's legacy Completions (`POST /v1/completions`): one or several prompts (text or
token ids), `n` choices each, streamed or not; with `suffix`, fill in the middle (the
prompt built as llama.cpp's server builds it: Tokenizer.encode_infill; a model without
FIM tokens is a 400).

The body's fields are service/http/openai_requests.py; the bodies sent back,
openai_responses.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from eagerlm.errors import EagerLMError
from eagerlm.service.api.records import Completion
from eagerlm.service.api.streams import MultiStream
from eagerlm.service.http.openai_errors import as_openai_error, bad_request
from eagerlm.service.http.openai_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    CompletionRequest,
    parse_completion_request,
)
from eagerlm.service.http.openai_responses import (
    DONE,
    ResponseIds,
    Usage,
    completion_body,
    completion_chunk_body,
    completion_logprobs_body,
    error_ending,
    event,
    finish_reason,
    text_length,
    usage_chunk_body,
)
from eagerlm.service.http.openai_sampling import resolve_max_tokens
from eagerlm.service.http.request_lifecycle import generation_response, prepare
from eagerlm.service.http.server_context import ServerContext


@dataclass
class _Submitted:
    streams: MultiStream
    ids: ResponseIds
    n_prompts: int
    n: int  # choices per prompt

    def groups(self, results: list[Completion]) -> list[list[Completion]]:
        """The completions of each prompt."""
        n = self.n
        return [results[i * n:(i + 1) * n] for i in range(self.n_prompts)]


def add_openai_completions_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/completions`."""

    @app.post("/v1/completions", dependencies=[Depends(ctx.authorize)])
    async def completions(request: Request) -> Response:
        req = parse_completion_request(await ctx.read_json(request))
        ctx.check_model(req.model)
        texts = req.prompts()
        if len(texts) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")

        async def submit() -> _Submitted:
            return await _submit(ctx, req, texts)

        return await generation_response(
            ctx, request, stream=bool(req.stream), submit=submit,
            stream_events=lambda s: _completion_events(s, req.include_usage),
            whole_body=lambda s, results: completion_body(s.ids, s.groups(results)),
            error_ending=error_ending)


async def _submit(ctx: ServerContext, req: CompletionRequest,
                  texts: list[str | list[int]]) -> _Submitted:
    engine = ctx.engine
    if req.suffix:
        if not engine.tokenizer.has_infill:
            raise bad_request("This model has no fill-in-the-middle tokens, so it "
                              "cannot complete between a prompt and a 'suffix'.",
                              param="suffix", code="unsupported_parameter")
        suffix = req.suffix
        prompts = await prepare(lambda: [engine.prepare_infill(p, suffix)
                                         for p in texts])  # type: ignore[arg-type]
    else:
        prompts = await prepare(lambda: [engine.prepare(p) for p in texts])
    n = req.n_choices
    requests = []
    for p in prompts:
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(p.ids),
                                        engine.context_length,
                                        COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
        requests += [(p, req.sampling_params(max_tokens, i, req.constraint()))
                     for i in range(n)]
    return _Submitted(engine.generate_many(requests), ResponseIds.new("cmpl", engine.name),
                      len(prompts), n)


async def _completion_events(s: _Submitted, include_usage: bool) -> AsyncIterator[str]:
    offsets = [0] * (s.n_prompts * s.n)  # each choice's legacy text_offset so far
    try:
        async for index, chunk in s.streams:
            reason = finish_reason(chunk.finish_reason)
            if chunk.text or reason is not None or chunk.logprobs:
                logprobs: dict[str, Any] | None = None
                if chunk.logprobs:
                    logprobs = completion_logprobs_body(chunk.logprobs, offsets[index])
                    offsets[index] += text_length(chunk.logprobs)
                yield event(completion_chunk_body(s.ids, index, chunk.text, reason,
                                                  include_usage, logprobs))
    except EagerLMError as e:  # the engine's failure (a 500), or the request's own (a 400)
        yield error_ending(as_openai_error(e))
        return
    if include_usage:
        groups = s.groups(s.streams.completions())
        yield event(usage_chunk_body(s.ids, "text_completion", Usage.of(groups)))
    yield DONE


__all__ = ["add_openai_completions_routes"]
