// Rotary position embedding of the first rope_dim dims of each head; the rest is copied.
//
// NORM (llama) rotates adjacent pairs (x[2i], x[2i+1]); NEOX (qwen, gemma) rotates x[i]
// with x[i + rope_dim/2]. The angle of pair i at position p is
//     p * scale * base^(-2i / rope_dim) / freq_factor[i]
// computed in double precision, as the numpy reference does: at positions in the tens of
// thousands a float32 angle is off by more than a bf16 ulp of the result. cos and sin are
// then rounded to float32 and the rotation itself is float32.
#include "common.cuh"

template <bool NEOX>
__device__ __forceinline__ void rope_impl(bf16* __restrict__ out, const bf16* __restrict__ x,
                                          const int* __restrict__ positions,
                                          const float* __restrict__ freq_factors, int n_heads,
                                          int head_dim, int rope_dim, double base,
                                          double scale) {
  const i64 row = blockIdx.x;  // (token, head)
  const int tok = (int)(row / n_heads);
  const double p = (double)positions[tok];
  const int half = rope_dim / 2;
  const bf16* xr = x + row * head_dim;
  bf16* o = out + row * head_dim;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double inv = pow(base, (-(double)i * 2.0) / (double)rope_dim);
    if (freq_factors != nullptr) inv = inv / (double)freq_factors[i];
    double sd, cd;
    sincos(p * scale * inv, &sd, &cd);
    const float s = (float)sd, c = (float)cd;
    const int ia = NEOX ? i : 2 * i;
    const int ib = NEOX ? i + half : 2 * i + 1;
    const float a = __bfloat162float(xr[ia]), b = __bfloat162float(xr[ib]);
    o[ia] = from_f32<bf16>(a * c - b * s);
    o[ib] = from_f32<bf16>(a * s + b * c);
  }
  for (int j = rope_dim + threadIdx.x; j < head_dim; j += blockDim.x) o[j] = xr[j];
}

extern "C" __global__ void rope_norm(bf16* __restrict__ out, const bf16* __restrict__ x,
                                     const int* __restrict__ positions,
                                     const float* __restrict__ freq_factors, int n_heads,
                                     int head_dim, int rope_dim, double base, double scale) {
  rope_impl<false>(out, x, positions, freq_factors, n_heads, head_dim, rope_dim, base, scale);
}

extern "C" __global__ void rope_neox(bf16* __restrict__ out, const bf16* __restrict__ x,
                                     const int* __restrict__ positions,
                                     const float* __restrict__ freq_factors, int n_heads,
                                     int head_dim, int rope_dim, double base, double scale) {
  rope_impl<true>(out, x, positions, freq_factors, n_heads, head_dim, rope_dim, base, scale);
}
