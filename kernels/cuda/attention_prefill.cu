// Causal GQA flash attention for prefill on tensor cores (FlashAttention-2 style, sm_80+;
// the same mma.sync code runs on sm_90, where wgmma would be faster still).
//
// Inputs are those of attention.cu: SeqDesc per session, q [n_rows, n_heads, hd] bf16, and
// each session's token-major KV region (K of token p at kv_base + p*token_bytes + k_off +
// kv_head*hd*2, V likewise at v_off), the new rows' K/V already appended. The output is
// [n_rows, n_heads*hd] bf16. A key at position j is visible from position p when j <= p
// and, with a sliding window, p - j < window (kernels/numpy_ops.py: attention).
//
// Work split. A block (8 warps) takes PF_BM = 128 query vectors of one session and one KV
// head; a query vector is a (row, query head) pair, numbered row * g + head-in-group, so a
// block covers 128 / g consecutive rows of all g query heads that share the KV head (GQA):
// every K/V tile brought into shared memory serves all of them, which halves (g = 2) to
// quarters (g = 4) the K/V traffic of a per-head split and, with 128 vectors per tile,
// keeps the L2 -> shared traffic at 128 flop per byte. Each warp owns 16 query vectors,
// one m16 row block of the mma: S = Q K^T, the online softmax and O += P V all stay in its
// registers, and warps never exchange data (only the shared K/V tiles).
//
// Per K/V tile of PF_BN = 64 keys, per warp:
//   S[16 x 64]  = Q[16 x hd] . K^T       hd/16 x 8 mma.m16n8k16 (K via ldmatrix, non-trans)
//   mask (only on tiles that cross the causal diagonal or the window edge), row max over
//   the quad of lanes sharing a row (2 shuffles), p = 2^(s*scale*log2e - m), rescale O, l
//   O[16 x hd] += P[16 x 64] . V          4 x hd/8 mma (P reused from S's accumulator
//                                         registers as the A operand; V via ldmatrix.trans)
// The m16n8 accumulator layout of S (rows g and g+8, key pairs 2t, 2t+1 of each n8 tile)
// is exactly the A-operand layout of the next mma once two n8 tiles are packed to bf16x2,
// so P never touches shared memory. Q is loaded once per block (staged through the K/V
// buffers) into A fragments that stay in registers: hd/16 x 4 registers.
//
// Precision: S, the softmax statistics, l and O accumulate in float32; P is rounded to bf16
// for the second mma (as in FlashAttention and PyTorch's flash kernels), which costs about
// 2^-9 relative per weight: outputs agree with a float32 reference to ~1e-3 of their scale,
// not to a few bf16 ulps of every element (attention.cu, all float32, does that).
//
// Memory. Shared memory is one K tile and one V tile, 2 x 64 x hd bf16: 16 KiB (hd 64) or
// 32 KiB (hd 128), under the 48 KiB a launch gets without cuFuncSetAttribute. Rows are 16-byte
// chunks stored at chunk ^ (row & 7) (XOR swizzle): the 8 row addresses of every ldmatrix
// phase and the 16-byte cp.async stores then hit 8 distinct bank groups, without padding.
// Tiles arrive by cp.async (16 bytes per thread per copy, zero-filled past the last key), and
// the loads overlap compute: V(j) is in flight while S(j) is computed, K(j+1) while the
// softmax and P.V of tile j run. One buffer of each is enough for that overlap. Shared
// memory would let two blocks share an SM, but registers do not: NVRTC 13 gives hd 128
// 248 registers a thread (8 warps: the whole 64K register file), so one block per SM
// there; __launch_bounds__(256, 2) would halve that at the cost of spills, a trade to
// measure on the GPU before making it.
//
// Scheduling: blockIdx = (kv head, query tile in reverse, session). Later query tiles see
// more keys, so they are issued first and the short ones fill the tail. Tiles that a warp's
// rows cannot see at all (above the diagonal, or before the window) skip its math; the
// block still loads them for the warps that can.
//
// mma_selftest (below) exists for tests/test_cuda_prefill_attention.py only: it checks the
// fragment layouts of mma.cuh (on a GPU, the hardware's; under the emulator, its model).
#include "common.cuh"
#include "mma.cuh"

constexpr int PF_WARPS = 8;
constexpr int PF_THREADS = PF_WARPS * 32;
constexpr int PF_BM = PF_WARPS * 16;  // query vectors per block (PF_BM in cuda_attention.py)
constexpr int PF_BN = 64;             // keys per K/V tile (PF_BN in cuda_attention.py)
static_assert(PF_BM == 2 * PF_BN, "Q is staged in the K and V buffers together");

// Element offset of 16-byte chunk `c` of row `r` in a tile of CPR chunks per row.
template <int CPR>
__device__ __forceinline__ int pf_swz(int r, int c) {
  return (r * CPR + (c ^ (r & 7))) * 8;
}

// Keys [t0, t0 + PF_BN) of one KV head into a swizzled tile; keys >= k_hi become zeros (a
// zero V row times a zero weight stays zero; NaN poison would not).
template <int HD>
__device__ __forceinline__ void pf_load_kv(bf16* dst, const unsigned char* src, int t0, int k_hi,
                                           i64 token_bytes) {
  constexpr int CPR = HD / 8;
  static_assert(PF_BN * CPR % PF_THREADS == 0, "whole copies per thread");
#pragma unroll
  for (int i = 0; i < PF_BN * CPR / PF_THREADS; ++i) {
    const int e = threadIdx.x + i * PF_THREADS;
    const int r = e / CPR, c = e % CPR;
    const int key = t0 + r;
    const bool ok = key < k_hi;
    cp_async_16(dst + pf_swz<CPR>(r, c), src + (ok ? (i64)key * token_bytes : 0) + c * 16,
                ok ? 16 : 0);
  }
}

template <int HD>
__device__ __forceinline__ void attention_prefill_impl(
    bf16* __restrict__ out, const bf16* __restrict__ q, const SeqDesc* __restrict__ seqs,
    i64 k_off, i64 v_off, i64 token_bytes, int n_heads, int n_kv_heads, float scale_log2,
    int window) {
  constexpr int CPR = HD / 8;     // 16-byte chunks per row
  constexpr int KS = HD / 16;     // k steps of Q.K^T
  constexpr int NT = PF_BN / 8;   // n8 tiles of S (keys)
  constexpr int DT = HD / 8;      // n8 tiles of O (head dims)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* k_s = reinterpret_cast<bf16*>(smem);  // [PF_BN][HD], swizzled
  bf16* v_s = k_s + PF_BN * HD;               // [PF_BN][HD], swizzled
  bf16* q_s = k_s;                            // [PF_BM][HD] over both, before the loop

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int mi = lane >> 3, mr = lane & 7;  // the ldmatrix matrix / row this lane addresses
  const int kvh = blockIdx.x;
  const SeqDesc s = seqs[blockIdx.z];
  const int g = n_heads / n_kv_heads;
  const int n_qv = s.n_new * g;
  const int qv0 = ((int)gridDim.y - 1 - (int)blockIdx.y) * PF_BM;
  if (qv0 >= n_qv) return;  // uniform over the block

  // Q: cp.async into the staging tile, then each warp's 16 rows into A fragments.
#pragma unroll
  for (int i = 0; i < PF_BM * CPR / PF_THREADS; ++i) {
    const int e = threadIdx.x + i * PF_THREADS;
    const int r = e / CPR, c = e % CPR;
    const int qv = qv0 + r;
    const bool ok = qv < n_qv;
    const int row = ok ? qv / g : 0, h = kvh * g + (ok ? qv - row * g : 0);
    cp_async_16(q_s + pf_swz<CPR>(r, c), q + ((i64)(s.start + row) * n_heads + h) * HD + c * 8,
                ok ? 16 : 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  u32 qf[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
    ldmatrix_x4(qf[ks], q_s + pf_swz<CPR>(warp * 16 + (mi & 1) * 8 + mr, ks * 2 + (mi >> 1)));
  __syncthreads();  // the staging tile becomes the K and V tiles

  // This warp's rows, and this thread's two of them (grp and grp + 8).
  const int w_lo = qv0 + warp * 16;
  const bool has_rows = w_lo < n_qv;  // uniform over the warp
  const int w_hi = min(w_lo + 15, n_qv - 1);
  const int min_pos = s.n_past + w_lo / g, max_pos = s.n_past + w_hi / g;
  int pos[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qv = w_lo + grp + 8 * r;
    pos[r] = qv < n_qv ? s.n_past + qv / g : -1;  // -1: sees no key
  }

  // Keys the block may see: from the window start of its first row to its last row.
  const int r_lo = qv0 / g, r_hi = (min(qv0 + PF_BM, n_qv) - 1) / g;
  const int k_lo = window > 0 ? max(0, s.n_past + r_lo - window + 1) : 0;
  const int k_hi = s.n_past + r_hi + 1;
  const int t_first = k_lo / PF_BN * PF_BN;
  const int n_tiles = (k_hi - t_first + PF_BN - 1) / PF_BN;
  const unsigned char* kv = reinterpret_cast<const unsigned char*>(s.kv_base);
  const unsigned char* k_src = kv + k_off + (i64)kvh * HD * 2;
  const unsigned char* v_src = kv + v_off + (i64)kvh * HD * 2;

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int j = 0; j < 4; ++j) o[dt][j] = 0.0f;
  float m[2] = {-EAGERLM_INF, -EAGERLM_INF};  // running max of s * scale_log2, per row
  float l[2] = {0.0f, 0.0f};  // this thread's share of the row sums (quad-reduced at the end)

  pf_load_kv<HD>(k_s, k_src, t_first, k_hi, token_bytes);
  cp_async_commit();

  for (int it = 0; it < n_tiles; ++it) {
    const int t0 = t_first + it * PF_BN;
    cp_async_wait<0>();
    __syncthreads();  // K(it) is in k_s for all; every warp is done reading v_s
    pf_load_kv<HD>(v_s, v_src, t0, k_hi, token_bytes);
    cp_async_commit();

    const bool skip = !has_rows || t0 > max_pos ||
                      (window > 0 && min_pos - (t0 + PF_BN - 1) >= window);
    const bool unmasked = t0 + PF_BN - 1 <= min_pos && (window <= 0 || max_pos - t0 < window);
    float sc[NT][4];
    if (!skip) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[nt][j] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          u32 b[4];  // keys np*16 + {0..7, 8..15} x dims ks*16 + {0..7, 8..15}
          ldmatrix_x4(b, k_s + pf_swz<CPR>(np * 16 + (mi >> 1) * 8 + mr, ks * 2 + (mi & 1)));
          mma_bf16_16816(sc[2 * np], qf[ks], b, sc[2 * np]);
          mma_bf16_16816(sc[2 * np + 1], qf[ks], b + 2, sc[2 * np + 1]);
        }
      }
    }
    __syncthreads();  // every warp is done reading k_s
    if (it + 1 < n_tiles) pf_load_kv<HD>(k_s, k_src, t0 + PF_BN, k_hi, token_bytes);
    cp_async_commit();  // possibly empty: keeps the group count uniform for the wait below

    if (!skip) {
      if (!unmasked) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int key = t0 + nt * 8 + tig * 2 + (j & 1);
            const int p = pos[j >> 1];
            if (!(key <= p && (window <= 0 || p - key < window))) sc[nt][j] = -EAGERLM_INF;
          }
      }
      float mx[2] = {-EAGERLM_INF, -EAGERLM_INF};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) mx[j >> 1] = fmaxf(mx[j >> 1], sc[nt][j]);
      float m_use[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
        const float m_new = fmaxf(m[r], mx[r] * scale_log2);
        // A row that has seen no visible key yet keeps m = -inf; exponentiate against 0
        // so its weights are exp2(-inf) = 0 rather than NaN.
        m_use[r] = m_new == -EAGERLM_INF ? 0.0f : m_new;
        const float corr = exp2_approx(m[r] - m_use[r]);
        m[r] = m_new;
        l[r] *= corr;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[dt][2 * r] *= corr;
          o[dt][2 * r + 1] *= corr;
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float p = exp2_approx(fmaf(sc[nt][j], scale_log2, -m_use[j >> 1]));
          sc[nt][j] = p;
          l[j >> 1] += p;
        }
    }

    cp_async_wait<1>();  // V(it); K(it + 1) may still be in flight
    __syncthreads();
    if (!skip) {
#pragma unroll
      for (int ks = 0; ks < PF_BN / 16; ++ks) {
        u32 a[4];  // P rows grp / grp + 8, keys ks*16 + tig*2 (+1) and + 8
        a[0] = pack_bf16x2(sc[2 * ks][0], sc[2 * ks][1]);
        a[1] = pack_bf16x2(sc[2 * ks][2], sc[2 * ks][3]);
        a[2] = pack_bf16x2(sc[2 * ks + 1][0], sc[2 * ks + 1][1]);
        a[3] = pack_bf16x2(sc[2 * ks + 1][2], sc[2 * ks + 1][3]);
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          u32 b[4];  // keys ks*16 + {0..7, 8..15} x dims dp*16 + {0..7, 8..15}, transposed
          ldmatrix_x4_trans(b, v_s + pf_swz<CPR>(ks * 16 + (mi & 1) * 8 + mr, dp * 2 + (mi >> 1)));
          mma_bf16_16816(o[2 * dp], a, b, o[2 * dp]);
          mma_bf16_16816(o[2 * dp + 1], a, b + 2, o[2 * dp + 1]);
        }
      }
    }
  }

  if (!has_rows) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qv = w_lo + grp + 8 * r;
    if (qv >= n_qv) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int row = qv / g, h = kvh * g + qv - row * g;
    u32* dst = reinterpret_cast<u32*>(out + ((i64)(s.start + row) * n_heads + h) * HD + tig * 2);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      dst[dt * 4] = pack_bf16x2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
  }
}

#define ATTENTION_PREFILL_KERNEL(HD)                                                          \
  extern "C" __global__ void __launch_bounds__(PF_THREADS) attention_prefill_hd##HD(          \
      bf16* __restrict__ out, const bf16* __restrict__ q, const SeqDesc* __restrict__ seqs,   \
      i64 k_off, i64 v_off, i64 token_bytes, int n_heads, int n_kv_heads, float scale_log2,  \
      int window) {                                                                           \
    attention_prefill_impl<HD>(out, q, seqs, k_off, v_off, token_bytes, n_heads, n_kv_heads, \
                               scale_log2, window);                                           \
  }

ATTENTION_PREFILL_KERNEL(64)
ATTENTION_PREFILL_KERNEL(128)

// Test only. One warp: d[16][16] = c + a[16][16] . b[16][16] (row-major float32 d, bf16 a and
// b, b indexed [k][n]; c is d's value on entry), as two m16n8k16 products (n 0-7, 8-15).
// mode 0 builds the fragments straight from global memory by the PTX ISA's fragment tables;
// mode 1 loads them with ldmatrix as attention_prefill does for Q and K: A from a row-major
// tile, B from a tile whose rows are B's columns; mode 2 takes B with ldmatrix.trans from a
// tile of B's rows, as for V. Shared memory: 1536 bytes.
__device__ __forceinline__ u32 pf_bits2(bf16 lo, bf16 hi) {
  return (u32)__bfloat16_as_ushort(lo) | ((u32)__bfloat16_as_ushort(hi) << 16);
}

extern "C" __global__ void mma_selftest(float* __restrict__ d, const bf16* __restrict__ a,
                                        const bf16* __restrict__ b, int mode) {
  extern __shared__ __align__(16) unsigned char selftest_smem[];
  bf16* a_s = reinterpret_cast<bf16*>(selftest_smem);  // [16 m][16 k]
  bf16* b_s = a_s + 256;                      // [16 k][16 n]
  bf16* bt_s = b_s + 256;                     // [16 n][16 k]
  const int lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  const int mi = lane >> 3, mr = lane & 7;
  for (int e = lane; e < 256; e += 32) {
    a_s[e] = a[e];
    b_s[e] = b[e];
    bt_s[(e % 16) * 16 + e / 16] = b[e];
  }
  __syncwarp();
  u32 fa[4], fb[4];  // fb[2 nt + i]: register i of n-tile nt's B fragment
  if (mode == 0) {
    for (int i = 0; i < 4; ++i) {  // register i holds a_{2i} (low) and a_{2i+1}
      const int row = grp + ((i & 1) ? 8 : 0), col = tig * 2 + ((i & 2) ? 8 : 0);
      fa[i] = pf_bits2(a[row * 16 + col], a[row * 16 + col + 1]);
    }
    for (int nt = 0; nt < 2; ++nt)
      for (int i = 0; i < 2; ++i) {  // register i holds b_{2i} and b_{2i+1}
        const int k = tig * 2 + (i ? 8 : 0), n = nt * 8 + grp;
        fb[2 * nt + i] = pf_bits2(b[k * 16 + n], b[(k + 1) * 16 + n]);
      }
  } else {
    ldmatrix_x4(fa, a_s + ((mi & 1) * 8 + mr) * 16 + (mi >> 1) * 8);
    if (mode == 1)
      ldmatrix_x4(fb, bt_s + ((mi >> 1) * 8 + mr) * 16 + (mi & 1) * 8);
    else
      ldmatrix_x4_trans(fb, b_s + ((mi & 1) * 8 + mr) * 16 + (mi >> 1) * 8);
  }
  for (int nt = 0; nt < 2; ++nt) {
    float c[4];
    for (int j = 0; j < 4; ++j) c[j] = d[(grp + (j >> 1) * 8) * 16 + nt * 8 + tig * 2 + (j & 1)];
    mma_bf16_16816(c, fa, fb + 2 * nt, c);
    for (int j = 0; j < 4; ++j) d[(grp + (j >> 1) * 8) * 16 + nt * 8 + tig * 2 + (j & 1)] = c[j];
  }
}
