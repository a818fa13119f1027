"""Rounds and requests as a Chrome trace-event file, which ui.perfetto.dev and
chrome://tracing open.

Format: the JSON object form of the trace-event format (`{"traceEvents": [...]}`);
timestamps and durations in microseconds. Each profiled mode (eager, sync) is one process,
its timestamps relative to that run's own start, so the two runs line up one above the
other. Tracks per process:

- `control thread`: a `plan` slice then a `launch` slice per round;
- `device (compute stream)`: a `round N` slice per round, from its start event to its end
  event, with batch composition in `args`;
- with a model split over devices (`-tp N`), `device r (compute stream)` for r = 1 ..
  N - 1: the same rounds on each other device (the time in its collectives, waiting for
  the slowest device, included);
- `service thread`: `tokens to host`, from the round's device end until the service thread
  had the tokens (the copy and the hand-over);
- counters `batch` (decode sessions, prefill tokens) and `rounds in flight` (the lookahead
  reached when each round was launched);
- `requests`: one async slice per request, `waiting` from arrival to first token, then
  `generating` to its last token.

Building the trace is pure (`chrome_trace`), so tests check its structure directly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagerlm.service.measure.request_metrics import RequestRecord
from eagerlm.service.measure.round_timeline import RoundSpan, in_flight_at_launch

CONTROL_TID, DEVICE_TID, SERVICE_TID, REQUESTS_TID = 1, 2, 3, 4
PEER_TID = 10  # device r + 1 of a split model (tensor parallelism): PEER_TID + r
TRACK_NAMES = {CONTROL_TID: "control thread", DEVICE_TID: "device (compute stream)",
               SERVICE_TID: "service thread", REQUESTS_TID: "requests"}


@dataclass
class TracedRun:
    """One profiled run: its rounds, its requests, and the host time it started at."""

    name: str
    spans: Sequence[RoundSpan]
    requests: Sequence[RequestRecord] = field(default_factory=list)
    start: float = 0.0


def _us(t: float, start: float) -> float:
    return round((t - start) * 1e6, 3)


def chrome_trace(runs: Sequence[TracedRun], metadata: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    for pid, run in enumerate(runs, start=1):
        t0 = run.start
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"eagerlm {run.name}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        n_peers = max((len(s.peers) for s in run.spans), default=0)
        tracks = {**TRACK_NAMES, **{PEER_TID + r: f"device {r + 1} (compute stream)"
                                    for r in range(n_peers)}}
        for tid, name in tracks.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        ordered = sorted(run.spans, key=lambda s: s.round_id)
        for s, flight in zip(ordered, in_flight_at_launch(ordered)):
            rid = {"round": s.round_id}
            events.append(_slice("plan", "host", pid, CONTROL_TID, s.plan_start, s.plan_end,
                                 t0, rid))
            events.append(_slice("launch", "host", pid, CONTROL_TID, s.plan_end, s.launch_end,
                                 t0, rid))
            events.append(_slice(f"round {s.round_id}", "device", pid, DEVICE_TID,
                                 s.device_start, s.device_end, t0,
                                 {"decode": s.n_decode, "prefill_tokens": s.n_prefill_tokens,
                                  "sessions": s.n_sessions, "pages_in_use": s.pages_in_use}))
            for r, lane in enumerate(s.peers):  # the same round on the other devices
                if lane is not None:
                    events.append(_slice(f"round {s.round_id}", "device", pid, PEER_TID + r,
                                         *lane, t0, rid))
            events.append(_slice("tokens to host", "service", pid, SERVICE_TID, s.device_end,
                                 s.tokens_ready, t0, rid))
            events.append({"ph": "C", "name": "batch", "pid": pid, "tid": 0,
                           "ts": _us(s.plan_start, t0),
                           "args": {"decode": s.n_decode, "prefill_tokens": s.n_prefill_tokens}})
            events.append({"ph": "C", "name": "rounds in flight", "pid": pid, "tid": 0,
                           "ts": _us(s.launch_end, t0), "args": {"rounds": flight}})
        for r in run.requests:
            if not r.token_times:
                continue
            ident = f"{pid}-{r.index}"
            first, last = r.token_times[0], r.token_times[-1]
            for ph, name, t in (("b", "waiting", r.arrival), ("e", "waiting", first),
                                ("b", "generating", first), ("e", "generating", last)):
                ev = {"ph": ph, "name": name, "cat": "request", "id": ident, "pid": pid,
                      "tid": REQUESTS_TID, "ts": _us(t, t0)}
                if ph == "b" and name == "waiting":
                    ev["args"] = {"request": r.index, "prompt_tokens": r.prompt_tokens,
                                  "output_tokens": len(r.token_times)}
                events.append(ev)
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = dict(metadata)
    return trace


def _slice(name: str, cat: str, pid: int, tid: int, start: float, end: float, t0: float,
           args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
            "ts": _us(start, t0), "dur": round(max(0.0, end - start) * 1e6, 3), "args": args}


def write_chrome_trace(path: str | Path, trace: Mapping[str, Any]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
    return path
