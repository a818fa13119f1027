"""A fake CUDA driver: what the engine uses of `cuda.bindings.driver`, with the driver's
rules, on host memory (see tests/test_vmm_fake_cuda.py for what it is for, and
tests/emulated_gpu/gpu_emulator.py for the version that also runs kernels)."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as real

from eagerlm.vmm.virmem import _MAP_FIXED, _RESERVE_FLAGS, _libc, _mmap

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
_VALIDATING = threading.local()


_IDS = itertools.count(0x1000)
_CONTEXT_BASES = itertools.count(0xC7C7, 0x100)

class _Worker:
    """A fake stream: a thread running closures in order."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.idle = threading.Condition()
        self.pending = 0
        self.error: BaseException | None = None  # the first work that raised (sticky)
        self.capture: list[Callable[[], None]] | None = None
        self.device = 0  # the device whose context created it
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, fn: Callable[[], None]) -> None:
        if self.capture is not None:  # stream capture: recorded into the graph, not run
            self.capture.append(fn)
            return
        with self.idle:
            self.pending += 1
        self.work.put(fn)

    def _run(self) -> None:
        while (fn := self.work.get()) is not None:
            try:
                fn()
            except BaseException as exc:  # a failed kernel: the stream carries on, marked
                if self.error is None:
                    self.error = exc
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
    """What `vmm` uses of cuda.bindings.driver, with the driver's rules, on host memory;
    `n_devices` GPUs (one primary context each; memory is counted for all of them
    together)."""

    def __init__(self, memory_bytes: int = 512 << 20, n_devices: int = 1) -> None:
        self.total = memory_bytes
        self.used = 0
        # Handles and contexts are numbered across every driver of the process: a stale
        # object of an earlier test's driver, finalized during a later test, then names
        # nothing here (an error its finalizer ignores) instead of this driver's own event
        # or context of the same number.
        self.ids = _IDS
        self.n_devices = n_devices
        self.ctx_id = next(_CONTEXT_BASES)  # device d's primary context is ctx_id + d
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
        self.mem_lock = threading.RLock()  # allocs may change on a stream's thread

    def __getattr__(self, name: str) -> Any:  # enums, structs, constants: the real ones
        return getattr(real, name)

    # -- plumbing --------------------------------------------------------------------

    def _enter(self, name: str, args: tuple, needs_ctx: bool = True) -> tuple | None:
        self.calls[name] = self.calls.get(name, 0) + 1
        # Not re-entrantly: a garbage-collected CudaEvent's __del__ may call in here from
        # inside another call's validation, where cuda-python holds a lock of its own.
        if _VALIDATE and not getattr(_VALIDATING, "on", False):
            _VALIDATING.on = True
            try:
                getattr(real, name)(*args)
            except TypeError:
                raise
            except Exception:
                pass  # no driver library: the arguments converted fine
            finally:
                _VALIDATING.on = False
        if needs_ctx and self.current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None)
        return None

    def current_device(self) -> int | None:
        """The device whose context is current on the calling thread."""
        d = getattr(self.tls, "ctx", -1) - self.ctx_id
        return d if 0 <= d < self.n_devices else None

    def _device_ok(self, ptr: int, n: int) -> bool:
        """Whether [ptr, ptr + n) is device memory this device may access."""
        with self.mem_lock:
            return self._device_ok_locked(ptr, n)

    def _device_ok_locked(self, ptr: int, n: int) -> bool:
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
        return self._enter("cuDeviceGetCount", (), False) or (R.CUDA_SUCCESS, self.n_devices)

    def cuDeviceGet(self, ordinal: int) -> tuple:
        err = self._enter("cuDeviceGet", (ordinal,), False)
        return err or ((R.CUDA_SUCCESS, real.CUdevice(ordinal)) if 0 <= ordinal < self.n_devices
                       else (R.CUDA_ERROR_INVALID_DEVICE, None))

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple:
        err = self._enter("cuDevicePrimaryCtxRetain", (dev,), False)
        self.ctx_refs += 1
        return err or (R.CUDA_SUCCESS, real.CUcontext(self.ctx_id + int(dev)))

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
        return err or self._sticky()

    # -- virtual memory management ---------------------------------------------------

    def _prop_ok(self, prop: Any) -> bool:
        """Pinned device memory on the current context's device (0 where none is current:
        the granularity query needs no context)."""
        return (prop.type == real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and prop.location.id == (self.current_device() or 0))

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
                           and d.location.id == self.current_device() and d.flags ==
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
        return self._enter("cuMemAlloc", (n,)) or self._alloc(n)

    def _alloc(self, n: int) -> tuple:
        if n <= 0:
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        addr = _mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        with self.mem_lock:
            self.allocs[addr] = n
            self.used += n
        return (R.CUDA_SUCCESS, real.CUdeviceptr(addr))

    def cuMemFree(self, ptr: Any) -> tuple:
        return self._enter("cuMemFree", (ptr,)) or self._free(int(ptr))

    def _free(self, addr: int) -> tuple:
        with self.mem_lock:
            n = self.allocs.pop(addr, None)
            if n is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            _libc.munmap(addr, n)
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
        self.streams[s].device = self.current_device() or 0
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
        if w.capture is not None:
            return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        w.drain()
        return self._sticky()

    def _sticky(self) -> tuple:
        """A kernel that failed poisons the context, as on a GPU: every later
        synchronization reports it."""
        failed = [w.error for w in list(self.streams.values()) if w.error is not None]
        return (R.CUDA_ERROR_LAUNCH_FAILED,) if failed else (R.CUDA_SUCCESS,)

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
        if w.capture is not None:  # the engine records no event inside a capture
            return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
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
        return self._sticky()

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


