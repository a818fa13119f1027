"""The profiler: its pure computations on timelines built by hand (exact results), the
common host/device clock, the trace-event file's structure, the repeated runs (ABBA order,
each mode reported by its median run) with runs faked at known speeds, and `eagerlm
profile` run for real on the cpu backend with a tiny synthetic model."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections import Counter
from types import SimpleNamespace

import pytest

from eagerlm.errors import InvalidParameters
from eagerlm.service.measure import profiler
from eagerlm.service.measure.harness import RunResult
from eagerlm.service.measure.profiler import (
    ModeProfile,
    ProfileSettings,
    add_profile_parser,
    run_order,
    run_profile,
)
from eagerlm.service.measure.request_metrics import RequestRecord, summarize
from eagerlm.service.measure.round_timeline import (
    Bubble,
    DeviceClock,
    RoundSpan,
    in_flight_at_launch,
    steady_bubble,
    steady_decode_runs,
    timeline_stats,
    union_length,
)
from eagerlm.service.measure.trace_export import TRACK_NAMES, TracedRun, chrome_trace
from eagerlm.service.measure.workload import LengthRange, WorkloadSpec
from eagerlm.vmm.device import Event, open_device


def span(rid: int, dev: tuple[float, float], *, decode: int = 4, prefill: int = 0,
         plan: float | None = None, launch: float | None = None,
         ready: float | None = None) -> RoundSpan:
    """A round whose host times default to just before / after its device interval."""
    a, b = dev
    p = a - 0.5 if plan is None else plan
    lend = p + 0.25 if launch is None else launch
    return RoundSpan(rid, p, p + 0.125, lend, a, b, b + 0.25 if ready is None else ready,
                     n_decode=decode, n_prefill_tokens=prefill, n_sessions=decode)


# -- pure computations -------------------------------------------------------------------

def test_bubble_between_known_gaps_is_exact():
    # busy 0-2, 3-5, 5.5-8: window 8, gaps 1 + 0.5
    assert Bubble.between([(0.0, 2.0), (3.0, 5.0), (5.5, 8.0)]) == Bubble(1.5, 8.0, 3)
    assert Bubble.between([(0.0, 2.0), (3.0, 5.0), (5.5, 8.0)]).fraction == 1.5 / 8
    # overlaps are counted once; order does not matter
    assert union_length([(3.0, 5.0), (0.0, 2.0), (1.0, 2.5), (4.0, 4.5)]) == 4.5
    assert Bubble.between([(1.0, 3.0), (0.0, 2.0)]).fraction == 0.0
    assert Bubble.between([]).fraction == 0.0
    assert Bubble.between([(1.0, 1.0)]).fraction == 0.0  # an empty window


def test_steady_bubble_counts_only_gaps_between_decode_only_rounds():
    spans = [
        span(0, (0.0, 4.0), decode=0, prefill=64),   # prefill: not steady
        span(1, (6.0, 7.0)),                          # gap 4-6 follows a prefill: excluded
        span(2, (7.25, 8.25)),                        # gap 0.25
        span(3, (8.5, 9.5)),                          # gap 0.25
        span(4, (12.0, 13.0), decode=2, prefill=16),  # mixed round ends the run
        span(5, (13.0, 14.0)),
        span(6, (14.5, 15.5)),                        # gap 0.5 (a second run: 5-6)
        span(8, (20.0, 21.0)),                        # round 7 missing: not consecutive
    ]
    runs = steady_decode_runs(spans)
    assert [[s.round_id for s in r] for r in runs] == [[1, 2, 3], [5, 6]]
    b = steady_bubble(spans)
    assert b == Bubble(idle_s=0.25 + 0.25 + 0.5, window_s=3.5 + 2.5, n_rounds=5)
    assert b.fraction == 1.0 / 6.0
    # a batch floor: rounds 5-6 decode 4 sessions, so min_batch=5 leaves nothing steady
    assert steady_bubble(spans, min_batch=5) == Bubble(0.0, 0.0, 0)


def test_a_split_models_other_devices_get_their_own_bubble_and_round_time():
    """Device 0's rounds (1 s each, back to back) include its waits in the collectives;
    device 1's own intervals have gaps 0.5 and 0.25 in the steady run, which its bubble
    counts, and its round time is its own mean. A round whose device-1 record is missing
    counts for neither; a prefill round is outside the steady run for both."""
    lanes = [(0.0, 0.5), (1.0, 1.5), (2.25, 2.75), None, (4.0, 4.5)]
    spans = [dataclasses.replace(span(i, (float(i), float(i + 1))), peers=(lane,))
             for i, lane in enumerate(lanes)]
    spans.insert(0, dataclasses.replace(span(-1, (-2.0, -1.0), decode=0, prefill=8),
                                        peers=((-2.0, -1.5),)))
    stats = timeline_stats(spans)
    assert stats.bubble == 0.0 and stats.device_ms == 1000.0
    # device 1 over the steady run: window 0-4.5, busy 2.0, so idle 2.5
    assert stats.peer_bubble == (2.5 / 4.5,)
    assert stats.peer_device_ms == (500.0,)
    assert timeline_stats(spans[1:4]).peer_bubble == ((0.5 + 0.75) / 2.75,)
    assert timeline_stats([span(0, (0.0, 1.0)), span(1, (1.0, 2.0))]).peer_bubble == ()
    # the summary shows device 1's row beside device 0's figures
    record = RequestRecord(0, 0.0, 4, token_times=[0.1 * k for k in range(1, 11)])
    run = ModeProfile("eager", spans, RunResult([record], 0.0, 1.0), summarize([record]),
                      stats, 0.5, 0.0, peer_busy=(0.4,))
    text = profiler.format_summary([profiler.ModeRuns("eager", [run])])
    row = next(line for line in text.splitlines() if line.startswith("device 1:"))
    assert row.split()[-5:] == ["55.6%", "/", "40.0%", "/", "500.00"]


def test_lookahead_reached_is_one_in_sync_and_up_to_k_when_eager():
    # sync: each round planned after the previous round's tokens were taken
    sync = [span(i, (3.0 * i + 1, 3.0 * i + 2), plan=3.0 * i, launch=3.0 * i + 0.5,
                 ready=3.0 * i + 2.5) for i in range(5)]
    assert in_flight_at_launch(sync) == [1] * 5
    # eager, k = 2: round i+1 launched while round i's tokens are still on their way
    eager = [span(i, (1.0 * i + 1, 1.0 * i + 2), plan=1.0 * i, launch=1.0 * i + 0.5,
                  ready=1.0 * i + 2.25) for i in range(5)]
    assert in_flight_at_launch(eager) == [1, 2, 2, 2, 2]
    stats = timeline_stats(eager)
    assert stats.lookahead_max == 2 and stats.bubble == 0.0 and stats.n_steady == 5
    assert stats.device_ms == 1000.0 and stats.host_ms == 500.0


class _TimedEvent(Event):
    """An event that completed at a known device time (milliseconds)."""

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, _TimedEvent)
        return end.t_ms - self.t_ms


def test_device_clock_places_events_by_elapsed_time_from_the_anchor():
    clock = DeviceClock(_TimedEvent(1000.0), anchor_host_s=50.0)
    assert clock.host_time(_TimedEvent(1250.0)) == 50.25
    assert clock.host_time(_TimedEvent(500.0)) == 49.5


def test_cpu_device_clock_is_exact_and_between_the_host_times_around_an_event():
    import time

    with open_device("cpu") as dev:
        clock = DeviceClock.calibrate(dev)
        assert clock.uncertainty_s == 0.0  # cpu events carry their host stamp
        s = dev.stream("s")
        ev = dev.event()
        before = time.perf_counter()
        s.record(ev)
        ev.synchronize()
        after = time.perf_counter()
        assert before <= clock.host_time(ev) <= after
        assert clock.host_time(ev) == pytest.approx(ev._time_ns / 1e9, abs=1e-9)
        s.close()


# -- the trace file ----------------------------------------------------------------------

def test_trace_events_have_the_expected_tracks_and_microsecond_times():
    start = 100.0
    spans = [span(i, (start + 1.0 + i, start + 1.5 + i)) for i in range(3)]
    req = RequestRecord(0, start + 0.5, 8, token_times=[start + 2.0, start + 3.0])
    trace = chrome_trace([TracedRun("eager", spans, [req], start),
                          TracedRun("sync", spans[:2], [], start)], {"model": "m"})
    trace = json.loads(json.dumps(trace))  # plain JSON all the way down
    events = trace["traceEvents"]
    assert trace["otherData"] == {"model": "m"}
    for ev in events:
        assert {"ph", "pid", "tid", "name"} <= ev.keys()
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {1: "eagerlm eager", 2: "eagerlm sync"}
    for pid in (1, 2):
        names = {e["tid"]: e["args"]["name"] for e in events
                 if e["name"] == "thread_name" and e["pid"] == pid}
        assert names == TRACK_NAMES
    slices = Counter((e["pid"], e["tid"], e["name"].split()[0]) for e in events
                     if e["ph"] == "X")
    assert slices == {(1, 1, "plan"): 3, (1, 1, "launch"): 3, (1, 2, "round"): 3,
                      (1, 3, "tokens"): 3, (2, 1, "plan"): 2, (2, 1, "launch"): 2,
                      (2, 2, "round"): 2, (2, 3, "tokens"): 2}
    r1 = next(e for e in events if e["name"] == "round 1" and e["pid"] == 1)
    assert (r1["ts"], r1["dur"]) == (2e6, 5e5)  # relative to the run's start, microseconds
    assert r1["args"]["decode"] == 4
    asyncs = [e for e in events if e["ph"] in "be"]
    assert [(e["ph"], e["name"], e["ts"]) for e in asyncs] == [
        ("b", "waiting", 5e5), ("e", "waiting", 2e6),
        ("b", "generating", 2e6), ("e", "generating", 3e6)]
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"batch", "rounds in flight"}


# -- repeated runs, faked at known speeds ------------------------------------------------

def test_two_modes_alternate_abba_and_one_mode_just_repeats():
    assert run_order(("eager", "sync"), 3) == ["eager", "sync", "sync", "eager",
                                              "eager", "sync"]
    assert run_order(("eager", "sync"), 4) == ["eager", "sync", "sync", "eager",
                                              "eager", "sync", "sync", "eager"]
    assert run_order(("eager", "sync"), 1) == ["eager", "sync"]
    assert run_order(("sync",), 3) == ["sync"] * 3


class FakeRuns:
    """Stands in for `profile_mode`: the n-th run of a mode makes `speeds[mode][n]` output
    tokens/s, and its one round has the run's place in the whole order as its id."""

    def __init__(self, speeds: dict[str, list[float]]) -> None:
        self.speeds = {mode: iter(v) for mode, v in speeds.items()}
        self.order: list[str] = []

    def __call__(self, loaded, settings, mode, requests) -> ModeProfile:
        tok_s = next(self.speeds[mode])
        rid = len(self.order)
        self.order.append(mode)
        record = RequestRecord(0, 0.0, 4, token_times=[k / tok_s for k in range(1, 101)])
        spans = [span(rid, (0.25, 0.5))]
        return ModeProfile(mode, spans, RunResult([record], 0.0, 100 / tok_s),
                           summarize([record]), timeline_stats(spans), 0.5, 0.0)


def _fake_profile(monkeypatch, tmp_path, speeds: dict[str, list[float]]):
    fake = FakeRuns(speeds)
    monkeypatch.setattr(profiler, "profile_mode", fake)
    repeats = len(next(iter(speeds.values())))
    settings = ProfileSettings(WorkloadSpec(2, LengthRange(4, 4), LengthRange(4, 4)),
                               modes=tuple(speeds), repeats=repeats)
    loaded = SimpleNamespace(vocab_size=512, context_length=64, label="fake")
    results, _, outputs, text = run_profile(loaded, settings, tmp_path, png=False)
    return fake.order, results, outputs, text


def test_profile_runs_the_modes_in_abba_order(monkeypatch, tmp_path):
    order, results, _, _ = _fake_profile(monkeypatch, tmp_path, {
        "eager": [1.0, 2.0, 3.0], "sync": [1.0, 2.0, 3.0]})
    assert order == ["eager", "sync", "sync", "eager", "eager", "sync"]
    # each mode keeps its runs in the order they ran
    assert [[s.spans[0].round_id for s in r.runs] for r in results] == [[0, 3, 4], [1, 2, 5]]
    order, results, _, _ = _fake_profile(monkeypatch, tmp_path, {"eager": [1.0, 2.0]})
    assert order == ["eager", "eager"] and [r.mode for r in results] == ["eager"]


def test_each_mode_is_reported_by_its_median_run_in_summary_json_and_trace(monkeypatch,
                                                                          tmp_path):
    # 4 runs each: the lower middle one, eager's 4th (200) and sync's 3rd (50)
    order, results, outputs, text = _fake_profile(monkeypatch, tmp_path, {
        "eager": [100.0, 400.0, 300.0, 200.0], "sync": [40.0, 70.0, 50.0, 60.0]})
    eager_rid, sync_rid = 7, 5  # their places in eager sync sync eager eager sync sync eager
    assert (order[eager_rid], order[sync_rid]) == ("eager", "sync")
    assert [r.median_index for r in results] == [3, 2]
    assert [r.median.spans[0].round_id for r in results] == [eager_rid, sync_rid]

    lines = text.splitlines()
    assert lines[0].split()[-1] == "repeats=4"  # the header
    (tok_s,) = [ln for ln in lines if ln.startswith("output tok/s ")]
    assert tok_s.split()[-2:] == ["200.0", "50.0"]
    (each,) = [ln for ln in lines if ln.startswith("output tok/s, each run")]
    assert each.split()[-2:] == ["100/400/300/200", "40/70/50/60"]
    assert lines[-1] == ("eager / sync output tok/s: 4.00x (median of 4 runs each; per "
                         "ABBA pair: 2.50x 5.71x 6.00x 3.33x)")
    assert outputs.summary.read_text().strip() == text.strip()

    report = json.loads(outputs.json.read_text())
    assert report["metadata"]["repeats"] == 4
    eager, sync = report["modes"]["eager"], report["modes"]["sync"]
    assert eager["runs_output_tok_s"] == pytest.approx([100.0, 400.0, 300.0, 200.0])
    assert sync["runs_output_tok_s"] == pytest.approx([40.0, 70.0, 50.0, 60.0])
    assert (eager["median_run"], sync["median_run"]) == (3, 2)
    assert eager["latency"]["output_tok_s"] == pytest.approx(200.0)
    assert sync["latency"]["output_tok_s"] == pytest.approx(50.0)
    assert [r["round_id"] for r in eager["rounds"]] == [eager_rid]
    assert [r["round_id"] for r in sync["rounds"]] == [sync_rid]

    events = json.loads(outputs.trace.read_text())["traceEvents"]
    rounds = {(e["pid"], e["name"]) for e in events if e["ph"] == "X" and e["tid"] == 2}
    assert rounds == {(1, f"round {eager_rid}"), (2, f"round {sync_rid}")}


def test_one_run_or_one_mode_summarizes_without_pairs(monkeypatch, tmp_path):
    _, _, _, text = _fake_profile(monkeypatch, tmp_path, {"eager": [30.0], "sync": [20.0]})
    assert text.splitlines()[-1] == "eager / sync output tok/s: 1.50x (one run each)"
    _, _, _, text = _fake_profile(monkeypatch, tmp_path, {"sync": [20.0, 10.0, 30.0]})
    assert "output tok/s, each run" in text and " / " not in text.splitlines()[-1]
    assert [ln.split()[-1] for ln in text.splitlines()
            if ln.startswith("output tok/s ")] == ["20.0"]


def test_repeats_below_one_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch):
    with pytest.raises(InvalidParameters, match="--repeats must be >= 1"):
        ProfileSettings(WorkloadSpec(1, LengthRange(4, 4), LengthRange(4, 4)), repeats=0)

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(profiler, "open_measured_model", no_loading)
    args = _parse(["profile", "--synthetic", "tiny", "--repeats", "0", "--out", str(tmp_path)])
    with pytest.raises(InvalidParameters, match="--repeats must be >= 1"):
        args.func(args)
    assert _parse(["profile"]).repeats == ProfileSettings.repeats == 3


# -- eagerlm profile, for real ------------------------------------------------------------

def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="eagerlm")
    add_profile_parser(ap.add_subparsers(dest="command", required=True))
    return ap.parse_args(argv)


def test_profile_command_writes_trace_png_and_summary(tmp_path, capsys):
    out = tmp_path / "prof"
    args = _parse(["profile", "--synthetic", "tiny", "--requests", "4", "--max-batch", "4",
                   "--prompt-len", "8-16", "--output-len", "12", "--out", str(out),
                   "--repeats", "2", "--overhead-repeats", "1", "--quiet"])
    assert args.func(args) == 0
    summary = capsys.readouterr().out
    assert "bubble, steady decode" in summary and "profiler overhead" in summary
    assert "eager / sync output tok/s" in summary and "median of 2 runs each" in summary
    assert summary.strip() == (out / "summary.txt").read_text().strip()
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    procs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {"eagerlm eager", "eagerlm sync"}
    report = json.loads((out / "profile.json").read_text())
    for mode, pid in (("eager", 1), ("sync", 2)):
        m = report["modes"][mode]
        # the reported run is the slower of the two (the lower middle of an even count)
        assert len(m["runs_output_tok_s"]) == 2
        assert m["latency"]["output_tok_s"] == min(m["runs_output_tok_s"])
        rounds = m["rounds"]
        device_slices = [e for e in events if e["ph"] == "X" and e["pid"] == pid
                         and e["tid"] == 2]
        assert len(device_slices) == len(rounds) == m["timeline"]["n_rounds"]
        assert m["latency"]["output_tokens"] == 4 * 12
        # one clock: every round's times are in causal order, and the single compute
        # stream never runs two rounds at once
        for r in rounds:
            assert (r["plan_start"] <= r["plan_end"] <= r["launch_end"]
                    <= r["tokens_ready"])
            assert r["plan_end"] <= r["device_start"] <= r["device_end"] <= r["tokens_ready"]
        for a, b in itertools.pairwise(rounds):
            assert a["device_end"] <= b["device_start"]
        lookahead_max = m["timeline"]["lookahead_max"]
        assert lookahead_max == 1 if mode == "sync" else 1 <= lookahead_max <= 2
    overhead = report["overhead"]
    assert len(overhead["off_tok_s"]) == len(overhead["on_tok_s"]) == 1
    assert 0.0 <= overhead["cpu_fraction"] < 1.0


def test_profile_with_constrained_requests_shows_the_mask_wait(tmp_path, capsys):
    """Half the requests follow a JSON schema: each of their tokens is sampled with a mask
    in some round, and each round's wait for the host's masks is recorded."""
    out = tmp_path / "prof"
    args = _parse(["profile", "--synthetic", "tiny", "--requests", "4", "--max-batch", "4",
                   "--output-len", "10", "--constrained-every", "2", "--out", str(out),
                   "--repeats", "1", "--no-png", "--quiet"])
    assert args.func(args) == 0
    summary = capsys.readouterr().out
    assert "rounds with constrained rows" in summary and "mask wait ms" in summary
    report = json.loads((out / "profile.json").read_text())
    for mode in ("eager", "sync"):
        m = report["modes"][mode]
        assert m["latency"]["output_tokens"] == 4 * 10  # constrained ones run to length
        # (a round may hold only free rows: one before the constrained requests' first
        # or after their last, as the arrivals fall on a busy machine)
        assert m["timeline"]["constrained_rounds"] == sum(
            r["n_constrained"] > 0 for r in m["rounds"]) > 0
        assert sum(r["n_constrained"] for r in m["rounds"]) == 2 * 10
        assert all(r["mask_wait"] >= 0 for r in m["rounds"])
        assert m["timeline"]["mask_wait_max_ms"] >= m["timeline"]["mask_wait_ms"] >= 0


def test_collector_sees_every_round_and_leaves_the_engines_traces_alone():
    """/metrics reads the same deque: the profiler must not take rounds out of it."""
    from eagerlm.service.measure.harness import (
        DispatchSettings,
        open_measured_model,
        run_requests,
        start_engine,
    )
    from eagerlm.service.measure.profiler import RoundCollector
    from eagerlm.service.measure.workload import LengthRange, WorkloadSpec, make_workload

    loaded = open_measured_model(None, "tiny")
    try:
        reqs = make_workload(WorkloadSpec(3, LengthRange(4, 8), LengthRange(10, 20)), 512)
        with start_engine(loaded, DispatchSettings(max_batch=4), sync=False) as engine:
            clock = DeviceClock.calibrate(engine.device)
            with RoundCollector(engine, clock, interval_s=0.001) as collector:
                run_requests(engine, reqs)
            traced = [t.round_id for t in engine.traces]
    finally:
        loaded.close()
    assert [s.round_id for s in collector.spans] == traced == list(range(len(traced)))
    assert collector.cpu_s > 0


def test_profile_refuses_unknown_devices_and_missing_gpus(tmp_path):
    from eagerlm.vmm.cuda_driver import NoCudaDevice, device_count

    args = _parse(["profile", "--synthetic", "tiny", "--device", "tpu",
                   "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        args.func(args)
    try:
        has_gpu = device_count() > 0
    except NoCudaDevice:
        has_gpu = False
    if not has_gpu:
        args = _parse(["profile", "--synthetic", "tiny", "--device", "cuda",
                       "--out", str(tmp_path)])
        with pytest.raises(NoCudaDevice, match="no CUDA device"):
            args.func(args)
