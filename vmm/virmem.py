"""Reserved virtual ranges that physical pages are mapped into and out of.

A `VirMem` is address space only: reserving it costs no memory, so a session reserves room
for the model's whole context and pages are mapped as it grows. It keeps the table of which
page-aligned offsets are mapped (and to which `PhyMem`) and which are vacant, so mapping over
a mapped page or unmapping a vacant one is an error here rather than a silent corruption.

- cuda: cuMemAddressReserve / cuMemMap + cuMemSetAccess / cuMemUnmap / cuMemAddressFree.
- host: mmap(PROT_NONE, MAP_NORESERVE) reserves; mmap(MAP_FIXED | MAP_SHARED) of the page's
  memfd slice maps; unmapping maps fresh PROT_NONE anonymous memory over the page again, so
  the range stays reserved and no other mmap in the process can land inside it. Python's mmap
  module cannot map at a fixed address, so libc's mmap is called through ctypes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

from eagerlm.vmm.cuda_driver import CudaContext, cu, driver
from eagerlm.vmm.phymem import CudaPhyMem, HostPhyMem, PhyMem
from eagerlm.vmm.stats import MapLatency


class VirMem(ABC):
    """`size` bytes of reserved address space at `base`, mapped page by page."""

    def __init__(self, base: int, size: int, page_size: int,
                 latency: MapLatency | None = None) -> None:
        self.base = base
        self.size = size
        self.page_size = page_size
        self.latency = latency if latency is not None else MapLatency()
        self._table: dict[int, PhyMem] = {}  # offset -> mapped memory
        self._occupied: set[int] = set()  # page indices covered by a mapping
        self._mapped_bytes = 0  # kept as a number: read from other threads, never iterated
        self._freed = False

    @property
    def mapped(self) -> Mapping[int, PhyMem]:
        """offset -> the PhyMem mapped there; offsets absent are vacant."""
        return MappingProxyType(self._table)

    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

    def is_vacant(self, offset: int) -> bool:
        return offset // self.page_size not in self._occupied

    def map(self, offset: int, phy: PhyMem) -> None:
        """Map `phy` at `offset`; every page it covers must be vacant."""
        if self._freed:
            raise RuntimeError("virtual range already freed")
        ps = self.page_size
        if offset % ps or phy.size % ps or offset < 0 or offset + phy.size > self.size:
            raise ValueError(f"cannot map {phy.size} bytes at offset {offset} of a "
                             f"{self.size}-byte range with {ps}-byte pages")
        pages = range(offset // ps, (offset + phy.size) // ps)
        if any(i in self._occupied for i in pages):
            raise ValueError(f"offset {offset} is already mapped")
        t0 = time.perf_counter()
        self._map(offset, phy)
        self.latency.map.record(time.perf_counter() - t0)
        self._table[offset] = phy
        self._occupied.update(pages)
        self._mapped_bytes += phy.size
        phy.refs += 1

    def unmap(self, offset: int) -> PhyMem:
        """Unmap what is mapped at `offset` and return it (its refs decremented)."""
        phy = self._table.get(offset)
        if phy is None:
            raise ValueError(f"offset {offset} is vacant")
        t0 = time.perf_counter()
        self._unmap(offset, phy)
        self.latency.unmap.record(time.perf_counter() - t0)
        del self._table[offset]
        self._occupied.difference_update(range(offset // self.page_size,
                                               (offset + phy.size) // self.page_size))
        self._mapped_bytes -= phy.size
        phy.refs -= 1
        return phy

    def unmap_all(self) -> list[PhyMem]:
        """Unmap everything, last offset first; return what was mapped."""
        return [self.unmap(off) for off in sorted(self._table, reverse=True)]

    def free(self) -> None:
        """Give the address range back; only when nothing is mapped."""
        if self._table:
            raise RuntimeError(f"{len(self._table)} mapping(s) left in the range")
        if not self._freed:
            self._freed = True
            self._free()

    @abstractmethod
    def _map(self, offset: int, phy: PhyMem) -> None: ...

    @abstractmethod
    def _unmap(self, offset: int, phy: PhyMem) -> None: ...

    @abstractmethod
    def _free(self) -> None: ...


# -- host ------------------------------------------------------------------------------

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux values (x86-64 and arm64 alike); the mmap module does not export
_MAP_NORESERVE = 0x4000  # these two
_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _libc.mmap(addr, size, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({size} bytes, flags={flags:#x}) failed: {os.strerror(err)}")
    return int(got)


class HostVirMem(VirMem):
    """A range of host address space reserved with mmap(PROT_NONE)."""

    def __init__(self, size: int, page_size: int, latency: MapLatency | None = None) -> None:
        if page_size % mmap.PAGESIZE or size % page_size:
            raise ValueError(f"page size {page_size} must be a multiple of {mmap.PAGESIZE} "
                             f"and the range {size} a multiple of the page size")
        super().__init__(_mmap(None, size, _PROT_NONE, _RESERVE_FLAGS, -1, 0), size, page_size,
                         latency)

    def _map(self, offset: int, phy: PhyMem) -> None:
        assert isinstance(phy, HostPhyMem)
        _mmap(self.base + offset, phy.size, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, phy.fd,
              phy.offset)

    def _unmap(self, offset: int, phy: PhyMem) -> None:
        _mmap(self.base + offset, phy.size, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)

    def _free(self) -> None:
        if _libc.munmap(self.base, self.size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap failed: {os.strerror(err)}")


# -- cuda ------------------------------------------------------------------------------


class CudaVirMem(VirMem):
    """A range of device address space from cuMemAddressReserve."""

    def __init__(self, ctx: CudaContext, size: int, page_size: int,
                 latency: MapLatency | None = None) -> None:
        if page_size % ctx.granularity or size % page_size:
            raise ValueError(f"page size {page_size} must be a multiple of the granularity "
                             f"{ctx.granularity} and the range {size} of the page size")
        ctx.bind()
        base = int(cu("cuMemAddressReserve", size, page_size, 0, 0))
        super().__init__(base, size, page_size, latency)
        self.ctx = ctx
        self._access = [ctx.access_desc()]

    def _map(self, offset: int, phy: PhyMem) -> None:
        assert isinstance(phy, CudaPhyMem)
        self.ctx.bind()
        ptr = driver().CUdeviceptr(self.base + offset)
        cu("cuMemMap", ptr, phy.size, 0, phy.handle, 0)
        try:
            cu("cuMemSetAccess", ptr, phy.size, self._access, 1)
        except BaseException:
            cu("cuMemUnmap", ptr, phy.size)
            raise

    def _unmap(self, offset: int, phy: PhyMem) -> None:
        self.ctx.bind()
        cu("cuMemUnmap", driver().CUdeviceptr(self.base + offset), phy.size)

    def _free(self) -> None:
        self.ctx.bind()
        cu("cuMemAddressFree", driver().CUdeviceptr(self.base), self.size)
