"""Compiled cpu kernels over GGUF quantized blocks (numba, cached on disk, GIL released).

Two kernels per type, both reading a matrix as its raw blocks, uint8 `[rows, row_bytes]`
(kernels/quantized.py's `QuantizedMatrix`):

- `gemv_<type>(w, x, y)`: y[j, r] = dot(row r of w, x[j]) for a few activation rows (decode).
  Fused: each value is dequantized in a register (d * q, or d * sc * q - dmin * m) and
  multiplied into a vector of float32 partial sums as wide as a (super)block, summed once
  per row, so no dequantized weight is ever stored. Output rows are split over the
  machine's cores in chunks of `_CHUNK` (`prange`), each chunk with its own partial sums.
- `dequant_<type>(w, r0, out)`: rows r0 .. r0 + len(out) of w as float32 into `out`, the
  tile that the many-rows path multiplies with BLAS. One thread: BLAS's own threads keep
  spinning between its calls, and numba's threads fighting them for two cores made a tile
  loop of a 2048 x 640 matrix take 80-200 ms instead of 3-8 ms.

Block layouts are ggml's, as gguf-py's `gguf/quants.py` dequantizes them (the reference
the tests hold these to): Q4_0, Q5_0 and Q8_0 blocks of 32, the K-quants superblocks of 256
with 6-bit (Q4_K, Q5_K) or int8 (Q6_K) sub-block scales. The float16 block scales are read
from a table (`_f16`).

`fastmath` lets LLVM reassociate the float32 sums (so they vectorize): a different
summation order than BLAS's, within float32 rounding of it.

Measured on this project's 2-core x86 (AVX-512) machine, one thread, Q8_0 16384 x 2048:
the float path (dequantize in registers against float32 activations) 11.5 ms; llama.cpp's
(activations quantized to int8 per 32 values, integer products) 13.2 ms with the same
vector of float partial sums and 39 ms with an int32 sum per block (all three decoding
the float16 scale with ldexp; the table below took the float path to 3.9 ms): numba does
not emit the packed integer dot instructions llama.cpp writes by hand, so the float path
it is.
"""

from __future__ import annotations

import os
import tempfile

import numba
import numpy as np
from numba import njit, prange

# numba caches compiled code in __pycache__ beside this file, or in the user's cache
# directory where that is not writable; where neither is (a read-only install with no
# home), a temporary directory keeps the cache for this machine's later runs.
if "NUMBA_CACHE_DIR" not in os.environ and not os.access(os.path.dirname(__file__), os.W_OK):
    numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), "eagerlm-numba-cache")

# numba's OpenMP workers spin after each parallel loop by default, and on a machine with
# few cores they then starve the BLAS threads of the next matmul (a 6-token prefill of the
# demo model took 13 s instead of 0.25 s on 2 cores); passive workers sleep instead. Read
# when numba first starts its thread pool, so set here, before any kernel runs; a user's
# own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_JIT = {"cache": True, "nogil": True, "fastmath": True}


# Every float16 as float32, indexed by its bits: a load from a table that stays in cache is
# a third faster than decoding the bits (a libm ldexp per block) in the Q8_0 GEMV. numba
# compiles the table into the kernels as a constant.
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(
    np.float32)


@njit(inline="always", **_JIT)
def _f16(lo: int, hi: int) -> float:
    """The float16 whose little-endian bytes are lo, hi, as float32."""
    return _F16_TO_F32[np.int32(lo) | (np.int32(hi) << 8)]


@njit(inline="always", **_JIT)
def _scale_min_k4(row: np.ndarray, o: int, j: int) -> tuple[int, int]:
    """Sub-block j's 6-bit scale and min from the 12 packed bytes at row[o:] (Q4_K, Q5_K;
    ggml's get_scale_min_k4)."""
    if j < 4:
        return np.int32(row[o + j] & 63), np.int32(row[o + j + 4] & 63)
    sc = np.int32(row[o + j + 4] & 0xF) | (np.int32(row[o + j - 4] >> 6) << 4)
    mn = np.int32(row[o + j + 4] >> 4) | (np.int32(row[o + j] >> 6) << 4)
    return sc, mn


_CHUNK = 16  # output rows per parallel work item


# -- Q8_0: 34 bytes per 32 values: float16 d, int8 q[32]; value = d * q ---------------------

@njit(parallel=True, **_JIT)
def gemv_q8_0(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        acc = np.empty(32, np.float32)
        for r in range(ch * _CHUNK, min(rows, (ch + 1) * _CHUNK)):
            wr = w[r]
            qr = wr.view(np.int8)
            for j in range(n):
                xr = x[j]
                acc[:] = 0.0
                for b in range(k // 32):
                    o, e = b * 34, b * 32
                    d = _f16(wr[o], wr[o + 1])
                    for i in range(32):
                        acc[i] += d * np.float32(qr[o + 2 + i]) * xr[e + i]
                y[j, r] = acc.sum()


@njit(**_JIT)
def dequant_q8_0(w: np.ndarray, r0: int, out: np.ndarray) -> None:
    k = out.shape[1]
    for t in prange(out.shape[0]):
        wr = w[r0 + t]
        qr = wr.view(np.int8)
        orow = out[t]
        for b in range(k // 32):
            o, e = b * 34, b * 32
            d = _f16(wr[o], wr[o + 1])
            for i in range(32):
                orow[e + i] = d * np.float32(qr[o + 2 + i])


# -- Q4_0: 18 bytes per 32 values: float16 d, 16 bytes of nibbles (low: values 0-15,
#    high: 16-31); value = d * (q - 8) -------------------------------------------------------

@njit(parallel=True, **_JIT)
def gemv_q4_0(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        acc = np.empty(32, np.float32)
        for r in range(ch * _CHUNK, min(rows, (ch + 1) * _CHUNK)):
            wr = w[r]
            for j in range(n):
                xr = x[j]
                acc[:] = 0.0
                for b in range(k // 32):
                    o, e = b * 18, b * 32
                    d = _f16(wr[o], wr[o + 1])
                    for i in range(16):
                        q = np.int32(wr[o + 2 + i])
                        acc[i] += d * np.float32((q & 0xF) - 8) * xr[e + i]
                        acc[16 + i] += d * np.float32((q >> 4) - 8) * xr[e + 16 + i]
                y[j, r] = acc.sum()


@njit(**_JIT)
def dequant_q4_0(w: np.ndarray, r0: int, out: np.ndarray) -> None:
    k = out.shape[1]
    for t in prange(out.shape[0]):
        wr = w[r0 + t]
        orow = out[t]
        for b in range(k // 32):
            o, e = b * 18, b * 32
            d = _f16(wr[o], wr[o + 1])
            for i in range(16):
                q = np.int32(wr[o + 2 + i])
                orow[e + i] = d * np.float32((q & 0xF) - 8)
                orow[e + 16 + i] = d * np.float32((q >> 4) - 8)


# -- Q5_0: 22 bytes per 32 values: float16 d, 32 fifth bits (u32 qh, bit i for value i),
#    16 bytes of nibbles as Q4_0's; value = d * (q - 16) ----------------------------------------

@njit(parallel=True, **_JIT)
def gemv_q5_0(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        acc = np.empty(32, np.float32)
        for r in range(ch * _CHUNK, min(rows, (ch + 1) * _CHUNK)):
            wr = w[r]
            for j in range(n):
                xr = x[j]
                acc[:] = 0.0
                for b in range(k // 32):
                    o, e = b * 22, b * 32
                    d = _f16(wr[o], wr[o + 1])
                    qh = (np.int64(wr[o + 2]) | (np.int64(wr[o + 3]) << 8)
                          | (np.int64(wr[o + 4]) << 16) | (np.int64(wr[o + 5]) << 24))
                    for i in range(16):
                        q = np.int64(wr[o + 6 + i])
                        lo = (q & 0xF) | (((qh >> i) & 1) << 4)
                        hi = (q >> 4) | (((qh >> (i + 16)) & 1) << 4)
                        acc[i] += d * np.float32(lo - 16) * xr[e + i]
                        acc[16 + i] += d * np.float32(hi - 16) * xr[e + 16 + i]
                y[j, r] = acc.sum()


@njit(**_JIT)
def dequant_q5_0(w: np.ndarray, r0: int, out: np.ndarray) -> None:
    k = out.shape[1]
    for t in prange(out.shape[0]):
        wr = w[r0 + t]
        orow = out[t]
        for b in range(k // 32):
            o, e = b * 22, b * 32
            d = _f16(wr[o], wr[o + 1])
            qh = (np.int64(wr[o + 2]) | (np.int64(wr[o + 3]) << 8)
                  | (np.int64(wr[o + 4]) << 16) | (np.int64(wr[o + 5]) << 24))
            for i in range(16):
                q = np.int64(wr[o + 6 + i])
                orow[e + i] = d * np.float32(((q & 0xF) | (((qh >> i) & 1) << 4)) - 16)
                orow[e + 16 + i] = d * np.float32(
                    ((q >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16)


# -- Q4_K: 144 bytes per 256 values: float16 d, dmin, 12 bytes of 6-bit scales and mins
#    for 8 sub-blocks of 32, 128 bytes of nibbles (bytes 32c..32c+31: low nibbles are
#    sub-block 2c, high 2c+1); value = d * sc * q - dmin * m --------------------------------

@njit(parallel=True, **_JIT)
def gemv_q4_k(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        acc = np.empty(64, np.float32)
        for r in range(ch * _CHUNK, min(rows, (ch + 1) * _CHUNK)):
            wr = w[r]
            for j in range(n):
                xr = x[j]
                acc[:] = 0.0
                for b in range(k // 256):
                    o = b * 144
                    d = _f16(wr[o], wr[o + 1])
                    dmin = _f16(wr[o + 2], wr[o + 3])
                    for c in range(4):
                        e = b * 256 + 64 * c
                        sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
                        sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
                        d0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
                        d1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
                        for i in range(32):
                            q = np.int32(wr[o + 16 + 32 * c + i])
                            acc[i] += (d0 * np.float32(q & 0xF) - n0) * xr[e + i]
                            acc[32 + i] += (d1 * np.float32(q >> 4) - n1) * xr[e + 32 + i]
                y[j, r] = acc.sum()


@njit(**_JIT)
def dequant_q4_k(w: np.ndarray, r0: int, out: np.ndarray) -> None:
    k = out.shape[1]
    for t in prange(out.shape[0]):
        wr = w[r0 + t]
        orow = out[t]
        for b in range(k // 256):
            o = b * 144
            d = _f16(wr[o], wr[o + 1])
            dmin = _f16(wr[o + 2], wr[o + 3])
            for c in range(4):
                e = b * 256 + 64 * c
                sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
                sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
                d0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
                d1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
                for i in range(32):
                    q = np.int32(wr[o + 16 + 32 * c + i])
                    orow[e + i] = d0 * np.float32(q & 0xF) - n0
                    orow[e + 32 + i] = d1 * np.float32(q >> 4) - n1


# -- Q5_K: 176 bytes per 256 values: as Q4_K with 32 bytes of fifth bits (qh) before the
#    nibbles: value i of sub-block s has bit s of qh[i] as its bit 4 ------------------------

@njit(parallel=True, **_JIT)
def gemv_q5_k(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        acc = np.empty(64, np.float32)
        for r in range(ch * _CHUNK, min(rows, (ch + 1) * _CHUNK)):
            wr = w[r]
            for j in range(n):
                xr = x[j]
                acc[:] = 0.0
                for b in range(k // 256):
                    o = b * 176
                    d = _f16(wr[o], wr[o + 1])
                    dmin = _f16(wr[o + 2], wr[o + 3])
                    for c in range(4):
                        e = b * 256 + 64 * c
                        sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
                        sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
                        d0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
                        d1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
                        for i in range(32):
                            q = np.int32(wr[o + 48 + 32 * c + i])
                            h = np.int32(wr[o + 16 + i]) >> (2 * c)
                            acc[i] += (d0 * np.float32((q & 0xF) | ((h & 1) << 4)) - n0
                                       ) * xr[e + i]
                            acc[32 + i] += (d1 * np.float32((q >> 4) | ((h & 2) << 3)) - n1
                                            ) * xr[e + 32 + i]
                y[j, r] = acc.sum()


@njit(**_JIT)
def dequant_q5_k(w: np.ndarray, r0: int, out: np.ndarray) -> None:
    k = out.shape[1]
    for t in prange(out.shape[0]):
        wr = w[r0 + t]
        orow = out[t]
        for b in range(k // 256):
            o = b * 176
            d = _f16(wr[o], wr[o + 1])
            dmin = _f16(wr[o + 2], wr[o + 3])
            for c in range(4):
                e = b * 256 + 64 * c
                sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
                sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
                d0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
                d1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
                for i in range(32):
                    q = np.int32(wr[o + 48 + 32 * c + i])
                    h = np.int32(wr[o + 16 + i]) >> (2 * c)
                    orow[e + i] = d0 * np.float32((q & 0xF) | ((h & 1) << 4)) - n0
                    orow[e + 32 + i] = d1 * np.float32((q >> 4) | ((h & 2) << 3)) - n1


# -- Q6_K: 210 bytes per 256 values: 128 bytes of low nibbles (ql), 64 bytes of 2-bit
#    high parts (qh), 16 int8 scales (one per 16 values), float16 d at byte 208;
#    value = d * scale * (q - 32). In half h (128 values), value 32g + l (g = 0..3) is
#    nibble g // 2 of ql[64h + 32 * (g % 2) + l] with bits 2g, 2g+1 of qh[32h + l] ----------

@njit(parallel=True, **_JIT)
def gemv_q6_k(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        acc = np.empty(128, np.float32)
        for r in range(ch * _CHUNK, min(rows, (ch + 1) * _CHUNK)):
            wr = w[r]
            sr = wr.view(np.int8)
            for j in range(n):
                xr = x[j]
                acc[:] = 0.0
                for b in range(k // 256):
                    o = b * 210
                    d = _f16(wr[o + 208], wr[o + 209])
                    for h in range(2):
                        e = b * 256 + 128 * h
                        for half16 in range(2):
                            s = o + 192 + 8 * h + half16
                            d0, d1 = d * np.float32(sr[s]), d * np.float32(sr[s + 2])
                            d2, d3 = d * np.float32(sr[s + 4]), d * np.float32(sr[s + 6])
                            for i in range(16):
                                li = 16 * half16 + i
                                a = np.int32(wr[o + 64 * h + li])
                                c = np.int32(wr[o + 64 * h + 32 + li])
                                hb = np.int32(wr[o + 128 + 32 * h + li])
                                acc[li] += d0 * np.float32(
                                    ((a & 0xF) | ((hb & 3) << 4)) - 32) * xr[e + li]
                                acc[32 + li] += d1 * np.float32(
                                    ((c & 0xF) | ((hb & 12) << 2)) - 32) * xr[e + 32 + li]
                                acc[64 + li] += d2 * np.float32(
                                    ((a >> 4) | (hb & 48)) - 32) * xr[e + 64 + li]
                                acc[96 + li] += d3 * np.float32(
                                    ((c >> 4) | ((hb & 192) >> 2)) - 32) * xr[e + 96 + li]
                y[j, r] = acc.sum()


@njit(**_JIT)
def dequant_q6_k(w: np.ndarray, r0: int, out: np.ndarray) -> None:
    k = out.shape[1]
    for t in prange(out.shape[0]):
        wr = w[r0 + t]
        sr = wr.view(np.int8)
        orow = out[t]
        for b in range(k // 256):
            o = b * 210
            d = _f16(wr[o + 208], wr[o + 209])
            for h in range(2):
                e = b * 256 + 128 * h
                for li in range(32):
                    s = o + 192 + 8 * h + li // 16
                    a = np.int32(wr[o + 64 * h + li])
                    c = np.int32(wr[o + 64 * h + 32 + li])
                    hb = np.int32(wr[o + 128 + 32 * h + li])
                    orow[e + li] = d * np.float32(sr[s]) * np.float32(
                        ((a & 0xF) | ((hb & 3) << 4)) - 32)
                    orow[e + 32 + li] = d * np.float32(sr[s + 2]) * np.float32(
                        ((c & 0xF) | ((hb & 12) << 2)) - 32)
                    orow[e + 64 + li] = d * np.float32(sr[s + 4]) * np.float32(
                        ((a >> 4) | (hb & 48)) - 32)
                    orow[e + 96 + li] = d * np.float32(sr[s + 6]) * np.float32(
                        ((c >> 4) | ((hb & 192) >> 2)) - 32)
