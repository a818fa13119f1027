// The CUDA execution model on the host, for running the engine's kernels without a GPU.
//
// tests/emulated_gpu/gpu_emulator.py compiles each kernels/cuda/*.cu file with g++ and this header
// force-included. A launch runs the grid block after block; the threads of a block are
// fibers on the calling OS thread (`Context`), switched only where CUDA synchronizes:
// __syncthreads (and its _or/_and/_count forms), __syncwarp, and every warp collective
// (__shfl*_sync, __ballot_sync, __reduce_add_sync, __match_any_sync, ...). A collective
// completes when every lane of its mask has reached it, and each lane then reads the
// values the lanes held at that moment, so warp code runs exactly as the mask and the
// barriers promise, no more: code that leans on implicit warp synchronism, a barrier
// some threads of the block never reach, or a shuffle whose mask names an exited lane
// ends the launch with an error instead of passing by luck.
//
// Blocks, and the fibers of a block between two synchronizations, run in index order, or
// in reverse with EAGERLM_EMULATOR_SCHEDULE=reverse. A GPU promises neither, and for any
// two threads (or blocks) one order runs the first before the second and the other the
// second first, so a kernel that races on shared or global memory between two
// synchronizations gives different results under the two: the tests run under both.
//
// What it does not model: the memory model between blocks (blocks run one after another),
// timing, the hardware's exact float rounding of expf / exp2f / tanhf (the host libm's is
// as good or better), and shared-memory bank conflicts. Dynamic shared memory is filled with
// 0xFF (NaN) before each block, so a kernel that reads what it never wrote is caught.
#pragma once

// Kernel headers that use inline PTX (mma.sync, ldmatrix, cp.async) test this to supply
// a host version built on emu::warp_exchange.
#define EAGERLM_EMULATOR 1

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <type_traits>
#include <utility>

#include <vector_types.h>
#include <vector_functions.h>

namespace emu {

enum Wait : int { RUN = 0, BLOCK_BAR = 1, WARP_BAR = 2, DONE = 3 };

// Where a fiber (or the scheduler) left off. On x86-64 a switch pushes the callee-saved
// registers on the leaving stack, keeps its stack pointer here, and pops the other's:
// glibc's swapcontext also saves and sets the signal mask, two system calls a switch,
// which made half of the emulated tests' time kernel time. (The x87 and SSE control
// words are not switched: no kernel changes them.) Elsewhere, ucontext.
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};

// Save this side's registers and stack pointer into *from, continue at `to`.
__attribute__((naked, noinline)) inline void switch_stacks(void** /*from*/, void* /*to*/) {
  __asm__(
      "pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
      "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
      "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\t"
      "ret");
}

inline void switch_to(Context& from, Context& to) { switch_stacks(&from.sp, to.sp); }

// A context that, switched to, calls entry() on the stack [stack, stack + size): the
// six registers' slots, then entry as the return address of the switch, then a return
// address for entry (never used: entry switches away for good), 16-byte aligned as a
// call leaves the stack.
inline void make(Context& c, char* stack, size_t size, void (*entry)()) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top - 64);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(entry);
  sp[7] = nullptr;
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};

inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Fiber {
  Context ctx;
  int wait;
  unsigned mask;      // the lanes of a warp collective
  uint64_t value;     // what this lane brings to the collective
  int pred;           // __syncthreads_or / _and / _count
};

struct Launch {
  unsigned gx, gy, gz, bx, by, bz;
  size_t smem;
};

constexpr size_t kStack = 64 << 10;
constexpr int kMaxThreads = 1024;

struct State {
  dim3 grid, block;
  uint3 block_idx, thread_idx;
  int n = 0, cur = 0;
  Fiber fibers[kMaxThreads];
  char* stacks = nullptr;
  Context sched;
  uint64_t warp_snap[kMaxThreads];  // indexed by thread: lane values at the last release
  int block_or = 0, block_and = 0, block_count = 0;
  unsigned char* smem = nullptr;
  size_t smem_size = 0;
  std::function<void()> body;
  char error[512] = {0};
  std::mutex lock;
};

inline State S;

inline void fail(const char* what) {
  if (!S.error[0]) snprintf(S.error, sizeof S.error, "%s", what);
}

// Leave the current fiber for the scheduler until the collective it waits on completes.
__attribute__((noinline)) inline void park(int wait) {
  Fiber& f = S.fibers[S.cur];
  f.wait = wait;
  switch_to(f.ctx, S.sched);
}

// A fiber's life: the kernel's body, then back to the scheduler for good.
inline void trampoline() {
  S.body();
  Fiber& f = S.fibers[S.cur];
  f.wait = DONE;
  switch_to(f.ctx, S.sched);
  __builtin_unreachable();
}

inline int linear_tid() { return S.cur; }
inline int lane_id() { return S.cur & 31; }

// Make the fibers of one block waiting ones complete; false if none could.
inline bool release() {
  int alive = 0, at_block = 0;
  for (int i = 0; i < S.n; ++i) {
    if (S.fibers[i].wait != DONE) ++alive;
    if (S.fibers[i].wait == BLOCK_BAR) ++at_block;
  }
  if (alive > 0 && at_block == alive) {
    int any = 0, all = 1, count = 0;
    for (int i = 0; i < S.n; ++i)
      if (S.fibers[i].wait == BLOCK_BAR) {
        any |= S.fibers[i].pred != 0;
        all &= S.fibers[i].pred != 0;
        count += S.fibers[i].pred != 0;
        S.fibers[i].wait = RUN;
      }
    S.block_or = any, S.block_and = all, S.block_count = count;
    return true;
  }
  bool released = false;
  for (int w = 0; w * 32 < S.n; ++w) {
    const int base = w * 32;
    for (int l = 0; l < 32 && base + l < S.n; ++l) {
      Fiber& f = S.fibers[base + l];
      if (f.wait != WARP_BAR) continue;
      const unsigned mask = f.mask;
      if (!(mask >> l & 1u)) {
        fail("a warp collective's mask leaves out the calling lane");
        return false;
      }
      bool ready = true;
      for (int k = 0; k < 32; ++k) {
        if (!(mask >> k & 1u)) continue;
        if (base + k >= S.n || S.fibers[base + k].wait == DONE) {
          fail("a warp collective's mask names a lane that has exited (or does not exist)");
          return false;
        }
        // A lane of the mask still running, at a barrier, or at a collective of another
        // mask (say, the next loop iteration's, after its own lanes' last one) is not
        // there yet: the group waits for it, and a wait that can never end is reported
        // as a deadlock.
        if (S.fibers[base + k].wait != WARP_BAR || S.fibers[base + k].mask != mask) {
          ready = false;
          break;
        }
      }
      if (!ready) continue;
      for (int k = 0; k < 32; ++k)
        if (mask >> k & 1u) {
          S.warp_snap[base + k] = S.fibers[base + k].value;
          S.fibers[base + k].wait = RUN;
        }
      released = true;
    }
  }
  return released;
}

// Run `body` as a kernel: every block of the grid in turn, its threads as fibers. Returns
// an error message, or nullptr.
inline const char* launch(const Launch& l, std::function<void()> body) {
  std::lock_guard<std::mutex> guard(S.lock);
  S.error[0] = 0;
  const unsigned n = l.bx * l.by * l.bz;
  if (n == 0 || n > (unsigned)kMaxThreads || l.bx > 1024 || l.by > 1024 || l.bz > 64) {
    fail("invalid block dimensions");
    return S.error;
  }
  if (l.gy > 65535 || l.gz > 65535 || l.gx == 0 || l.gy == 0 || l.gz == 0) {
    fail("invalid grid dimensions");
    return S.error;
  }
  if (!S.stacks) S.stacks = static_cast<char*>(malloc(kStack * kMaxThreads));
  if (l.smem > S.smem_size) {
    free(S.smem);
    S.smem = static_cast<unsigned char*>(aligned_alloc(128, (l.smem + 127) / 128 * 128));
    S.smem_size = l.smem;
  }
  S.grid = dim3(l.gx, l.gy, l.gz);
  S.block = dim3(l.bx, l.by, l.bz);
  S.body = std::move(body);
  S.n = (int)n;
  // The order blocks, and the threads of a block between two synchronizations, run in.
  // A GPU promises none, so a kernel must give the same result under both: a race on
  // shared or global memory that one order hides, the other shows.
  const char* schedule = getenv("EAGERLM_EMULATOR_SCHEDULE");
  const bool reverse = schedule && strcmp(schedule, "reverse") == 0;
  const unsigned n_blocks = l.gx * l.gy * l.gz;
  for (unsigned k = 0; k < n_blocks; ++k) {
    const unsigned b = reverse ? n_blocks - 1 - k : k;
    S.block_idx = make_uint3(b % l.gx, (b / l.gx) % l.gy, b / (l.gx * l.gy));
    if (l.smem) memset(S.smem, 0xFF, l.smem);
    for (int i = 0; i < S.n; ++i) {
      Fiber& f = S.fibers[i];
      make(f.ctx, S.stacks + (size_t)i * kStack, kStack, trampoline);
      f.wait = RUN;
    }
    for (;;) {
      bool alive = false;
      for (int j = 0; j < S.n; ++j) {
        const int i = reverse ? S.n - 1 - j : j;
        if (S.fibers[i].wait != RUN) continue;
        S.cur = i;
        S.thread_idx = make_uint3(i % l.bx, (i / l.bx) % l.by, i / (l.bx * l.by));
        switch_to(S.sched, S.fibers[i].ctx);
        if (S.error[0]) return S.error;
      }
      for (int i = 0; i < S.n; ++i) alive |= S.fibers[i].wait != DONE;
      if (!alive) break;
      if (!release()) {
        fail("deadlock: threads of a block wait at different barriers (or some never "
             "reach a __syncthreads the others wait at)");
        return S.error;
      }
    }
  }
  return nullptr;
}

// Calls a kernel with cuLaunchKernel's argument array: args[i] points at parameter i.
template <typename... A, size_t... I>
void call_impl(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <typename... A>
void call(void (*k)(A...), void** args) {
  call_impl(k, args, std::index_sequence_for<A...>{});
}

template <typename T>
uint64_t bits(T v) {
  static_assert(sizeof(T) <= 8, "warp collectives move at most 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  memcpy(&v, &b, sizeof(T));
  return v;
}

// Enter a warp collective with `value`; on return S.warp_snap holds every lane's value.
inline void warp_collective(unsigned mask, uint64_t value) {
  Fiber& f = S.fibers[S.cur];
  f.mask = mask;
  f.value = value;
  park(WARP_BAR);
}

// Every lane of a full warp brings 8 bytes; each gets all 32 lanes' values (index by lane),
// valid until its next collective. For emulating warp-wide instructions (mma, ldmatrix).
inline const uint64_t* warp_exchange(uint64_t v) {
  warp_collective(0xffffffffu, v);
  return &S.warp_snap[S.cur - lane_id()];
}

inline void block_barrier(int pred) {
  S.fibers[S.cur].pred = pred;
  park(BLOCK_BAR);
}

}  // namespace emu

#define threadIdx (emu::S.thread_idx)
#define blockIdx (emu::S.block_idx)
#define blockDim (emu::S.block)
#define gridDim (emu::S.grid)
#define warpSize 32

inline void __syncthreads() { emu::block_barrier(0); }
inline int __syncthreads_or(int p) { emu::block_barrier(p); return emu::S.block_or; }
inline int __syncthreads_and(int p) { emu::block_barrier(p); return emu::S.block_and; }
inline int __syncthreads_count(int p) { emu::block_barrier(p); return emu::S.block_count; }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_collective(mask, 0); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  emu::warp_collective(mask, emu::bits(v));
  const int lane = emu::lane_id(), base = lane / width * width;
  const int from = (emu::S.cur - lane) + base + (src % width + width) % width;
  return emu::from_bits<T>(emu::S.warp_snap[from]);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  emu::warp_collective(mask, emu::bits(v));
  const int lane = emu::lane_id(), src = lane ^ lane_mask;
  const int from = src >= (lane / width + 1) * width ? lane : src;
  return emu::from_bits<T>(emu::S.warp_snap[emu::S.cur - lane + from]);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  emu::warp_collective(mask, emu::bits(v));
  const int lane = emu::lane_id(), base = lane / width * width, src = lane - (int)delta;
  return emu::from_bits<T>(emu::S.warp_snap[emu::S.cur - lane + (src < base ? lane : src)]);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  emu::warp_collective(mask, emu::bits(v));
  const int lane = emu::lane_id(), base = lane / width * width, src = lane + (int)delta;
  return emu::from_bits<T>(
      emu::S.warp_snap[emu::S.cur - lane + (src >= base + width ? lane : src)]);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  emu::warp_collective(mask, pred != 0);
  const int w0 = emu::S.cur - emu::lane_id();
  unsigned out = 0;
  for (int k = 0; k < 32; ++k)
    if (mask >> k & 1u) out |= (unsigned)(emu::S.warp_snap[w0 + k] != 0) << k;
  return out;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  emu::warp_collective(mask, v);
  const int w0 = emu::S.cur - emu::lane_id();
  unsigned out = 0;
  for (int k = 0; k < 32; ++k)
    if (mask >> k & 1u) out += (unsigned)emu::S.warp_snap[w0 + k];
  return out;
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  emu::warp_collective(mask, v);
  const int w0 = emu::S.cur - emu::lane_id();
  unsigned out = 0;
  for (int k = 0; k < 32; ++k)
    if (mask >> k & 1u) out = std::max(out, (unsigned)emu::S.warp_snap[w0 + k]);
  return out;
}
template <typename T>
unsigned __match_any_sync(unsigned mask, T v) {
  emu::warp_collective(mask, emu::bits(v));
  const int w0 = emu::S.cur - emu::lane_id();
  const uint64_t mine = emu::S.warp_snap[emu::S.cur];
  unsigned out = 0;
  for (int k = 0; k < 32; ++k)
    if ((mask >> k & 1u) && emu::S.warp_snap[w0 + k] == mine) out |= 1u << k;
  return out;
}

// Atomics: blocks run one at a time and fibers switch only at collectives, so a plain
// read-modify-write is atomic here.
template <typename T> T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <typename T> T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <typename T> T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <typename T> T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <typename T> T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
template <typename T> T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <typename T> T atomicCAS(T* p, T cmp, T v) {
  T old = *p;
  if (old == cmp) *p = v;
  return old;
}

// Integer and float intrinsics.
template <typename A, typename B>
inline auto min(A a, B b) -> std::common_type_t<A, B> { return b < a ? b : a; }
template <typename A, typename B>
inline auto max(A a, B b) -> std::common_type_t<A, B> { return a < b ? b : a; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
// dp4a: c + the dot product of a's and b's four bytes as signed 8-bit integers
inline int __dp4a(int a, int b, int c) {
  for (int k = 0; k < 4; ++k) c += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
  return c;
}
// byte_perm: byte n of the result is byte (s >> 4n) & 7 of the eight bytes y:x
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t in = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((in >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline float __int_as_float(int x) { return emu::from_bits<float>((uint32_t)x); }
inline float __uint_as_float(unsigned x) { return emu::from_bits<float>(x); }
inline int __float_as_int(float x) { return (int)(uint32_t)emu::bits(x); }
inline unsigned __float_as_uint(float x) { return (uint32_t)emu::bits(x); }
inline double __longlong_as_double(long long x) { return emu::from_bits<double>((uint64_t)x); }
inline long long __double_as_longlong(double x) { return (long long)emu::bits(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline void sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline unsigned long long __double2ull_rn(double x) {
  return (unsigned long long)nearbyint(x);
}
inline long long __double2ll_rn(double x) { return (long long)nearbyint(x); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
using std::isinf;
using std::isnan;
using std::isfinite;
