"""The matmul loops of the 16-bit float weight types (F16, BF16), written once over a
value loader.

A template, as kernels/cpu_quant_loops.py is (see there why): kernels/cpu_kernel_registry.py
copies everything below the `-- loops --` line into one generated module per type, after
lines binding `load_values(row, byte_offset)` (8 values as a `Float32x8`) and
`load_value(row, byte_offset)` (one, float32). Weights stay 2 bytes a value and are
converted in registers (F16C's `vcvtph2ps` for F16, a 16-bit shift for BF16); the
activations stay float32, so these products round only as float32 sums do.

- `gemv(w, x, y, r0, r1)`: y[j, r] = dot(row r of w, x[j]) for rows r0 .. r1 - 1 of w and
  every row of x (up to `MAX_ROWS`); weights are converted once per two rows of x.
- `dequant(w, r0, out)`: rows of w as float32 (tiles for BLAS, the embedding lookup).
- `row_kernel_address()`: `gemv` as a C function of kernels/cpu_row_kernel.py's
  `ROW_KERNEL` signature (what the decode replay calls), compiled on first use.
"""

from __future__ import annotations

# -- type binding: replaced in each generated module -------------------------------------------
from eagerlm.kernels.cpu_simd import load_f16 as load_value
from eagerlm.kernels.cpu_simd import load_f16x8 as load_values

VALUE_BYTES = 2

# -- loops: copied into each generated module --------------------------------------------------
from numba import njit  # noqa: E402

from eagerlm.kernels.cpu_simd import (  # noqa: E402
    lane_sum,
    load_f32x8,
    muladd,
    store_f32x8,
    zeros_f32x8,
)
from eagerlm.kernels.numba_settings import JIT_ORDERED  # noqa: E402

MAX_ROWS = 64  # rows of x `gemv` takes at most (as the block types' loops)


@njit(inline="always", **JIT_ORDERED)
def _finish(a0, a1, a2, a3, wr, xr, whole, k):
    """A row's four vectors of partial sums summed, plus the products of the values past
    the last whole 32."""
    total = lane_sum((a0 + a1) + (a2 + a3))
    for i in range(whole, k):
        total += load_value(wr, VALUE_BYTES * i) * xr[i]
    return total


@njit(**JIT_ORDERED)
def gemv(w, x, y, r0, r1):
    """Each row of x sums its products in four vectors of eight lanes (values 32c + 8a ..
    into vector a), then ((0 + 1) + (2 + 3)) lane-summed, then the tail: the same order for
    every row, alone or in a batch. Two rows of x at a time share each 32 converted
    weights (eight sums in registers); an odd last row alone."""
    n, k = x.shape
    whole = k // 32 * 32
    pairs = n // 2 * 2
    for r in range(r0, r1):
        wr = w[r]
        for j in range(0, pairs, 2):
            x0, x1 = x[j], x[j + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zeros_f32x8()
            for i in range(0, whole, 32):
                o = VALUE_BYTES * i
                v0 = load_values(wr, o)
                v1 = load_values(wr, o + 8 * VALUE_BYTES)
                v2 = load_values(wr, o + 16 * VALUE_BYTES)
                v3 = load_values(wr, o + 24 * VALUE_BYTES)
                a0 = muladd(v0, load_f32x8(x0, i), a0)
                a1 = muladd(v1, load_f32x8(x0, i + 8), a1)
                a2 = muladd(v2, load_f32x8(x0, i + 16), a2)
                a3 = muladd(v3, load_f32x8(x0, i + 24), a3)
                b0 = muladd(v0, load_f32x8(x1, i), b0)
                b1 = muladd(v1, load_f32x8(x1, i + 8), b1)
                b2 = muladd(v2, load_f32x8(x1, i + 16), b2)
                b3 = muladd(v3, load_f32x8(x1, i + 24), b3)
            y[j, r] = _finish(a0, a1, a2, a3, wr, x0, whole, k)
            y[j + 1, r] = _finish(b0, b1, b2, b3, wr, x1, whole, k)
        for j in range(pairs, n):
            xj = x[j]
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for i in range(0, whole, 32):
                o = VALUE_BYTES * i
                a0 = muladd(load_values(wr, o), load_f32x8(xj, i), a0)
                a1 = muladd(load_values(wr, o + 8 * VALUE_BYTES), load_f32x8(xj, i + 8), a1)
                a2 = muladd(load_values(wr, o + 16 * VALUE_BYTES), load_f32x8(xj, i + 16), a2)
                a3 = muladd(load_values(wr, o + 24 * VALUE_BYTES), load_f32x8(xj, i + 24), a3)
            y[j, r] = _finish(a0, a1, a2, a3, wr, xj, whole, k)


@njit(**JIT_ORDERED)
def dequant(w, r0, out):
    k = out.shape[1]
    whole = k // 8 * 8
    for t in range(out.shape[0]):
        wr, orow = w[r0 + t], out[t]
        for i in range(0, whole, 8):
            store_f32x8(orow, i, load_values(wr, VALUE_BYTES * i))
        for i in range(whole, k):
            orow[i] = load_value(wr, VALUE_BYTES * i)


# -- the row kernel: `gemv` behind kernels/cpu_row_kernel.py's C signature ----------------------
import functools  # noqa: E402

from numba import carray, cfunc  # noqa: E402

from eagerlm.kernels.cpu_row_kernel import ROW_KERNEL, f32_at, u8_at  # noqa: E402


def _row_kernel(w, x, scales, sums, y, n, k, rows, row_bytes, r0, r1):  # pragma: no cover
    gemv(carray(u8_at(w), (rows, row_bytes)), carray(f32_at(x), (n, k)),
         carray(f32_at(y), (n, rows)), r0, r1)


@functools.cache
def row_kernel_address() -> int:
    return cfunc(ROW_KERNEL, **JIT_ORDERED)(_row_kernel).address
