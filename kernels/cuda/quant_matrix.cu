// Every kernel over a weight of one GGUF type, written once over the type's decoder
// (quant_blocks.cuh) and compiled once per type: kernels/cuda_weight_types.py builds module
// `quant_matrix_<name>` of this file with -DWEIGHT_TYPE=<decoder> -DWEIGHT_NAME=<name>
// (and -DWEIGHT_INTEGER=1 for the block types, which get the int8 GEMV), so a model
// compiles the kernels of the types it holds and no others. Without WEIGHT_TYPE the file is
// module `quant_matrix`: quantize_q8, which serves every type.
//
// A matrix kept on the device as its GGUF blocks (kernels/cuda_quantized.py) is the file's
// bytes, `[out, row bytes]`, a row `n_in / QK` blocks, so it takes what the file takes.
//
// dequant_<name>_{bf16,f32}: a tensor's (or a tile's) values, gguf-py's float32 to the bit
// (bf16: that value rounded to nearest even); one thread per 32-value unit of a block type,
// one per value of a float type (whose vectors may have any length). The loader expands
// what it does not keep as blocks with them; the tile path expands rows of a matrix.
//
// gemv_<name>: y[r, o] = sum_i x[r, i] * W[o, i] (+ bias[o]) for up to GEMV_MAX_ROWS rows of
// x (decode and small batches). A block of GEMV_WARPS warps serves GEMV_WARPS /
// warps_per_row output rows; the warps of row o take its 32-value units in turn, lane l
// of the row's warp p the units 32 p + l, 32 (p + warps_per_row) + l, ... (so the lanes of
// a warp read adjacent bytes), decodes the unit's 32 weights into registers once, and
// multiplies them into every row of x. The host gives long rows more warps
// (kernels/cuda_quantized.py), so a narrow matrix still puts enough loads in flight. Each
// row's sum is a warp reduction, then the sum of its warps' in shared memory, then bias,
// then bf16 (or float32 for the lm head's logits). The weights are read once per launch,
// which is what bounds decode: a Q4_K matrix is 0.5625 bytes a value against bf16's 2.
// Activations are bf16 and the weights gguf-py's float32 values (F16 ones exact, not
// rounded to bf16); the dot products are float32.
//
// gemv8_<name> (block types): the same product in llama.cpp's mmvq style: x first quantized
// to int8 per 32 values (quantize_q8), each unit's weights as the decoder's integers, the
// products by dp4a, scales and minimums applied once per 16 values: far fewer
// instructions per weight (the float GEMV may be bound by them rather than by memory), at
// the cost of int8 activations' rounding. Which of the two the engine uses
// (kernels/cuda_quantized.py's `gemv_int8`, off by default) waits for
// benchmarks/bench_gemm.py --quantized on a GPU.
//
// A row of x's units is read with 16-byte loads: x must be 16-byte aligned (the host
// checks it) and n_in a multiple of 32 (every block type's rows are; the host sends a
// float matrix whose rows are not to the tile path).
//
// embed_<name>: the embedding lookup of embed.cu over a table of this type: each row's
// values as the cpu backend's lookup dequantizes them, times the scale.
//
// moe_gemv_<name>: the float GEMV over a mixture of experts' 3-D expert tensor (kept as
// blocks, `expert_bytes` per expert), one launch for a round's whole grouping
// (kernels/cuda_moe.py): blockIdx.y is a chunk of up to GEMV_MAX_ROWS consecutive rows of
// x, all routed to one expert (moe.cu's moe_sort wrote (expert, first row, rows) per
// chunk and how many chunks there are), multiplied by that expert's slice with the expert's
// bias; blocks past the chunk count return at once. So an expert's weights are read once
// per chunk of the rows that chose it.
#include "quant_blocks.cuh"

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 4  // warps per block (of 128 threads)

// -- dequantization ----------------------------------------------------------------------

// 32 values to out[0..31] (16-byte aligned) in 16-byte stores
__device__ __forceinline__ void store32(bf16* out, const float* v) {
  uint4* o = reinterpret_cast<uint4*>(out);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[8 * k + 2 * i]));
      const unsigned hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[8 * k + 2 * i + 1]));
      w[i] = lo | (hi << 16);
    }
    o[k] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
__device__ __forceinline__ void store32(float* out, const float* v) {
  float4* o = reinterpret_cast<float4*>(out);
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

template <class Q, typename OUT>
__device__ __forceinline__ void dequant(OUT* __restrict__ out, const unsigned char* __restrict__ in,
                                        i64 n) {
  const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x, step = (i64)gridDim.x * blockDim.x;
  if constexpr (Q::QK == 1) {
    for (i64 i = first; i < n; i += step) out[i] = from_f32<OUT>(Q::value(in + i * Q::BYTES));
  } else {  // n is whole blocks
    for (i64 u = first; u < n / 32; u += step) {
      float v[32];
      unit_values<Q>(in, u, v);
      store32(out + u * 32, v);
    }
  }
}

// -- the GEMVs ---------------------------------------------------------------------------

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
template <class Q>
struct FloatDot {
  static constexpr int QK = Q::QK, BYTES = Q::BYTES;
  struct X {
    const bf16* x;
  };
  struct Unit {
    float v[32];
  };
  __device__ static void load(const unsigned char* row, int u, Unit& w) {
    unit_values<Q>(row, u, w.v);
  }
  __device__ static float dot(const Unit& w, const X& x, int r, int u, int n_in) {
    const uint4* xp = reinterpret_cast<const uint4*>(x.x + (i64)r * n_in + u * 32);
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) s += dot8(xp[q], w.v + 8 * q);
    return s;
  }
};

// The int8 GEMV's: x quantized by quantize_q8 to int8 per 32 values with one float scale
// dx, the unit as the decoder's integers, so that
//   sum_j w[j] x[j] = dx * sum_h (scale[h] (sum q x - offset sum x)_h - min[h] (sum x)_h)
// with integer sums over each half's quantized x.
template <class Q>
struct Int8Dot {
  static constexpr int QK = Q::QK, BYTES = Q::BYTES;
  struct X {
    const signed char* q;  // [rows, n_in]
    const float* d;        // [rows, n_in / 32]
  };
  typedef IntUnit Unit;
  __device__ static void load(const unsigned char* row, int u, Unit& w) {
    Q::unit(unit_bytes<Q>(row, u), u % (Q::QK / 32), w);
  }
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
    float part = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      part += w.scale[h] * (float)(dot_h[h] - w.offset * sum_h[h]) - w.min[h] * (float)sum_h[h];
    }
    return x.d[(i64)r * (n_in / 32) + u] * part;
  }
};

// The GEMV of both kinds (K: FloatDot<Q> or Int8Dot<Q>).
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
      K::load(row, u, unit);
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

// A chunk of rows of x against its expert (moe_gemv_<name>): the chunk table's row c,
// (expert, first row, rows), selects the slices of x, W, the bias and y.
template <class Q>
__device__ __forceinline__ void moe_gemv(bf16* __restrict__ y, const bf16* __restrict__ x,
                                         const unsigned char* __restrict__ w, i64 expert_bytes,
                                         const float* __restrict__ bias,
                                         const int* __restrict__ chunks,
                                         const int* __restrict__ n_chunks, int n_in, int n_out,
                                         int warps_per_row) {
  const int c = blockIdx.y;
  if (c >= n_chunks[0]) return;  // uniform over the block
  const int e = chunks[3 * c], start = chunks[3 * c + 1], n = chunks[3 * c + 2];
  gemv<FloatDot<Q>>(y + (i64)start * n_out, {x + (i64)start * n_in}, w + e * expert_bytes,
                    bias != nullptr ? bias + (i64)e * n_out : nullptr, n, n_in, n_out, 0,
                    warps_per_row);
}

// -- the embedding lookup ----------------------------------------------------------------

// The embedding of embed.cu (ids from the host or the round's device metadata; an id
// outside the vocabulary poisons its row with NaN) over a table of type Q.
template <class Q>
__device__ __forceinline__ void embed(float* __restrict__ out, const unsigned char* __restrict__ table,
                                      const int* __restrict__ ids, int id_stride,
                                      const int* __restrict__ token_buf, int n_rows, int d,
                                      int vocab, float scale) {
  const int row = blockIdx.x;
  if (row >= n_rows) return;
  float* o = out + (i64)row * d;
  const int id = embed_row_token(ids, id_stride, token_buf, row, o, d, vocab);
  if (id < 0) return;
  const unsigned char* t = table + (i64)id * (d / Q::QK) * Q::BYTES;
  if constexpr (Q::QK == 1) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = Q::value(t + j * Q::BYTES) * scale;
  } else {
    for (int u = threadIdx.x; u < d / 32; u += blockDim.x) {
      float v[32];
      unit_values<Q>(t, u, v);
#pragma unroll
      for (int j = 0; j < 32; ++j) v[j] *= scale;
      store32(o + u * 32, v);
    }
  }
}

// -- one type's kernels, by name ---------------------------------------------------------

#define WEIGHT_KERNELS_(NAME, Q)                                                            \
  extern "C" __global__ void dequant_##NAME##_bf16(bf16* __restrict__ out,                  \
                                                   const unsigned char* __restrict__ in,     \
                                                   i64 n) {                                 \
    dequant<Q, bf16>(out, in, n);                                                           \
  }                                                                                         \
  extern "C" __global__ void dequant_##NAME##_f32(float* __restrict__ out,                  \
                                                  const unsigned char* __restrict__ in,      \
                                                  i64 n) {                                  \
    dequant<Q, float>(out, in, n);                                                          \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                             \
      gemv_##NAME(void* __restrict__ y, const bf16* __restrict__ x,                         \
                  const unsigned char* __restrict__ w, const float* __restrict__ bias,       \
                  int n_rows, int n_in, int n_out, int out_f32, int warps_per_row) {        \
    gemv<FloatDot<Q>>(y, {x}, w, bias, n_rows, n_in, n_out, out_f32, warps_per_row);        \
  }                                                                                         \
  extern "C" __global__ void embed_##NAME(float* __restrict__ out,                          \
                                          const unsigned char* __restrict__ table,           \
                                          const int* __restrict__ ids, int id_stride,        \
                                          const int* __restrict__ token_buf, int n_rows,     \
                                          int d, int vocab, float scale) {                   \
    embed<Q>(out, table, ids, id_stride, token_buf, n_rows, d, vocab, scale);               \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                             \
      moe_gemv_##NAME(bf16* __restrict__ y, const bf16* __restrict__ x,                     \
                      const unsigned char* __restrict__ w, i64 expert_bytes,                 \
                      const float* __restrict__ bias, const int* __restrict__ chunks,        \
                      const int* __restrict__ n_chunks, int n_in, int n_out,                 \
                      int warps_per_row) {                                                  \
    moe_gemv<Q>(y, x, w, expert_bytes, bias, chunks, n_chunks, n_in, n_out, warps_per_row); \
  }
#define WEIGHT_KERNELS(NAME, Q) WEIGHT_KERNELS_(NAME, Q)

#define GEMV8_KERNEL_(NAME, Q)                                                              \
  extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                             \
      gemv8_##NAME(void* __restrict__ y, const signed char* __restrict__ qx,                \
                   const float* __restrict__ dx, const unsigned char* __restrict__ w,        \
                   const float* __restrict__ bias, int n_rows, int n_in, int n_out,          \
                   int out_f32, int warps_per_row) {                                        \
    gemv<Int8Dot<Q>>(y, {qx, dx}, w, bias, n_rows, n_in, n_out, out_f32, warps_per_row);    \
  }
#define GEMV8_KERNEL(NAME, Q) GEMV8_KERNEL_(NAME, Q)

#ifdef WEIGHT_TYPE
WEIGHT_KERNELS(WEIGHT_NAME, WEIGHT_TYPE)
#if WEIGHT_INTEGER
GEMV8_KERNEL(WEIGHT_NAME, WEIGHT_TYPE)
#endif
#else
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
#endif
