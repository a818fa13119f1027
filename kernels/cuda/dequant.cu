// GGUF tensor data, as stored in the file, to bf16 (matrices) or float32 (vectors).
//
// The raw blocks are uploaded unchanged and expanded here, one thread per output element
// (the loader is bound by the host link, not by this). Block layouts follow ggml
// (ggml-common.h) as gguf-py's quants.py reads them; each decoder gives element j of one
// block. Products are rounded as the numpy reference rounds them (__fmul_rn keeps the
// compiler from fusing a multiply-add), so the float32 value equals gguf.quants.dequantize
// and the bf16 output is that value rounded to nearest even.
//
// Bytes are assembled one at a time: blocks are 2-byte aligned at best (Q8_0 is 34 bytes).
#include "common.cuh"

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

template <class Q, typename OUT>
__device__ __forceinline__ void dequant(OUT* __restrict__ out, const unsigned char* __restrict__ in,
                                        i64 n) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 blk = i / Q::QK;
    out[i] = from_f32<OUT>(Q::at(in + blk * Q::BYTES, (int)(i - blk * Q::QK)));
  }
}

#define DEQUANT_KERNELS(NAME, Q)                                                        \
  extern "C" __global__ void dequant_##NAME##_bf16(bf16* __restrict__ out,              \
                                                   const unsigned char* __restrict__ in, \
                                                   i64 n) {                             \
    dequant<Q, bf16>(out, in, n);                                                       \
  }                                                                                     \
  extern "C" __global__ void dequant_##NAME##_f32(float* __restrict__ out,              \
                                                  const unsigned char* __restrict__ in,  \
                                                  i64 n) {                              \
    dequant<Q, float>(out, in, n);                                                      \
  }

DEQUANT_KERNELS(f32, F32)
DEQUANT_KERNELS(f16, F16)
DEQUANT_KERNELS(bf16, BF16)
DEQUANT_KERNELS(q4_0, Q4_0)
DEQUANT_KERNELS(q4_1, Q4_1)
DEQUANT_KERNELS(q5_0, Q5_0)
DEQUANT_KERNELS(q5_1, Q5_1)
DEQUANT_KERNELS(q8_0, Q8_0)
DEQUANT_KERNELS(q2_k, Q2_K)
DEQUANT_KERNELS(q3_k, Q3_K)
DEQUANT_KERNELS(q4_k, Q4_K)
DEQUANT_KERNELS(q5_k, Q5_K)
DEQUANT_KERNELS(q6_k, Q6_K)
