// Flash-decoding: GQA attention for decode rounds (every session of the batch has one new
// row), streaming K and V straight from the KV cache into registers.
//
// Why not attention.cu's kernel: it is built for prefill. It packs ATT_QB = 16 query
// vectors per block, but a decode row of one KV head has only g = n_heads / n_kv_heads of
// them (2 for Qwen3-0.6B), so most of its block computes on padding; and it stages K/V
// through shared memory 4 bytes at a time. Decode attention is a pure stream over the
// cache (each K/V byte is used by the g heads of its group and nothing else), so the only
// figure of merit is how close the read gets to the memory bandwidth.
//
// Work split. One block = (split, KV head [, chunk of G query heads], session):
//   grid = (n_splits, n_kv_heads * ceil(g / G), n_sessions), DEC_THREADS = 128 threads.
// All G query heads of the block share every K/V load (GQA). Within the block, a group of
// TPK = head_dim / 8 threads owns one key at a time, each thread 8 consecutive dims of it:
// one 16-byte load (uint4 = 8 bf16) of K and one of V per thread per key, so a group reads
// a key's whole K (and V) row as one contiguous 64..512-byte run. The NG = 128 / TPK
// groups walk the split's keys interleaved, U keys per group per step, and all 2U loads
// of a step are issued before any is used (U = 8, 4, 2 for G <= 2, 4, 8: fewer in flight
// where the per-key arithmetic, which grows with G, already hides the latency).
// Scores: each thread dots its 8 dims with the G queries (held pre-scaled by
// scale * log2(e) in float32 registers), the group sums the partials with xor shuffles
// (log2(TPK) steps, so every lane of the group holds the score). Softmax: online, in the
// log2 domain (exp2f), per group and per head, rescaling once per step of U keys; the
// accumulators (G x 8 float32 per thread) stay in registers. At the end the groups'
// (m, l, acc) are merged through shared memory (G * 1024 floats + a little).
//
// Visibility: the query of a decode row is at position p = n_past; keys 0 .. p (kv_append
// has already written key p), and with a sliding window only keys j > p - window. That is
// one contiguous range [lo, p], so there is no per-key mask beyond the range's ends.
//
// Splits (flash-decoding). `n_splits` and `split_len` are arguments fixed by the host, so
// one launch is valid for every batch whose sessions fit the bound it was sized for (a
// CUDA graph replays it with per-round lengths that live only in device memory): split s
// covers keys [lo + s * split_len, lo + (s + 1) * split_len) of its session's visible
// range, the last split also everything beyond (so a session longer than the bound is
// still right, only slower). A split past its session's keys writes an empty partial
// (m = -inf, l = 0; attention_merge never reads its o). With n_splits > 1 every block
// writes its unnormalised output and (m, l) to part_o[split][row][head][hd] and
// part_ml[split][row][head][2] and attention.cu's attention_merge combines them; with
// n_splits == 1 the block normalises and writes bf16 directly.
//
// Loads: __ldg (ld.global.nc.v4): kv_base is an integer, so a plain dereference would be a
// generic load; the cache is read-only while the kernel runs.
//
// Alignment: the host uses these kernels only when every K/V row start is 16-byte aligned
// (kv_base, token_bytes, k_off, v_off multiples of 16; head_dim * 2 is). q and out are
// read and written in 2- and 4-byte pieces (a few KiB per launch, not worth a constraint).
//
// head_dim (32, 64, 128, 256) and G (1, 2, 4, 8) are template arguments so every per-thread
// array is in registers: attention_decode_hd{HD}_g{G}. The host picks the smallest G >= g
// (G = 8 and several head chunks for g > 8); a chunk's heads past g compute on zero
// queries and are not written. Other head dims (not a power of two) use attention.cu.
#include "common.cuh"

constexpr int DEC_THREADS = 128;

// 8 bf16 (one 16-byte load) as float32: a bf16 is the top half of a float32.
__device__ __forceinline__ void dec_unpack(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <int HD, int G>
__device__ __forceinline__ void attention_decode_impl(
    bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    const bf16* __restrict__ q, const SeqDesc* __restrict__ seqs, i64 k_off, i64 v_off,
    i64 token_bytes, int n_heads, int n_kv_heads, float scale_log2, int window, int n_splits,
    int split_len, int n_rows, const float* __restrict__ sinks) {
  static_assert(HD % 8 == 0 && DEC_THREADS % (HD / 8) == 0 && HD / 8 <= 32, "head_dim");
  constexpr int TPK = HD / 8;                // threads per key (8 dims each)
  constexpr int NG = DEC_THREADS / TPK;      // key groups per block
  constexpr int U = G <= 2 ? 8 : (G <= 4 ? 4 : 2);  // keys per group per step
  constexpr int STEP = NG * U;               // keys per block per step
  extern __shared__ __align__(16) float dec_smem[];
  float* sm_o = dec_smem;                    // [NG][G][HD] scaled partial outputs
  float* sm_m = sm_o + NG * G * HD;          // [NG][G]
  float* sm_l = sm_m + NG * G;               // [NG][G]
  float* sm_ml = sm_l + NG * G;              // [G][2]: the block's (max, sum) per head

  const int tid = threadIdx.x, sub = tid % TPK, grp = tid / TPK;
  const int g = n_heads / n_kv_heads;
  const int n_chunks = (g + G - 1) / G;
  const int kvh = blockIdx.y / n_chunks, h0 = (blockIdx.y % n_chunks) * G;
  const int split = blockIdx.x;
  const SeqDesc s = seqs[blockIdx.z];
  if (s.n_new <= 0) return;  // a session with no row this round (uniform over the block)
  const int pos = s.n_past + s.n_new - 1;  // the decode row's position (n_new == 1)
  const i64 row = s.start + s.n_new - 1;
  const int lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int hi = pos + 1;
  const int a = lo + split * split_len;
  const int b = split == n_splits - 1 ? hi : min(hi, a + split_len);

  if (a >= b) {  // past this session's keys (only ever a split > 0): an empty partial
    if (tid < G && h0 + tid < g) {
      const i64 at = ((i64)split * n_rows + row) * n_heads + kvh * g + h0 + tid;
      part_ml[at * 2] = -EAGERLM_INF;
      part_ml[at * 2 + 1] = 0.0f;
    }
    return;
  }

  // This thread's 8 dims of each query, times scale * log2(e); zeros past the group.
  float qf[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h0 + h < g) {
      const __nv_bfloat162* qp = reinterpret_cast<const __nv_bfloat162*>(
          q + (row * n_heads + kvh * g + h0 + h) * HD + sub * 8);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(qp[i]);
        qf[h][2 * i] = f.x * scale_log2;
        qf[h][2 * i + 1] = f.y * scale_log2;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[h][i] = 0.0f;
    }
  }

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -EAGERLM_INF;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }

  const unsigned char* kv = reinterpret_cast<const unsigned char*>(s.kv_base);
  const unsigned char* k_src = kv + k_off + (i64)kvh * HD * 2 + sub * 16;
  const unsigned char* v_src = kv + v_off + (i64)kvh * HD * 2 + sub * 16;

  for (int t0 = a; t0 < b; t0 += STEP) {  // trip count uniform over the block
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int key = t0 + u * NG + grp;
      if (key < b) {
        kr[u] = __ldg(reinterpret_cast<const uint4*>(k_src + (i64)key * token_bytes));
        vr[u] = __ldg(reinterpret_cast<const uint4*>(v_src + (i64)key * token_bytes));
      } else {  // never read memory past the session's keys (may be unmapped)
        kr[u] = make_uint4(0u, 0u, 0u, 0u);
        vr[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }

    float sc[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      dec_unpack(kr[u], kf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(qf[h][i], kf[i], d);
        sc[u][h] = d;
      }
    }
#pragma unroll
    for (int o = TPK / 2; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < G; ++h) sc[u][h] += __shfl_xor_sync(FULL_MASK, sc[u][h], o);

    float p[U][G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float mx = m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (t0 + u * NG + grp >= b) sc[u][h] = -EAGERLM_INF;
        mx = fmaxf(mx, sc[u][h]);
      }
      if (mx == -EAGERLM_INF) {  // this group has seen no key yet (uniform over the group)
#pragma unroll
        for (int u = 0; u < U; ++u) p[u][h] = 0.0f;
        continue;
      }
      const float corr = exp2f(m[h] - mx);  // 0 when m was -inf
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        p[u][h] = exp2f(sc[u][h] - mx);  // 0 for masked keys
        sum += p[u][h];
      }
      l[h] = l[h] * corr + sum;
      m[h] = mx;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      dec_unpack(vr[u], vf);
#pragma unroll
      for (int h = 0; h < G; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(p[u][h], vf[i], acc[h][i]);
    }
  }

  // Merge the groups: M = max_grp m, L = sum_grp l 2^(m - M), O = sum_grp acc 2^(m - M).
  if (sub == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      sm_m[grp * G + h] = m[h];
      sm_l[grp * G + h] = l[h];
    }
  }
  __syncthreads();
  if (tid < G) {
    float mx = -EAGERLM_INF;
    for (int j = 0; j < NG; ++j) mx = fmaxf(mx, sm_m[j * G + tid]);
    float sum = 0.0f;
    for (int j = 0; j < NG; ++j) {
      const float mj = sm_m[j * G + tid];
      if (mj != -EAGERLM_INF) sum += sm_l[j * G + tid] * exp2f(mj - mx);
    }
    sm_ml[tid * 2] = mx;  // finite: the range [a, b) is not empty
    sm_ml[tid * 2 + 1] = sum;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float w = m[h] == -EAGERLM_INF ? 0.0f : exp2f(m[h] - sm_ml[h * 2]);
    float4* dst = reinterpret_cast<float4*>(sm_o + (grp * G + h) * HD + sub * 8);
    dst[0] = make_float4(acc[h][0] * w, acc[h][1] * w, acc[h][2] * w, acc[h][3] * w);
    dst[1] = make_float4(acc[h][4] * w, acc[h][5] * w, acc[h][6] * w, acc[h][7] * w);
  }
  __syncthreads();
  for (int e = tid; e < G * HD; e += DEC_THREADS) {
    const int h = e / HD, d = e - h * HD;
    if (h0 + h >= g) break;  // e only grows: every later element is past the group too
    float o = 0.0f;
#pragma unroll 4
    for (int j = 0; j < NG; ++j) o += sm_o[j * G * HD + e];
    const i64 head = kvh * g + h0 + h;
    if (n_splits == 1) {  // a sink joins the denominator (attention.cu says how)
      float sum = sm_ml[h * 2 + 1];
      if (sinks != nullptr) sum += exp2f(sinks[head] * LOG2E - sm_ml[h * 2]);
      out[(row * n_heads + head) * HD + d] = from_f32<bf16>(sum > 0.0f ? o / sum : 0.0f);
    } else {
      const i64 at = ((i64)split * n_rows + row) * n_heads + head;
      part_o[at * HD + d] = o;
      if (d == 0) {
        part_ml[at * 2] = sm_ml[h * 2];
        part_ml[at * 2 + 1] = sm_ml[h * 2 + 1];
      }
    }
  }
}

#define ATTENTION_DECODE_KERNEL(HD, G)                                                      \
  extern "C" __global__ void __launch_bounds__(DEC_THREADS) attention_decode_hd##HD##_g##G( \
      bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,      \
      const bf16* __restrict__ q, const SeqDesc* __restrict__ seqs, i64 k_off, i64 v_off,   \
      i64 token_bytes, int n_heads, int n_kv_heads, float scale_log2, int window,           \
      int n_splits, int split_len, int n_rows, const float* __restrict__ sinks) {           \
    attention_decode_impl<HD, G>(out, part_o, part_ml, q, seqs, k_off, v_off, token_bytes,  \
                                 n_heads, n_kv_heads, scale_log2, window, n_splits,         \
                                 split_len, n_rows, sinks);                                 \
  }

ATTENTION_DECODE_KERNEL(32, 1)
ATTENTION_DECODE_KERNEL(32, 2)
ATTENTION_DECODE_KERNEL(32, 4)
ATTENTION_DECODE_KERNEL(32, 8)
ATTENTION_DECODE_KERNEL(64, 1)
ATTENTION_DECODE_KERNEL(64, 2)
ATTENTION_DECODE_KERNEL(64, 4)
ATTENTION_DECODE_KERNEL(64, 8)
ATTENTION_DECODE_KERNEL(128, 1)
ATTENTION_DECODE_KERNEL(128, 2)
ATTENTION_DECODE_KERNEL(128, 4)
ATTENTION_DECODE_KERNEL(128, 8)
ATTENTION_DECODE_KERNEL(256, 1)
ATTENTION_DECODE_KERNEL(256, 2)
ATTENTION_DECODE_KERNEL(256, 4)
ATTENTION_DECODE_KERNEL(256, 8)
