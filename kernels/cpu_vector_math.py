"""exp on eight float32 lanes at once, and what the compiled row ops and attention build on
it: the gated FFN activations (SiLU, GELU) and a softmax's exponentials.

numba lowers `np.exp` on a float32 to a scalar libm call (no vector math library is
assumed: SVML comes from an Intel runtime package numba does not require), about 5 ns a
value here: a 128-token prefill of a 0.5B model spent 20 ms in its SwiGLU and most of its
45 ms of attention on it. This is Cephes' `expf` on a `Float32x8` (kernels/cpu_simd.py):
x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n put into the
exponent bits: within 1.01 ulp of float64's e^x over [-87.3, 88.37] (tests), 0.0 below
-88.37 (libm: subnormals down to -103), +inf above 88.37 (libm: above 88.72), NaN kept NaN;
six times libm's speed.

Every value goes through the vector: the last, short group of a row is copied into a
padded buffer first (`load_tail`, `store_tail`), so a value's bits never depend on where it
sits in a row or how many rows are computed together (the batch invariance of
docs/architecture.md).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.extending import intrinsic

from eagerlm.kernels.cpu_simd import (
    _F8,
    _muladd,
    float32x8,
    lane_sum,
    load_f32x8,
    stack_empty,
    store_f32x8,
    zeros_f32x8,
)
from eagerlm.kernels.numba_settings import JIT_ORDERED
from eagerlm.loader.config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

_I32x8 = ir.VectorType(ir.IntType(32), 8)

# Cephes expf's constants (ln 2 split in two so n * ln2 is exact enough; the polynomial's
# coefficients for e^r - 1 - r, over r^2)
_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
         1.6666665459e-1, 5.0000001201e-1)
_HIGH, _LOW = 88.3762626647949, -88.3762626647949


def _f8(value: float) -> ir.Constant:
    return ir.Constant(_F8, [float(np.float32(value))] * 8)


def _exp_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    floor = builder.module.declare_intrinsic("llvm.floor.v8f32", fnty=ir.FunctionType(_F8, [_F8]))
    under = builder.fcmp_ordered("<", x, _f8(_LOW))  # false for NaN: NaN stays NaN
    over = builder.fcmp_ordered(">", x, _f8(_HIGH))
    c = builder.select(over, _f8(_HIGH), builder.select(under, _f8(_LOW), x))
    n = builder.call(floor, [_muladd(builder, c, _f8(_LOG2E), _f8(0.5))])
    r = builder.fsub(c, builder.fmul(n, _f8(_LN2_HI)))
    r = builder.fsub(r, builder.fmul(n, _f8(_LN2_LO)))
    p = _f8(_POLY[0])
    for coefficient in _POLY[1:]:
        p = _muladd(builder, p, r, _f8(coefficient))
    r2 = builder.fmul(r, r)
    e = builder.fadd(_muladd(builder, p, r2, r), _f8(1.0))
    bits = builder.shl(builder.add(builder.fptosi(n, _I32x8), ir.Constant(_I32x8, [127] * 8)),
                       ir.Constant(_I32x8, [23] * 8))
    e = builder.fmul(e, builder.bitcast(bits, _F8))
    e = builder.select(under, _f8(0.0), e)
    inf = ir.Constant(_F8, [float("inf")] * 8)
    return builder.select(over, inf, e)


@intrinsic
def exp_f32x8(typingctx, x):
    """e^x lane-wise (a `Float32x8`), the module's Cephes `expf`."""
    def codegen(context, builder, signature, args):
        return _exp_ir(builder, args[0])
    return float32x8(x), codegen


@njit(inline="always", **JIT_ORDERED)
def load_tail(src, start, stop):
    """src[start:stop], fewer than 8 values, as a `Float32x8` whose other lanes are 0: a
    row's short last group goes through the same vector code as the rest of it."""
    pad = stack_empty(8, np.float32)
    for j in range(8):
        pad[j] = src[start + j] if start + j < stop else np.float32(0.0)
    return load_f32x8(pad, 0)


@njit(inline="always", **JIT_ORDERED)
def store_tail(dst, start, stop, value):
    """dst[start:stop] = the first stop - start lanes of `value` (`load_tail`'s inverse)."""
    pad = stack_empty(8, np.float32)
    store_f32x8(pad, 0, value)
    for j in range(start, stop):
        dst[j] = pad[j - start]


_GELU_2C = np.float32(2.0 * np.sqrt(2.0 / np.pi))
_GELU_2C3 = np.float32(2.0 * np.sqrt(2.0 / np.pi) * 0.044715)


# gpt-oss's clamped SwiGLU (ggml's swiglu_oai): the gate clamped above at 7, up to
# [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)
_OAI_LIMIT = np.float32(SWIGLU_OAI_LIMIT)
_OAI_ALPHA = np.float32(SWIGLU_OAI_ALPHA)


@njit(inline="always", **JIT_ORDERED)
def gated_x8(g, u, gelu):
    """act(g) * u on eight lanes: SiLU, g / (1 + e^-g), or with `gelu` GELU's tanh
    approximation, 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g / (1 + e^(-2c (g + 0.044715
    g^3))) (the same function, written with the one exp)."""
    z = g * (_GELU_2C + _GELU_2C3 * (g * g)) if gelu else g
    return g / (np.float32(1.0) + exp_f32x8(np.float32(0.0) - z)) * u


@njit(inline="always", **JIT_ORDERED)
def gated_row(g, u, gelu, out):
    """out = act(g) * u over 1-D float32 rows."""
    d = len(g)
    whole = d // 8 * 8
    for j in range(0, whole, 8):
        store_f32x8(out, j, gated_x8(load_f32x8(g, j), load_f32x8(u, j), gelu))
    if whole < d:
        store_tail(out, whole, d, gated_x8(load_tail(g, whole, d), load_tail(u, whole, d),
                                           gelu))


@njit(inline="always", **JIT_ORDERED)
def _clamped_x8(g, u, start, stop):
    """g[start:stop] clamped above and u[start:stop] on both sides at the clamped
    SwiGLU's limit, as two `Float32x8` (lanes past stop 0)."""
    pg = stack_empty(8, np.float32)
    pu = stack_empty(8, np.float32)
    for j in range(8):
        if start + j < stop:
            pg[j] = min(g[start + j], _OAI_LIMIT)
            pu[j] = max(min(u[start + j], _OAI_LIMIT), -_OAI_LIMIT)
        else:
            pg[j] = np.float32(0.0)
            pu[j] = np.float32(0.0)
    return load_f32x8(pg, 0), load_f32x8(pu, 0)


@njit(inline="always", **JIT_ORDERED)
def gated_oai_row(g, u, out):
    """out = gpt-oss's clamped SwiGLU of g, u over 1-D float32 rows, eight values at a
    time: g / (1 + e^(-1.702 g)) * (u + 1) on the clamped values."""
    d = len(g)
    for j in range(0, d, 8):
        cg, cu = _clamped_x8(g, u, j, d)
        v = cg / (np.float32(1.0) + exp_f32x8(np.float32(0.0) - cg * _OAI_ALPHA)) * (
            cu + np.float32(1.0))
        if j + 8 <= d:
            store_f32x8(out, j, v)
        else:
            store_tail(out, j, d, v)


@njit(inline="always", **JIT_ORDERED)
def exp_shifted(row, n, shift):
    """row[:n] = e^(row[:n] - shift) in place, and their sum (eight lane sums, then the
    lanes summed: one order for a given n): a softmax's numerators and denominator."""
    acc = zeros_f32x8()
    whole = n // 8 * 8
    for j in range(0, whole, 8):
        e = exp_f32x8(load_f32x8(row, j) - shift)
        store_f32x8(row, j, e)
        acc = acc + e
    if whole < n:  # the lanes past n sum as 0: read back through `load_tail`
        store_tail(row, whole, n, exp_f32x8(load_tail(row, whole, n) - shift))
        acc = acc + load_tail(row, whole, n)
    return lane_sum(acc)


@njit(**JIT_ORDERED)
def exp_row(src, dst):
    """dst = e^src over a 1-D float32 row (tests; the kernels inline the same loop)."""
    whole = len(src) // 8 * 8
    for j in range(0, whole, 8):
        store_f32x8(dst, j, exp_f32x8(load_f32x8(src, j)))
    if whole < len(src):
        store_tail(dst, whole, len(src), exp_f32x8(load_tail(src, whole, len(src))))
