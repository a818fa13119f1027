"""What a round costs on this machine, learned from the rounds the engine runs.

The speculation plan (dispatch/speculation.py's `allocate_drafts`) weighs a round's
expected tokens against its cost by its rows. The backend's own table
(`RoundBackend.round_cost`, kernels/numpy_ops.py's `ROUND_COST`) was measured on one
machine; on another the shape differs: on the AVX-512 Xeon of docs/performance.md a
forward of 8 rows of the demo model costs 2.7 one-row forwards where the table, from an
AMD EPYC, says 4.3. And a forward's cost is not a round's: eight sessions' one-row
rounds and a round with draft rows do not take the same path (pricing drafts by
forwards lost 23% at 8 requests there). So the control thread times each round it
harvests that prefills nothing and runs no draft model (device start to device end: the
forward, the sampling, the acceptance; a draft model's forwards are not what a prompt
lookup's draft rows cost) and tells `RoundCosts`, which keeps a decayed mean per (rows, drafted)
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

A round that runs the draft model has its draft forwards timed apart on the device
(`DraftRound.elapsed`): the rest of its time is its rows' (`observe`), and the draft's
(`observe_draft`) prices its first forward and each further one apart (`draft_prices`,
in one-row rounds): the first takes two rows per session (the catch-up row), the others
one, and the first is paid in every round while the others are what drafts add. Rounds
of one forward give the first's price; rounds of K give the others' as (time - the
first's) / (K - 1), or time / K while no one-forward round was seen. A price not yet
measured in `MIN_ROUNDS` rounds is `draft_prior` (the control thread's: the bytes the
draft reads per step over the model's), so drafts the plan has not tried are priced
by the draft's size, not by the dearer first forward, and get tried.
"""

from __future__ import annotations

import bisect
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
    # the prices as last derived from the means (`_reprice`, after an observation): per
    # kind, the sizes seen and their costs in one-row rounds; and the prices asked since
    _points: dict[bool, tuple[list[int], list[float]]] | None = None
    _prices: dict[tuple[int, bool], float] = field(default_factory=dict)
    # a draft-model forward's price in one-row rounds until enough are measured
    draft_prior: float = 0.0
    # seconds: the draft's first forward of a round, each further one ([mean, rounds])
    _first: list[float] = field(default_factory=lambda: [0.0, 0])
    _more: list[float] = field(default_factory=lambda: [0.0, 0])

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
        self._points = None

    def observe_draft(self, forwards: int, seconds: float) -> None:
        """A harvested round's `forwards` forwards of the draft model took `seconds` on
        the device."""
        if forwards < 1 or not seconds > 0:
            return
        if forwards == 1:
            self._update(self._first, seconds)
        elif self._first[1] >= self.min_rounds:
            self._update(self._more, max(0.0, seconds - self._first[0]) / (forwards - 1))
        else:
            self._update(self._more, seconds / forwards)

    def _update(self, stat: list[float], seconds: float) -> None:
        """A decayed mean ([mean, count]) told of one more round."""
        mean, n = stat
        weight = min(self.decay, n / (n + 1))
        stat[0], stat[1] = weight * mean + (1 - weight) * seconds, n + 1

    @property
    def draft_rounds(self) -> int:
        """How many rounds' draft forwards it was told of."""
        return int(self._first[1] + self._more[1])

    def draft_prices(self) -> tuple[float, float]:
        """The draft model's first forward of a round and each further one, in one-row
        rounds (`allocate_drafts`' `draft_first`, `draft_step`): measured after
        `min_rounds` rounds that show each, else `draft_prior`."""
        unit = self._unit()

        def price(stat: list[float]) -> float:
            if unit is None or stat[1] < self.min_rounds:
                return self.draft_prior
            return stat[0] / unit
        return price(self._first), price(self._more)

    def rounds(self, rows: int, drafted: bool) -> int:
        """How many rounds of the kind it was told of."""
        return self._count.get((rows, drafted), 0)

    def seen(self, rows: int, drafted: bool) -> bool:
        return self.rounds(rows, drafted) >= self.min_rounds

    def __call__(self, rows: int, drafted: bool = False) -> float:
        """The price, looked up once derived: a plan asks for every candidate round
        size (8 sessions' 16 drafts each: 128 prices a round), and deriving each took
        7 µs, 0.9 ms a plan, taken from the forward's threads on 2 cores."""
        if self._points is None:
            self._reprice()
        key = (max(rows, 1), drafted)
        price = self._prices.get(key)
        if price is None:
            price = self._prices[key] = self._price(*key)
        return price

    def _reprice(self) -> None:
        """The sizes seen of each kind and their costs, from the means."""
        unit = self._unit()
        points: dict[bool, dict[int, float]] = {False: {}, True: {}}
        if unit is not None:
            for (r, d), mean in self._mean.items():
                if self.seen(r, d):
                    points[d][r] = mean / unit
            if self.seen(1, False):  # a round with drafts costs a one-row round and more
                points[True].setdefault(1, 1.0)
        self._points = {d: (sorted(p), [p[r] for r in sorted(p)]) for d, p in points.items()}
        self._prices = {}

    def _price(self, rows: int, drafted: bool) -> float:
        assert self._points is not None
        sizes, costs = self._points[drafted]
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes) and sizes[i] == rows:  # seen
            return costs[i]
        if 0 < i < len(sizes):  # between two sizes seen: a line
            t = (rows - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
            return costs[i - 1] + t * (costs[i] - costs[i - 1])
        if not sizes:
            return self.prior(rows)
        near = i - 1 if i else 0  # past the sizes seen: the prior's growth from the nearest
        return self.prior(rows) * costs[near] / self.prior(sizes[near])

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
