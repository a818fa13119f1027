// The GGUF block types' decoders, shared by dequant.cu (whole tensors, tiles) and
// quant_matrix.cu (the fused GEMV and the embedding lookup over blocks kept on the device).
//
// Block layouts follow ggml (ggml-common.h) as gguf-py's quants.py reads them; each
// decoder's `at(block, j)` gives element j of one block. Products are rounded as the numpy
// reference rounds them (__fmul_rn keeps the compiler from fusing a multiply-add), so the
// float32 value equals gguf.quants.dequantize.
//
// Bytes are assembled one at a time: blocks are 2-byte aligned at best (Q8_0 is 34 bytes).
#pragma once

#include "common.cuh"
#include "iq_tables.cuh"

__device__ __forceinline__ float ld_f16(const unsigned char* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}
__device__ __forceinline__ unsigned ld_u32(const unsigned char* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned)p[3] << 24);
}

struct F32 {
  static constexpr int QK = 1, BYTES = 4;
  __device__ static float at(const unsigned char* b, int) { return __uint_as_float(ld_u32(b)); }
};
struct F16 {
  static constexpr int QK = 1, BYTES = 2;
  __device__ static float at(const unsigned char* b, int) { return ld_f16(b); }
};
struct BF16 {
  static constexpr int QK = 1, BYTES = 2;
  __device__ static float at(const unsigned char* b, int) {
    return __uint_as_float((unsigned)(b[0] | (b[1] << 8)) << 16);
  }
};

// d: f16, qs: 16 bytes, element j < 16 in the low nibble of qs[j], j >= 16 in the high.
__device__ __forceinline__ int nibble32(const unsigned char* qs, int j) {
  return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
}

struct Q4_0 {  // d, qs[16]
  static constexpr int QK = 32, BYTES = 18;
  __device__ static float at(const unsigned char* b, int j) {
    return __fmul_rn(ld_f16(b), (float)(nibble32(b + 2, j) - 8));
  }
};
struct Q4_1 {  // d, m, qs[16]
  static constexpr int QK = 32, BYTES = 20;
  __device__ static float at(const unsigned char* b, int j) {
    return __fadd_rn(__fmul_rn(ld_f16(b), (float)nibble32(b + 4, j)), ld_f16(b + 2));
  }
};
struct Q5_0 {  // d, qh (u32: bit j is element j's fifth bit), qs[16]
  static constexpr int QK = 32, BYTES = 22;
  __device__ static float at(const unsigned char* b, int j) {
    const int q = nibble32(b + 6, j) | (((ld_u32(b + 2) >> j) & 1) << 4);
    return __fmul_rn(ld_f16(b), (float)(q - 16));
  }
};
struct Q5_1 {  // d, m, qh, qs[16]
  static constexpr int QK = 32, BYTES = 24;
  __device__ static float at(const unsigned char* b, int j) {
    const int q = nibble32(b + 8, j) | (((ld_u32(b + 4) >> j) & 1) << 4);
    return __fadd_rn(__fmul_rn(ld_f16(b), (float)q), ld_f16(b + 2));
  }
};
struct Q8_0 {  // d, qs: int8[32]
  static constexpr int QK = 32, BYTES = 34;
  __device__ static float at(const unsigned char* b, int j) {
    return __fmul_rn((float)(signed char)b[2 + j], ld_f16(b));
  }
};

// K-quants: super-blocks of 256 elements.
struct Q2_K {  // scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin
  static constexpr int QK = 256, BYTES = 84;
  __device__ static float at(const unsigned char* b, int j) {
    const int sc = b[j / 16];
    const float dl = __fmul_rn(ld_f16(b + 80), (float)(sc & 0xF));
    const float ml = __fmul_rn(ld_f16(b + 82), (float)(sc >> 4));
    const int h = j / 128, s = (j % 128) / 32, l = j % 32;
    const int q = (b[16 + h * 32 + l] >> (2 * s)) & 3;
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
  }
};
struct Q3_K {  // hmask[32], qs[64], scales[12] (16 x 6 bits), d
  static constexpr int QK = 256, BYTES = 110;
  __device__ static float at(const unsigned char* b, int j) {
    const unsigned char* sc = b + 96;
    const int sb = j / 16;
    const int low = (sc[sb % 8] >> (4 * (sb / 8))) & 0xF;
    const int high = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
    const float dl = __fmul_rn(ld_f16(b + 108), (float)((low | (high << 4)) - 32));
    const int h = j / 128, s = (j % 128) / 32, l = j % 32;
    const int ql = (b[32 + h * 32 + l] >> (2 * s)) & 3;
    const int hb = (b[l] >> (j / 32)) & 1;
    return __fmul_rn(dl, (float)(ql - (hb ? 0 : 4)));
  }
};

// The 6-bit scale and min of sub-block i (of 8) of a Q4_K / Q5_K super-block.
__device__ __forceinline__ void k4_scale_min(const unsigned char* s, int i, int* sc, int* mn) {
  if (i < 4) {
    *sc = s[i] & 63;
    *mn = s[i + 4] & 63;
  } else {
    *sc = (s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4);
    *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
  }
}

struct Q4_K {  // d, dmin, scales[12], qs[128]
  static constexpr int QK = 256, BYTES = 144;
  __device__ static float at(const unsigned char* b, int j) {
    const int i = j / 32, l = j % 32;
    int sc, mn;
    k4_scale_min(b + 4, i, &sc, &mn);
    const int q = (b[16 + (i / 2) * 32 + l] >> (4 * (i % 2))) & 0xF;
    const float d = __fmul_rn(ld_f16(b), (float)sc);
    const float m = __fmul_rn(ld_f16(b + 2), (float)mn);
    return __fsub_rn(__fmul_rn(d, (float)q), m);
  }
};
struct Q5_K {  // d, dmin, scales[12], qh[32], qs[128]
  static constexpr int QK = 256, BYTES = 176;
  __device__ static float at(const unsigned char* b, int j) {
    const int i = j / 32, l = j % 32;
    int sc, mn;
    k4_scale_min(b + 4, i, &sc, &mn);
    const int q = ((b[48 + (i / 2) * 32 + l] >> (4 * (i % 2))) & 0xF) | (((b[16 + l] >> i) & 1) << 4);
    const float d = __fmul_rn(ld_f16(b), (float)sc);
    const float m = __fmul_rn(ld_f16(b + 2), (float)mn);
    return __fsub_rn(__fmul_rn(d, (float)q), m);
  }
};
struct Q6_K {  // ql[128], qh[64], scales: int8[16], d
  static constexpr int QK = 256, BYTES = 210;
  __device__ static float at(const unsigned char* b, int j) {
    const int h = j / 128, r = j % 128;
    const int ql = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
    const int qh = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
    const float d = __fmul_rn(ld_f16(b + 208), (float)(signed char)b[192 + j / 16]);
    return __fmul_rn(d, (float)((ql | (qh << 4)) - 32));
  }
};

// IQ types ("i-quants"): each group of 4 or 8 elements is one entry of a fixed grid (tables
// in iq_tables.cuh, generated from gguf-py), times a block scale, with its sign bits; IQ4
// is a 16-value non-linear codebook. Products are taken in gguf-py's order: the scale
// first, then times the grid value, then times the sign (+1 or -1, as numpy multiplies
// it, rather than a negation, which would differ from numpy on a NaN's sign bit).

__device__ __forceinline__ int grid_byte(unsigned long long entry, int k) {
  return (int)((entry >> (8 * k)) & 0xFF);
}
__device__ __forceinline__ float signed_by(float v, int negative) {
  return __fmul_rn(v, negative ? -1.0f : 1.0f);
}
// The 4-bit scale s of a 16-element sub-block (two per byte) as (0.5 + s) * d / 4: IQ2_XS, IQ2_S.
__device__ __forceinline__ float iq2_scale(const unsigned char* b, const unsigned char* scales,
                                           int j) {
  const int s = j / 16;
  const int sc = (scales[s / 2] >> (4 * (s % 2))) & 0xF;
  return __fmul_rn(__fmul_rn(ld_f16(b), __fadd_rn(0.5f, (float)sc)), 0.25f);
}

// d, then per 32 elements two u32: 4 grid indices (bytes), and 4 x 7-bit sign-pattern
// indices | 4-bit scale << 28.
struct IQ2_XXS {
  static constexpr int QK = 256, BYTES = 66;
  __device__ static float at(const unsigned char* b, int j) {
    const int l = (j % 32) / 8, k = j % 8;
    const unsigned char* q = b + 2 + 8 * (j / 32);
    const unsigned aux = ld_u32(q + 4);
    const float db = __fmul_rn(__fmul_rn(ld_f16(b), __fadd_rn(0.5f, (float)(aux >> 28))), 0.25f);
    const float v = __fmul_rn(db, (float)grid_byte(iq2xxs_grid[q[l]], k));
    return signed_by(v, (ksigns_iq2xs[(aux >> (7 * l)) & 127] >> k) & 1);
  }
};
// d, qs: u16[32] (9-bit grid index | 7-bit sign-pattern index << 9), scales[8].
struct IQ2_XS {
  static constexpr int QK = 256, BYTES = 74;
  __device__ static float at(const unsigned char* b, int j) {
    const int g = j / 8, k = j % 8;
    const unsigned q = b[2 + 2 * g] | (b[3 + 2 * g] << 8);
    const float v = __fmul_rn(iq2_scale(b, b + 66, j), (float)grid_byte(iq2xs_grid[q & 511], k));
    return signed_by(v, (ksigns_iq2xs[q >> 9] >> k) & 1);
  }
};
// d, qs[32] (grid index low bits), signs[32] (one bit per element), qh[8] (2 high bits of
// each grid index), scales[8].
struct IQ2_S {
  static constexpr int QK = 256, BYTES = 82;
  __device__ static float at(const unsigned char* b, int j) {
    const int g = j / 8, k = j % 8;
    const int index = b[2 + g] | (((b[66 + g / 4] >> (2 * (g % 4))) & 3) << 8);
    const float v = __fmul_rn(iq2_scale(b, b + 74, j), (float)grid_byte(iq2s_grid[index], k));
    return signed_by(v, (b[34 + g] >> k) & 1);
  }
};
// d, qs[64] (a grid index per 4 elements), then per 32 elements a u32: 4 x 7-bit
// sign-pattern indices | 4-bit scale << 28.
struct IQ3_XXS {
  static constexpr int QK = 256, BYTES = 98;
  __device__ static float at(const unsigned char* b, int j) {
    const int l = (j % 32) / 8;
    const unsigned aux = ld_u32(b + 66 + 4 * (j / 32));
    const float db = __fmul_rn(__fmul_rn(ld_f16(b), __fadd_rn(0.5f, (float)(aux >> 28))), 0.5f);
    const float v = __fmul_rn(db, (float)grid_byte(iq3xxs_grid[b[2 + j / 4]], j % 4));
    return signed_by(v, (ksigns_iq2xs[(aux >> (7 * l)) & 127] >> (j % 8)) & 1);
  }
};
// d, qs[64] (grid index low bits), qh[8] (the ninth bits), signs[32], scales[4] (4 bits
// per 32 elements, as 1 + 2 s).
struct IQ3_S {
  static constexpr int QK = 256, BYTES = 110;
  __device__ static float at(const unsigned char* b, int j) {
    const int i = j / 4, s = j / 32;
    const int index = b[2 + i] | (((b[66 + i / 8] >> (i % 8)) & 1) << 8);
    const int sc = (b[106 + s / 2] >> (4 * (s % 2))) & 0xF;
    const float db = __fmul_rn(ld_f16(b), (float)(1 + 2 * sc));
    const float v = __fmul_rn(db, (float)grid_byte(iq3s_grid[index], j % 4));
    return signed_by(v, (b[74 + j / 8] >> (j % 8)) & 1);
  }
};
// d, qs[32] (grid index low bits), qh: u16[8], per 32 elements: 4 x 3 high index bits,
// 3-bit scale << 12, delta sign << 15. Values are (grid + delta) * d * (2 s + 1).
struct IQ1_S {
  static constexpr int QK = 256, BYTES = 50;
  __device__ static float at(const unsigned char* b, int j) {
    const int g = j / 8, ib = j / 32;
    const int qh = b[34 + 2 * ib] | (b[35 + 2 * ib] << 8);
    const float dl = __fmul_rn(ld_f16(b), (float)(2 * ((qh >> 12) & 7) + 1));
    const float delta = (qh & 0x8000) ? -0.125f : 0.125f;
    const int index = b[2 + g] | (((qh >> (3 * (g % 4))) & 7) << 8);
    const int v = (signed char)grid_byte(iq1s_grid[index], j % 8);
    return __fmul_rn(dl, __fadd_rn((float)v, delta));
  }
};
// qs[32] (grid index low bits), qh[16] (per 8 elements a nibble: 3 high index bits, delta
// sign << 3), scales: u16[4]: 3-bit scales of 16 elements in bits 0-11, and the block's
// f16 scale d spread over the top nibbles (bits 0-3 of d in the first u16's, ...).
struct IQ1_M {
  static constexpr int QK = 256, BYTES = 56;
  __device__ static float at(const unsigned char* b, int j) {
    const unsigned char* sc = b + 48;
    const unsigned d_bits = (sc[1] >> 4) | (sc[3] & 0xF0) | ((sc[5] & 0xF0) << 4) |
                            ((sc[7] & 0xF0) << 8);
    const float d = __half2float(__ushort_as_half((unsigned short)d_bits));
    const int t = j / 16;
    const int s = ((sc[2 * (t / 4)] | (sc[2 * (t / 4) + 1] << 8)) >> (3 * (t % 4))) & 7;
    const float dl = __fmul_rn(d, (float)(2 * s + 1));
    const int g = j / 8;
    const int qh = (b[32 + g / 2] >> (4 * (g % 2))) & 0xF;
    const float delta = (qh & 8) ? -0.125f : 0.125f;
    const int v = (signed char)grid_byte(iq1s_grid[b[g] | ((qh & 7) << 8)], j % 8);
    return __fmul_rn(dl, __fadd_rn((float)v, delta));
  }
};
// d, qs[16]: 4-bit codebook indices, laid out as Q4_0's.
struct IQ4_NL {
  static constexpr int QK = 32, BYTES = 18;
  __device__ static float at(const unsigned char* b, int j) {
    return __fmul_rn(ld_f16(b), (float)kvalues_iq4nl[nibble32(b + 2, j)]);
  }
};
// d, scales_h: u16 (2 high bits per 32 elements), scales_l[4] (4 low bits per 32), qs[128]
// (per 32 elements 16 bytes laid out as Q4_0's); the 6-bit scales are offset by 32.
struct IQ4_XS {
  static constexpr int QK = 256, BYTES = 136;
  __device__ static float at(const unsigned char* b, int j) {
    const int ib = j / 32;
    const int low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    const int high = ((b[2] | (b[3] << 8)) >> (2 * ib)) & 3;
    const float dl = __fmul_rn(ld_f16(b), (float)((low | (high << 4)) - 32));
    return __fmul_rn(dl, (float)kvalues_iq4nl[nibble32(b + 8 + 16 * ib, j % 32)]);
  }
};
// MXFP4 (gpt-oss's experts): e (e8m0: 2^(e - 128) per doubled e2m1 step, gguf-py's
// e8m0_to_fp32_half), qs[16]: 4-bit e2m1 codes laid out as Q4_0's, the doubled values
// 0, 1, 2, 3, 4, 6, 8, 12 and their negatives.
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17;
  __device__ static float at(const unsigned char* b, int j) {
    const unsigned e = b[0];
    const float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    const int code = nibble32(b + 1, j);
    const int mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    return __fmul_rn(d, (float)(code < 8 ? mag[code] : -mag[code - 8]));
  }
};
