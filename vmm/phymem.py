"""Physical memory for KV pages: device memory from cuMemCreate, or host memory in a memfd.

A `PhyMem` is memory that is not addressable by itself: it becomes addressable by being
mapped into a reserved virtual range (`VirMem.map`), and it can be mapped into several ranges
at once, which is how two sessions share the pages of a common prefix. `refs` counts those
mappings; the page pool hands a page out again only when it is back to zero.

On the host, all pages of one allocation are slices of one memfd (one file descriptor per
pool, not per page: a pool has thousands of pages and a process a limited number of fds);
mapping a slice with MAP_SHARED at two addresses is real shared memory, exactly like one
CUDA allocation handle mapped at two virtual addresses.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from eagerlm.vmm.cuda_driver import CudaContext, cu


class PhyMem(ABC):
    """Physical memory of `size` bytes (one page or a few), mapped `refs` times."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.refs = 0

    @abstractmethod
    def release(self) -> None:
        """Give the memory back to the OS or driver; only while it is mapped nowhere."""


class _MemFd:
    """One memfd shared by many host pages; closed when the last page is released
    (mappings stay valid after the close, as mmap holds its own reference)."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("eagerlm-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)  # sparse: RAM is used only where pages are touched
        except BaseException:
            os.close(self.fd)
            raise
        self.users = 0

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0:
            os.close(self.fd)
            self.fd = -1


class HostPhyMem(PhyMem):
    """`size` bytes at `offset` in a memfd."""

    def __init__(self, memfd: _MemFd, offset: int, size: int) -> None:
        super().__init__(size)
        self._memfd = memfd
        self.offset = offset
        memfd.users += 1
        self._released = False

    @property
    def fd(self) -> int:
        return self._memfd.fd

    def release(self) -> None:
        if self.refs:
            raise RuntimeError(f"page still mapped {self.refs} time(s)")
        if not self._released:
            self._released = True
            self._memfd.drop()


def host_pages(n_pages: int, page_size: int) -> list[HostPhyMem]:
    """`n_pages` host pages of `page_size` bytes, slices of one new memfd."""
    if n_pages <= 0:
        return []
    memfd = _MemFd(n_pages * page_size)
    return [HostPhyMem(memfd, i * page_size, page_size) for i in range(n_pages)]


class CudaPhyMem(PhyMem):
    """A cuMemCreate allocation handle of `size` bytes on one device."""

    def __init__(self, ctx: CudaContext, handle: Any, size: int) -> None:
        super().__init__(size)
        self.ctx = ctx
        self.handle = handle
        self._released = False

    def release(self) -> None:
        if self.refs:
            raise RuntimeError(f"page still mapped {self.refs} time(s)")
        if not self._released:
            self._released = True
            self.ctx.bind()
            cu("cuMemRelease", self.handle)


def cuda_pages(ctx: CudaContext, n_pages: int, page_size: int) -> list[CudaPhyMem]:
    """`n_pages` device pages of `page_size` bytes (a multiple of the granularity).

    All or nothing: if the driver runs out part-way, the pages made so far are released and
    the CudaError propagates.
    """
    ctx.bind()
    prop = ctx.allocation_prop()
    pages: list[CudaPhyMem] = []
    try:
        for _ in range(n_pages):
            pages.append(CudaPhyMem(ctx, cu("cuMemCreate", page_size, prop, 0), page_size))
    except BaseException:
        for p in pages:
            p.release()
        raise
    return pages
