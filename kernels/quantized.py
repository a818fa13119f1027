"""A weight matrix kept in its GGUF blocks on the cpu, and the matmul and row lookup over it.

`QuantizedMatrix` is what the cpu backend holds for a quantized (or float16 / bfloat16)
matrix: the file's bytes, `[rows, row_bytes]`, so it takes what the file takes. The ops
(kernels/numpy_ops.py) accept it wherever they accept a float32 matrix:

- `quantized_linear(x, w)`: x @ w^T. With at most `FUSED_MAX_ROWS` rows of x (decode) and a
  type with compiled kernels (`FUSED`: Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K: what Q4_K_M,
  Q5_K_M and Q8_0 files hold, Q5_0 where a row is not whole 256-value superblocks) it is
  one fused dequantize-dot pass over the blocks (kernels/cpu_quant_kernels.py).
  Otherwise `TILE_ELEMENTS` worth of weight rows at a time is dequantized into one reused
  float32 buffer (the compiled dequantizers, or gguf-py's for the other types) and
  multiplied by BLAS into its slice of the output: one tile is all the extra memory.
- `QuantizedMatrix.take(ids)`: rows dequantized (the embedding lookup).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eagerlm.kernels import cpu_quant_kernels as k
from eagerlm.loader.weights import dequantize_blocks

Q = GGMLQuantizationType

Gemv = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
Dequant = Callable[[np.ndarray, int, np.ndarray], None]

# The types with compiled kernels: (fused gemv, row dequantizer).
FUSED: dict[GGMLQuantizationType, tuple[Gemv, Dequant]] = {
    Q.Q4_0: (k.gemv_q4_0, k.dequant_q4_0),
    Q.Q5_0: (k.gemv_q5_0, k.dequant_q5_0),
    Q.Q8_0: (k.gemv_q8_0, k.dequant_q8_0),
    Q.Q4_K: (k.gemv_q4_k, k.dequant_q4_k),
    Q.Q5_K: (k.gemv_q5_k, k.dequant_q5_k),
    Q.Q6_K: (k.gemv_q6_k, k.dequant_q6_k),
}
# Rows of x up to which the fused kernel runs. Its cost grows with the rows (it decodes
# the blocks again for each), the tile path's barely (one dequantization, then BLAS);
# measured on 2 cores (the demo model's shapes, Q5_0 / Q4_K / Q6_K / Q8_0) the two cross
# between 8 and 16 rows.
FUSED_MAX_ROWS = 8
TILE_ELEMENTS = 1 << 18  # weights per tile: 1 MiB of float32, cache-sized

# numba's workqueue threading layer (used where neither OpenMP nor TBB is installed) must
# not be entered by two threads at once; two engines in one process share the parallel
# kernels (the GEMVs).
_KERNEL_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False)
class QuantizedMatrix:
    """A matrix of the file held as its blocks: `shape` (out_features, in_features) as the
    forward uses it, `blocks` uint8 `[out_features, row bytes]`, C-contiguous."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    blocks: np.ndarray

    @classmethod
    def of(cls, qtype: GGMLQuantizationType, shape: tuple[int, ...],
           raw: np.ndarray) -> QuantizedMatrix:
        """A copy of a tensor's raw bytes (`raw`, as the file stores them)."""
        rows, cols = shape
        block, type_size = GGML_QUANT_SIZES[qtype]
        if cols % block:
            raise ValueError(f"rows of {cols} values are not whole {qtype.name} blocks")
        blocks = np.array(raw, dtype=np.uint8, copy=True).reshape(rows, cols // block * type_size)
        return cls(qtype, (rows, cols), blocks)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def dtype(self) -> np.dtype:
        """What it computes as (so code that asks an array's dtype gets an answer)."""
        return np.dtype(np.float32)

    def dequantize_rows(self, start: int, out: np.ndarray) -> np.ndarray:
        """Rows start .. start + len(out) as float32 into `out`."""
        fused = FUSED.get(self.qtype)
        if fused is not None:
            fused[1](self.blocks, start, out)  # one thread: no lock needed
        else:
            out[:] = _dequantize_other(self.blocks[start:start + len(out)], self.qtype
                                       ).reshape(out.shape)
        return out

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` as float32 `[len(ids), in_features]` (an embedding lookup)."""
        rows = QuantizedMatrix(self.qtype, (len(ids), self.shape[1]),
                               np.ascontiguousarray(self.blocks[np.asarray(ids)]))
        return rows.dequantize_rows(0, np.empty(rows.shape, np.float32))

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (tests, comparisons)."""
        return self.dequantize_rows(0, np.empty(self.shape, np.float32))


def _dequantize_other(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Blocks of a type without compiled kernels, by numpy (float16, bfloat16, gguf-py)."""
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return dequantize_blocks(raw.reshape(-1), qtype)


def quantized_linear(x: np.ndarray, w: QuantizedMatrix) -> np.ndarray:
    """x @ w^T, float32 `[rows of x, out_features]`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    out_features, in_features = w.shape
    y = np.empty((n, out_features), np.float32)
    fused = FUSED.get(w.qtype)
    if fused is not None and n <= FUSED_MAX_ROWS:
        with _KERNEL_LOCK:
            fused[0](w.blocks, x, y)
        return y
    tile_rows = max(1, min(out_features, TILE_ELEMENTS // in_features))
    tile = np.empty((tile_rows, in_features), np.float32)
    for start in range(0, out_features, tile_rows):
        part = tile[:min(tile_rows, out_features - start)]
        w.dequantize_rows(start, part)
        y[:, start:start + len(part)] = x @ part.T
    return y


def warm_up(qtypes: Iterable[GGMLQuantizationType]) -> float:
    """Compile (or load from numba's disk cache) the kernels of `qtypes`, on tiny inputs;
    returns the seconds it took. The first forward would otherwise pay it."""
    t0 = time.perf_counter()
    for qtype in sorted(set(qtypes) & FUSED.keys()):
        block, type_size = GGML_QUANT_SIZES[qtype]
        w = QuantizedMatrix(qtype, (1, block), np.zeros((1, type_size), np.uint8))
        quantized_linear(np.zeros((1, block), np.float32), w)
        w.dequantize()
    return time.perf_counter() - t0
