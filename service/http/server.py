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
- tool calling (`tools`, `tool_choice` "auto" or "none", `parallel_tool_calls`) for models
  whose chat template shows tools: calls the model writes (Hermes/Qwen `<tool_call>` blocks
  or Llama 3 JSON, chosen by the template) come back as `message.tool_calls` with
  finish_reason "tool_calls", streamed as one delta per call at the end; text that is not
  a valid call of a given tool stays content, and a reply cut by max_tokens is never
  parsed (service/tool_calls.py). Forcing a call ("required", a named function, `strict`
  schemas) needs constrained decoding and is a 400, as are tools for a model whose template
  cannot show them;
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

import json
import logging
import secrets
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
from eagerlm.errors import EagerLMError, EngineClosed, EngineFailure
from eagerlm.service.api.engine import Engine, GenerationError, MultiStream
from eagerlm.service.api.metrics import PrometheusText
from eagerlm.service.api.tool_calls import Reply, ToolCallParser
from eagerlm.service.http.admission import AdmissionGate, QueueFull, Ticket
from eagerlm.service.http.config import ServerConfig
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


_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class _EventStream(StreamingResponse):
    """Server-sent events whose admission ticket is released however the response ends
    (finished, client gone, server shutting down). When the server's shutdown grace
    period ends first, the stream is cut between two events and closed with an error
    event and [DONE], as a generation error closes it."""

    def __init__(self, events: AsyncIterator[str], ticket: Ticket,
                 streams: MultiStream, drain: Drain) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._ticket = ticket
        self._streams = streams
        self._drain = drain

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


class _ErrorResponse(JSONResponse):
    """An OpenAI error body, rendered as ASCII: a message that quotes what the client
    sent, or an exception's text, always encodes."""

    def __init__(self, error: OpenAIError, headers: dict[str, str] | None = None) -> None:
        super().__init__(error.body(), status_code=error.status, headers=headers)

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving `engine`. The engine's lifetime is the caller's."""
    cfg = config or ServerConfig()
    gate = AdmissionGate(cfg.max_concurrency, cfg.max_queue)
    drain = Drain()
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
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.name,
                "requests_running": engine.active_requests}

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
        ticket = admit()
        streams: MultiStream | None = None
        handed_over = False  # a streaming response releases the ticket when it ends
        try:
            prompt = await _prepare(lambda: engine.prepare_chat(messages, tools))
            max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt.ids),
                                            engine.context_length, None, "messages")
            streams = engine.generate_many(
                [(prompt, req.sampling_params(max_tokens, i)) for i in range(req.n_choices)])
            await _admitted_and_started(request, ticket, streams)
            ids = ResponseIds.new("chatcmpl", engine.name)
            if req.stream:
                events = _chat_events(streams, ids, req.n_choices, req.include_usage,
                                      parser)
                handed_over = True
                return _EventStream(events, ticket, streams, drain)
            completions = await _unless_disconnected(request, streams.collect)
            replies = [parser.reply(c.text, c.finish_reason is FinishReason.STOP)
                       if parser is not None else Reply(c.text) for c in completions]
            return JSONResponse(chat_completion_body(ids, completions, replies))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                if streams is not None:
                    streams.close()
                ticket.release()

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
                requests += [(p, req.sampling_params(max_tokens, i)) for i in range(n)]
            streams = engine.generate_many(requests)
            await _admitted_and_started(request, ticket, streams)
            ids = ResponseIds.new("cmpl", engine.name)
            if req.stream:
                events = _completion_events(streams, ids, len(prompts), n, req.include_usage)
                handed_over = True
                return _EventStream(events, ticket, streams, drain)
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


async def _chat_events(streams: MultiStream, ids: ResponseIds, n: int,
                       include_usage: bool, parser: ToolCallParser | None
                       ) -> AsyncIterator[str]:
    """Each choice's content as it comes; with tools, text that may be a call is held
    back (service/tool_calls.py), and the calls follow at the end, one delta each, before
    the chunk with the finish reason."""
    splitters = [parser.stream() if parser is not None else None for _ in range(n)]
    for i in range(n):
        yield _event(chat_chunk_body(ids, i, {"role": "assistant", "content": ""}, None,
                                     include_usage))
    try:
        async for index, chunk in streams:
            splitter = splitters[index]
            text = chunk.text if splitter is None else splitter.push(chunk.text)
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
    except GenerationError as e:
        yield _error_event(OpenAIError(500, f"Generation failed: {e}"))
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
    except GenerationError as e:
        yield _error_event(OpenAIError(500, f"Generation failed: {e}"))
        yield _DONE
        return
    if include_usage:
        results = streams.completions()
        groups = [results[i * n:(i + 1) * n] for i in range(n_prompts)]
        yield _event(usage_chunk_body(ids, "text_completion", Usage.of(groups)))
    yield _DONE


def serve(engine: Engine, config: ServerConfig, log_level: str = "info") -> None:
    """Run the server until SIGTERM or SIGINT (blocking), then stop as service/shutdown.py
    describes and return. The caller shuts the engine down."""
    import uvicorn

    app = create_app(engine, config)
    server = GracefulServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                       timeout_graceful_shutdown=AFTER_GRACE_S),
        app.state.drain, config.shutdown_grace_s)
    server.run()


__all__ = ["ServerConfig", "create_app", "serve"]
