// Products and lookups over a weight matrix kept on the device as its GGUF blocks
// (kernels/cuda_quantized.py): each row of the matrix is the file's bytes for that row,
// `n_in / QK` blocks, so the matrix takes what the file takes.
//
// gemv_<type>: y[r, o] = sum_i x[r, i] * W[o, i] (+ bias[o]) for up to GEMV_MAX_ROWS rows of
// x (decode and small batches). A block of GEMV_WARPS warps serves GEMV_WARPS /
// warps_per_row output rows; the warps of row o take its 32-value units in turn, lane l
// of the row's warp p the units 32 p + l, 32 (p + warps_per_row) + l, ... (a unit is a
// Q4_0 / Q5_0 / Q8_0 block, or one of a K-quant super-block's eight sub-blocks, so the
// lanes of a warp read adjacent bytes), decodes the unit's 32 weights into registers
// once, and multiplies them into every row of x. The host gives long rows more warps
// (kernels/cuda_quantized.py), so a narrow matrix still puts enough loads in flight. Each
// row's sum is a warp reduction, then the sum of its warps' in shared memory, then bias,
// then bf16 (or float32 for the lm head's logits). The weights are read once per launch, which is what bounds decode: a Q4_K
// matrix is 0.5625 bytes a value against bf16's 2. Activations are bf16 and the dot
// products float32.
//
// gemv8_<type>: the same product in llama.cpp's mmvq style: x first quantized to int8 per
// 32 values (quantize_q8), each unit's weights kept as integers in four-byte words, the
// products by dp4a, scales applied once per half unit: far fewer instructions per weight
// (the float GEMV may be bound by them rather than by memory), at the cost of int8
// activations' rounding. Which of the two the engine uses (kernels/cuda_quantized.py's
// `gemv_int8`, off by default) waits for benchmarks/bench_gemm.py --quantized on a GPU.
//
// A row of x's units is read with 16-byte loads: x must be 16-byte aligned (the host
// checks it) and n_in a multiple of 32 (every block type's rows are).
//
// embed_<type>: the embedding lookup of embed.cu over a block table, every supported block
// type, by the generic decoders.
#include "quant_blocks.cuh"

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 4  // warps per block (of 128 threads)

// Per type: U::unit(block, s, v) writes the 32 values of unit s (of UNITS) of a block into
// v, as its decoder's `at` gives them (the same float32 products, hoisted per unit).
struct UQ4_0 {
  static constexpr int QK = 32, BYTES = 18, UNITS = 1;
  __device__ static void unit(const unsigned char* b, int, float* v) {
    const float d = ld_f16(b);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int c = b[2 + l];
      v[l] = __fmul_rn(d, (float)((c & 0xF) - 8));
      v[l + 16] = __fmul_rn(d, (float)((c >> 4) - 8));
    }
  }
};
struct UQ5_0 {
  static constexpr int QK = 32, BYTES = 22, UNITS = 1;
  __device__ static void unit(const unsigned char* b, int, float* v) {
    const float d = ld_f16(b);
    const unsigned qh = ld_u32(b + 2);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int c = b[6 + l];
      const int lo = (c & 0xF) | (int)(((qh >> l) & 1) << 4);  // int: q - 16 may be < 0
      const int hi = (c >> 4) | (int)(((qh >> (l + 16)) & 1) << 4);
      v[l] = __fmul_rn(d, (float)(lo - 16));
      v[l + 16] = __fmul_rn(d, (float)(hi - 16));
    }
  }
};
struct UQ8_0 {
  static constexpr int QK = 32, BYTES = 34, UNITS = 1;
  __device__ static void unit(const unsigned char* b, int, float* v) {
    const float d = ld_f16(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn((float)(signed char)b[2 + l], d);
  }
};
struct UQ4_K {
  static constexpr int QK = 256, BYTES = 144, UNITS = 8;
  __device__ static void unit(const unsigned char* b, int i, float* v) {
    int sc, mn;
    k4_scale_min(b + 4, i, &sc, &mn);
    const float d = __fmul_rn(ld_f16(b), (float)sc);
    const float m = __fmul_rn(ld_f16(b + 2), (float)mn);
    const unsigned char* qs = b + 16 + (i / 2) * 32;
    const int shift = 4 * (i % 2);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fsub_rn(__fmul_rn(d, (float)((qs[l] >> shift) & 0xF)), m);
  }
};
struct UQ5_K {
  static constexpr int QK = 256, BYTES = 176, UNITS = 8;
  __device__ static void unit(const unsigned char* b, int i, float* v) {
    int sc, mn;
    k4_scale_min(b + 4, i, &sc, &mn);
    const float d = __fmul_rn(ld_f16(b), (float)sc);
    const float m = __fmul_rn(ld_f16(b + 2), (float)mn);
    const unsigned char* qh = b + 16;
    const unsigned char* qs = b + 48 + (i / 2) * 32;
    const int shift = 4 * (i % 2);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const int q = ((qs[l] >> shift) & 0xF) | (((qh[l] >> i) & 1) << 4);
      v[l] = __fsub_rn(__fmul_rn(d, (float)q), m);
    }
  }
};
struct UQ6_K {
  static constexpr int QK = 256, BYTES = 210, UNITS = 8;
  __device__ static void unit(const unsigned char* b, int i, float* v) {
    const int h = i / 4, s = i % 4;
    const unsigned char* ql = b + h * 64 + (s % 2) * 32;
    const unsigned char* qh = b + 128 + h * 32;
    const float d = ld_f16(b + 208);
    const float d0 = __fmul_rn(d, (float)(signed char)b[192 + 2 * i]);
    const float d1 = __fmul_rn(d, (float)(signed char)b[193 + 2 * i]);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const int q = ((ql[l] >> (4 * (s / 2))) & 0xF) | (((qh[l] >> (2 * s)) & 3) << 4);
      v[l] = __fmul_rn(l < 16 ? d0 : d1, (float)(q - 32));
    }
  }
};

// 8 bf16 (one 16-byte load) times 8 floats
__device__ __forceinline__ float dot8(const uint4 p, const float* v) {
  const unsigned w[4] = {p.x, p.y, p.z, p.w};
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    s = fmaf(__uint_as_float(w[k] << 16), v[2 * k], s);
    s = fmaf(__uint_as_float(w[k] & 0xFFFF0000u), v[2 * k + 1], s);
  }
  return s;
}

// The float GEMV's view of a type: a unit is its 32 weights as float32; a row of x is bf16.
template <class U>
struct FloatDot {
  static constexpr int QK = U::QK, BYTES = U::BYTES, UNITS = U::UNITS;
  struct X {
    const bf16* x;
  };
  struct Unit {
    float v[32];
  };
  __device__ static void load(const unsigned char* b, int s, Unit& w) { U::unit(b, s, w.v); }
  __device__ static float dot(const Unit& w, const X& x, int r, int u, int n_in) {
    const uint4* xp = reinterpret_cast<const uint4*>(x.x + (i64)r * n_in + u * 32);
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) s += dot8(xp[q], w.v + 8 * q);
    return s;
  }
};

// The int8 GEMV's (llama.cpp's mmvq, in spirit): x quantized by quantize_q8 to int8 per
// 32 values with one float scale, each unit's weights as integers in four-byte words,
// products by dp4a. Per type, V::load writes the unit's weights as
//   w[j] = scale[j / 16] * (q[j] - offset) - min,
// q[j] a byte (0..63, or a signed Q8_0 value) of word j / 4, so that
//   sum_j w[j] x[j] = dx * (sum_h scale[h] (sum q x - offset sum x)_h - min sum x)
// with integer sums over the quantized x.
struct IntUnit {
  int q[8];
  float scale[2];
  float min;
  int offset;
};
// four bytes from a 2-byte aligned address
__device__ __forceinline__ int ld_i32(const unsigned char* p) {
  const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
  return (int)((unsigned)h[0] | ((unsigned)h[1] << 16));
}
// bits 0..3 of t to bit 4 of bytes 0..3
__device__ __forceinline__ int spread4(unsigned t) {
  return (int)(((t & 1u) << 4) | ((t & 2u) << 11) | ((t & 4u) << 18) | ((t & 8u) << 25));
}
struct VQ4_0 {
  static constexpr int QK = 32, BYTES = 18, UNITS = 1;
  __device__ static void load(const unsigned char* b, int, IntUnit& w) {
    const float d = ld_f16(b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int v = ld_i32(b + 2 + 4 * k);
      w.q[k] = v & 0x0F0F0F0F;
      w.q[k + 4] = (v >> 4) & 0x0F0F0F0F;
    }
    w.scale[0] = w.scale[1] = d;
    w.min = 0.0f;
    w.offset = 8;
  }
};
struct VQ5_0 {
  static constexpr int QK = 32, BYTES = 22, UNITS = 1;
  __device__ static void load(const unsigned char* b, int, IntUnit& w) {
    const float d = ld_f16(b);
    const unsigned qh = ld_u32(b + 2);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int v = ld_i32(b + 6 + 4 * k);
      w.q[k] = (v & 0x0F0F0F0F) | spread4(qh >> (4 * k));
      w.q[k + 4] = ((v >> 4) & 0x0F0F0F0F) | spread4(qh >> (16 + 4 * k));
    }
    w.scale[0] = w.scale[1] = d;
    w.min = 0.0f;
    w.offset = 16;
  }
};
struct VQ8_0 {
  static constexpr int QK = 32, BYTES = 34, UNITS = 1;
  __device__ static void load(const unsigned char* b, int, IntUnit& w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = ld_i32(b + 2 + 4 * k);
    w.scale[0] = w.scale[1] = ld_f16(b);
    w.min = 0.0f;
    w.offset = 0;
  }
};
struct VQ4_K {
  static constexpr int QK = 256, BYTES = 144, UNITS = 8;
  __device__ static void load(const unsigned char* b, int i, IntUnit& w) {
    int sc, mn;
    k4_scale_min(b + 4, i, &sc, &mn);
    const unsigned char* qs = b + 16 + (i / 2) * 32;
    const int shift = 4 * (i % 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = (ld_i32(qs + 4 * k) >> shift) & 0x0F0F0F0F;
    w.scale[0] = w.scale[1] = __fmul_rn(ld_f16(b), (float)sc);
    w.min = __fmul_rn(ld_f16(b + 2), (float)mn);
    w.offset = 0;
  }
};
struct VQ5_K {
  static constexpr int QK = 256, BYTES = 176, UNITS = 8;
  __device__ static void load(const unsigned char* b, int i, IntUnit& w) {
    int sc, mn;
    k4_scale_min(b + 4, i, &sc, &mn);
    const unsigned char* qh = b + 16;
    const unsigned char* qs = b + 48 + (i / 2) * 32;
    const int shift = 4 * (i % 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w.q[k] = ((ld_i32(qs + 4 * k) >> shift) & 0x0F0F0F0F) |
               (((ld_i32(qh + 4 * k) >> i) & 0x01010101) << 4);
    }
    w.scale[0] = w.scale[1] = __fmul_rn(ld_f16(b), (float)sc);
    w.min = __fmul_rn(ld_f16(b + 2), (float)mn);
    w.offset = 0;
  }
};
struct VQ6_K {
  static constexpr int QK = 256, BYTES = 210, UNITS = 8;
  __device__ static void load(const unsigned char* b, int i, IntUnit& w) {
    const int h = i / 4, s = i % 4;
    const unsigned char* ql = b + h * 64 + (s % 2) * 32;
    const unsigned char* qh = b + 128 + h * 32;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w.q[k] = ((ld_i32(ql + 4 * k) >> (4 * (s / 2))) & 0x0F0F0F0F) |
               (((ld_i32(qh + 4 * k) >> (2 * s)) & 0x03030303) << 4);
    }
    const float d = ld_f16(b + 208);
    w.scale[0] = __fmul_rn(d, (float)(signed char)b[192 + 2 * i]);
    w.scale[1] = __fmul_rn(d, (float)(signed char)b[193 + 2 * i]);
    w.min = 0.0f;
    w.offset = 32;
  }
};

template <class V>
struct Int8Dot {
  static constexpr int QK = V::QK, BYTES = V::BYTES, UNITS = V::UNITS;
  struct X {
    const signed char* q;  // [rows, n_in]
    const float* d;        // [rows, n_in / 32]
  };
  typedef IntUnit Unit;
  __device__ static void load(const unsigned char* b, int s, Unit& w) { V::load(b, s, w); }
  __device__ static float dot(const Unit& w, const X& x, int r, int u, int n_in) {
    const uint4* xp = reinterpret_cast<const uint4*>(x.q + (i64)r * n_in + u * 32);
    const uint4 a = xp[0], c = xp[1];
    const int xw[8] = {(int)a.x, (int)a.y, (int)a.z, (int)a.w,
                       (int)c.x, (int)c.y, (int)c.z, (int)c.w};
    int dot_h[2] = {0, 0}, sum_h[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      dot_h[k / 4] = __dp4a(w.q[k], xw[k], dot_h[k / 4]);
      sum_h[k / 4] = __dp4a(0x01010101, xw[k], sum_h[k / 4]);
    }
    const float part = w.scale[0] * (float)(dot_h[0] - w.offset * sum_h[0]) +
                       w.scale[1] * (float)(dot_h[1] - w.offset * sum_h[1]) -
                       w.min * (float)(sum_h[0] + sum_h[1]);
    return x.d[(i64)r * (n_in / 32) + u] * part;
  }
};

// The GEMV of both kinds (K: FloatDot<U> or Int8Dot<V>).
template <class K>
__device__ __forceinline__ void gemv(void* __restrict__ y, const typename K::X x,
                                     const unsigned char* __restrict__ w,
                                     const float* __restrict__ bias, int n_rows, int n_in,
                                     int n_out, int out_f32, int warps_per_row) {
  __shared__ float partial[GEMV_WARPS][GEMV_MAX_ROWS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int o = blockIdx.x * (GEMV_WARPS / warps_per_row) + warp / warps_per_row;
  const int part = warp % warps_per_row;  // which of the row's warps this is
  const bool valid = o < n_out;  // no early return: the block meets at a barrier below
  const int units = n_in / 32;
  float acc[GEMV_MAX_ROWS];
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.0f;
  if (valid) {
    const unsigned char* row = w + (i64)o * (n_in / K::QK) * K::BYTES;
    for (int u = part * 32 + lane; u < units; u += 32 * warps_per_row) {
      typename K::Unit unit;
      K::load(row + (i64)(u / K::UNITS) * K::BYTES, u % K::UNITS, unit);
#pragma unroll
      for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < n_rows) acc[r] += K::dot(unit, x, r, u, n_in);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
    if (r < n_rows) {  // the same for every lane: the reduction's lanes all arrive
      const float s = warp_sum(acc[r]);
      if (lane == 0) partial[warp][r] = s;
    }
  }
  if (warps_per_row > 1) __syncthreads();  // the same for the whole block
  if (!valid || part != 0 || lane != 0) return;
  const float b = bias != nullptr ? bias[o] : 0.0f;
  for (int r = 0; r < n_rows; ++r) {
    float sum = partial[warp][r];
    for (int k = 1; k < warps_per_row; ++k) sum += partial[warp + k][r];
    sum += b;
    if (out_f32) {
      static_cast<float*>(y)[(i64)r * n_out + o] = sum;
    } else {
      static_cast<bf16*>(y)[(i64)r * n_out + o] = __float2bfloat16_rn(sum);
    }
  }
}

#define GEMV_KERNEL(NAME, U)                                                              \
  extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                           \
      gemv_##NAME(void* __restrict__ y, const bf16* __restrict__ x,                       \
                  const unsigned char* __restrict__ w, const float* __restrict__ bias,     \
                  int n_rows, int n_in, int n_out, int out_f32, int warps_per_row) {      \
    gemv<FloatDot<U>>(y, {x}, w, bias, n_rows, n_in, n_out, out_f32, warps_per_row);      \
  }

#define GEMV8_KERNEL(NAME, V)                                                             \
  extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                           \
      gemv8_##NAME(void* __restrict__ y, const signed char* __restrict__ qx,              \
                   const float* __restrict__ dx, const unsigned char* __restrict__ w,      \
                   const float* __restrict__ bias, int n_rows, int n_in, int n_out,        \
                   int out_f32, int warps_per_row) {                                      \
    gemv<Int8Dot<V>>(y, {qx, dx}, w, bias, n_rows, n_in, n_out, out_f32, warps_per_row);  \
  }

// x (bf16, n_units runs of 32 values) to int8 and one float scale per run, as llama.cpp's
// q8_1 without the sum: d = max |x| / 127, q = x / d rounded to nearest even (0 where the
// run is all zeros). One warp per run.
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
    quantize_q8(signed char* __restrict__ q, float* __restrict__ d,
                const bf16* __restrict__ x, i64 n_units) {
  const int lane = threadIdx.x & 31;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  for (i64 u = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); u < n_units;
       u += warps) {  // the same for every lane of a warp
    const float v = __bfloat162float(x[u * 32 + lane]);
    const float amax = warp_max(fabsf(v));
    const float scale = amax / 127.0f;
    q[u * 32 + lane] = (signed char)(amax == 0.0f ? 0 : __float2int_rn(v / scale));
    if (lane == 0) d[u] = scale;
  }
}

GEMV_KERNEL(q4_0, UQ4_0)
GEMV_KERNEL(q5_0, UQ5_0)
GEMV_KERNEL(q8_0, UQ8_0)
GEMV_KERNEL(q4_k, UQ4_K)
GEMV_KERNEL(q5_k, UQ5_K)
GEMV_KERNEL(q6_k, UQ6_K)
GEMV8_KERNEL(q4_0, VQ4_0)
GEMV8_KERNEL(q5_0, VQ5_0)
GEMV8_KERNEL(q8_0, VQ8_0)
GEMV8_KERNEL(q4_k, VQ4_K)
GEMV8_KERNEL(q5_k, VQ5_K)
GEMV8_KERNEL(q6_k, VQ6_K)

// The embedding of embed.cu (ids from the host or the round's device metadata; an id
// outside the vocabulary poisons its row with NaN) over a table of blocks: the row's values
// decoded as the cpu backend's lookup dequantizes them, times the scale.
template <class Q>
__device__ __forceinline__ void embed_blocks(float* __restrict__ out,
                                             const unsigned char* __restrict__ table,
                                             const int* __restrict__ ids, int id_stride,
                                             const int* __restrict__ token_buf, int n_rows,
                                             int d, int vocab, float scale) {
  const int row = blockIdx.x;
  if (row >= n_rows) return;
  const int id = embed_row_id(ids, id_stride, token_buf, row);
  float* o = out + (i64)row * d;
  if (id < 0 || id >= vocab) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = EAGERLM_NAN;
    return;
  }
  const unsigned char* t = table + (i64)id * (d / Q::QK) * Q::BYTES;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    o[j] = Q::at(t + (j / Q::QK) * Q::BYTES, j % Q::QK) * scale;
  }
}

#define EMBED_KERNEL(NAME, Q)                                                             \
  extern "C" __global__ void embed_##NAME(float* __restrict__ out,                        \
                                          const unsigned char* __restrict__ table,         \
                                          const int* __restrict__ ids, int id_stride,      \
                                          const int* __restrict__ token_buf, int n_rows,   \
                                          int d, int vocab, float scale) {                 \
    embed_blocks<Q>(out, table, ids, id_stride, token_buf, n_rows, d, vocab, scale);      \
  }

EMBED_KERNEL(q4_0, Q4_0)
EMBED_KERNEL(q4_1, Q4_1)
EMBED_KERNEL(q5_0, Q5_0)
EMBED_KERNEL(q5_1, Q5_1)
EMBED_KERNEL(q8_0, Q8_0)
EMBED_KERNEL(q2_k, Q2_K)
EMBED_KERNEL(q3_k, Q3_K)
EMBED_KERNEL(q4_k, Q4_K)
EMBED_KERNEL(q5_k, Q5_K)
EMBED_KERNEL(q6_k, Q6_K)
EMBED_KERNEL(iq2_xxs, IQ2_XXS)
EMBED_KERNEL(iq2_xs, IQ2_XS)
EMBED_KERNEL(iq2_s, IQ2_S)
EMBED_KERNEL(iq3_xxs, IQ3_XXS)
EMBED_KERNEL(iq3_s, IQ3_S)
EMBED_KERNEL(iq1_s, IQ1_S)
EMBED_KERNEL(iq1_m, IQ1_M)
EMBED_KERNEL(iq4_nl, IQ4_NL)
EMBED_KERNEL(iq4_xs, IQ4_XS)
EMBED_KERNEL(mxfp4, MXFP4)
