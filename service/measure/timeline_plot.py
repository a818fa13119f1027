"""A PNG of a window of rounds per mode, one above the other on the same time scale:
where the host plans and launches, where the device is busy, and when tokens reach the
service thread. The gaps in the device row are the bubbles. With a model split over
devices (`-tp N`), a row per other device (`device r`) below device 0's. Bars narrower than 0.2% of
the window are drawn at that width so that sub-millisecond host work stays visible.

matplotlib is imported only here and only when a plot is drawn (it is in the `test`
extra; the engine does not need it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagerlm.service.measure.round_timeline import RoundSpan, steady_bubble, steady_decode_runs

ROWS = ("control: plan", "control: launch", "device", "service: tokens")
COLORS = {"control: plan": "#4c72b0", "control: launch": "#8172b2", "device": "#55a868",
          "service: tokens": "#dd8452"}


def plot_window(spans: Sequence[RoundSpan], n_rounds: int) -> list[RoundSpan]:
    """`n_rounds` consecutive rounds from the middle of the longest steady-decode run (the
    whole run when shorter), or from the middle of all rounds when there is none."""
    runs = steady_decode_runs(spans)
    pool = max(runs, key=len) if runs else sorted(spans, key=lambda s: s.round_id)
    if len(pool) <= n_rounds:
        return list(pool)
    first = (len(pool) - n_rounds) // 2
    return list(pool[first:first + n_rounds])


def rows_for(spans: Sequence[RoundSpan]) -> tuple[str, ...]:
    """The plot's rows: ROWS, with a row per other device of a split model after
    device 0's."""
    n = max((len(s.peers) for s in spans), default=0)
    at = ROWS.index("device") + 1
    return ROWS[:at] + tuple(f"device {r + 1}" for r in range(n)) + ROWS[at:]


def _bars(s: RoundSpan, row: str) -> tuple[float, float] | None:
    if row.startswith("device "):  # another device of a split model (None: not found)
        r = int(row.split()[1]) - 1
        return s.peers[r] if r < len(s.peers) else None
    return {"control: plan": (s.plan_start, s.plan_end),
            "control: launch": (s.plan_end, s.launch_end),
            "device": (s.device_start, s.device_end),
            "service: tokens": (s.device_end, s.tokens_ready)}[row]


def plot_timeline(path: str | Path, runs: Sequence[tuple[str, Sequence[RoundSpan]]],
                  n_rounds: int = 12, title: str = "") -> Path:
    """Draw each (mode name, rounds) pair's window in its own panel, top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    height = max(len(rows_for(spans)) for _, spans in runs) / len(ROWS) if runs else 1.0
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.2 * height * len(runs) + 0.8),
                             sharex=True, squeeze=False)
    for ax, (name, spans) in zip(axes[:, 0], runs):
        window = plot_window(spans, n_rounds)
        if not window:
            ax.set_title(f"{name}: no rounds")
            continue
        t0 = min(s.plan_start for s in window)
        # host work can be a thousandth of a round: widen bars to stay visible (the trace
        # file has the exact times)
        min_ms = 0.002 * (max(s.tokens_ready for s in window) - t0) * 1e3
        rows = rows_for(window)
        for y, row in enumerate(rows):
            bars = [((a - t0) * 1e3, max((b - a) * 1e3, min_ms))
                    for a, b in filter(None, (_bars(s, row) for s in window))]
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS.get(row, COLORS["device"]),
                           edgecolors="white", linewidth=0.4)
        for s in window:  # round numbers on the device bars
            ax.text((s.device_start - t0) * 1e3, rows.index("device") + 0.42,
                    str(s.round_id), fontsize=6, va="bottom")
        bubble = steady_bubble(spans)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(-0.6, len(rows) - 0.2)
        ax.invert_yaxis()
        ax.set_title(f"{name}: rounds {window[0].round_id}-{window[-1].round_id}, "
                     f"steady-decode bubble {bubble.fraction:.1%}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the window's first plan")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
