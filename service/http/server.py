"""The OpenAI-compatible HTTP server (`eagerlm serve`): FastAPI on uvicorn over one Engine.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events or not), POST /tokenize and /detokenize (vLLM's: a prompt or chat
messages to the ids the completion routes would use, and ids back to text; what a client
needs to build a `logit_bias`), GET /health, GET /metrics (Prometheus text), GET
/server_info and /get_load (SGLang's: what its router reads from a worker;
service/http/sglang_worker.py).

What a client can count on:
- every error is OpenAI's JSON error body with the status OpenAI would use (400 for a bad
  field or a prompt too long, 401 for a wrong key, 404 for an unknown model or route, 413
  for an oversized body, 415 for a body not sent as `application/json`, 429 when the
  queue is full, 503 while shutting down), and the server keeps serving; no input
  makes it a 500 (JSON nested too deep or holding a lone surrogate is a 400:
  service/request_body.py), and a 500 of a bug is counted in /metrics like any response;
- a field the engine cannot honour is refused, never silently ignored
  (service/http/openai_requests.py);
- penalties (`presence_penalty`, `frequency_penalty`, and vLLM's `repetition_penalty`),
  `logit_bias` ({"token id": bias in [-100, 100]}; an id outside the vocabulary is a 400)
  and log-probabilities (chat: `logprobs` + `top_logprobs`; completions: `logprobs: N`) in
  OpenAI's formats, streamed or not;
- fill in the middle (completions' `suffix`, for models with FIM tokens such as
  Qwen2.5-Coder): the prompt built as llama.cpp's server builds it
  (Tokenizer.encode_infill); a model without them, or id prompts, are a 400;
- tool calling (`tools`, `tool_choice` "auto", "none", "required" or a named function,
  `parallel_tool_calls`, `strict`) for models whose chat template shows tools: calls the
  model writes (Hermes/Qwen `<tool_call>` blocks or Llama 3 JSON, chosen by the template)
  come back as `message.tool_calls` with finish_reason "tool_calls", streamed as one delta
  per call at the end; text that is not a valid call of a given tool stays content, and a
  reply cut by max_tokens is never parsed (service/tool_calls.py). A forced call is
  constrained to one call whose arguments follow the tool's parameter schema; tools for a
  model whose template cannot show them are a 400;
- structured output: `response_format` json_object / json_schema (chat), llama.cpp's
  `json_schema` and `grammar` (GBNF) on both routes, by constrained decoding
  (dispatch/grammar.py); an invalid schema or grammar, or one beyond its limits (at
  submission or while generating), is a 400 naming the field;
- a client that goes away, mid-stream or while queued, cancels its requests, so their KV
  pages go back to the pool;
- at most `max_concurrency` requests generate at once, `max_queue` more wait
  (service/admission.py);
- on SIGTERM or SIGINT it stops admitting, gives the requests in flight
  `shutdown_grace_s` to finish, ends the rest cleanly (a stream with an error event and
  [DONE], others with a 503) and returns, so the process exits 0 (service/shutdown.py);
- it binds 127.0.0.1 unless told otherwise; with an API key, /v1 routes need
  `Authorization: Bearer KEY` (/health and /metrics stay open, for probes and scrapers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.reasoning import (
    ReasoningBlock,
    ReasoningFormat,
    ReasoningStream,
    Split,
    prompt_opens_reasoning,
    split_reasoning,
)
from eagerlm.errors import EagerLMError, EngineClosed, EngineFailure
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.service.api.engine import Engine, MultiStream
from eagerlm.service.api.metrics import PrometheusText
from eagerlm.service.api.tool_calls import Reply, ToolCallParser
from eagerlm.service.api.vllm_metrics import write_vllm_metrics
from eagerlm.service.http.admission import AdmissionGate, QueueFull, Ticket
from eagerlm.service.http.config import ServerConfig
from eagerlm.service.http.ignored_fields import log_once
from eagerlm.service.http.liveness import EngineDied, EngineWatchdog
from eagerlm.service.http.loading import WhileLoading
from eagerlm.service.http.openai_embeddings import embedding_body, parse_embedding_request
from eagerlm.service.http.openai_errors import OpenAIError, bad_request, brief
from eagerlm.service.http.openai_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    resolve_max_tokens,
)
from eagerlm.service.http.openai_responses import (
    ResponseIds,
    Usage,
    chat_chunk_body,
    chat_completion_body,
    chat_finish_reason,
    chat_logprobs_body,
    completion_body,
    completion_chunk_body,
    completion_logprobs_body,
    finish_reason,
    text_length,
    tool_call_delta,
    usage_chunk_body,
)
from eagerlm.service.http.request_body import read_json
from eagerlm.service.http.sglang_worker import add_sglang_worker_routes
from eagerlm.service.http.shutdown import (
    AFTER_GRACE_S,
    Drain,
    GracefulServer,
    RefuseWhileDraining,
    send_error,
    shutting_down,
)

log = logging.getLogger("eagerlm.server")

T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


class _ResponseCounter:
    """Pure ASGI middleware counting responses by route and status, the 500s of
    unexpected exceptions included. (Starlette's BaseHTTPMiddleware would sit between a
    streaming response and the client's disconnect, so it is avoided.)"""

    def __init__(self, app: ASGIApp, counts: dict[tuple[str, int], int]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"

        started = False

        def count(status: int) -> None:
            self.counts[route, status] = self.counts.get((route, status), 0) + 1

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # Starlette's ServerErrorMiddleware, outside every user middleware, answers
            # the 500 once the exception has passed here: counted here for it.
            if not started:
                count(500)
            raise


_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
           "/health", "/metrics")


class _EventStream(StreamingResponse):
    """Server-sent events whose admission ticket is released however the response ends
    (finished, client gone, server shutting down). When the server's shutdown grace
    period ends first, the stream is cut between two events and closed with an error
    event and [DONE], as a generation error closes it."""

    def __init__(self, events: AsyncIterator[str], ticket: Ticket,
                 streams: MultiStream, drain: Drain, keepalive_s: float = 0.0) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._ticket = ticket
        self._streams = streams
        self._drain = drain
        self._keepalive_s = keepalive_s

    async def stream_response(self, send: Send) -> None:
        """Starlette's, plus a `: keep-alive` comment (which SSE clients skip) whenever no
        event came for `keepalive_s`: proxies and load balancers close connections idle
        for a minute or so, and a long prefill sends nothing for that long. The events
        are produced by a task of their own, so waiting for one never cancels it."""
        if self._keepalive_s <= 0:
            await super().stream_response(send)
            return
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        sender, receiver = anyio.create_memory_object_stream[str](1)

        async def produce() -> None:
            async with sender:
                async for event in self.body_iterator:
                    await sender.send(str(event))

        async with anyio.create_task_group() as tg, receiver:
            tg.start_soon(produce)
            while True:
                event = _KEEPALIVE
                with anyio.move_on_after(self._keepalive_s):
                    try:
                        event = await receiver.receive()
                    except anyio.EndOfStream:
                        break
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = ended = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, ended
            await send(message)  # uvicorn writes a message whole or, cancelled, not at all
            started = True
            ended = message["type"] == "http.response.body" and not message.get("more_body")

        try:
            with self._drain.cancelled_on_expiry() as expiry:
                await super().__call__(scope, receive, tracking_send)
            if expiry.cancelled_caught and not ended:
                if not started:
                    await send_error(send, shutting_down())
                else:
                    tail = _error_event(shutting_down()) + _DONE
                    await send({"type": "http.response.body", "body": tail.encode(),
                                "more_body": False})
        finally:
            self._streams.close()
            self._ticket.release()


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error_event(error: OpenAIError) -> str:
    """An in-band error, ASCII whatever its message holds, so it always encodes."""
    return f"data: {json.dumps(error.body())}\n\n"


_DONE = "data: [DONE]\n\n"
_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it


class _ErrorResponse(JSONResponse):
    """An OpenAI error body, rendered as ASCII: a message that quotes what the client
    sent, or an exception's text, always encodes."""

    def __init__(self, error: OpenAIError, headers: dict[str, str] | None = None) -> None:
        super().__init__(error.body(), status_code=error.status, headers=headers)

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def create_app(engine: Engine, config: ServerConfig | None = None,
               drain: Drain | None = None) -> FastAPI:
    """The ASGI app serving `engine`. The engine's lifetime is the caller's; `drain`, the
    server's shutdown as requests see it, when the server exists before the app."""
    cfg = config or ServerConfig()
    gate = AdmissionGate(cfg.max_concurrency, cfg.max_queue)
    drain = drain or Drain()
    reasoning_format = ReasoningFormat(cfg.reasoning_format).resolve(
        engine.model.chat_template)  # dispatch/reasoning.py
    response_counts: dict[tuple[str, int], int] = {}
    started = int(time.time())
    app = FastAPI(title="eagerlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RefuseWhileDraining, drain=drain)
    app.add_middleware(_ResponseCounter, counts=response_counts)  # outermost: counts all
    app.state.engine = engine
    app.state.gate = gate
    app.state.drain = drain  # what GracefulServer's shutdown drives

    # -- errors, all in OpenAI's format ----------------------------------------------------

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _ErrorResponse(exc, headers=headers)

    @app.exception_handler(EagerLMError)
    async def eagerlm_error(request: Request, exc: EagerLMError) -> JSONResponse:
        return _ErrorResponse(_as_openai_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"Unknown route {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}
        return _ErrorResponse(OpenAIError(exc.status_code,
                                          message.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _ErrorResponse(bad_request(str(exc)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return _ErrorResponse(OpenAIError(500, f"Internal server error: {exc!r}"))

    # -- helpers ----------------------------------------------------------------------------

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), cfg.api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided. Send it as "
                                   "'Authorization: Bearer KEY'.", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != engine.name:
            raise OpenAIError(404, f"The model {brief(name, 80)} does not exist; this "
                                   f"server serves '{engine.name}'.", param="model",
                              code="model_not_found")

    def admit() -> Ticket:
        try:
            return gate.enter()
        except QueueFull as e:
            raise OpenAIError(429, f"The server is at capacity: {e}.",
                              code="rate_limit_exceeded") from None

    # -- routes -----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        failure = engine.failure  # 503 once the engine cannot serve (service/http/liveness.py)
        if failure is not None:
            return JSONResponse({"status": "error", "model": engine.name, "error": failure},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": engine.name,
                             "requests_running": engine.active_requests})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        out = PrometheusText()
        engine.write_metrics(out)
        out.gauge("eagerlm_queue_length", "HTTP requests waiting for a concurrency slot.",
                  gate.queued)
        out.gauge("eagerlm_http_requests_active", "HTTP requests holding a concurrency slot.",
                  gate.active)
        out.family("eagerlm_http_responses_total", "counter", "Responses by route and status.")
        for (route, status), n in sorted(response_counts.items()):
            out.sample("eagerlm_http_responses_total", n,
                       {"route": route, "status": str(status)})
        write_vllm_metrics(out, engine.metrics, engine.name,  # service/api/vllm_metrics.py
                           engine.vllm_gauges(gate.queued))
        return PlainTextResponse(out.text(), media_type="text/plain; version=0.0.4")

    add_sglang_worker_routes(app, engine, gate)  # GET /server_info, /get_load

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(engine, started)]}

    @app.get("/v1/models/{model}", dependencies=[Depends(authorize)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return _model_card(engine, started)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_tokenize_request(await read_json(request, cfg.max_body_bytes))
        if req.model is not None:
            check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            messages = [m.for_template() for m in req.messages]
            ids = await _prepare(lambda: tok.encode(engine.model.render_chat(
                messages, add_generation_prompt=req.add_generation_prompt is not False)))
        else:
            prompt = req.prompt or ""
            ids = await _prepare(lambda: tok.encode(
                prompt, add_special=req.add_special_tokens is not False))
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_detokenize_request(await read_json(request, cfg.max_body_bytes))
        if req.model is not None:
            check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Token {bad} is not in the vocabulary (ids 0 to {vocab - 1}).",
                              param="tokens", code="invalid_value")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        req = parse_chat_request(await read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        messages, tools = req.template_messages(), req.template_tools
        parser = req.tool_parser(engine.model.chat_template)
        template_kwargs = req.template_kwargs()
        if ("reasoning_effort" in template_kwargs
                and "reasoning_effort" not in engine.model.chat_template.variables):
            log_once("reasoning_effort", "this model's chat template does not read it")
        ticket = admit()
        streams: MultiStream | None = None
        handed_over = False  # a streaming response releases the ticket when it ends
        try:
            prompt = await _prepare(lambda: engine.prepare_chat(messages, tools,
                                                                template_kwargs))
            thinking = _Thinking(reasoning_format, prompt.chat_text)
            max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt.ids),
                                            engine.context_length, None, "messages")
            constraint = req.tool_constraint(parser, _is_special_text(engine)) \
                or req.constraint()
            streams = engine.generate_many(
                [(prompt, thinking.params(req.sampling_params(max_tokens, i, constraint)))
                 for i in range(req.n_choices)])
            queued = _streams_while_queued(req.stream, ticket, cfg)
            if not queued:
                await _admitted_and_started(request, ticket, streams)
            ids = ResponseIds.new("chatcmpl", engine.name)
            if req.stream:
                events = _chat_events(streams, ids, req.n_choices, req.include_usage,
                                      parser, thinking)
                if queued:
                    events = _after_admission(ticket, streams, events)
                handed_over = True
                return _EventStream(events, ticket, streams, drain, cfg.sse_keepalive_s)
            completions = await _unless_disconnected(request, streams.collect)
            splits = [thinking.split(c.text) for c in completions]
            replies = [parser.reply(sp.content, c.finish_reason is FinishReason.STOP)
                       if parser is not None else Reply(sp.content)
                       for c, sp in zip(completions, splits)]
            body = chat_completion_body(ids, completions, replies)
            for choice, sp in zip(body["choices"], splits):
                if sp.reasoning is not None:
                    choice["message"]["reasoning_content"] = sp.reasoning
            return JSONResponse(body)
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                if streams is not None:
                    streams.close()
                ticket.release()

    @app.post("/v1/embeddings", dependencies=[Depends(authorize)])
    async def embeddings(request: Request) -> Response:
        req = parse_embedding_request(await read_json(request, cfg.max_body_bytes))
        check_model(req.model)
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
        ids = await _prepare(lambda: [engine.tokenizer.encode(x) if isinstance(x, str)
                                      else x for x in items])
        ticket = admit()
        try:
            await _unless_disconnected(request, ticket.wait)
            vectors = await _unless_disconnected(
                request, lambda: anyio.to_thread.run_sync(engine.embed, ids))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            ticket.release()
        return JSONResponse(embedding_body(engine.name, vectors, sum(map(len, ids)),
                                           req.encoding_format))

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        req = parse_completion_request(await read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        texts = req.prompts()
        if len(texts) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
        ticket = admit()
        streams: MultiStream | None = None
        handed_over = False  # a streaming response releases the ticket when it ends
        try:
            if req.suffix:
                if not engine.tokenizer.has_infill:
                    raise bad_request("This model has no fill-in-the-middle tokens, so it "
                                      "cannot complete between a prompt and a 'suffix'.",
                                      param="suffix", code="unsupported_parameter")
                suffix = req.suffix
                prompts = await _prepare(lambda: [engine.prepare_infill(p, suffix)
                                                  for p in texts])  # type: ignore[arg-type]
            else:
                prompts = await _prepare(lambda: [engine.prepare(p) for p in texts])
            n = req.n_choices
            requests = []
            for p in prompts:
                max_tokens = resolve_max_tokens(req.requested_max_tokens, len(p.ids),
                                                engine.context_length,
                                                COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
                requests += [(p, req.sampling_params(max_tokens, i, req.constraint()))
                             for i in range(n)]
            streams = engine.generate_many(requests)
            queued = _streams_while_queued(req.stream, ticket, cfg)
            if not queued:
                await _admitted_and_started(request, ticket, streams)
            ids = ResponseIds.new("cmpl", engine.name)
            if req.stream:
                events = _completion_events(streams, ids, len(prompts), n, req.include_usage)
                if queued:
                    events = _after_admission(ticket, streams, events)
                handed_over = True
                return _EventStream(events, ticket, streams, drain, cfg.sse_keepalive_s)
            results = await _unless_disconnected(request, streams.collect)
            groups = [results[i * n:(i + 1) * n] for i in range(len(prompts))]
            return JSONResponse(completion_body(ids, groups))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                if streams is not None:
                    streams.close()
                ticket.release()

    return app


def _model_card(engine: Engine, created: int) -> dict[str, Any]:
    return {"id": engine.name, "object": "model", "created": created, "owned_by": "eagerlm",
            "max_model_len": engine.context_length}


def _is_special_text(engine: Engine) -> Callable[[str], bool]:
    """Whether a text is one special token of the model's vocabulary (a forced call's
    markers are then written as that token, as the model learned them)."""
    tok = engine.tokenizer

    def is_special(text: str) -> bool:
        tid = tok.token_id(text)
        return tid is not None and tok.is_special(tid)
    return is_special


def _as_openai_error(e: EagerLMError) -> OpenAIError:
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


async def _prepare(fn: Callable[[], T]) -> T:
    """Render and tokenize on a worker thread. The request's own mistakes raise
    `EagerLMError`s, which the app's handler answers with 400s."""
    return await anyio.to_thread.run_sync(fn)


async def _admitted_and_started(request: Request, ticket: Ticket,
                                streams: MultiStream) -> None:
    """Wait for a concurrency slot, then submit; a client leaving meanwhile cancels."""
    async def run() -> None:
        await ticket.wait()
        await streams.start()  # a request the engine refuses raises an EagerLMError
    await _unless_disconnected(request, run)


def _streams_while_queued(stream: bool | None, ticket: Ticket, cfg: ServerConfig) -> bool:
    """Whether a streamed request that must wait for a slot starts its response now, so
    that keep-alive comments flow while it is queued (proxies close a connection that
    sends nothing, headers included, for a minute or so). The price: a request the engine
    refuses once admitted gets an in-band error event instead of a 4xx."""
    return bool(stream) and not ticket.admitted and cfg.sse_keepalive_s > 0


async def _after_admission(ticket: Ticket, streams: MultiStream,
                           events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events` once the ticket holds a slot and the requests are submitted; a refusal
    (an `EagerLMError`) as an error event and [DONE]. The client leaving while queued is
    seen at the next keep-alive, which cancels this."""
    try:
        await ticket.wait()
        await streams.start()
    except EagerLMError as e:
        yield _error_event(_as_openai_error(e))
        yield _DONE
        return
    async for event in events:
        yield event


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, cancelling it if the client disconnects first (raises _ClientGone) or
    the server's shutdown grace period ends first (a 503).

    Once the body has been read, the next ASGI message can only be the disconnect.
    """
    drain: Drain = request.app.state.drain
    results: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        with drain.cancelled_on_expiry() as expiry:
            try:
                results.append(await work())
            except Exception as e:  # raised as itself below, not in an ExceptionGroup
                errors.append(e)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]
    if expiry.cancelled_caught:
        raise shutting_down()
    if not results:
        raise _ClientGone()
    return results[0]


class _Thinking:
    """One request's reasoning split (dispatch/reasoning.py), or none."""

    def __init__(self, fmt: ReasoningFormat, prompt_text: str | None) -> None:
        self.on = fmt is ReasoningFormat.DEEPSEEK
        self.opened = prompt_opens_reasoning(prompt_text)

    def params(self, params: SamplingParams) -> SamplingParams:
        """Stop strings skip the reasoning (dispatch/token_judge.py)."""
        if not self.on:
            return params
        block = ReasoningBlock.OPEN if self.opened else ReasoningBlock.MAY_OPEN
        return dataclasses.replace(params, reasoning_block=block)

    def split(self, text: str) -> Split:
        return split_reasoning(text, self.opened) if self.on else Split(None, text)

    def stream(self) -> ReasoningStream | None:
        return ReasoningStream(self.opened) if self.on else None


async def _chat_events(streams: MultiStream, ids: ResponseIds, n: int,
                       include_usage: bool, parser: ToolCallParser | None,
                       thinking: _Thinking) -> AsyncIterator[str]:
    """Each choice's content as it comes, its reasoning as `reasoning_content` deltas
    (dispatch/reasoning.py); with tools, answer text that may be a call is held back
    (service/tool_calls.py), and the calls follow at the end, one delta each, before the
    chunk with the finish reason."""
    splitters = [parser.stream() if parser is not None else None for _ in range(n)]
    thoughts = [thinking.stream() for _ in range(n)]
    for i in range(n):
        yield _event(chat_chunk_body(ids, i, {"role": "assistant", "content": ""}, None,
                                     include_usage))
    try:
        async for index, chunk in streams:
            splitter, thought = splitters[index], thoughts[index]
            reasoning, text = "", chunk.text
            if thought is not None:
                reasoning, text = thought.push(text)
                if chunk.finish_reason is not None:
                    more_reasoning, more_text = thought.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                yield _event(chat_chunk_body(ids, index, {"reasoning_content": reasoning},
                                             None, include_usage))
            text = text if splitter is None else splitter.push(text)
            if text or chunk.logprobs:  # tokens that show no text still have logprobs
                yield _event(chat_chunk_body(ids, index, {"content": text}, None,
                                             include_usage,
                                             chat_logprobs_body(chunk.logprobs)))
            if chunk.finish_reason is None:
                continue
            rest = Reply(None)
            if splitter is not None:
                rest = splitter.finish(chunk.finish_reason is FinishReason.STOP)
            if rest.content:
                yield _event(chat_chunk_body(ids, index, {"content": rest.content}, None,
                                             include_usage))
            for k, call in enumerate(rest.tool_calls):
                yield _event(chat_chunk_body(ids, index, tool_call_delta(k, call), None,
                                             include_usage))
            yield _event(chat_chunk_body(ids, index, {},
                                         chat_finish_reason(rest, chunk.finish_reason),
                                         include_usage))
    except EagerLMError as e:  # the engine's failure (a 500), or the request's own (a 400)
        yield _error_event(_as_openai_error(e))
        yield _DONE
        return
    if include_usage:
        yield _event(usage_chunk_body(ids, "chat.completion.chunk",
                                      Usage.of([streams.completions()])))
    yield _DONE


async def _completion_events(streams: MultiStream, ids: ResponseIds, n_prompts: int, n: int,
                             include_usage: bool) -> AsyncIterator[str]:
    offsets = [0] * (n_prompts * n)  # each choice's legacy text_offset so far
    try:
        async for index, chunk in streams:
            reason = finish_reason(chunk.finish_reason)
            if chunk.text or reason is not None or chunk.logprobs:
                logprobs = None
                if chunk.logprobs:
                    logprobs = completion_logprobs_body(chunk.logprobs, offsets[index])
                    offsets[index] += text_length(chunk.logprobs)
                yield _event(completion_chunk_body(ids, index, chunk.text, reason,
                                                   include_usage, logprobs))
    except EagerLMError as e:  # the engine's failure (a 500), or the request's own (a 400)
        yield _error_event(_as_openai_error(e))
        yield _DONE
        return
    if include_usage:
        results = streams.completions()
        groups = [results[i * n:(i + 1) * n] for i in range(n_prompts)]
        yield _event(usage_chunk_body(ids, "text_completion", Usage.of(groups)))
    yield _DONE


def serve(engine: Engine, config: ServerConfig, log_level: str = "info") -> None:
    """Run the server until SIGTERM or SIGINT (blocking), then stop as service/shutdown.py
    describes and return; or, once the engine cannot serve, stop the same way and raise
    `EngineDied` (service/http/liveness.py). The caller shuts the engine down."""
    drain = Drain()
    _run(create_app(engine, config, drain), drain, config, log_level, lambda: engine)


def serve_loading(load: Callable[[], Engine], config: ServerConfig,
                  log_level: str = "info") -> None:
    """`serve`, but bound before the model is loaded: `load()` runs on a thread while
    /health answers 503 "loading" (service/http/loading.py). A load that fails stops the
    server and raises its error; the engine loaded here is shut down here."""
    drain = Drain()
    front = WhileLoading()
    loaded: list[Engine] = []
    failed: list[BaseException] = []
    server_box: list[GracefulServer] = []

    def load_then_serve() -> None:
        try:
            engine = load()
        except BaseException as e:  # raised again on the main thread
            failed.append(e)
            server_box[0].should_exit = True
            return
        loaded.append(engine)
        front.ready(create_app(engine, config, drain))

    loader = threading.Thread(target=load_then_serve, name="eagerlm-load", daemon=True)
    try:
        _run(front, drain, config, log_level, lambda: loaded[0] if loaded else None,
             on_start=lambda server: (server_box.append(server), loader.start()))
    finally:
        if loader.ident is not None:  # started: an interrupted load still finishes
            loader.join()
        for engine in loaded:
            engine.shutdown()
    if failed:
        raise failed[0]


def _run(app: ASGIApp, drain: Drain, config: ServerConfig, log_level: str,
         engine: Callable[[], Engine | None],
         on_start: Callable[[GracefulServer], object] | None = None) -> None:
    """uvicorn with the graceful shutdown and the engine's watchdog."""
    import uvicorn

    server = GracefulServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                       lifespan="off", timeout_graceful_shutdown=AFTER_GRACE_S),
        drain, config.shutdown_grace_s)

    def failure() -> str | None:
        current = engine()
        return None if current is None else current.failure

    def stop(reason: str) -> None:
        server.should_exit = True

    watchdog = EngineWatchdog(failure, stop).start()
    if on_start is not None:
        on_start(server)
    try:
        server.run()
    finally:
        watchdog.stop()
    if watchdog.reason is not None:  # exit non-zero, for a supervisor to restart it
        raise EngineDied(f"the engine stopped serving: {watchdog.reason}")


__all__ = ["ServerConfig", "create_app", "serve", "serve_loading"]
