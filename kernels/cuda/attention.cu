// Causal GQA attention over each session's contiguous KV region, for prefill and decode.
//
// One block serves ATT_QB query vectors of one session and one KV head: the vectors are
// (row, query head) pairs of the session's new rows whose heads share that KV head, so
// each K/V tile loaded into shared memory is used by every query head of the group. Keys
// are visited in tiles of 32 (one key per lane for the scores, then all lanes over the
// head dimension for P.V) with the online softmax in the log2 domain (exp2f).
//
// A key at position j is visible from position p when j <= p and, with a sliding window,
// p - j < window (kernels/numpy_ops.py: attention). With `sinks` (gpt-oss: one logit per
// query head, natural log units, or null) each head's softmax also counts that logit,
// which has no value: it joins the normalisation (here, or in attention_merge).
//
// Long contexts with few query vectors (decode) are split over the context: blockIdx.y
// also numbers the split; each split writes its unnormalised output and (max, sum) to a
// float32 workspace, and attention_merge combines them. With n_splits == 1 the block
// normalises and writes bf16 directly.
//
// HPL (head dims per lane) is a template argument so the accumulators stay in registers:
// attention_hd32/64/128/256 serve head_dim up to 32, 64, 128 and 256.
#include "common.cuh"

constexpr int ATT_BK = 32;     // keys per tile
constexpr int ATT_WARPS = 4;
constexpr int ATT_QPW = 4;     // query vectors per warp
constexpr int ATT_QB = ATT_WARPS * ATT_QPW;

// Keys [t0, t0 + ATT_BK) of one KV head into shared memory rows of `ld` bf16 (zeros past
// k_hi, so masked lanes multiply finite values).
__device__ __forceinline__ void load_tile(bf16* dst, const unsigned char* src0, int t0, int k_hi,
                                          i64 token_bytes, int hd, int ld) {
  const int words = hd / 2;
  for (int e = threadIdx.x; e < ATT_BK * words; e += blockDim.x) {
    const int j = e / words, w = e - j * words;
    const int key = t0 + j;
    __nv_bfloat162 val = __floats2bfloat162_rn(0.0f, 0.0f);
    if (key < k_hi)
      val = reinterpret_cast<const __nv_bfloat162*>(src0 + (i64)key * token_bytes)[w];
    reinterpret_cast<__nv_bfloat162*>(dst + j * ld)[w] = val;
  }
}

template <int HPL>
__device__ __forceinline__ void attention_impl(
    bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    const bf16* __restrict__ q, const SeqDesc* __restrict__ seqs, i64 k_off, i64 v_off,
    i64 token_bytes, int n_heads, int n_kv_heads, int hd, float scale_log2, int window,
    int n_splits, int split_len, int n_rows, const float* __restrict__ sinks) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int ld = hd + 2;  // odd number of 32-bit words per row: lanes hit distinct banks
  bf16* q_s = reinterpret_cast<bf16*>(smem);  // [ATT_QB][hd]
  bf16* kv_s = q_s + ATT_QB * hd;              // [ATT_BK][ld]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = blockIdx.y % n_kv_heads, split = blockIdx.y / n_kv_heads;
  const SeqDesc s = seqs[blockIdx.z];
  const int g = n_heads / n_kv_heads;
  const int n_qv = s.n_new * g;
  const int qv0 = blockIdx.x * ATT_QB;
  if (qv0 >= n_qv) return;  // uniform over the block

  for (int e = threadIdx.x; e < ATT_QB * hd; e += blockDim.x) {
    const int i = e / hd, d = e - i * hd, qv = qv0 + i;
    bf16 val = __float2bfloat16_rn(0.0f);
    if (qv < n_qv) {
      const int r = qv / g, h = kvh * g + qv % g;
      val = q[((i64)(s.start + r) * n_heads + h) * hd + d];
    }
    q_s[e] = val;
  }

  int qpos[ATT_QPW];
  bool valid[ATT_QPW];
  float m[ATT_QPW], l[ATT_QPW], acc[ATT_QPW][HPL];
#pragma unroll
  for (int k = 0; k < ATT_QPW; ++k) {
    const int qv = qv0 + warp * ATT_QPW + k;
    valid[k] = qv < n_qv;
    qpos[k] = s.n_past + (valid[k] ? qv / g : 0);
    m[k] = -EAGERLM_INF;
    l[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < HPL; ++i) acc[k][i] = 0.0f;
  }

  // Keys this block may see: up to its last row, from the window start of its first row,
  // within this split's share of the context.
  const int r_lo = qv0 / g;
  const int r_hi = min(n_qv - 1, qv0 + ATT_QB - 1) / g;
  int k_lo = window > 0 ? max(0, s.n_past + r_lo - window + 1) : 0;
  int k_hi = s.n_past + r_hi + 1;
  const int s_lo = split * split_len;
  k_lo = max(k_lo, s_lo);
  k_hi = min(k_hi, s_lo + split_len);

  const unsigned char* kv = reinterpret_cast<const unsigned char*>(s.kv_base);
  const unsigned char* k_src = kv + k_off + (i64)kvh * hd * 2;
  const unsigned char* v_src = kv + v_off + (i64)kvh * hd * 2;
  for (int t0 = k_lo; t0 < k_hi; t0 += ATT_BK) {
    __syncthreads();  // q_s written / the previous V tile consumed
    load_tile(kv_s, k_src, t0, k_hi, token_bytes, hd, ld);
    __syncthreads();
    float sc[ATT_QPW];
    {
      const int key = t0 + lane;
      float dot[ATT_QPW];
#pragma unroll
      for (int k = 0; k < ATT_QPW; ++k) dot[k] = 0.0f;
      const __nv_bfloat162* kr = reinterpret_cast<const __nv_bfloat162*>(kv_s + lane * ld);
      for (int d2 = 0; d2 < hd / 2; ++d2) {
        const float2 kf = __bfloat1622float2(kr[d2]);
#pragma unroll
        for (int k = 0; k < ATT_QPW; ++k) {
          const float2 qf = __bfloat1622float2(
              reinterpret_cast<const __nv_bfloat162*>(q_s + (warp * ATT_QPW + k) * hd)[d2]);
          dot[k] = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, dot[k]));
        }
      }
#pragma unroll
      for (int k = 0; k < ATT_QPW; ++k) {
        const bool visible = valid[k] && key < k_hi && key <= qpos[k] &&
                             (window <= 0 || qpos[k] - key < window);
        sc[k] = visible ? dot[k] * scale_log2 : -EAGERLM_INF;
      }
    }
    __syncthreads();
    load_tile(kv_s, v_src, t0, k_hi, token_bytes, hd, ld);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ATT_QPW; ++k) {
      const float m_new = fmaxf(m[k], warp_max(sc[k]));
      if (m_new == -EAGERLM_INF) continue;  // nothing visible yet (uniform over the warp)
      const float p = exp2f(sc[k] - m_new);
      const float corr = exp2f(m[k] - m_new);
      l[k] = l[k] * corr + warp_sum(p);
      m[k] = m_new;
#pragma unroll
      for (int i = 0; i < HPL; ++i) acc[k][i] *= corr;
      for (int j = 0; j < ATT_BK; ++j) {
        const float pj = __shfl_sync(FULL_MASK, p, j);
        const bf16* vr = kv_s + j * ld;
#pragma unroll
        for (int i = 0; i < HPL; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) acc[k][i] = fmaf(pj, __bfloat162float(vr[d]), acc[k][i]);
        }
      }
    }
  }

#pragma unroll
  for (int k = 0; k < ATT_QPW; ++k) {
    if (!valid[k]) continue;
    const int qv = qv0 + warp * ATT_QPW + k;
    const int h = kvh * g + qv % g;
    const i64 row = s.start + qv / g;
    if (n_splits == 1) {
      float total = l[k];
      if (sinks != nullptr && m[k] != -EAGERLM_INF) total += exp2f(sinks[h] * LOG2E - m[k]);
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
      for (int i = 0; i < HPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) out[(row * n_heads + h) * hd + d] = from_f32<bf16>(acc[k][i] * inv);
      }
    } else {
      const i64 at = ((i64)split * n_rows + row) * n_heads + h;
#pragma unroll
      for (int i = 0; i < HPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) part_o[at * hd + d] = acc[k][i];
      }
      if (lane == 0) {
        part_ml[at * 2] = m[k];
        part_ml[at * 2 + 1] = l[k];
      }
    }
  }
}

#define ATTENTION_KERNEL(NAME, HPL)                                                        \
  extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) NAME(                       \
      bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,     \
      const bf16* __restrict__ q, const SeqDesc* __restrict__ seqs, i64 k_off, i64 v_off,  \
      i64 token_bytes, int n_heads, int n_kv_heads, int hd, float scale_log2, int window,  \
      int n_splits, int split_len, int n_rows, const float* __restrict__ sinks) {          \
    attention_impl<HPL>(out, part_o, part_ml, q, seqs, k_off, v_off, token_bytes, n_heads, \
                        n_kv_heads, hd, scale_log2, window, n_splits, split_len, n_rows,   \
                        sinks);                                                            \
  }

ATTENTION_KERNEL(attention_hd32, 1)
ATTENTION_KERNEL(attention_hd64, 2)
ATTENTION_KERNEL(attention_hd128, 4)
ATTENTION_KERNEL(attention_hd256, 8)

// Combine the splits of one (row, head): out = sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M).
// A split that saw no visible key has m = -inf and weighs nothing; at least one split holds
// the row's own position, so M is finite. A head's sink (when `sinks` is given) adds
// 2^(sink - M) to the denominator, M taken over it too.
extern "C" __global__ void attention_merge(bf16* __restrict__ out, const float* __restrict__ part_o,
                                           const float* __restrict__ part_ml, int n_rows,
                                           int n_heads, int hd, int n_splits,
                                           const float* __restrict__ sinks) {
  const i64 at = blockIdx.x;  // row * n_heads + head
  const i64 stride = (i64)n_rows * n_heads;
  const float sink = sinks != nullptr ? sinks[at % n_heads] * LOG2E : -EAGERLM_INF;
  float mx = sink;
  for (int s = 0; s < n_splits; ++s) mx = fmaxf(mx, part_ml[(s * stride + at) * 2]);
  float total = sink != -EAGERLM_INF ? exp2f(sink - mx) : 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float ms = part_ml[(s * stride + at) * 2];
    if (ms != -EAGERLM_INF) total += part_ml[(s * stride + at) * 2 + 1] * exp2f(ms - mx);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
      const float ms = part_ml[(s * stride + at) * 2];
      if (ms != -EAGERLM_INF) o += part_o[(s * stride + at) * hd + d] * exp2f(ms - mx);
    }
    out[at * hd + d] = from_f32<bf16>(o * inv);
  }
}
