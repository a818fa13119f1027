"""The CUDA driver API, every call checked, and the primary context of one device.

cuda-python's `cuda.bindings.driver` returns a tuple `(CUresult, *outputs)` from every call
and raises nothing. Forgetting to look at the CUresult turns a failure into a wrong answer far
from its cause, so the engine never calls the driver directly: `cu("cuMemMap", ...)` makes
the call, raises `CudaError` naming the call and the CUDA error when it fails, and returns the
outputs. On a machine without a GPU or driver, cuda-python imports fine and fails at the first
call (it cannot load libcuda); `CudaContext.open` turns that into `NoCudaDevice`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from eagerlm.errors import DeviceUnavailable, EngineFailure

try:
    from cuda.bindings import driver as _driver
except ImportError as exc:  # cuda-python itself missing: same outcome as having no driver
    _driver = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


class NoCudaDevice(DeviceUnavailable):
    """No usable CUDA device: no driver library, cuInit failed, or zero devices."""


class CudaError(EngineFailure):
    """A driver call failed: which call, and the CUDA error it returned."""

    def __init__(self, call: str, code: int, name: str) -> None:
        self.call = call
        self.code = code
        self.name = name
        super().__init__(f"{call} failed: {name} ({code})")


def driver() -> Any:
    """The `cuda.bindings.driver` module, or NoCudaDevice when cuda-python is not installed."""
    if _driver is None:
        raise NoCudaDevice(f"no CUDA device: cuda-python is not importable ({_IMPORT_ERROR})")
    return _driver


def error_name(err: Any) -> str:
    """The CUDA name of a CUresult (`CUDA_ERROR_OUT_OF_MEMORY`), asking the driver first."""
    try:
        res, name = driver().cuGetErrorName(err)
        if int(res) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return getattr(err, "name", str(err))


def check(result: tuple, call: str) -> Any:
    """Unpack a driver result tuple: raise CudaError on failure, else return the outputs
    (None for none, the value for one, a tuple for several)."""
    err, *outputs = result
    if int(err) != 0:
        raise CudaError(call, int(err), error_name(err))
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def cu(call: str, *args: Any) -> Any:
    """Call the driver function named `call` with `args`, checked (see `check`)."""
    return check(getattr(driver(), call)(*args), call)


def device_count() -> int:
    """How many CUDA devices there are; NoCudaDevice when there is no usable driver."""
    d = driver()
    try:
        (err,) = d.cuInit(0)
    except Exception as exc:  # cuda-python raises when libcuda cannot be loaded at all
        raise NoCudaDevice(f"no CUDA device: the CUDA driver cannot be loaded ({exc})") from exc
    if int(err) != 0:
        raise NoCudaDevice(f"no CUDA device: cuInit failed with {error_name(err)}")
    count = int(cu("cuDeviceGetCount"))
    if count == 0:
        raise NoCudaDevice("no CUDA device: the driver reports 0 devices")
    return count


_current = threading.local()  # .ctx: the context current on this thread, as bound here


class CudaContext:
    """The primary context of one device, made current on whichever thread uses it.

    CUDA contexts are current per thread; the control thread, the service thread and the
    loader all use the device, so every entry point calls `bind()` (a thread-local check
    after the first time on a thread).
    """

    def __init__(self, ordinal: int) -> None:
        count = device_count()
        if not 0 <= ordinal < count:
            raise NoCudaDevice(f"no CUDA device: ordinal {ordinal} requested, {count} present")
        self.ordinal = ordinal
        self.device = cu("cuDeviceGet", ordinal)
        self.ctx = cu("cuDevicePrimaryCtxRetain", self.device)
        self._released = False
        try:
            self.bind()
            name = cu("cuDeviceGetName", 256, self.device)
            self.name = (name.split(b"\0", 1)[0].decode() if isinstance(name, bytes)
                         else str(name))
            d = driver()
            vmm = cu("cuDeviceGetAttribute", d.CUdevice_attribute
                     .CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self.device)
            if not vmm:
                raise NoCudaDevice(f"CUDA device {ordinal} ({self.name}) lacks virtual memory "
                                   "management (cuMemCreate / cuMemMap)")
            self.granularity = int(cu("cuMemGetAllocationGranularity", self.allocation_prop(),
                                      d.CUmemAllocationGranularity_flags
                                      .CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        except BaseException:
            self.release()
            raise

    def bind(self) -> None:
        """Make the primary context current on the calling thread (a thread-local check
        when it already is). What is current is the thread's, not the context's: a thread
        that uses several devices (a tensor-parallel group's loading) switches each time."""
        if getattr(_current, "ctx", None) is not self.ctx:
            cu("cuCtxSetCurrent", self.ctx)
            _current.ctx = self.ctx

    @contextlib.contextmanager
    def visiting(self) -> Iterator[None]:
        """Bound for a moment, then the calling thread's own context put back: for
        finalizers, which the garbage collector runs on whatever thread allocates, possibly
        between another device's `bind()` and its driver call (that call then ran on this
        context, or on none)."""
        before = getattr(_current, "ctx", None)
        self.bind()
        try:
            yield
        finally:
            if before is not None and before is not self.ctx:
                cu("cuCtxSetCurrent", before)
                _current.ctx = before

    def allocation_prop(self) -> Any:
        """Properties of a physical page: pinned device memory on this device."""
        d = driver()
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return prop

    def access_desc(self) -> Any:
        """Read-write access for this device, granted to each mapped range."""
        d = driver()
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.ordinal
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            cu("cuDevicePrimaryCtxRelease", self.device)
