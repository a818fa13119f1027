"""The KV regions of a tensor-parallel group: the leader's decisions, replayed by each
follower on its own page pool (docs/tensor_parallel.md, "Phase 2").

Every device of the group holds the same tokens of a session (its own KV heads), so its
region needs the same pages at the same times. The leader's scheduler and prefix cache
decide alone, as with one device; its pool (`JournaledPool`) notes every change a region
goes through, in order (`RegionOp`: created, grown, a prefix shared, swapped, released),
and the leader sends the notes with its next order. A follower applies them to its own
regions (`apply_ops`), keyed by the leader's region id: no page, region or pool is shared
between the threads.

A follower's pool has the leader's page count, and applies the same operations in the
same order, so it can always do what the leader did; it may only be later in getting
pages back (a release waits for the follower's own rounds), so a grow that finds too few
free pages waits for its own stream and reclaims first (`_with_pages`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from eagerlm.vmm.device import Event, Stream
from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.kv_region import KVRegion
from eagerlm.vmm.page_pool import OutOfPages, PagePool

T = TypeVar("T")


@dataclass(frozen=True)
class NewRegion:
    region: int
    max_tokens: int


@dataclass(frozen=True)
class Ensure:
    region: int
    n_tokens: int
    ahead: int


@dataclass(frozen=True)
class SharePrefix:
    region: int
    source: int
    n_tokens: int


@dataclass(frozen=True)
class SwapOut:
    region: int


@dataclass(frozen=True)
class SwapIn:
    region: int


@dataclass(frozen=True)
class Release:
    region: int


RegionOp = NewRegion | Ensure | SharePrefix | SwapOut | SwapIn | Release


class JournaledRegion(KVRegion):
    """A leader's region: each change that succeeded is noted in its pool's journal (a
    change that raised, OutOfPages included, changed nothing and is not noted)."""

    pool: JournaledPool
    rid: int

    def ensure(self, n_tokens: int, ahead: int = 0) -> int:
        added = super().ensure(n_tokens, ahead)
        self.pool.journal.append(Ensure(self.rid, n_tokens, ahead))
        return added

    def share_prefix_from(self, other: KVRegion, n_tokens: int,
                          stream: Stream | None = None) -> int:
        shared = super().share_prefix_from(other, n_tokens, stream)
        assert isinstance(other, JournaledRegion)
        self.pool.journal.append(SharePrefix(self.rid, other.rid, n_tokens))
        return shared

    def swap_out(self, stream: Stream | None = None, after: Event | None = None) -> None:
        super().swap_out(stream, after)
        self.pool.journal.append(SwapOut(self.rid))

    def swap_in(self, stream: Stream | None = None) -> None:
        super().swap_in(stream)
        self.pool.journal.append(SwapIn(self.rid))

    def release(self, after: Event | None = None) -> None:
        super().release(after)
        self.pool.journal.append(Release(self.rid))


class JournaledPool(PagePool):
    """The leader's page pool: regions that note their changes in `journal`, which the
    leader empties into each order (`take_journal`). Used by the leader's control thread
    only, so the journal needs no lock."""

    region_type = JournaledRegion

    def __init__(self, device, n_pages: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(device, n_pages)
        self.journal: list[RegionOp] = []
        self._ids = itertools.count()

    def new_region(self, layout: KVLayout, max_tokens: int) -> KVRegion:
        region = super().new_region(layout, max_tokens)
        assert isinstance(region, JournaledRegion)
        region.rid = next(self._ids)
        self.journal.append(NewRegion(region.rid, max_tokens))
        return region

    def take_journal(self) -> list[RegionOp]:
        ops, self.journal = self.journal, []
        return ops


class RegionMirror:
    """A follower's regions, one per leader region id, on the follower's own pool and KV
    layout (its heads). `fence()` records an event on the follower's compute stream after
    everything launched there so far: what a release or a swap waits for."""

    def __init__(self, pool: PagePool, layout: KVLayout, compute: Stream,
                 fence: Callable[[], Event]) -> None:
        self.pool = pool
        self.layout = layout
        self.compute = compute
        self.fence = fence
        self.regions: dict[int, KVRegion] = {}

    def apply(self, ops: list[RegionOp]) -> None:
        for op in ops:
            self._apply(op)

    def _apply(self, op: RegionOp) -> None:
        regions = self.regions
        if isinstance(op, NewRegion):
            regions[op.region] = self.pool.new_region(self.layout, op.max_tokens)
        elif isinstance(op, Ensure):
            r = regions[op.region]
            self._with_pages(lambda: r.ensure(op.n_tokens, op.ahead))
        elif isinstance(op, SharePrefix):
            r, src = regions[op.region], regions[op.source]
            self._with_pages(lambda: r.share_prefix_from(src, op.n_tokens,
                                                         stream=self.compute))
        elif isinstance(op, SwapOut):
            self.compute.synchronize()  # its rounds done and their views of it dropped
            regions[op.region].swap_out()
        elif isinstance(op, SwapIn):
            r = regions[op.region]
            self._with_pages(r.swap_in)
        elif isinstance(op, Release):
            regions.pop(op.region).release(after=self.fence())
        else:  # pragma: no cover
            raise TypeError(f"not a region operation: {op!r}")

    def _with_pages(self, change: Callable[[], T]) -> T:
        """Make `change`; where the pool is short, first let this device's releases in
        flight complete (the leader had those pages back sooner) and try once more."""
        try:
            return change()
        except OutOfPages:
            self.compute.synchronize()
            self.pool.reclaim()
            return change()

    def close(self) -> None:
        for r in self.regions.values():
            r.release(after=self.fence())
        self.regions.clear()
