// Rotary position embedding of the first rope_dim dims of each head; the rest is copied.
//
// NORM (llama) rotates adjacent pairs (x[2i], x[2i+1]); NEOX (qwen, gemma) rotates x[i]
// with x[i + rope_dim/2]. Pair i at position p turns by (llama.cpp's ggml_rope_ext; see
// RopeParams in loader/config.py)
//     extrap = p * base^(-2i / rope_dim) / freq_factor[i]
//     interp = freq_scale * extrap
//     theta  = interp * (1 - mix) + extrap * mix,  mix = ext_factor * ramp(i)
//     ramp(i) = 1 - clamp((i - corr_low) / max(0.001, corr_high - corr_low), 0, 1)
// (ext_factor 0: plain or linearly scaled rope, theta = interp; YaRN: 1), and cos and sin
// are multiplied by mscale. The host derives corr_low/high and mscale once per model.
// Angles are computed in double precision, as the numpy reference does: at positions in
// the tens of thousands a float32 angle is off by more than a bf16 ulp of the result.
// cos and sin are then rounded to float32 and the rotation itself is float32.
#include "common.cuh"

template <bool NEOX>
__device__ __forceinline__ void rope_impl(bf16* __restrict__ out, const bf16* __restrict__ x,
                                          const int* __restrict__ positions,
                                          const float* __restrict__ freq_factors, int n_heads,
                                          int head_dim, int rope_dim, double base,
                                          double freq_scale, double ext_factor,
                                          double corr_low, double corr_high, double mscale) {
  const i64 row = blockIdx.x;  // (token, head)
  const int tok = (int)(row / n_heads);
  const double p = (double)positions[tok];
  const int half = rope_dim / 2;
  const bf16* xr = x + row * head_dim;
  bf16* o = out + row * head_dim;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double inv = pow(base, (-(double)i * 2.0) / (double)rope_dim);
    if (freq_factors != nullptr) inv = inv / (double)freq_factors[i];
    const double extrap = p * inv;
    double theta = freq_scale * extrap;
    if (ext_factor != 0.0) {
      const double y = ((double)i - corr_low) / fmax(0.001, corr_high - corr_low);
      const double mix = (1.0 - fmin(1.0, fmax(0.0, y))) * ext_factor;
      theta = theta * (1.0 - mix) + extrap * mix;
    }
    double sd, cd;
    sincos(theta, &sd, &cd);
    const float s = (float)(sd * mscale), c = (float)(cd * mscale);
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
                                     int head_dim, int rope_dim, double base,
                                     double freq_scale, double ext_factor, double corr_low,
                                     double corr_high, double mscale) {
  rope_impl<false>(out, x, positions, freq_factors, n_heads, head_dim, rope_dim, base,
                   freq_scale, ext_factor, corr_low, corr_high, mscale);
}

extern "C" __global__ void rope_neox(bf16* __restrict__ out, const bf16* __restrict__ x,
                                     const int* __restrict__ positions,
                                     const float* __restrict__ freq_factors, int n_heads,
                                     int head_dim, int rope_dim, double base,
                                     double freq_scale, double ext_factor, double corr_low,
                                     double corr_high, double mscale) {
  rope_impl<true>(out, x, positions, freq_factors, n_heads, head_dim, rope_dim, base,
                  freq_scale, ext_factor, corr_low, corr_high, mscale);
}
