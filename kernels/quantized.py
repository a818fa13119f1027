"""A weight matrix kept in its GGUF blocks on the cpu, and the matmul and row lookup over it.

`QuantizedMatrix` is what the cpu backend holds for a quantized (or float16 / bfloat16)
matrix: the file's bytes, `[rows, row_bytes]`, so it takes what the file takes. The ops
(kernels/numpy_ops.py) accept it wherever they accept a float32 matrix:

- `quantized_linear(x, w)`: x @ w^T. For a type with compiled kernels (`FUSED`: Q4_0,
  Q5_0, Q8_0, Q4_K, Q5_K, Q6_K: what Q4_K_M, Q5_K_M and Q8_0 files hold, Q5_0 where a row
  is not whole 256-value superblocks; kernels/cpu_quant_kernels.py) one row of x (decode at
  batch 1) is one fused dequantize-dot pass over the blocks, and up to `FEW_ROWS` rows
  decode each weight row once into an L1 buffer and dot it with every row. Beyond that
  (prefill, big batches), and for every other type, `TILE_ELEMENTS` worth of weight rows
  at a time is dequantized into a reused float32 buffer (the compiled dequantizer, or
  gguf-py's) and multiplied by BLAS, one share of the output rows per core
  (kernels/cpu_threads.py): a tile per core is all the extra memory.
- `QuantizedMatrix.take(ids)`: rows dequantized (the embedding lookup).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eagerlm.kernels import cpu_quant_kernels as k
from eagerlm.kernels.cpu_threads import (
    by_output_features,
    core_workers,
    numba_threads,
)
from eagerlm.loader.weights import dequantize_blocks

Q = GGMLQuantizationType

Gemv = Callable[[np.ndarray, np.ndarray, np.ndarray], None]

# The types with compiled kernels, and their one-row fused GEMV; their rows decode through
# `k.dequant` / `k.gemv_rows` with the GGML type id.
FUSED: dict[GGMLQuantizationType, Gemv] = {
    Q.Q4_0: k.gemv_q4_0,
    Q.Q5_0: k.gemv_q5_0,
    Q.Q8_0: k.gemv_q8_0,
    Q.Q4_K: k.gemv_q4_k,
    Q.Q5_K: k.gemv_q5_k,
    Q.Q6_K: k.gemv_q6_k,
}
# How a product is computed, by the rows of x (measured on 2 cores, the demo model's
# matrices, docs/performance.md): one row, the fused GEMV (never a decoded value in
# memory); up to `FEW_ROWS`, `gemv_rows` (each weight row decoded once into an L1 buffer,
# dotted with every row of x); beyond, tiles dequantized and multiplied by BLAS.
FEW_ROWS = 64
TILE_ELEMENTS = 1 << 18  # weights per tile: 1 MiB of float32, cache-sized


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
        if self.qtype in FUSED:
            k.dequant(self.blocks, int(self.qtype), start, out)  # one thread: no lock
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
    if w.qtype in FUSED and n <= FEW_ROWS:
        with numba_threads(n * out_features * in_features):
            if n == 1:
                FUSED[w.qtype](w.blocks, x, y)
            else:
                k.gemv_rows(w.blocks, int(w.qtype), x, y)
        return y
    by_output_features(n * out_features * in_features, out_features,
                       partial(_tiles, x, w, y, core_workers().local))
    return y


def _tiles(x: np.ndarray, w: QuantizedMatrix, y: np.ndarray, local: threading.local,
           start: int, stop: int) -> None:
    """Output features start .. stop - 1: a tile of `TILE_ELEMENTS` weights at a time
    dequantized into this thread's buffer, times x by BLAS."""
    in_features = w.shape[1]
    tile_rows = max(1, min(stop - start, TILE_ELEMENTS // in_features))
    tile = getattr(local, "tile", None)
    if tile is None or tile.size < tile_rows * in_features:
        tile = local.tile = np.empty(TILE_ELEMENTS + in_features, np.float32)
    for s in range(start, stop, tile_rows):
        rows = min(tile_rows, stop - s)
        part = tile[:rows * in_features].reshape(rows, in_features)
        w.dequantize_rows(s, part)
        y[:, s:s + rows] = x @ part.T


def warm_up(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """Compile (or load from numba's disk cache) the kernels of `qtypes`, on tiny inputs
    (cpu_backend.compile_kernels times it with the others). The first forward would
    otherwise pay it."""
    for qtype in sorted(set(qtypes) & FUSED.keys()):
        block, type_size = GGML_QUANT_SIZES[qtype]
        w = QuantizedMatrix(qtype, (1, block), np.zeros((1, type_size), np.uint8))
        for rows in (1, 2):  # the one-row GEMV, `gemv_rows`
            quantized_linear(np.zeros((rows, block), np.float32), w)
        w.dequantize()  # `dequant`, the tiles
