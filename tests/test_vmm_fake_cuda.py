"""The cuda backend's code run against a fake CUDA driver, on machines without a GPU.

The real cuda tests skip without a GPU, which would leave every line of `cuda_device`, the
cuda `PhyMem` / `VirMem` and `cuda_driver` unexecuted until a GPU run. So this module swaps
cuda-python's driver module for `FakeDriver`, which keeps the driver's rules the code must
respect (a context current on the calling thread; cuMemMap only into a reservation, aligned,
onto vacant addresses; memory unusable until cuMemSetAccess; cuMemUnmap of whole mappings;
copies only over device-accessible ranges; stream order, events and stream waits) and backs
device memory with host memory the same way the host backend does. Where cuda-python cannot
load a driver, every call is also passed to the real binding first, which converts (and so
type-checks) every argument before failing to find the library: a wrong argument type is a
TypeError here rather than on the GPU machine.

The backend-agnostic tests of test_vmm and test_device are imported and run again on this
fake device. It proves the plumbing, not the hardware: the real driver's behaviour is checked
only by the `cuda` variants of those tests on a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as real

import vmm.cuda_driver
from tests.test_device import (  # noqa: F401  (collected again here, on the fake device)
    test_a_never_recorded_event_counts_as_complete,
    test_copies_round_trip_host_device_device_host,
    test_copy_out_of_bounds_raises_before_enqueueing,
    test_elapsed_time_between_events_is_measured,
    test_event_completes_only_when_its_stream_reaches_it,
    test_stream_waits_for_another_streams_event,
)
from tests.test_vmm import (  # noqa: F401
    KVIO,
    layout_for,
    test_ensure_can_map_ahead_without_counting_it_live,
    test_layer_views_give_kernels_pointers_and_strides,
    test_map_unmap_remap_keeps_data,
    test_out_of_pages_is_typed_and_changes_nothing,
    test_prefix_sharing_maps_whole_pages_and_copies_the_partial_one,
    test_random_sessions_never_leak_a_page,
    test_region_grows_page_by_page_and_keeps_what_was_written,
    test_released_pages_return_only_after_the_last_rounds_event,
    test_sharing_a_page_aligned_prefix_copies_nothing,
    test_stats_report_live_and_mapped_bytes_and_map_latency,
    test_swap_in_without_free_pages_stays_swapped,
    test_swap_round_trip_is_bit_exact,
    test_virtual_reservations_are_recycled,
)
from vmm.cuda_device import CudaDevice
from vmm.cuda_driver import CudaError, NoCudaDevice
from vmm.device import Device, open_device
from vmm.host_views import ViewsAlive
from vmm.page_pool import PagePool
from vmm.virmem import _MAP_FIXED, _RESERVE_FLAGS, _libc, _mmap

R = real.CUresult
_GRANULARITY = 64 << 10
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _real_driver_missing() -> bool:
    try:
        real.cuInit(0)
    except Exception:
        return True
    return False


_VALIDATE = _real_driver_missing()


class _Worker:
    """A fake stream: a thread running closures in order."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.idle = threading.Condition()
        self.pending = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, fn: Callable[[], None]) -> None:
        with self.idle:
            self.pending += 1
        self.work.put(fn)

    def _run(self) -> None:
        while (fn := self.work.get()) is not None:
            fn()
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    def drain(self) -> None:
        with self.idle:
            self.idle.wait_for(lambda: self.pending == 0)

    def stop(self) -> None:
        self.work.put(None)
        self.thread.join()


class _Ev:
    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self.cond = threading.Condition()
        self.recorded = self.reached = 0
        self.t_ns = 0

    def reach(self, gen: int) -> None:
        with self.cond:
            if gen > self.reached:
                self.reached, self.t_ns = gen, time.perf_counter_ns()
                self.cond.notify_all()

    def wait(self, gen: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.reached >= gen)


class FakeDriver:
    """What `vmm` uses of cuda.bindings.driver, with the driver's rules, on host memory."""

    def __init__(self, memory_bytes: int = 512 << 20) -> None:
        self.total = memory_bytes
        self.used = 0
        self.ids = itertools.count(0x1000)
        self.ctx_id = 0xC7C7
        self.ctx_refs = 0
        self.tls = threading.local()
        self.handles: dict[int, tuple[int, int]] = {}  # id -> (memfd, size)
        self.reservations: dict[int, int] = {}  # base -> size
        self.mappings: dict[int, list] = {}  # addr -> [size, handle id, accessible]
        self.allocs: dict[int, int] = {}  # cuMemAlloc: addr -> size
        self.host: dict[int, tuple[Any, int]] = {}  # cuMemHostAlloc: addr -> (buffer, flags)
        self.streams: dict[int, _Worker] = {}
        self.events: dict[int, _Ev] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:  # enums, structs, constants: the real ones
        return getattr(real, name)

    # -- plumbing --------------------------------------------------------------------

    def _enter(self, name: str, args: tuple, needs_ctx: bool = True) -> tuple | None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if _VALIDATE:
            try:
                getattr(real, name)(*args)
            except TypeError:
                raise
            except Exception:
                pass  # no driver library: the arguments converted fine
        if needs_ctx and getattr(self.tls, "ctx", None) != self.ctx_id:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None)
        return None

    def _device_ok(self, ptr: int, n: int) -> bool:
        """Whether [ptr, ptr + n) is device memory this device may access."""
        pos, end = ptr, ptr + n
        while pos < end:
            for base, size in self.allocs.items():
                if base <= pos < base + size:
                    pos = base + size
                    break
            else:
                for base, (size, _h, access) in self.mappings.items():
                    if base <= pos < base + size and access:
                        pos = base + size
                        break
                else:
                    return False
        return True

    # -- device and context ----------------------------------------------------------

    def cuInit(self, flags: int) -> tuple:
        return self._enter("cuInit", (flags,), False) or (R.CUDA_SUCCESS,)

    def cuDeviceGetCount(self) -> tuple:
        return self._enter("cuDeviceGetCount", (), False) or (R.CUDA_SUCCESS, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple:
        err = self._enter("cuDeviceGet", (ordinal,), False)
        return err or ((R.CUDA_SUCCESS, real.CUdevice(0)) if ordinal == 0
                       else (R.CUDA_ERROR_INVALID_DEVICE, None))

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple:
        err = self._enter("cuDevicePrimaryCtxRetain", (dev,), False)
        self.ctx_refs += 1
        return err or (R.CUDA_SUCCESS, real.CUcontext(self.ctx_id))

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> tuple:
        err = self._enter("cuDevicePrimaryCtxRelease", (dev,), False)
        self.ctx_refs -= 1
        return err or (R.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple:
        err = self._enter("cuCtxSetCurrent", (ctx,), False)
        self.tls.ctx = int(ctx)
        return err or (R.CUDA_SUCCESS,)

    def cuDeviceGetName(self, length: int, dev: Any) -> tuple:
        err = self._enter("cuDeviceGetName", (length, dev), False)
        return err or (R.CUDA_SUCCESS, b"Fake VMM GPU".ljust(length, b"\0"))

    def cuDeviceGetAttribute(self, attr: Any, dev: Any) -> tuple:
        err = self._enter("cuDeviceGetAttribute", (attr, dev), False)
        vmm_attr = real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        return err or (R.CUDA_SUCCESS, int(attr == vmm_attr))

    def cuGetErrorName(self, error: Any) -> tuple:
        return (R.CUDA_SUCCESS, R(int(error)).name.encode())

    def cuMemGetInfo(self) -> tuple:
        return self._enter("cuMemGetInfo", ()) or (R.CUDA_SUCCESS, self.total - self.used,
                                                   self.total)

    def cuCtxSynchronize(self) -> tuple:
        err = self._enter("cuCtxSynchronize", ())
        for w in list(self.streams.values()):
            w.drain()
        return err or (R.CUDA_SUCCESS,)

    # -- virtual memory management ---------------------------------------------------

    @staticmethod
    def _prop_ok(prop: Any) -> bool:
        return (prop.type == real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and prop.location.id == 0)

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple:
        err = self._enter("cuMemGetAllocationGranularity", (prop, option), False)
        if err:
            return err
        return (R.CUDA_SUCCESS, _GRANULARITY) if self._prop_ok(prop) else \
            (R.CUDA_ERROR_INVALID_VALUE, None)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:
        if err := self._enter("cuMemCreate", (size, prop, flags)):
            return err
        if not self._prop_ok(prop) or size % _GRANULARITY or size <= 0 or flags:
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        if self.used + size > self.total:
            return (R.CUDA_ERROR_OUT_OF_MEMORY, None)
        fd = os.memfd_create("fake-cuda", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        h = next(self.ids)
        self.handles[h] = (fd, size)
        self.used += size
        return (R.CUDA_SUCCESS, real.CUmemGenericAllocationHandle(h))

    def cuMemRelease(self, handle: Any) -> tuple:
        if err := self._enter("cuMemRelease", (handle,)):
            return err
        got = self.handles.pop(int(handle), None)
        if got is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        os.close(got[0])  # mappings, if any, keep the memory until unmapped (as in CUDA)
        self.used -= got[1]
        return (R.CUDA_SUCCESS,)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> tuple:
        if err := self._enter("cuMemAddressReserve", (size, alignment, addr, flags)):
            return err
        align = alignment or _GRANULARITY
        if size % _GRANULARITY or size <= 0 or align % _GRANULARITY or int(addr) or flags:
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        raw = _mmap(None, size + align, 0, _RESERVE_FLAGS, -1, 0)
        base = -(-raw // align) * align
        if base > raw:
            _libc.munmap(raw, base - raw)
        if raw + size + align > base + size:
            _libc.munmap(base + size, raw + size + align - base - size)
        self.reservations[base] = size
        return (R.CUDA_SUCCESS, real.CUdeviceptr(base))

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple:
        if err := self._enter("cuMemAddressFree", (ptr, size)):
            return err
        base = int(ptr)
        if self.reservations.get(base) != size or any(
                base <= m < base + size for m in self.mappings):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        del self.reservations[base]
        _libc.munmap(base, size)
        return (R.CUDA_SUCCESS,)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:
        if err := self._enter("cuMemMap", (ptr, size, offset, handle, flags)):
            return err
        addr, h = int(ptr), int(handle)
        inside = any(b <= addr and addr + size <= b + s for b, s in self.reservations.items())
        overlaps = any(a < addr + size and addr < a + m[0] for a, m in self.mappings.items())
        if (not inside or overlaps or addr % _GRANULARITY or size % _GRANULARITY or offset
                or flags or h not in self.handles or size > self.handles[h][1]):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        _mmap(addr, size, 0, mmap.MAP_SHARED | _MAP_FIXED, self.handles[h][0], 0)
        self.mappings[addr] = [size, h, False]
        return (R.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr: Any, size: int, desc: list, count: int) -> tuple:
        if err := self._enter("cuMemSetAccess", (ptr, size, desc, count)):
            return err
        addr = int(ptr)
        covered = [a for a, m in self.mappings.items() if addr <= a and a + m[0] <= addr + size]
        if (count != len(desc) or sum(self.mappings[a][0] for a in covered) != size
                or not all(d.location.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                           and d.location.id == 0 and d.flags ==
                           real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                           for d in desc)):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        if _libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                          mmap.PROT_READ | mmap.PROT_WRITE):
            return (R.CUDA_ERROR_UNKNOWN,)
        for a in covered:
            self.mappings[a][2] = True
        return (R.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple:
        if err := self._enter("cuMemUnmap", (ptr, size)):
            return err
        addr = int(ptr)
        covered = [a for a, m in self.mappings.items() if addr <= a and a + m[0] <= addr + size]
        if sum(self.mappings[a][0] for a in covered) != size or addr not in self.mappings:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        _mmap(addr, size, 0, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)
        for a in covered:
            del self.mappings[a]
        return (R.CUDA_SUCCESS,)

    # -- plain memory ----------------------------------------------------------------

    def cuMemAlloc(self, n: int) -> tuple:
        if err := self._enter("cuMemAlloc", (n,)):
            return err
        if n <= 0:
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        addr = _mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        self.allocs[addr] = n
        self.used += n
        return (R.CUDA_SUCCESS, real.CUdeviceptr(addr))

    def cuMemFree(self, ptr: Any) -> tuple:
        if err := self._enter("cuMemFree", (ptr,)):
            return err
        n = self.allocs.pop(int(ptr), None)
        if n is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        _libc.munmap(int(ptr), n)
        self.used -= n
        return (R.CUDA_SUCCESS,)

    def cuMemHostAlloc(self, n: int, flags: int) -> tuple:
        if err := self._enter("cuMemHostAlloc", (n, flags)):
            return err
        buf = ctypes.create_string_buffer(n)
        addr = ctypes.addressof(buf)
        self.host[addr] = (buf, flags)
        return (R.CUDA_SUCCESS, addr)

    def cuMemHostGetDevicePointer(self, p: int, flags: int) -> tuple:
        if err := self._enter("cuMemHostGetDevicePointer", (p, flags)):
            return err
        got = self.host.get(int(p))
        if got is None or not got[1] & real.CU_MEMHOSTALLOC_DEVICEMAP or flags:
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        return (R.CUDA_SUCCESS, real.CUdeviceptr(int(p)))

    def cuMemFreeHost(self, p: int) -> tuple:
        if err := self._enter("cuMemFreeHost", (p,)):
            return err
        return (R.CUDA_SUCCESS,) if self.host.pop(int(p), None) else \
            (R.CUDA_ERROR_INVALID_VALUE,)

    # -- streams, events, copies ------------------------------------------------------

    def cuStreamCreate(self, flags: int) -> tuple:
        if err := self._enter("cuStreamCreate", (flags,)):
            return err
        s = next(self.ids)
        self.streams[s] = _Worker()
        return (R.CUDA_SUCCESS, real.CUstream(s))

    def _stream(self, s: Any) -> _Worker | None:
        return self.streams.get(int(s))

    def cuStreamDestroy(self, s: Any) -> tuple:
        if err := self._enter("cuStreamDestroy", (s,)):
            return err
        w = self.streams.pop(int(s), None)
        if w is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        w.stop()
        return (R.CUDA_SUCCESS,)

    def cuStreamSynchronize(self, s: Any) -> tuple:
        if err := self._enter("cuStreamSynchronize", (s,)):
            return err
        w = self._stream(s)
        if w is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        w.drain()
        return (R.CUDA_SUCCESS,)

    def cuStreamWaitValue32(self, s: Any, addr: Any, value: Any, flags: int) -> tuple:
        if err := self._enter("cuStreamWaitValue32", (s, addr, value, flags)):
            return err
        w, a, v = self._stream(s), int(addr), int(value)
        geq = int(real.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        if w is None or flags != geq or not any(h <= a < h + 4 for h in self.host):
            return (R.CUDA_ERROR_INVALID_VALUE,)

        def wait() -> None:
            word = ctypes.c_uint32.from_address(a)
            while ((word.value - v) & 0xFFFFFFFF) >= 0x80000000:  # cyclic >=, as in CUDA
                time.sleep(0.0005)

        w.put(wait)
        return (R.CUDA_SUCCESS,)

    def cuStreamWaitEvent(self, s: Any, e: Any, flags: int) -> tuple:
        if err := self._enter("cuStreamWaitEvent", (s, e, flags)):
            return err
        w, ev = self._stream(s), self.events.get(int(e))
        if w is None or ev is None or flags:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        gen = ev.recorded
        w.put(lambda: ev.wait(gen))
        return (R.CUDA_SUCCESS,)

    def cuEventCreate(self, flags: int) -> tuple:
        if err := self._enter("cuEventCreate", (flags,)):
            return err
        e = next(self.ids)
        timing = not flags & int(real.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.events[e] = _Ev(timing)
        return (R.CUDA_SUCCESS, real.CUevent(e))

    def cuEventDestroy(self, e: Any) -> tuple:
        if err := self._enter("cuEventDestroy", (e,)):
            return err
        return (R.CUDA_SUCCESS,) if self.events.pop(int(e), None) else \
            (R.CUDA_ERROR_INVALID_HANDLE,)

    def cuEventRecord(self, e: Any, s: Any) -> tuple:
        if err := self._enter("cuEventRecord", (e, s)):
            return err
        w, ev = self._stream(s), self.events.get(int(e))
        if w is None or ev is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        with ev.cond:
            ev.recorded += 1
            gen = ev.recorded
        w.put(lambda: ev.reach(gen))
        return (R.CUDA_SUCCESS,)

    def cuEventQuery(self, e: Any) -> tuple:
        if err := self._enter("cuEventQuery", (e,)):
            return err[:1]
        ev = self.events.get(int(e))
        if ev is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        return (R.CUDA_SUCCESS,) if ev.reached >= ev.recorded else (R.CUDA_ERROR_NOT_READY,)

    def cuEventSynchronize(self, e: Any) -> tuple:
        if err := self._enter("cuEventSynchronize", (e,)):
            return err[:1]
        ev = self.events.get(int(e))
        if ev is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        ev.wait(ev.recorded)
        return (R.CUDA_SUCCESS,)

    def cuEventElapsedTime(self, a: Any, b: Any) -> tuple:
        if err := self._enter("cuEventElapsedTime", (a, b)):
            return err
        ea, eb = self.events.get(int(a)), self.events.get(int(b))
        if ea is None or eb is None or not (ea.timing and eb.timing):
            return (R.CUDA_ERROR_INVALID_HANDLE, None)
        if ea.reached < ea.recorded or eb.reached < eb.recorded or not ea.recorded:
            return (R.CUDA_ERROR_NOT_READY, None)
        return (R.CUDA_SUCCESS, (eb.t_ns - ea.t_ns) / 1e6)

    def _copy(self, name: str, args: tuple, dst: int, src: int, n: int, s: Any,
              dst_dev: bool, src_dev: bool) -> tuple:
        if err := self._enter(name, args):
            return err
        w = self._stream(s)
        if w is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        if (dst_dev and not self._device_ok(dst, n)) or (src_dev and not self._device_ok(src, n)):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        w.put(lambda: ctypes.memmove(dst, src, n))
        return (R.CUDA_SUCCESS,)

    def cuMemcpyHtoDAsync(self, dst: Any, src: int, n: int, s: Any) -> tuple:
        return self._copy("cuMemcpyHtoDAsync", (dst, src, n, s), int(dst), int(src), n, s,
                          True, False)

    def cuMemcpyDtoHAsync(self, dst: int, src: Any, n: int, s: Any) -> tuple:
        return self._copy("cuMemcpyDtoHAsync", (dst, src, n, s), int(dst), int(src), n, s,
                          False, True)

    def cuMemcpyDtoDAsync(self, dst: Any, src: Any, n: int, s: Any) -> tuple:
        return self._copy("cuMemcpyDtoDAsync", (dst, src, n, s), int(dst), int(src), n, s,
                          True, True)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver()
    monkeypatch.setattr(vmm.cuda_driver, "_driver", drv)
    return drv


@pytest.fixture
def device(fake: FakeDriver) -> Iterator[Device]:
    dev = CudaDevice(0)
    yield dev
    dev.close()
    for w in fake.streams.values():
        w.stop()


@pytest.fixture
def io(device: Device) -> KVIO:
    return KVIO(device)


# -- what only the cuda backend does ---------------------------------------------------


def test_the_fake_device_is_the_cuda_backend(device: Device, fake: FakeDriver) -> None:
    assert device.kind == "cuda" and not device.host_accessible
    assert device.page_size == _GRANULARITY and "Fake VMM GPU" in device.name
    assert layout_for(device).head_dim == _GRANULARITY // 512


def test_every_thread_binds_the_context_before_calling(device: Device,
                                                       fake: FakeDriver) -> None:
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            pool = PagePool(device, 2)
            region = pool.new_region(layout_for(device), 20)
            region.ensure(15)
            pool.close()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errors == []


def test_a_driver_failure_is_a_cuda_error_naming_the_call(device: Device,
                                                          fake: FakeDriver) -> None:
    fake.total = fake.used + 3 * _GRANULARITY
    with pytest.raises(CudaError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        PagePool(device, 5)
    assert fake.handles == {}, "pages made before the failure are released"


def test_pool_sized_from_free_device_memory(device: Device, fake: FakeDriver) -> None:
    fake.total = fake.used + 40 * _GRANULARITY
    pool = PagePool.from_free_memory(device, memory_fraction=0.5)
    assert pool.n_pages == 20
    pool.close()


def test_pool_close_gives_everything_back_to_the_driver(device: Device,
                                                        fake: FakeDriver) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    a = pool.new_region(layout, 100)
    a.ensure(30)
    b = pool.new_region(layout, 100)
    b.share_prefix_from(a, 20)
    c = pool.new_region(layout, 100)
    c.ensure(10)
    c.release(after=device.stream().record())
    pool.close()
    assert (fake.handles, fake.reservations, fake.mappings) == ({}, {}, {})


def test_pinned_host_buffer_is_not_freed_under_a_view(device: Device) -> None:
    host = device.alloc_host(4096)
    view = host.array[8:16]
    with pytest.raises(ViewsAlive):
        host.free()
    view[:] = 1
    del view
    host.free()


def test_a_gate_holds_the_stream_until_opened(device: Device) -> None:
    s = device.stream()
    gate = s.gate()
    ev = s.record()
    time.sleep(0.01)
    assert not ev.query()
    gate.open()
    ev.synchronize()
    s.close()


def test_real_bindings_accept_every_argument_passed(fake: FakeDriver) -> None:
    """With no driver library the fake forwarded each call to the real binding first."""
    if not _VALIDATE:
        pytest.skip("a CUDA driver is loadable: arguments are checked by the GPU tests")
    dev = CudaDevice(0)
    buf = dev.alloc(256)
    s = dev.stream()
    host = dev.alloc_host(256)
    s.copy_h2d(buf, host)
    s.copy_d2h(host, buf)
    s.record().synchronize()
    dev.close()
    assert {"cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuEventRecord"} <= set(fake.calls)
    np.testing.assert_array_equal(host.array, 0)


def test_a_driver_that_fails_cuinit_means_no_cuda_device(fake: FakeDriver,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "cuInit", lambda flags: (R.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(NoCudaDevice, match="no CUDA device: cuInit failed with "
                                           "CUDA_ERROR_NO_DEVICE"):
        open_device("cuda")


def test_a_gpu_without_vmm_is_refused_and_its_context_released(
        fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "cuDeviceGetAttribute", lambda attr, dev: (R.CUDA_SUCCESS, 0))
    with pytest.raises(NoCudaDevice, match="virtual memory"):
        open_device("cuda")
    assert fake.ctx_refs == 0
