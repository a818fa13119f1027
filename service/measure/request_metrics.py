"""Per-request latency as the user sees it, and its percentiles.

A request's times are taken where its tokens reach the user (the engine's output sink, or
the HTTP client's stream): its arrival, then one timestamp per generated token. From these:

- TTFT: first token time - arrival (queueing and prefill included, as vLLM reports it);
- ITL: the gaps between a request's successive tokens;
- TPOT: (last token - first token) / (tokens - 1), one number per request;
- E2E: last token time - arrival.

Percentiles are numpy's linear interpolation (`np.percentile`), as vLLM's serving
benchmark computes them. Everything here is pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What happened to one request (times in perf_counter seconds)."""

    index: int
    arrival: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of a set of latencies, in milliseconds."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(len(ms), float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class LatencySummary:
    """A run's request-level results."""

    n_requests: int
    n_failed: int
    input_tokens: int
    output_tokens: int
    duration_s: float  # first arrival to last token
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        total = self.input_tokens + self.output_tokens
        return total / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_s(self) -> float:
        done = self.n_requests - self.n_failed
        return done / self.duration_s if self.duration_s > 0 else 0.0


def summarize(records: Sequence[RequestRecord]) -> LatencySummary:
    ok = [r for r in records if r.ok]
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.token_times[-1] for r in ok), default=start)
    return LatencySummary(
        n_requests=len(records), n_failed=len(records) - len(ok),
        input_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(len(r.token_times) for r in ok),
        duration_s=end - start,
        ttft=Distribution.of_seconds([r.ttft for r in ok]),
        itl=Distribution.of_seconds([g for r in ok for g in r.itls]),
        tpot=Distribution.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        e2e=Distribution.of_seconds([r.e2e for r in ok]))


def format_latency(summary: LatencySummary, title: str) -> str:
    """A plain-text block like vLLM's serving benchmark prints."""
    s = summary
    lines = [f"{f' {title} ':=^60}",
             f"{'Successful requests:':<40}{s.n_requests - s.n_failed:>20}",
             f"{'Failed requests:':<40}{s.n_failed:>20}",
             f"{'Duration (s):':<40}{s.duration_s:>20.2f}",
             f"{'Total input tokens:':<40}{s.input_tokens:>20}",
             f"{'Total generated tokens:':<40}{s.output_tokens:>20}",
             f"{'Request throughput (req/s):':<40}{s.request_s:>20.2f}",
             f"{'Output token throughput (tok/s):':<40}{s.output_tok_s:>20.2f}",
             f"{'Total token throughput (tok/s):':<40}{s.total_tok_s:>20.2f}"]
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E latency", s.e2e)):
        lines.append(f"{f' {name} (ms) ':-^60}")
        for label, v in (("Mean", d.mean), ("P50", d.p50), ("P90", d.p90), ("P99", d.p99)):
            lines.append(f"{f'{label} {name} (ms):':<40}{v:>20.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
