"""The cpu backend: float32 numpy weights and the numpy reference ops."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from kernels.model import Transformer
from kernels.numpy_ops import NumpyOps
from loader.gguf_file import TensorInfo
from loader.model_file import ModelFile
from loader.weights import build_weights, dequantize


class ModelTooLarge(MemoryError):
    """The model's weights as float32 would not fit in the memory available: raised before
    loading, instead of the kernel's out-of-memory killer ending the process midway."""


def available_memory(cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of memory a new allocation may take without swapping or being killed: Linux's
    MemAvailable, or less where a cgroup v2 memory limit (a container's) leaves less; None
    where neither is known."""
    limits: list[int] = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as fh:
            limit = fh.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as fh:
            current = int(fh.read().strip())
        if limit != "max":
            limits.append(max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def float32_bytes(model: ModelFile) -> int:
    """What the cpu backend's weights of `model` take: 4 bytes per parameter."""
    return 4 * sum(info.n_elements for info in model.gguf.tensors.values())


def check_fits_in_memory(model: ModelFile, available: int | None = None) -> None:
    """Raise ModelTooLarge if the float32 weights need more than the memory available
    (`available`, default: available_memory(); unknown: no check)."""
    if available is None:
        available = available_memory()
    need = float32_bytes(model)
    if available is not None and need > available:
        raise ModelTooLarge(
            f"the cpu backend holds weights as float32: {_size(need)} for "
            f"{os.path.basename(model.path)}, but only {_size(available)} of memory is "
            "available; run it on a GPU (--device cuda) or choose a smaller model")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def cpu_transformer(model: ModelFile, on_bytes: Callable[[int, int], None] | None = None
                    ) -> Transformer[np.ndarray]:
    """Dequantize every weight of the file to float32 and pair them with numpy ops.

    `on_bytes(done, total)` is called as tensors load (bytes of the file's tensor data), so
    a caller can show progress; it starts at (0, total) and ends at (total, total). Raises
    ModelTooLarge, before loading anything, where the weights would not fit in memory."""
    check_fits_in_memory(model)
    f = model.gguf
    total = sum(info.n_bytes for info in f.tensors.values())
    done = 0

    def fetch(info: TensorInfo) -> np.ndarray:
        nonlocal done
        array = dequantize(f, info)
        done += info.n_bytes
        if on_bytes is not None:
            on_bytes(done, total)
        return array

    if on_bytes is not None:
        on_bytes(0, total)
    weights = build_weights(f, model.config, fetch)
    if on_bytes is not None:
        on_bytes(total, total)  # tensors the architecture does not use count as done
    return Transformer(model.config, weights, NumpyOps())
