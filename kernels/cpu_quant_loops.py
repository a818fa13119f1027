"""The matmul loops of every quantized block type, written once over a block decoder.

This module is a template: kernels/cpu_kernel_registry.py copies everything below the
`-- loops --` line into one generated module per block type, after lines binding the
names the loops use (here bound to Q8_0, so that this file imports and lints as it is):

- `decode_block(row, o, q, sc, mn)`: the type's decoder (kernels/cpu_block_decoders.py):
  the block at byte `o` of a row as int8 codes `q[0:BLOCK]`, a scale per `SUB` values
  `sc`, and, where `HAS_MIN`, an offset per `SUB` values `mn` (value = sc * q + mn);
- `BLOCK`, `BLOCK_BYTES`: values and bytes per block; `SUB`: 16 or 32.

Why generated modules and not one kernel taking its decoder as an argument: numba compiles
a kernel once per argument type, and a jitted function's type is its dispatcher object, so
a decoder passed as an argument gives each type its own compiled kernel, as wanted, but
numba's disk cache keys such kernels on a pickle of the dispatcher that differs in every
process: every run recompiled every kernel (a closure over the decoder hits the same
wall). A generated module per type is ordinary code to numba: its kernels are cached like
any other, each type compiles only its own, and the loops exist once, here.

The kernels (one thread each; kernels/quantized.py splits output rows over the cores):

- `gemv(w, xq, xs, xsum, y, r0, r1)`: y[j, r] = dot(row r of w, x[j]) for rows r0 .. r1 - 1
  of w and every row of x, given as 8-bit codes, scales and sums
  (kernels/cpu_activations.py). Each block is decoded once into a stack buffer that LLVM
  keeps in registers and multiplied with every row of x as integers (`dot16` / `dot32`:
  pairs of int8 x int16 products summed in 32-bit lanes), scaled per group into float32
  lanes; offsets are added as offset * the sum of the activations they multiply. One row
  of x (decode at batch 1) keeps its partial sums in registers; more keep one vector
  per row in a stack buffer.
- `dequant(w, r0, out)`: rows r0 .. r0 + len(out) - 1 of w as float32 (the tiles BLAS
  multiplies for many rows of x, the embedding lookup).
"""

from __future__ import annotations

# -- type binding: replaced in each generated module -------------------------------------------
from eagerlm.kernels.cpu_block_decoders import decode_q8_0 as decode_block

BLOCK, BLOCK_BYTES, SUB, HAS_MIN = 32, 34, 32, False

# -- loops: copied into each generated module --------------------------------------------------
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from eagerlm.kernels.cpu_simd import (  # noqa: E402
    codes_f32x8,
    dot16,
    dot32,
    lane_sum,
    load_f32x8,
    scaled_add,
    stack_empty,
    store_f32x8,
    zeros_f32x8,
)
from eagerlm.kernels.numba_settings import JIT_ORDERED  # noqa: E402

NSUB = BLOCK // SUB  # groups per block
MAX_ROWS = 64  # rows of x `gemv` takes at most (its stack buffer of partial sums)
_ACC_LANES = 8 * MAX_ROWS


@njit(inline="always", **JIT_ORDERED)
def _group_dot(q, s, xq, e):
    """The integer dot of group s of the decoded block with activations xq[e:]."""
    if SUB == 32:
        return dot32(q, s * SUB, xq, e)
    return dot16(q, s * SUB, xq, e)


@njit(inline="always", **JIT_ORDERED)
def _group_sum(xsum, e):
    """The sum of activations e .. e + SUB - 1 (sums are kept per 16)."""
    if SUB == 32:
        return xsum[e >> 4] + xsum[(e >> 4) + 1]
    return xsum[e >> 4]


@njit(**JIT_ORDERED)
def gemv(w, xq, xs, xsum, y, r0, r1):
    n, k = xq.shape
    n_blocks = k // BLOCK
    q = stack_empty(BLOCK, np.int8)
    sc = stack_empty(NSUB, np.float32)
    mn = stack_empty(NSUB, np.float32)
    if n == 1:
        x0, s0, m0 = xq[0], xs[0], xsum[0]
        for r in range(r0, r1):
            wr = w[r]
            acc = zeros_f32x8()
            offset = np.float32(0.0)
            for b in range(n_blocks):
                decode_block(wr, b * BLOCK_BYTES, q, sc, mn)
                for s in range(NSUB):
                    e = b * BLOCK + s * SUB
                    acc = scaled_add(acc, _group_dot(q, s, x0, e), sc[s] * s0[e >> 5])
                    if HAS_MIN:
                        offset += mn[s] * _group_sum(m0, e)
            y[0, r] = lane_sum(acc) + offset
        return
    accs = stack_empty(_ACC_LANES, np.float32)
    offsets = stack_empty(MAX_ROWS, np.float32)
    for r in range(r0, r1):
        wr = w[r]
        for j in range(n):
            store_f32x8(accs, 8 * j, zeros_f32x8())
            offsets[j] = 0.0
        for b in range(n_blocks):
            decode_block(wr, b * BLOCK_BYTES, q, sc, mn)
            for j in range(n):
                xj, sj = xq[j], xs[j]
                acc = load_f32x8(accs, 8 * j)
                offset = offsets[j]
                for s in range(NSUB):
                    e = b * BLOCK + s * SUB
                    acc = scaled_add(acc, _group_dot(q, s, xj, e), sc[s] * sj[e >> 5])
                    if HAS_MIN:
                        offset += mn[s] * _group_sum(xsum[j], e)
                store_f32x8(accs, 8 * j, acc)
                offsets[j] = offset
        for j in range(n):
            y[j, r] = lane_sum(load_f32x8(accs, 8 * j)) + offsets[j]


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
                offset = mn[s] if HAS_MIN else np.float32(0.0)
                for i in range(0, SUB, 8):
                    value = codes_f32x8(q, s * SUB + i) * scale + offset
                    store_f32x8(orow, b * BLOCK + s * SUB + i, value)
