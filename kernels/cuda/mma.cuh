// Inline-PTX wrappers for tensor-core kernels (sm_80+): mma.sync m16n8k16 bf16 -> f32,
// ldmatrix, cp.async and ex2.approx, plus host versions of each for the emulator.
//
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// groupID = lane >> 2 and tig (threadID_in_group) = lane & 3; each 32-bit register holds two
// bf16, the lower-numbered element in the low half:
//   A, 16x16 row-major, a0..a7 in a[0..3]:  row = groupID       for a0,a1,a4,a5
//                                                 groupID + 8   for a2,a3,a6,a7
//                                           col = tig*2 + (i&1)      for i < 4
//                                                 tig*2 + (i&1) + 8  for i >= 4
//   B, 16x8 "col" (k x n), b0..b3 in b[0..1]:  k = tig*2 + (i&1) (+8 for i >= 2), n = groupID
//   C/D, 16x8 f32, c0..c3:  row = groupID (c0,c1) / groupID + 8 (c2,c3), col = tig*2 + (i&1)
//
// ldmatrix.m8n8.x4.b16: lanes 8m..8m+7 give the row addresses (16 bytes each, 16-byte
// aligned) of matrix m; register m of lane L receives row L/4, columns 2(L%4), 2(L%4)+1 of
// matrix m, or with .trans, rows 2(L%4), 2(L%4)+1 of column L/4. So ldmatrix of a row-major
// tile gives A fragments and, of a tile whose rows are B's columns (K for Q.K^T), B
// fragments; .trans of a tile whose rows are B's rows (V for P.V) gives B fragments.
//
// Under EAGERLM_EMULATOR (tests/emulated_gpu/cuda_emulation/runtime.h) every wrapper is plain C++ with
// the same semantics: mma and ldmatrix gather the warp's operands with emu::warp_exchange
// (so a call from a diverged or partial warp is reported, as the hardware would misbehave),
// cp.async copies are queued per thread and performed only at cp.async.wait_group, and the
// shared-memory races around them that the emulator's schedule would hide (a read before
// the wait, a read of another thread's copy with no __syncthreads after its wait, a copy
// into memory another thread read since the last __syncthreads) are reported (see Chunk).
#pragma once

#include "common.cuh"

typedef unsigned int u32;

// Two floats as a bf16x2 register (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  u32 r;
  memcpy(&r, &v, 4);
  return r;
}

#ifndef EAGERLM_EMULATOR

__device__ __forceinline__ void mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2],
                                               const float c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
        "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory; `row` is this lane's row address (see above).
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}

// 16 bytes global -> shared without passing through registers; the first `src_bytes` (0 or
// 16) come from `src`, the rest is zero-filled (so rows past the end read nothing).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)),
               "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight. Other
// threads' copies are visible only after a __syncthreads that follows their wait.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 2^x with the MUFU unit (ex2.approx.ftz: 2 ulp, denormal results flush to zero).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

#else  // EAGERLM_EMULATOR: the same operations on the host

namespace emu_mma {

inline float bf16_bits_to_f32(u32 bits16) {
  return __uint_as_float((bits16 & 0xFFFFu) << 16);
}
inline u32 half_of(u32 reg, int hi) { return hi ? reg >> 16 : reg & 0xFFFFu; }

// Every lane's two 32-bit registers, gathered through one 8-byte warp exchange.
inline void gather2(u32 out[32][2], u32 lo, u32 hi) {
  const uint64_t* all = emu::warp_exchange((uint64_t)lo | ((uint64_t)hi << 32));
  for (int l = 0; l < 32; ++l) {
    out[l][0] = (u32)all[l];
    out[l][1] = (u32)(all[l] >> 32);
  }
}

// cp.async: per thread, the copies not yet performed, tagged with their commit group.
struct PendingCopy {
  void* dst;
  const void* src;
  int src_bytes;
  long group;
};
struct AsyncState {
  PendingCopy copies[256];
  int n = 0;
  long committed = 0;  // groups committed so far: the open group's number
};

// Race tracking over the dynamic shared memory, per 16-byte chunk. Fibers switch only at
// barriers and collectives, so the emulator's schedule alone would hide a missing
// __syncthreads around cp.async (every thread reaches its wait before any warp's next
// collective completes). Instead each thread counts the __syncthreads it has passed (its
// epoch; within a block all threads agree), and:
//  - ldmatrix of a chunk with a copy still in flight is a missing wait_group;
//  - ldmatrix of a chunk another thread's copy filled, in the epoch of that thread's wait
//    (no __syncthreads since), is a missing barrier after the wait;
//  - cp.async into a chunk another thread read in the current epoch is a missing barrier
//    before the copy (it may land while the reader still reads).
struct Chunk {
  int pending = -1;      // thread with a copy in flight to this chunk
  int writer = -1;       // thread whose copy filled it last
  long done_epoch = -1;  // the writer's epoch at its wait_group
  unsigned char bytes[16];  // what that copy wrote (a chunk rewritten since is not its data)
  int reader = -1;       // last reader thread, -2 for several in read_epoch
  long read_epoch = -1;
};

struct Tracker {
  AsyncState async[emu::kMaxThreads];
  long epoch[emu::kMaxThreads];
  Chunk* chunks = nullptr;
  size_t n_chunks = 0;
  // the block these states belong to
  uint3 block{~0u, ~0u, ~0u}, grid{0, 0, 0}, threads{0, 0, 0};
  const unsigned char* smem = nullptr;
};
inline Tracker tracker;

// The tracker for the running block, reset when a different block (or launch shape) runs.
inline Tracker& state() {
  Tracker& t = tracker;
  const uint3 b = blockIdx, g = make_uint3(gridDim.x, gridDim.y, gridDim.z),
              d = make_uint3(blockDim.x, blockDim.y, blockDim.z);
  const size_t n = emu::S.smem_size / 16;
  auto same = [](uint3 x, uint3 y) { return x.x == y.x && x.y == y.y && x.z == y.z; };
  if (!same(t.block, b) || !same(t.grid, g) || !same(t.threads, d) || t.smem != emu::S.smem ||
      t.n_chunks != n) {
    for (int i = 0; i < emu::kMaxThreads; ++i) {
      if (t.async[i].n > 0) emu::fail("cp.async: copies of a previous block were never waited for");
      t.async[i] = AsyncState();
      t.epoch[i] = 0;
    }
    delete[] t.chunks;
    t.chunks = n ? new Chunk[n] : nullptr;
    t.n_chunks = n;
    t.block = b, t.grid = g, t.threads = d, t.smem = emu::S.smem;
  }
  return t;
}

inline Chunk* chunk_at(Tracker& t, const void* p) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (!t.smem || c < t.smem || c >= t.smem + t.n_chunks * 16) return nullptr;  // not tracked
  return &t.chunks[(c - t.smem) / 16];
}

inline void note_read(const void* p) {
  Tracker& t = state();
  Chunk* c = chunk_at(t, p);
  if (!c) return;
  const int me = emu::linear_tid();
  const long e = t.epoch[me];
  if (c->pending == me)
    emu::fail("ldmatrix reads shared memory that this thread's cp.async is still writing "
              "(missing cp.async.wait_group)");
  else if (c->pending >= 0)
    emu::fail("ldmatrix reads shared memory that another thread's cp.async is still writing "
              "(missing wait_group, or no __syncthreads between that thread's wait and here)");
  else if (c->writer >= 0 && c->writer != me && c->done_epoch >= e &&
           memcmp(c->bytes, p, 16) == 0)
    emu::fail("ldmatrix reads another thread's cp.async data without a __syncthreads after "
              "that thread's cp.async.wait_group");
  c->reader = (c->read_epoch == e && c->reader != me) ? -2 : me;
  c->read_epoch = e;
}

inline void tracked_syncthreads() {
  emu::block_barrier(0);
  ++state().epoch[emu::linear_tid()];
}

}  // namespace emu_mma

// Count barriers for the race tracking above (kernels that include this header must use
// __syncthreads, not its _or/_and/_count forms, around cp.async).
#define __syncthreads() emu_mma::tracked_syncthreads()

inline void mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2], const float c[4]) {
  u32 a01[32][2], a23[32][2], bb[32][2];
  emu_mma::gather2(a01, a[0], a[1]);
  emu_mma::gather2(a23, a[2], a[3]);
  emu_mma::gather2(bb, b[0], b[1]);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int grp = l >> 2, tig = l & 3;
    const u32 regs[4] = {a01[l][0], a01[l][1], a23[l][0], a23[l][1]};
    for (int i = 0; i < 8; ++i) {
      const int row = grp + (((i >> 1) & 1) ? 8 : 0);
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = emu_mma::bf16_bits_to_f32(emu_mma::half_of(regs[i >> 1], i & 1));
    }
    for (int i = 0; i < 4; ++i) {
      const int k = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[k][grp] = emu_mma::bf16_bits_to_f32(emu_mma::half_of(bb[l][i >> 1], i & 1));
    }
  }
  const int lane = emu::lane_id(), grp = lane >> 2, tig = lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = grp + (i >= 2 ? 8 : 0), col = tig * 2 + (i & 1);
    float acc = 0.0f;  // bf16 products are exact in float32
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    out[i] = c[i] + acc;
  }
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

template <bool TRANS>
inline void ldmatrix_x4_emu(u32 r[4], const void* row) {
  if ((uintptr_t)row & 15) emu::fail("ldmatrix: a row address is not 16-byte aligned");
  emu_mma::note_read(row);
  const uint64_t* all = emu::warp_exchange((uint64_t)(uintptr_t)row);
  uint64_t addr[32];
  memcpy(addr, all, sizeof addr);
  const int lane = emu::lane_id();
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    if (!TRANS) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(addr[8 * m + (lane >> 2)]);
      lo = p[(lane & 3) * 2];
      hi = p[(lane & 3) * 2 + 1];
    } else {
      lo = reinterpret_cast<const uint16_t*>(addr[8 * m + (lane & 3) * 2])[lane >> 2];
      hi = reinterpret_cast<const uint16_t*>(addr[8 * m + (lane & 3) * 2 + 1])[lane >> 2];
    }
    r[m] = (u32)lo | ((u32)hi << 16);
  }
}

inline void ldmatrix_x4(u32 r[4], const void* row) { ldmatrix_x4_emu<false>(r, row); }
inline void ldmatrix_x4_trans(u32 r[4], const void* row) { ldmatrix_x4_emu<true>(r, row); }

inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  emu_mma::Tracker& t = emu_mma::state();
  const int me = emu::linear_tid();
  emu_mma::AsyncState& st = t.async[me];
  if (((uintptr_t)dst | (uintptr_t)src) & 15) emu::fail("cp.async: address not 16-byte aligned");
  if (src_bytes != 0 && src_bytes != 16) emu::fail("cp.async: src-size must be 0 or 16 here");
  if (st.n == (int)(sizeof st.copies / sizeof st.copies[0])) {
    emu::fail("cp.async: too many copies in flight for the emulator");
    return;
  }
  if (emu_mma::Chunk* c = emu_mma::chunk_at(t, dst)) {
    if (c->pending >= 0) emu::fail("cp.async: two copies in flight to the same 16 bytes");
    if (c->read_epoch == t.epoch[me] && c->reader != me)
      emu::fail("cp.async overwrites shared memory another thread read since the last "
                "__syncthreads (missing barrier before the copy)");
    c->pending = me;
  }
  st.copies[st.n++] = {dst, src, src_bytes, st.committed};
}

inline void cp_async_commit() { ++emu_mma::state().async[emu::linear_tid()].committed; }

template <int N>
inline void cp_async_wait() {
  emu_mma::Tracker& t = emu_mma::state();
  const int me = emu::linear_tid();
  emu_mma::AsyncState& st = t.async[me];
  // Groups numbered below committed - N are complete; uncommitted copies are not waited.
  int keep = 0;
  for (int i = 0; i < st.n; ++i) {
    const emu_mma::PendingCopy& cp = st.copies[i];
    if (cp.group >= st.committed - N) {
      st.copies[keep++] = cp;
      continue;
    }
    memcpy(cp.dst, cp.src, cp.src_bytes);
    memset(static_cast<char*>(cp.dst) + cp.src_bytes, 0, 16 - cp.src_bytes);
    if (emu_mma::Chunk* c = emu_mma::chunk_at(t, cp.dst)) {
      c->pending = -1;
      c->writer = me;
      c->done_epoch = t.epoch[me];
      memcpy(c->bytes, cp.dst, 16);
    }
  }
  st.n = keep;
}

inline float exp2_approx(float x) { return exp2f(x); }

#endif  // EAGERLM_EMULATOR
