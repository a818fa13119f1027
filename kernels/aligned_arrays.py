"""Host arrays that start on a cache line.

numpy aligns a small array's data to 16 bytes only (its allocator's malloc), so a kernel's
32-byte vector loads from an activation row cross a 64-byte cache line boundary half the
time, and such a load costs two. Measured on this project's 2-core AMD EPYC (AVX2), one
thread, 1024 x 1024 weights: the F16 `gemv` at 8 rows of x 17.1 G multiply-adds a second
with x 16 bytes past a line, 23.9 with x on a line (docs/performance.md). The activations
the kernels read (x, its 8-bit codes, the decode replay's arena) are therefore allocated
here.
"""

from __future__ import annotations

import numpy as np

CACHE_LINE = 64  # bytes


def aligned_empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a cache line."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.empty(count * dtype.itemsize + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def aligned(x: np.ndarray) -> np.ndarray:
    """x itself where its data starts on a cache line and it is C-contiguous, else an
    aligned copy."""
    if x.flags.c_contiguous and x.ctypes.data % CACHE_LINE == 0:
        return x
    out = aligned_empty(x.shape, x.dtype)
    out[...] = x
    return out
