// GGUF tensor data, as stored in the file, to bf16 (matrices) or float32 (vectors).
//
// The raw blocks are uploaded unchanged and expanded here, one thread per output element
// (the loader is bound by the host link, not by this); the cuda backend's tile path
// (kernels/cuda_quantized.py) expands a few rows of a quantized matrix at a time the same
// way. The decoders (quant_blocks.cuh) give gguf.quants.dequantize's float32 values; the
// bf16 output is that value rounded to nearest even.
#include "quant_blocks.cuh"

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
DEQUANT_KERNELS(iq2_xxs, IQ2_XXS)
DEQUANT_KERNELS(iq2_xs, IQ2_XS)
DEQUANT_KERNELS(iq2_s, IQ2_S)
DEQUANT_KERNELS(iq3_xxs, IQ3_XXS)
DEQUANT_KERNELS(iq3_s, IQ3_S)
DEQUANT_KERNELS(iq1_s, IQ1_S)
DEQUANT_KERNELS(iq1_m, IQ1_M)
DEQUANT_KERNELS(iq4_nl, IQ4_NL)
DEQUANT_KERNELS(iq4_xs, IQ4_XS)
DEQUANT_KERNELS(mxfp4, MXFP4)
