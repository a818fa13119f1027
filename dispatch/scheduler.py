"""Sessions as the control thread sees them, and the planning of one round.

A round is planned in one readable function (`Scheduler.plan`): every running session
decodes one token, a speculating one with as many draft rows after it as are worth their
cost (dispatch/speculation.py); waiting sessions contribute prefill chunks, oldest first,
under the round's token budget and the batch size. Pages for the positions the round writes are
mapped before it is launched; when the pool runs dry the scheduler evicts cached prefixes,
then preempts the newest sessions (their KV dropped, recomputed when they resume).
The scheduler never looks at token values: it only counts.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from eagerlm.dispatch.speculation import RoundCost, SpecSession, allocate_drafts
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.vmm.device import Event
from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.kv_region import KVRegion, RegionState
from eagerlm.vmm.page_pool import OutOfPages, PagePool

_arrivals = itertools.count()


@dataclass
class Session:
    """One generation as the control thread tracks it.

    `tokens` are the inputs whose KV the session must hold before it decodes: the prompt,
    and after a preemption also the tokens generated so far (recomputed on resume).

    A speculating session (`spec`) accepts a number of tokens per round that the device
    decides: until its rounds are harvested, `n_cached` counts every row launched (an
    upper bound: pages are mapped for it) and `n_sampled` one token per round (a lower
    bound: launching goes on until the service thread stops the session); the harvest of
    each round corrects both (ControlThread._harvest).
    """

    id: int
    tokens: list[int]
    params: SamplingParams
    max_new: int  # decode steps the service allows (max_tokens, context)
    arrival: int = field(default_factory=lambda: next(_arrivals))
    region: KVRegion | None = None
    slot: int | None = None  # row of the device token buffer holding its last sample
    n_cached: int = 0  # positions whose KV launched rounds write
    n_sampled: int = 0  # tokens sampled by launched rounds
    n_reused: int = 0  # prompt positions taken from the prefix cache
    last_event: Event | None = None  # recorded after the last work that touched its KV
    stopped: bool = False
    counts_valid: bool = False  # the sampler's penalty counts match what is cached
    spec: SpecSession | None = None  # speculative decoding, if the session does it
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)

    @property
    def prefilling(self) -> bool:
        return self.n_cached < len(self.tokens)

    @property
    def exhausted(self) -> bool:
        """Sampled every token the service allows; nothing more to launch."""
        return self.n_sampled >= self.max_new


@dataclass
class Row:
    """What one session contributes to a round."""

    session: Session
    n_new: int  # positions written: 1 for decode, a chunk for prefill
    n_past: int
    from_slot: bool  # decode: input is the session's last sample on the device
    samples: bool  # the last row's logits are sampled
    n_draft: int = 0  # decode rows after the first that verify proposals (speculation)


@dataclass
class RoundPlan:
    rows: list[Row]

    @property
    def n_tokens(self) -> int:
        return sum(r.n_new for r in self.rows)

    @property
    def n_decode(self) -> int:
        return sum(1 for r in self.rows if r.from_slot)

    @property
    def n_draft(self) -> int:
        return sum(r.n_draft for r in self.rows)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32  # sessions per round
    max_round_tokens: int = 256  # prefill + decode tokens per round (chunked prefill)
    map_ahead: int = 16  # tokens of pages mapped beyond what the round writes
    preempt: str = "recompute"  # or "swap": a preempted session's KV waits in host memory

    def __post_init__(self) -> None:
        if self.preempt not in ("recompute", "swap"):
            raise ValueError(f"preempt must be 'recompute' or 'swap', not {self.preempt!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool, layout: KVLayout,
                 context_length: int, sync_event: Callable[[Event | None], None]) -> None:
        self.config = config
        self.pool = pool
        self.layout = layout
        self.context_length = context_length
        self._sync = sync_event
        self.waiting: deque[Session] = deque()
        self.running: list[Session] = []
        self.free_slots = list(range(config.max_batch - 1, -1, -1))
        self.preemptions = 0
        self.swaps = 0
        # set by the control thread: evicts one cached prefix, False when none is left
        self.evict_cached: Callable[[], bool] = lambda: False
        # set by the control thread: makes a preempted session's generated tokens known
        self.resolve_tokens: Callable[[Session], list[int]] = lambda s: []
        # set by the control thread: a round's cost by its rows, relative to a one-row
        # round, by which speculating sessions' draft rows are chosen; None: always the
        # most each session allows (dispatch/speculation.py)
        self.round_cost: RoundCost | None = None
        # and a draft model's first forward of a round and each further one, in the same
        # units (0: none, or not priced)
        self.draft_prices: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)

    # -- planning ----------------------------------------------------------------------

    def plan(self) -> RoundPlan:
        """The next round: all running sessions decode, then prefill chunks fill the rest."""
        cfg = self.config
        rows: list[Row] = []
        # oldest first: a session only ever preempts newer ones, not yet in `rows`
        for s in sorted(self.running, key=lambda x: x.arrival):
            if s.stopped or s.exhausted or s not in self.running:
                continue
            if s.n_cached >= self.context_length:
                continue  # a speculating session's bound: wait for its rounds' harvest
            if not self._make_room(s, s.n_cached + 1):
                continue  # s itself gave way
            rows.append(Row(s, 1, s.n_cached, from_slot=True, samples=True))
        self._add_drafts(rows)
        budget = cfg.max_round_tokens - sum(r.n_new for r in rows)
        for s in list(self.waiting):
            if budget <= 0 or len(rows) >= cfg.max_batch:
                break
            if s.slot is None and not self.free_slots:
                break
            n = min(budget, len(s.tokens) - s.n_cached)
            if not self._admit(s, s.n_cached + n):
                break  # keep arrival order: nobody overtakes a session that cannot fit
            done = s.n_cached + n == len(s.tokens)
            rows.append(Row(s, n, s.n_cached, from_slot=False, samples=done))
            budget -= n
        return RoundPlan(rows)

    def _add_drafts(self, rows: list[Row]) -> None:
        """Give speculating sessions' decode rows their draft rows (allocate_drafts),
        within the round's token budget, the session's remaining tokens and the context;
        pages are mapped for them if the pool has them free (drafts never preempt)."""
        spec = [r for r in rows if r.session.spec is not None]
        if not spec:
            return
        caps = [max(0, min(r.session.spec.k_max, r.session.max_new - r.session.n_sampled - 1,
                           self.context_length - r.session.n_cached - 1)) for r in spec]
        if self.round_cost is None:
            ks = caps
        else:
            drafter = [r.session.spec.method == "draft" for r in spec]
            first, step = self.draft_prices() if any(drafter) else (0.0, 0.0)
            ks = allocate_drafts([r.session.spec.rate for r in spec], caps, len(rows),
                                 len(rows), self.round_cost,
                                 self.config.max_round_tokens - len(rows), drafter=drafter,
                                 draft_first=first, draft_step=step)
        budget = self.config.max_round_tokens - len(rows)
        for r, k in zip(spec, ks, strict=True):
            s = r.session
            assert s.region is not None
            k = min(k, budget)
            budget -= k
            try:
                if k:
                    s.region.ensure(s.n_cached + 1 + k)
            except OutOfPages:
                k = 0
            r.n_draft, r.n_new = k, 1 + k

    def launched(self, plan: RoundPlan, event: Event) -> None:
        """Account for a launched round: positions written, samples taken."""
        for r in plan.rows:
            s = r.session
            s.n_cached += r.n_new
            s.last_event = event
            if r.samples:
                s.n_sampled += 1
            if not r.from_slot and not s.prefilling:
                self.waiting.remove(s)
                self.running.append(s)

    # -- sessions ---------------------------------------------------------------------

    def add(self, s: Session) -> None:
        self.waiting.append(s)

    def remove(self, s: Session) -> None:
        """Take a stopped session out of planning; its slot is free for the next one."""
        s.stopped = True
        if s in self.running:
            self.running.remove(s)
        if s in self.waiting:
            self.waiting.remove(s)
        if s.slot is not None:
            self.free_slots.append(s.slot)
            s.slot = None

    def idle(self) -> bool:
        return not self.waiting and not any(not s.exhausted for s in self.running)

    # -- pages ------------------------------------------------------------------------

    def _admit(self, s: Session, n_tokens: int) -> bool:
        if s.region is None:
            s.region = self.pool.new_region(self.layout, self.context_length)
        if not self._make_room(s, n_tokens):
            return False
        if s.slot is None:
            s.slot = self.free_slots.pop()
        return True

    def _make_room(self, s: Session, n_tokens: int) -> bool:
        """Map pages for `n_tokens` positions of `s`, evicting cached prefixes and then
        preempting newer sessions as needed. False if `s` itself had to give way."""
        assert s.region is not None
        ahead = self.config.map_ahead
        while True:
            try:
                if s.region.state is RegionState.SWAPPED:
                    s.region.swap_in()  # all or nothing, like ensure
                s.region.ensure(n_tokens, ahead=ahead)
                return True
            except OutOfPages:
                pass
            if ahead:
                ahead = 0  # map-ahead is a nicety, not worth preempting for
                continue
            if self.pool.reclaim() or self.evict_cached():
                continue
            victim = self._newest_victim(s)
            if victim is None:
                if s in self.running:
                    self.preempt(s)  # the newest holder gives way itself
                return False
            self.preempt(victim)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens * self.layout.token_bytes // self.pool.page_size)

    def can_ever_fit(self, s: Session) -> bool:
        """Whether the whole pool could hold `s` at its longest."""
        return self.pages_for(s.prompt_len + s.max_new) <= self.pool.n_pages

    def _newest_victim(self, s: Session) -> Session | None:
        """The newest session holding pages, if newer than `s`."""
        holders = [x for x in itertools.chain(self.running, self.waiting)
                   if x is not s and x.region is not None and x.region.n_pages
                   and x.arrival > s.arrival]
        return max(holders, key=lambda x: x.arrival, default=None)

    def preempt(self, s: Session) -> None:
        """Take `s`'s pages and put it back at the head of the queue.

        Its generated tokens join its input, and sampling continues at the same generation
        count, so no token is shown twice. With `recompute` its KV is dropped and computed
        again on resume; with `swap` it is copied to host memory and copied back, and only
        the last sampled token (whose KV was never written) is computed on resume."""
        self.preemptions += 1
        s.tokens = s.tokens[: s.prompt_len] + self.resolve_tokens(s)
        if s.spec is not None:
            s.spec.history_sent = False  # its next slot's history is sent again
        self._sync(s.last_event)
        if s.region is not None and self.config.preempt == "swap" and s.n_cached:
            s.region.swap_out(after=s.last_event)
            self.swaps += 1
        else:
            if s.region is not None:
                s.region.release(after=s.last_event)
                s.region = None
            s.n_cached = 0
            s.n_reused = 0
            s.counts_valid = False  # the recompute counts its tokens again
        self.pool.reclaim()
        if s in self.running:
            self.running.remove(s)
        if s.slot is not None:
            self.free_slots.append(s.slot)
            s.slot = None
        if s not in self.waiting:
            # ahead of everything that arrived after it
            i = next((i for i, w in enumerate(self.waiting) if w.arrival > s.arrival),
                     len(self.waiting))
            self.waiting.insert(i, s)
