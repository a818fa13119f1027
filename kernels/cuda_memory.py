"""Memory of the cuda ops: device memory in stream order and the pinned ring host data
goes up through.

Every op returns a fresh tensor from the stream-ordered allocator (cuMemAllocAsync on the
compute stream, the pool keeping freed memory for reuse); when the last Python reference to
it goes, its memory is freed in stream order after the work already enqueued. During a
stream capture (kernels/cuda_graphs.py) a free of memory from before the capture is held
back until the capture ends: a captured free may only free the capture's own memory.

Host data (token ids, positions, per-session descriptors, sampler tables) goes up through
a pinned staging ring: a copy from pageable memory would synchronize the stream and undo
the eager dispatch.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eagerlm.kernels.device_tensor import DeviceTensor
from eagerlm.vmm.cuda_driver import cu, driver
from eagerlm.vmm.device import Event, HostBuffer

if TYPE_CHECKING:
    from eagerlm.kernels.cuda_ops import CudaOps


class StreamAllocator:
    """cuMemAllocAsync / cuMemFreeAsync on the ops' stream, and the frees held back while a
    capture of that stream is under way (see `capturing`)."""

    def __init__(self, ops: CudaOps) -> None:
        self.ops = ops  # its context and stream; its to_numpy downloads a tensor
        self.lock = threading.RLock()  # RLock: a __del__ may run while held
        self.in_capture = False
        self.deferred_frees: list[int] = []

    def alloc(self, nbytes: int) -> Allocation:
        return Allocation(self, nbytes)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a capture of the ops' stream. A free captured into a graph may only free
        memory the capture itself allocated: anything else fails and invalidates the
        capture on a GPU. So a tensor from before the capture whose last reference goes
        away meanwhile (a garbage-collected cycle, another thread dropping it) is freed
        once the capture has ended, and no garbage collection runs inside it."""
        gc_enabled = gc.isenabled()
        gc.disable()
        with self.lock:
            self.in_capture = True
        try:
            yield
        finally:
            with self.lock:
                self.in_capture = False
                deferred, self.deferred_frees = self.deferred_frees, []
            if gc_enabled:
                gc.enable()
            for ptr in deferred:
                self.free(ptr)

    def defer_free(self, ptr: int) -> bool:
        """Keep `ptr` for the end of the capture under way, if one is (see `capturing`)."""
        with self.lock:
            if self.in_capture:
                self.deferred_frees.append(ptr)
            return self.in_capture

    def free(self, ptr: int) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown, dead context
            self.ops.ctx.bind()
            cu("cuMemFreeAsync", driver().CUdeviceptr(ptr), self.ops.stream.handle)


class Allocation:
    """Stream-ordered device memory: freed on its stream, after the work enqueued before
    the last reference went away. One from before a stream capture whose last reference
    goes away during it is freed after the capture (see `StreamAllocator.capturing`)."""

    __slots__ = ("__weakref__", "allocator", "captured", "nbytes", "ptr")

    def __init__(self, allocator: StreamAllocator, nbytes: int) -> None:
        self.allocator = allocator
        self.nbytes = nbytes
        self.captured = allocator.in_capture  # the capture's own: freed inside it, as CUDA asks
        ops = allocator.ops
        ops.ctx.bind()
        self.ptr = int(cu("cuMemAllocAsync", max(nbytes, 1), ops.stream.handle))

    def download(self, t: DeviceTensor) -> np.ndarray:
        return self.allocator.ops.to_numpy(t)

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        with contextlib.suppress(Exception):  # interpreter shutdown
            if not self.captured and self.allocator.defer_free(ptr):
                return
            ctx = self.allocator.ops.ctx
            if not ctx.released:
                with ctx.visiting():
                    self.allocator.free(ptr)


class StagingRing:
    """Pinned host memory for small uploads, reused in ring order: a region is rewritten
    only after the event of the copy that last read it has completed."""

    def __init__(self, ops: CudaOps, nbytes: int = 8 << 20) -> None:
        self.ops = ops
        self.buf: HostBuffer = ops.device.alloc_host(nbytes)
        self.size = nbytes
        self.head = 0
        self.in_flight: collections.deque[tuple[int, int, Event]] = collections.deque()
        self.lock = threading.Lock()

    def upload(self, data: np.ndarray, out: DeviceTensor) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        n = raw.size
        if n == 0:
            return
        if n > self.size:  # rare: a one-off pinned buffer, freed once its copy is done
            host = self.ops.device.alloc_host(n)
            host.array[:n] = raw
            self.ops.stream.copy_h2d(_Mem(out.ptr, n), host, n)
            self.ops.stream.synchronize()
            host.free()
            return
        with self.lock:
            wrap = self.head + n > self.size
            start = 0 if wrap else self.head
            end = start + (n + 255) // 256 * 256
            # The in-flight copies are queued in ring order from `head` on: those at or past
            # head (the previous lap's) are the oldest. Wrapping skips the tail [head, size),
            # so its copies must leave the queue first, or the check below would stop at one
            # of them and miss a newer copy at the front of the ring that the write overlaps.
            while self.in_flight and ((wrap and self.in_flight[0][0] >= self.head) or (
                    self.in_flight[0][0] < end and start < self.in_flight[0][1])):
                self.in_flight.popleft()[2].synchronize()
            self.buf.array[start:start + n] = raw
            self.ops.stream.copy_h2d(_Mem(out.ptr, n), self.buf, n, src_offset=start)
            ev = self.ops.stream.record(self.ops.device.event(timing=False))
            self.in_flight.append((start, min(end, self.size), ev))
            self.head = min(end, self.size)


@dataclass(frozen=True)
class _Mem:
    ptr: int
    nbytes: int
