"""The matmul loops of every quantized block type, written once over a block decoder.

This module is a template: kernels/cpu_kernel_registry.py copies everything below the
`-- loops --` line into one generated module per block type, after lines binding the
names the loops use (here bound to Q8_0, so that this file imports and lints as it is):

- `decode_block(row, o, q, sc, mn)`: the type's decoder (kernels/cpu_block_decoders.py):
  the block at byte `o` of a row as codes `q[0:BLOCK]`, a scale per `SUB` values `sc`
  and, where `HAS_MIN`, a minimum per `SUB` values `mn`:
  value = sc * (q - CODE_OFFSET) + mn, codes 0..127 (or -128..127 where `SIGNED_CODES`);
- `BLOCK`, `BLOCK_BYTES`: values and bytes per block; `SUB`: 16 or 32.

Why generated modules and not one kernel taking its decoder as an argument: numba compiles
a kernel once per argument type, and a jitted function's type is its dispatcher object, so
a decoder passed as an argument gives each type its own compiled kernel, as wanted, but
numba's disk cache keys such kernels on a pickle of the dispatcher that differs in every
process: every run recompiled every kernel (a closure over the decoder hits the same
wall). A generated module per type is ordinary code to numba: its kernels are cached like
any other, each type compiles only its own, and the loops exist once, here.

The kernels (one thread each; kernels/quantized.py splits output rows over the cores):

- `gemv(w, codes, scales, sums, y, r0, r1)`: y[j, r] = dot(row r of w, x[j]) for rows
  r0 .. r1 - 1 of w and every row of x, given as 8-bit codes with a scale and a sum per
  `SUB` values (kernels/cpu_activations.py). Each block is decoded once into stack
  buffers that LLVM keeps in registers and multiplied with every row of x: per 32 values
  an integer dot product of the codes with the activation codes (`dot_unsigned`:
  llama.cpp's `vpmaddubsw` + `vpmaddwd`), scaled into eight float32 lanes by the
  group's weight scale times activation scale (computed for the block's groups at once);
  the code offset and the minimum cost one multiply by each group's activation sum. One
  row of x keeps its sums in registers; more keep one vector per row in a stack buffer.
- `dequant(w, r0, out)`: rows r0 .. r0 + len(out) - 1 of w as float32 (the tiles BLAS
  multiplies for many rows of x, the embedding lookup).
"""

from __future__ import annotations

# -- type binding: replaced in each generated module -------------------------------------------
from eagerlm.kernels.cpu_block_decoders import decode_q8_0 as decode_block

BLOCK, BLOCK_BYTES, SUB, HAS_MIN, CODE_OFFSET, SIGNED_CODES = 32, 34, 32, False, 0, True

# -- loops: copied into each generated module --------------------------------------------------
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from eagerlm.kernels.cpu_simd import (  # noqa: E402
    codes_f32x8,
    dot_signed,
    dot_unsigned,
    lane_sum,
    load_bytes,
    load_f32x8,
    muladd,
    pair_lanes,
    scaled_add,
    stack_empty,
    store_f32x8,
    zeros_f32x8,
)
from eagerlm.kernels.numba_settings import JIT_ORDERED  # noqa: E402

NSUB = BLOCK // SUB  # scale groups per block
CHUNK = max(1, 256 // BLOCK)  # blocks decoded together: 256 values
CHUNK_GROUPS = CHUNK * NSUB  # 8 or 16 scale groups: their products eight at a time
CHUNK_VALUES = CHUNK * BLOCK
HAS_OFFSET = HAS_MIN or CODE_OFFSET != 0
_CODE_OFFSET = np.float32(CODE_OFFSET)
MAX_ROWS = 64  # rows of x `gemv` takes at most (its stack buffer of partial sums)
_ACC_LANES = 16 * MAX_ROWS  # two Float32x8 per row


@njit(inline="always", **JIT_ORDERED)
def _decode_chunk(wr, b0, q, sc, mn):
    """The `CHUNK` blocks from b0 on of a row into q, sc, mn."""
    for t in range(CHUNK):
        decode_block(wr, (b0 + t) * BLOCK_BYTES, q[t * BLOCK:], sc[t * NSUB:], mn[t * NSUB:])


@njit(inline="always", **JIT_ORDERED)
def _unit(q, comb, codes, e0, u, acc):
    """acc + unit u's 32-value dot product of q with codes[e0 + 32u:], scaled by its
    groups' `comb` (scale products)."""
    if SIGNED_CODES:
        part = dot_signed(load_bytes(q, 32 * u), codes, e0 + 32 * u)
    else:
        part = dot_unsigned(load_bytes(q, 32 * u), codes, e0 + 32 * u)
    if SUB == 32:
        return scaled_add(acc, part, comb[u])
    return scaled_add(acc, part, pair_lanes(comb, 2 * u))


@njit(inline="always", **JIT_ORDERED)
def _units(q, comb, codes, e0, n_units, acc):
    """acc + the scaled dot products of q's first `n_units` units with codes[e0:], even
    and odd units in two sums (one chain of multiply-adds would wait on each other's
    latency)."""
    if n_units == 1:
        return _unit(q, comb, codes, e0, 0, acc)
    even = zeros_f32x8()
    odd = zeros_f32x8()
    for u in range(0, n_units, 2):
        even = _unit(q, comb, codes, e0, u, even)
        odd = _unit(q, comb, codes, e0, u + 1, odd)
    return acc + (even + odd)


@njit(inline="always", **JIT_ORDERED)
def _chunk_dot(q, sc, mn, comb, codes, scales, sums, b0, acc, offsets):
    """A decoded chunk (blocks b0 ..) times one row of x: `acc` (Float32x8) gains the
    scaled dot products, `offsets` (Float32x8) the code offsets and minimums times the
    groups' activation sums, the groups' products eight at a time."""
    g0 = b0 * NSUB
    for v in range(CHUNK_GROUPS // 8):
        s = load_f32x8(sc, 8 * v)
        store_f32x8(comb, 8 * v, s * load_f32x8(scales, g0 + 8 * v))
        if HAS_OFFSET:
            m = load_f32x8(mn, 8 * v) if HAS_MIN else zeros_f32x8()
            if CODE_OFFSET != 0:
                m = m - s * _CODE_OFFSET
            offsets = muladd(m, load_f32x8(sums, g0 + 8 * v), offsets)
    return _units(q, comb, codes, b0 * BLOCK, CHUNK_VALUES // 32, acc), offsets


@njit(inline="always", **JIT_ORDERED)
def _block_dot(q, sc, mn, comb, codes, scales, sums, b, acc, offset):
    """One decoded block (a row's last blocks, after its whole chunks) times one row of
    x, its groups one at a time (the offsets and minimums into the scalar `offset`)."""
    g0 = b * NSUB
    for s in range(NSUB):
        comb[s] = sc[s] * scales[g0 + s]
        if HAS_OFFSET:
            m = (mn[s] if HAS_MIN else np.float32(0.0)) - sc[s] * _CODE_OFFSET
            offset += m * sums[g0 + s]
    return _units(q, comb, codes, b * BLOCK, BLOCK // 32, acc), offset


@njit(**JIT_ORDERED)
def gemv(w, codes, scales, sums, y, r0, r1):
    n, k = codes.shape
    n_blocks = k // BLOCK
    whole = n_blocks // CHUNK * CHUNK  # blocks in whole chunks
    q = stack_empty(CHUNK_VALUES, np.int8)
    sc = stack_empty(CHUNK_GROUPS, np.float32)
    mn = stack_empty(CHUNK_GROUPS, np.float32)
    comb = stack_empty(CHUNK_GROUPS, np.float32)
    if n == 1:
        c0, s0, m0 = codes[0], scales[0], sums[0]
        for r in range(r0, r1):
            wr = w[r]
            acc = zeros_f32x8()
            offsets = zeros_f32x8()
            offset = np.float32(0.0)
            for b0 in range(0, whole, CHUNK):
                _decode_chunk(wr, b0, q, sc, mn)
                acc, offsets = _chunk_dot(q, sc, mn, comb, c0, s0, m0, b0, acc, offsets)
            for b in range(whole, n_blocks):
                decode_block(wr, b * BLOCK_BYTES, q, sc, mn)
                acc, offset = _block_dot(q, sc, mn, comb, c0, s0, m0, b, acc, offset)
            y[0, r] = lane_sum(acc) + (lane_sum(offsets) + offset)
        return
    accs = stack_empty(_ACC_LANES, np.float32)
    others = stack_empty(MAX_ROWS, np.float32)
    for r in range(r0, r1):
        wr = w[r]
        for j in range(2 * n):
            store_f32x8(accs, 8 * j, zeros_f32x8())
        for j in range(n):
            others[j] = 0.0
        for b0 in range(0, whole, CHUNK):
            _decode_chunk(wr, b0, q, sc, mn)
            for j in range(n):
                acc, offsets = _chunk_dot(q, sc, mn, comb, codes[j], scales[j], sums[j], b0,
                                          load_f32x8(accs, 16 * j),
                                          load_f32x8(accs, 16 * j + 8))
                store_f32x8(accs, 16 * j, acc)
                store_f32x8(accs, 16 * j + 8, offsets)
        for b in range(whole, n_blocks):
            decode_block(wr, b * BLOCK_BYTES, q, sc, mn)
            for j in range(n):
                acc, offset = _block_dot(q, sc, mn, comb, codes[j], scales[j], sums[j], b,
                                         load_f32x8(accs, 16 * j), others[j])
                store_f32x8(accs, 16 * j, acc)
                others[j] = offset
        for j in range(n):
            y[j, r] = lane_sum(load_f32x8(accs, 16 * j)) + (
                lane_sum(load_f32x8(accs, 16 * j + 8)) + others[j])


@njit(**JIT_ORDERED)
def dequant(w, r0, out):
    n_blocks = out.shape[1] // BLOCK
    q = stack_empty(BLOCK, np.int8)
    sc = stack_empty(NSUB, np.float32)
    mn = stack_empty(NSUB, np.float32)
    for t in range(out.shape[0]):
        wr, orow = w[r0 + t], out[t]
        for b in range(n_blocks):
            decode_block(wr, b * BLOCK_BYTES, q, sc, mn)
            for s in range(NSUB):
                scale = sc[s]
                for i in range(0, SUB, 8):
                    value = (codes_f32x8(q, s * SUB + i) - _CODE_OFFSET) * scale
                    if HAS_MIN:
                        value = value + mn[s]
                    store_f32x8(orow, b * BLOCK + s * SUB + i, value)
