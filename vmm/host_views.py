"""Numpy views over raw host memory whose owner can tell whether any is still alive.

A numpy array made from a raw address does not keep the memory behind it alive: if the
range is unmapped (a KV page returned to the pool, pinned memory freed) while a view still
points into it, the next access is a segfault, not an exception. So every such view is made
through a `HostViews`: the view's `base` is a `TrackedRange`, the owner keeps only weak
references to its ranges, and before unmapping it calls `check_released()`, which raises
`ViewsAlive` while any view (or any slice of one) is still referenced. The unmap then does not
happen and nothing dangles.

A `TrackedRange` is also a `Memory` for device copies: a copy queued on a cpu stream holds
its ranges until it has run, so unmapping under a queued copy is caught the same way.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np


class ViewsAlive(RuntimeError):
    """Host memory cannot be unmapped or freed: numpy views of it are still referenced."""


class TrackedRange:
    """A host range handed out by `HostViews`: the `base` of its numpy views (numpy keeps it
    alive as long as any view lives) and a `Memory` for copies."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {
            "data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3,
        }
        self.ptr = ptr
        self.nbytes = nbytes


class HostViews:
    """Makes byte views of raw host ranges and remembers them weakly."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._ranges: list[weakref.ref[TrackedRange]] = []

    def range(self, ptr: int, nbytes: int) -> TrackedRange:
        """`[ptr, ptr + nbytes)`, tracked while referenced; the caller guarantees it is mapped."""
        for ref in reversed(self._ranges):
            r = ref()
            if r is not None and r.ptr == ptr and r.nbytes == nbytes:
                return r
        if len(self._ranges) >= 32:
            self._ranges = [r for r in self._ranges if r() is not None]
        tracked = TrackedRange(ptr, nbytes)
        self._ranges.append(weakref.ref(tracked))
        return tracked

    def array(self, ptr: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of `[ptr, ptr + nbytes)`; the caller guarantees it is mapped."""
        return np.asarray(self.range(ptr, nbytes))

    def alive(self) -> int:
        """How many distinct ranges are still referenced (collecting garbage cycles first
        when there is any, so an unreachable view does not block an unmap)."""
        self._ranges = [r for r in self._ranges if r() is not None]
        if self._ranges:
            gc.collect()
            self._ranges = [r for r in self._ranges if r() is not None]
        return len(self._ranges)

    def check_released(self, action: str) -> None:
        """Raise ViewsAlive if any view is alive: `action` would leave it dangling."""
        n = self.alive()
        if n:
            raise ViewsAlive(f"cannot {action} {self.what}: numpy views of it are still "
                             f"referenced, or copies queued on it ({n} range(s)); drop them "
                             "first")
