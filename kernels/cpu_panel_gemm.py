"""Prompts as 8-bit integer products over weight panels: the many-rows matmul of every
block type on machines with 512-bit VNNI (`vpdpbusd` on zmm registers).

`gemv` (kernels/cpu_quant_loops.py) multiplies one weight row at a time: per 32 values
of a row and a row of x it spends one or two integer multiplies and a dozen instructions
of scaling, offsets and sums, and reaches ~45 G multiply-adds a second per core here,
under OpenBLAS's float32 GEMM (~70 on 512-bit registers) that the float32 tiles use.
llama.cpp's prompts go faster than either by interleaving weight rows, so that one
integer instruction multiplies four values of x with sixteen rows at once, and the float
work per group is shared by sixteen outputs. This module does the same for every type:

- A **panel** is `PANEL` (32) weight rows in 8-bit codes, interleaved four values at a
  time: word `j * PANEL + t` (uint32) holds codes 4j .. 4j + 3 of row t, so one 64-byte
  load is four values of sixteen rows, the operand of one `vpdpbusd`. Per group of `sub`
  (16 or 32) values each row has a float32 scale and offset, `PANEL` of each contiguous
  per group: value = scale * code + offset, codes unsigned 0..255. Each type's
  `pack_panels` (kernels/cpu_quant_loops.py) writes a tile of panels from the blocks
  with its block decoder, at the start of each product: held weights stay the file's
  blocks, and a panel tile per core is all the extra memory.
- x comes as kernels/cpu_activations.py's 8-bit codes, per 32 values a scale, per `sub`
  values the scale's copy and d * the codes' sum: llama.cpp's Q8_0 activations, the
  error bound the tests already hold `gemv` to.
- `panel_product` multiplies: per group, for `ROW_BLOCK` rows of x and the panel's 32
  rows, `sub / 4` steps of two weight loads and eight `vpdpbusd` (each the broadcast 4
  bytes of one row of x times the 64 bytes of sixteen rows: 64 multiply-adds), then per
  row of x and half-panel one conversion to float, one multiply (weight scale times x
  scale) and two multiply-adds (the scaled sum, the offset times x's sum): ~43
  multiply-adds an instruction for 32-value groups, against BLAS's 16. Measured on the
  Xeon (docs/performance.md): ~200 G multiply-adds a second on one core, 2.7x BLAS.

The micro-kernel is LLVM IR written here (`group_mac`), its accumulators a tuple of
16-lane vectors that stays in registers: numba has no 512-bit vectors of its own, and
LLVM's register allocator then sees the whole block. `ROW_BLOCK` 4 by two 16-row
vectors measured fastest of 4-8 rows by one to four vectors (docs/performance.md).
Where the machine has no 512-bit VNNI the same IR multiplies by generic vector code
(`_dpbusd_generic`: slow, for the tests on any machine); kernels/quantized.py takes this
path only where `PANELS_NATIVE`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, register_model

from eagerlm.kernels.cpu_simd import VectorModel, VectorType, element_ptr, host_features, splat
from eagerlm.kernels.numba_settings import JIT_ORDERED

PANEL = 32  # weight rows interleaved: two 16-lane vectors
ROW_BLOCK = 4  # rows of x multiplied together with one panel
# rows of x whose codes one pass over a tile's panels keeps in the core's L2 (the
# panels themselves are 32 * k bytes each)
X_CHUNK_BYTES = 1 << 18
# `vpdpbusd` on 512-bit registers
PANELS_NATIVE = {"avx512vnni", "avx512bw"} <= host_features()

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VI = ir.VectorType(_I32, 16)
_VF = ir.VectorType(_F32, 16)


class Float32x16Type(VectorType):
    def __init__(self) -> None:
        super().__init__("Float32x16", _VF)


float32x16 = Float32x16Type()
register_model(Float32x16Type)(VectorModel)


def _dpbusd_generic(builder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """`vpdpbusd` in generic IR: lane i of acc plus the four products of bytes 4i .. 4i + 3
    of `unsigned` (zero-extended) and `signed` (sign-extended)."""
    b64 = ir.VectorType(_I8, 64)
    w64 = ir.VectorType(_I32, 64)
    products = builder.mul(builder.zext(builder.bitcast(unsigned, b64), w64),
                           builder.sext(builder.bitcast(signed, b64), w64))
    for j in range(4):
        lanes = ir.Constant(ir.VectorType(_I32, 16), [4 * i + j for i in range(16)])
        acc = builder.add(acc, builder.shuffle_vector(products, products, lanes))
    return acc


def _dpbusd(builder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    if not PANELS_NATIVE:
        return _dpbusd_generic(builder, acc, unsigned, signed)
    fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512",
                                          fnty=ir.FunctionType(_VI, [_VI] * 3))
    return builder.call(fn, [acc, unsigned, signed])


def _literal(value) -> int | None:
    return value.literal_value if isinstance(value, types.IntegerLiteral) else None


@intrinsic
def zero_accs(typingctx, n):
    """A tuple of `n` (a constant) zero Float32x16: a block's accumulators."""
    count = _literal(n)
    if count is None:
        return None
    tuple_type = types.UniTuple(float32x16, count)

    def codegen(context, builder, signature, args):
        return context.make_tuple(builder, tuple_type, [ir.Constant(_VF, None)] * count)
    return tuple_type(n), codegen


@intrinsic
def group_mac(typingctx, accs, rows, steps, codes, c0, xq, x0, x_stride, scales, offsets, s0,
              xd, xs, g0, g_stride):
    """One group of values of `rows` (a constant) rows of x times one panel, added to
    `accs` (row i's two half-panels at 2i, 2i + 1): `steps` (a constant: the group's
    values / 4) of `vpdpbusd` of words c0 + step * PANEL (+ 16) of `codes` with 4 bytes of
    row i of x at x0 + i * x_stride + 4 * step of `xq`; then each half-panel's sum as
    float32 times its scales (from s0 of `scales`) times x's scale (xd[g0 + i * g_stride]),
    plus its offsets times x's sum (xs[...])."""
    n_rows, n_steps = _literal(rows), _literal(steps)
    if n_rows is None or n_steps is None:
        return None

    def codegen(context, builder, signature, args):
        a = signature.args

        def index(i):
            return context.cast(builder, args[i], a[i], types.intp)

        def at(i, offset, element):
            data = context.make_array(a[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [offset]), element.as_pointer())

        def const(n):
            return ir.Constant(_I64, n)
        c_at, x_at, x_step, s_at, g_at, g_step = (index(i) for i in (4, 6, 7, 10, 13, 14))
        sums = [[ir.Constant(_VI, None)] * 2 for _ in range(n_rows)]
        for step in range(n_steps):
            w = [builder.load(at(3, builder.add(c_at, const(step * PANEL + 16 * h)), _VI),
                              align=4) for h in range(2)]
            for i in range(n_rows):
                offset = builder.add(builder.add(x_at, builder.mul(x_step, const(i))),
                                     const(4 * step))
                x = splat(builder, builder.load(at(5, offset, _I32), align=1), _VI)
                sums[i] = [_dpbusd(builder, sums[i][h], w[h], x) for h in range(2)]
        muladd = builder.module.declare_intrinsic("llvm.fmuladd.v16f32",
                                                  fnty=ir.FunctionType(_VF, [_VF] * 3))
        scale = [builder.load(at(8, builder.add(s_at, const(16 * h)), _VF), align=4)
                 for h in range(2)]
        offset = [builder.load(at(9, builder.add(s_at, const(16 * h)), _VF), align=4)
                  for h in range(2)]
        out = []
        for i in range(n_rows):
            g = builder.add(g_at, builder.mul(g_step, const(i)))
            x_scale = splat(builder, builder.load(at(11, g, _F32)), _VF)
            x_sum = splat(builder, builder.load(at(12, g, _F32)), _VF)
            for h in range(2):
                acc = builder.extract_value(args[0], 2 * i + h)
                acc = builder.call(muladd, [builder.sitofp(sums[i][h], _VF),
                                            builder.fmul(scale[h], x_scale), acc])
                out.append(builder.call(muladd, [offset[h], x_sum, acc]))
        return context.make_tuple(builder, signature.return_type, out)
    return accs(accs, rows, steps, codes, c0, xq, x0, x_stride, scales, offsets, s0, xd, xs,
                g0, g_stride), codegen


@intrinsic
def store_accs(typingctx, accs, rows, out, at, stride):
    """Row i's two half-panels of `accs` at item at + i * stride of `out` (float32)."""
    n_rows = _literal(rows)
    if n_rows is None:
        return None

    def codegen(context, builder, signature, args):
        a = signature.args
        start = context.cast(builder, args[3], a[3], types.intp)
        step = context.cast(builder, args[4], a[4], types.intp)
        for i in range(n_rows):
            row = builder.add(start, builder.mul(step, ir.Constant(_I64, i)))
            for h in range(2):
                ptr = element_ptr(context, builder, a[2], args[2],
                                   builder.add(row, ir.Constant(_I64, 16 * h)), types.intp, _VF)
                builder.store(builder.extract_value(args[0], 2 * i + h), ptr, align=4)
        return context.get_dummy_value()
    return types.void(accs, rows, out, at, stride), codegen


def _transpose_network(n_rows: int, n_words: int) -> list[list[tuple[int, int, list[int]]]]:
    """The shuffles that turn n_rows rows of n_words words (held two rows a vector, row
    2i + r in lanes 8r .. of vector i) into n_words vectors of one word of every row
    (vector j, lane t: word j of row t): per stage, for each pair of vectors whose index
    differs in one bit, two two-source shuffles (`vpermt2d`), each keeping the words
    whose final vector has that bit 0, or 1; the last stage puts the lanes in row order.
    Worked out on labels here, once, as (a, b, lanes) per output vector of each stage."""
    width = 2 * n_words
    vectors = [[(2 * i + lane // n_words, lane % n_words) for lane in range(width)]
               for i in range(n_rows // 2)]
    stages = []
    bits = (len(vectors) - 1).bit_length()
    for bit in range(bits):
        step, new, shuffles = 1 << bit, [None] * len(vectors), []
        for a in range(len(vectors)):
            if a & step:
                continue
            b = a | step
            pool = vectors[a] + vectors[b]
            for side, target in ((0, a), (1, b)):
                chosen = [k for k, (_, word) in enumerate(pool) if (word >> bit) & 1 == side]
                if bit == bits - 1:
                    chosen.sort(key=lambda k: pool[k][0])
                new[target] = [pool[k] for k in chosen]
                shuffles.append((target, a, b, chosen))
        vectors = new
        stages.append(shuffles)
    assert all(v == [(t, j) for t in range(n_rows)] for j, v in enumerate(vectors))
    return stages


_TRANSPOSE = _transpose_network(16, 8)


@intrinsic
def store_panel_words(typingctx, q, q_at, q_stride, codes, c_at, flip):
    """8 words (32 codes) of each of 16 rows, row r at byte q_at + r * q_stride of `q`
    (int8), into `codes` (uint32) as panel words: word j of the rows at item
    c_at + j * PANEL .. + 15, each xor `flip`. A transpose of 16 x 8 words in 24 shuffles
    of two vectors (`_TRANSPOSE`), where copying word by word took ~0.5 cycle a byte,
    most of a type's packing."""
    def codegen(context, builder, signature, args):
        a = signature.args
        half = ir.VectorType(_I32, 8)
        start = context.cast(builder, args[1], a[1], types.intp)
        stride = context.cast(builder, args[2], a[2], types.intp)
        rows = [builder.load(element_ptr(
            context, builder, a[0], args[0],
            builder.add(start, builder.mul(stride, ir.Constant(_I64, r))), types.intp, half),
            align=1) for r in range(16)]
        both = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
        vectors = [builder.shuffle_vector(rows[2 * i], rows[2 * i + 1], both) for i in range(8)]
        for stage in _TRANSPOSE:
            new = list(vectors)
            for target, x, y, lanes in stage:
                new[target] = builder.shuffle_vector(vectors[x], vectors[y], ir.Constant(
                    ir.VectorType(_I32, 16), lanes))
            vectors = new
        mask = splat(builder, builder.trunc(context.cast(builder, args[5], a[5], types.int64),
                                             _I32), _VI)
        at = context.cast(builder, args[4], a[4], types.intp)
        for j in range(8):
            ptr = element_ptr(context, builder, a[3], args[3],
                               builder.add(at, ir.Constant(_I64, j * PANEL)), types.intp, _VI)
            builder.store(builder.xor(vectors[j], mask), ptr, align=4)
        return context.get_dummy_value()
    return types.void(q, q_at, q_stride, codes, c_at, flip), codegen


_ACCS = 2 * ROW_BLOCK


@njit(**JIT_ORDERED)
def panel_product(codes, scales, offsets, k, n_panels, xq, xd, xs, y, col0, n_cols):
    """y[j, col0 + c] = dot(row c of the tile, row j of x) for the tile's n_cols rows (in
    `n_panels` panels of rows of k values, `pack_panels`' layout) and every row of y; x
    as `quantize_activations`' codes xq, scales xd and sums xs per `sub` values (16 or
    32: the panels' group), with rows up to a multiple of `ROW_BLOCK` (zeros past y's)."""
    n_x, padded = xq.shape
    n_y, width = y.shape
    groups_x = xd.shape[1]
    sub16 = groups_x * 16 == padded
    sub = 16 if sub16 else 32
    groups = k // sub
    chunk = max(ROW_BLOCK, X_CHUNK_BYTES // padded // ROW_BLOCK * ROW_BLOCK)
    xq_flat, xd_flat, xs_flat = xq.reshape(-1), xd.reshape(-1), xs.reshape(-1)
    y_flat = y.reshape(-1)
    tail = np.empty(ROW_BLOCK * PANEL, np.float32)
    for first in range(0, n_x, chunk):
        for p in range(n_panels):
            c_base = p * PANEL * (k // 4)
            s_base = p * PANEL * groups
            cols = min(PANEL, n_cols - p * PANEL)
            for j in range(first, min(n_x, first + chunk), ROW_BLOCK):
                accs = zero_accs(_ACCS)
                if sub16:
                    for g in range(groups):
                        accs = group_mac(accs, ROW_BLOCK, 4, codes, c_base + 4 * g * PANEL,
                                         xq_flat, j * padded + 16 * g, padded, scales, offsets,
                                         s_base + g * PANEL, xd_flat, xs_flat,
                                         j * groups_x + g, groups_x)
                else:
                    for g in range(groups):
                        accs = group_mac(accs, ROW_BLOCK, 8, codes, c_base + 8 * g * PANEL,
                                         xq_flat, j * padded + 32 * g, padded, scales, offsets,
                                         s_base + g * PANEL, xd_flat, xs_flat,
                                         j * groups_x + g, groups_x)
                column = col0 + p * PANEL
                if cols == PANEL and j + ROW_BLOCK <= n_y:
                    store_accs(accs, ROW_BLOCK, y_flat, j * width + column, width)
                else:
                    store_accs(accs, ROW_BLOCK, tail, 0, PANEL)
                    for i in range(min(ROW_BLOCK, n_y - j)):
                        for c in range(cols):
                            y[j + i, column + c] = tail[i * PANEL + c]
