"""The cpu backend's collectives: the devices of a tensor-parallel group exchange their
partial results through shared host memory.

A cpu device is a worker group on its share of the cores (kernels/cpu_threads.py's
`device_cores`), all of them in this process, so shared memory is the address space:
each device publishes its array in its slot of the group's table, the devices meet at a
barrier, each sums (or copies) its share of the result into one output array that every
device then reads, and they meet again before a slot may be reused. The sum is in rank
order for every element, so every device gets the same bits (a replicated residual
stream stays identical on every device, as NCCL's all-reduce keeps it on GPUs).

A device that fails aborts the group's barrier (`HostGroup.abort`): the others raise
`threading.BrokenBarrierError` at their next collective instead of waiting forever.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class CollectiveStats:
    """What one device's collectives cost (benchmarks/bench_tensor_parallel.py): calls,
    seconds waiting at the first barrier for the other devices (their imbalance: the
    bubble this device sits in), and seconds in the rest (its share of the sums or
    copies, and the second barrier)."""

    calls: int = 0
    wait_s: float = 0.0
    work_s: float = 0.0


class HostGroup:
    """The shared state of `size` cpu devices: the slots and the barrier. `member(r)` is
    device r's end, what its ops call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[np.ndarray | None] = [None] * size
        self._out: np.ndarray | None = None

    def member(self, rank: int) -> HostCollective:
        return HostCollective(self, rank)

    def abort(self) -> None:
        """Break the barrier: every device waiting in a collective, or entering one, raises
        BrokenBarrierError (a device failed; the group cannot go on)."""
        self._barrier.abort()

    @property
    def broken(self) -> bool:
        return self._barrier.broken

    def _meet(self) -> None:
        self._barrier.wait()


class HostCollective:
    """Device `rank`'s collectives over its group (`NumpyOps.all_reduce`, `all_gather`)."""

    def __init__(self, group: HostGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.size = group.size
        self.stats = CollectiveStats()

    def _meet_first(self) -> None:
        t0 = time.perf_counter()
        self.group._meet()
        self._t = time.perf_counter()
        self.stats.calls += 1
        self.stats.wait_s += self._t - t0

    def _meet_last(self) -> None:
        self.group._meet()
        self.stats.work_s += time.perf_counter() - self._t

    def _share(self, n: int) -> slice:
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The element-wise sum of every device's `x` (float32, same shape), on every device:
        one array, which no device writes after this returns."""
        g = self.group
        x = np.ascontiguousarray(x, np.float32)
        g._slots[self.rank] = x
        if self.rank == 0:
            g._out = np.empty_like(x)
        self._meet_first()
        out, parts = g._out, g._slots
        assert out is not None and out.shape == x.shape
        flat = out.reshape(-1)
        share = self._share(flat.size)
        first = parts[0]
        assert first is not None
        np.copyto(flat[share], first.reshape(-1)[share])
        for p in parts[1:]:  # rank order, on every element: the same bits everywhere
            assert p is not None
            flat[share] += p.reshape(-1)[share]
        self._meet_last()
        return out

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """Every device's `x` `[rows, n]` side by side, `[rows, size * n]`, device r's in
        columns r * n .. (r + 1) * n - 1, on every device."""
        g = self.group
        x = np.asarray(x, np.float32)
        if self.rank == 0:
            g._out = np.empty((*x.shape[:-1], self.size * x.shape[-1]), np.float32)
        self._meet_first()
        out = g._out
        assert out is not None
        n = x.shape[-1]
        out[..., self.rank * n:(self.rank + 1) * n] = x
        self._meet_last()
        return out

    def broadcast(self, x: np.ndarray, root: int = 0) -> np.ndarray:
        """Device `root`'s `x` on every device (a copy on each; `x` is ignored elsewhere
        but for its shape)."""
        g = self.group
        if self.rank == root:
            g._slots[root] = np.ascontiguousarray(x)
        self._meet_first()
        src = g._slots[root]
        assert src is not None
        out = src.copy()
        self._meet_last()
        return out
