"""vLLM's metric names for what eagerlm measures, beside eagerlm's own.

vLLM's Grafana dashboards, its production-stack router and the Kubernetes Gateway API
inference extension read `vllm:` series labelled with `model_name`; serving the same names
for the same quantities lets them watch and route to eagerlm unchanged. Only what the
engine really measures is written, with vLLM's meaning:

| vLLM series | from |
|---|---|
| `vllm:num_requests_running` | requests with a token already (decoding) |
| `vllm:num_requests_waiting` | requests with no token yet, plus HTTP requests queued |
| `vllm:kv_cache_usage_perc` | KV pages mapped / pages in the pool (a fraction, as vLLM's) |
| `vllm:time_to_first_token_seconds` | `EngineMetrics.ttft` |
| `vllm:inter_token_latency_seconds` | `EngineMetrics.itl` |
| `vllm:e2e_request_latency_seconds` | `EngineMetrics.duration` |
| `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | the token counters |
| `vllm:prefix_cache_queries_total` | prompt tokens submitted (tokens, as vLLM counts) |
| `vllm:prefix_cache_hits_total` | prompt tokens whose KV came from the prefix cache |
| `vllm:request_success_total{finished_reason}` | finished requests by reason |
| `vllm:spec_decode_num_drafts_total` | speculating sessions' rounds with draft rows |
| `vllm:spec_decode_num_draft_tokens_total` | proposals verified (dispatch/speculation.py) |
| `vllm:spec_decode_num_accepted_tokens_total` | proposals accepted |

Pages held by cached prefixes count as in use (vLLM counts its evictable cached blocks as
free), so after traffic the ratio overstates what new requests would have to evict first.

The exposition stays eagerlm's hand-written `PrometheusText` rather than prometheus-client:
every value here is a snapshot of counters the engine already keeps under one lock, so
there is nothing to register or update on the hot path, and prometheus-client's global
registry would need one collector per engine (tests open several in one process) to say
the same thing. The format is checked by prometheus-client's own parser in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagerlm.service.api.metrics import EngineMetrics, PrometheusText


@dataclass(frozen=True)
class VllmGauges:
    """What the engine's counters do not hold: the pool's state and the server's queue."""

    kv_pages_in_use: int
    kv_pages_total: int
    http_queued: int = 0
    # speculative decoding (the dispatcher's service thread counts them)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_in_use / self.kv_pages_total if self.kv_pages_total else 0.0


def write_vllm_metrics(out: PrometheusText, metrics: EngineMetrics, model_name: str,
                       gauges: VllmGauges) -> None:
    """Append the `vllm:` families, each sample labelled `model_name`."""
    label = {"model_name": model_name}
    with metrics.lock:
        running = metrics.running - metrics.waiting
        waiting = metrics.waiting + gauges.http_queued
        for name, kind, text, value in (
                ("vllm:num_requests_running", "gauge",
                 "Requests in the engine that have produced a token.", running),
                ("vllm:num_requests_waiting", "gauge",
                 "Requests waiting for their first token or for a concurrency slot.",
                 waiting),
                ("vllm:kv_cache_usage_perc", "gauge",
                 "KV cache usage: 1 means every page of the pool is in use.",
                 gauges.kv_usage),
                ("vllm:prompt_tokens_total", "counter", "Prompt tokens of submitted requests.",
                 metrics.prompt_tokens),
                ("vllm:generation_tokens_total", "counter", "Tokens generated and delivered.",
                 metrics.generation_tokens),
                ("vllm:prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache.", metrics.prompt_tokens),
                ("vllm:prefix_cache_hits_total", "counter",
                 "Prompt tokens whose KV came from the prefix cache.",
                 metrics.cached_prompt_tokens),
                ("vllm:spec_decode_num_drafts_total", "counter",
                 "Speculative rounds of a session with draft tokens.", gauges.spec_drafts),
                ("vllm:spec_decode_num_draft_tokens_total", "counter",
                 "Draft tokens verified.", gauges.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens_total", "counter",
                 "Draft tokens accepted.", gauges.spec_accepted_tokens)):
            out.family(name, kind, text)
            out.sample(name, value, label)
        out.family("vllm:request_success_total", "counter",
                   "Requests finished, by finish reason.")
        for reason in ("stop", "length", "abort"):
            key = "cancelled" if reason == "abort" else reason
            out.sample("vllm:request_success_total", metrics.finished.get(key, 0),
                       {**label, "finished_reason": reason})
        for name, text, hist in (
                ("vllm:time_to_first_token_seconds", "Time to first token.", metrics.ttft),
                ("vllm:inter_token_latency_seconds", "Time between consecutive tokens.",
                 metrics.itl),
                ("vllm:e2e_request_latency_seconds", "From submission to the end.",
                 metrics.duration)):
            out.histogram(name, text, hist, label)


__all__ = ["VllmGauges", "write_vllm_metrics"]
