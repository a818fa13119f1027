"""Activations as 8-bit integers, for the integer dot products of the quantized kernels.

A row of x is cut in groups of `GROUP` (32) values, each stored as int8 codes times one
float32 scale: d = max |x| / 127, code = round(x / d). This is llama.cpp's Q8_0 activation
format. The kernels then compute exactly sum(w * x~) with x~ = d * code, the activation
rounded to the nearest of 255 levels of its group: |x~ - x| <= d / 2 = max |x of the
group| / 254 per value. A matmul's error against the float32 activations is therefore at
most sum_i |w_i| * max|x of i's group| / 254 per output (the bound the tests hold the
kernels to), plus float32 rounding.

Per group of `sub` values (16 or 32: a weight type's scale group, kernels/
cpu_kernel_registry.py) the kernels also get the activations' scale (a 32-group's, for
both its 16-halves) and the sum of the quantized activations, d * sum(codes): what a
block type whose values are scale * (q - offset) + min needs for its offset and min, one
multiply per group.

The 256-value superblock types take their activations per 256 values instead
(`quantize_superblocks`, llama.cpp's Q8_K): one scale per superblock, so that a
superblock's integer sub-scales multiply the integer dot products before anything is
converted to float (one multiply-add per 256 values instead of one per 16 or 32); the
sums per group are then the codes' integer sums. The bound is the same with d = max |x|
of the 256 / 127.

A prompt's rows are quantized a share per core (`cpu_threads.by_rows`: ~0.14 ms for 128
rows of 1024 on one core, 3% of a product the `gemv` then takes in runs of rows).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import carray, cfunc, njit

from eagerlm.kernels.aligned_arrays import aligned_empty
from eagerlm.kernels.cpu_row_kernel import QUANTIZE, f32_at, i8_at, i32_at
from eagerlm.kernels.cpu_threads import by_rows
from eagerlm.kernels.numba_settings import JIT_ORDERED

GROUP = 32  # activation values per scale
SUPERBLOCK = 256  # activation values per scale for the superblock types
PAD = 256  # rows padded with zeros to a multiple of this: the kernels' chunks of 256 values


def quantize_activations(x: np.ndarray, sub: int = GROUP
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 `[n, k]` (k a multiple of `GROUP`) as (codes int8 `[n, k']`, scales and
    sums float32 `[n, k' / sub]`), `sub` 16 or 32, k' = k rounded up to a multiple of
    `PAD` (codes, scales and sums 0 past k: the kernels read whole chunks)."""
    n, k = x.shape
    codes, scales, sums = activation_arrays(n, k, sub, superblocks=False)
    by_rows(n, lambda a, b: quantize_into(x[a:b], codes[a:b], scales[a:b], sums[a:b]))
    return codes, scales, sums


def activation_arrays(n: int, k: int, sub: int, *, superblocks: bool
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty (uninitialised) codes, scales and sums for n rows of k values, in the layout
    `quantize_superblocks` (if `superblocks`) or `quantize_activations` fills."""
    if superblocks:
        return (aligned_empty((n, k), np.int8), aligned_empty((n, k // SUPERBLOCK), np.float32),
                aligned_empty((n, k // sub), np.int32))
    padded = -(-k // PAD) * PAD
    return (aligned_empty((n, padded), np.int8), aligned_empty((n, padded // sub), np.float32),
            aligned_empty((n, padded // sub), np.float32))


@njit(inline="always", **JIT_ORDERED)
def _amax(xr, o, n):
    """max |x| of xr[o:o + n] (n a multiple of 8) in eight independent chains: one chain
    of n dependent `max` was most of the quantizer's time (a max is exact in any order:
    the same value)."""
    m0, m1, m2, m3 = abs(xr[o]), abs(xr[o + 1]), abs(xr[o + 2]), abs(xr[o + 3])
    m4, m5, m6, m7 = abs(xr[o + 4]), abs(xr[o + 5]), abs(xr[o + 6]), abs(xr[o + 7])
    for i in range(o + 8, o + n, 8):
        m0, m1 = max(m0, abs(xr[i])), max(m1, abs(xr[i + 1]))
        m2, m3 = max(m2, abs(xr[i + 2])), max(m3, abs(xr[i + 3]))
        m4, m5 = max(m4, abs(xr[i + 4])), max(m5, abs(xr[i + 5]))
        m6, m7 = max(m6, abs(xr[i + 6])), max(m7, abs(xr[i + 7]))
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@njit(**JIT_ORDERED)
def quantize_into(x, codes, scales, sums):
    """`quantize_activations`' kernel, into arrays of its shapes (`sub` and the padding
    from theirs)."""
    n, k = x.shape
    padded = codes.shape[1]
    per_group = GROUP * scales.shape[1] // padded  # 1, or 2 halves of 16
    for j in range(n):
        xr, cr = x[j], codes[j]
        for g in range(k // GROUP):
            o = g * GROUP
            amax = _amax(xr, o, GROUP)
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            s0 = 0
            s1 = 0
            for i in range(16):
                c0 = np.int8(np.rint(xr[o + i] * inv))
                c1 = np.int8(np.rint(xr[o + 16 + i] * inv))
                cr[o + i] = c0
                cr[o + 16 + i] = c1
                s0 += c0
                s1 += c1
            if per_group == 1:
                scales[j, g] = d
                sums[j, g] = d * np.float32(s0 + s1)
            else:
                scales[j, 2 * g] = d
                scales[j, 2 * g + 1] = d
                sums[j, 2 * g] = d * np.float32(s0)
                sums[j, 2 * g + 1] = d * np.float32(s1)
        cr[k:] = 0
        scales[j, k * per_group // GROUP:] = 0.0
        sums[j, k * per_group // GROUP:] = 0.0


def quantize_superblocks(x: np.ndarray, sub: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 `[n, k]` (k a multiple of 256) as (codes int8 `[n, k]`, scales float32
    `[n, k / 256]`, the codes' integer sums int32 `[n, k / sub]`), `sub` 16 or 32."""
    n, k = x.shape
    codes, scales, sums = activation_arrays(n, k, sub, superblocks=True)
    by_rows(n, lambda a, b: quantize_superblocks_into(x[a:b], codes[a:b], scales[a:b],
                                                      sums[a:b]))
    return codes, scales, sums


@njit(**JIT_ORDERED)
def quantize_superblocks_into(x, codes, scales, sums):
    """`quantize_superblocks`' kernel, into arrays of its shapes."""
    n, k = x.shape
    sub = k // sums.shape[1]
    for j in range(n):
        xr, cr = x[j], codes[j]
        for b in range(k // SUPERBLOCK):
            o = b * SUPERBLOCK
            amax = _amax(xr, o, SUPERBLOCK)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for i in range(SUPERBLOCK):
                cr[o + i] = np.int8(np.rint(xr[o + i] * inv))
            scales[j, b] = amax / np.float32(127.0)
        for g in range(k // sub):
            total = 0
            for i in range(sub):
                total += cr[g * sub + i]
            sums[j, g] = total


# -- the quantizers as kernels/cpu_row_kernel.py's `QUANTIZE` C functions (the replay's) --
# x `[n, k]` float32 at address x into the layout above: one function per layout and group

@njit(inline="always", **JIT_ORDERED)
def _groups_at(x, codes, scales, sums, n, k, sub):
    padded = -(-k // PAD) * PAD
    quantize_into(carray(f32_at(x), (n, k)), carray(i8_at(codes), (n, padded)),
                  carray(f32_at(scales), (n, padded // sub)),
                  carray(f32_at(sums), (n, padded // sub)))


@njit(inline="always", **JIT_ORDERED)
def _superblocks_at(x, codes, scales, sums, n, k, sub):
    quantize_superblocks_into(carray(f32_at(x), (n, k)), carray(i8_at(codes), (n, k)),
                              carray(f32_at(scales), (n, k // SUPERBLOCK)),
                              carray(i32_at(sums), (n, k // sub)))


def _groups16(x, codes, scales, sums, n, k):  # pragma: no cover
    _groups_at(x, codes, scales, sums, n, k, 16)


def _groups32(x, codes, scales, sums, n, k):  # pragma: no cover
    _groups_at(x, codes, scales, sums, n, k, 32)


def _superblocks16(x, codes, scales, sums, n, k):  # pragma: no cover
    _superblocks_at(x, codes, scales, sums, n, k, 16)


def _superblocks32(x, codes, scales, sums, n, k):  # pragma: no cover
    _superblocks_at(x, codes, scales, sums, n, k, 32)


_QUANTIZERS = {(False, 16): _groups16, (False, 32): _groups32,
               (True, 16): _superblocks16, (True, 32): _superblocks32}


def quantizer_function(superblocks: bool, sub: int):
    """The Python function `quantizer_address` compiles (kernels/cpu_compile.py asks numba's
    disk cache whether it holds it)."""
    return _QUANTIZERS[superblocks, sub]


@functools.cache
def quantizer_address(superblocks: bool, sub: int) -> int:
    """The address of the `QUANTIZE` making a type's activations (`quantize_superblocks`
    if `superblocks`, else `quantize_activations`, with a sum per `sub` values), compiled
    on first use."""
    return cfunc(QUANTIZE, **JIT_ORDERED)(_QUANTIZERS[superblocks, sub]).address
