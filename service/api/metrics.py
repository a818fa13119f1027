"""What the engine and the server count, and the Prometheus text format they are read in.

Written by hand: the exposition format is a few lines of text and this avoids a dependency.
Request timings are taken on the dispatcher's service thread, where outputs are produced,
so they do not include the hop to an event loop; readers are other threads, hence the lock.

The bubble fraction is the profiler's `steady_bubble` (service/measure/round_timeline.py):
device idle between rounds over wall time, in runs of consecutive decode-only rounds, where
the device always had work the host knew about.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from eagerlm.dispatch.messages import Output, RoundTrace
from eagerlm.service.measure.round_timeline import DeviceClock, spans_from_traces, steady_bubble

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BUBBLE_WINDOW_ROUNDS = 2000


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus wants them (`le` upper bounds, then +Inf)."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, running = [], 0
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            running += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            sep = "," if labels else ""
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        wrapped = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{wrapped} {self.total!r}")
        out.append(f"{name}_count{wrapped} {self.n}")
        return out


class PrometheusText:
    """Builds one exposition: `# HELP`, `# TYPE` and the samples of each family."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        if labels:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            name = f"{name}{{{inner}}}"
        self._lines.append(f"{name} {_number(value)}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        """A gauge family of one unlabelled sample."""
        self.family(name, "gauge", help_text)
        self.sample(name, value)

    def counter(self, name: str, help_text: str, value: float) -> None:
        """A counter family of one unlabelled sample."""
        self.family(name, "counter", help_text)
        self.sample(name, value)

    def histogram(self, name: str, help_text: str, hist: Histogram,
                  labels: dict[str, str] | None = None) -> None:
        self.family(name, "histogram", help_text)
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted((labels or {}).items()))
        self._lines += hist.lines(name, inner)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class RequestTimer:
    """One request's timings, fed with its outputs on the service thread."""

    def __init__(self, metrics: EngineMetrics, n_prompt: int) -> None:
        self.metrics = metrics
        self.n_prompt = n_prompt
        self.t_submit = time.perf_counter()
        self.t_last: float | None = None
        self.n_tokens = 0

    def on_output(self, out: Output) -> None:
        now = time.perf_counter()
        m = self.metrics
        with m.lock:
            if out.token_ids:
                if self.t_last is None:
                    m.ttft.observe(now - self.t_submit)
                    m.waiting -= 1
                else:
                    gap = (now - self.t_last) / len(out.token_ids)
                    for _ in out.token_ids:
                        m.itl.observe(gap)
                self.t_last = now
                self.n_tokens += len(out.token_ids)
                m.generation_tokens += len(out.token_ids)
                m.live_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                if self.t_last is None:
                    m.waiting -= 1
                m.running -= 1
                m.live_tokens -= self.n_prompt + self.n_tokens
                reason = out.finish_reason.value
                m.finished[reason] = m.finished.get(reason, 0) + 1
                m.duration.observe(now - self.t_submit)
                m.cached_prompt_tokens += out.cached_tokens


@dataclass
class EngineMetrics:
    """Counters of one engine. `running` counts submitted requests not yet finished;
    `waiting` those of them with no token yet; `live_tokens` their prompt and generated
    tokens, the KV they hold or will (what a load-aware router compares)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    duration: Histogram = field(default_factory=lambda: Histogram(DURATION_BUCKETS))
    submitted: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    running: int = 0
    waiting: int = 0
    live_tokens: int = 0  # prompt and generated tokens of the running requests

    def start(self, n_prompt: int) -> RequestTimer:
        with self.lock:
            self.submitted += 1
            self.running += 1
            self.waiting += 1
            self.prompt_tokens += n_prompt
            self.live_tokens += n_prompt
        return RequestTimer(self, n_prompt)

    def not_submitted(self, n_prompt: int) -> None:
        """Undo `start` for a request the dispatcher refused."""
        with self.lock:
            self.submitted -= 1
            self.running -= 1
            self.waiting -= 1
            self.prompt_tokens -= n_prompt
            self.live_tokens -= n_prompt

    def write(self, out: PrometheusText) -> None:
        with self.lock:
            out.family("eagerlm_requests_total", "counter",
                       "Requests finished, by finish reason.")
            for reason in ("stop", "length", "cancelled", "error"):
                out.sample("eagerlm_requests_total", self.finished.get(reason, 0),
                           {"finish_reason": reason})
            for name, value, text in (
                    ("eagerlm_prompt_tokens_total", self.prompt_tokens,
                     "Prompt tokens of submitted requests."),
                    ("eagerlm_cached_prompt_tokens_total", self.cached_prompt_tokens,
                     "Prompt tokens whose KV was reused from the prefix cache."),
                    ("eagerlm_generation_tokens_total", self.generation_tokens,
                     "Tokens generated and delivered.")):
                out.counter(name, text, value)
            out.gauge("eagerlm_requests_running",
                      "Requests in the engine (submitted, not finished).", self.running)
            out.gauge("eagerlm_requests_waiting",
                      "Requests in the engine that have no token yet.", self.waiting)
            out.histogram("eagerlm_time_to_first_token_seconds",
                          "From submission to the first token.", self.ttft)
            out.histogram("eagerlm_inter_token_latency_seconds",
                          "Between consecutive tokens of a request.", self.itl)
            out.histogram("eagerlm_request_duration_seconds",
                          "From submission to the end of the request.", self.duration)


def recent_steady_bubble(traces: Iterable[RoundTrace],
                         window: int = BUBBLE_WINDOW_ROUNDS) -> float:
    """Device idle over wall time in steady decode, over the last `window` consumed rounds:
    the profiler's `steady_bubble` (service/measure/round_timeline.py), on device times
    taken relative to the first of those rounds (only differences matter)."""
    recent = [t for t in _snapshot(traces)[-window:] if t.tokens_ready
              and t.device_start is not None and t.device_end is not None]
    if not recent:
        return 0.0
    try:
        first = min(recent, key=lambda t: t.round_id)
        spans = spans_from_traces(recent, DeviceClock(first.device_start, 0.0))
    except Exception:  # an event without timing: not measurable
        return 0.0
    return steady_bubble(spans).fraction


def _snapshot(traces: Iterable[RoundTrace]) -> list[RoundTrace]:
    """A copy of a deque another thread appends to (a copy racing an append retries)."""
    for _ in range(10):
        try:
            return list(traces)
        except RuntimeError:
            continue
    return []
