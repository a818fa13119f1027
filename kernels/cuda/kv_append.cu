// Append this batch's K and V to each session's KV region.
//
// Row r of the batch belongs to session row_seq[r] and is its position
// n_past + (r - start). The region is token-major (vmm/kv_layout.py): the K of one layer
// of one token is kv_dim contiguous bf16 at kv_base + position * token_bytes + k_off,
// and V likewise at v_off. All sessions of a batch share one layout, so the layer offsets
// and the token stride are arguments and only the base address is per session.
#include "common.cuh"

extern "C" __global__ void kv_append(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                     const SeqDesc* __restrict__ seqs,
                                     const int* __restrict__ row_seq, int n_rows, int kv_dim,
                                     i64 k_off, i64 v_off, i64 token_bytes) {
  const int row = blockIdx.x;
  if (row >= n_rows) return;
  const SeqDesc s = seqs[row_seq[row]];
  const i64 pos = s.n_past + (row - s.start);
  unsigned char* tok = reinterpret_cast<unsigned char*>(s.kv_base) + pos * token_bytes;
  // kv_dim is even (head_dim is) and every offset a multiple of 4: copy 32-bit words.
  const int words = kv_dim / 2;
  const unsigned* ks = reinterpret_cast<const unsigned*>(k + (i64)row * kv_dim);
  const unsigned* vs = reinterpret_cast<const unsigned*>(v + (i64)row * kv_dim);
  unsigned* kd = reinterpret_cast<unsigned*>(tok + k_off);
  unsigned* vd = reinterpret_cast<unsigned*>(tok + v_off);
  for (int j = threadIdx.x; j < words; j += blockDim.x) {
    kd[j] = ks[j];
    vd[j] = vs[j];
  }
}
