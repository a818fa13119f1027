"""What a round costs on this machine, learned from the rounds the engine runs.

The speculation plan (dispatch/speculation.py's `allocate_drafts`) weighs a round's
expected tokens against its cost by its rows. The backend's own table
(`RoundBackend.round_cost`, kernels/numpy_ops.py's `ROUND_COST`) was measured on one
machine; on another the shape differs: on the AVX-512 Xeon of docs/performance.md a
forward of 8 rows of the demo model costs 2.7 one-row forwards where the table, from an
AMD EPYC, says 4.3. And a forward's cost is not a round's: eight sessions' one-row
rounds and a round with draft rows do not take the same path (pricing drafts by
forwards lost 23% at 8 requests there). So the control thread times each round it
harvests that prefills nothing (device start to device end: the forward, the sampling,
the acceptance) and tells `RoundCosts`, which keeps a decayed mean per (rows, drafted)
and prices a round by it:

- a (rows, drafted) seen in `MIN_ROUNDS` rounds or more: its mean, in units of a one-row
  round without drafts (measured too, once seen; before, inferred from the kind seen most
  through the prior's ratio);
- another between two sizes seen of its kind (a one-row round counts for the drafted
  kind: drafts only add to it): on the line between them; past the sizes seen, the
  prior's growth from the nearest; with none seen, the prior itself.

A size the plan never chooses keeps the prior's price, so learning corrects the prices
of what speculation does, which is where a price that is too low costs: rounds it chose
that did not pay are seen, priced up, and chosen less.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MIN_ROUNDS = 4  # rounds of a kind before its own mean is trusted over the prior's shape
DECAY = 0.9  # how much of a kind's mean each new round keeps


@dataclass
class RoundCosts:
    """Round costs by (rows, drafted), relative to a one-row round without drafts:
    measured where seen, else `prior(rows)` (the backend's table) reshaped through
    what was seen. Called by the plan (`cost(rows, drafted)`); told by the control
    thread (`observe`). One thread uses it (the control thread's)."""

    prior: Callable[[int], float]
    min_rounds: int = MIN_ROUNDS
    decay: float = DECAY
    _mean: dict[tuple[int, bool], float] = field(default_factory=dict)  # seconds
    _count: dict[tuple[int, bool], int] = field(default_factory=dict)

    def observe(self, rows: int, drafted: bool, seconds: float) -> None:
        """A harvested round of `rows` rows (with draft rows among them: `drafted`)
        that took `seconds` on the device."""
        if rows < 1 or not seconds > 0:
            return
        key = (rows, drafted)
        n = self._count.get(key, 0)
        mean = self._mean.get(key, seconds)
        # the plain mean of its first rounds, then a decayed one
        weight = min(self.decay, n / (n + 1))
        self._mean[key] = weight * mean + (1 - weight) * seconds
        self._count[key] = n + 1

    def seen(self, rows: int, drafted: bool) -> bool:
        return self._count.get((rows, drafted), 0) >= self.min_rounds

    def __call__(self, rows: int, drafted: bool = False) -> float:
        rows = max(rows, 1)
        unit = self._unit()
        if unit is None:
            return self.prior(rows)
        if self.seen(rows, drafted):
            return self._mean[(rows, drafted)] / unit
        points = {r: self._mean[(r, d)] / unit for (r, d) in self._mean
                  if d == drafted and self.seen(r, d)}
        if self.seen(1, False):  # a round with drafts costs a one-row round and more
            points.setdefault(1, 1.0)
        below = max((r for r in points if r < rows), default=None)
        above = min((r for r in points if r > rows), default=None)
        if below is not None and above is not None:  # between two sizes seen: a line
            t = (rows - below) / (above - below)
            return points[below] + t * (points[above] - points[below])
        near = below if below is not None else above
        if near is None:
            return self.prior(rows)
        return self.prior(rows) * points[near] / self.prior(near)  # the prior's growth

    def _unit(self) -> float | None:
        """Seconds of a one-row round without drafts: measured, or inferred from the
        kind seen in the most rounds through the prior; None before any is seen."""
        if self.seen(1, False):
            return self._mean[(1, False)]
        seen = [k for k in self._mean if self.seen(*k)]
        if not seen:
            return None
        rows, drafted = max(seen, key=lambda k: self._count[k])
        return self._mean[(rows, drafted)] / self.prior(rows)
