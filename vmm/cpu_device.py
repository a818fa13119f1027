"""The cpu device: numpy memory, streams as worker threads, events set when reached.

A stream is a thread that owns a queue and runs what is enqueued strictly in order: host
work (the numpy ops), copies (real memmoves, run on the thread of the stream that enqueued
them), event records and event waits. So the asynchronous machinery above the device (the
eager dispatcher overlapping rounds, deferred page reclamation) runs for real without a GPU,
with the same ordering rules as CUDA streams. Like a CUDA context, a stream whose work raised
stays failed: later work is skipped, events still complete (nobody deadlocks) and report the
error, and `synchronize` raises it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eagerlm.vmm.device import (
    Device,
    DeviceBuffer,
    Event,
    Gate,
    HostBuffer,
    Memory,
    Stream,
    StreamError,
)
from eagerlm.vmm.phymem import HostPhyMem, host_pages
from eagerlm.vmm.stats import MapLatency
from eagerlm.vmm.virmem import HostVirMem


class CpuEvent(Event):
    """Recorded on a CpuStream; completes when the stream's thread reaches it.

    Each record arms a new generation, so re-recording an event refers to the latest record
    (as cuEventRecord does), and a stream waiting on it waits for the record current at the
    time of the wait.
    """

    def __init__(self, timing: bool = True) -> None:
        self.timing = timing
        self._cond = threading.Condition()
        self._recorded = 0
        self._reached = 0
        self._time_ns: int | None = None
        self._error: StreamError | None = None

    def _arm(self) -> int:
        with self._cond:
            self._recorded += 1
            self._time_ns = None
            return self._recorded

    def _reach(self, generation: int, error: StreamError | None) -> None:
        with self._cond:
            if generation > self._reached:
                self._reached = generation
                self._time_ns = time.perf_counter_ns()
                self._error = error
                self._cond.notify_all()

    def _wait_for(self, generation: int) -> StreamError | None:
        with self._cond:
            self._cond.wait_for(lambda: self._reached >= generation)
            return self._error

    def query(self) -> bool:
        with self._cond:
            done = self._reached >= self._recorded
            if done and self._error is not None:
                raise self._error
            return done

    def synchronize(self) -> None:
        with self._cond:
            generation = self._recorded
        error = self._wait_for(generation)
        if error is not None:
            raise error

    def elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, CpuEvent)
        if not (self.timing and end.timing):
            raise ValueError("elapsed_ms needs two events created with timing=True")
        if not (self.query() and end.query()) or self._time_ns is None or end._time_ns is None:
            raise RuntimeError("elapsed_ms: both events must be recorded and completed")
        return (end._time_ns - self._time_ns) / 1e6


class CpuGate(Gate):
    def __init__(self) -> None:
        self._opened = threading.Event()

    def open(self) -> None:
        self._opened.set()


@dataclass(frozen=True)
class _Record:
    event: CpuEvent
    generation: int


@dataclass(frozen=True)
class _Wait:
    event: CpuEvent
    generation: int


class CpuStream(Stream):
    """A worker thread running enqueued work in order."""

    def __init__(self, name: str = "stream") -> None:
        self.name = name
        self._work: queue.SimpleQueue[Callable[[], object] | _Record | _Wait | None] = (
            queue.SimpleQueue())
        self._error: StreamError | None = None
        self._gates: list[CpuGate] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"eagerlm-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> None:
        """Enqueue host work; it runs on this stream's thread after everything before it."""
        self._put(fn)

    def launch(self, work: Callable[[], object]) -> None:
        self.submit(work)

    def _put(self, item: Callable[[], object] | _Record | _Wait) -> None:
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        self._work.put(item)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            if isinstance(item, _Record):
                item.event._reach(item.generation, self._error)
            elif isinstance(item, _Wait):
                error = item.event._wait_for(item.generation)
                if error is not None and self._error is None:
                    self._error = error
            elif self._error is None:  # a failed stream runs no more work
                try:
                    item()
                except BaseException as exc:
                    self._error = StreamError(f"work on stream {self.name} failed: {exc!r}")
                    # without its traceback: the frames would keep the failed work's
                    # buffers (and numpy views of KV pages) alive
                    self._error.__cause__ = exc.with_traceback(None)
            item = None  # drop what the work held (buffers, KV ranges) before waiting again

    def record(self, event: Event | None = None) -> Event:
        ev = CpuEvent() if event is None else event
        assert isinstance(ev, CpuEvent)
        self._put(_Record(ev, ev._arm()))
        return ev

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CpuEvent)
        with event._cond:
            generation = event._recorded
        self._put(_Wait(event, generation))

    def synchronize(self) -> None:
        self.record(CpuEvent(timing=False)).synchronize()

    def gate(self) -> Gate:
        g = CpuGate()
        self._gates = [x for x in self._gates if not x._opened.is_set()]
        self._gates.append(g)
        self._put(g._opened.wait)
        return g

    def _copy(self, kind: str, dst: int, src: int, nbytes: int,
              keep: tuple[Memory, Memory]) -> None:
        def copy() -> None:
            _ = keep  # the closure holds both buffers until the copy has run
            ctypes.memmove(dst, src, nbytes)

        self._put(copy)

    def close(self) -> None:
        """Open any gate, let queued work finish, stop the thread."""
        if self._closed:
            return
        for g in self._gates:
            g.open()
        self._closed = True
        self._work.put(None)
        self._thread.join()


class HostArray(DeviceBuffer, HostBuffer):
    """Host memory owned by a numpy array: both "device" and "pinned host" memory on cpu.

    numpy owns the memory, so views of `array` keep it alive by themselves.
    """

    def __init__(self, nbytes: int) -> None:
        self._array: np.ndarray | None = np.zeros(nbytes, dtype=np.uint8)
        self.ptr = self._array.ctypes.data
        self.nbytes = nbytes

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise RuntimeError("buffer already freed")
        return self._array

    def free(self) -> None:
        self._array = None


class CpuDevice(Device):
    """The host standing in for a device; KV pages are memfd pages of `page_size` bytes."""

    kind = "cpu"
    host_accessible = True

    def __init__(self, page_size: int = 2 << 20) -> None:
        if page_size <= 0 or page_size % mmap.PAGESIZE:
            raise ValueError(f"page size {page_size} is not a multiple of the OS page size "
                             f"{mmap.PAGESIZE}")
        self.page_size = page_size
        self.name = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
        self._streams: list[CpuStream] = []
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> HostArray:
        return HostArray(nbytes)

    def alloc_host(self, nbytes: int) -> HostArray:
        return HostArray(nbytes)

    def stream(self, name: str = "stream") -> CpuStream:
        s = CpuStream(name)
        with self._lock:
            self._streams.append(s)
        return s

    def event(self, timing: bool = True) -> CpuEvent:
        return CpuEvent(timing)

    def mem_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def alloc_pages(self, n_pages: int) -> list[HostPhyMem]:
        return host_pages(n_pages, self.page_size)

    def reserve(self, nbytes: int, latency: MapLatency | None = None) -> HostVirMem:
        return HostVirMem(nbytes, self.page_size, latency)

    def synchronize(self) -> None:
        with self._lock:
            streams = [s for s in self._streams if not s._closed]
        for s in streams:
            s.synchronize()

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for s in streams:
            s.close()
