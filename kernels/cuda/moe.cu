// The mixture-of-experts FFN on the device (kernels/cuda_moe.py), all of it decided on the
// device so a decode round's launches are fixed (CUDA graphs) and the host never waits:
//
// moe_route: per row, the router's logits (float32 weights, bf16 x, float32 sums), the
//   gating (softmax over all experts, sigmoid, or none for top-k-then-softmax), the top k
//   (ties to the lower index, as a stable sort), their weights as llama.cpp's
//   build_moe_ffn computes them (kernels/cpu_moe.py's `route` is the reference).
// moe_sort: the round's (row, slot) pairs grouped by expert, in pair order within an
//   expert (a counting sort on one thread: a round has a few thousand pairs at most), each
//   expert's pairs cut into chunks of up to MOE_CHUNK rows, and where each pair went.
// moe_gemv_<type>: y = x W_e^T (+ bias_e) for every chunk: the chunk's rows (token rows of
//   x through `x_rows`, or consecutive rows of the sorted activations) against its
//   expert's matrix, a slice of the 3-D expert tensor kept as the file's blocks; one warp
//   per output row, the row's values decoded by the type's `at` (quant_blocks.cuh), each
//   dotted with every row of the chunk. So an expert's weights are read once per chunk,
//   not once per row that chose it. Any block type, bf16 included.
// moe_combine: each row's k expert outputs weighted and summed in slot order, plus a
//   shared expert's output (times the sigmoid of its gate logit, when it has one).
#include "quant_blocks.cuh"

#define MOE_CHUNK 8      // rows per chunk of an expert's product
#define MOE_WARPS 4      // warps (output rows) per moe_gemv block
#define MOE_MAX_EXPERTS 512
#define MOE_MAX_USED 32

// gating: 0 softmax, 1 top-k of the logits then a softmax over them, 2 sigmoid
extern "C" __global__ void __launch_bounds__(128)
    moe_route(int* __restrict__ ids, float* __restrict__ weights, const bf16* __restrict__ x,
              const float* __restrict__ router, const float* __restrict__ router_bias,
              int n_rows, int d, int n_experts, int k, int gating, int normalize,
              float scale) {
  __shared__ float score[MOE_MAX_EXPERTS];
  __shared__ float logit[MOE_MAX_EXPERTS];
  const int r = blockIdx.x;
  if (r >= n_rows) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const bf16* xr = x + (i64)r * d;
  for (int e = warp; e < n_experts; e += n_warps) {
    const float* w = router + (i64)e * d;
    float s = 0.0f;
    for (int i = lane; i < d; i += 32) s = fmaf(__bfloat162float(xr[i]), w[i], s);
    s = warp_sum(s);
    if (lane == 0) logit[e] = s + (router_bias != nullptr ? router_bias[e] : 0.0f);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (gating == 0) {
    float mx = -EAGERLM_INF;
    for (int e = 0; e < n_experts; ++e) mx = fmaxf(mx, logit[e]);
    float sum = 0.0f;
    for (int e = 0; e < n_experts; ++e) sum += (score[e] = expf(logit[e] - mx));
    for (int e = 0; e < n_experts; ++e) score[e] /= sum;
  } else {
    for (int e = 0; e < n_experts; ++e)
      score[e] = gating == 2 ? 1.0f / (1.0f + expf(-logit[e])) : logit[e];
  }
  int chosen[MOE_MAX_USED];
  float w[MOE_MAX_USED];
  for (int s = 0; s < k; ++s) {  // the best left, the lower index on a tie
    int best = -1;
    for (int e = 0; e < n_experts; ++e) {
      bool taken = false;
      for (int t = 0; t < s; ++t) taken |= chosen[t] == e;
      if (!taken && (best < 0 || score[e] > score[best])) best = e;
    }
    chosen[s] = best;
    w[s] = score[best];
  }
  if (gating == 1) {
    const float mx = w[0];  // the largest: chosen in descending order
    float sum = 0.0f;
    for (int s = 0; s < k; ++s) sum += (w[s] = expf(w[s] - mx));
    for (int s = 0; s < k; ++s) w[s] /= sum;
  }
  if (normalize) {
    float sum = 0.0f;
    for (int s = 0; s < k; ++s) sum += w[s];
    sum = fmaxf(sum, 6.103515625e-5f);  // llama.cpp's clamp: the smallest float16 normal
    for (int s = 0; s < k; ++s) w[s] /= sum;
  }
  for (int s = 0; s < k; ++s) {
    ids[(i64)r * k + s] = chosen[s];
    weights[(i64)r * k + s] = w[s] * scale;
  }
}

// pos[p]: where pair p (row p / k, slot p % k) goes in expert order; rows[q]: the token row
// of sorted position q; chunks[c] = (expert, first sorted position, rows), `n_chunks[0]`
// of them (moe_gemv's blocks past it return at once).
extern "C" __global__ void moe_sort(int* __restrict__ pos, i64* __restrict__ rows,
                                    int* __restrict__ chunks, int* __restrict__ n_chunks,
                                    const int* __restrict__ ids, int n_pairs, int k,
                                    int n_experts) {
  __shared__ int count[MOE_MAX_EXPERTS];
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int p = 0; p < n_pairs; ++p) ++count[ids[p]];
  int at = 0, c = 0;
  for (int e = 0; e < n_experts; ++e) {
    const int n = count[e];
    for (int j = 0; j < n; j += MOE_CHUNK) {
      chunks[3 * c] = e;
      chunks[3 * c + 1] = at + j;
      chunks[3 * c + 2] = min(MOE_CHUNK, n - j);
      ++c;
    }
    count[e] = at;  // from here on: the next free position of expert e
    at += n;
  }
  n_chunks[0] = c;
  for (int p = 0; p < n_pairs; ++p) {
    const int q = count[ids[p]]++;
    pos[p] = q;
    rows[q] = p / k;
  }
}

template <class Q>
__device__ __forceinline__ void moe_gemv(bf16* __restrict__ y, const bf16* __restrict__ x,
                                         const i64* __restrict__ x_rows,
                                         const unsigned char* __restrict__ w, i64 expert_bytes,
                                         const float* __restrict__ bias,
                                         const int* __restrict__ chunks,
                                         const int* __restrict__ n_chunks, int n_in,
                                         int n_out) {
  const int c = blockIdx.y;
  if (c >= n_chunks[0]) return;  // uniform over the block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int o = blockIdx.x * MOE_WARPS + warp;
  if (o >= n_out) return;  // uniform over the warp; no block barrier follows
  const int e = chunks[3 * c], start = chunks[3 * c + 1], n = chunks[3 * c + 2];
  const unsigned char* row = w + e * expert_bytes + (i64)o * (n_in / Q::QK) * Q::BYTES;
  i64 xr[MOE_CHUNK];
#pragma unroll
  for (int j = 0; j < MOE_CHUNK; ++j) {
    const int q = start + min(j, n - 1);
    xr[j] = (x_rows != nullptr ? x_rows[q] : q) * n_in;
  }
  float acc[MOE_CHUNK];
#pragma unroll
  for (int j = 0; j < MOE_CHUNK; ++j) acc[j] = 0.0f;
  for (int i = lane; i < n_in; i += 32) {
    const float v = Q::at(row + (i / Q::QK) * Q::BYTES, i % Q::QK);
#pragma unroll
    for (int j = 0; j < MOE_CHUNK; ++j) {
      if (j < n) acc[j] = fmaf(v, __bfloat162float(x[xr[j] + i]), acc[j]);
    }
  }
  const float b = bias != nullptr ? bias[(i64)e * n_out + o] : 0.0f;
#pragma unroll
  for (int j = 0; j < MOE_CHUNK; ++j) {
    if (j < n) {  // the same for every lane: the reduction's lanes all arrive
      const float s = warp_sum(acc[j]);
      if (lane == 0) y[(i64)(start + j) * n_out + o] = from_f32<bf16>(s + b);
    }
  }
}

#define MOE_GEMV_KERNEL(NAME, Q)                                                          \
  extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS)                            \
      moe_gemv_##NAME(bf16* __restrict__ y, const bf16* __restrict__ x,                   \
                      const i64* __restrict__ x_rows, const unsigned char* __restrict__ w, \
                      i64 expert_bytes, const float* __restrict__ bias,                   \
                      const int* __restrict__ chunks, const int* __restrict__ n_chunks,    \
                      int n_in, int n_out) {                                              \
    moe_gemv<Q>(y, x, x_rows, w, expert_bytes, bias, chunks, n_chunks, n_in, n_out);      \
  }

MOE_GEMV_KERNEL(f32, F32)
MOE_GEMV_KERNEL(f16, F16)
MOE_GEMV_KERNEL(bf16, BF16)
MOE_GEMV_KERNEL(q4_0, Q4_0)
MOE_GEMV_KERNEL(q4_1, Q4_1)
MOE_GEMV_KERNEL(q5_0, Q5_0)
MOE_GEMV_KERNEL(q5_1, Q5_1)
MOE_GEMV_KERNEL(q8_0, Q8_0)
MOE_GEMV_KERNEL(q2_k, Q2_K)
MOE_GEMV_KERNEL(q3_k, Q3_K)
MOE_GEMV_KERNEL(q4_k, Q4_K)
MOE_GEMV_KERNEL(q5_k, Q5_K)
MOE_GEMV_KERNEL(q6_k, Q6_K)
MOE_GEMV_KERNEL(iq2_xxs, IQ2_XXS)
MOE_GEMV_KERNEL(iq2_xs, IQ2_XS)
MOE_GEMV_KERNEL(iq2_s, IQ2_S)
MOE_GEMV_KERNEL(iq3_xxs, IQ3_XXS)
MOE_GEMV_KERNEL(iq3_s, IQ3_S)
MOE_GEMV_KERNEL(iq1_s, IQ1_S)
MOE_GEMV_KERNEL(iq1_m, IQ1_M)
MOE_GEMV_KERNEL(iq4_nl, IQ4_NL)
MOE_GEMV_KERNEL(iq4_xs, IQ4_XS)
MOE_GEMV_KERNEL(mxfp4, MXFP4)

// out[r, :] = sum_s weights[r, s] y[pos[r k + s], :] (+ shared[r, :], times
// sigmoid(shared_logit[r]) when given), bf16; one block per row.
extern "C" __global__ void moe_combine(bf16* __restrict__ out, const bf16* __restrict__ y,
                                       const int* __restrict__ pos,
                                       const float* __restrict__ weights,
                                       const bf16* __restrict__ shared,
                                       const bf16* __restrict__ shared_logit, int n_rows,
                                       int k, int d) {
  const int r = blockIdx.x;
  if (r >= n_rows) return;
  float gate = 1.0f;
  if (shared_logit != nullptr) gate = 1.0f / (1.0f + expf(-__bfloat162float(shared_logit[r])));
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float s = 0.0f;
    for (int t = 0; t < k; ++t) {
      const i64 q = pos[(i64)r * k + t];
      s = fmaf(weights[(i64)r * k + t], __bfloat162float(y[q * d + i]), s);
    }
    if (shared != nullptr) s = fmaf(gate, __bfloat162float(shared[(i64)r * d + i]), s);
    out[(i64)r * d + i] = from_f32<bf16>(s);
  }
}
