"""One decoder per GGUF block type, for the cpu kernels (kernels/cpu_quant_loops.py).

Every quantized type of ggml is, block by block, small integers times a scale per group of
16 or 32 values, for some plus a per-group minimum: `value = sc[s] * (q - OFFSET) + mn[s]`,
with a constant `OFFSET` per type (the registry's `code_offset`: 8 for Q4_0's nibbles, 32
for Q6_K's 6-bit codes, 1 for Q1_0's sign bits as codes 0 and 2, ...). A decoder turns
one block into exactly that:

    decode_<type>(row, o, q, sc, mn)

reads the block at byte `o` of `row` (uint8), writes its codes as bytes to `q[0:BLOCK]`
(0..127; -128..127 for the `signed` types), the scale of each group of `SUB` values to
`sc[0:BLOCK // SUB]` and, for the types with a minimum (`has_min`), the minimum to `mn`.
The loops do the rest: an integer dot product of the codes with 8-bit activations per 32
values, times the group's scale, the offset and minimum as one multiply by the group's
activation sum (the one-row and few-rows kernels), or the values themselves (the tiles
BLAS multiplies). Codes are exact, so the decoders lose nothing: `sc * (q - OFFSET) + mn`
is gguf-py's value to float32 rounding (the IQ1 types' codes are 8 * grid +- 1 and their
scale an eighth of gguf-py's, the same value exactly).

The 256-value superblock types (the K-quants, IQ1/IQ2/IQ3, IQ4_XS, TQ) have integer
sub-scales under one or two float scales per block, and their decoders say so
(`INT_SCALES` in the loops):

    d, dmin = decode_<type>(row, o, q, isc, imn)

writes the codes, the integer sub-scale of each group to `isc` and (`has_min`) the
integer min to `imn` (int8), and returns the block's float scales: value =
d * isc[s] * (q - OFFSET) - dmin * imn[s] (the IQ types' d is gguf-py's over 4 or 8, their
sub-scales 2s + 1: the same values exactly). The loops then scale the integer products
by the sub-scales before converting anything to float.

Codes are unsigned wherever the type allows (`vpmaddubsw` multiplies unsigned by signed
bytes; a signed code costs a sign transfer): nibbles and bit fields as they are, the IQ
types' signed grid values shifted up by their largest magnitude.

Block layouts are ggml's, as gguf-py's `gguf/quants.py` dequantizes them (the reference
the tests hold these to; for Q1_0, which gguf-py 0.19 cannot dequantize, llama.cpp's own
dequantizer's values, tests/fixtures/q1_0_llama.npz). Codes are unpacked 32 at a time as
`Bytes32` vectors (kernels/cpu_simd.py); scales are a few scalars per block. The IQ grids,
sign patterns and codebook come from gguf-py through kernels/iq_tables.py, the tables the
CUDA kernels are generated from.
"""

from __future__ import annotations

import numpy as np
from gguf import quants
from numba import njit

from eagerlm.kernels.cpu_simd import (
    bit_lanes,
    gather_u32x8,
    gather_u64x4,
    half_to_float,
    load_bytes,
    load_bytes16,
    load_f16,
    load_nibbles,
    load_nibbles_by8,
    load_u16,
    load_u32,
    lut16,
    mul_high,
    negate_where,
    splat_bytes,
    store_bytes,
    store_u64,
)
from eagerlm.kernels.iq_tables import grid_words, iq4_codebook, sign_masks
from eagerlm.kernels.numba_settings import JIT_ORDERED

_INLINE = {**JIT_ORDERED, "inline": "always"}


def _table32(values) -> np.ndarray:
    """A 16-entry byte table padded to the 32 bytes `load_bytes` reads."""
    out = np.zeros(32, np.int8)
    out[:len(values)] = values
    return out


_IQ4_VALUES = _table32(iq4_codebook())
# e2m1 values doubled (gguf-py's), shifted up by 12: codes 0..24 (code offset 12)
_FP4_CODES = _table32(np.array(quants.MXFP4.kvalues, np.int8) + 12)
_SIGN_MASKS = sign_masks()
_IQ2_XXS_GRID = grid_words(quants.IQ2_XXS, 8)
_IQ2_XS_GRID = grid_words(quants.IQ2_XS, 8)
_IQ2_S_GRID = grid_words(quants.IQ2_S, 8)
_IQ3_XXS_GRID = grid_words(quants.IQ3_XXS, 4)
_IQ3_S_GRID = grid_words(quants.IQ3_S, 4)
_IQ1_GRID = grid_words(quants.IQ1_S, 8)  # IQ1_M's too
# MXFP4's block exponent (e8m0) and NVFP4's sub-block scales (unsigned e4m3) as float32,
# halved as gguf-py's are (its codes are the e2m1 values doubled)
_E8M0_HALF = quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint32)).astype(np.float32)
_UE4M3_HALF = quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)).astype(np.float32)
_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _lanes(*groups: tuple[int, ...]) -> np.ndarray:
    """32 byte lanes from their first values (the rest 0): shuffle indices and masks for
    unpacking a block's packed scales with a few vector operations (`lut16`, `&`)."""
    out = np.zeros(32, np.uint8)
    values = [v for g in groups for v in g]
    out[:len(values)] = values
    return out


# Q4_K / Q5_K: 8 6-bit scales (lanes 0-7) and mins (8-15) from the 12 bytes b[0..11]:
# j < 4: scale b[j] & 63, min b[j + 4] & 63; j >= 4: scale b[j + 4] & 15 | (b[j - 4] >> 6)
# << 4, min b[j + 4] >> 4 | (b[j] >> 6) << 4 (ggml's get_scale_min_k4)
_K4_LOW = _lanes((0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11))
_K4_HIGH = _lanes((0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7))
_K4_MASK = _lanes((63,) * 4, (15,) * 4, (63,) * 4, (0,) * 4)
_K4_MASK_UPPER = _lanes((0,) * 12, (15,) * 4)
_K4_MASK_TOP = _lanes((0,) * 4, (0x30,) * 4, (0,) * 4, (0x30,) * 4)
_K4_MINS = _lanes(tuple(range(8, 16)))
# Q3_K: 16 6-bit scales from 12 bytes: low nibble of b[s] (s < 8) or high nibble of
# b[s - 8], two high bits (b[8 + s % 4] >> 2 (s // 4)) & 3
_Q3_LOW = _lanes(tuple(range(8)) * 2)
_Q3_HIGH = _lanes((8, 9, 10, 11) * 4)
_MASK_LOW8 = _lanes((15,) * 8)
_MASK_HIGH8 = _lanes((0,) * 8, (15,) * 8)
_Q3_PAIRS = np.stack([_lanes((0,) * 4 * k, (3,) * 4) for k in range(4)]).reshape(-1)
# TQ1_0's values 160-255: bytes 32-47 for values 160 + 16k + i (lanes 0-15, then again
# 16-31), bytes 48-51 for values 240 + 4k + i; the powers of 3 each lane's digit needs
_TQ1_TWICE = _lanes(tuple(range(16)) * 2)
_TQ1_LOW_HALF = _lanes((0xFF,) * 16)
_TQ1_HIGH_HALF = _lanes((0,) * 16, (0xFF,) * 16)
_TQ1_LAST = _lanes((10,) * 16, (10, 11, 12, 13) * 4)
_TQ1_POWERS = np.concatenate([_lanes((1,) * 16, (3,) * 16), _lanes((9,) * 16, (27,) * 16),
                              _lanes((81,) * 16, (1,) * 4, (3,) * 4, (9,) * 4, (27,) * 4)])
# IQ1_M's 16 3-bit scales: scale s is bits 3 (s % 4) .. of the uint16 s // 4, i.e. of
# the byte pair from byte 2 (s // 4) + (3 (s % 4)) // 8, shifted right by (3 (s % 4)) % 8
_IQ1M_BYTE = _lanes(tuple(8 + 2 * (s // 4) + (3 * (s % 4)) // 8 for s in range(16)))
_IQ1M_SHIFT = np.concatenate([_lanes(tuple((3 * (s % 4)) % 8 for s in range(16))),
                              # the next byte's share (a shift by 7 leaves none of it in
                              # the low 3 bits: a byte shift by 8 is undefined in LLVM)
                              _lanes(tuple(8 - (3 * (s % 4)) % 8 or 7 for s in range(16)))])
# nibble pairs (IQ scales): lane 2i low nibble of byte i, 2i + 1 its high nibble
_NIBBLE_PAIRS = _lanes(tuple(i // 2 for i in range(16)))
_MASK_EVEN = _lanes((15, 0) * 8)
_MASK_ODD = _lanes((0, 15) * 8)
# the IQ types' signed codes shifted up by their largest magnitude (the registry's
# code_offset): IQ2 grids hold 8, 25, 43; IQ3_XXS's 4 .. 62; IQ3_S's 1 .. 15; IQ1's codes
# 8 * grid +- 1 reach 9
_IQ2_OFFSET, _IQ3_XXS_OFFSET, _IQ3_S_OFFSET, _IQ1_OFFSET = 43, 62, 15, 9


# -- 32-value blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 ------------------------------

@njit(**_INLINE)
def decode_q4_0(row, o, q, sc, mn):
    """18 bytes: float16 d, 16 bytes of nibbles; value = d * (nibble - 8) (offset 8)."""
    sc[0] = load_f16(row, o)
    store_bytes(q, 0, load_nibbles(row, o + 2))


@njit(**_INLINE)
def decode_q4_1(row, o, q, sc, mn):
    """20 bytes: float16 d and m, 16 bytes of nibbles; value = d * nibble + m."""
    sc[0] = load_f16(row, o)
    mn[0] = load_f16(row, o + 2)
    store_bytes(q, 0, load_nibbles(row, o + 4))


@njit(**_INLINE)
def decode_q5_0(row, o, q, sc, mn):
    """22 bytes: float16 d, 32 fifth bits (bit i for value i), nibbles as Q4_0's;
    value = d * (q - 16) (offset 16)."""
    sc[0] = load_f16(row, o)
    high = bit_lanes(load_u32(row, o + 2), 16)
    store_bytes(q, 0, load_nibbles(row, o + 6) | high)


@njit(**_INLINE)
def decode_q5_1(row, o, q, sc, mn):
    """24 bytes: float16 d and m, fifth bits, nibbles; value = d * q + m."""
    sc[0] = load_f16(row, o)
    mn[0] = load_f16(row, o + 2)
    store_bytes(q, 0, load_nibbles(row, o + 8) | bit_lanes(load_u32(row, o + 4), 16))


@njit(**_INLINE)
def decode_q8_0(row, o, q, sc, mn):
    """34 bytes: float16 d, int8 q[32]; value = d * q."""
    sc[0] = load_f16(row, o)
    store_bytes(q, 0, load_bytes(row, o + 2))


@njit(**_INLINE)
def decode_iq4_nl(row, o, q, sc, mn):
    """18 bytes: float16 d, 16 bytes of nibbles indexing the IQ4 codebook."""
    sc[0] = load_f16(row, o)
    store_bytes(q, 0, lut16(load_bytes(_IQ4_VALUES, 0), load_nibbles(row, o + 2)))


@njit(**_INLINE)
def decode_mxfp4(row, o, q, sc, mn):
    """17 bytes: an e8m0 exponent, 16 bytes of e2m1 nibbles (codes: the values doubled,
    offset 12)."""
    sc[0] = _E8M0_HALF[row[o]]
    store_bytes(q, 0, lut16(load_bytes(_FP4_CODES, 0), load_nibbles(row, o + 1)))


@njit(**_INLINE)
def decode_nvfp4(row, o, q, sc, mn):
    """36 bytes per 64 values: four unsigned e4m3 scales (one per 16 values), then 8 bytes
    of e2m1 nibbles per 16 values (low nibbles first); codes as MXFP4's."""
    for s in range(4):
        sc[s] = _UE4M3_HALF[row[o + s]]
    table = load_bytes(_FP4_CODES, 0)
    for c in range(2):
        store_bytes(q, 32 * c, lut16(table, load_nibbles_by8(row, o + 4 + 16 * c)))


# -- 128-value blocks: Q1_0 --------------------------------------------------------------------

@njit(**_INLINE)
def decode_q1_0(row, o, q, sc, mn):
    """18 bytes per 128 values: float16 d, then a bit per value (bit i % 8 of byte i // 8);
    value = +d where it is set, else -d: code 2 * bit, offset 1, the same scale d for the
    block's four groups of 32 (llama.cpp's activations are Q8_0's 32-value blocks too)."""
    d = load_f16(row, o)
    for s in range(4):
        sc[s] = d
        store_bytes(q, 32 * s, bit_lanes(load_u32(row, o + 2 + 4 * s), 2))


# -- K-quants: 256-value superblocks ---------------------------------------------------------

@njit(**_INLINE)
def decode_q2_k(row, o, q, isc, imn):
    """84 bytes: 16 bytes of 4-bit scale and min per 16 values, 64 bytes of 2-bit codes
    (32-value chunk c: bits 2(c % 4) of bytes 32(c // 4) ..), float16 d, dmin;
    value = d * scale * q - dmin * min."""
    packed = load_bytes16(row, o)
    store_bytes(isc, 0, packed & 15)
    store_bytes(imn, 0, packed >> 4)
    for c in range(8):
        store_bytes(q, 32 * c, (load_bytes(row, o + 16 + 32 * (c // 4)) >> (2 * (c % 4))) & 3)
    return load_f16(row, o + 80), load_f16(row, o + 82)


@njit(**_INLINE)
def decode_q3_k(row, o, q, isc, imn):
    """110 bytes: 32 bytes of high bits (hmask), 64 bytes of 2-bit codes (as Q2_K's), 12
    bytes of 6-bit scales, float16 d; value = d * (scale - 32) * (q - 4 * !high): code
    low | high << 2, offset 4."""
    packed = load_bytes16(row, o + 94)  # the block's last 16 bytes: scales at lanes 2-13
    low = lut16(packed, load_bytes(_Q3_LOW, 0) + 2)
    low = (low & load_bytes(_MASK_LOW8, 0)) | ((low >> 4) & load_bytes(_MASK_HIGH8, 0))
    high = lut16(packed, load_bytes(_Q3_HIGH, 0) + 2)
    high = ((high & load_bytes(_Q3_PAIRS, 0)) | ((high >> 2) & load_bytes(_Q3_PAIRS, 32))
            | ((high >> 4) & load_bytes(_Q3_PAIRS, 64)) | ((high >> 6) & load_bytes(_Q3_PAIRS, 96)))
    store_bytes(isc, 0, (low | (high << 4)) - 32)
    hmask = load_bytes(row, o)
    for c in range(8):
        low = (load_bytes(row, o + 32 + 32 * (c // 4)) >> (2 * (c % 4))) & 3
        store_bytes(q, 32 * c, low | (((hmask >> c) & 1) << 2))
    return load_f16(row, o + 108), np.float32(0.0)


@njit(**_INLINE)
def _k4_scales(row, o, isc, imn):
    """The 8 6-bit scales and mins of a Q4_K / Q5_K superblock; returns d, dmin."""
    packed = load_bytes16(row, o + 4)
    low = lut16(packed, load_bytes(_K4_LOW, 0))
    high = lut16(packed, load_bytes(_K4_HIGH, 0))
    both = ((low & load_bytes(_K4_MASK, 0)) | ((low >> 4) & load_bytes(_K4_MASK_UPPER, 0))
            | (((high >> 6) << 4) & load_bytes(_K4_MASK_TOP, 0)))
    store_bytes(isc, 0, both)  # lanes 0-7: scales
    store_bytes(imn, 0, lut16(both, load_bytes(_K4_MINS, 0)))  # lanes 8-15: mins
    return load_f16(row, o), load_f16(row, o + 2)


@njit(**_INLINE)
def decode_q4_k(row, o, q, isc, imn):
    """144 bytes: float16 d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
    32, 128 bytes of nibbles (bytes 32c.. : low nibbles sub-block 2c, high 2c + 1);
    value = d * scale * q - dmin * min."""
    d, dmin = _k4_scales(row, o, isc, imn)
    for c in range(4):
        v = load_bytes(row, o + 16 + 32 * c)
        store_bytes(q, 64 * c, v & 15)
        store_bytes(q, 64 * c + 32, v >> 4)
    return d, dmin


@njit(**_INLINE)
def decode_q5_k(row, o, q, isc, imn):
    """176 bytes: Q4_K's with 32 bytes of fifth bits before the nibbles (bit s of byte i:
    value i of sub-block s)."""
    d, dmin = _k4_scales(row, o, isc, imn)
    high = load_bytes(row, o + 16)
    for c in range(4):
        v = load_bytes(row, o + 48 + 32 * c)
        store_bytes(q, 64 * c, (v & 15) | (((high >> (2 * c)) & 1) << 4))
        store_bytes(q, 64 * c + 32, (v >> 4) | (((high >> (2 * c + 1)) & 1) << 4))
    return d, dmin


@njit(**_INLINE)
def decode_q6_k(row, o, q, isc, imn):
    """210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales
    (one per 16 values), float16 d; value = d * scale * (q - 32) (offset 32). In half h,
    values 32g.. : nibble g // 2 of bytes 64h + 32(g % 2).., bits 2g of bytes 128 + 32h.."""
    store_bytes(isc, 0, load_bytes16(row, o + 192))
    for h in range(2):
        high = load_bytes(row, o + 128 + 32 * h)
        for g in range(4):
            low = load_bytes(row, o + 64 * h + 32 * (g % 2)) >> (4 * (g // 2))
            code = (low & 15) | (((high >> (2 * g)) & 3) << 4)
            store_bytes(q, 128 * h + 32 * g, code)
    return load_f16(row, o + 208), np.float32(0.0)


# -- ternary: TQ1_0, TQ2_0 --------------------------------------------------------------------

@njit(**_INLINE)
def decode_tq1_0(row, o, q, isc, imn):
    """54 bytes: 48 bytes of five base-3 digits each (bytes 0-31: values 32k + i, bytes
    32-47: values 160 + 16k + i), 4 bytes of four digits (values 240 + 4k + i), float16 d;
    value = d * (digit - 1) (offset 1). Digit k of byte b is ((b * 3^k mod 256) * 3) >> 8
    (ggml's fixed-point packing)."""
    store_bytes(isc, 0, splat_bytes(1))
    first = load_bytes(row, o)
    for k in range(5):
        store_bytes(q, 32 * k, mul_high(first * _POW3[k], 3))
    second = load_bytes16(row, o + 32)  # bytes 32-47 in lanes 0-15
    both = lut16(second, load_bytes(_TQ1_TWICE, 0))  # ... and again in lanes 16-31
    store_bytes(q, 160, mul_high(both * load_bytes(_TQ1_POWERS, 0), 3))
    store_bytes(q, 192, mul_high(both * load_bytes(_TQ1_POWERS, 32), 3))
    last = load_bytes16(row, o + 38)  # bytes 48-51 in lanes 10-13
    mixed = ((both & load_bytes(_TQ1_LOW_HALF, 0))
             | (lut16(last, load_bytes(_TQ1_LAST, 0)) & load_bytes(_TQ1_HIGH_HALF, 0)))
    store_bytes(q, 224, mul_high(mixed * load_bytes(_TQ1_POWERS, 64), 3))
    return load_f16(row, o + 52), np.float32(0.0)


@njit(**_INLINE)
def decode_tq2_0(row, o, q, isc, imn):
    """66 bytes: 64 bytes of 2-bit codes (as Q2_K's), float16 d; value = d * (q - 1)
    (offset 1)."""
    store_bytes(isc, 0, splat_bytes(1))
    for c in range(8):
        store_bytes(q, 32 * c, (load_bytes(row, o + 32 * (c // 4)) >> (2 * (c % 4))) & 3)
    return load_f16(row, o + 64), np.float32(0.0)


# -- IQ4_XS ----------------------------------------------------------------------------------

@njit(**_INLINE)
def _every_other_byte(x):
    """Bytes 0-3 of x at bytes 0, 2, 4 and 6."""
    x = (x & 0xFFFF) | ((x & 0xFFFF0000) << 16)
    return (x & 0x000000FF000000FF) | ((x & 0x0000FF000000FF00) << 8)


@njit(**_INLINE)
def _iq4_xs_scales(row, o):
    """IQ4_XS's eight 6-bit scales less 32, as the int8 bytes of one int64 (byte s: scale
    s): low nibbles from bytes 4-7 (scale 2i the low nibble of byte 4 + i, 2i + 1 its high
    one), high bit pairs from the uint16 at 2 (bits 2s, 2s + 1), put together in the
    bytes' lanes of one integer."""
    low = load_u32(row, o + 4)
    nibbles = _every_other_byte(low & 0x0F0F0F0F) | (_every_other_byte((low >> 4) & 0x0F0F0F0F)
                                                     << 8)
    h = np.int64(load_u16(row, o + 2))
    h = (h & 0xFF) | ((h & 0xFF00) << 24)
    h = (h & 0x0000000F0000000F) | ((h & 0x000000F0000000F0) << 12)
    h = (h & 0x0003000300030003) | ((h & 0x000C000C000C000C) << 6)
    flipped = (nibbles | (h << 4)) ^ 0x2020202020202020  # v - 32 for v >= 32
    negative = flipped & 0x2020202020202020  # v < 32: bits 5-7 set, as int8
    return flipped | (negative << 1) | (negative << 2)


@njit(**_INLINE)
def decode_iq4_xs(row, o, q, isc, imn):
    """136 bytes: float16 d, 8 6-bit scales (low nibbles in bytes 4-7, high bit pairs in
    the uint16 at 2), 128 bytes of codebook nibbles (16 bytes per 32 values). The scales
    go into isc in one store (`store_u64`)."""
    store_u64(isc, 0, _iq4_xs_scales(row, o))
    table = load_bytes(_IQ4_VALUES, 0)
    for s in range(8):
        store_bytes(q, 32 * s, lut16(table, load_nibbles(row, o + 8 + 16 * s)))
    return load_f16(row, o), np.float32(0.0)


# -- IQ2 / IQ3: grid entries with signs -----------------------------------------------------

@njit(**_INLINE)
def decode_iq2_xxs(row, o, q, isc, imn):
    """66 bytes: float16 d, then per 32 values two uint32: four grid indices (bytes), and
    four 7-bit sign indices plus a 4-bit scale s: d * (0.5 + s) / 4, here d / 8 times
    the integer 2s + 1."""
    for s in range(8):
        at = o + 2 + 8 * s
        aux = load_u32(row, at + 4)
        isc[s] = 2 * (aux >> 28) + 1
        grid = gather_u64x4(_IQ2_XXS_GRID, row[at], row[at + 1], row[at + 2], row[at + 3])
        signs = gather_u64x4(_SIGN_MASKS, aux & 127, (aux >> 7) & 127, (aux >> 14) & 127,
                             (aux >> 21) & 127)
        store_bytes(q, 32 * s, negate_where(grid, signs) + _IQ2_OFFSET)
    return load_f16(row, o) * np.float32(0.125), np.float32(0.0)


@njit(**_INLINE)
def _iq2_scales(row, o, tail, isc):
    """IQ2_XS / IQ2_S: 16 4-bit scales s, the nibbles of bytes 8-15 of the 16 at `tail`
    (low nibble first): d * (0.5 + s) / 4, here the integers 2s + 1; returns d / 8."""
    pairs = lut16(load_bytes16(row, tail), load_bytes(_NIBBLE_PAIRS, 0) + 8)
    nibbles = (pairs & load_bytes(_MASK_EVEN, 0)) | ((pairs >> 4) & load_bytes(_MASK_ODD, 0))
    store_bytes(isc, 0, (nibbles << 1) + 1)
    return load_f16(row, o) * np.float32(0.125)


@njit(**_INLINE)
def decode_iq2_xs(row, o, q, isc, imn):
    """74 bytes: float16 d, 32 uint16 (9-bit grid index, 7-bit sign index per 8 values),
    8 bytes of 4-bit scales (one per 16 values): d * (0.5 + s) / 4."""
    d = _iq2_scales(row, o, o + 58, isc)  # the block's last 16 bytes: scales at 8-15
    for c in range(8):
        at = o + 2 + 8 * c
        e0, e1 = load_u16(row, at), load_u16(row, at + 2)
        e2, e3 = load_u16(row, at + 4), load_u16(row, at + 6)
        grid = gather_u64x4(_IQ2_XS_GRID, e0 & 511, e1 & 511, e2 & 511, e3 & 511)
        signs = gather_u64x4(_SIGN_MASKS, e0 >> 9, e1 >> 9, e2 >> 9, e3 >> 9)
        store_bytes(q, 32 * c, negate_where(grid, signs) + _IQ2_OFFSET)
    return d, np.float32(0.0)


@njit(**_INLINE)
def decode_iq2_s(row, o, q, isc, imn):
    """82 bytes: float16 d, 32 low bytes of 10-bit grid indices, 32 sign bytes (bit k:
    value k of an 8-value group), 8 bytes of the indices' high bit pairs, 8 bytes of 4-bit
    scales (one per 16 values): d * (0.5 + s) / 4."""
    d = _iq2_scales(row, o, o + 66, isc)  # the block's last 16 bytes: scales at 8-15
    for c in range(8):
        high = np.int32(row[o + 66 + c])
        at = o + 2 + 4 * c
        grid = gather_u64x4(_IQ2_S_GRID,
                            np.int32(row[at]) | ((high & 3) << 8),
                            np.int32(row[at + 1]) | (((high >> 2) & 3) << 8),
                            np.int32(row[at + 2]) | (((high >> 4) & 3) << 8),
                            np.int32(row[at + 3]) | (((high >> 6) & 3) << 8))
        store_bytes(q, 32 * c, negate_where(grid, bit_lanes(load_u32(row, o + 34 + 4 * c), 0xFF))
                    + _IQ2_OFFSET)
    return d, np.float32(0.0)


@njit(**_INLINE)
def decode_iq3_xxs(row, o, q, isc, imn):
    """98 bytes: float16 d, 64 bytes of grid indices (4 values each), then per 32 values
    a uint32 of four 7-bit sign indices and a 4-bit scale s: d * (0.5 + s) / 2, here d / 4
    times the integer 2s + 1."""
    for s in range(8):
        aux = load_u32(row, o + 66 + 4 * s)
        isc[s] = 2 * (aux >> 28) + 1
        at = o + 2 + 8 * s
        grid = gather_u32x8(_IQ3_XXS_GRID, row[at], row[at + 1], row[at + 2], row[at + 3],
                            row[at + 4], row[at + 5], row[at + 6], row[at + 7])
        signs = gather_u64x4(_SIGN_MASKS, aux & 127, (aux >> 7) & 127, (aux >> 14) & 127,
                             (aux >> 21) & 127)
        store_bytes(q, 32 * s, negate_where(grid, signs) + _IQ3_XXS_OFFSET)
    return load_f16(row, o) * np.float32(0.25), np.float32(0.0)


@njit(**_INLINE)
def decode_iq3_s(row, o, q, isc, imn):
    """110 bytes: float16 d, 64 low bytes of 9-bit grid indices (4 values each), 8 bytes of
    their high bits, 32 sign bytes, 4 bytes of 4-bit scales (one per 32 values):
    d * (1 + 2s)."""
    for s in range(8):
        nib = (np.int32(row[o + 106 + s // 2]) >> (4 * (s % 2))) & 15
        isc[s] = 1 + 2 * nib
        high = np.int32(row[o + 66 + s])
        at = o + 2 + 8 * s
        grid = gather_u32x8(_IQ3_S_GRID,
                            np.int32(row[at]) | ((high & 1) << 8),
                            np.int32(row[at + 1]) | (((high >> 1) & 1) << 8),
                            np.int32(row[at + 2]) | (((high >> 2) & 1) << 8),
                            np.int32(row[at + 3]) | (((high >> 3) & 1) << 8),
                            np.int32(row[at + 4]) | (((high >> 4) & 1) << 8),
                            np.int32(row[at + 5]) | (((high >> 5) & 1) << 8),
                            np.int32(row[at + 6]) | (((high >> 6) & 1) << 8),
                            np.int32(row[at + 7]) | (((high >> 7) & 1) << 8))
        store_bytes(q, 32 * s, negate_where(grid, bit_lanes(load_u32(row, o + 74 + 4 * s), 0xFF))
                    + _IQ3_S_OFFSET)
    return load_f16(row, o), np.float32(0.0)


# -- IQ1: grid entries of -1, 0, 1 plus a shift of an eighth ----------------------------------

@njit(**_INLINE)
def decode_iq1_s(row, o, q, isc, imn):
    """50 bytes: float16 d, 32 low bytes of 11-bit grid indices (8 values each), then per
    32 values a uint16: the indices' high bits (3 each), a 3-bit scale s and the sign of
    the shift; value = d * (2s + 1) * (grid +- 1/8), here code 8 * grid +- 1 times an
    eighth of the scale (d / 8 times the integer 2s + 1)."""
    for s in range(8):
        h = load_u16(row, o + 34 + 2 * s)
        isc[s] = 2 * ((h >> 12) & 7) + 1
        at = o + 2 + 4 * s
        grid = gather_u64x4(_IQ1_GRID,
                            np.int32(row[at]) | ((h & 7) << 8),
                            np.int32(row[at + 1]) | (((h >> 3) & 7) << 8),
                            np.int32(row[at + 2]) | (((h >> 6) & 7) << 8),
                            np.int32(row[at + 3]) | (((h >> 9) & 7) << 8))
        shift = -1 if h & 0x8000 else 1
        store_bytes(q, 32 * s, (grid << 3) + splat_bytes(shift + _IQ1_OFFSET))
    return load_f16(row, o) * np.float32(0.125), np.float32(0.0)


@njit(**_INLINE)
def decode_iq1_m(row, o, q, isc, imn):
    """56 bytes: 32 low bytes of 11-bit grid indices (8 values each), 16 bytes of a
    nibble per 8 values (3 high index bits, the shift's sign), 4 uint16 holding 16 3-bit
    scales (one per 16 values) and, in their top nibbles, the float16 d;
    value = d * (2s + 1) * (grid +- 1/8)."""
    w0, w1 = load_u16(row, o + 48), load_u16(row, o + 50)
    w2, w3 = load_u16(row, o + 52), load_u16(row, o + 54)
    d = half_to_float((w0 >> 12) | ((w1 >> 8) & 0xF0) | ((w2 >> 4) & 0xF00) | (w3 & 0xF000))
    words = load_bytes16(row, o + 40)  # the block's last 16 bytes: the words at lanes 8-15
    low = lut16(words, load_bytes(_IQ1M_BYTE, 0)) >> load_bytes(_IQ1M_SHIFT, 0)
    high = lut16(words, load_bytes(_IQ1M_BYTE, 0) + 1) << load_bytes(_IQ1M_SHIFT, 32)
    store_bytes(isc, 0, (((low | high) & 7) << 1) + 1)
    for c in range(8):
        n0, n1 = np.int32(row[o + 32 + 2 * c]), np.int32(row[o + 33 + 2 * c])
        at = o + 4 * c
        grid = gather_u64x4(_IQ1_GRID,
                            np.int32(row[at]) | ((n0 & 7) << 8),
                            np.int32(row[at + 1]) | (((n0 >> 4) & 7) << 8),
                            np.int32(row[at + 2]) | ((n1 & 7) << 8),
                            np.int32(row[at + 3]) | (((n1 >> 4) & 7) << 8))
        negative = (((n0 >> 3) & 1) * 0xFF | ((n0 >> 7) & 1) * 0xFF00
                    | ((n1 >> 3) & 1) * 0xFF0000 | ((n1 >> 7) & 1) * 0xFF000000)
        store_bytes(q, 32 * c, (grid << 3) + (1 + _IQ1_OFFSET) - bit_lanes(negative, 2))
    return d * np.float32(0.125), np.float32(0.0)
