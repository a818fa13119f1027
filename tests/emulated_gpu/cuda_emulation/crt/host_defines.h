// Stand-in for the CUDA toolkit's crt/host_defines.h (not shipped in the nvidia-cuda-runtime
// wheel), so the kernels and cuda_bf16.h compile with a host C++ compiler for the emulator
// (tests/emulated_gpu/gpu_emulator.py). Device qualifiers vanish; __shared__ becomes `static`, which is
// right because the emulator runs one block at a time per compiled module.
#pragma once
#define __host__
#define __device__
#define __global__
#define __shared__ static
#define __constant__ static
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __attribute__((aligned(n)))
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a) __attribute__((a))
#define __location__(a) __annotate__(a)
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __launch_bounds__(...)
#define __grid_constant__
#define __CUDA_ALIGN__(n) __attribute__((aligned(n)))
