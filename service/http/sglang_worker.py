"""What SGLang's router (`sglang-router`) reads from each worker, in SGLang's forms.

Run behind the router (docs/deployment.md), each eagerlm server is one of its workers.
Besides `/health` and the OpenAI routes, the router reads:

- `GET /server_info`, once when a worker joins: `served_model_name` becomes the worker's
  model id (what the router's own `/v1/models` lists; without it, `unknown`). Only fields
  that are true here are sent: the name, one tensor-parallel and one data-parallel rank.
  No `model_path`: the router would try to load a tokenizer from it.
- `GET /get_load`, polled by the `power_of_two` policy, which sends a request to the less
  loaded of two workers drawn at random; what it compares is the sum of `num_tokens` over
  the entries (one per data-parallel rank; eagerlm is one). The other fields are SGLang's
  too, for people and other tools reading the same endpoint.

What each load number is here, from counters the server keeps anyway (nothing is computed
per poll beyond a few reads):
- `num_reqs`: requests in the engine (submitted, not finished) plus HTTP requests queued
  for a concurrency slot (service/http/admission.py);
- `num_waiting_reqs`: those of them with no token yet: queued, or submitted and prefilling;
- `num_tokens`: the prompt and generated tokens of the requests in the engine, i.e. the
  KV they hold or are about to (`EngineMetrics.live_tokens`), as SGLang counts its running
  requests' tokens. Cached prefixes are not counted: the pool evicts them when sessions
  need the pages, so an idle replica with a warm cache reads 0, not full. (A prefix a
  request reused is counted in its prompt, though its pages are shared.)

The cache-aware policy (the router's default) reads nothing from the replica: it keeps its
own approximate radix tree of the request texts it sent to each worker.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from eagerlm.service.api.engine import Engine
from eagerlm.service.http.admission import AdmissionGate


def load_report(engine: Engine, gate: AdmissionGate) -> list[dict[str, Any]]:
    """SGLang's `/get_load` body: one entry, for data-parallel rank 0."""
    metrics = engine.metrics
    with metrics.lock:
        running, waiting, tokens = metrics.running, metrics.waiting, metrics.live_tokens
    return [{"dp_rank": 0, "num_reqs": running + gate.queued,
             "num_waiting_reqs": waiting + gate.queued, "num_tokens": tokens}]


def server_info(engine: Engine) -> dict[str, Any]:
    """SGLang's `/server_info`, with the fields that are true of this server."""
    return {"served_model_name": engine.name, "tp_size": 1, "dp_size": 1}


def add_sglang_worker_routes(app: FastAPI, engine: Engine, gate: AdmissionGate) -> None:
    """`GET /server_info` and `GET /get_load`, open like /health and /metrics (the router
    reads them without a key; they say nothing a probe could not)."""

    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(engine)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return load_report(engine, gate)


__all__ = ["add_sglang_worker_routes", "load_report", "server_info"]
