// Token sampling on the device: one block per row of logits, reproducing kernels/sampling.py.
//
// Greedy: the argmax, ties to the lower id. Otherwise the llama.cpp chain of the reference:
// top-k -> top-p -> min-p on the model's own distribution, then temperature on the
// survivors and a draw with the counter-based uniform
//     bits = mix64(mix64(seed) + (position + 1) * 0x9E3779B97F4A7C15)
//     u    = (bits >> 11) * 2^-53
// (splitmix64's finaliser; bit-exact with sampling.draw_uniform), so a token depends only
// on its row's logits, seed and position, never on the rest of the batch.
//
// No sort. Tokens are ordered by (logit descending, id ascending) through a 64-bit key
// (the float's order-preserving bits, then the id); top-k and top-p each become a
// threshold in that order, found by a 4-pass radix select over the float bits (8 bits per
// pass, MSB first, histograms in shared memory) and a final pass that resolves ties at the
// threshold value by id. top-k selects by count, top-p by probability mass.
//
// Probability mass is fixed point: w = round(exp(logit - max) * 2^40) as an integer, so
// every sum is exact and independent of summation order (atomics included): the kernel is
// deterministic, and a row gives the same token whatever else runs. Differences from the
// float64 reference: weights come from float32 expf and are quantised to 2^-40, so the kept
// set or the drawn token can differ only when a cumulative sum lies within about 1e-7
// (relative) of the top-p target or of u * total.
//
// The logit bias and penalties (penalize_rows, with token counts kept on the device by
// count_tokens) run before sampling, into a copy of the logits; logprobs (token_logprobs)
// after it, from the raw logits, as kernels/sampling.py defines both.
//
// A row whose logits hold NaN (or, when not greedy, have no finite maximum) gets token -1:
// the reference raises there; the device reports it in-band for the host to fail the
// request (the embedding turns -1 into a NaN row rather than reading out of bounds).
#include "common.cuh"

constexpr int SMP_THREADS = 1024;
constexpr int SMP_WARPS = SMP_THREADS / 32;
constexpr double FX_ONE = 1099511627776.0;  // 2^40
constexpr int NO_ID = 0x7fffffff;

// Mirrors SAMPLE_PARAMS in kernels/cuda_sampling.py (32 bytes).
struct SampleParams {
  float temperature;  // 0 = greedy
  int top_k;          // 0 = off
  float top_p;        // 1 = off
  float min_p;        // 0 = off
  u64 seed;
  i64 position;       // the counter of this draw
};
static_assert(sizeof(SampleParams) == 32, "must match SAMPLE_PARAMS in kernels/cuda_sampling.py");

struct SamplerShared {
  u64 hist[256];
  u64 scan[SMP_WARPS];
  double dsum[SMP_WARPS];
  float best[SMP_WARPS];
  int best_id[SMP_WARPS];
  int digit;
  u64 above;
  int found;
  int last;
};

// The position of a token in (logit descending) order as an unsigned key: larger is first.
// -0.0 takes +0.0's key: the two compare equal, so the reference breaks their tie by id.
__device__ __forceinline__ unsigned order_key(float x) {
  const unsigned raw = __float_as_uint(x);
  const unsigned b = (raw << 1) == 0u ? 0u : raw;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A threshold in (key descending, id ascending) order: tokens at or before it pass.
struct Cut {
  unsigned key;
  int id;
};
__device__ __forceinline__ bool passes(unsigned key, int id, Cut c) {
  return key > c.key || (key == c.key && id <= c.id);
}
__device__ __forceinline__ Cut everything() { return Cut{0u, NO_ID}; }

__device__ __forceinline__ u64 fixed_point(float w) {
  return (u64)__double2ull_rn((double)w * FX_ONE);
}

// Block-wide argmax (ties to the lower id): every thread ends with the block's result.
__device__ __forceinline__ void block_argmax(float& best, int& best_id, SamplerShared& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_argmax(best, best_id);
  __syncthreads();  // sm.best may still be read from a previous call
  if (lane == 0) {
    sm.best[warp] = best;
    sm.best_id[warp] = best_id;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < SMP_WARPS ? sm.best[lane] : -EAGERLM_INF;
    best_id = lane < SMP_WARPS ? sm.best_id[lane] : NO_ID;
    warp_argmax(best, best_id);
    if (lane == 0) {
      sm.best[0] = best;
      sm.best_id[0] = best_id;
    }
  }
  __syncthreads();
  best = sm.best[0];
  best_id = sm.best_id[0];
}

__device__ __forceinline__ u64 mix64(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Add `mass` to hist[digit] for the active lanes of a warp, one atomic per distinct digit.
// Every lane of the warp must call it. mass <= 2^40, so 20-bit halves sum without overflow
// over 32 lanes.
__device__ __forceinline__ void hist_add(u64* hist, bool act, unsigned digit, u64 mass) {
  const unsigned active = __ballot_sync(FULL_MASK, act);
  if (!act) return;
  const unsigned peers = __match_any_sync(active, digit);
  const unsigned lo = __reduce_add_sync(peers, (unsigned)(mass & 0xFFFFFull));
  const unsigned hi = __reduce_add_sync(peers, (unsigned)(mass >> 20));
  if ((int)(threadIdx.x & 31) == __ffs(peers) - 1)
    atomicAdd(&hist[digit], ((u64)hi << 20) + (u64)lo);
}

// Exclusive prefix sum over the block in thread order; *total gets the block's sum.
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, SamplerShared& sm, u64* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u64 x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) sm.scan[warp] = x;
  __syncthreads();
  if (warp == 0) {
    u64 t = lane < SMP_WARPS ? sm.scan[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 y = __shfl_up_sync(FULL_MASK, t, o);
      if (lane >= o) t += y;
    }
    if (lane < SMP_WARPS) sm.scan[lane] = t;
  }
  __syncthreads();
  const u64 before = warp > 0 ? sm.scan[warp - 1] : 0;
  *total = sm.scan[SMP_WARPS - 1];
  return before + x - v;
}

// The mass of token i for a selection: 1 (count, for top-k) or its fixed-point probability
// weight exp(logit - max) (for top-p).
template <bool WEIGHT>
__device__ __forceinline__ u64 mass_of(float logit, float mx) {
  if constexpr (WEIGHT) return fixed_point(expf(logit - mx));
  return 1;
}

// The first token, in (logit desc, id asc) order among those passing `filter`, at which
// the running mass reaches `target`. The target is always reachable (callers clamp it to
// the filter's total), but an unreachable one keeps everything, as the reference does.
template <bool WEIGHT>
__device__ Cut select_cut(const float* __restrict__ row, int vocab, float mx, Cut filter,
                          u64 target, SamplerShared& sm) {
  const int tid = threadIdx.x;
  unsigned prefix = 0, pmask = 0;
  u64 above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += blockDim.x) sm.hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < vocab; base += blockDim.x) {
      const int i = base + tid;
      bool act = false;
      unsigned digit = 0;
      u64 mass = 0;
      if (i < vocab) {
        const float x = row[i];
        const unsigned key = order_key(x);
        if (passes(key, i, filter) && (key & pmask) == prefix) {
          act = true;
          digit = (key >> shift) & 0xFFu;
          mass = mass_of<WEIGHT>(x, mx);
        }
      }
      hist_add(sm.hist, act, digit, mass);
    }
    __syncthreads();
    if (tid == 0) {
      int chosen = -1, last = -1;
      u64 acc = above;
      for (int d = 255; d >= 0; --d) {
        const u64 h = sm.hist[d];
        if (h == 0) continue;
        last = d;
        if (acc + h >= target) {
          chosen = d;
          break;
        }
        acc += h;
      }
      if (chosen < 0) {  // unreachable: keep down to the smallest bucket
        chosen = last < 0 ? 0 : last;
        if (last >= 0) acc -= sm.hist[last];
      }
      sm.digit = chosen;
      sm.above = acc;
    }
    __syncthreads();
    prefix |= (unsigned)sm.digit << shift;
    pmask |= 0xFFu << shift;
    above = sm.above;
  }

  // Ties at the threshold value, in id order: each thread owns a contiguous run of ids.
  const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int lo = min(vocab, tid * chunk), hi = min(vocab, lo + chunk);
  u64 sum = 0;
  int last_tie = -1;
  for (int i = lo; i < hi; ++i) {
    const float x = row[i];
    const unsigned key = order_key(x);
    if (key == prefix && passes(key, i, filter)) {
      sum += mass_of<WEIGHT>(x, mx);
      last_tie = i;
    }
  }
  if (tid == 0) {
    sm.found = -1;
    sm.last = -1;
  }
  u64 total;
  const u64 before = above + block_exclusive_scan(sum, sm, &total);  // synchronizes
  if (last_tie >= 0) atomicMax(&sm.last, last_tie);
  if (before < target && before + sum >= target) {
    u64 acc = before;
    for (int i = lo; i < hi; ++i) {
      const float x = row[i];
      const unsigned key = order_key(x);
      if (key == prefix && passes(key, i, filter)) {
        acc += mass_of<WEIGHT>(x, mx);
        if (acc >= target) {
          sm.found = i;
          break;
        }
      }
    }
  }
  __syncthreads();
  const int id = sm.found >= 0 ? sm.found : sm.last;
  __syncthreads();
  return Cut{prefix, id < 0 ? NO_ID : id};
}

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    sample_rows(int* __restrict__ out, int* __restrict__ token_buf,
                const int* __restrict__ out_slots, const float* __restrict__ logits, int vocab,
                i64 ld, const SampleParams* __restrict__ params) {
  __shared__ SamplerShared sm;
  const int tid = threadIdx.x;
  const float* row = logits + (i64)blockIdx.x * ld;
  const SampleParams p = params[blockIdx.x];

  // 1. max and argmax (ties to the lower id), and whether the row holds a NaN.
  float best = -EAGERLM_INF;
  int best_id = NO_ID;
  bool nan = false;
  for (int i = tid; i < vocab; i += blockDim.x) {
    const float x = row[i];
    if (isnan(x)) nan = true;
    else if (x > best || (x == best && i < best_id)) {
      best = x;
      best_id = i;
    }
  }
  nan = __syncthreads_or(nan);
  block_argmax(best, best_id, sm);
  const float mx = best;
  int token = best_id;

  if (nan) {
    token = -1;
  } else if (p.temperature > 0.0f) {
    if (isinf(mx)) {  // +inf, or every logit -inf: no distribution
      token = -1;
    } else {
      // 2. top-k, then top-p over the survivors, then min-p.
      Cut k_cut = everything(), p_cut = everything();
      if (p.top_k > 0 && p.top_k < vocab) k_cut = select_cut<false>(row, vocab, mx, everything(),
                                                                    (u64)p.top_k, sm);
      if (p.top_p < 1.0f) {
        u64 part = 0;
        for (int i = tid; i < vocab; i += blockDim.x) {
          const float x = row[i];
          if (passes(order_key(x), i, k_cut)) part += fixed_point(expf(x - mx));
        }
        u64 total;
        block_exclusive_scan(part, sm, &total);
        u64 target = (u64)ceil((double)p.top_p * (double)total);
        target = max((u64)1, min(target, total));
        p_cut = select_cut<true>(row, vocab, mx, k_cut, target, sm);
      }
      const double min_logit = p.min_p > 0.0f ? (double)mx + log((double)p.min_p)
                                              : -(double)EAGERLM_INF;

      // 3. temperature on the survivors and the draw, in id order.
      const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
      const int lo = min(vocab, tid * chunk), hi = min(vocab, lo + chunk);
      // A subnormal temperature makes 1 / T infinite and (mx - mx) * inf NaN: clamp to the
      // largest float, which still sends every other weight to 0 as the reference does.
      const float inv_t = fminf(1.0f / p.temperature, __int_as_float(0x7f7fffff));
      u64 sum = 0;
      int last_nonzero = -1;
      for (int i = lo; i < hi; ++i) {
        const float x = row[i];
        const unsigned key = order_key(x);
        if (passes(key, i, k_cut) && passes(key, i, p_cut) && (double)x >= min_logit) {
          const u64 w = fixed_point(expf((x - mx) * inv_t));
          sum += w;
          if (w) last_nonzero = i;
        }
      }
      if (tid == 0) {
        sm.found = -1;
        sm.last = -1;
      }
      u64 total;
      const u64 before = block_exclusive_scan(sum, sm, &total);
      if (last_nonzero >= 0) atomicMax(&sm.last, last_nonzero);
      const u64 bits = mix64(mix64(p.seed) + (u64)(p.position + 1) * 0x9E3779B97F4A7C15ull);
      const double u = (double)(bits >> 11) * 0x1.0p-53;
      // first token whose running sum exceeds u * total (sampling.py's searchsorted right);
      // in integers: running sum > floor(u * total)
      u64 target = (u64)(u * (double)total);
      if (total > 0 && target >= total) target = total - 1;
      if (before <= target && target < before + sum) {
        u64 acc = before;
        for (int i = lo; i < hi; ++i) {
          const float x = row[i];
          const unsigned key = order_key(x);
          if (passes(key, i, k_cut) && passes(key, i, p_cut) && (double)x >= min_logit) {
            acc += fixed_point(expf((x - mx) * inv_t));
            if (acc > target) {
              sm.found = i;
              break;
            }
          }
        }
      }
      __syncthreads();
      token = sm.found >= 0 ? sm.found : sm.last;
    }
  }
  if (tid == 0) {
    out[blockIdx.x] = token;
    if (out_slots != nullptr && out_slots[blockIdx.x] >= 0) token_buf[out_slots[blockIdx.x]] = token;
  }
}

// -- penalties ---------------------------------------------------------------------------

// Mirrors PENALTY_ROW in kernels/cuda_sampling.py (32 bytes): one row of logits' logit bias and
// penalties.
struct PenaltyRow {
  const int* counts;   // [2, vocab]: prompt counts, then output counts; null = no penalties
  const float* bias;   // [vocab]: the request's logit bias; null = none
  float repetition;    // 1 = off
  float presence;      // 0 = off
  float frequency;     // 0 = off
  int pad_;
};
static_assert(sizeof(PenaltyRow) == 32, "must match PENALTY_ROW in kernels/cuda_sampling.py");

// out = the logits with each row's logit bias and penalties applied (sampling.adjust_logits,
// to the bit): the bias is added first, in float32; then repetition divides a seen token's
// positive logit and multiplies a negative one, in float32; frequency subtracts penalty *
// count in float64 (numpy promotes the int32 counts there), presence subtracts the penalty
// once in float32. Rows with neither are copied. Grid: (blocks over the vocabulary, rows).
extern "C" __global__ void penalize_rows(float* __restrict__ out, const float* __restrict__ logits,
                                         int vocab, const PenaltyRow* __restrict__ rows) {
  const PenaltyRow p = rows[blockIdx.y];
  const float* in = logits + (i64)blockIdx.y * vocab;
  float* o = out + (i64)blockIdx.y * vocab;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x) {
    float x = in[i];
    if (p.bias != nullptr) x += p.bias[i];
    if (p.counts != nullptr) {
      const int seen = p.counts[i] + p.counts[vocab + i], output = p.counts[vocab + i];
      if (p.repetition != 1.0f && seen > 0) x = x > 0.0f ? x / p.repetition : x * p.repetition;
      if (p.frequency != 0.0f) x = (float)((double)x - (double)p.frequency * (double)output);
      if (p.presence != 0.0f && output > 0) x = x - p.presence;
    }
    o[i] = x;
  }
}

// out = the logits with every token a row's allowed-token bitmask does not allow set to
// -inf (sampling.apply_token_mask; constrained decoding): bit t % 32 of word t / 32 of the
// row's mask, `masks + which[row] * words`; a row whose `which` is -1 is copied unchanged.
// Tokens past the mask's words are not allowed. `out` may be `logits` (in place, on the
// copy penalize_rows made). Grid: (blocks over the vocabulary, rows).
extern "C" __global__ void mask_rows(float* __restrict__ out, const float* __restrict__ logits,
                                     int vocab, const unsigned* __restrict__ masks, int words,
                                     const int* __restrict__ which) {
  const int m = which[blockIdx.y];
  const float* in = logits + (i64)blockIdx.y * vocab;
  float* o = out + (i64)blockIdx.y * vocab;
  const unsigned* mask = m >= 0 ? masks + (i64)m * words : nullptr;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x) {
    const bool allowed = mask == nullptr || (i / 32 < words && ((mask[i / 32] >> (i % 32)) & 1u));
    o[i] = allowed ? in[i] : -EAGERLM_INF;
  }
}

// Mirrors COUNT_SPAN in kernels/cuda_sampling.py (24 bytes): rows [start, start + n) of a
// round's inputs belong to one penalized session; those before `split` are still its prompt.
struct CountSpan {
  int* counts;  // [2, vocab], as PenaltyRow's; null = nothing to count
  int start;
  int n;
  int split;
  int pad_;
};
static_assert(sizeof(CountSpan) == 24, "must match COUNT_SPAN in kernels/cuda_sampling.py");

// Adds a round's input tokens to their sessions' counts: one block per span. A row's id is
// its metadata's host id or, when its slot is >= 0, the token buffer's entry there (what
// the embedding reads: DeviceIds). Ids outside the vocabulary (a failed sample's -1) are
// not counted.
extern "C" __global__ void count_tokens(const CountSpan* __restrict__ spans,
                                        const int* __restrict__ rows, int stride,
                                        const int* __restrict__ token_buf, int vocab) {
  const CountSpan s = spans[blockIdx.x];
  if (s.counts == nullptr) return;  // a session without penalties (in a graph's table)
  for (int r = threadIdx.x; r < s.n; r += blockDim.x) {
    const int* m = rows + (i64)(s.start + r) * stride;
    const int id = m[1] >= 0 ? token_buf[m[1]] : m[0];
    if (id >= 0 && id < vocab) atomicAdd(&s.counts[(r >= s.split ? vocab : 0) + id], 1);
  }
}

// -- logprobs ----------------------------------------------------------------------------

__device__ __forceinline__ double block_sum_f64(double v, SamplerShared& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  __syncthreads();
  if (lane == 0) sm.dsum[warp] = v;
  __syncthreads();
  v = 0.0;
  for (int w = 0; w < SMP_WARPS; ++w) v += sm.dsum[w];  // same order in every thread
  return v;
}

// The sampled token's log-probability and the `want[row]` most likely tokens' (none when
// want < 0), under the model's distribution: log-softmax of the raw logits in float64, as
// sampling.token_logprob computes it. values [rows, 1 + max_top]: the token's, then the top
// ones' (logit desc, id asc); top_ids [rows, max_top]. A failed sample (-1) gets NaN.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    token_logprobs(float* __restrict__ values, int* __restrict__ top_ids,
                   const float* __restrict__ logits, int vocab, i64 ld,
                   const int* __restrict__ tokens, const int* __restrict__ want, int max_top) {
  __shared__ SamplerShared sm;
  const int n_top = want[blockIdx.x];
  if (n_top < 0) return;  // the whole block leaves
  const int tid = threadIdx.x;
  const float* row = logits + (i64)blockIdx.x * ld;
  float* v = values + (i64)blockIdx.x * (1 + max_top);
  int* ids = top_ids + (i64)blockIdx.x * max_top;

  float best = -EAGERLM_INF;
  int best_id = NO_ID;
  for (int i = tid; i < vocab; i += blockDim.x) {
    const float x = row[i];
    if (x > best || (x == best && i < best_id)) {
      best = x;
      best_id = i;
    }
  }
  block_argmax(best, best_id, sm);
  const double mx = (double)best;
  double part = 0.0;
  for (int i = tid; i < vocab; i += blockDim.x) part += exp((double)row[i] - mx);
  const double log_sum = log(block_sum_f64(part, sm));
  if (tid == 0) {
    const int token = tokens[blockIdx.x];
    v[0] = token >= 0 && token < vocab ? (float)(((double)row[token] - mx) - log_sum)
                                       : EAGERLM_NAN;
  }

  // The top n_top, one block argmax each, over the tokens after the previous pick in
  // (logit desc, id asc) order. NaN logits are never picked.
  Cut prev = Cut{0xFFFFFFFFu, -1};  // nothing picked yet: every token comes after it
  for (int j = 0; j < n_top; ++j) {
    best = -EAGERLM_INF;
    best_id = NO_ID;
    for (int i = tid; i < vocab; i += blockDim.x) {
      const float x = row[i];
      if (isnan(x) || passes(order_key(x), i, prev)) continue;
      if (best_id == NO_ID || x > best || (x == best && i < best_id)) {
        best = x;
        best_id = i;
      }
    }
    block_argmax(best, best_id, sm);
    if (tid == 0) {
      ids[j] = best_id == NO_ID ? -1 : best_id;
      v[1 + j] = best_id == NO_ID ? EAGERLM_NAN : (float)(((double)best - mx) - log_sum);
    }
    if (best_id == NO_ID) break;
    prev = Cut{order_key(best), best_id};
  }
}
