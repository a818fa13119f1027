"""The HTTP server (`eagerlm serve`): FastAPI on uvicorn over one Engine, speaking several
APIs.

Routes, each group added by its module's `add_*_routes(app, ctx)` (the context every route
shares: service/http/server_context.py), the API dialects from their registry
(service/http/api_dialects.py: each translates its body onto the one internal chat request
of chat_request.py, or its own request for completions and embeddings):
- OpenAI: POST /v1/chat/completions (openai_chat.py), POST /v1/completions
  (openai_completions.py), POST /v1/embeddings (openai_embeddings.py), POST /v1/responses
  with GET and DELETE /v1/responses/{id} (responses_api.py);
- Anthropic: POST /v1/messages and /v1/messages/count_tokens (anthropic_api.py);
- vLLM's POST /tokenize and /detokenize (vllm_tokenize.py);
- GET /server_info and /get_load (SGLang's: what its router reads from a worker;
  sglang_worker.py);
- the chat page at GET / (webui.py; `--no-webui` leaves it out);
- here: GET /v1/models, GET /health, GET /metrics (Prometheus text).
Generation routes stream as server-sent events or not (request_lifecycle.py,
event_stream.py).

What a client can count on:
- every error is its API's JSON error body (OpenAI's, or Anthropic's under /v1/messages:
  error_formats.py) with the status the API would use (400 for a bad field or a prompt
  too long, 401 for a wrong key, 404 for an unknown model, route or stored response, 413
  for an oversized body, 415 for a body not sent as `application/json`, 429 when the
  queue is full, 503 while shutting down), and the server keeps serving; no input
  makes it a 500 (JSON nested too deep or holding a lone surrogate is a 400:
  service/http/request_body.py), and a 500 of a bug is counted in /metrics like any
  response (service/http/response_counts.py);
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
  reply cut by max_tokens is never parsed (service/api/tool_calls.py). A forced call is
  constrained to one call whose arguments follow the tool's parameter schema; tools for a
  model whose template cannot show them are a 400;
- structured output: `response_format` json_object / json_schema (chat), llama.cpp's
  `json_schema` and `grammar` (GBNF) on both routes, by constrained decoding
  (dispatch/grammar.py); an invalid schema or grammar, or one beyond its limits (at
  submission or while generating), is a 400 naming the field;
- a client that goes away, mid-stream or while queued, cancels its requests, so their KV
  pages go back to the pool;
- at most `max_concurrency` requests generate at once, `max_queue` more wait
  (service/http/admission.py);
- on SIGTERM or SIGINT it stops admitting, gives the requests in flight
  `shutdown_grace_s` to finish, ends the rest cleanly (a stream with an error event and
  [DONE], others with a 503) and returns, so the process exits 0 (service/http/shutdown.py);
- it binds 127.0.0.1 unless told otherwise; with an API key, /v1 routes need
  `Authorization: Bearer KEY` or `x-api-key: KEY` (/health, /metrics and the chat page
  stay open: probes, scrapers, and a page that asks for the key).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp

from eagerlm.dispatch.reasoning import ReasoningFormat
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.metrics import PrometheusText
from eagerlm.service.api.vllm_metrics import write_vllm_metrics
from eagerlm.service.http.admission import AdmissionGate
from eagerlm.service.http.api_dialects import API_DIALECTS, error_formats
from eagerlm.service.http.config import ServerConfig
from eagerlm.service.http.error_formats import add_error_handlers
from eagerlm.service.http.liveness import EngineDied, EngineWatchdog
from eagerlm.service.http.loading import WhileLoading
from eagerlm.service.http.response_counts import ResponseCounter
from eagerlm.service.http.server_context import ServerContext
from eagerlm.service.http.sglang_worker import add_sglang_worker_routes
from eagerlm.service.http.shutdown import AFTER_GRACE_S, Drain, GracefulServer, RefuseWhileDraining
from eagerlm.service.http.webui import add_webui_routes


def create_app(engine: Engine, config: ServerConfig | None = None,
               drain: Drain | None = None) -> FastAPI:
    """The ASGI app serving `engine`. The engine's lifetime is the caller's; `drain`, the
    server's shutdown as requests see it, when the server exists before the app."""
    cfg = config or ServerConfig()
    ctx = ServerContext(
        engine, cfg, AdmissionGate(cfg.max_concurrency, cfg.max_queue), drain or Drain(),
        ReasoningFormat(cfg.reasoning_format).resolve(  # dispatch/reasoning.py
            engine.model.chat_template),
        int(time.time()), errors=error_formats())
    app = FastAPI(title="eagerlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RefuseWhileDraining, drain=ctx.drain, errors=ctx.errors)
    app.add_middleware(ResponseCounter, counts=ctx.response_counts)  # outermost: counts all
    app.state.engine = engine
    app.state.gate = ctx.gate
    app.state.drain = ctx.drain  # what GracefulServer's shutdown drives
    add_error_handlers(app, ctx.errors)  # each in its path's API format
    _add_operations_routes(app, ctx)
    add_sglang_worker_routes(app, engine, ctx.gate)  # GET /server_info, /get_load
    for dialect in API_DIALECTS:  # service/http/api_dialects.py
        dialect.add_routes(app, ctx)
    add_webui_routes(app, ctx)  # the chat page at / (unless --no-webui)
    return app


def _add_operations_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`GET /health` and `GET /metrics` (open, for probes and scrapers), `GET /v1/models`."""
    engine, gate = ctx.engine, ctx.gate

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
        for (route, status), n in sorted(ctx.response_counts.items()):
            out.sample("eagerlm_http_responses_total", n,
                       {"route": route, "status": str(status)})
        write_vllm_metrics(out, engine.metrics, engine.name,  # service/api/vllm_metrics.py
                           engine.vllm_gauges(gate.queued))
        return PlainTextResponse(out.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(ctx.authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx)]}

    @app.get("/v1/models/{model}", dependencies=[Depends(ctx.authorize)])
    async def model(model: str) -> dict[str, Any]:
        ctx.check_model(model)
        return _model_card(ctx)


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.engine.name, "object": "model", "created": ctx.started,
            "owned_by": "eagerlm", "max_model_len": ctx.engine.context_length}


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
    front = WhileLoading(error_formats())
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
