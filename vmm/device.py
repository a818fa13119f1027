"""The device interface everything above the ops talks to, and `open_device`.

Two implementations: `cuda` (the CUDA driver through cuda-python) and `cpu` (numpy, with a
worker thread per stream). The dispatcher, the page pool and the loader are written once
against this interface, so on a machine without a GPU they still run for real and
asynchronously, and the test suite exercises them there.

Memory is addressed by plain integers (`ptr`): device pointers on cuda, host addresses on
cpu. A copy names its source and destination as `Memory` objects (anything with `ptr` and
`nbytes`) so ranges are bounds-checked before anything is enqueued.

Lifetimes follow CUDA's rules: memory a copy reads or writes must stay allocated and mapped
until an event recorded after the copy has completed. The KV page pool enforces this for its
pages (deferred reclamation); numpy views over raw memory are tracked so that freeing while a
view lives raises instead of crashing (see `host_views`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from eagerlm.errors import InvalidParameters

if TYPE_CHECKING:
    from eagerlm.vmm.phymem import PhyMem
    from eagerlm.vmm.stats import MapLatency
    from eagerlm.vmm.virmem import VirMem


class Memory(Protocol):
    """Anything a copy can read or write: an address and a size in bytes."""

    @property
    def ptr(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class MemoryRange:
    """A plain address range, e.g. the mapped part of a KV region."""

    ptr: int
    nbytes: int


class StreamError(RuntimeError):
    """Work enqueued on a stream failed; the stream (like a CUDA context) stays failed."""


class Event(ABC):
    """A point in a stream's work. Complete once the stream has run everything enqueued
    before it was recorded; an event never recorded counts as complete (as in CUDA)."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the event has completed, without blocking."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until the event has completed."""

    @abstractmethod
    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end`, both completed and timed."""


class Gate(ABC):
    """A barrier enqueued on a stream: work behind it waits until `open()`.

    Lets tests and benchmarks hold a stream at a known point (to check that something waits
    for an event) on both backends.
    """

    @abstractmethod
    def open(self) -> None: ...


class Stream(ABC):
    """An in-order queue of device work."""

    @abstractmethod
    def record(self, event: Event | None = None) -> Event:
        """Record `event` (a new one when None) after the work enqueued so far; return it."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work enqueued after this call waits for `event` to complete."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all enqueued work has run; raise StreamError if any failed."""

    @abstractmethod
    def gate(self) -> Gate:
        """Enqueue a closed gate (see Gate)."""

    @abstractmethod
    def launch(self, work: Callable[[], object]) -> None:
        """Run `work`, the host side of some device work, in this stream's order.

        On cuda `work` runs now and enqueues kernels on this stream; on cpu it *is* the
        computation and runs later on the stream's thread. Either way it is ordered after
        everything enqueued before and the caller does not wait for it."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _copy(self, kind: str, dst: int, src: int, nbytes: int,
              keep: tuple[Memory, Memory]) -> None:
        """Enqueue a copy of `nbytes` from address `src` to `dst`; kind is h2d, d2h or d2d."""

    def copy_h2d(self, dst: Memory, src: Memory, nbytes: int | None = None,
                 dst_offset: int = 0, src_offset: int = 0) -> None:
        """Asynchronously copy host memory into device memory."""
        self._checked_copy("h2d", dst, src, nbytes, dst_offset, src_offset)

    def copy_d2h(self, dst: Memory, src: Memory, nbytes: int | None = None,
                 dst_offset: int = 0, src_offset: int = 0) -> None:
        """Asynchronously copy device memory into host memory."""
        self._checked_copy("d2h", dst, src, nbytes, dst_offset, src_offset)

    def copy_d2d(self, dst: Memory, src: Memory, nbytes: int | None = None,
                 dst_offset: int = 0, src_offset: int = 0) -> None:
        """Asynchronously copy device memory to device memory."""
        self._checked_copy("d2d", dst, src, nbytes, dst_offset, src_offset)

    def _checked_copy(self, kind: str, dst: Memory, src: Memory, nbytes: int | None,
                      dst_offset: int, src_offset: int) -> None:
        n = min(dst.nbytes - dst_offset, src.nbytes - src_offset) if nbytes is None else nbytes
        for what, mem, off in (("destination", dst, dst_offset), ("source", src, src_offset)):
            if off < 0 or n < 0 or off + n > mem.nbytes:
                raise ValueError(f"copy_{kind}: {what} range [{off}, {off + n}) is outside "
                                 f"its {mem.nbytes} bytes")
        if n:
            self._copy(kind, dst.ptr + dst_offset, src.ptr + src_offset, n, (dst, src))


class DeviceBuffer(ABC):
    """Device memory from `Device.alloc`."""

    ptr: int
    nbytes: int

    @abstractmethod
    def free(self) -> None: ...


class HostBuffer(ABC):
    """Host memory the device copies to and from asynchronously (pinned on cuda)."""

    ptr: int
    nbytes: int

    @property
    @abstractmethod
    def array(self) -> np.ndarray:
        """The buffer as a uint8 numpy array."""

    @abstractmethod
    def free(self) -> None:
        """Give the memory back; raises ViewsAlive while views of `array` are referenced."""


class Device(ABC):
    """One accelerator (or the host standing in for one)."""

    kind: str  # "cpu" or "cuda"
    name: str
    page_size: int  # bytes of one physical KV page
    host_accessible: bool  # whether device memory can be read as numpy arrays

    @abstractmethod
    def alloc(self, nbytes: int) -> DeviceBuffer: ...

    @abstractmethod
    def alloc_host(self, nbytes: int) -> HostBuffer: ...

    @abstractmethod
    def stream(self, name: str = "stream") -> Stream: ...

    @abstractmethod
    def event(self, timing: bool = True) -> Event: ...

    @abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""

    @abstractmethod
    def alloc_pages(self, n_pages: int) -> list[PhyMem]:
        """`n_pages` physical pages of `page_size` bytes each."""

    @abstractmethod
    def reserve(self, nbytes: int, latency: MapLatency | None = None) -> VirMem:
        """Reserve a virtual range of `nbytes` (a multiple of `page_size`) with nothing mapped."""

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_device(spec: str = "cpu", *, page_size: int | None = None) -> Device:
    """Open "cpu", "cuda" or "cuda:N".

    On cpu, `page_size` sets the KV page size (default 2 MiB). On cuda the page size is the
    driver's allocation granularity, or `page_size` when given and a multiple of it. Raises
    NoCudaDevice (from `vmm.cuda_driver`) when cuda is asked for and there is none.
    """
    kind, _, index = spec.partition(":")
    if kind == "cpu" and not index:
        from eagerlm.vmm.cpu_device import CpuDevice

        return CpuDevice() if page_size is None else CpuDevice(page_size=page_size)
    if kind == "cuda":
        from eagerlm.vmm.cuda_device import CudaDevice

        return CudaDevice(int(index or 0), page_size=page_size)
    raise InvalidParameters(f"unknown device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'")
