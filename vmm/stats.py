"""What the page pool reports: page accounting, live versus mapped bytes, map latency.

The numbers a scheduler and an operator need to see whether paging pays: how full the pool
is, how much of what is mapped holds live KV (the token-major layout promises less than one
page of waste per session), and what mapping costs on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Latency:
    """Running count, total and worst case of one operation's duration."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def record(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    @property
    def mean_us(self) -> float:
        return 1e6 * self.total_s / self.count if self.count else 0.0


@dataclass
class MapLatency:
    """Latency of mapping and unmapping pages into virtual ranges, shared by a pool's ranges."""

    map: Latency = field(default_factory=Latency)
    unmap: Latency = field(default_factory=Latency)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a page pool. Every page is either free or mapped:
    `pages_free + pages_mapped == pages_total` always (a leak breaks it)."""

    page_size: int
    pages_total: int
    pages_free: int
    pages_mapped: int  # distinct pages mapped into at least one region
    pages_shared: int  # mapped into two or more regions (prefix sharing)
    pages_pending: int  # mapped only by released regions waiting for their event
    regions_active: int
    regions_swapped: int
    regions_pending: int
    reservations_total: int  # virtual ranges reserved, in use or recycled
    reservations_free: int
    live_kv_bytes: int  # tokens held by active regions times bytes per token
    mapped_bytes: int  # bytes of active regions backed by pages (a shared page counts per map)
    swapped_bytes: int  # KV bytes held in host memory by swapped-out regions
    map_mean_us: float
    map_max_us: float
    unmap_mean_us: float
    unmap_max_us: float
    maps: int
    unmaps: int

    @property
    def live_fraction(self) -> float:
        """Live KV bytes per mapped byte: 1.0 is no waste."""
        return self.live_kv_bytes / self.mapped_bytes if self.mapped_bytes else 1.0
