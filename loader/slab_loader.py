"""The pinned slab weight loader (the seed design): the GGUF file's bytes to device weights
with the host link kept busy.

For each tensor, in the order `build_weights` asks for them:

1. take a pinned staging buffer of the tensor's size from the slab (`SizePool`): a buffer of
   that size whose last upload has completed is reused; otherwise one is allocated;
2. copy the raw GGUF bytes (quantized blocks as they are) into it; this CPU work overlaps
   the DMA of the previous tensors, which is still in flight;
3. enqueue the upload (an asynchronous host-to-device copy) on the loader's stream, then
   the backend's expansion of the raw bytes into the weight (dequantization on the GPU),
   unless the bytes already are the weight (bf16 matrices, float32 vectors on cuda);
4. record an event; the staging buffer (and the device scratch holding the raw bytes)
   goes back to the slab when that event has completed.

Sizes that occur rarely (fewer than `min_repeats` tensors of the file have them: the
embedding, the lm head) are not pooled: their buffers are freed once their upload is done,
so one huge buffer does not sit in pinned memory for the rest of the load. The slab's
pinned bytes are bounded by `budget_bytes`: past it, `take` waits for the oldest upload.

The loader is written against the device interface (vmm/device.py), so the same code runs
on the cpu device (tests/test_slab_loader.py) with a host expander.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from eagerlm.loader.gguf_file import GGUFFile, TensorInfo
from eagerlm.vmm.device import Device, DeviceBuffer, Event, HostBuffer, Memory, Stream

T = TypeVar("T")
B = TypeVar("B", HostBuffer, DeviceBuffer)

DEFAULT_BUDGET = 512 << 20
DEFAULT_MIN_REPEATS = 2


class WeightBuilder(Protocol[T]):
    """The backend's part of loading: what a tensor of the file becomes on the device."""

    def is_final(self, info: TensorInfo) -> bool:
        """Whether the file's bytes are already the weight, so they are uploaded straight
        into the weight's own buffer."""

    def wrap(self, buffer: DeviceBuffer, info: TensorInfo) -> T:
        """The handle of a weight uploaded as it is (is_final) into `buffer`."""

    def expand(self, stream: Stream, raw: Memory, info: TensorInfo) -> T:
        """Enqueue on `stream` the expansion of `raw` (the tensor's file bytes, in device
        memory, valid until the work enqueued now has run) into a new weight; return it."""


@dataclass
class PoolStats:
    allocs: int = 0  # buffers allocated
    reuses: int = 0  # takes served by a recycled buffer
    unpooled: int = 0  # one-off buffers for rare sizes
    waits: int = 0  # takes that waited for an upload to finish
    peak_bytes: int = 0


class SizePool(Generic[B]):
    """Buffers reused by size, recycled when the event of their last use completes.

    `pooled(size)` says which sizes are kept for reuse; others are freed once their event
    completes. At most `budget_bytes` are held (in use, in flight or free) when waiting for
    uploads can keep it so; a single buffer larger than the budget is still allowed.
    """

    def __init__(self, alloc: Callable[[int], B], pooled: Callable[[int], bool],
                 budget_bytes: int) -> None:
        self._alloc = alloc
        self._pooled = pooled
        self.budget_bytes = budget_bytes
        self.free: dict[int, list[B]] = collections.defaultdict(list)
        self.in_flight: collections.deque[tuple[Event, B]] = collections.deque()
        self.held_bytes = 0
        self.stats = PoolStats()

    def take(self, nbytes: int) -> B:
        self.collect()
        pooled = self._pooled(nbytes)
        while True:
            if pooled and self.free[nbytes]:
                self.stats.reuses += 1
                return self.free[nbytes].pop()
            if self.held_bytes + nbytes <= self.budget_bytes:
                break
            if self.in_flight:  # wait for the oldest upload, then look again
                self.stats.waits += 1
                self.in_flight[0][0].synchronize()
                self.collect()
            elif not self._release_free(nbytes):
                break  # nothing left to give back: go over budget for this one
        buf = self._alloc(nbytes)
        self.held_bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes)
        if pooled:
            self.stats.allocs += 1
        else:
            self.stats.unpooled += 1
        return buf

    def give_back(self, buf: B, after: Event) -> None:
        """`buf` is free once `after` (recorded after its last use) completes."""
        self.in_flight.append((after, buf))

    def collect(self) -> int:
        """Recycle the buffers whose event has completed; returns how many. Events of one
        stream complete in order, so the scan stops at the first one still pending."""
        n = 0
        while self.in_flight and self.in_flight[0][0].query():
            _, buf = self.in_flight.popleft()
            size = buf.nbytes
            if self._pooled(size):
                self.free[size].append(buf)
            else:
                buf.free()
                self.held_bytes -= size
            n += 1
        return n

    def _release_free(self, keep_size: int) -> bool:
        """Free one idle buffer of another size to make room; False if there is none."""
        for size, bufs in self.free.items():
            if size != keep_size and bufs:
                bufs.pop().free()
                self.held_bytes -= size
                return True
        return False

    def close(self) -> None:
        """Wait for everything in flight and free every buffer."""
        while self.in_flight:
            ev, buf = self.in_flight.popleft()
            ev.synchronize()
            buf.free()
            self.held_bytes -= buf.nbytes
        for bufs in self.free.values():
            for buf in bufs:
                buf.free()
                self.held_bytes -= buf.nbytes
        self.free.clear()


@dataclass
class LoadStats:
    tensors: int = 0
    bytes: int = 0  # file bytes uploaded
    seconds: float = 0.0
    staging: PoolStats = field(default_factory=PoolStats)
    scratch: PoolStats = field(default_factory=PoolStats)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def report(self) -> str:
        st = self.staging
        return (f"loaded {self.tensors} tensors, {self.bytes / 1e9:.2f} GB in "
                f"{self.seconds:.2f} s ({self.gb_per_s:.2f} GB/s); pinned staging: "
                f"{st.allocs} buffers for {st.allocs + st.reuses} pooled tensors, "
                f"{st.unpooled} one-off, {st.waits} waits, peak {st.peak_bytes / 2**20:.0f} MiB")


class SlabLoader(Generic[T]):
    """Uploads the tensors of one GGUF file; `fetch` is the `build_weights` callback.

    `on_bytes(done, total)` is called as tensors are uploaded (bytes of the file's tensor
    data), from (0, total) on; tensors the architecture does not use are never uploaded, so
    the caller reports (total, total) once `build_weights` has returned."""

    def __init__(self, device: Device, gguf: GGUFFile, builder: WeightBuilder[T], *,
                 stream: Stream | None = None, budget_bytes: int = DEFAULT_BUDGET,
                 min_repeats: int = DEFAULT_MIN_REPEATS,
                 on_bytes: Callable[[int, int], None] | None = None) -> None:
        self.device = device
        self.gguf = gguf
        self.builder = builder
        self._own_stream = stream is None
        self.stream = stream if stream is not None else device.stream("loader")
        counts = collections.Counter(info.n_bytes for info in gguf.tensors.values())
        self.pooled_sizes = frozenset(s for s, c in counts.items() if c >= min_repeats)

        def pooled(n: int) -> bool:
            return n in self.pooled_sizes

        self.staging: SizePool[HostBuffer] = SizePool(device.alloc_host, pooled, budget_bytes)
        self.scratch: SizePool[DeviceBuffer] = SizePool(device.alloc, pooled, budget_bytes)
        self.total_bytes = sum(info.n_bytes for info in gguf.tensors.values())
        self.on_bytes = on_bytes
        self.stats = LoadStats(staging=self.staging.stats, scratch=self.scratch.stats)
        self._t0 = time.perf_counter()
        self._report()

    def _report(self) -> None:
        if self.on_bytes is not None:
            self.on_bytes(self.stats.bytes, self.total_bytes)

    def fetch(self, info: TensorInfo) -> T:
        n = info.n_bytes
        staging = self.staging.take(n)
        staging.array[:n] = self.gguf.tensor_bytes(info)
        s = self.stream
        raw: DeviceBuffer | None = None
        if self.builder.is_final(info):
            dst = self.device.alloc(n)
            s.copy_h2d(dst, staging, n)
            weight = self.builder.wrap(dst, info)
        else:
            raw = self.scratch.take(n)
            s.copy_h2d(raw, staging, n)
            weight = self.builder.expand(s, raw, info)
        done = s.record(self.device.event(timing=False))
        self.staging.give_back(staging, done)
        if raw is not None:
            self.scratch.give_back(raw, done)
        self.stats.tensors += 1
        self.stats.bytes += n
        self._report()
        return weight

    def finish(self) -> LoadStats:
        """Wait for every upload, free the slab, and return the statistics."""
        self.stream.synchronize()
        self.staging.close()
        self.scratch.close()
        self.stats.seconds = time.perf_counter() - self._t0
        if self._own_stream:
            self.stream.close()
        return self.stats
