"""How the cpu backend's matmuls use the machine's cores.

Two kinds of parallel work share the cores: the fused GEMVs (numba `prange`, OpenMP
threads) and the many-rows path (a tile of weights dequantized, then BLAS). Left alone,
numpy's OpenBLAS starts its own threads for each product and keeps them spinning after
it, and on a 2-core machine they and numba's threads took turns being descheduled inside
each other's barriers: the 126 tile products of the demo model's layers at 8 rows took
0.4-1.5 s instead of 80 ms, even with the machine otherwise idle. The spinning threads
also take the cores from the host threads eager dispatch overlaps with a round (with
float32 weights, `eagerlm profile --synthetic tiny` used 1.7 cores for one core's work). So
once a cpu backend is built, numpy's BLAS runs on one thread in this process
(threadpoolctl; OpenBLAS's threads then sleep) and the big products parallelize
themselves: `CoreWorkers` splits the output features in one contiguous share per core
(`by_output_features`). The quantized many-rows path dequantizes its share tile by tile
into a reused buffer per worker and multiplies it with single-threaded BLAS; a float32
matrix's share is multiplied directly (numba and BLAS both release the GIL). The rest of
the forward's numpy products (attention) are small beside the weights' and run on the
calling thread, or split by rows (`by_rows`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
from threadpoolctl import ThreadpoolController


def core_count() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def _pin(cores: Sequence[int] | None) -> None:
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)  # 0: the calling thread, on Linux


class CoreWorkers:
    """One thread per core, each with its own state (`local`, e.g. its tile buffer); `run`
    calls `part(i, parts)` for every share i on them and waits. The calling thread runs
    share 0 itself, so a call costs one hand-off, not two. With `cores`, the threads are
    pinned to them (a cpu device's worker group, `device_cores`)."""

    def __init__(self, workers: int | None = None, cores: Sequence[int] | None = None) -> None:
        self.parts = workers or (len(cores) if cores else core_count())
        self._pool = (ThreadPoolExecutor(self.parts - 1, thread_name_prefix="eagerlm-cpu",
                                         initializer=_pin, initargs=(cores,))
                      if self.parts > 1 else None)
        self.local = threading.local()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def run(self, part: Callable[[int, int], None]) -> None:
        futures = [self._pool.submit(part, i, self.parts) for i in range(1, self.parts)
                   ] if self._pool is not None else []
        try:
            part(0, self.parts)
        finally:
            for f in futures:
                f.result()


_workers: CoreWorkers | None = None
_lock = threading.Lock()
_device = threading.local()  # .workers: the worker group of the device this thread runs


def core_workers() -> CoreWorkers:
    """The workers of the cpu device the calling thread runs (`device_cores`), else the
    process's, created on first use."""
    mine = getattr(_device, "workers", None)
    if mine is not None:
        return mine
    global _workers
    with _lock:
        if _workers is None:
            _workers = CoreWorkers()
        return _workers


def core_shares(n: int) -> list[list[int]]:
    """The process's cores cut into `n` contiguous shares, one per cpu device of a
    tensor-parallel group (with fewer cores than devices, devices share cores)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (macOS, Windows)
        cores = list(range(core_count()))
    if len(cores) < n:
        return [[cores[r % len(cores)]] for r in range(n)]
    return [cores[r * len(cores) // n:(r + 1) * len(cores) // n] for r in range(n)]


@contextlib.contextmanager
def device_cores(cores: Sequence[int]) -> Iterator[None]:
    """Within, the calling thread is one cpu device's: pinned to `cores`, its products
    split over a worker group pinned to the same cores, its numba kernels on as many
    threads (numba's thread count is per calling thread; OpenMP's team inherits the
    pinning). A tensor-parallel group's devices each run on their own share this way."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    _pin(cores)
    workers = CoreWorkers(cores=cores)
    _device.workers = workers
    try:
        yield
    finally:
        _device.workers = None
        workers.close()
        _pin(sorted(before) if before is not None else None)


def hold_blas_to_one_thread() -> None:
    """Set numpy's BLAS to one thread, for the rest of the process (each time a cpu
    backend is built: a BLAS library loaded since is caught too; ~5 ms). Limited only
    around the many-rows path, OpenBLAS's threads, woken by any other product of the
    forward (attention), still spun through the next tile products."""
    ThreadpoolController().select(user_api="blas").limit(limits=1)


# Below this many multiply-adds a product runs on the calling thread alone: waking the
# workers (ours, or numba's sleeping ones) costs ~20-50 µs, more than a 256 x 640 GEMV
# takes on one core.
SERIAL_MAX_VALUES = 1 << 18


def by_output_features(n_values: int, out_features: int,
                       part: Callable[[int, int], None]) -> None:
    """`part(start, stop)` over one contiguous share of a product's `out_features` per
    core, or over all of them on the calling thread when the product (`n_values`
    multiply-adds) is too small to pay for the hand-off."""
    workers = core_workers() if n_values >= SERIAL_MAX_VALUES else None
    if workers is None or workers.parts == 1:
        part(0, out_features)
        return
    per_share = -(-out_features // workers.parts)
    workers.run(lambda i, parts: part(min(out_features, i * per_share),
                                      min(out_features, (i + 1) * per_share)))


# numba's workqueue threading layer (used where neither OpenMP nor TBB is installed) must
# not be entered by two threads at once; two engines in one process share the parallel
# kernels. OpenMP and TBB take concurrent callers (each OpenMP caller gets its own team),
# which a tensor-parallel group's devices are.
_NUMBA_LOCK = threading.Lock()


def _numba_lock() -> contextlib.AbstractContextManager[object]:
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet: the layer is not chosen
        return _NUMBA_LOCK
    return _NUMBA_LOCK if layer == "workqueue" else contextlib.nullcontext()


@contextlib.contextmanager
def numba_threads(n_values: int) -> Iterator[None]:
    """Run a numba parallel kernel of `n_values` multiply-adds: on every core of the
    calling thread's device, or on one thread below `SERIAL_MAX_VALUES`."""
    with _numba_lock():
        numba.set_num_threads(1 if n_values < SERIAL_MAX_VALUES else
                              min(core_workers().parts, numba.config.NUMBA_NUM_THREADS))
        yield


SPLIT_MIN_ROWS = 32  # fewer rows stay on the calling thread: a hand-off costs ~20-50 µs


def by_rows(n_rows: int, part: Callable[[int, int], None], *, causal: bool = False) -> None:
    """`part(start, stop)` over one contiguous share of `n_rows` rows per core (numpy
    releases the GIL in its loops), or over all of them on the calling thread when they
    are few. `causal`: row i costs about i (a prompt's attention), so the shares are cut
    at n * sqrt(i / cores) to take equal time."""
    workers = core_workers() if n_rows >= SPLIT_MIN_ROWS else None
    if workers is None or workers.parts == 1:  # decode's one row per session: no lock
        part(0, n_rows)
        return

    def cut(i: int, parts: int) -> int:
        share = (i / parts) ** 0.5 if causal else i / parts
        return min(n_rows, round(n_rows * share))

    workers.run(lambda i, parts: part(cut(i, parts), cut(i + 1, parts)))
