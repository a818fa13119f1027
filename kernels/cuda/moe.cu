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
// The expert products between them are quant_matrix.cu's moe_gemv_<type>, the fused GEMV of
// the experts' type over each chunk (its rows of x gathered in expert order first).
// moe_combine: each row's k expert outputs weighted and summed in slot order, plus a
//   shared expert's output (times the sigmoid of its gate logit, when it has one).
#include "common.cuh"

#define MOE_CHUNK 8      // rows per chunk of an expert's product: GEMV_MAX_ROWS
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
