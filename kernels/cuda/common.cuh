// Shared helpers of the eagerlm kernels: bf16 conversion, warp and block reductions, and
// the per-session descriptor that kv_append and attention read.
//
// Activations are bf16 in memory and float32 in registers; every reduction accumulates in
// float32 (or wider). Kernels take plain pointers and sizes; Python (kernels/cuda_*.py)
// packs the arguments in the order declared here, and tests/test_kernel_build.py checks
// that order against the parameter table of each compiled cubin.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
typedef long long i64;

#define EAGERLM_INF __int_as_float(0x7f800000)
#define EAGERLM_NAN __int_as_float(0x7fc00000)
#define FULL_MASK 0xffffffffu
#define LOG2E 1.4426950408889634f  // log2(e): natural-log logits to the kernels' log2 domain

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// Warp-wide argmax: every lane ends with the largest value and, among equal values, the
// lowest id (the samplers' tie rule: kernels/sampling.py).
__device__ __forceinline__ void warp_argmax(float& best, int& best_id) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(FULL_MASK, best, o);
    const int oi = __shfl_xor_sync(FULL_MASK, best_id, o);
    if (ob > best || (ob == best && oi < best_id)) {
      best = ob;
      best_id = oi;
    }
  }
}

// Sum over the threads of one row of a block (blockDim.x threads, a multiple of 32, up to
// 1024); blockDim.y rows per block reduce independently. Every thread of the row gets the
// result. `scratch` holds 32 floats per row.
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* s = scratch + threadIdx.y * 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) s[warp] = v;
  __syncthreads();
  const int n_warps = blockDim.x >> 5;
  v = lane < n_warps ? s[lane] : 0.0f;
  return warp_sum(v);
}

// A session's part of a batch as the device sees it. Rows [start, start + n_new) of the
// flat batch are positions n_past .. n_past + n_new - 1 of the session; its KV cache is
// token-major at `kv_base` (see vmm/kv_layout.py): token p, layer l, K or V at
// kv_base + p * token_bytes + layer offset. Mirrors SEQ_DESC in kernels/cuda_attention.py.
struct SeqDesc {
  int start;
  int n_new;
  int n_past;
  int pad_;
  u64 kv_base;
};
static_assert(sizeof(SeqDesc) == 24, "SeqDesc must match SEQ_DESC in kernels/cuda_attention.py");

// The token of embedding row `row`: ids[row] from the host (id_stride 1), or from the
// round's device metadata (pairs [host id, slot], id_stride 2) the token the previous
// round's sampler wrote to token_buf[slot] where the slot is set (embed.cu says why). An id
// outside the vocabulary poisons the row's output `o` (d floats) with NaN and gives -1.
__device__ __forceinline__ int embed_row_token(const int* __restrict__ ids, int id_stride,
                                               const int* __restrict__ token_buf, int row,
                                               float* __restrict__ o, int d, int vocab) {
  int id = ids[(i64)row * id_stride];
  if (id_stride > 1 && token_buf != nullptr) {
    const int slot = ids[(i64)row * id_stride + 1];
    if (slot >= 0) id = token_buf[slot];
  }
  if (id < 0 || id >= vocab) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = EAGERLM_NAN;
    return -1;
  }
  return id;
}
