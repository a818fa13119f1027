// Speculative decoding's device steps (kernels/speculative.py is the reference and says
// why): the prompt-lookup proposal over each speculating session's history, the acceptance
// of the longest run of samples equal to the drafts, and what lets a round run with
// positions only the device knows: the sessions' descriptors and row positions fixed from
// their device-side lengths, the sampler's draw positions likewise. Also the draft model's
// inputs and its greedy proposals.
//
// A speculating session's state, per token-buffer slot: lengths[slot] (positions holding
// accepted KV), history[slot * hist_stride + p] (its token at position p), and a round's
// proposal at proposals[slot * prop_stride]: the count, then the tokens.
#include "common.cuh"

// Mirrors SPEC_ENTRY in kernels/cuda_speculative.py (kernels/speculative.py's SpecSeq). An
// entry whose slot is -1 is padding (a captured graph's table is as long as its bucket):
// every kernel skips it.
struct SpecEntry {
  int slot;
  int start;    // its first row in the round
  int k;        // draft rows after it
  int propose;  // tokens to propose (k; 1 for a shadow proposal; 0 none)
  int past;     // its first row's position, or -1: lengths[slot]
  int out;      // its first sample in the round's output
  int lookup;   // 1: proposed by prompt lookup here; 0: by the draft model
  int pad_;
};
static_assert(sizeof(SpecEntry) == 32, "must match SPEC_ENTRY in kernels/cuda_speculative.py");

constexpr int SPEC_THREADS = 256;

// One block per entry: its first position (into firsts[slot]) and, for a prompt-lookup
// entry, its proposal: the tokens after the most recent earlier occurrence of the longest
// suffix of n_max down to n_min tokens, copied through their own end; written to its
// proposal and its draft rows' host-id column of the round's metadata (filler 0 past it).
extern "C" __global__ void __launch_bounds__(SPEC_THREADS)
    spec_prepare(const SpecEntry* __restrict__ entries, int* __restrict__ rows,
                 const int* __restrict__ lengths, const int* __restrict__ history,
                 int hist_stride, int* __restrict__ proposals, int prop_stride,
                 int* __restrict__ firsts, int n_min, int n_max) {
  __shared__ int best;
  const SpecEntry e = entries[blockIdx.x];
  if (e.slot < 0) return;  // a padding entry (a graph's table): the whole block leaves
  const int tid = threadIdx.x;
  const int first = e.past >= 0 ? e.past : lengths[e.slot];
  const int* h = history + (i64)e.slot * hist_stride;
  int* prop = proposals + (i64)e.slot * prop_stride;
  const int size = first + 1;
  int found = -1, n_found = 0;
  if (e.lookup && e.propose > 0) {
    for (int n = min(n_max, size - 1); n >= n_min && found < 0; --n) {
      if (tid == 0) best = -1;
      __syncthreads();
      // windows starting at p = 0 .. size - n - 1: each has a token after it
      for (int p = tid; p <= size - n - 1; p += blockDim.x) {
        bool same = true;
        for (int j = 0; j < n && same; ++j) same = h[p + j] == h[size - n + j];
        if (same) atomicMax(&best, p);
      }
      __syncthreads();
      if (best >= 0) {
        found = best + n;  // the first token copied
        n_found = e.propose;
      }
      __syncthreads();  // best is reset by the next n
    }
  }
  const int period = size - found;
  for (int i = tid; i < max(n_found, e.k); i += blockDim.x) {
    const int token = i < n_found ? h[found + i % period] : 0;
    if (i < n_found) prop[1 + i] = token;
    if (i < e.k) {
      rows[2 * (i64)(e.start + 1 + i)] = token;
      rows[2 * (i64)(e.start + 1 + i) + 1] = -1;
    }
  }
  if (tid == 0) {
    firsts[e.slot] = first;
    prop[0] = n_found;
  }
}

// One thread per entry: the accepted run of its samples out[e.out ..] against its
// proposal, its count (out[counts_at + entry]) and statistics (out[stats_at + 3 entry]:
// proposals checked, accepted, shadow match 1 / 0 / -1 none), its new length, history and
// next input (token_buf[slot]).
extern "C" __global__ void spec_accept(const SpecEntry* __restrict__ entries, int n,
                                       int* __restrict__ out, int counts_at, int stats_at,
                                       int* __restrict__ token_buf, int* __restrict__ lengths,
                                       int* __restrict__ history, int hist_stride,
                                       const int* __restrict__ proposals, int prop_stride,
                                       const int* __restrict__ firsts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const SpecEntry e = entries[i];
  if (e.slot < 0) return;  // a padding entry
  const int first = firsts[e.slot];
  const int* x = out + e.out;
  const int* prop = proposals + (i64)e.slot * prop_stride;
  const int m = prop[0];
  const int checked = min(m, e.k);
  int a = 0;
  while (a < checked && x[a] == prop[1 + a]) ++a;
  const int shadow = (e.k > 0 || m == 0) ? -1 : (x[0] == prop[1] ? 1 : 0);
  int* h = history + (i64)e.slot * hist_stride;
  for (int j = 0; j <= a; ++j) h[first + 1 + j] = x[j];
  lengths[e.slot] = first + a + 1;
  token_buf[e.slot] = x[a];
  out[counts_at + i] = a + 1;
  out[stats_at + 3 * i] = checked;
  out[stats_at + 3 * i + 1] = a;
  out[stats_at + 3 * i + 2] = shadow;
}

// One block: sessions whose position only the device knows get it in their descriptor
// (past_of[2 s] is a slot, or -1 for a session the host placed: n_past =
// firsts[slot] + past_of[2 s + 1]), then every row its position (its session's n_past +
// its offset in the session).
extern "C" __global__ void __launch_bounds__(SPEC_THREADS)
    spec_positions(SeqDesc* __restrict__ seqs, const int* __restrict__ past_of,
                   const int* __restrict__ firsts, int n_seqs,
                   const int* __restrict__ row_seq, int n_rows, int* __restrict__ positions) {
  for (int s = threadIdx.x; s < n_seqs; s += blockDim.x) {
    const int slot = past_of[2 * s];
    if (slot >= 0) seqs[s].n_past = firsts[slot] + past_of[2 * s + 1];
  }
  __syncthreads();
  for (int r = threadIdx.x; r < n_rows; r += blockDim.x) {
    const SeqDesc d = seqs[row_seq[r]];
    positions[r] = d.n_past + (r - d.start);
  }
}

// The sampler's draw positions from the device's row positions: row i of the sampler's
// table (SAMPLE_PARAMS, 32 bytes, the int64 position at byte 24) draws at the position of
// the token its logits row predicts, positions[logit_rows[i]] + 1.
extern "C" __global__ void spec_draw_positions(unsigned char* __restrict__ table,
                                               const int* __restrict__ positions,
                                               const i64* __restrict__ logit_rows, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) *(i64*)(table + 32 * (i64)i + 24) = (i64)positions[logit_rows[i]] + 1;
}

// The draft model's input rows ([host id, -1] pairs, DeviceIds' layout) at `step`: at 0,
// per entry the tokens at its first position and the one before; at j > 0, per entry its
// draft row j of the round's metadata (the proposal the step before made).
extern "C" __global__ void draft_rows(const SpecEntry* __restrict__ entries, int n,
                                      const int* __restrict__ firsts,
                                      const int* __restrict__ history, int hist_stride,
                                      const int* __restrict__ meta_rows, int step,
                                      int* __restrict__ rows_out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const SpecEntry e = entries[i];
  if (step == 0) {
    const int* h = history + (i64)e.slot * hist_stride + firsts[e.slot];
    rows_out[4 * i] = h[-1];
    rows_out[4 * i + 1] = -1;
    rows_out[4 * i + 2] = h[0];
    rows_out[4 * i + 3] = -1;
  } else {
    rows_out[2 * i] = meta_rows[2 * (i64)(e.start + step)];
    rows_out[2 * i + 1] = -1;
  }
}

// One block per logits row: the draft model's greedy proposal at `step` for entry
// `blockIdx.x` (argmax, ties to the lower id), into its proposal and, if it has one, its
// draft row step + 1 of the round's metadata.
extern "C" __global__ void __launch_bounds__(SPEC_THREADS)
    draft_argmax(const float* __restrict__ logits, int vocab,
                 const SpecEntry* __restrict__ entries, int step,
                 int* __restrict__ proposals, int prop_stride, int* __restrict__ meta_rows) {
  __shared__ float best_v[SPEC_THREADS / 32];
  __shared__ int best_i[SPEC_THREADS / 32];
  const float* row = logits + (i64)blockIdx.x * vocab;
  float v = -EAGERLM_INF;
  int id = 0x7fffffff;
  for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
    const float x = row[t];
    if (x > v || (x == v && t < id)) {
      v = x;
      id = t;
    }
  }
  warp_argmax(v, id);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
      if (best_v[w] > v || (best_v[w] == v && best_i[w] < id)) {
        v = best_v[w];
        id = best_i[w];
      }
    const SpecEntry e = entries[blockIdx.x];
    if (id == 0x7fffffff) id = 0;  // a row of NaN: any proposal will do, it is verified
    int* prop = proposals + (i64)e.slot * prop_stride;
    prop[1 + step] = id;
    prop[0] = step + 1;
    if (e.k > step) {
      meta_rows[2 * (i64)(e.start + 1 + step)] = id;
      meta_rows[2 * (i64)(e.start + 1 + step) + 1] = -1;
    }
  }
}
