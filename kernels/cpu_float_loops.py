"""The matmul loops of the float weight types, written once over a value loader: F16 and
BF16, and F32 matrices' products of up to `FIXED_ORDER_ROWS` rows (kernels/cpu_row_kernel.py).

A template, as kernels/cpu_quant_loops.py is (see there why): kernels/cpu_kernel_registry.py
copies everything below the `-- loops --` line into one generated module per type, after
lines binding `load_values(row, byte_offset)` (8 values as a `Float32x8`) and
`load_value(row, byte_offset)` (one, float32). Weights stay 2 bytes a value (F32's 4) and
are converted in registers (F16C's `vcvtph2ps` for F16, a 16-bit shift for BF16); the
activations stay float32, so these products round only as float32 sums do.

- `gemv(w, x, y, r0, r1)`: y[j, r] = dot(row r of w, x[j]) for rows r0 .. r1 - 1 of w and
  every row of x (up to `MAX_ROWS`), in register tiles of up to 3 x 4 (see `gemv`).
- `dequant(w, r0, out)`: rows of w as float32 (tiles for BLAS, the embedding lookup).
- `row_kernel_address()`: `gemv` as a C function of kernels/cpu_row_kernel.py's
  `ROW_KERNEL` signature (what the decode replay calls), compiled on first use from
  `row_kernel`.
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
W_ROWS = 6  # rows of w a pass of `gemv` takes: two 3 x 4 tiles, one 6 x 2 or one 6 x 1


@njit(inline="always", **JIT_ORDERED)
def _store(y, j, r, n, end, acc):
    """y[j, r] = the lanes of acc summed, if (j, r) is inside y (rows at or past `end`
    and past the rows of x are a tile's repeats, computed but not stored). Takes no
    weight or x row: a helper taking arrays under a branch makes numba count references
    on each call, which cost a 3 x 4 tile a third of its time."""
    if j < n and r < end:
        y[j, r] = lane_sum(acc)


@njit(inline="always", **JIT_ORDERED)
def _store_column(y, j, r, n, end, a0, a1, a2, a3):
    """Weight row r's sums with rows j .. j + 3 of x (`_store` each)."""
    _store(y, j, r, n, end, a0)
    _store(y, j + 1, r, n, end, a1)
    _store(y, j + 2, r, n, end, a2)
    _store(y, j + 3, r, n, end, a3)


@njit(inline="always", **JIT_ORDERED)
def _tile_3x4(w0, w1, w2, x0, x1, x2, x3, y, r0, r1, r2, j, n, end, whole):
    """Three rows of w times four of x: twelve sums in registers, each converted weight
    vector used four times and each x vector three (the F16C conversion and the loads
    from L2, not the multiply-adds, bound a tile with fewer rows of x)."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = zeros_f32x8()
    for i in range(0, whole, 8):
        o = VALUE_BYTES * i
        v0, v1, v2 = load_values(w0, o), load_values(w1, o), load_values(w2, o)
        u = load_f32x8(x0, i)
        a00, a10, a20 = muladd(v0, u, a00), muladd(v1, u, a10), muladd(v2, u, a20)
        u = load_f32x8(x1, i)
        a01, a11, a21 = muladd(v0, u, a01), muladd(v1, u, a11), muladd(v2, u, a21)
        u = load_f32x8(x2, i)
        a02, a12, a22 = muladd(v0, u, a02), muladd(v1, u, a12), muladd(v2, u, a22)
        u = load_f32x8(x3, i)
        a03, a13, a23 = muladd(v0, u, a03), muladd(v1, u, a13), muladd(v2, u, a23)
    _store_column(y, j, r0, n, end, a00, a01, a02, a03)
    _store_column(y, j, r1, n, end, a10, a11, a12, a13)
    _store_column(y, j, r2, n, end, a20, a21, a22, a23)


@njit(inline="always", **JIT_ORDERED)
def _tile_6x2(w0, w1, w2, w3, w4, w5, x0, x1, y, r0, r1, r2, r3, r4, r5, j, n, end,
              whole):
    """Six rows of w times two of x (twelve sums), for the last two rows of x."""
    a0 = a1 = a2 = a3 = a4 = a5 = b0 = b1 = b2 = b3 = b4 = b5 = zeros_f32x8()
    for i in range(0, whole, 8):
        o = VALUE_BYTES * i
        u, t = load_f32x8(x0, i), load_f32x8(x1, i)
        v = load_values(w0, o)
        a0, b0 = muladd(v, u, a0), muladd(v, t, b0)
        v = load_values(w1, o)
        a1, b1 = muladd(v, u, a1), muladd(v, t, b1)
        v = load_values(w2, o)
        a2, b2 = muladd(v, u, a2), muladd(v, t, b2)
        v = load_values(w3, o)
        a3, b3 = muladd(v, u, a3), muladd(v, t, b3)
        v = load_values(w4, o)
        a4, b4 = muladd(v, u, a4), muladd(v, t, b4)
        v = load_values(w5, o)
        a5, b5 = muladd(v, u, a5), muladd(v, t, b5)
    for r, a, b in ((r0, a0, b0), (r1, a1, b1), (r2, a2, b2), (r3, a3, b3), (r4, a4, b4),
                    (r5, a5, b5)):
        _store(y, j, r, n, end, a)
        _store(y, j + 1, r, n, end, b)


@njit(inline="always", **JIT_ORDERED)
def _tile_6x1(w0, w1, w2, w3, w4, w5, x0, y, r0, r1, r2, r3, r4, r5, j, n, end, whole):
    """Six rows of w times one of x: six independent chains of multiply-adds (a decode
    step's one row, or a batch's odd last)."""
    a0 = a1 = a2 = a3 = a4 = a5 = zeros_f32x8()
    for i in range(0, whole, 8):
        o = VALUE_BYTES * i
        u = load_f32x8(x0, i)
        a0 = muladd(load_values(w0, o), u, a0)
        a1 = muladd(load_values(w1, o), u, a1)
        a2 = muladd(load_values(w2, o), u, a2)
        a3 = muladd(load_values(w3, o), u, a3)
        a4 = muladd(load_values(w4, o), u, a4)
        a5 = muladd(load_values(w5, o), u, a5)
    for r, a in ((r0, a0), (r1, a1), (r2, a2), (r3, a3), (r4, a4), (r5, a5)):
        _store(y, j, r, n, end, a)


@njit(**JIT_ORDERED)
def gemv(w, x, y, r0, r1):
    """y[j, r] for each pair of a row r of w and a row j of x: the products of values
    8c .. 8c + 7 summed in one vector of eight lanes over c, the lanes summed, then the
    products past the last whole 8 added in order. The same order for every pair, alone
    or in a batch, whichever tile computed it.

    Rows r0 .. r1 - 1 of w are cut into W_ROWS spans of consecutive rows, and each pass
    takes the next row of every span, so the weights arrive as W_ROWS long sequential
    streams: six rows side by side in memory (one 12 KB stretch read six places at once)
    took twice as long from DRAM on this machine (docs/performance.md). A last span
    shorter than the others repeats the range's last row, computed and not stored. Rows
    of x go four at a time (a last three repeat their last row), then a last two or one."""
    n, k = x.shape
    whole = k // 8 * 8
    last = r1 - 1
    span = (r1 - r0 + W_ROWS - 1) // W_ROWS
    for t in range(r0, r0 + span):
        q0, q1, q2, q3, q4, q5 = t, t + span, t + 2 * span, t + 3 * span, t + 4 * span, t + 5 * span
        w0, w1, w2 = w[q0], w[min(q1, last)], w[min(q2, last)]
        w3, w4, w5 = w[min(q3, last)], w[min(q4, last)], w[min(q5, last)]
        j = 0
        while n - j >= 3:
            x0, x1, x2, x3 = x[j], x[j + 1], x[j + 2], x[min(j + 3, n - 1)]
            _tile_3x4(w0, w1, w2, x0, x1, x2, x3, y, q0, q1, q2, j, n, r1, whole)
            _tile_3x4(w3, w4, w5, x0, x1, x2, x3, y, q3, q4, q5, j, n, r1, whole)
            j += 4
        if n - j == 2:
            _tile_6x2(w0, w1, w2, w3, w4, w5, x[j], x[j + 1], y, q0, q1, q2, q3, q4, q5, j, n,
                      r1, whole)
        elif n - j == 1:
            _tile_6x1(w0, w1, w2, w3, w4, w5, x[j], y, q0, q1, q2, q3, q4, q5, j, n, r1, whole)
    if whole < k:
        for r in range(r0, r1):
            wr = w[r]
            for j in range(n):
                xr = x[j]
                total = y[j, r]
                for i in range(whole, k):
                    total += load_value(wr, VALUE_BYTES * i) * xr[i]
                y[j, r] = total


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


def row_kernel(w, x, scales, sums, y, n, k, rows, row_bytes, r0, r1):  # pragma: no cover
    gemv(carray(u8_at(w), (rows, row_bytes)), carray(f32_at(x), (n, k)),
         carray(f32_at(y), (n, rows)), r0, r1)


@functools.cache
def row_kernel_address() -> int:
    return cfunc(ROW_KERNEL, **JIT_ORDERED)(row_kernel).address
