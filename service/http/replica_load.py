"""A replica's load, in the form SGLang's router reads it (`GET /get_load`).

Run behind `sglang-router` (docs/deployment.md), each eagerlm server is one of the router's
workers. Its `power_of_two` policy polls every worker's `/get_load` and sends a request to
the less loaded of two workers drawn at random; what it compares is the sum of `num_tokens`
over the entries (one per data-parallel rank; eagerlm is one). The other fields are
SGLang's too, for people and other tools reading the same endpoint.

What each number is here, from counters the server keeps anyway (nothing is computed per
poll beyond a few reads):
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


def add_load_route(app: FastAPI, engine: Engine, gate: AdmissionGate) -> None:
    """`GET /get_load`, open like /health and /metrics (routers poll it without a key)."""

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return load_report(engine, gate)


__all__ = ["add_load_route", "load_report"]
