// Token embedding: one row of the (bf16) table per token, times the model's embedding
// scale, into the float32 residual stream.
//
// The ids come from the host (a plain int32 array, id_stride = 1) or from the round's
// device metadata (pairs [host id, slot], id_stride = 2): a decode step's input is the
// token the previous round's sampler wrote to token_buf[slot], which the host has not seen
// yet (shared/DESIGN.md, "One round, eagerly", step 4). An id outside the vocabulary (the
// sampler's -1 for a failed row) poisons its row with NaN instead of reading out of bounds,
// so the failure surfaces in that row's logits.
#include "common.cuh"

extern "C" __global__ void embed_rows(float* __restrict__ out, const bf16* __restrict__ table,
                                      const int* __restrict__ ids, int id_stride,
                                      const int* __restrict__ token_buf, int n_rows, int d,
                                      int vocab, float scale) {
  const int row = blockIdx.x;
  if (row >= n_rows) return;
  float* o = out + (i64)row * d;
  const int id = embed_row_token(ids, id_stride, token_buf, row, o, d, vocab);
  if (id < 0) return;
  const bf16* t = table + (i64)id * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = __bfloat162float(t[j]) * scale;
}
