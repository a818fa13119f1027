"""How the cpu backend's kernels use the machine's cores.

Every parallel piece of work runs on `CoreWorkers`, one thread per core, the caller
taking the first share: the weight kernels (kernels/quantized.py: one contiguous share of
the output features per core, `by_output_features`), the attention rows
(kernels/cpu_attention.py, `on_cores`), the many-rows path (a tile of weights dequantized
into a reused buffer per worker, then single-threaded BLAS), big float32 products, and a
prompt's numpy work split by rows (`by_rows`). The kernels are compiled without numba's
`parallel=True` (each releases the GIL), which also keeps their first-use compile short:
numba's parallel pipeline took 4.3 s of CPU for the attention kernel alone against 2.0 s
for the same loop serial.

Left alone, numpy's OpenBLAS starts its own threads for each product and keeps them
spinning after it, and on a 2-core machine they and numba's threads took turns being
descheduled inside each other's barriers: the 126 tile products of the demo model's
layers at 8 rows took 0.4-1.5 s instead of 80 ms, even with the machine otherwise idle.
The spinning threads also take the cores from the host threads eager dispatch overlaps
with a round (with float32 weights, `eagerlm profile --synthetic tiny` used 1.7 cores for
one core's work). So once a cpu backend is built, numpy's BLAS runs on one thread in this
process (threadpoolctl; OpenBLAS's threads then sleep).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

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

    def take_turns(self, n_pieces: int, piece: Callable[[int], None]) -> None:
        """`piece(i)` for every i < n_pieces, each claimed by whichever thread is free
        first: the caller and the workers take the next unclaimed one until none is left,
        and a worker that has not started by then is not waited for. A worker the OS is
        slow to schedule (the machine busy with other work) then costs nothing but the
        piece it may be in, where fixed shares waited for its whole share."""
        claim = itertools.count().__next__  # atomic: one call under the GIL

        def work() -> None:
            while (i := claim()) < n_pieces:
                piece(i)
        futures = [self._pool.submit(work) for _ in range(1, self.parts)
                   ] if self._pool is not None else []
        try:
            work()
        finally:
            for f in futures:
                if not f.cancel():
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
    split over a worker group pinned to the same cores. A tensor-parallel group's
    devices each run on their own share this way."""
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
# workers costs ~20-50 µs, more than a 256 x 640 GEMV takes on one core.
SERIAL_MAX_VALUES = 1 << 18


def by_output_features(n_values: int, out_features: int,
                       part: Callable[[int, int], None], *,
                       serial_max: int = SERIAL_MAX_VALUES) -> None:
    """`part(start, stop)` over one contiguous share of a product's `out_features` per
    core, or over all of them on the calling thread when the product (`n_values`
    multiply-adds) is too small to pay for the hand-off (below `serial_max`)."""
    workers = core_workers() if n_values >= serial_max else None
    if workers is None or workers.parts == 1:
        part(0, out_features)
        return
    per_share = -(-out_features // workers.parts)
    workers.run(lambda i, parts: part(min(out_features, i * per_share),
                                      min(out_features, (i + 1) * per_share)))


def by_output_pieces(n_values: int, out_features: int, part: Callable[[int, int], None], *,
                     serial_max: int = SERIAL_MAX_VALUES, per_core: int = 3) -> None:
    """`part(start, stop)` over `out_features` cut in `per_core` pieces per core, each
    run by whichever thread is free first (`CoreWorkers.take_turns`), or over all of them
    on the calling thread below `serial_max` multiply-adds (`n_values`)."""
    workers = core_workers() if n_values >= serial_max else None
    if workers is None or workers.parts == 1:
        part(0, out_features)
        return
    n_pieces = min(out_features, per_core * workers.parts)
    step = -(-out_features // n_pieces)
    workers.take_turns(-(-out_features // step), lambda i: part(
        i * step, min(out_features, (i + 1) * step)))


def on_cores(n_values: int, part: Callable[[int, int], None]) -> None:
    """`part(i, parts)` for every share i of a product of `n_values` multiply-adds, one
    per core, or `part(0, 1)` on the calling thread when it is too small to pay for the
    hand-off (`part` chooses what its share is)."""
    workers = core_workers() if n_values >= SERIAL_MAX_VALUES else None
    if workers is None or workers.parts == 1:
        part(0, 1)
        return
    workers.run(part)


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
