"""Short SIMD vectors for numba kernels: three numba types whose values are LLVM vectors,
and the few operations the block decoders and the matmul loops need.

numba compiles scalar Python loops and leaves vectorization to LLVM, which finds it or
not depending on details (a `- 8` after a nibble mask turned a 32-byte unpack into 32
scalar byte operations; numba widens every integer operation to 64 bits). The decoders of
the GGUF block types and the integer dot products are written here against explicit
vectors instead, so what runs is what is written:

- `Bytes32` (`<32 x i8>`): 32 byte lanes: a block's codes as they are unpacked (nibbles,
  bit planes, grid entries, signs). Operators `& | ^ + - * << >>` work lane-wise with
  wrap-around; `>>` is logical; a scalar operand is broadcast.
- `Int32x8` (`<8 x i32>`): integer dot-product partial sums, from `dot_unsigned` /
  `dot_signed` (32 codes times 32 int8 activations, four products per 32-bit lane:
  llama.cpp's `vpmaddubsw` + `vpmaddwd`).
- `Float32x8` (`<8 x float>`): float32 partial sums and values (`+ - * /`, scalars
  broadcast, `muladd`), computed in the order written (numba_settings.JIT_ORDERED).

The vectors are generic LLVM IR, lowered by LLVM for whatever the machine has (AVX2 as
two or one 256-bit registers, AVX-512, SSE, NEON): no kernel assumes an instruction set.
Three operations use x86 instructions where the compiling machine has them, with a generic
fallback otherwise: the dot products (`vpmaddubsw`, `vpmaddwd`, `vpsignb` on AVX2, and
`vpdpbusd` for the unscaled ones where AVX-512 VNNI or AVX-VNNI is there; LLVM's
own instruction selection found `vpmaddwd` in isolation but lost it once the loads were
folded in, and has no saturating pair sum to match `vpmaddubsw` from) and `lut16` (a
16-entry byte table lookup, `vpshufb`; LLVM has no variable shuffle). numba's cache keys
every compiled kernel on the host CPU's name and features, so a kernel compiled with them
is never loaded on a machine without them.
"""

from __future__ import annotations

import operator

import llvmlite.binding as llvm_binding
import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, overload, register_model

_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())
_HALF = ir.HalfType()


def _vec(element: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(element, n)


def host_features() -> set[str]:
    """The instruction-set features numba compiles for: NUMBA_CPU_FEATURES where set,
    else the host's."""
    text = numba.config.CPU_FEATURES or llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in text.split(",") if f.startswith("+")}


_FEATURES = host_features()
_X86_AVX2 = "avx2" in _FEATURES
# `vpdpbusd` on 256-bit registers: AVX-512 VNNI with AVX-512 VL, or AVX-VNNI
_X86_VNNI = ("avx512vnni" in _FEATURES and "avx512vl" in _FEATURES) or "avxvnni" in _FEATURES
_X86_SSSE3 = "ssse3" in _FEATURES
_X86 = "sse2" in _FEATURES
_F16C = "f16c" in _FEATURES
# 512-bit vectors: the kernels here stay 256-bit, OpenBLAS's float32 ones do not
# (kernels/quantized.py's `PROMPT_RUNS`)
HOST_AVX512 = "avx512f" in _FEATURES


# -- the three vector types -------------------------------------------------------------------

class VectorType(types.Type):
    """A numba type whose value is one LLVM vector (`llvm` is its IR type)."""

    def __init__(self, name: str, llvm: ir.VectorType) -> None:
        self.llvm = llvm
        super().__init__(name=name)


class Bytes32Type(VectorType):
    def __init__(self) -> None:
        super().__init__("Bytes32", _vec(_I8, 32))


class Int32x8Type(VectorType):
    def __init__(self) -> None:
        super().__init__("Int32x8", _vec(_I32, 8))


class Float32x8Type(VectorType):
    def __init__(self) -> None:
        super().__init__("Float32x8", _vec(_F32, 8))


bytes32, int32x8, float32x8 = Bytes32Type(), Int32x8Type(), Float32x8Type()


@register_model(Bytes32Type)
@register_model(Int32x8Type)
@register_model(Float32x8Type)
class VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type: VectorType) -> None:
        super().__init__(dmm, fe_type, fe_type.llvm)


# -- IR helpers (kernels/cpu_panel_gemm.py's intrinsics use them too) ----------------------------

def element_ptr(context, builder, array_type, array, offset, offset_type, element: ir.Type):
    """A pointer to `element` at item `offset` of a numba array (C-contiguous, 1-D)."""
    data = context.make_array(array_type)(context, builder, array).data
    at = context.cast(builder, offset, offset_type, types.intp)
    return builder.bitcast(builder.gep(data, [at]), element.as_pointer())


def splat(builder, value: ir.Value, vec: ir.VectorType) -> ir.Value:
    one = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_vec(_I32, vec.count), [0] * vec.count))


def _scalar_to(context, builder, value, from_type, vec: ir.VectorType) -> ir.Value:
    """A numba scalar broadcast to `vec`'s element type and width."""
    element = vec.element
    if isinstance(element, ir.FloatType):
        scalar = context.cast(builder, value, from_type, types.float32)
    else:
        scalar = builder.trunc(context.cast(builder, value, from_type, types.int64), element) \
            if element.width < 64 else context.cast(builder, value, from_type, types.int64)
    return splat(builder, scalar, vec)


def _constant_lanes(vec: ir.VectorType, values) -> ir.Constant:
    return ir.Constant(vec, list(values))


# -- stack buffers ------------------------------------------------------------------------------

@intrinsic
def stack_empty(typingctx, n, dtype):
    """A 1-D C array of `n` (a compile-time constant) items of `dtype` on the stack frame,
    aligned to 64 bytes: no allocation, and LLVM may keep it in registers. Only valid in
    the function it is created in (never return it)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    count = n.literal_value
    array_type = types.Array(dtype.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        element = context.get_data_type(dtype.dtype)
        data = cgutils.alloca_once(builder, element, size=count)
        # aligned to a cache line (LLVM gave the element's own alignment): a 32-byte load
        # across two lines costs two; the few-rows `gemv` gained up to 29% (Q6_K, 24 rows)
        data.align = 64
        array = context.make_array(array_type)(context, builder)
        itemsize = context.get_abi_sizeof(element)
        context.populate_array(array, data=data,
                               shape=[context.get_constant(types.intp, count)],
                               strides=[context.get_constant(types.intp, itemsize)],
                               itemsize=context.get_constant(types.intp, itemsize),
                               meminfo=None)
        return array._getvalue()
    return array_type(n, dtype), codegen


# -- Bytes32 --------------------------------------------------------------------------------------

_V32 = _vec(_I8, 32)


@intrinsic
def load_bytes(typingctx, array, offset):
    """32 bytes of a byte array (uint8 / int8) from item `offset` on."""
    def codegen(context, builder, signature, args):
        ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                          signature.args[1], _V32)
        return builder.load(ptr, align=1)
    return bytes32(array, offset), codegen


@intrinsic
def load_bytes16(typingctx, array, offset):
    """16 bytes of a byte array from item `offset` on, in lanes 0-15 (16-31 zero): a
    block's header, without reading past the block."""
    def codegen(context, builder, signature, args):
        ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                          signature.args[1], _vec(_I8, 16))
        half = builder.load(ptr, align=1)
        return builder.shuffle_vector(half, ir.Constant(_vec(_I8, 16), None),
                                      _constant_lanes(_vec(_I32, 32), range(32)))
    return bytes32(array, offset), codegen


@intrinsic
def store_bytes(typingctx, array, offset, value):
    """`value` into 32 items of a byte array from `offset` on."""
    def codegen(context, builder, signature, args):
        ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                          signature.args[1], _V32)
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()
    return types.void(array, offset, value), codegen


def _nibbles(order: list[int]):
    @intrinsic
    def load(typingctx, array, offset):
        def codegen(context, builder, signature, args):
            ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                              signature.args[1], _vec(_I8, 16))
            half = builder.load(ptr, align=1)
            low = builder.and_(half, splat(builder, ir.Constant(_I8, 15), _vec(_I8, 16)))
            high = builder.lshr(half, splat(builder, ir.Constant(_I8, 4), _vec(_I8, 16)))
            return builder.shuffle_vector(low, high, _constant_lanes(_vec(_I32, 32), order))
        return bytes32(array, offset), codegen
    return load


# (shuffle lanes 0-15 are the low nibbles of bytes 0-15, 16-31 their high nibbles)
load_nibbles = _nibbles(list(range(32)))
load_nibbles.__doc__ = """The 32 nibbles of 16 bytes at `offset`: lanes 0-15 the low
nibbles of bytes 0-15, lanes 16-31 their high nibbles (ggml's layout for Q4_0, Q4_1,
IQ4_NL, MXFP4, ...)."""
load_nibbles_by8 = _nibbles([*range(8), *range(16, 24), *range(8, 16), *range(24, 32)])
load_nibbles_by8.__doc__ = """The 32 nibbles of 16 bytes in groups of 8 bytes: lanes 0-7
the low nibbles of bytes 0-7, 8-15 their high nibbles, then the same for bytes 8-15
(NVFP4's 16-value sub-blocks)."""


@intrinsic
def bit_lanes(typingctx, word, value):
    """Lane i = `value` (truncated to a byte) where bit i of the 32-bit integer `word` is
    set, else 0. The word is broadcast to eight 32-bit lanes and its byte i // 8 picked
    within each 128-bit half (`vpbroadcastd`, `vpshufb`): the same instructions LLVM chose
    for a shuffle of the word's four bytes into 32 lanes, but its cost model priced that
    one so high that a decoder calling this four times (Q1_0) was no longer unrolled in
    the loops, and its codes and scales went through the stack (Q1_0's one-row GEMV 1.7x
    slower, Q5_0 / Q5_1's 1.5x; docs/performance.md)."""
    def codegen(context, builder, signature, args):
        w = builder.trunc(context.cast(builder, args[0], signature.args[0], types.int64), _I32)
        words = builder.bitcast(splat(builder, w, _vec(_I32, 8)), _V32)
        spread = builder.shuffle_vector(words, words, _constant_lanes(
            _vec(_I32, 32), [16 * (i // 16) + i // 8 for i in range(32)]))
        bits = _constant_lanes(_V32, [1 << (i % 8) for i in range(32)])
        hit = builder.icmp_unsigned("==", builder.and_(spread, bits), bits)
        lanes = _scalar_to(context, builder, args[1], signature.args[1], _V32)
        return builder.and_(builder.sext(hit, _V32), lanes)
    return bytes32(word, value), codegen


@intrinsic
def splat_bytes(typingctx, value):
    """`value` (truncated to a byte) in every lane."""
    def codegen(context, builder, signature, args):
        return _scalar_to(context, builder, args[0], signature.args[0], _V32)
    return bytes32(value), codegen


@intrinsic
def negate_where(typingctx, value, mask):
    """Lanes of `value` negated where `mask` is 0xFF (its lanes are 0 or 0xFF:
    `bit_lanes(word, 0xFF)`)."""
    def codegen(context, builder, signature, args):
        return builder.sub(builder.xor(args[0], args[1]), args[1])
    return bytes32(value, mask), codegen


@intrinsic
def mul_high(typingctx, value, factor):
    """(lane * factor) >> 8, lanes unsigned and the product 16 bits wide (TQ1_0's base-3
    digits)."""
    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], _vec(_I16, 32))
        f = _scalar_to(context, builder, args[1], signature.args[1], _vec(_I16, 32))
        product = builder.mul(wide, f)
        shifted = builder.lshr(product, splat(builder, ir.Constant(_I16, 8), _vec(_I16, 32)))
        return builder.trunc(shifted, _V32)
    return bytes32(value, factor), codegen


@intrinsic
def lut16(typingctx, table, index):
    """Lane i = table[index[i]] for a 16-entry table (lanes 0-15 of `table`; every index
    below 16)."""
    def codegen(context, builder, signature, args):
        tbl, idx = args
        if _X86_AVX2:  # vpshufb looks up within each 128-bit half: the table in both
            both = builder.shuffle_vector(tbl, tbl, _constant_lanes(
                _vec(_I32, 32), [i % 16 for i in range(32)]))
            fn = builder.module.declare_intrinsic(
                "llvm.x86.avx2.pshuf.b", fnty=ir.FunctionType(_V32, [_V32, _V32]))
            return builder.call(fn, [both, idx])
        if _X86_SSSE3:
            v16 = _vec(_I8, 16)
            fn = builder.module.declare_intrinsic(
                "llvm.x86.ssse3.pshuf.b.128", fnty=ir.FunctionType(v16, [v16, v16]))
            low_tbl = builder.shuffle_vector(tbl, tbl, _constant_lanes(_vec(_I32, 16), range(16)))
            halves = [builder.call(fn, [low_tbl, builder.shuffle_vector(
                idx, idx, _constant_lanes(_vec(_I32, 16), range(h, h + 16)))])
                for h in (0, 16)]
            return builder.shuffle_vector(halves[0], halves[1],
                                          _constant_lanes(_vec(_I32, 32), range(32)))
        out = ir.Constant(_V32, None)
        for i in range(32):
            at = builder.extract_element(idx, ir.Constant(_I32, i))
            out = builder.insert_element(out, builder.extract_element(tbl, at),
                                         ir.Constant(_I32, i))
        return out
    return bytes32(table, index), codegen


@intrinsic
def gather_u64x4(typingctx, table, i0, i1, i2, i3):
    """Entries i0..i3 of a uint64 table, each 8 byte lanes (the IQ2 / IQ1 grids)."""
    def codegen(context, builder, signature, args):
        out = ir.Constant(_vec(_I64, 4), None)
        for lane in range(4):
            ptr = element_ptr(context, builder, signature.args[0], args[0], args[1 + lane],
                              signature.args[1 + lane], _I64)
            out = builder.insert_element(out, builder.load(ptr, align=8),
                                         ir.Constant(_I32, lane))
        return builder.bitcast(out, _V32)
    return bytes32(table, i0, i1, i2, i3), codegen


@intrinsic
def gather_u32x8(typingctx, table, i0, i1, i2, i3, i4, i5, i6, i7):
    """Entries i0..i7 of a uint32 table, each 4 byte lanes (the IQ3 grids)."""
    def codegen(context, builder, signature, args):
        out = ir.Constant(_vec(_I32, 8), None)
        for lane in range(8):
            ptr = element_ptr(context, builder, signature.args[0], args[0], args[1 + lane],
                              signature.args[1 + lane], _I32)
            out = builder.insert_element(out, builder.load(ptr, align=4),
                                         ir.Constant(_I32, lane))
        return builder.bitcast(out, _V32)
    return bytes32(table, i0, i1, i2, i3, i4, i5, i6, i7), codegen


# -- lane-wise operators ---------------------------------------------------------------------

_INT_OPS = {operator.and_: "and_", operator.or_: "or_", operator.xor: "xor",
            operator.add: "add", operator.sub: "sub", operator.mul: "mul",
            operator.lshift: "shl", operator.rshift: "lshr"}
_FLOAT_OPS = {operator.add: "fadd", operator.sub: "fsub", operator.mul: "fmul",
              operator.truediv: "fdiv"}


def _vector_binop(vector_type: VectorType, name: str):
    """An intrinsic for `vector op vector`, `vector op scalar` and `scalar op vector`."""
    @intrinsic
    def op(typingctx, a, b):
        def codegen(context, builder, signature, args):
            x, y = args
            if not isinstance(signature.args[0], VectorType):
                x = _scalar_to(context, builder, x, signature.args[0], vector_type.llvm)
            if not isinstance(signature.args[1], VectorType):
                y = _scalar_to(context, builder, y, signature.args[1], vector_type.llvm)
            return getattr(builder, name)(x, y)
        return vector_type(a, b), codegen
    return op


def _operator_typer(vector_type: VectorType, scalar: type, impl):
    def typer(a, b):
        vector = isinstance(a, type(vector_type)) or isinstance(b, type(vector_type))
        operands_ok = all(isinstance(t, (type(vector_type), scalar)) for t in (a, b))
        if vector and operands_ok:
            return lambda a, b: impl(a, b)
        return None
    return typer


def _register_operators(vector_type: VectorType, ops: dict, scalar: type) -> None:
    for pyop, name in ops.items():
        overload(pyop)(
            _operator_typer(vector_type, scalar, _vector_binop(vector_type, name)))


_register_operators(bytes32, _INT_OPS, types.Integer)
_register_operators(int32x8, {operator.add: "add", operator.sub: "sub", operator.mul: "mul"},
                    types.Integer)
_register_operators(float32x8, _FLOAT_OPS, (types.Float, types.Integer))


# -- integer dot products -----------------------------------------------------------------------

def pmaddwd(builder, a: ir.Value, b: ir.Value) -> ir.Value:
    """Two `<16 x i16>`: adjacent products summed into `<8 x i32>`."""
    if _X86_AVX2:
        fn = builder.module.declare_intrinsic(
            "llvm.x86.avx2.pmadd.wd",
            fnty=ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16), _vec(_I16, 16)]))
        return builder.call(fn, [a, b])
    return _pairs(builder, a, b, _vec(_I32, 8), builder.sext)


def _pairs(builder, a: ir.Value, b: ir.Value, wide: ir.VectorType, extend_a) -> ir.Value:
    """Adjacent products of a (extended by `extend_a`) and b (sign-extended) summed, in
    `wide` lanes: generic IR for the x86 instructions above and below."""
    n = wide.count
    parts = [builder.mul(extend_a(builder.shuffle_vector(a, a, lanes), wide),
                         builder.sext(builder.shuffle_vector(b, b, lanes), wide))
             for lanes in (_constant_lanes(_vec(_I32, n), range(0, 2 * n, 2)),
                           _constant_lanes(_vec(_I32, n), range(1, 2 * n, 2)))]
    return builder.add(parts[0], parts[1])


def pmaddubsw(builder, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """Two `<32 x i8>`, the first unsigned: adjacent products summed into `<16 x i16>`
    (saturating on x86; the callers' codes keep every pair sum within int16)."""
    if _X86_AVX2:
        fn = builder.module.declare_intrinsic(
            "llvm.x86.avx2.pmadd.ub.sw", fnty=ir.FunctionType(_vec(_I16, 16), [_V32, _V32]))
        return builder.call(fn, [unsigned, signed])
    return _pairs(builder, unsigned, signed, _vec(_I16, 16), builder.zext)


def _dpbusd(builder, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """`pmaddwd(pmaddubsw(unsigned, signed), ones)` in one VNNI instruction (`vpdpbusd`),
    one multiply instead of two: four adjacent products summed into each int32 lane, with
    no int16 pair sums in between (nothing to saturate). Not used for the scaled dot
    products: LLVM splits their `vpdpwssd` back into `vpmaddwd` + `vpaddd` on Intel cores
    (a shorter dependency chain for the same multiplies), measured no faster."""
    i32x8 = _vec(_I32, 8)
    fn = builder.module.declare_intrinsic(
        "llvm.x86.avx512.vpdpbusd.256", fnty=ir.FunctionType(i32x8, [i32x8] * 3))
    return builder.call(fn, [ir.Constant(i32x8, None), builder.bitcast(unsigned, i32x8),
                             builder.bitcast(signed, i32x8)])


def abs_and_sign(builder, codes: ir.Value, acts: ir.Value) -> tuple[ir.Value, ir.Value]:
    """|codes| and acts with the codes' signs (zero where a code is 0): their products are
    codes * acts with the codes unsigned, as `vpmaddubsw` wants them."""
    if _X86_AVX2:
        fn = builder.module.declare_intrinsic(
            "llvm.x86.avx2.psign.b", fnty=ir.FunctionType(_V32, [_V32, _V32]))
        magnitude = builder.call(fn, [codes, codes])
        return magnitude, builder.call(fn, [acts, codes])
    zero = ir.Constant(_V32, None)
    negative = builder.icmp_signed("<", codes, zero)
    magnitude = builder.select(negative, builder.sub(zero, codes), codes)
    signed = builder.select(negative, builder.sub(zero, acts), acts)
    return magnitude, builder.select(builder.icmp_signed("==", codes, zero), zero, signed)


def _dot(signed_codes: bool):
    @intrinsic
    def dot(typingctx, codes, acts, offset):
        def codegen(context, builder, signature, args):
            x = builder.load(element_ptr(context, builder, signature.args[1], args[1], args[2],
                                         signature.args[2], _V32), align=1)
            q = args[0]
            if signed_codes:
                q, x = abs_and_sign(builder, q, x)
            if _X86_VNNI:
                return _dpbusd(builder, q, x)
            pairs = pmaddubsw(builder, q, x)
            return pmaddwd(builder, pairs, ir.Constant(_vec(_I16, 16), [1] * 16))
        return int32x8(codes, acts, offset), codegen
    return dot


def _scaled_dot(signed_codes: bool):
    @intrinsic
    def dot(typingctx, codes, acts, offset, scales, at, pair):
        if not isinstance(pair, types.BooleanLiteral):
            return None
        two = pair.literal_value

        def codegen(context, builder, signature, args):
            x = builder.load(element_ptr(context, builder, signature.args[1], args[1], args[2],
                                         signature.args[2], _V32), align=1)
            q = args[0]
            if signed_codes:
                q, x = abs_and_sign(builder, q, x)
            pairs = pmaddubsw(builder, q, x)
            raw = builder.load(element_ptr(context, builder, signature.args[3], args[3],
                                           args[4], signature.args[4], _vec(_I8, 2)), align=1)
            wide = builder.sext(raw, _vec(_I16, 2))
            lanes = [0] * 8 + [1] * 8 if two else [0] * 16
            scale = builder.shuffle_vector(wide, wide, _constant_lanes(_vec(_I32, 16), lanes))
            return pmaddwd(builder, pairs, scale)
        return int32x8(codes, acts, offset, scales, at, pair), codegen
    return dot


dot_unsigned = _dot(False)
dot_unsigned.__doc__ = """Lane l = the sum of codes[4l .. 4l + 3] * acts[offset + 4l ..]: 32
codes 0..127 (a `Bytes32`) times 32 int8 activations (`vpmaddubsw` then `vpmaddwd` on x86:
llama.cpp's dot product; the pair sums stay within int16)."""
dot_signed = _dot(True)
dot_signed.__doc__ = """`dot_unsigned` for codes -128..127: their magnitudes times the
activations with the codes' signs."""
dot_unsigned_scaled = _scaled_dot(False)
dot_unsigned_scaled.__doc__ = """`dot_unsigned` with integer scales applied before the lanes
sum: the int8 scale scales[at] multiplies every product (`pair` False: one group of 32),
or scales[at] those of values 0-15 and scales[at + 1] those of 16-31 (`pair` True: two
groups of 16). llama.cpp's K-quant dot product: `vpmaddwd` by the scales instead of ones."""
dot_signed_scaled = _scaled_dot(True)
dot_signed_scaled.__doc__ = """`dot_unsigned_scaled` for codes -128..127."""


def _half_to_float(builder, value: ir.Value) -> ir.Value:
    """A float16 (or a vector of them) as float32: `fpext` (F16C's `vcvtph2ps`) where the
    machine has F16C; elsewhere LLVM makes `fpext` a call of a runtime helper that numba's
    JIT does not link (a call of address 0), so the bits are converted here: the exponent
    and mantissa moved into place and scaled by 2^112 (exact for normal and subnormal
    values alike), infinities and NaNs given the full exponent, the sign put back."""
    n = value.type.count if isinstance(value.type, ir.VectorType) else 0
    i32 = _vec(_I32, n) if n else _I32
    f32 = _vec(_F32, n) if n else _F32
    if _F16C or not _X86:  # (not x86: converted natively)
        return builder.fpext(value, f32)

    def c(v, t=_I32):
        return splat(builder, ir.Constant(t, v), _vec(t, n)) if n else ir.Constant(t, v)
    bits = builder.zext(builder.bitcast(value, _vec(_I16, n) if n else ir.IntType(16)), i32)
    magnitude = builder.bitcast(builder.shl(builder.and_(bits, c(0x7FFF)), c(13)), f32)
    scaled = builder.fmul(magnitude, c(2.0 ** 112, _F32))
    as_bits = builder.bitcast(scaled, i32)
    special = builder.fcmp_ordered(">=", scaled, c(65536.0, _F32))
    as_bits = builder.select(special, builder.or_(as_bits, c(0x7F800000)), as_bits)
    sign = builder.shl(builder.and_(bits, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(as_bits, sign), f32)


# -- float vectors --------------------------------------------------------------------------------

_F8 = _vec(_F32, 8)


@intrinsic
def zeros_i32x8(typingctx):
    def codegen(context, builder, signature, args):
        return ir.Constant(_vec(_I32, 8), None)
    return int32x8(), codegen


def _load_ints8(element: ir.Type, doc: str):
    @intrinsic
    def load(typingctx, array, offset):
        def codegen(context, builder, signature, args):
            raw = builder.load(element_ptr(context, builder, signature.args[0], args[0],
                                           args[1], signature.args[1], _vec(element, 8)),
                               align=1)
            return builder.sext(raw, _vec(_I32, 8)) if element.width < 32 else raw
        return int32x8(array, offset), codegen
    load.__doc__ = doc
    return load


load_i32x8 = _load_ints8(_I32, "8 int32 of an int32 array from item `offset` on.")
load_i8_i32x8 = _load_ints8(_I8, "8 int8 of a byte array from item `offset` on, as int32.")


@intrinsic
def zeros_f32x8(typingctx):
    def codegen(context, builder, signature, args):
        return ir.Constant(_F8, None)
    return float32x8(), codegen


def _muladd(builder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c, fused where the machine has a fused multiply-add (`llvm.fmuladd`: the
    same choice at every use on one machine, so every path rounds alike)."""
    fn = builder.module.declare_intrinsic("llvm.fmuladd.v8f32",
                                          fnty=ir.FunctionType(_F8, [_F8, _F8, _F8]))
    return builder.call(fn, [a, b, c])


@intrinsic
def muladd(typingctx, a, b, c):
    """a * b + c lane-wise (Float32x8), fused where the machine can."""
    def codegen(context, builder, signature, args):
        return _muladd(builder, *args)
    return float32x8(a, b, c), codegen


@intrinsic
def scaled_add(typingctx, acc, sums, scale):
    """float(sums) * scale + acc: an integer dot's lanes into float32 partial sums;
    `scale` a scalar (every lane) or a Float32x8 (one per lane)."""
    def codegen(context, builder, signature, args):
        s = args[2]
        if not isinstance(signature.args[2], VectorType):
            s = _scalar_to(context, builder, s, signature.args[2], _F8)
        return _muladd(builder, builder.sitofp(args[1], _F8), s, args[0])
    return float32x8(acc, sums, scale), codegen


@intrinsic
def pair_lanes(typingctx, array, index):
    """[a[i]] * 4 + [a[i + 1]] * 4 of a float32 array: the scales of two 16-value groups
    for the lanes of a 32-value `dot_unsigned` (lanes 0-3 sum values 0-15)."""
    def codegen(context, builder, signature, args):
        two = builder.load(element_ptr(context, builder, signature.args[0], args[0], args[1],
                                       signature.args[1], _vec(_F32, 2)), align=4)
        return builder.shuffle_vector(two, two, _constant_lanes(_vec(_I32, 8),
                                                                [0] * 4 + [1] * 4))
    return float32x8(array, index), codegen


def _bytes_to_floats(signed: bool):
    @intrinsic
    def convert(typingctx, value, part):
        if not isinstance(part, types.IntegerLiteral):
            return None
        first = 8 * part.literal_value

        def codegen(context, builder, signature, args):
            eight = builder.shuffle_vector(args[0], args[0], _constant_lanes(
                _vec(_I32, 8), range(first, first + 8)))
            return (builder.sitofp if signed else builder.uitofp)(eight, _F8)
        return float32x8(value, part), codegen
    return convert


ubytes_f32x8 = _bytes_to_floats(False)
ubytes_f32x8.__doc__ = """Lanes 8p .. 8p + 7 of a `Bytes32` (p a constant), unsigned, as
float32 (a block's scales unpacked as bytes)."""
sbytes_f32x8 = _bytes_to_floats(True)
sbytes_f32x8.__doc__ = """`ubytes_f32x8` for signed bytes."""


@intrinsic
def lane_sum(typingctx, value):
    """The sum of a Float32x8's lanes, as float32."""
    def codegen(context, builder, signature, args):
        v = args[0]
        for width in (4, 2, 1):
            low = builder.shuffle_vector(v, v, _constant_lanes(_vec(_I32, width), range(width)))
            high = builder.shuffle_vector(v, v, _constant_lanes(
                _vec(_I32, width), range(width, 2 * width)))
            v = builder.fadd(low, high)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(value), codegen


@intrinsic
def lane_sums8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """The lane sums of eight Float32x8s as one Float32x8 (lane i: the sum of a_i's
    lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), whatever the other seven hold):
    eight dot products finished in three rounds of pairwise adds (`vhaddps` on x86)
    instead of eight `lane_sum`s."""
    def codegen(context, builder, signature, args):
        def pairwise(x, y, lanes):
            even = builder.shuffle_vector(x, y, _constant_lanes(_vec(_I32, 8), lanes[0]))
            odd = builder.shuffle_vector(x, y, _constant_lanes(_vec(_I32, 8), lanes[1]))
            return builder.fadd(even, odd)
        hadd = ([0, 2, 8, 10, 4, 6, 12, 14], [1, 3, 9, 11, 5, 7, 13, 15])
        halves = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
        pairs = [pairwise(args[i], args[i + 1], hadd) for i in range(0, 8, 2)]
        quads = [pairwise(pairs[0], pairs[1], hadd), pairwise(pairs[2], pairs[3], hadd)]
        return pairwise(quads[0], quads[1], halves)
    return float32x8(a0, a1, a2, a3, a4, a5, a6, a7), codegen


@intrinsic
def load_f32x8(typingctx, array, offset):
    """8 float32 of an array from item `offset` on: of a float32 array, its items
    offset .. offset + 7; of a byte array (an F32 matrix's rows as bytes), the values at
    byte `offset`."""
    def codegen(context, builder, signature, args):
        return builder.load(element_ptr(context, builder, signature.args[0], args[0], args[1],
                                        signature.args[1], _F8), align=4)
    return float32x8(array, offset), codegen


@intrinsic
def store_f32x8(typingctx, array, offset, value):
    def codegen(context, builder, signature, args):
        builder.store(args[2], element_ptr(context, builder, signature.args[0], args[0],
                                           args[1], signature.args[1], _F8), align=4)
        return context.get_dummy_value()
    return types.void(array, offset, value), codegen


def _load8(element: ir.Type, convert, doc: str):
    """An intrinsic loading 8 `element`s at item (or byte) `offset` of an array, converted
    to a Float32x8 by `convert(builder, vector)`."""
    @intrinsic
    def load(typingctx, array, offset):
        def codegen(context, builder, signature, args):
            raw = builder.load(element_ptr(context, builder, signature.args[0], args[0],
                                           args[1], signature.args[1], _vec(element, 8)),
                               align=1)
            return convert(builder, raw)
        return float32x8(array, offset), codegen
    load.__doc__ = doc
    return load


codes_f32x8 = _load8(_I8, lambda b, v: b.sitofp(v, _F8),
                     "8 int8 codes from item `offset` on, as float32.")
load_f16x8 = _load8(_HALF, _half_to_float,
                    """8 IEEE float16 values at byte `offset` of a byte array, as float32
                    (F16C's `vcvtph2ps` on x86).""")
load_bf16x8 = _load8(_I16, lambda b, v: b.bitcast(b.shl(
    b.zext(v, _vec(_I32, 8)), splat(b, ir.Constant(_I32, 16), _vec(_I32, 8))), _F8),
    """8 bfloat16 values at byte `offset` of a byte array, as float32 (the bits shifted
    into a float32's upper half: exact).""")


# -- scalars of a block ---------------------------------------------------------------------------

def _scalar_load(element: ir.Type, result: types.Type, convert):
    @intrinsic
    def load(typingctx, array, byte_offset):
        def codegen(context, builder, signature, args):
            ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                              signature.args[1], element)
            return convert(builder, builder.load(ptr, align=1))
        return result(array, byte_offset), codegen
    return load


load_f16 = _scalar_load(_HALF, types.float32, _half_to_float)
load_f16.__doc__ = "The float16 at a byte offset of a byte array, as float32."
load_u16 = _scalar_load(_I16, types.int32, lambda b, v: b.zext(v, _I32))
load_u16.__doc__ = "The little-endian uint16 at a byte offset, as int32."
load_u32 = _scalar_load(_I32, types.int64, lambda b, v: b.zext(v, _I64))
load_u32.__doc__ = "The little-endian uint32 at a byte offset, as int64."
load_bf16 = _scalar_load(_I16, types.float32, lambda b, v: b.bitcast(
    b.shl(b.zext(v, _I32), ir.Constant(_I32, 16)), _F32))
load_bf16.__doc__ = "The bfloat16 at a byte offset of a byte array, as float32."
load_f32 = _scalar_load(_F32, types.float32, lambda b, v: v)
load_f32.__doc__ = "The float32 at a byte offset of a byte array."


@intrinsic
def store_u64(typingctx, array, byte_offset, value):
    """`value`'s low 64 bits, little-endian, at a byte offset of a byte array: eight bytes
    in one store (eight one-byte stores read back as a wider load stall the load until
    they are all written)."""
    def codegen(context, builder, signature, args):
        ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                          signature.args[1], _I64)
        builder.store(context.cast(builder, args[2], signature.args[2], types.int64), ptr,
                      align=1)
        return context.get_dummy_value()
    return types.void(array, byte_offset, value), codegen


@intrinsic
def half_to_float(typingctx, bits):
    """The float16 whose bits are the low 16 of `bits`, as float32."""
    def codegen(context, builder, signature, args):
        raw = builder.trunc(context.cast(builder, args[0], signature.args[0], types.int64), _I16)
        return _half_to_float(builder, builder.bitcast(raw, _HALF))
    return types.float32(bits), codegen


@intrinsic
def prefetch(typingctx, array, offset):
    """Ask for the cache line holding item `offset` of an array ahead of its use (x86's
    `prefetcht0`): for reads at strides the hardware prefetcher does not follow, such as
    one layer's K and V rows of a token-major cache."""
    def codegen(context, builder, signature, args):
        ptr = element_ptr(context, builder, signature.args[0], args[0], args[1],
                          signature.args[1], _I8)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [ptr.type],
            ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32]))
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(array, offset), codegen
