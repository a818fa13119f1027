"""The cpu backend's collectives: the devices of a tensor-parallel group exchange their
partial results through shared host memory.

A cpu device is a worker group on its share of the cores (kernels/cpu_threads.py's
`device_cores`), all of them in this process, so shared memory is the address space.

The all-reduce, two per layer, is compiled code on both sides (`Exchange`): each device
copies its rows into its slot of the group's exchange buffer, counts itself in with an
atomic add and spins until every device has (kernels/cpu_sync.py), then sums every slot
into its own rows, in rank order for every element, so every device gets the same bits
(a replicated residual stream stays identical on every device, as NCCL's all-reduce keeps
it on GPUs). Two sets of slots alternate, so a device's next all-reduce never writes a slot
another device may still read: to reach it every device must have counted itself into
the one between, after reading. The decode replay runs it as a step of its table
(kernels/cpu_decode_program.py), without returning to Python; the ops call the same
function (with the GIL released) for the other forwards, so the devices meet in the same
sequence whichever path each takes. Before, it was a `threading.Barrier` twice and numpy
sums, from Python between runs of the replay's table: 20-40 us a call on this machine.

The all-gather and the broadcast, once a round, keep a barrier: each device publishes
its array in its slot of the group's table, the devices meet, each reads, and they meet
again before a slot may be reused.

A device that fails aborts the group (`HostGroup.abort`): the others raise
`threading.BrokenBarrierError` at their next collective instead of waiting forever.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from eagerlm.kernels.aligned_arrays import aligned_empty
from eagerlm.kernels.cpu_sync import (
    SCHED_YIELD,
    atomic_add,
    atomic_load,
    cycles,
    cycles_per_second,
    spin_until,
)
from eagerlm.kernels.numba_settings import JIT_ORDERED


@dataclass
class CollectiveStats:
    """What one device's collectives cost (benchmarks/bench_tensor_parallel.py): calls,
    seconds waiting for the other devices to arrive (their imbalance: the bubble this
    device sits in; an all-reduce's spin, the others' first barrier), and seconds in the
    rest (the all-reduce's sum; the others' copies and second barrier)."""

    calls: int = 0
    wait_s: float = 0.0
    work_s: float = 0.0


# the exchange's control words, one a cache line (8 int64) so that no two devices write
# one line: the arrivals of the two slot sets, the abort flag, then per rank its
# exchanges so far, and its cycles waiting for the others and summing
_LINE = 8
_ARRIVED, _ABORT, _PER_RANK = 0, 2, 3
# floats per slot: an all-reduce of more goes in pieces (a decode batch of 8 rows of
# 4096 is one)
EXCHANGE_FLOATS = 1 << 15


class Exchange:
    """A group's all-reduce buffers: `data` float32 `[2 sets, size, capacity]` and its
    `control` words (`_ARRIVED`, `_ABORT`, `_PER_RANK`), what `exchange_sum` and the
    replay's REDUCE step work on."""

    def __init__(self, size: int, capacity: int = EXCHANGE_FLOATS) -> None:
        self.size = size
        self.capacity = capacity
        self.data = aligned_empty(2 * size * capacity, np.float32)
        self.control = np.zeros(_LINE * (_PER_RANK + 3 * size), np.int64)

    def sum(self, rank: int, x: np.ndarray) -> None:
        """x (float32, C-contiguous) summed over the group in place: every device's call
        with the same shape, in the same order as the others'."""
        if not exchange_sum(self.data, self.control, rank, self.size, self.capacity,
                            x.reshape(-1), SCHED_YIELD):
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        self.control[_LINE * _ABORT] = 1

    @property
    def aborted(self) -> bool:
        return bool(self.control[_LINE * _ABORT])

    def counts(self, rank: int) -> tuple[int, int, int]:
        """Device `rank`'s exchanges so far (an all-reduce of more than `capacity` floats
        is several), and its cycles waiting and summing."""
        at = _LINE * (_PER_RANK + rank)
        step = _LINE * self.size
        return (int(self.control[at]), int(self.control[at + step]),
                int(self.control[at + 2 * step]))


@njit(**JIT_ORDERED)
def exchange_sum(data, control, rank, size, capacity, x, sched_yield) -> bool:
    """x summed in place over the `size` devices calling this with their x (see the module
    docstring), `capacity` floats at a time; False if the group was aborted (x then
    holds anything). JIT_ORDERED: the sum in rank order, per element."""
    mine = _LINE * (_PER_RANK + rank)
    waited, summed = _LINE * (_PER_RANK + size + rank), _LINE * (_PER_RANK + 2 * size + rank)
    n = x.size
    for start in range(0, n, capacity):
        if atomic_load(control, _LINE * _ABORT) != 0:  # (its arrival counts may be off)
            return False
        m = min(capacity, n - start)
        g = control[mine]  # this device's all-reduces so far: only it writes the word
        s = g & 1
        slots = s * size * capacity
        data[slots + rank * capacity:slots + rank * capacity + m] = x[start:start + m]
        t0 = cycles()
        atomic_add(control, _LINE * (_ARRIVED + s), 1)
        if not spin_until(control, _LINE * (_ARRIVED + s), size * (g // 2 + 1),
                          _LINE * _ABORT, sched_yield):
            return False
        t1 = cycles()
        for j in range(m):
            acc = data[slots + j]
            for r in range(1, size):
                acc += data[slots + r * capacity + j]
            x[start + j] = acc
        control[mine] = g + 1
        control[waited] += t1 - t0
        control[summed] += cycles() - t1
    return True


class HostGroup:
    """The shared state of `size` cpu devices: the all-reduce's `exchange`, the slots and
    the barrier of the others. `member(r)` is device r's end, what its ops call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.exchange = Exchange(size)
        # compiled (or loaded from numba's cache) with the group, not in its first forward
        Exchange(1, 1).sum(0, np.zeros(1, np.float32))
        self._barrier = threading.Barrier(size)
        self._slots: list[np.ndarray | None] = [None] * size
        self._out: np.ndarray | None = None

    def member(self, rank: int) -> HostCollective:
        return HostCollective(self, rank)

    def abort(self) -> None:
        """Break the barrier and the exchange: every device waiting in a collective, or
        entering one, raises BrokenBarrierError (a device failed; the group cannot go
        on)."""
        self.exchange.abort()
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
        self._stats = CollectiveStats()  # the barrier's collectives

    @property
    def stats(self) -> CollectiveStats:
        """This device's collectives so far, the all-reduces' counted by the exchange."""
        calls, waited, summed = self.group.exchange.counts(self.rank)
        rate = cycles_per_second()
        own = self._stats
        return CollectiveStats(own.calls + calls, own.wait_s + waited / rate,
                               own.work_s + summed / rate)

    def _meet_first(self) -> None:
        t0 = time.perf_counter()
        self.group._meet()
        self._t = time.perf_counter()
        self._stats.calls += 1
        self._stats.wait_s += self._t - t0

    def _meet_last(self) -> None:
        self.group._meet()
        self._stats.work_s += time.perf_counter() - self._t

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The element-wise sum of every device's `x` (float32, same shape), on every device:
        a new array (`Exchange.sum`)."""
        out = np.array(x, np.float32, order="C")
        self.group.exchange.sum(self.rank, out)
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
