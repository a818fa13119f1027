"""A session's KV cache: one virtual range, token-major, with pages mapped as it grows.

The range is reserved for the model's whole context when the session starts, so its base
address never changes (not on growth, not across a swap): attention sees one contiguous
tensor per session, with no block table. `ensure(n)` maps the pages position n needs before
the round that writes it. Because the layout is token-major (`KVLayout`), all layers grow
together and the unmapped-but-wasted tail is under one page per session.

Lifecycle: ACTIVE -> (swap_out) SWAPPED -> (swap_in) ACTIVE -> release -> RELEASING (waiting
for the event of the last round that touched it) -> RELEASED (pages back in the pool, the
vacant range recycled for the next session).

Views: on the host backend `k(layer)` / `v(layer)` are numpy views into the mapped pages (the
`SessionKV` protocol the numpy ops read). A numpy view does not keep a mapping alive, so the
region never unmaps under a live view: release, swap-out and pool shutdown first check that
no view (or slice of one) is still referenced and raise `ViewsAlive` if one is, and a
deferred release just waits for the views to go. Views only ever cover mapped pages
(`capacity` tokens), so indexing past them is an IndexError, never a wild access. On cuda,
`k_view` / `v_view` give the base pointer and strides for the kernels.

Threads: the control thread grows, swaps and releases regions while a cpu stream's thread
runs the ops that take views. Making a view and deciding to unmap both happen under the
pool's lock, so a view is either seen by the check (which then refuses to unmap) or made
after the state changed (and refused). The lock is never held while waiting for a stream:
the work being waited for may itself need a view.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eagerlm.vmm.device import Event, HostBuffer, Stream
from eagerlm.vmm.host_views import HostViews, TrackedRange
from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.virmem import VirMem

if TYPE_CHECKING:
    from eagerlm.vmm.page_pool import PagePool


class RegionState(enum.Enum):
    ACTIVE = "active"
    SWAPPED = "swapped"
    RELEASING = "releasing"
    RELEASED = "released"


class RegionStateError(RuntimeError):
    """An operation the region's state does not allow (e.g. reading a released region)."""


@dataclass(frozen=True)
class StridedView:
    """A tensor in device memory as a kernel takes it: address, shape, byte strides."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    dtype: np.dtype


class KVRegion:
    """One session's KV cache in a reserved virtual range. Made by `PagePool.new_region`."""

    def __init__(self, pool: PagePool, layout: KVLayout, max_tokens: int, vm: VirMem) -> None:
        self.pool = pool
        self.layout = layout
        self.max_tokens = max_tokens
        self._vm: VirMem | None = vm
        self._lock = pool._lock  # one lock for the pool and its regions: no lock ordering
        self.base_ptr = vm.base  # stable for the region's whole life
        self.n_tokens = 0  # live positions: 0 .. n_tokens - 1 hold (or will hold) KV
        self.state = RegionState.ACTIVE
        self._views = HostViews("a KV region")
        self._tokens_view: np.ndarray | None = None  # the region's own view; not a lease
        self._swap: HostBuffer | None = None

    # -- sizes -----------------------------------------------------------------------

    @property
    def token_bytes(self) -> int:
        return self.layout.token_bytes

    @property
    def n_pages(self) -> int:
        return self.mapped_bytes // self.pool.page_size

    @property
    def mapped_bytes(self) -> int:
        vm = self._vm
        return vm.mapped_bytes if vm is not None else 0

    @property
    def live_bytes(self) -> int:
        return self.n_tokens * self.token_bytes

    @property
    def capacity(self) -> int:
        """Positions backed by mapped pages (what the ops may read and write)."""
        if self.state is not RegionState.ACTIVE:
            return 0
        return min(self.max_tokens, self.mapped_bytes // self.token_bytes)

    @property
    def memory(self) -> TrackedRange:
        """The mapped part of the range, for device copies. Tracked like a view: while a
        copy queued on a cpu stream holds it, the region is not unmapped under it."""
        with self._lock:
            self._require(RegionState.ACTIVE, "address")
            return self._views.range(self.base_ptr, self.mapped_bytes)

    # -- growth ----------------------------------------------------------------------

    def ensure(self, n_tokens: int, ahead: int = 0) -> int:
        """Map pages so positions `0 .. n_tokens + ahead - 1` are backed, and count
        `n_tokens` as live. Returns how many pages were mapped now. All or nothing: on
        OutOfPages nothing is mapped and the region is as it was."""
        if not 0 <= n_tokens <= self.max_tokens:
            raise ValueError(f"{n_tokens} tokens asked of a region of at most "
                             f"{self.max_tokens}")
        with self._lock:
            self._require(RegionState.ACTIVE, "grow")
            added = self._map_pages(self._pages_for(min(n_tokens + ahead, self.max_tokens)))
            self.n_tokens = max(self.n_tokens, n_tokens)
            return added

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens * self.token_bytes // self.pool.page_size)

    def _map_pages(self, n_pages: int) -> int:
        """Grow the mapping to `n_pages` pages from the start of the range (lock held)."""
        vm = self._vm
        assert vm is not None
        ps = self.pool.page_size
        have = vm.mapped_bytes // ps
        if n_pages <= have:
            return 0
        pages = self.pool.take(n_pages - have)
        try:
            for i, page in enumerate(pages):
                vm.map((have + i) * ps, page)
        except BaseException:
            for off in sorted(vm.mapped, reverse=True):
                if off >= have * ps:
                    vm.unmap(off)
            self.pool.give_back(pages)
            raise
        self._tokens_view = None
        return len(pages)

    # -- views -----------------------------------------------------------------------

    def tokens(self, layout: KVLayout | None = None) -> np.ndarray:
        """The mapped positions as `[capacity, n_layers, 2, n_kv_heads, head_dim]` (host);
        with `layout`, another model's part of a shared cache (KVLayout.shared_with)."""
        with self._lock:
            self._require(RegionState.ACTIVE, "view")
            if not self.pool.device.host_accessible:
                raise TypeError(f"the KV of a {self.pool.device.kind} region is in device "
                                "memory: use k_view / v_view")
            if layout is not None and layout != self.layout:
                self._check_shared(layout)
                buf = self._views.array(self.base_ptr, self.mapped_bytes)
                return layout.view(buf)[: self.capacity]
            view = self._tokens_view
            if view is None:
                buf = self._views.array(self.base_ptr, self.mapped_bytes)
                view = self._tokens_view = self.layout.view(buf)[: self.capacity]
            return view

    def _check_shared(self, layout: KVLayout) -> None:
        if layout.token_bytes != self.token_bytes:
            raise ValueError(f"a layout of {layout.token_bytes} bytes per token cannot view "
                             f"a region of {self.token_bytes}")

    def k(self, layer: int) -> np.ndarray:
        """Layer `layer`'s keys `[capacity, n_kv_heads, head_dim]`, position p at index p."""
        return self.tokens()[:, layer, 0]

    def v(self, layer: int) -> np.ndarray:
        return self.tokens()[:, layer, 1]

    def k_view(self, layer: int, layout: KVLayout | None = None) -> StridedView:
        return self._layer_view(layer, 0, layout)

    def v_view(self, layer: int, layout: KVLayout | None = None) -> StridedView:
        return self._layer_view(layer, 1, layout)

    def _layer_view(self, layer: int, kv: int, layout: KVLayout | None = None) -> StridedView:
        self._require(RegionState.ACTIVE, "view")
        lay = self.layout if layout is None else layout
        if layout is not None:
            self._check_shared(layout)
        if not 0 <= layer < lay.n_layers:
            raise IndexError(f"layer {layer} of {lay.n_layers}")
        item = lay.dtype.itemsize
        head = lay.head_dim * item
        ptr = self.base_ptr + lay.offset + (layer * 2 + kv) * lay.n_kv_heads * head
        return StridedView(ptr, (self.capacity, lay.n_kv_heads, lay.head_dim),
                           (self.token_bytes, head, item), lay.dtype)

    def part(self, layout: KVLayout) -> RegionPart:
        """Another model's part of this region's cache (a draft model's KV beside its
        target's: `KVLayout.shared_with`), viewed as a session's KV of its own."""
        self._check_shared(layout)
        return RegionPart(self, layout)

    # -- release ---------------------------------------------------------------------

    def release(self, after: Event | None = None) -> None:
        """Give the region back. With `after`, the pages return to the pool (on a later
        `pool.reclaim()`) only once that event, recorded after the last work touching them,
        has completed. Without it, now: raises ViewsAlive (and changes nothing) while numpy
        views of the region are referenced."""
        with self._lock:
            if self.state in (RegionState.RELEASING, RegionState.RELEASED):
                raise RegionStateError(f"region already {self.state.value}")
            if after is None or self.state is RegionState.SWAPPED:
                self._check_no_views("release")
                self._finish_release()
            else:
                self._tokens_view = None
                self.state = RegionState.RELEASING
                self.pool._defer(self, after)

    def _finish_release(self) -> None:
        """Unmap everything, return pages and the vacant reservation (lock held, no views)."""
        self._tokens_view = None
        vm, self._vm = self._vm, None
        if vm is None:
            return
        self.pool.give_back(vm.unmap_all())
        self.pool._retire(self, vm)
        if self._swap is not None:
            self._swap.free()
            self._swap = None
        self.state = RegionState.RELEASED
        self.n_tokens = 0

    # -- prefix sharing --------------------------------------------------------------

    def share_prefix_from(self, other: KVRegion, n_tokens: int,
                          stream: Stream | None = None) -> int:
        """Start this (empty) region with the first `n_tokens` positions of `other`.

        The pages wholly inside the prefix are mapped here too (the same physical pages,
        reference-counted); the partial last page is copied into a page of our own, since
        both sessions will write past the prefix there. Neither session ever writes into a
        shared page: every position either writes is at or past `n_tokens`. The copy runs on
        `stream` (ordered after work already enqueued there, e.g. the round that wrote the
        prefix), or when None on the pool's stream, waited for. Returns the pages shared.
        """
        ps = self.pool.page_size
        full, partial = divmod(n_tokens * self.token_bytes, ps)
        with self._lock:
            self._require(RegionState.ACTIVE, "share into")
            other._require(RegionState.ACTIVE, "share from")
            if self.n_pages or self.n_tokens:
                raise RegionStateError("prefix sharing needs a fresh, empty region")
            if other.layout != self.layout:
                raise ValueError("regions of different KV layouts cannot share pages")
            if not 0 <= n_tokens <= min(other.n_tokens, self.max_tokens):
                raise ValueError(f"cannot share {n_tokens} tokens: the source holds "
                                 f"{other.n_tokens}, this region at most {self.max_tokens}")
            vm, src = self._vm, other._vm
            assert vm is not None and src is not None
            own = self.pool.take(1) if partial else []  # OutOfPages here changes nothing
            try:
                for i in range(full):
                    vm.map(i * ps, src.mapped[i * ps])
                if partial:
                    vm.map(full * ps, own[0])
            except BaseException:  # a driver failure part-way: undo what was mapped
                unmapped = vm.unmap_all()
                self.pool.give_back(unmapped + [p for p in own if p not in unmapped])
                raise
            self._tokens_view = None
            self.n_tokens = n_tokens
            s = stream if stream is not None else self.pool.stream
            if partial:
                s.copy_d2d(self.memory, other.memory, partial, full * ps, full * ps)
        if partial and stream is None:
            s.synchronize()
        return full

    # -- swapping --------------------------------------------------------------------

    def swap_out(self, stream: Stream | None = None, after: Event | None = None) -> None:
        """Copy the live KV to host memory and give the pages back (preemption).

        The copy waits for `after` (the last round touching the region) and completes before
        any page is unmapped. The base address stays reserved, so `swap_in` restores the
        session at the same address, bit-exact. Raises ViewsAlive, changing nothing, while
        numpy views of the region are referenced."""
        with self._lock:
            self._require(RegionState.ACTIVE, "swap out")
            self._check_no_views("swap out")
            nbytes = self.live_bytes
            memory = self.memory
        host = self.pool.device.alloc_host(nbytes)
        s = stream if stream is not None else self.pool.stream
        try:
            if after is not None:
                s.wait_event(after)
            s.copy_d2h(host, memory, nbytes)
            del memory
            s.synchronize()  # not under the lock: the work waited for may take views
            with self._lock:
                self._check_no_views("swap out")
                vm = self._vm
                assert vm is not None
                self.pool.give_back(vm.unmap_all())
                self._swap = host
                self.state = RegionState.SWAPPED
        except BaseException:
            host.free()
            raise

    def swap_in(self, stream: Stream | None = None) -> None:
        """Map pages again and copy the swapped KV back. OutOfPages leaves it swapped."""
        with self._lock:
            self._require(RegionState.SWAPPED, "swap in")
            host = self._swap
            assert host is not None
            self._map_pages(self._pages_for(self.n_tokens))
            memory = self._views.range(self.base_ptr, self.mapped_bytes)
        s = stream if stream is not None else self.pool.stream
        try:
            s.copy_h2d(memory, host, host.nbytes)
            del memory
            s.synchronize()
        except BaseException:
            with self._lock:
                vm = self._vm
                assert vm is not None
                self.pool.give_back(vm.unmap_all())
            raise
        with self._lock:
            host.free()
            self._swap = None
            self.state = RegionState.ACTIVE

    # -- helpers ---------------------------------------------------------------------

    def _views_alive(self) -> int:
        """How many ranges of this region are still referenced (our own view dropped)."""
        self._tokens_view = None
        return self._views.alive()

    def _check_no_views(self, action: str) -> None:
        self._tokens_view = None
        self._views.check_released(action)

    def _require(self, state: RegionState, action: str) -> None:
        if self.state is not state:
            raise RegionStateError(f"cannot {action} a {self.state.value} KV region "
                                   f"(needs {state.value})")

    def __repr__(self) -> str:
        return (f"KVRegion({self.state.value}, {self.n_tokens}/{self.max_tokens} tokens, "
                f"{self.n_pages} pages at {self.base_ptr:#x})")


class RegionPart:
    """A region's cache as another model sharing it sees it (`KVRegion.part`): the same
    positions, pages and lifetime, that model's layers (the `SessionKV` views on the
    host, `k_view` / `v_view` on cuda)."""

    def __init__(self, region: KVRegion, layout: KVLayout) -> None:
        self.region = region
        self.layout = layout

    @property
    def capacity(self) -> int:
        return self.region.capacity

    def tokens(self) -> np.ndarray:
        return self.region.tokens(self.layout)

    def k(self, layer: int) -> np.ndarray:
        return self.tokens()[:, layer, 0]

    def v(self, layer: int) -> np.ndarray:
        return self.tokens()[:, layer, 1]

    def k_view(self, layer: int) -> StridedView:
        return self.region.k_view(layer, self.layout)

    def v_view(self, layer: int) -> StridedView:
        return self.region.v_view(layer, self.layout)
