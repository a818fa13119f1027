"""Prompts as 8-bit integer products over weight panels: the many-rows matmul of every
block type, on machines with 512-bit VNNI (`vpdpbusd` on zmm registers) or AVX2.

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
- Each type's `panel_product` (kernels/cpu_quant_loops.py, the one loop over a tile's
  panels and rows of x) multiplies by `group_mac`: per group, for `ROW_BLOCK` rows of x
  and the panel's 32 rows, `sub / 4` steps of two weight loads and eight `vpdpbusd`
  (each the broadcast 4 bytes of one row of x times the 64 bytes of sixteen rows: 64
  multiply-adds), then per row of x and half-panel one conversion to float, one multiply
  (weight scale times x scale) and two multiply-adds (the scaled sum, the offset times
  x's sum): ~43 multiply-adds an instruction for 32-value groups, against BLAS's 16.
  Measured on the Xeon (docs/performance.md): ~200 G multiply-adds a second on one
  core, 2.7x BLAS.

The micro-kernel is LLVM IR written here (`group_mac`), its accumulators a tuple of
16-lane vectors that stays in registers: numba has no 512-bit vectors of its own, and
LLVM's register allocator then sees the whole block. `ROW_BLOCK` 4 by two 16-row
vectors measured fastest of 4-8 rows by one to four vectors (docs/performance.md).

AVX2 has no `vpdpbusd`: its `vpmaddubsw` multiplies the same bytes into int16 pair sums
that saturate, and `vpmaddwd` by ones widens them. The pair sums of codes up to 127 fit,
and those of small codes fit several steps' worth, added in int16 before one widening
(`int16_steps`: 8 steps for 4-bit codes, 2 for Q6_K's, 1 for the IQ grids'); codes past
127 (the signed types', plus 128) multiply as their magnitudes times x with their signs
(`vpsignb`) and take 128 times x's sum back. The int32 sums are the same integers as
`vpdpbusd`'s, so the products are the same bits on both. The same IR in generic vector
code runs where neither is there (the tests' path, slow; kernels/quantized.py takes the
panels only where `PANELS_NATIVE`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, register_model

from eagerlm.kernels.cpu_simd import (
    VectorModel,
    VectorType,
    abs_and_sign,
    element_ptr,
    host_features,
    pmaddubsw,
    pmaddwd,
    splat,
)

PANEL = 32  # weight rows interleaved: two 16-lane vectors
# rows of x whose codes one pass over a tile's panels keeps in the core's L2 (the
# panels themselves are 32 * k bytes each)
X_CHUNK_BYTES = 1 << 18


def _panel_isa(features: set[str]) -> str:
    """How the micro-kernel multiplies bytes on a machine with `features`: one 512-bit
    `vpdpbusd` ("avx512vnni"), AVX2's `vpmaddubsw` + `vpmaddwd` on 256-bit halves ("avx2";
    AVX-VNNI machines too), or generic vector code ("generic": the tests' path on any
    machine, not fast)."""
    if {"avx512vnni", "avx512bw"} <= features:
        return "avx512vnni"
    return "avx2" if "avx2" in features else "generic"


PANEL_ISA = _panel_isa(host_features())
PANELS_NATIVE = PANEL_ISA != "generic"
# rows of x multiplied together with one panel: 4 by two 16-row vectors measured fastest
# of 4-8 rows by one to four vectors on 512-bit registers; on AVX2 (16 registers of 256
# bits: four a row of x for its sums, four for a step's weights) 2 of 1-4 rows, for Q4_K,
# Q6_K and Q8_0 (docs/performance.md)
ROW_BLOCK = 4 if PANEL_ISA == "avx512vnni" else 2
# The x codes are -127..127 (kernels/cpu_activations.py); `vpmaddubsw` saturates its int16
# pair sums, which two products of a code up to 127 and x stay within (2 * 127 * 127).
INT16_MAX = 32767
X_MAX = 127

_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())
_VI = ir.VectorType(_I32, 16)
_VF = ir.VectorType(_F32, 16)
_VB = ir.VectorType(_I8, 64)
_VW = ir.VectorType(_I16, 32)


class Float32x16Type(VectorType):
    def __init__(self) -> None:
        super().__init__("Float32x16", _VF)


float32x16 = Float32x16Type()
register_model(Float32x16Type)(VectorModel)


def int16_steps(code_max: int, steps: int) -> int:
    """How many steps' `vpmaddubsw` pair sums (of codes up to `code_max` unsigned) an int16
    lane holds before it must widen: the largest power of two dividing a group's `steps`
    that keeps their total within int16; 0 for codes past 127 (the signed types' codes
    plus 128), which take their magnitudes and signs instead (`_bytes_times_x`)."""
    if code_max > 127:
        return 0
    n = 1
    while 2 * n <= steps and 2 * n * 2 * code_max * X_MAX <= INT16_MAX:
        n *= 2
    return n


def _dpbusd(builder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """`vpdpbusd`: lane i of acc plus the four products of bytes 4i .. 4i + 3 of
    `unsigned` (zero-extended) and `signed` (sign-extended), no int16 in between."""
    fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512",
                                          fnty=ir.FunctionType(_VI, [_VI] * 3))
    return builder.call(fn, [acc, unsigned, signed])


def _halves(builder, fn, a: ir.Value, b: ir.Value) -> ir.Value:
    """`fn(builder, a', b')`, an IR builder of 256-bit operands (kernels/cpu_simd.py's), on
    each half of two 512-bit operands, the results joined."""
    count = a.type.count // 2
    parts = [fn(builder, *[builder.shuffle_vector(v, v, ir.Constant(
        ir.VectorType(_I32, count), list(range(h * count, h * count + count)))) for v in (a, b)])
        for h in range(2)]
    total = 2 * parts[0].type.count
    return builder.shuffle_vector(parts[0], parts[1],
                                  ir.Constant(ir.VectorType(_I32, total), list(range(total))))


def _bytes_times_x(builder, codes: ir.Value, x: ir.Value, signed: bool) -> ir.Value:
    """The int16 pair sums (`vpmaddubsw`) of 64 code bytes times x's 4 bytes (broadcast).
    Codes past 127 would saturate them: `signed` codes (the signed types' codes plus 128,
    less 128 again) multiply x as their magnitudes with their signs, which sums to the
    codes times x; the caller adds 128 * x's sum back (`_x_sum_times_128`)."""
    def half(b, q, xs):
        if signed:
            q, xs = abs_and_sign(b, q, xs)
        return pmaddubsw(b, q, xs)
    return _halves(builder, half, builder.bitcast(codes, _VB), builder.bitcast(x, _VB))


def _widen(builder, pairs: ir.Value) -> ir.Value:
    """`vpmaddwd` by ones: 32 int16 lanes summed in adjacent pairs into 16 int32 lanes."""
    return _halves(builder, pmaddwd, pairs, ir.Constant(_VW, [1] * 32))


def _x_sum_times_128(builder, x_bytes: ir.Value) -> ir.Value:
    """128 * the sum of a group's x codes (`<sub x i8>`), in every lane of a `<16 x i32>`."""
    wide = builder.sext(x_bytes, ir.VectorType(_I32, x_bytes.type.count))
    reduce = builder.module.declare_intrinsic(
        f"llvm.vector.reduce.add.v{x_bytes.type.count}i32",
        fnty=ir.FunctionType(_I32, [wide.type]))
    total = builder.shl(builder.call(reduce, [wide]), ir.Constant(_I32, 7))
    return splat(builder, total, _VI)


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
def group_mac(typingctx, accs, rows, steps, int16, codes, c0, xq, x0, x_stride, scales, offsets,
              s0, xd, xs, g0, g_stride):
    """One group of values of `rows` (a constant) rows of x times one panel, added to
    `accs` (row i's two half-panels at 2i, 2i + 1): `steps` (a constant: the group's
    values / 4) of 16 x 4 codes, words c0 + step * PANEL (+ 16) of `codes`, times 4
    bytes of row i of x at x0 + i * x_stride + 4 * step of `xq`, summed in int32; then
    each half-panel's sum as float32 times its scales (from s0 of `scales`) times x's
    scale (xd[g0 + i * g_stride]), plus its offsets times x's sum (xs[...]).

    With 512-bit VNNI each step is one `vpdpbusd` per half-panel. Elsewhere it is
    `vpmaddubsw`'s int16 pair sums, `int16` (a constant: `int16_steps`) steps of them
    added before one `vpmaddwd` widens them; `int16` 0 for codes past 127, whose
    magnitudes multiply x with their signs (`_bytes_times_x`). Either way the int32 sums
    are the same integers, so the products are the same bits on every machine."""
    n_rows, n_steps, n_int16 = _literal(rows), _literal(steps), _literal(int16)
    if n_rows is None or n_steps is None or n_int16 is None:
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

        def x_at(i, byte):
            return builder.add(builder.add(x0, builder.mul(x_step, const(i))), const(byte))
        c_at, x0, x_step, s_at, g_at, g_step = (index(i) for i in (5, 7, 8, 11, 14, 15))
        vnni = PANEL_ISA == "avx512vnni"
        signed = not vnni and not n_int16  # codes past 127: magnitudes and signs
        chunk = max(1, n_int16)
        flip = splat(builder, ir.Constant(_I8, 0x80), _VB)
        sums = [[ir.Constant(_VI, None)] * 2 for _ in range(n_rows)]
        pairs = [[None] * 2 for _ in range(n_rows)]
        for step in range(n_steps):
            w = [builder.load(at(4, builder.add(c_at, const(step * PANEL + 16 * h)), _VI),
                              align=4) for h in range(2)]
            if signed:  # the signed codes, -128..127
                w = [builder.xor(builder.bitcast(v, _VB), flip) for v in w]
            for i in range(n_rows):
                x = splat(builder, builder.load(at(6, x_at(i, 4 * step), _I32), align=1), _VI)
                for h in range(2):
                    if vnni:
                        sums[i][h] = _dpbusd(builder, sums[i][h], w[h], x)
                        continue
                    p = _bytes_times_x(builder, w[h], x, signed)
                    pairs[i][h] = p if step % chunk == 0 else builder.add(pairs[i][h], p)
                    if (step + 1) % chunk == 0:
                        sums[i][h] = builder.add(sums[i][h], _widen(builder, pairs[i][h]))
        if signed:
            group = ir.VectorType(_I8, 4 * n_steps)
            for i in range(n_rows):
                shift = _x_sum_times_128(builder, builder.load(at(6, x_at(i, 0), group),
                                                               align=1))
                sums[i] = [builder.add(v, shift) for v in sums[i]]
        muladd = builder.module.declare_intrinsic("llvm.fmuladd.v16f32",
                                                  fnty=ir.FunctionType(_VF, [_VF] * 3))
        scale = [builder.load(at(9, builder.add(s_at, const(16 * h)), _VF), align=4)
                 for h in range(2)]
        offset = [builder.load(at(10, builder.add(s_at, const(16 * h)), _VF), align=4)
                  for h in range(2)]
        out = []
        for i in range(n_rows):
            g = builder.add(g_at, builder.mul(g_step, const(i)))
            x_scale = splat(builder, builder.load(at(12, g, _F32)), _VF)
            x_sum = splat(builder, builder.load(at(13, g, _F32)), _VF)
            for h in range(2):
                acc = builder.extract_value(args[0], 2 * i + h)
                acc = builder.call(muladd, [builder.sitofp(sums[i][h], _VF),
                                            builder.fmul(scale[h], x_scale), acc])
                out.append(builder.call(muladd, [offset[h], x_sum, acc]))
        return context.make_tuple(builder, signature.return_type, out)
    return accs(accs, rows, steps, int16, codes, c0, xq, x0, x_stride, scales, offsets, s0, xd,
                xs, g0, g_stride), codegen


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
