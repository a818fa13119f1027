"""The physical page pool: sized once at start-up, pages recycled, never released while
the engine runs.

Creating and releasing device memory (cuMemCreate / cuMemRelease) is slow and can fail when
memory is fragmented by other allocations; taking a page off a free list is neither. So the
pool allocates all its pages up front, from what is left after weights and workspaces (a
`memory_fraction` of it), and every later page movement is bookkeeping plus a map or unmap.

Running out of pages is a normal event (the scheduler preempts a session and retries), so it
is the typed `OutOfPages`, raised before anything changes. Pages of a released region come
back only once the event recorded after the last work that touched them has completed
(`KVRegion.release(after=event)` then `reclaim()` each round). Virtual reservations are
recycled the same way: a released region's range, now vacant, serves the next region of the
same size.

Accounting invariant (checked by `audit()`): every page is either on the free list with no
mapping, or mapped (`refs` = how many regions map it); `free + mapped == total`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

from eagerlm.vmm.device import Device, Event, Stream, StreamError
from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.kv_region import KVRegion, RegionState
from eagerlm.vmm.phymem import PhyMem
from eagerlm.vmm.stats import MapLatency, PoolStats
from eagerlm.vmm.virmem import VirMem


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for. Nothing was changed: free pages (release
    or swap out a session, then `reclaim()`) and try again."""

    def __init__(self, wanted: int, free: int) -> None:
        self.wanted = wanted
        self.free = free
        super().__init__(f"out of KV pages: {wanted} wanted, {free} free")


class PagePool:
    """`n_pages` physical pages of `device.page_size` bytes, and the regions mapping them."""

    # what `new_region` makes: a subclass may note what its regions do (the tensor-parallel
    # leader's journal, dispatch/region_journal.py)
    region_type: type[KVRegion] = KVRegion

    def __init__(self, device: Device, n_pages: int) -> None:
        self.device = device
        self.page_size = device.page_size
        self.latency = MapLatency()
        self._pages: list[PhyMem] = device.alloc_pages(n_pages)
        self._free: list[PhyMem] = list(reversed(self._pages))  # a stack: reuse warm pages
        self._regions: set[KVRegion] = set()  # active and swapped
        self._pending: list[tuple[KVRegion, Event]] = []
        self._reservations: dict[int, list[VirMem]] = defaultdict(list)  # vacant, by size
        self._n_reservations = 0
        self._stream: Stream | None = None
        self._lock = threading.RLock()
        self._closed = False

    @classmethod
    def with_budget(cls, device: Device, budget_bytes: int) -> PagePool:
        """As many pages as fit in `budget_bytes` (the host backend's sizing)."""
        return cls(device, max(0, budget_bytes) // device.page_size)

    @classmethod
    def from_free_memory(cls, device: Device, memory_fraction: float = 0.9,
                         keep_bytes: int = 0) -> PagePool:
        """A `memory_fraction` of the device memory free now, less `keep_bytes`. Call it after
        weights and workspaces are allocated so the pool gets what is really left."""
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction {memory_fraction} is not in (0, 1]")
        free, _total = device.mem_info()
        return cls.with_budget(device, int(free * memory_fraction) - keep_bytes)

    @property
    def n_pages(self) -> int:
        return len(self._pages)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def stream(self) -> Stream:
        """The pool's own stream, for the copies of prefix sharing and swapping."""
        with self._lock:
            if self._stream is None:
                self._stream = self.device.stream("kv-pool")
            return self._stream

    # -- regions ---------------------------------------------------------------------

    def new_region(self, layout: KVLayout, max_tokens: int) -> KVRegion:
        """A region with room for `max_tokens` tokens reserved and nothing mapped yet."""
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, not {max_tokens}")
        ps = self.page_size
        size = -(-max_tokens * layout.token_bytes // ps) * ps
        with self._lock:
            self._require_open()
            vacant = self._reservations[size]
            if vacant:
                vm = vacant.pop()
            else:
                vm = self.device.reserve(size, self.latency)
                self._n_reservations += 1
            region = self.region_type(self, layout, max_tokens, vm)
            self._regions.add(region)
            return region

    def take(self, n: int) -> list[PhyMem]:
        """`n` free pages, or OutOfPages with nothing taken."""
        with self._lock:
            self._require_open()
            if n > len(self._free):
                raise OutOfPages(n, len(self._free))
            return [self._free.pop() for _ in range(n)]

    def give_back(self, pages: list[PhyMem]) -> None:
        """Pages a region no longer maps; those mapped nowhere else return to the free list."""
        with self._lock:
            self._free.extend(p for p in pages if p.refs == 0)

    def reclaim(self) -> int:
        """Finish the releases whose event has completed; return how many pages came back.

        Called by the control thread each round. A released region whose numpy views are
        still referenced stays pending (unmapping under them would crash the process).
        """
        with self._lock:
            before = len(self._free)
            still: list[tuple[KVRegion, Event]] = []
            for region, event in self._pending:
                if _completed(event) and not region._views_alive():
                    region._finish_release()
                else:
                    still.append((region, event))
            self._pending = still
            return len(self._free) - before

    def _defer(self, region: KVRegion, event: Event) -> None:
        with self._lock:
            self._regions.discard(region)
            self._pending.append((region, event))

    def _retire(self, region: KVRegion, vm: VirMem) -> None:
        """A region is gone: recycle its now vacant reservation."""
        with self._lock:
            self._regions.discard(region)
            self._reservations[vm.size].append(vm)

    # -- accounting ------------------------------------------------------------------

    def stats(self) -> PoolStats:
        with self._lock:
            active = [r for r in self._regions if r.state is RegionState.ACTIVE]
            swapped = [r for r in self._regions if r.state is RegionState.SWAPPED]
            in_active = {id(p) for r in active for p in r._vm.mapped.values()}
            pending_pages = {id(p) for r, _ in self._pending for p in r._vm.mapped.values()}
            lat = self.latency
            return PoolStats(
                page_size=self.page_size,
                pages_total=len(self._pages),
                pages_free=len(self._free),
                pages_mapped=sum(1 for p in self._pages if p.refs > 0),
                pages_shared=sum(1 for p in self._pages if p.refs > 1),
                pages_pending=len(pending_pages - in_active),
                regions_active=len(active),
                regions_swapped=len(swapped),
                regions_pending=len(self._pending),
                reservations_total=self._n_reservations,
                reservations_free=sum(len(v) for v in self._reservations.values()),
                live_kv_bytes=sum(r.live_bytes for r in active),
                mapped_bytes=sum(r.mapped_bytes for r in active),
                swapped_bytes=sum(r.live_bytes for r in swapped),
                map_mean_us=lat.map.mean_us,
                map_max_us=1e6 * lat.map.max_s,
                unmap_mean_us=lat.unmap.mean_us,
                unmap_max_us=1e6 * lat.unmap.max_s,
                maps=lat.map.count,
                unmaps=lat.unmap.count,
            )

    def audit(self) -> None:
        """Check the accounting invariant; raise RuntimeError describing the first breach."""
        with self._lock:
            mappings: dict[int, int] = defaultdict(int)
            regions = [*self._regions, *(r for r, _ in self._pending)]
            for r in regions:
                for p in r._vm.mapped.values():
                    mappings[id(p)] += 1
            free_ids = [id(p) for p in self._free]
            if len(set(free_ids)) != len(free_ids):
                raise RuntimeError("a page is on the free list twice")
            free = set(free_ids)
            for i, p in enumerate(self._pages):
                if p.refs != mappings[id(p)]:
                    raise RuntimeError(f"page {i}: refs {p.refs}, mapped {mappings[id(p)]} times")
                if (id(p) in free) == (p.refs > 0):
                    raise RuntimeError(f"page {i}: refs {p.refs} but "
                                       f"{'on' if id(p) in free else 'off'} the free list")
            if not free <= {id(p) for p in self._pages}:
                raise RuntimeError("a foreign page is on the free list")

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Unmap everything and give all memory back (engine shutdown). Waits for pending
        events; raises ViewsAlive if numpy views of a region are still referenced."""
        with self._lock:
            if self._closed:
                return
            for region, event in self._pending:
                with contextlib.suppress(StreamError):  # failed work is over too
                    event.synchronize()
                region._check_no_views("close the pool under")
            for region in self._regions:
                region._check_no_views("close the pool under")
            for region, _ in self._pending:
                region._finish_release()
            self._pending = []
            for region in list(self._regions):
                region._finish_release()
            for vms in self._reservations.values():
                for vm in vms:
                    vm.free()
            self._reservations.clear()
            if self._stream is not None:
                self._stream.close()
            for p in self._pages:
                p.release()
            self._free.clear()
            self._closed = True

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("page pool is closed")


def _completed(event: Event) -> bool:
    try:
        return event.query()
    except StreamError:
        return True  # a failed stream runs no more work, so nothing will touch the pages
