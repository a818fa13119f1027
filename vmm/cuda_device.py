"""The cuda device: the CUDA driver's memory, streams, events and copies via cuda-python.

Every driver call goes through `vmm.cuda_driver.cu` (checked, naming the call on failure)
after binding the device's primary context to the calling thread. Host buffers are pinned
(cuMemHostAlloc) so copies are truly asynchronous; their numpy views are tracked so freeing
one while a view lives raises instead of leaving a dangling array.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from eagerlm.vmm.cuda_driver import CudaContext, CudaError, cu, driver, error_name
from eagerlm.vmm.device import Device, DeviceBuffer, Event, Gate, HostBuffer, Memory, Stream
from eagerlm.vmm.host_views import HostViews
from eagerlm.vmm.phymem import CudaPhyMem, cuda_pages
from eagerlm.vmm.stats import MapLatency
from eagerlm.vmm.virmem import CudaVirMem


def _dptr(addr: int) -> Any:
    return driver().CUdeviceptr(addr)


class CudaEvent(Event):
    def __init__(self, ctx: CudaContext, timing: bool = True) -> None:
        d = driver()
        ctx.bind()
        flags = d.CUevent_flags.CU_EVENT_DEFAULT if timing else \
            d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.ctx = ctx
        self.timing = timing
        self.handle: Any = cu("cuEventCreate", int(flags))

    def query(self) -> bool:
        d = driver()
        self.ctx.bind()
        (err,) = d.cuEventQuery(self.handle)
        if err == d.CUresult.CUDA_SUCCESS:
            return True
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise CudaError("cuEventQuery", int(err), error_name(err))

    def synchronize(self) -> None:
        self.ctx.bind()
        cu("cuEventSynchronize", self.handle)

    def elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, CudaEvent)
        self.ctx.bind()
        return float(cu("cuEventElapsedTime", self.handle, end.handle))

    def destroy(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None and not self.ctx.released:
            # (after the context is gone its handle values may be reused: leave them be)
            self.ctx.bind()
            cu("cuEventDestroy", handle)

    def __del__(self) -> None:
        # At interpreter shutdown or with a dead context there is nothing useful to do.
        with contextlib.suppress(Exception), self.ctx.visiting():
            self.destroy()


class CudaGate(Gate):
    """A pinned, device-mapped word the stream waits on (cuStreamWaitValue32 >= 1)."""

    def __init__(self, ctx: CudaContext, stream: Any) -> None:
        d = driver()
        ctx.bind()
        self.ctx = ctx
        flags = d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE
        self._word = int(cu("cuMemHostAlloc", 4, flags))
        ctypes.c_uint32.from_address(self._word).value = 0
        dev_word = cu("cuMemHostGetDevicePointer", self._word, 0)
        cu("cuStreamWaitValue32", stream, dev_word, d.cuuint32_t(1),
           int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))

    def open(self) -> None:
        if self._word:
            ctypes.c_uint32.from_address(self._word).value = 1

    def free(self) -> None:
        """After the stream has passed the gate."""
        word, self._word = self._word, 0
        if word:
            self.ctx.bind()
            cu("cuMemFreeHost", word)


class CudaStream(Stream):
    def __init__(self, ctx: CudaContext, name: str = "stream") -> None:
        d = driver()
        ctx.bind()
        self.ctx = ctx
        self.name = name
        self.handle: Any = cu("cuStreamCreate", int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._gates: list[CudaGate] = []

    def record(self, event: Event | None = None) -> Event:
        ev = CudaEvent(self.ctx) if event is None else event
        assert isinstance(ev, CudaEvent)
        self.ctx.bind()
        cu("cuEventRecord", ev.handle, self.handle)
        return ev

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        self.ctx.bind()
        cu("cuStreamWaitEvent", self.handle, event.handle, 0)

    def synchronize(self) -> None:
        self.ctx.bind()
        cu("cuStreamSynchronize", self.handle)

    def launch(self, work: Callable[[], object]) -> None:
        """The host side of the work enqueues its kernels on this stream, now."""
        work()

    def gate(self) -> Gate:
        g = CudaGate(self.ctx, self.handle)
        self._gates.append(g)
        return g

    def _copy(self, kind: str, dst: int, src: int, nbytes: int,
              keep: tuple[Memory, Memory]) -> None:
        self.ctx.bind()
        if kind == "h2d":
            cu("cuMemcpyHtoDAsync", _dptr(dst), src, nbytes, self.handle)
        elif kind == "d2h":
            cu("cuMemcpyDtoHAsync", dst, _dptr(src), nbytes, self.handle)
        else:
            cu("cuMemcpyDtoDAsync", _dptr(dst), _dptr(src), nbytes, self.handle)

    def close(self) -> None:
        if self.handle is None:
            return
        for g in self._gates:
            g.open()
        self.synchronize()
        for g in self._gates:
            g.free()
        self._gates.clear()
        handle, self.handle = self.handle, None
        cu("cuStreamDestroy", handle)


class CudaDeviceBuffer(DeviceBuffer):
    def __init__(self, ctx: CudaContext, nbytes: int) -> None:
        ctx.bind()
        self.ctx = ctx
        self.nbytes = nbytes
        self.ptr = int(cu("cuMemAlloc", nbytes)) if nbytes else 0

    def free(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            self.ctx.bind()
            cu("cuMemFree", _dptr(ptr))


class CudaHostBuffer(HostBuffer):
    """Pinned host memory (cuMemHostAlloc, portable across contexts)."""

    def __init__(self, ctx: CudaContext, nbytes: int) -> None:
        ctx.bind()
        self.ctx = ctx
        self.nbytes = nbytes
        self.ptr = int(cu("cuMemHostAlloc", max(nbytes, 1), driver().CU_MEMHOSTALLOC_PORTABLE))
        self._views = HostViews("pinned host buffer")

    @property
    def array(self) -> np.ndarray:
        if not self.ptr:
            raise RuntimeError("buffer already freed")
        return self._views.array(self.ptr, self.nbytes)

    def free(self) -> None:
        if self.ptr:
            self._views.check_released("free")
            ptr, self.ptr = self.ptr, 0
            self.ctx.bind()
            cu("cuMemFreeHost", ptr)


class CudaDevice(Device):
    """One CUDA GPU through its primary context."""

    kind = "cuda"
    host_accessible = False

    def __init__(self, ordinal: int = 0, page_size: int | None = None) -> None:
        self.ctx = CudaContext(ordinal)
        granularity = self.ctx.granularity
        if page_size is not None and (page_size <= 0 or page_size % granularity):
            raise ValueError(f"page size {page_size} is not a multiple of the allocation "
                             f"granularity {granularity}")
        self.page_size = granularity if page_size is None else page_size
        self.name = f"cuda:{ordinal} ({self.ctx.name})"
        self._streams: list[CudaStream] = []
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> CudaDeviceBuffer:
        return CudaDeviceBuffer(self.ctx, nbytes)

    def alloc_host(self, nbytes: int) -> CudaHostBuffer:
        return CudaHostBuffer(self.ctx, nbytes)

    def stream(self, name: str = "stream") -> CudaStream:
        s = CudaStream(self.ctx, name)
        with self._lock:
            self._streams.append(s)
        return s

    def event(self, timing: bool = True) -> CudaEvent:
        return CudaEvent(self.ctx, timing)

    def mem_info(self) -> tuple[int, int]:
        self.ctx.bind()
        free, total = cu("cuMemGetInfo")
        return int(free), int(total)

    def alloc_pages(self, n_pages: int) -> list[CudaPhyMem]:
        return cuda_pages(self.ctx, n_pages, self.page_size)

    def reserve(self, nbytes: int, latency: MapLatency | None = None) -> CudaVirMem:
        return CudaVirMem(self.ctx, nbytes, self.page_size, latency)

    def synchronize(self) -> None:
        self.ctx.bind()
        cu("cuCtxSynchronize")

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for s in streams:
            s.close()
        self.ctx.release()
