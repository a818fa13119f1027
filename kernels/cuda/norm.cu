// RMSNorm over the last axis, and the fused residual add + RMSNorm between sub-layers.
//
// y = x / sqrt(mean(x^2) + eps) * w, sums in float32. The same kernel serves the model's
// norms (rows = tokens, dim = d_model) and QK-norm (rows = tokens * heads, dim = head_dim).
// blockDim.x threads share a row and blockDim.y rows share a block, so short rows (QK-norm)
// do not leave most of a block idle; the host picks the shape from `dim`.
//
// The residual stream is float32: the sum residual + x is kept in float32 (h_out), and
// only the normalized activations that feed the GEMMs are bf16.
#include "common.cuh"

constexpr int NORM_MAX_ROWS_PER_BLOCK = 32;

template <typename Tin>
__device__ __forceinline__ void rms_norm_impl(bf16* __restrict__ out, const Tin* __restrict__ x,
                                              const float* __restrict__ w, int rows, int dim,
                                              float eps) {
  __shared__ float scratch[NORM_MAX_ROWS_PER_BLOCK * 32];
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const Tin* xr = x + (i64)row * dim;
  float ss = 0.0f;
  if (valid)
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
      const float v = to_f32(xr[j]);
      ss += v * v;
    }
  ss = row_sum(ss, scratch);  // every thread takes part: it may synchronize the block
  if (!valid) return;
  const float r = 1.0f / sqrtf(ss / (float)dim + eps);
  bf16* o = out + (i64)row * dim;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = from_f32<bf16>(to_f32(xr[j]) * r * w[j]);
}

extern "C" __global__ void rms_norm_f32(bf16* __restrict__ out, const float* __restrict__ x,
                                        const float* __restrict__ w, int rows, int dim,
                                        float eps) {
  rms_norm_impl<float>(out, x, w, rows, dim, eps);
}

extern "C" __global__ void rms_norm_bf16(bf16* __restrict__ out, const bf16* __restrict__ x,
                                         const float* __restrict__ w, int rows, int dim,
                                         float eps) {
  rms_norm_impl<bf16>(out, x, w, rows, dim, eps);
}

// h = residual + x (float32), y = rms_norm(h) * w (bf16).
extern "C" __global__ void add_rms_norm(float* __restrict__ h_out, bf16* __restrict__ y_out,
                                        const float* __restrict__ residual,
                                        const bf16* __restrict__ x, const float* __restrict__ w,
                                        int rows, int dim, float eps) {
  __shared__ float scratch[NORM_MAX_ROWS_PER_BLOCK * 32];
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const i64 base = (i64)row * dim;
  float ss = 0.0f;
  if (valid)
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
      const float h = residual[base + j] + __bfloat162float(x[base + j]);
      h_out[base + j] = h;  // read back below by this same thread
      ss += h * h;
    }
  ss = row_sum(ss, scratch);
  if (!valid) return;
  const float r = 1.0f / sqrtf(ss / (float)dim + eps);
  for (int j = threadIdx.x; j < dim; j += blockDim.x)
    y_out[base + j] = from_f32<bf16>(h_out[base + j] * r * w[j]);
}
