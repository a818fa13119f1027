// Elementwise ops: gated FFN activations, soft-capping, bias add, row gather.
// Grid-stride loops over flat element counts; math in float32, as the numpy reference.
#include "common.cuh"

#define GRID_STRIDE(i, n) \
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// silu(gate) * up. exp(-gate) overflowing to inf gives the right limit, 0.
extern "C" __global__ void swiglu(bf16* __restrict__ out, const bf16* __restrict__ gate,
                                  const bf16* __restrict__ up, i64 n) {
  GRID_STRIDE(i, n) {
    const float g = __bfloat162float(gate[i]);
    out[i] = from_f32<bf16>(g / (1.0f + expf(-g)) * __bfloat162float(up[i]));
  }
}

// gelu(gate) * up with gelu's tanh approximation (as llama.cpp and the reference).
extern "C" __global__ void geglu(bf16* __restrict__ out, const bf16* __restrict__ gate,
                                 const bf16* __restrict__ up, i64 n) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  GRID_STRIDE(i, n) {
    const float g = __bfloat162float(gate[i]);
    const float g3 = g * g * g;
    out[i] = from_f32<bf16>(0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g3))) *
                            __bfloat162float(up[i]));
  }
}

// gpt-oss's clamped SwiGLU, as ggml's swiglu_oai (alpha 1.702, limit 7): the gate clamped
// above, up on both sides, gate * sigmoid(alpha gate) * (up + 1).
extern "C" __global__ void swiglu_oai(bf16* __restrict__ out, const bf16* __restrict__ gate,
                                      const bf16* __restrict__ up, i64 n) {
  GRID_STRIDE(i, n) {
    const float g = fminf(__bfloat162float(gate[i]), 7.0f);
    const float u = fminf(fmaxf(__bfloat162float(up[i]), -7.0f), 7.0f);
    out[i] = from_f32<bf16>(g / (1.0f + expf(-1.702f * g)) * (u + 1.0f));
  }
}

// tanh(x / cap) * cap; logits (float32) or activations (bf16).
extern "C" __global__ void softcap_f32(float* __restrict__ out, const float* __restrict__ x,
                                       i64 n, float cap) {
  GRID_STRIDE(i, n) out[i] = tanhf(x[i] / cap) * cap;
}

extern "C" __global__ void softcap_bf16(bf16* __restrict__ out, const bf16* __restrict__ x,
                                        i64 n, float cap) {
  GRID_STRIDE(i, n) out[i] = from_f32<bf16>(tanhf(__bfloat162float(x[i]) / cap) * cap);
}

// y[r, j] += bias[j], in place on a GEMM's fresh output (qwen2's QKV biases).
extern "C" __global__ void add_bias_bf16(bf16* __restrict__ y, const float* __restrict__ bias,
                                         i64 n, int cols) {
  GRID_STRIDE(i, n) y[i] = from_f32<bf16>(__bfloat162float(y[i]) + bias[i % cols]);
}

extern "C" __global__ void add_bias_f32(float* __restrict__ y, const float* __restrict__ bias,
                                        i64 n, int cols) {
  GRID_STRIDE(i, n) y[i] += bias[i % cols];
}

// out[i, :] = x[rows[i], :], rows of `row_words` 16-bit words (any 2-byte-multiple row).
extern "C" __global__ void gather_rows(unsigned short* __restrict__ out,
                                       const unsigned short* __restrict__ x,
                                       const i64* __restrict__ rows, int n_rows,
                                       i64 row_words) {
  GRID_STRIDE(i, (i64)n_rows * row_words) {
    const i64 r = i / row_words, c = i - r * row_words;
    out[i] = x[rows[r] * row_words + c];
  }
}

// out[r, s * cols + c] = in[s, r, c]: an all-gather's per-device blocks [shards, rows, cols]
// (NCCL's layout) side by side as [rows, shards * cols] (32-bit words: float32 logits).
extern "C" __global__ void interleave_shards(unsigned* __restrict__ out,
                                             const unsigned* __restrict__ in, int n_shards,
                                             int rows, i64 cols) {
  const i64 per_shard = (i64)rows * cols;
  GRID_STRIDE(i, (i64)n_shards * per_shard) {
    const i64 s = i / per_shard, rem = i - s * per_shard, r = rem / cols, c = rem - r * cols;
    out[(r * n_shards + s) * cols + c] = in[i];
  }
}
