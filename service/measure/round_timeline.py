"""Rounds on one clock: the dispatcher's per-round traces turned into host-time intervals,
and what the profiler computes from them (bubble fraction, host time, lookahead reached).

Everything here except `DeviceClock.calibrate` and `spans_from_traces` is a pure function
of plain numbers, so tests can build a timeline with known gaps and check the results
exactly.

## The common clock

Host timestamps in a `RoundTrace` are `time.perf_counter()` seconds. Device times are
events; an event pair gives a duration (`elapsed_ms`) but not a place on the host timeline.
`DeviceClock` records one *anchor* event whose host time is known and places every other
event at `anchor_host + anchor.elapsed_ms(event)`: the same code on both backends, through
the public `Event` interface only.

- cpu: a `CpuEvent` stamps `perf_counter_ns` when its stream's thread reaches it, so the
  anchor's host time is exact and every converted time is the event's own stamp.
- cuda (when built): the host brackets the anchor (host time before recording it, after
  synchronizing on it); the midpoint is used and half the bracket (a few microseconds on an
  idle stream) is the clock's `uncertainty_s`. GPU timer and host clock drift by parts per
  million, nothing over a profiling run.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagerlm.dispatch.messages import RoundTrace
from eagerlm.vmm.device import Device, Event


@dataclass(frozen=True)
class DeviceClock:
    """Places device events on the host's `perf_counter` timeline (seconds)."""

    anchor: Event
    anchor_host_s: float
    uncertainty_s: float = 0.0

    @classmethod
    def calibrate(cls, device: Device) -> DeviceClock:
        """Record an anchor on a stream of its own (idle, so it completes at once)."""
        stream = device.stream("profiler-clock")
        try:
            event = device.event()
            before = time.perf_counter()
            stream.record(event)
            event.synchronize()
            after = time.perf_counter()
        finally:
            stream.close()
        stamp = _host_stamp(event)
        if stamp is not None:
            return cls(event, stamp, 0.0)
        return cls(event, (before + after) / 2, (after - before) / 2)

    def host_time(self, event: Event) -> float:
        """The host time (perf_counter seconds) at which `event` completed on the device,
        waited for if it has not yet: a consumed round's own events have, but a tensor-
        parallel peer records its round's end after its own last op, which may still be
        finishing when device 0's round is consumed (seen under load on CI's 2 cores)."""
        event.synchronize()
        return self.anchor_host_s + self.anchor.elapsed_ms(event) / 1e3


def _host_stamp(event: Event) -> float | None:
    """The exact host time of a completed event, on backends that stamp one (cpu)."""
    from eagerlm.vmm.cpu_device import CpuEvent

    if isinstance(event, CpuEvent) and event._time_ns is not None:
        return event._time_ns / 1e9  # perf_counter_ns: the same clock as perf_counter
    return None


@dataclass(frozen=True)
class RoundSpan:
    """One round with every time on the host clock (perf_counter seconds)."""

    round_id: int
    plan_start: float
    plan_end: float
    launch_end: float
    device_start: float
    device_end: float
    tokens_ready: float
    n_decode: int = 0
    n_prefill_tokens: int = 0
    n_sessions: int = 0
    pages_in_use: int = 0
    n_constrained: int = 0  # rows whose sampling took a grammar's mask
    mask_wait: float = 0.0  # seconds that sampling waited for the host's masks
    n_draft_rows: int = 0  # speculation: rows that verified proposals
    n_draft_tokens: int = 0  # proposals verified (fewer than the rows when none was found)
    n_accepted_tokens: int = 0  # and accepted
    # a model split over devices: device r's (start, end) of this round, r = 1 .. (None
    # where its record was not found)
    peers: tuple[tuple[float, float] | None, ...] = ()

    @property
    def host_s(self) -> float:
        """Host time the control thread spent on the round: planning plus launching."""
        return self.launch_end - self.plan_start

    @property
    def device_s(self) -> float:
        return self.device_end - self.device_start

    @property
    def decode_only(self) -> bool:
        return self.n_decode > 0 and self.n_prefill_tokens == 0


def spans_from_traces(traces: Iterable[RoundTrace], clock: DeviceClock,
                      peers: Sequence[tuple[Mapping[int, Any], DeviceClock]] = ()
                      ) -> list[RoundSpan]:
    """Convert consumed rounds' traces (their events completed), sorted by round id.
    `peers`: the other devices of a split model, each its rounds by id (with
    `device_start` / `device_end` events: dispatch/follower_thread.py's DeviceRound) and
    its clock."""
    spans = []
    for t in traces:
        if t.device_start is None or t.device_end is None:
            continue
        lanes = []
        for rounds, peer_clock in peers:
            r = rounds.get(t.round_id)
            lanes.append(None if r is None else (peer_clock.host_time(r.device_start),
                                                 peer_clock.host_time(r.device_end)))
        spans.append(RoundSpan(
            t.round_id, t.plan_start, t.plan_end, t.launch_end,
            clock.host_time(t.device_start), clock.host_time(t.device_end), t.tokens_ready,
            t.n_decode, t.n_prefill_tokens, t.n_sessions, t.pages_in_use, t.n_constrained,
            t.mask_wait, t.n_draft_rows, t.n_draft_tokens, t.n_accepted_tokens,
            tuple(lanes)))
    return sorted(spans, key=lambda s: s.round_id)


# -- pure computations -----------------------------------------------------------------

def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def steady_decode_runs(spans: Sequence[RoundSpan], min_batch: int = 1) -> list[list[RoundSpan]]:
    """Maximal runs of consecutive rounds (by id) that only decode, at least `min_batch`
    sessions each, two rounds or more.

    Why only these: between such rounds the device always has work the host knows about,
    so any idle time there is the dispatcher's doing. Around arrivals, prefills and the
    start and end of a run, the device may idle for lack of work, which no dispatcher
    can fix."""
    runs: list[list[RoundSpan]] = []
    current: list[RoundSpan] = []
    for s in sorted(spans, key=lambda x: x.round_id):
        ok = s.decode_only and s.n_decode >= min_batch
        if ok and current and s.round_id == current[-1].round_id + 1:
            current.append(s)
            continue
        if len(current) >= 2:
            runs.append(current)
        current = [s] if ok else []
    if len(current) >= 2:
        runs.append(current)
    return runs


@dataclass(frozen=True)
class Bubble:
    """Device idle time between rounds over the steady-decode windows."""

    idle_s: float
    window_s: float
    n_rounds: int

    @classmethod
    def between(cls, busy: Sequence[tuple[float, float]]) -> Bubble:
        """The time no interval of `busy` covers, in the window from the first start to the
        last end: the device's idle time when the intervals are its rounds."""
        if not busy:
            return cls(0.0, 0.0, 0)
        window = max(b for _, b in busy) - min(a for a, _ in busy)
        return cls(window - union_length(busy), window, len(busy))

    def __add__(self, other: Bubble) -> Bubble:
        return Bubble(self.idle_s + other.idle_s, self.window_s + other.window_s,
                      self.n_rounds + other.n_rounds)

    @property
    def fraction(self) -> float:
        """Idle over wall time (0 for an empty window)."""
        return self.idle_s / self.window_s if self.window_s > 0 else 0.0


def steady_bubble(spans: Sequence[RoundSpan], min_batch: int = 1) -> Bubble:
    """Idle over wall time, summed over every steady-decode run (each run's window goes
    from its first round's device start to its last round's device end)."""
    return sum((Bubble.between([(s.device_start, s.device_end) for s in run])
                for run in steady_decode_runs(spans, min_batch)), Bubble(0.0, 0.0, 0))


def in_flight_at_launch(spans: Sequence[RoundSpan]) -> list[int]:
    """For each round (by id order): how many launched rounds, itself included, the service
    thread had not yet taken the tokens of when it finished launching. This is the
    lookahead actually reached: 1 in sync mode, up to `k` when eager."""
    ordered = sorted(spans, key=lambda x: x.round_id)
    ready = [s.tokens_ready for s in ordered]
    if any(b < a for a, b in itertools.pairwise(ready)):  # never: the service is in order
        return [sum(1 for p in ordered[: i + 1] if p.tokens_ready > s.launch_end)
                for i, s in enumerate(ordered)]
    return [i + 1 - bisect.bisect_right(ready, s.launch_end, 0, i + 1)
            for i, s in enumerate(ordered)]


@dataclass(frozen=True)
class TimelineStats:
    """What the profiler reports about a run's rounds (times in milliseconds)."""

    n_rounds: int
    n_steady: int
    bubble: float  # device idle fraction in steady decode
    plan_ms: float  # mean over steady rounds (all rounds if none)
    launch_ms: float
    host_ms: float  # plan + launch
    device_ms: float
    ready_ms: float  # device end -> tokens in the service thread
    lookahead_mean: float
    lookahead_max: int
    batch_mean: float
    # rounds that sampled constrained rows, and how long those waited for their masks
    # (all such rounds, not only steady ones): the part of the grammar's work on the host
    # that the forward running meanwhile did not hide
    constrained_rounds: int = 0
    mask_wait_ms: float = 0.0  # mean over those rounds
    mask_wait_max_ms: float = 0.0
    # speculative decoding, over all rounds: draft rows, proposals verified and accepted
    draft_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # a model split over devices: devices 1 .. N - 1's own idle fraction in the same
    # steady-decode runs and their mean round time (RoundSpan.peers). Device 0's are
    # `bubble` and `device_ms`, which count the time it waits in a collective for the
    # others as busy: a slow device shows as its own busy time and the others' waits.
    peer_bubble: tuple[float, ...] = ()
    peer_device_ms: tuple[float, ...] = ()

    @property
    def acceptance(self) -> float:
        """Accepted proposals over the proposals verified (0 with none)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def peer_intervals(spans: Iterable[RoundSpan], r: int) -> list[tuple[float, float]]:
    """Device r's (1 .. N - 1) busy intervals in `spans`, where its record was found."""
    return [lane for s in spans if r < len(s.peers) and (lane := s.peers[r]) is not None]


def timeline_stats(spans: Sequence[RoundSpan], min_batch: int = 1) -> TimelineStats:
    bubble = steady_bubble(spans, min_batch)
    runs = steady_decode_runs(spans, min_batch)
    steady_ids = {s.round_id for run in runs for s in run}
    chosen = [s for s in spans if s.round_id in steady_ids] or list(spans)
    flight = dict(zip((s.round_id for s in sorted(spans, key=lambda x: x.round_id)),
                      in_flight_at_launch(spans)))
    flights = [flight[s.round_id] for s in chosen]
    masked = [s for s in spans if s.n_constrained]

    def mean_ms(values: list[float]) -> float:
        return 1e3 * sum(values) / len(values) if values else 0.0

    peers = range(max((len(s.peers) for s in spans), default=0))
    peer_bubble = tuple(sum((Bubble.between(peer_intervals(run, r)) for run in runs),
                            Bubble(0.0, 0.0, 0)).fraction for r in peers)
    peer_device_ms = tuple(mean_ms([b - a for a, b in peer_intervals(chosen, r)])
                           for r in peers)

    return TimelineStats(
        n_rounds=len(spans), n_steady=bubble.n_rounds, bubble=bubble.fraction,
        plan_ms=mean_ms([s.plan_end - s.plan_start for s in chosen]),
        launch_ms=mean_ms([s.launch_end - s.plan_end for s in chosen]),
        host_ms=mean_ms([s.host_s for s in chosen]),
        device_ms=mean_ms([s.device_s for s in chosen]),
        ready_ms=mean_ms([s.tokens_ready - s.device_end for s in chosen]),
        lookahead_mean=sum(flights) / len(flights) if flights else 0.0,
        lookahead_max=max(flights, default=0),
        batch_mean=sum(s.n_decode for s in chosen) / len(chosen) if chosen else 0.0,
        constrained_rounds=len(masked), mask_wait_ms=mean_ms([s.mask_wait for s in masked]),
        mask_wait_max_ms=1e3 * max((s.mask_wait for s in masked), default=0.0),
        draft_rows=sum(s.n_draft_rows for s in spans),
        draft_tokens=sum(s.n_draft_tokens for s in spans),
        accepted_tokens=sum(s.n_accepted_tokens for s in spans),
        peer_bubble=peer_bubble, peer_device_ms=peer_device_ms)
