"""What the GPU benchmarks share: opening the GPU (or saying plainly that there is none),
timing on a device stream (seconds per call from events around back-to-back calls), and
the device's copy bandwidth (the memory roofline they compare against)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def open_gpu(bench: str) -> Any | None:
    """The cuda device, or None after printing that `bench` measured nothing because this
    machine has no GPU (so a benchmark run without one exits 0 and says why)."""
    try:
        from eagerlm.vmm.cuda_driver import NoCudaDevice
        from eagerlm.vmm.device import open_device
    except ImportError as exc:
        print(f"{bench}: cuda bindings not importable ({exc}); nothing measured.")
        return None
    try:
        return open_device("cuda")
    except NoCudaDevice as exc:
        print(f"{bench}: no CUDA GPU here ({exc}); nothing measured.")
        return None


def time_on_stream(device: Any, stream: Any, fn: Callable[[], Any], reps: int,
                   warmup: int = 3) -> float:
    """Seconds per call of `fn`, which only enqueues work on `stream`: events around `reps`
    back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    start = stream.record(device.event())
    for _ in range(reps):
        fn()
    end = stream.record(device.event())
    end.synchronize()
    return start.elapsed_ms(end) / 1e3 / reps


def copy_bandwidth(device: Any, stream: Any, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device memory bandwidth in bytes/s: a device-to-device copy reads and writes each
    byte, so 2 x nbytes per copy."""
    a, b = device.alloc(nbytes), device.alloc(nbytes)
    try:
        sec = time_on_stream(device, stream, lambda: stream.copy_d2d(b, a, nbytes), reps, 2)
    finally:
        a.free()
        b.free()
    return 2 * nbytes / sec
