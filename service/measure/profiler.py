"""`eagerlm profile`: run a workload in eager and/or sync mode and report, from the
dispatcher's per-round instrumentation, where the time goes.

Per mode: the rounds on one host timeline (`round_timeline`), the bubble fraction in steady
decode, host time per round, the lookahead actually reached, and the request latencies
(TTFT, ITL percentiles, output tokens/s). Written to the output folder: `trace.json`
(Perfetto / chrome://tracing), `timeline.png` (a window of rounds, the modes one above the
other), `summary.txt` (the table printed) and `profile.json` (every number).

Each mode runs `--repeats N` times (default 3), each run on a fresh engine, the modes
alternating ABBA (eager, sync, sync, eager, eager, sync, ...) so that slow drift of the
machine and the first engine's extra costs fall on both alike: run-to-run noise on a busy
cpu is larger than the eager-vs-sync difference. A mode is reported by its run with the
median output tokens/s (the lower middle one for an even N): that run's timeline, latencies
and rounds, in the table, trace.json, timeline.png and profile.json, a real run and not an
average; the summary adds every run's tokens/s and the ratio of the modes' medians with the
ratio of each ABBA pair, profile.json every run's tokens/s.

What "the profiler" costs: the dispatcher always records a `RoundTrace` per round (a few
timestamps and two timing events). The profiler adds a collector thread that, while the run
goes on, takes those traces out of the dispatcher's deque and queries the events' timings,
so a long run holds neither an unbounded number of device events nor a full deque; trace
and plot building happen after the run. `--overhead-repeats N` measures the cost: the same
workload N times with the collector and N times without, alternating, on one engine, and
compares output tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagerlm.dispatch.dispatcher import Dispatcher
from eagerlm.dispatch.messages import RoundTrace
from eagerlm.errors import InvalidParameters
from eagerlm.service.api.model_loading import check_device
from eagerlm.service.measure.harness import (
    DispatchSettings,
    MeasuredModel,
    RunResult,
    add_engine_args,
    add_model_args,
    engine_settings,
    length_range,
    open_measured_model,
    rate,
    rate_label,
    run_requests,
    start_engine,
    wait_rounds_consumed,
    warm_up,
)
from eagerlm.service.measure.request_metrics import LatencySummary, summarize
from eagerlm.service.measure.round_timeline import (
    DeviceClock,
    RoundSpan,
    TimelineStats,
    peer_intervals,
    spans_from_traces,
    timeline_stats,
    union_length,
)
from eagerlm.service.measure.trace_export import TracedRun, chrome_trace, write_chrome_trace
from eagerlm.service.measure.workload import (
    LengthRange,
    PlannedRequest,
    WorkloadSpec,
    make_workload,
)

# the profile's own default, not the engine's: its workload is this many sessions (and
# requests, unless --requests), which profiles in seconds on the cpu backend
PROFILE_BATCH = 8
MODES = ("eager", "sync")


class RoundCollector:
    """Converts the dispatcher's round traces to host-time spans on a thread of its own
    while a run goes on.

    It reads `engine.traces` without taking anything out (the engine's /metrics reads the
    same deque), newest first, stopping at the last round it has already seen: each pass
    costs only the rounds that are new. Passes are rare (every `interval_s`): the deque
    keeps the last 100 000 rounds, so one pass every 2 s keeps up with rounds as short as
    20 us, and on the cpu backend every wake-up of an extra thread can stall a
    multithreaded BLAS call."""

    def __init__(self, engine: Dispatcher, clock: DeviceClock, interval_s: float = 2.0) -> None:
        self.engine = engine
        self.clock = clock
        # the other devices of a split model: each its own clock (its events' times)
        self.peer_clocks = [DeviceClock.calibrate(f.device) for f in engine.followers]
        self.interval_s = interval_s
        self.spans: list[RoundSpan] = []
        self.cpu_s = 0.0  # CPU time the collector used (its own cost, measured directly)
        traces = engine.traces
        self._seen = traces[-1].round_id if traces else -1  # earlier rounds are not ours
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagerlm-profiler",
                                        daemon=True)

    def __enter__(self) -> RoundCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        wait_rounds_consumed(self.engine)
        t0 = time.thread_time()
        self._collect()  # what arrived since the thread's last pass
        self.cpu_s += time.thread_time() - t0
        self.spans.sort(key=lambda s: s.round_id)

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.wait(self.interval_s):
            self._collect()
        self.cpu_s += time.thread_time() - t0

    def _collect(self) -> None:
        new: list[RoundTrace] = []
        for _ in range(100):
            try:
                new = list(itertools.takewhile(lambda t: t.round_id > self._seen,
                                               reversed(self.engine.traces)))
                break
            except RuntimeError:  # the service thread appended meanwhile: read again
                continue
        if new:
            self._seen = new[0].round_id
            self.spans.extend(spans_from_traces(new, self.clock, self._peers(new[-1].round_id)))

    def _peers(self, first: int) -> list[tuple[dict[int, Any], DeviceClock]]:
        """Each other device's rounds from round `first` on, by id, with its clock."""
        out = []
        for rounds, clock in zip(self.engine.device_traces, self.peer_clocks, strict=True):
            for _ in range(100):
                try:
                    new = list(itertools.takewhile(lambda r: r.round_id >= first,
                                                   reversed(rounds)))
                    break
                except RuntimeError:  # its control thread appended meanwhile: read again
                    continue
            out.append(({r.round_id: r for r in new}, clock))
        return out


@dataclass(frozen=True)
class ProfileSettings:
    workload: WorkloadSpec
    engine: DispatchSettings = field(default_factory=DispatchSettings)
    modes: tuple[str, ...] = MODES
    min_batch: int = 1  # steady decode: rounds with at least this many decoding sessions
    window: int = 12  # rounds in the PNG
    warm_up: bool = True
    repeats: int = 3  # runs of each mode, alternating ABBA; each reported by its median run

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise InvalidParameters(f"--repeats must be >= 1 (runs of each mode), "
                                    f"not {self.repeats}")


@dataclass
class ModeProfile:
    """One run of the workload in one mode."""

    mode: str
    spans: list[RoundSpan]
    run: RunResult
    latency: LatencySummary
    timeline: TimelineStats
    device_busy: float  # busy union over the whole run's wall time
    clock_uncertainty_s: float
    peer_busy: tuple[float, ...] = ()  # devices 1 .. N - 1's, a model split over devices


def profile_mode(loaded: MeasuredModel, settings: ProfileSettings, mode: str,
                 requests: Sequence[PlannedRequest]) -> ModeProfile:
    """One run of the workload in `mode` ("eager" or "sync") with the collector on."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    with start_engine(loaded, settings.engine, sync=mode == "sync") as engine:
        if settings.warm_up:
            warm_up(engine, loaded.vocab_size)
        clock = DeviceClock.calibrate(engine.device)
        with RoundCollector(engine, clock) as collector:
            run = run_requests(engine, requests)
    spans = collector.spans
    wall = run.end - run.start

    def busy(intervals: Iterable[tuple[float, float]]) -> float:
        return union_length(intervals) / wall if wall > 0 else 0.0
    stats = timeline_stats(spans, settings.min_batch)
    return ModeProfile(mode, spans, run, summarize(run.records), stats,
                       busy((s.device_start, s.device_end) for s in spans),
                       clock.uncertainty_s,
                       tuple(busy(peer_intervals(spans, r))
                             for r in range(len(stats.peer_bubble))))


def run_order(modes: Sequence[str], repeats: int) -> list[str]:
    """The modes' runs in ABBA order: eager, sync, sync, eager, eager, sync, ...
    (`repeats` runs of each), so a drift in time or a first-run cost falls on each alike."""
    return [m for i in range(repeats) for m in (modes if i % 2 == 0 else modes[::-1])]


@dataclass
class ModeRuns:
    """A mode's runs, in the order they ran, and the one it is reported by: the run with
    the median output tokens/s (for an even count, the lower middle one)."""

    mode: str
    runs: list[ModeProfile]

    @property
    def output_tok_s(self) -> list[float]:
        return [p.latency.output_tok_s for p in self.runs]

    @property
    def median_index(self) -> int:
        by_speed = sorted(range(len(self.runs)), key=self.output_tok_s.__getitem__)
        return by_speed[(len(by_speed) - 1) // 2]

    @property
    def median(self) -> ModeProfile:
        return self.runs[self.median_index]


@dataclass(frozen=True)
class Overhead:
    """The profiler's cost, two ways: output tokens/s of the same workload with the
    collector off and on (pairs run back to back, so slow drift of the machine cancels),
    and the CPU time the collector thread itself used over the runs' wall time (a direct
    measure, free of run-to-run noise)."""

    off_tok_s: list[float]
    on_tok_s: list[float]
    collector_cpu_s: list[float]
    on_wall_s: list[float]

    @property
    def fraction(self) -> float:
        """Throughput lost with the profiler on: 1 - median of the on/off ratios of the
        pairs (negative: on was faster, i.e. the cost is below the noise)."""
        return 1.0 - statistics.median(
            on / off for on, off in zip(self.on_tok_s, self.off_tok_s, strict=True))

    @property
    def cpu_fraction(self) -> float:
        return sum(self.collector_cpu_s) / sum(self.on_wall_s)


def measure_overhead(loaded: MeasuredModel, settings: ProfileSettings,
                     requests: Sequence[PlannedRequest], repeats: int) -> Overhead:
    """Alternate off/on runs on one eager engine; the prefix cache is flushed between runs
    so each does the same work."""
    off: list[float] = []
    on: list[float] = []
    cpu: list[float] = []
    wall: list[float] = []
    with start_engine(loaded, settings.engine, sync=False) as engine:
        warm_up(engine, loaded.vocab_size)
        clock = DeviceClock.calibrate(engine.device)
        for i in range(repeats):
            order = ((False, off), (True, on))
            for collect, results in order if i % 2 == 0 else order[::-1]:  # no order bias
                engine.flush()
                engine.traces.clear()
                if collect:
                    with RoundCollector(engine, clock) as collector:
                        run = run_requests(engine, requests)
                    cpu.append(collector.cpu_s)
                    wall.append(run.end - run.start)
                else:
                    run = run_requests(engine, requests)
                results.append(summarize(run.records).output_tok_s)
    return Overhead(off, on, cpu, wall)


# -- reporting ---------------------------------------------------------------------------

def _peer(p: ModeProfile, r: int) -> str:
    """Device r + 1's bubble, busy fraction and mean round time (or "-": not this run's)."""
    t = p.timeline
    if r >= len(t.peer_bubble):
        return "-"
    busy = f"{p.peer_busy[r]:.1%}" if r < len(p.peer_busy) else "-"
    return f"{t.peer_bubble[r]:.1%} / {busy} / {t.peer_device_ms[r]:.2f}"


def format_summary(results: Sequence[ModeRuns], overhead: Overhead | None = None,
                   header: str = "") -> str:
    """The plain-text table: one column per mode, its median run; then every run's
    output tokens/s and, with two modes, the ratio of their medians and of each ABBA
    pair (run i of the first mode against run i of the second)."""
    profiles = [r.median for r in results]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fmt) -> None:
        rows.append((label, [fmt(p) for p in profiles]))

    row("rounds (steady decode)", lambda p: f"{p.timeline.n_rounds} ({p.timeline.n_steady})")
    row("bubble, steady decode", lambda p: f"{p.timeline.bubble:.1%}")
    row("device busy, whole run", lambda p: f"{p.device_busy:.1%}")
    row("decode batch (mean)", lambda p: f"{p.timeline.batch_mean:.1f}")
    row("host ms/round (plan+launch)", lambda p: f"{p.timeline.host_ms:.3f}")
    row("  plan ms", lambda p: f"{p.timeline.plan_ms:.3f}")
    row("  launch ms", lambda p: f"{p.timeline.launch_ms:.3f}")
    row("device ms/round", lambda p: f"{p.timeline.device_ms:.2f}")
    row("device end -> tokens ms", lambda p: f"{p.timeline.ready_ms:.3f}")
    for r in range(max(len(p.timeline.peer_bubble) for p in profiles)):
        row(f"device {r + 1}: bubble / busy / ms per round", lambda p, r=r: _peer(p, r))
    row("rounds in flight mean/max",
        lambda p: f"{p.timeline.lookahead_mean:.2f}/{p.timeline.lookahead_max}")
    row("TTFT ms p50/p90/p99", lambda p: _pcts(p.latency.ttft))
    row("ITL ms p50/p90/p99", lambda p: _pcts(p.latency.itl))
    if any(p.timeline.constrained_rounds for p in profiles):
        row("rounds with constrained rows", lambda p: f"{p.timeline.constrained_rounds}")
        row("  mask wait ms mean/max",
            lambda p: f"{p.timeline.mask_wait_ms:.3f}/{p.timeline.mask_wait_max_ms:.3f}")
    if any(p.timeline.draft_rows for p in profiles):
        row("draft rows (speculation)", lambda p: f"{p.timeline.draft_rows}")
        row("  proposals accepted/verified",
            lambda p: f"{p.timeline.accepted_tokens}/{p.timeline.draft_tokens}")
        row("  acceptance rate", lambda p: f"{p.timeline.acceptance:.1%}")
    row("output tokens", lambda p: f"{p.latency.output_tokens}")
    row("output tok/s", lambda p: f"{p.latency.output_tok_s:.1f}")
    rows.append(("output tok/s, each run",
                 ["/".join(f"{v:.0f}" for v in r.output_tok_s) for r in results]))
    width = max(len(label) for label, _ in rows) + 2
    col = max(16, *(len(v) + 2 for _, vals in rows for v in vals))
    lines = [header] if header else []
    lines.append("".ljust(width) + "".join(p.mode.rjust(col) for p in profiles))
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in vals) for label, vals in rows]
    lines.append("(steady decode: consecutive decode-only rounds; times in the steady rounds)")
    if any(p.timeline.peer_bubble for p in profiles):
        lines.append("(a model split over devices: the bubble, busy and device rows are device "
                     "0's, whose rounds include its waits for the others; each other device's "
                     "own on its row)")
    n = max(len(r.runs) for r in results)
    if n > 1:
        lines.append(f"(each column: the mode's run with the median output tok/s, of {n})")
    if len(results) == 2:
        a, b = results
        pairs = " ".join(_ratio(x, y) for x, y in zip(a.output_tok_s, b.output_tok_s))
        runs = f"median of {n} runs each; per ABBA pair: {pairs}" if n > 1 else "one run each"
        lines.append(f"{a.mode} / {b.mode} output tok/s: "
                     f"{_ratio(a.median.latency.output_tok_s, b.median.latency.output_tok_s)}"
                     f" ({runs})")
    if overhead is not None:
        o = overhead
        lines.append(
            f"profiler overhead: {o.fraction:+.1%} of output tok/s (median of {len(o.on_tok_s)}"
            f" off/on pairs; off {statistics.median(o.off_tok_s):.1f}, on "
            f"{statistics.median(o.on_tok_s):.1f} tok/s); collector thread CPU "
            f"{o.cpu_fraction:.2%} of wall time")
    return "\n".join(lines)


def _pcts(d) -> str:
    return f"{d.p50:.1f}/{d.p90:.1f}/{d.p99:.1f}"


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y > 0 else "-"


def profile_json(results: Sequence[ModeRuns], overhead: Overhead | None,
                 metadata: dict[str, Any]) -> dict[str, Any]:
    """Per mode its median run's numbers and rounds, the index of that run and every
    run's output tokens/s (in the order the mode's runs ran)."""
    out: dict[str, Any] = {"metadata": metadata, "modes": {}}
    for r in results:
        p = r.median
        out["modes"][r.mode] = {
            "timeline": dataclasses.asdict(p.timeline),
            "latency": dataclasses.asdict(p.latency) | {
                "output_tok_s": p.latency.output_tok_s},
            "device_busy": p.device_busy, "clock_uncertainty_s": p.clock_uncertainty_s,
            "runs_output_tok_s": r.output_tok_s, "median_run": r.median_index,
            "rounds": [dataclasses.asdict(s) for s in p.spans]}
    if overhead is not None:
        out["overhead"] = dataclasses.asdict(overhead) | {
            "fraction": overhead.fraction, "cpu_fraction": overhead.cpu_fraction}
    return out


@dataclass(frozen=True)
class ProfileOutputs:
    trace: Path
    summary: Path
    json: Path
    png: Path | None


def write_outputs(out_dir: Path, results: Sequence[ModeRuns], overhead: Overhead | None,
                  settings: ProfileSettings, metadata: dict[str, Any], png: bool = True
                  ) -> tuple[ProfileOutputs, str]:
    """trace.json and timeline.png of each mode's median run, summary.txt, profile.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    profiles = [r.median for r in results]
    runs = [TracedRun(p.mode, p.spans, p.run.records, p.run.start) for p in profiles]
    trace = write_chrome_trace(out_dir / "trace.json", chrome_trace(runs, metadata))
    header = " ".join(f"{k}={v}" for k, v in metadata.items())
    text = format_summary(results, overhead, header)
    summary = out_dir / "summary.txt"
    summary.write_text(text + "\n", encoding="utf-8")
    js = out_dir / "profile.json"
    js.write_text(json.dumps(profile_json(results, overhead, metadata), indent=1),
                  encoding="utf-8")
    png_path = None
    if png:
        from eagerlm.service.measure.timeline_plot import plot_timeline

        png_path = plot_timeline(out_dir / "timeline.png",
                                 [(p.mode, p.spans) for p in profiles], settings.window,
                                 title=header)
    return ProfileOutputs(trace, summary, js, png_path), text


def run_profile(loaded: MeasuredModel, settings: ProfileSettings, out_dir: Path,
                overhead_repeats: int = 0, png: bool = True
                ) -> tuple[list[ModeRuns], Overhead | None, ProfileOutputs, str]:
    """Everything `eagerlm profile` does once the model is loaded: `settings.repeats`
    runs of each mode in ABBA order (`run_order`), each on a fresh engine."""
    requests = make_workload(settings.workload, loaded.vocab_size, loaded.context_length)
    runs: dict[str, list[ModeProfile]] = {mode: [] for mode in settings.modes}
    for mode in run_order(settings.modes, settings.repeats):
        runs[mode].append(profile_mode(loaded, settings, mode, requests))
    results = [ModeRuns(mode, profiles) for mode, profiles in runs.items()]
    overhead = (measure_overhead(loaded, settings, requests, overhead_repeats)
                if overhead_repeats > 0 else None)
    w, e = settings.workload, settings.engine
    metadata = {"model": loaded.label, "device": e.device,
                "date": time.strftime("%Y-%m-%d"), "requests": w.n_requests,
                "prompt_len": str(w.input_len), "output_len": str(w.output_len),
                "rate": rate_label(w.request_rate), "max_batch": e.max_batch,
                "lookahead": e.lookahead, "constrained_every": w.constrained_every,
                "speculative": e.speculative, "repeats": settings.repeats}
    outputs, text = write_outputs(out_dir, results, overhead, settings, metadata, png)
    return results, overhead, outputs, text


# -- command line ------------------------------------------------------------------------

def cmd_profile(args: argparse.Namespace) -> int:
    check_device(args.device)  # a clear error before anything is loaded
    workload = WorkloadSpec(args.requests or args.max_batch, args.prompt_len, args.output_len,
                            args.request_rate, args.seed, args.constrained_every)
    settings = ProfileSettings(workload, engine_settings(args),
                               MODES if args.mode == "both" else (args.mode,),
                               min_batch=args.min_batch, window=args.window,
                               repeats=args.repeats)
    need = args.prompt_len.high + args.output_len.high + 1
    if not args.quiet:
        print("loading the model...", file=sys.stderr, flush=True)
    loaded = open_measured_model(args.model, args.synthetic, min_context=need, device=args.device,
                                 weights=args.weights, tensor_parallel=args.tensor_parallel)
    try:
        if not args.quiet:
            print(f"profiling {loaded.label}: {workload.n_requests} requests, prompt "
                  f"{workload.input_len}, output {workload.output_len} tokens, rate "
                  f"{rate_label(workload.request_rate)}, modes {'+'.join(settings.modes)}, "
                  f"runs of each: {settings.repeats}",
                  file=sys.stderr, flush=True)
        _, _, outputs, text = run_profile(loaded, settings, Path(args.out),
                                          args.overhead_repeats, png=not args.no_png)
    finally:
        loaded.close()
    print(text)
    written = [outputs.trace, outputs.png, outputs.summary, outputs.json]
    print("wrote " + ", ".join(str(p) for p in written if p is not None), file=sys.stderr)
    return 0


def add_profile_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `eagerlm profile` to the CLI's subcommands (handler: `cmd_profile`)."""
    p = subparsers.add_parser(
        "profile", help="timeline, bubble fraction and latencies of eager vs sync dispatch",
        description="Run a workload and report from the dispatcher's per-round "
                    "instrumentation: bubble fraction in steady decode, host time per round, "
                    "lookahead reached, TTFT / ITL percentiles, output tokens/s. Each mode "
                    "runs --repeats times on a fresh engine, the modes alternating (eager, "
                    "sync, sync, eager, ...), and is reported by its run with the median "
                    "output tokens/s. Writes trace.json (open in ui.perfetto.dev), "
                    "timeline.png, summary.txt and profile.json to --out.")
    add_model_args(p)
    p.add_argument("--mode", choices=(*MODES, "both"), default="both",
                   help="dispatch mode(s) to profile (default both)")
    p.add_argument("--repeats", type=int, default=ProfileSettings.repeats, metavar="N",
                   help="runs of each mode, each on a fresh engine; with both modes they "
                        "alternate ABBA (eager, sync, sync, eager, ...) and each mode's "
                        "column is its run with the median output tok/s (default "
                        f"{ProfileSettings.repeats})")
    p.add_argument("--requests", "-n", type=int, default=None,
                   help="number of requests (default: --max-batch)")
    p.add_argument("--prompt-len", type=length_range, default=LengthRange(32, 32),
                   metavar="N|MIN-MAX", help="prompt tokens per request (default 32)")
    p.add_argument("--output-len", type=length_range, default=LengthRange(32, 32),
                   metavar="N|MIN-MAX", help="generated tokens per request (default 32)")
    p.add_argument("--request-rate", type=rate, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--constrained-every", type=int, default=0, metavar="K",
                   help="constrain every K-th request's output to a JSON schema (2: half of "
                        "them); the summary then shows how long their sampling waited for "
                        "the grammar's masks (default 0: none)")
    add_engine_args(p, max_batch=PROFILE_BATCH)
    p.add_argument("--min-batch", type=int, default=1,
                   help="steady decode counts rounds with at least this many decoding "
                        "sessions (default 1)")
    p.add_argument("--window", type=int, default=12, help="rounds drawn in the PNG")
    p.add_argument("--overhead-repeats", type=int, default=0, metavar="N",
                   help="also measure the profiler's own overhead: N runs with and N "
                        "without it (default 0: skip)")
    p.add_argument("--out", "-o", default="eagerlm-profile",
                   help="output folder (default ./eagerlm-profile)")
    p.add_argument("--no-png", action="store_true", help="skip the PNG (no matplotlib)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress messages")
    p.set_defaults(func=cmd_profile)
    return p
