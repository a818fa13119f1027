// The GGUF weight types' decoders: one struct per type, which is all a type adds to the
// kernels of quant_matrix.cu (dequantization, the GEMVs, the embedding lookup), instantiated
// per type by name (kernels/cuda_weight_types.py).
//
// A block type (QK values in BYTES bytes, layouts as ggml-common.h lays them out and gguf-py's
// quants.py reads them) decodes one 32-value unit of a block at a time,
// `unit(block, s, IntUnit&)` for unit s < QK / 32, as integers:
//
//   w[j] = scale[j / 16] * (q[j] - offset) - min[j / 16],   q[j] a signed byte,
//
// which is both what the int8 GEMV multiplies with dp4a (llama.cpp mmvq's idea: integer dot
// products over the bytes, the scales applied once per 16 values) and, evaluated in float32
// in that order (`unit_value`), gguf-py's float32 value to the bit: every type's value is
// one product of a float32 scale by a small integer, then at most one subtraction (a
// minimum, or Q4_1's / Q5_1's added m as a subtracted -m), and x - (+0) is x. So one
// decoder per type serves every kernel. A float type (F32, F16, BF16: QK 1) gives
// `value(p)` (one element) and `floats(p, v)` (32 elements from a 16-byte aligned address).
//
// Bytes of a block are read as their alignment allows: blocks are 2-byte aligned at best
// (Q8_0 is 34 bytes) and MXFP4's 17 bytes not even that, so ld_i32 assembles a word from
// two 16-bit loads and ld_u32 from four bytes; the emulated GPU checks the alignment.
#pragma once

#include "common.cuh"
#include "iq_tables.cuh"

__device__ __forceinline__ unsigned ld_u16(const unsigned char* p) {
#ifdef EAGERLM_EMULATOR
  if (reinterpret_cast<uintptr_t>(p) & 1) emu::fail("misaligned 2-byte load in a block decoder");
#endif
  return *reinterpret_cast<const unsigned short*>(p);
}
__device__ __forceinline__ float ld_f16(const unsigned char* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}
// four bytes from any address
__device__ __forceinline__ unsigned ld_u32(const unsigned char* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned)p[3] << 24);
}
// four bytes from a 2-byte aligned address
__device__ __forceinline__ int ld_i32(const unsigned char* p) {
  return (int)(ld_u16(p) | (ld_u16(p + 2) << 16));
}

// 32 weights as integers: w[j] = scale[j / 16] * (q[j] - offset) - min[j / 16], q[j] byte
// j % 4 of word j / 4 as a signed 8-bit integer (as dp4a reads it).
struct IntUnit {
  int q[8];
  float scale[2];
  float min[2];
  int offset;
};

__device__ __forceinline__ void set_scales(IntUnit& w, float scale, float min, int offset) {
  w.scale[0] = w.scale[1] = scale;
  w.min[0] = w.min[1] = min;
  w.offset = offset;
}
// a scale per half, no minimum
__device__ __forceinline__ void set_half_scales(IntUnit& w, float s0, float s1, int offset) {
  w.scale[0] = s0;
  w.scale[1] = s1;
  w.min[0] = w.min[1] = 0.0f;
  w.offset = offset;
}

// Weight j of a unit as gguf-py computes it (product, then subtraction, each rounded).
__device__ __forceinline__ float unit_value(const IntUnit& w, int j) {
  const int q = (int)(signed char)(w.q[j >> 2] >> (8 * (j & 3)));
  return __fsub_rn(__fmul_rn(w.scale[j >> 4], (float)(q - w.offset)), w.min[j >> 4]);
}

__device__ __forceinline__ int lo4(int v) { return v & 0x0F0F0F0F; }
__device__ __forceinline__ int hi4(int v) { return (v >> 4) & 0x0F0F0F0F; }

// The four bytes of `table` (16 int8 in four words, iq_tables.cuh's codebooks) that the
// four indices in the bytes of `idx` (each < 16) select, by byte permutes.
__device__ __forceinline__ int lookup16(unsigned idx, unsigned t0, unsigned t1, unsigned t2,
                                        unsigned t3) {
  const unsigned v = idx | (idx >> 4);
  const unsigned sel = (v & 0xFFu) | ((v >> 8) & 0xFF00u);  // the indices as nibbles
  const unsigned lo = __byte_perm(t0, t1, sel & 0x7777u);
  const unsigned hi = __byte_perm(t2, t3, sel & 0x7777u);
  return (int)__byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));  // bit 3: the upper half
}

// The four grid values in the bytes of `g` (each 1..127: the IQ2 / IQ3 grids hold no zero),
// negated where bit k of `signs` is set (so no byte borrows from the next).
__device__ __forceinline__ int signed_bytes(unsigned g, unsigned signs) {
  const unsigned ones = (signs & 1u) | ((signs & 2u) << 7) | ((signs & 4u) << 14) |
                        ((signs & 8u) << 21);
  return (int)((g ^ (ones * 0xFFu)) + ones);
}
// group l (values 8 l .. 8 l + 7) of a unit: the 8 grid values in the bytes of g, with the
// 8 sign bits of `signs`
__device__ __forceinline__ void signed_group(IntUnit& w, int l, unsigned long long g,
                                             unsigned signs) {
  w.q[2 * l] = signed_bytes((unsigned)g, signs & 0xF);
  w.q[2 * l + 1] = signed_bytes((unsigned)(g >> 32), signs >> 4);
}

// -- float types -----------------------------------------------------------------------

struct F32 {
  static constexpr int QK = 1, BYTES = 4;
  __device__ static float value(const unsigned char* p) { return __uint_as_float(ld_u32(p)); }
  __device__ static void floats(const unsigned char* p, float* v) {
    const uint4* p4 = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 c = p4[k];
      v[4 * k] = __uint_as_float(c.x);
      v[4 * k + 1] = __uint_as_float(c.y);
      v[4 * k + 2] = __uint_as_float(c.z);
      v[4 * k + 3] = __uint_as_float(c.w);
    }
  }
};
// 32 16-bit values from a 16-byte aligned address, each to float by H::of_bits.
template <class H>
__device__ __forceinline__ void floats16(const unsigned char* p, float* v) {
  const uint4* p4 = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint4 c = p4[k];
    const unsigned w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[8 * k + 2 * i] = H::of_bits(w[i] & 0xFFFFu);
      v[8 * k + 2 * i + 1] = H::of_bits(w[i] >> 16);
    }
  }
}
struct F16 {
  static constexpr int QK = 1, BYTES = 2;
  __device__ static float of_bits(unsigned h) {
    return __half2float(__ushort_as_half((unsigned short)h));
  }
  __device__ static float value(const unsigned char* p) { return of_bits(p[0] | (p[1] << 8)); }
  __device__ static void floats(const unsigned char* p, float* v) { floats16<F16>(p, v); }
};
struct BF16 {
  static constexpr int QK = 1, BYTES = 2;
  __device__ static float of_bits(unsigned h) { return __uint_as_float(h << 16); }
  __device__ static float value(const unsigned char* p) { return of_bits(p[0] | (p[1] << 8)); }
  __device__ static void floats(const unsigned char* p, float* v) { floats16<BF16>(p, v); }
};

// -- 32-value blocks -------------------------------------------------------------------

// The 32 nibbles of qs[16] in Q4_0's layout (value j < 16 the low nibble of qs[j], j >= 16
// the high one of qs[j - 16]) as bytes, four at a time through `map` (a codebook lookup,
// or none); qs 2-byte aligned, or any with ALIGNED false.
struct AsIs {
  __device__ int operator()(int v) const { return v; }
};
struct IQ4Codebook {
  __device__ int operator()(int v) const { return lookup16(v, KVALUES_IQ4NL); }
};
struct FP4Codebook {  // MXFP4's and NVFP4's E2M1 values, doubled
  __device__ int operator()(int v) const { return lookup16(v, KVALUES_MXFP4); }
};
template <class Map, bool ALIGNED = true>
__device__ __forceinline__ void q4_nibbles(const unsigned char* qs, IntUnit& w) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int v = ALIGNED ? ld_i32(qs + 4 * k) : (int)ld_u32(qs + 4 * k);
    w.q[k] = Map()(lo4(v));
    w.q[k + 4] = Map()(hi4(v));
  }
}

// d, qs[16]: d * (q - 8)
struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
    q4_nibbles<AsIs>(b + 2, w);
    set_scales(w, ld_f16(b), 0.0f, 8);
  }
};
// d, m, qs[16]: d * q + m
struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
    q4_nibbles<AsIs>(b + 4, w);
    set_scales(w, ld_f16(b), -ld_f16(b + 2), 0);
  }
};
// bits 0..3 of t to bit 4 of bytes 0..3
__device__ __forceinline__ int spread4(unsigned t) {
  return (int)(((t & 1u) << 4) | ((t & 2u) << 11) | ((t & 4u) << 18) | ((t & 8u) << 25));
}
// the nibbles of qs[16] at `qs` with the fifth bits of qh (bit j: value j)
__device__ __forceinline__ void five_bits(const unsigned char* qs, unsigned qh, IntUnit& w) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int v = ld_i32(qs + 4 * k);
    w.q[k] = lo4(v) | spread4(qh >> (4 * k));
    w.q[k + 4] = hi4(v) | spread4(qh >> (16 + 4 * k));
  }
}
// d, qh (u32), qs[16]: d * (q - 16)
struct Q5_0 {
  static constexpr int QK = 32, BYTES = 22;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
    five_bits(b + 6, (unsigned)ld_i32(b + 2), w);
    set_scales(w, ld_f16(b), 0.0f, 16);
  }
};
// d, m, qh, qs[16]: d * q + m
struct Q5_1 {
  static constexpr int QK = 32, BYTES = 24;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
    five_bits(b + 8, (unsigned)ld_i32(b + 4), w);
    set_scales(w, ld_f16(b), -ld_f16(b + 2), 0);
  }
};
// d, qs: int8[32]: d * q
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = ld_i32(b + 2 + 4 * k);
    set_scales(w, ld_f16(b), 0.0f, 0);
  }
};
// d, qs[16]: d * the IQ4 codebook's value of the nibble (Q4_0's layout)
struct IQ4_NL {
  static constexpr int QK = 32, BYTES = 18;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
    q4_nibbles<IQ4Codebook>(b + 2, w);
    set_scales(w, ld_f16(b), 0.0f, 0);
  }
};
// e (E8M0), qs[16]: e's power of two / 2 * the E2M1 value doubled (Q4_0's layout, unaligned)
__device__ __forceinline__ float e8m0_half(unsigned e) {
  return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17;
  __device__ static void unit(const unsigned char* b, int, IntUnit& w) {
    q4_nibbles<FP4Codebook, false>(b + 1, w);
    set_scales(w, e8m0_half(b[0]), 0.0f, 0);
  }
};

// -- 64-value blocks -------------------------------------------------------------------

// NVFP4's scale (unsigned E4M3) halved, as gguf-py decodes it (0 and 0x7F are zero).
__device__ __forceinline__ float ue4m3_half(unsigned x) {
  if (x == 0 || x == 0x7F) return 0.0f;
  const unsigned e = (x >> 3) & 0xF, m = x & 7;
  return e == 0 ? __fmul_rn((float)m, 0.0009765625f) : __uint_as_float(((e + 119) << 23) | (m << 20));
}
// d[4] (UE4M3, one per 16 values), qs[32]: 8 bytes per 16 values, values 0..7 in their low
// nibbles, 8..15 in the high ones; values as MXFP4's
struct NVFP4 {
  static constexpr int QK = 64, BYTES = 36;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * s + h;
      const int v0 = ld_i32(b + 4 + 8 * t), v1 = ld_i32(b + 8 + 8 * t);
      w.q[4 * h] = FP4Codebook()(lo4(v0));
      w.q[4 * h + 1] = FP4Codebook()(lo4(v1));
      w.q[4 * h + 2] = FP4Codebook()(hi4(v0));
      w.q[4 * h + 3] = FP4Codebook()(hi4(v1));
      w.scale[h] = ue4m3_half(b[t]);
      w.min[h] = 0.0f;
    }
    w.offset = 0;
  }
};

// -- 128-value blocks ------------------------------------------------------------------

// Q1_0: d, qs[16]: value j is +d where bit j % 8 of qs[j / 8] is set, else -d: d * (q - 1),
// q = 2 * bit (spread4's bit 4 shifted down to bit 1).
struct Q1_0 {
  static constexpr int QK = 128, BYTES = 18;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned bits = (unsigned)ld_i32(b + 2 + 4 * s);
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = spread4(bits >> (4 * k)) >> 3;
    set_scales(w, ld_f16(b), 0.0f, 1);
  }
};

// -- K-quants: super-blocks of 256 values ------------------------------------------------

// scales[16] (4-bit scale | 4-bit min per 16 values), qs[64], d, dmin:
// d * sc * q - dmin * m, q two bits of qs[32 (j / 128) + j % 32] at 2 ((j % 128) / 32)
struct Q2_K {
  static constexpr int QK = 256, BYTES = 84;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned char* qs = b + 16 + 32 * (s / 4);
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = (ld_i32(qs + 4 * k) >> (2 * (s % 4))) & 0x03030303;
    const float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sc = b[2 * s + h];
      w.scale[h] = __fmul_rn(d, (float)(sc & 0xF));
      w.min[h] = __fmul_rn(dmin, (float)(sc >> 4));
    }
    w.offset = 0;
  }
};
// hmask[32], qs[64], scales[12] (16 x 6 bits, offset 32), d:
// d * sc * (q - 4 * !hbit), q as Q2_K's, hbit bit j / 32 of hmask[j % 32]
struct Q3_K {
  static constexpr int QK = 256, BYTES = 110;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned char* qs = b + 32 + 32 * (s / 4);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w.q[k] = ((ld_i32(qs + 4 * k) >> (2 * (s % 4))) & 0x03030303) |
               (((ld_i32(b + 4 * k) >> s) & 0x01010101) << 2);
    }
    const unsigned char* sc = b + 96;
    const float d = ld_f16(b + 108);
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sb = 2 * s + h;
      const int low = (sc[sb % 8] >> (4 * (sb / 8))) & 0xF;
      const int high = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
      scale[h] = __fmul_rn(d, (float)((low | (high << 4)) - 32));
    }
    set_half_scales(w, scale[0], scale[1], 4);
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
__device__ __forceinline__ void k4_scales(const unsigned char* b, int s, IntUnit& w) {
  int sc, mn;
  k4_scale_min(b + 4, s, &sc, &mn);
  set_scales(w, __fmul_rn(ld_f16(b), (float)sc), __fmul_rn(ld_f16(b + 2), (float)mn), 0);
}
// d, dmin, scales[12], qs[128]: d * sc * q - dmin * m, q nibble (s % 2) of qs[32 (s / 2) + l]
struct Q4_K {
  static constexpr int QK = 256, BYTES = 144;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned char* qs = b + 16 + 32 * (s / 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = (ld_i32(qs + 4 * k) >> (4 * (s % 2))) & 0x0F0F0F0F;
    k4_scales(b, s, w);
  }
};
// d, dmin, scales[12], qh[32], qs[128]: as Q4_K, bit s of qh[l] the fifth bit
struct Q5_K {
  static constexpr int QK = 256, BYTES = 176;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned char* qs = b + 48 + 32 * (s / 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w.q[k] = ((ld_i32(qs + 4 * k) >> (4 * (s % 2))) & 0x0F0F0F0F) |
               (((ld_i32(b + 16 + 4 * k) >> s) & 0x01010101) << 4);
    }
    k4_scales(b, s, w);
  }
};
// ql[128], qh[64], scales: int8[16], d: d * sc * (q - 32)
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const int h = s / 4, t = s % 4;
    const unsigned char* ql = b + 64 * h + 32 * (t % 2);
    const unsigned char* qh = b + 128 + 32 * h;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w.q[k] = ((ld_i32(ql + 4 * k) >> (4 * (t / 2))) & 0x0F0F0F0F) |
               (((ld_i32(qh + 4 * k) >> (2 * t)) & 0x03030303) << 4);
    }
    const float d = ld_f16(b + 208);
    set_half_scales(w, __fmul_rn(d, (float)(signed char)b[192 + 2 * s]),
                    __fmul_rn(d, (float)(signed char)b[193 + 2 * s]), 32);
  }
};
// IQ4_XS: d, scales_h: u16 (2 high bits per 32 values), scales_l[4] (4 low bits
// per 32), qs[128] (16 bytes per 32 values, Q4_0's layout): d * (sc - 32) * codebook value
struct IQ4_XS {
  static constexpr int QK = 256, BYTES = 136;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    q4_nibbles<IQ4Codebook>(b + 8 + 16 * s, w);
    const int low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
    const int high = (ld_u16(b + 2) >> (2 * s)) & 3;
    set_scales(w, __fmul_rn(ld_f16(b), (float)((low | (high << 4)) - 32)), 0.0f, 0);
  }
};

// -- IQ2 / IQ3: groups of 8 (4) values are a grid entry (iq_tables.cuh) with sign bits, times
// a block scale, computed in gguf-py's order (d, then the sub-scale, then the 1/4 or 1/2).

// (0.5 + s) * d / 4 for a 4-bit sub-scale s
__device__ __forceinline__ float iq2_scale(float d, int s) {
  return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)s)), 0.25f);
}
// d, then per 32 values two u32: 4 grid indices (bytes), and 4 x 7-bit sign-pattern
// indices | 4-bit scale << 28
struct IQ2_XXS {
  static constexpr int QK = 256, BYTES = 66;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned char* p = b + 2 + 8 * s;
    const unsigned aux = (unsigned)ld_i32(p + 4);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      signed_group(w, l, iq2xxs_grid[p[l]], ksigns_iq2xs[(aux >> (7 * l)) & 127]);
    }
    set_scales(w, iq2_scale(ld_f16(b), aux >> 28), 0.0f, 0);
  }
};
// d, qs: u16[32] (9-bit grid index | 7-bit sign-pattern index << 9), scales[8] (4 bits per
// 16 values)
struct IQ2_XS {
  static constexpr int QK = 256, BYTES = 74;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const unsigned q = ld_u16(b + 2 + 2 * (4 * s + l));
      signed_group(w, l, iq2xs_grid[q & 511], ksigns_iq2xs[q >> 9]);
    }
    const float d = ld_f16(b);
    set_half_scales(w, iq2_scale(d, b[66 + s] & 0xF), iq2_scale(d, b[66 + s] >> 4), 0);
  }
};
// d, qs[32] (grid index low bits), signs[32] (a byte per 8 values), qh[8] (2 high index
// bits per 8 values), scales[8]
struct IQ2_S {
  static constexpr int QK = 256, BYTES = 82;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int g8 = 4 * s + l;
      const int index = b[2 + g8] | (((b[66 + s] >> (2 * l)) & 3) << 8);
      signed_group(w, l, iq2s_grid[index], b[34 + g8]);
    }
    const float d = ld_f16(b);
    set_half_scales(w, iq2_scale(d, b[74 + s] & 0xF), iq2_scale(d, b[74 + s] >> 4), 0);
  }
};
// d, qs[64] (a grid index per 4 values), then per 32 values a u32: 4 x 7-bit sign-pattern
// indices | 4-bit scale << 28; (0.5 + s) * d / 2
struct IQ3_XXS {
  static constexpr int QK = 256, BYTES = 98;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned aux = (unsigned)ld_i32(b + 66 + 4 * s);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const unsigned sg = ksigns_iq2xs[(aux >> (7 * (k / 2))) & 127];
      w.q[k] = signed_bytes(iq3xxs_grid[b[2 + 8 * s + k]], (sg >> (4 * (k % 2))) & 0xF);
    }
    const float d = ld_f16(b);
    set_scales(w, __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)(aux >> 28))), 0.5f), 0.0f, 0);
  }
};
// d, qs[64] (grid index low bits), qh[8] (the ninth bits), signs[32], scales[4] (4 bits
// per 32 values): d * (1 + 2 s)
struct IQ3_S {
  static constexpr int QK = 256, BYTES = 110;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int index = b[2 + 8 * s + k] | (((b[66 + s] >> k) & 1) << 8);
      const unsigned sg = (b[74 + 4 * s + k / 2] >> (4 * (k % 2))) & 0xF;
      w.q[k] = signed_bytes(iq3s_grid[index], sg);
    }
    const int sc = (b[106 + s / 2] >> (4 * (s % 2))) & 0xF;
    set_scales(w, __fmul_rn(ld_f16(b), (float)(1 + 2 * sc)), 0.0f, 0);
  }
};

// -- IQ1: values (v + delta) * dl, v in {-1, 0, 1} from the grid, delta +-1/8 per 8 values.
// As integers: 8 v + 8 delta = q - 9 with q = 8 (v + 1) + (delta > 0 ? 2 : 0), times dl / 8
// (exact: dl is an f16 times an odd number, far from float32's underflow), so that the
// product is gguf-py's dl * (v + delta) to the bit.

// grid bytes v (int8 -1, 0, 1) of `g` to q as above
__device__ __forceinline__ int iq1_bytes(unsigned g, bool plus) {
  const unsigned t = ((g & 0x7F7F7F7Fu) + 0x01010101u) ^ (g & 0x80808080u);  // v + 1, bytewise
  return (int)((t << 3) + (plus ? 0x02020202u : 0u));
}
// group l of a unit: the 8 grid values of iq1s_grid[index], delta +1/8 if `plus`
__device__ __forceinline__ void iq1_group(IntUnit& w, int l, int index, bool plus) {
  const unsigned long long g = iq1s_grid[index];
  w.q[2 * l] = iq1_bytes((unsigned)g, plus);
  w.q[2 * l + 1] = iq1_bytes((unsigned)(g >> 32), plus);
}
// d, qs[32] (grid index low bits), qh: u16[8] per 32 values: 4 x 3 high index bits, 3-bit
// scale << 12, delta sign << 15; dl = d (2 s + 1)
struct IQ1_S {
  static constexpr int QK = 256, BYTES = 50;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
    const unsigned qh = ld_u16(b + 34 + 2 * s);
    const bool plus = !(qh & 0x8000);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      iq1_group(w, l, b[2 + 4 * s + l] | (((qh >> (3 * l)) & 7) << 8), plus);
    }
    const float dl = __fmul_rn(ld_f16(b), (float)(2 * ((qh >> 12) & 7) + 1));
    set_scales(w, __fmul_rn(dl, 0.125f), 0.0f, 9);
  }
};
// qs[32] (grid index low bits), qh[16] (per 8 values a nibble: 3 high index bits, delta
// sign << 3), scales: u16[4]: 3-bit scales of 16 values in bits 0-11, and the block's f16
// scale d spread over the top nibbles (bits 0-3 of d in the first u16's, ...)
struct IQ1_M {
  static constexpr int QK = 256, BYTES = 56;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int g8 = 4 * s + l;
      const int qh = (b[32 + g8 / 2] >> (4 * (g8 % 2))) & 0xF;
      iq1_group(w, l, b[g8] | ((qh & 7) << 8), !(qh & 8));
    }
    const unsigned char* sc = b + 48;
    const unsigned d_bits = (sc[1] >> 4) | (sc[3] & 0xF0) | ((sc[5] & 0xF0) << 4) |
                            ((sc[7] & 0xF0) << 8);
    const float d = F16::of_bits(d_bits);
    const unsigned word = ld_u16(sc + 2 * (s / 2));  // the 3-bit scales of sub-blocks 2s, 2s+1
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * s + h;
      scale[h] = __fmul_rn(__fmul_rn(d, (float)(2 * ((word >> (3 * (t % 4))) & 7) + 1)), 0.125f);
    }
    set_half_scales(w, scale[0], scale[1], 9);
  }
};

// -- ternary types: values d * (t - 1), t in {0, 1, 2} ----------------------------------

// TQ1_0: qs[48], qh[4], d. Five trits per byte of qs[0..31] (values 32 k + l: trit k of
// qs[l]), four per byte of qs[32..47] (160 + 16 k + l) and of qh (240 + 4 k + l); trit k of
// a byte b is ((b * 3^k mod 256) * 3) >> 8.
__device__ __forceinline__ int trit(unsigned b, int k) {
  const unsigned pow3 = k == 0 ? 1u : k == 1 ? 3u : k == 2 ? 9u : k == 3 ? 27u : 81u;
  return (int)((((b * pow3) & 0xFFu) * 3u) >> 8);
}
struct TQ1_0 {
  static constexpr int QK = 256, BYTES = 54;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      int t;
      if (s < 5) {
        t = trit(b[j], s);
      } else if (s < 7 || j < 16) {  // values 160..239: qs[32 + l], trit (value - 160) / 16
        t = trit(b[32 + j % 16], 2 * (s - 5) + j / 16);
      } else {  // values 240..255: qh[l], trit (value - 240) / 4
        t = trit(b[48 + j % 4], (j - 16) / 4);
      }
      w.q[j / 4] |= t << (8 * (j % 4));
    }
    set_scales(w, ld_f16(b + 52), 0.0f, 1);
  }
};
// TQ2_0: qs[64], d: value 128 c + 32 k + l is bits 2k..2k+1 of qs[32 c + l]
struct TQ2_0 {
  static constexpr int QK = 256, BYTES = 66;
  __device__ static void unit(const unsigned char* b, int s, IntUnit& w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w.q[k] = (ld_i32(b + 32 * (s / 4) + 4 * k) >> (2 * (s % 4))) & 0x03030303;
    }
    set_scales(w, ld_f16(b + 64), 0.0f, 1);
  }
};

// -- what the kernels use ---------------------------------------------------------------

// The first byte of unit u (32 values) of a row of type Q.
template <class Q>
__device__ __forceinline__ const unsigned char* unit_bytes(const unsigned char* row, i64 u) {
  if constexpr (Q::QK == 1) {
    return row + u * 32 * Q::BYTES;
  } else {
    return row + u / (Q::QK / 32) * Q::BYTES;
  }
}

// Values 32 u .. 32 u + 31 of a row, each gguf-py's float32 value.
template <class Q>
__device__ __forceinline__ void unit_values(const unsigned char* row, i64 u, float* v) {
  if constexpr (Q::QK == 1) {
    Q::floats(unit_bytes<Q>(row, u), v);
  } else {
    IntUnit w;
    Q::unit(unit_bytes<Q>(row, u), (int)(u % (Q::QK / 32)), w);
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = unit_value(w, j);
  }
}
