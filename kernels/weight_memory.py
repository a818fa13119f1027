"""Whether a model's weights fit in the memory they are loaded into, asked before loading.

Without the question, a model too large for the cpu backend (which holds the file's blocks,
or float32 when asked: kernels/cpu_backend.py's `held_bytes`) is ended midway by the
kernel's out-of-memory killer, and one too large for the GPU fails on some allocation deep
in the slab loader; with it, the user reads the size, the room and what to
do, and nothing has been loaded.
"""

from __future__ import annotations

import os

from eagerlm.errors import ModelTooLarge
from eagerlm.loader.model_file import ModelFile


def n_parameters(model: ModelFile) -> int:
    """Elements of every tensor in the file."""
    return sum(info.n_elements for info in model.gguf.tensors.values())


def available_memory(cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory a new allocation may take without swapping or being killed:
    Linux's MemAvailable, or less where a cgroup v2 memory limit (a container's) leaves
    less; None where neither is known."""
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


def check_fits(model: ModelFile, need: int, available: int | None, backend: str,
               held_as: str, advice: str) -> None:
    """Raise ModelTooLarge if `need` bytes of weights exceed `available` (None: unknown, no
    check)."""
    if available is not None and need > available:
        raise ModelTooLarge(
            f"{backend} holds weights as {held_as}: {_size(need)} for "
            f"{os.path.basename(model.path)}, but only {_size(available)} of memory is "
            f"available; {advice}")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
