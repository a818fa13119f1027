"""Compiled cpu kernels over GGUF quantized blocks (numba, cached on disk, GIL released).

Every kernel reads a matrix as its raw blocks, uint8 `[rows, row_bytes]` (kernels/
quantized.py's `QuantizedMatrix`):

- `gemv_<type>(w, x, y)`: y[0, r] = dot(row r of w, x[0]), one activation row (decode at
  batch 1). Fused: each value is dequantized in a register (d * q, or d * sc * q - dmin * m)
  and multiplied into a vector of float32 partial sums as wide as a (super)block, summed
  once per row, so no dequantized weight is ever stored. (It accepts more rows of x and
  decodes the blocks again for each.)
- `_row_<type>(wr, orow)`: one row decoded whole, inlined into the two kernels every type
  shares through `_row(kind, ...)` (`kind` is the GGML type id):
  - `dequant(w, kind, r0, out)`: rows r0 .. r0 + len(out) as float32 into `out`, the tile
    the many-rows path multiplies with BLAS (kernels/cpu_threads.py runs one per core);
  - `gemv_rows(w, kind, x, y)`: a few rows of x (a decode batch): each weight row decoded
    once into a buffer that stays in L1 and dotted with every row of x.
The GEMVs split output rows over the machine's cores in chunks of `_CHUNK` (`prange`).

Block layouts are ggml's, as gguf-py's `gguf/quants.py` dequantizes them (the reference
the tests hold these to): Q4_0, Q5_0 and Q8_0 blocks of 32, the K-quants superblocks of 256
with 6-bit (Q4_K, Q5_K) or int8 (Q6_K) sub-block scales. The float16 block scales are read
from a table (`_f16`).

What makes numba's code vectorize (each measured on this project's 2-core AVX-512 machine,
in docs/performance.md): `fastmath`, so LLVM may reassociate the float32 sums (a different
summation order than BLAS's, within float32 rounding of it); bit unpacking in 32-bit
integers (`_and`, `_shr`, ...), as numba widens `int32 & int32` to int64; zero points as
float32 constants (`_F8`, ...); loops whose trip count LLVM cannot count where their body
is small (`_opaque_block_size`). Activations stay float32: llama.cpp quantizes them to
int8 and multiplies with packed integer dot instructions, which numba does not emit for
32-value blocks (a Q8_0 GEMV that way, one thread, took 13.2-39 ms against the float
path's 3.9 ms on 16384 x 2048).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from eagerlm.kernels.numba_settings import JIT as _JIT


def _int32_op(name: str):
    """A 32-bit integer bit operation (`name` is the llvmlite IR builder's method).

    numba types `int32 & int32` (and |, <<, >>) as int64, as it does all integer arithmetic
    below the machine's width, so the nibble and bit unpacking of a block vectorized in
    64-bit lanes: 8 values per AVX-512 register instead of 16. These keep it at 32 bits
    (operands are truncated to int32; every value unpacked here fits in 16 bits). Measured
    on Q4_K, 2048 x 2048, 2 cores: 10.7 -> 14.5 G values/s."""

    @intrinsic
    def op(typingctx, a, b):
        sig = types.int32(a, b)

        def codegen(context, builder, signature, args):
            x = context.cast(builder, args[0], signature.args[0], types.int32)
            y = context.cast(builder, args[1], signature.args[1], types.int32)
            return getattr(builder, name)(x, y)
        return sig, codegen
    return op


_and, _or = _int32_op("and_"), _int32_op("or_")
_shl, _shr = _int32_op("shl"), _int32_op("lshr")
# The types' zero points as float32 (an int literal would make the arithmetic float64).
_F8, _F16, _F32 = np.float32(8), np.float32(16), np.float32(32)


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


@njit(inline="always", **_JIT)
def _k4_scales(wr: np.ndarray, o: int, c: int) -> tuple[float, float, float, float]:
    """Sub-blocks 2c and 2c + 1 of the Q4_K / Q5_K superblock at wr[o:]: d * scale and
    dmin * min of each (value = d * scale * q - dmin * min)."""
    d = _f16(wr[o], wr[o + 1])
    dmin = _f16(wr[o + 2], wr[o + 3])
    sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
    sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
    return (d * np.float32(sc0), dmin * np.float32(m0),
            d * np.float32(sc1), dmin * np.float32(m1))


@njit(inline="always", **_JIT)
def _u32(row: np.ndarray, o: int) -> int:
    """The little-endian 32-bit word at row[o:] (Q5_0's fifth bits), as int32 bits."""
    return _or(_or(np.int32(row[o]), _shl(np.int32(row[o + 1]), 8)),
               _or(_shl(np.int32(row[o + 2]), 16), _shl(np.int32(row[o + 3]), 24)))


@njit(inline="always", **_JIT)
def _lo4(q: int) -> int:
    return _and(q, 15)


@njit(inline="always", **_JIT)
def _hi4(q: int) -> int:
    return _shr(q, 4)


@njit(inline="always", **_JIT)
def _q5_0_pair(q: int, qh: int, i: int) -> tuple[int, int]:
    """Q5_0 values i and 16 + i (0..31): nibbles of byte q, fifth bits i and 16 + i of qh."""
    return (_or(_lo4(q), _shl(_and(_shr(qh, i), 1), 4)),
            _or(_hi4(q), _shl(_and(_shr(qh, i + 16), 1), 4)))


@njit(inline="always", **_JIT)
def _q5_k_pair(q: int, h: int, c: int) -> tuple[int, int]:
    """Q5_K values i of sub-blocks 2c and 2c + 1 (0..31): nibbles of q, bits 2c and 2c + 1
    of the fifth-bit byte h."""
    h = _shr(h, 2 * c)
    return _or(_lo4(q), _shl(_and(h, 1), 4)), _or(_hi4(q), _shl(_and(h, 2), 3))


@njit(inline="always", **_JIT)
def _q6_k_values(wr: np.ndarray, o: int, h: int, li: int) -> tuple[float, float, float, float]:
    """Q6_K's four values (-32..31, float32) at position li of half h of the superblock at
    wr[o:]: low nibbles of ql[64h + li], ql[64h + 32 + li], then their high nibbles, each
    with two bits of qh[32h + li]."""
    a = np.int32(wr[o + 64 * h + li])
    c = np.int32(wr[o + 64 * h + 32 + li])
    hb = np.int32(wr[o + 128 + 32 * h + li])
    return (np.float32(_or(_lo4(a), _shl(_and(hb, 3), 4))) - _F32,
            np.float32(_or(_lo4(c), _shl(_and(hb, 12), 2))) - _F32,
            np.float32(_or(_hi4(a), _and(hb, 48))) - _F32,
            np.float32(_or(_hi4(c), _shr(_and(hb, 192), 2))) - _F32)


@njit(inline="always", **_JIT)
def _q6_k_scales(sr: np.ndarray, o: int, h: int, half16: int,
                 d: float) -> tuple[float, float, float, float]:
    """d * the int8 scales of the four 16-value groups that positions 16 * half16 ..
    + 15 of half h belong to."""
    s = o + 192 + 8 * h + half16
    return (d * np.float32(sr[s]), d * np.float32(sr[s + 2]),
            d * np.float32(sr[s + 4]), d * np.float32(sr[s + 6]))


@njit(inline="always", **_JIT)
def _opaque_block_size(row_values: int, row_bytes: int, block_bytes: int) -> int:
    """Values per block (32), computed from the shapes at run time. A loop with a constant
    trip count of 32 and as small a body as Q8_0's and Q4_0's dequantizers is unrolled
    into 32 scalar conversions before LLVM's vectorizer sees it (it cannot prove the
    stores miss the blocks it reads); one it cannot count vectorizes with a run-time
    overlap check: 1.6 -> 7.9 G values/s for Q8_0 on one core."""
    return row_values // (row_bytes // block_bytes)


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


@njit(inline="always", **_JIT)
def _row_q8_0(wr: np.ndarray, orow: np.ndarray) -> None:
    k = orow.shape[0]
    per_block = _opaque_block_size(k, wr.shape[0], 34)
    qr = wr.view(np.int8)
    for b in range(k // 32):
        o, e = b * 34, b * 32
        d = _f16(wr[o], wr[o + 1])
        for i in range(per_block):
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
                        acc[i] += d * (np.float32(_lo4(q)) - _F8) * xr[e + i]
                        acc[16 + i] += d * (np.float32(_hi4(q)) - _F8) * xr[e + 16 + i]
                y[j, r] = acc.sum()


@njit(inline="always", **_JIT)
def _row_q4_0(wr: np.ndarray, orow: np.ndarray) -> None:
    k = orow.shape[0]
    half_block = _opaque_block_size(k, wr.shape[0], 18) // 2
    for b in range(k // 32):
        o, e = b * 18, b * 32
        d = _f16(wr[o], wr[o + 1])
        for i in range(half_block):
            q = np.int32(wr[o + 2 + i])
            orow[e + i] = d * (np.float32(_lo4(q)) - _F8)
            orow[e + 16 + i] = d * (np.float32(_hi4(q)) - _F8)


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
                    qh = _u32(wr, o + 2)
                    for i in range(16):
                        lo, hi = _q5_0_pair(np.int32(wr[o + 6 + i]), qh, i)
                        acc[i] += d * (np.float32(lo) - _F16) * xr[e + i]
                        acc[16 + i] += d * (np.float32(hi) - _F16) * xr[e + 16 + i]
                y[j, r] = acc.sum()


@njit(inline="always", **_JIT)
def _row_q5_0(wr: np.ndarray, orow: np.ndarray) -> None:
    k = orow.shape[0]
    for b in range(k // 32):
        o, e = b * 22, b * 32
        d = _f16(wr[o], wr[o + 1])
        qh = _u32(wr, o + 2)
        for i in range(16):
            lo, hi = _q5_0_pair(np.int32(wr[o + 6 + i]), qh, i)
            orow[e + i] = d * (np.float32(lo) - _F16)
            orow[e + 16 + i] = d * (np.float32(hi) - _F16)


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
                    for c in range(4):
                        e = b * 256 + 64 * c
                        d0, n0, d1, n1 = _k4_scales(wr, o, c)
                        for i in range(32):
                            q = np.int32(wr[o + 16 + 32 * c + i])
                            acc[i] += (d0 * np.float32(_lo4(q)) - n0) * xr[e + i]
                            acc[32 + i] += (d1 * np.float32(_hi4(q)) - n1) * xr[e + 32 + i]
                y[j, r] = acc.sum()


@njit(inline="always", **_JIT)
def _row_q4_k(wr: np.ndarray, orow: np.ndarray) -> None:
    k = orow.shape[0]
    for b in range(k // 256):
        o = b * 144
        for c in range(4):
            e = b * 256 + 64 * c
            d0, n0, d1, n1 = _k4_scales(wr, o, c)
            for i in range(32):
                q = np.int32(wr[o + 16 + 32 * c + i])
                orow[e + i] = d0 * np.float32(_lo4(q)) - n0
                orow[e + 32 + i] = d1 * np.float32(_hi4(q)) - n1


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
                    for c in range(4):
                        e = b * 256 + 64 * c
                        d0, n0, d1, n1 = _k4_scales(wr, o, c)
                        for i in range(32):
                            lo, hi = _q5_k_pair(np.int32(wr[o + 48 + 32 * c + i]),
                                                np.int32(wr[o + 16 + i]), c)
                            acc[i] += (d0 * np.float32(lo) - n0) * xr[e + i]
                            acc[32 + i] += (d1 * np.float32(hi) - n1) * xr[e + 32 + i]
                y[j, r] = acc.sum()


@njit(inline="always", **_JIT)
def _row_q5_k(wr: np.ndarray, orow: np.ndarray) -> None:
    k = orow.shape[0]
    for b in range(k // 256):
        o = b * 176
        for c in range(4):
            e = b * 256 + 64 * c
            d0, n0, d1, n1 = _k4_scales(wr, o, c)
            for i in range(32):
                lo, hi = _q5_k_pair(np.int32(wr[o + 48 + 32 * c + i]),
                                    np.int32(wr[o + 16 + i]), c)
                orow[e + i] = d0 * np.float32(lo) - n0
                orow[e + 32 + i] = d1 * np.float32(hi) - n1


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
                            d0, d1, d2, d3 = _q6_k_scales(sr, o, h, half16, d)
                            for i in range(16):
                                li = 16 * half16 + i
                                q0, q1, q2, q3 = _q6_k_values(wr, o, h, li)
                                acc[li] += d0 * q0 * xr[e + li]
                                acc[32 + li] += d1 * q1 * xr[e + 32 + li]
                                acc[64 + li] += d2 * q2 * xr[e + 64 + li]
                                acc[96 + li] += d3 * q3 * xr[e + 96 + li]
                y[j, r] = acc.sum()


@njit(inline="always", **_JIT)
def _row_q6_k(wr: np.ndarray, orow: np.ndarray) -> None:
    k = orow.shape[0]
    sr = wr.view(np.int8)
    for b in range(k // 256):
        o = b * 210
        d = _f16(wr[o + 208], wr[o + 209])
        for h in range(2):
            e = b * 256 + 128 * h
            for half16 in range(2):
                d0, d1, d2, d3 = _q6_k_scales(sr, o, h, half16, d)
                for i in range(16):
                    li = 16 * half16 + i
                    q0, q1, q2, q3 = _q6_k_values(wr, o, h, li)
                    orow[e + li] = d0 * q0
                    orow[e + 32 + li] = d1 * q1
                    orow[e + 64 + li] = d2 * q2
                    orow[e + 96 + li] = d3 * q3


# -- What every type shares: a row decoded whole (the many-rows path's tiles, and the
#    few-rows GEMV below) -----------------------------------------------------------------

@njit(inline="always", **_JIT)
def _row(kind: int, wr: np.ndarray, orow: np.ndarray) -> None:
    """Row `wr` (blocks of GGML type id `kind`) as float32 into `orow`."""
    if kind == 8:  # Q8_0
        _row_q8_0(wr, orow)
    elif kind == 2:  # Q4_0
        _row_q4_0(wr, orow)
    elif kind == 6:  # Q5_0
        _row_q5_0(wr, orow)
    elif kind == 12:  # Q4_K
        _row_q4_k(wr, orow)
    elif kind == 13:  # Q5_K
        _row_q5_k(wr, orow)
    elif kind == 14:  # Q6_K
        _row_q6_k(wr, orow)


@njit(**_JIT)
def dequant(w: np.ndarray, kind: int, r0: int, out: np.ndarray) -> None:
    """Rows r0 .. r0 + len(out) of w (GGML type id `kind`) as float32 into `out`."""
    for t in range(out.shape[0]):
        _row(kind, w[r0 + t], out[t])


@njit(parallel=True, **_JIT)
def gemv_rows(w: np.ndarray, kind: int, x: np.ndarray, y: np.ndarray) -> None:
    """y[j, r] = dot(row r of w, x[j]) for a few rows of x (2 to `FEW_ROWS`, 64): each weight row
    is decoded once into a buffer that stays in L1 (2.5-8 KB for these models) and dotted
    with every row of x, instead of decoded again per row of x as the one-row kernels do.
    Two weight rows by four rows of x per pass: 6 loads feed 8 multiply-adds."""
    n, k = x.shape
    rows = w.shape[0]
    for ch in prange((rows + _CHUNK - 1) // _CHUNK):
        buf = np.empty((2, k), np.float32)
        r = ch * _CHUNK
        end = min(rows, r + _CHUNK)
        while r < end:
            pair = 2 if r + 1 < end else 1
            for t in range(pair):
                _row(kind, w[r + t], buf[t])
            b0, b1 = buf[0], buf[pair - 1]
            j = 0
            while j < n:
                x0, x1 = x[j], x[min(j + 1, n - 1)]
                x2, x3 = x[min(j + 2, n - 1)], x[min(j + 3, n - 1)]
                s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
                for i in range(k):
                    a, c = b0[i], b1[i]
                    s00 += a * x0[i]
                    s01 += a * x1[i]
                    s02 += a * x2[i]
                    s03 += a * x3[i]
                    s10 += c * x0[i]
                    s11 += c * x1[i]
                    s12 += c * x2[i]
                    s13 += c * x3[i]
                for t, s0, s1, s2, s3 in ((0, s00, s01, s02, s03), (1, s10, s11, s12, s13)):
                    if t < pair:
                        y[j, r + t] = s0
                        if j + 1 < n:
                            y[j + 1, r + t] = s1
                        if j + 2 < n:
                            y[j + 2, r + t] = s2
                        if j + 3 < n:
                            y[j + 3, r + t] = s3
                j += 4
            r += pair
