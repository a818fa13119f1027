"""The engine's CUDA kernels run on the host: an emulated GPU for machines without one.

CI has no GPU, and a kernel that only ever compiles is a kernel nobody has seen run. So the
tests also run the cuda backend on `EmulatedDriver`: the fake driver of
fake_cuda_driver.py beside this file (device memory is host memory, streams are threads,
the driver's rules are kept) plus what kernels need:

- `cuModuleLoadData` loads each kernel module (a `kernels/cuda/*.cu` file and its
  defines: kernels/cuda_kernels.py's MODULES) compiled by g++ against
  cuda_emulation/runtime.h, which runs a grid block by block with the threads of a
  block as fibers that switch at every barrier and warp collective (see that header for
  what is and is not modelled). The sources are the very files NVRTC compiles; only
  `extern __shared__` declarations are rewritten to point at the launch's dynamic shared
  memory.
- `cuLaunchKernel` copies the argument values at launch, as the driver does, and runs the
  kernel on the stream's thread; a kernel that deadlocks or breaks a collective's rules
  fails the stream, and the next synchronization reports CUDA_ERROR_LAUNCH_FAILED. It
  refuses, as a GPU does, a block larger than the kernel's `__launch_bounds__` or than the
  register file holds at the kernel's register count (both read from the sm_90 cubin
  NVRTC makes of the same source), and more than 48 KiB of dynamic shared memory
  without the opt-in.
- stream-ordered allocation, memset and the synchronous copies;
- cuBLASLt is fake_cublaslt.py: the engine's own `eagerlm.kernels.cublaslt.Gemm` builds
  its descriptors, preferences and plans against it, the library's documented contract is
  checked (argument types, shapes, operand alignment, workspace), and the product is a
  numpy GEMM over the same bf16 bytes: cuBLASLt's kernels are NVIDIA's, not ours to test.

This checks indexing, synchronization and numerics of our kernels and the host code that
drives them; it says nothing about speed, and the hardware's own behaviour is checked only
by the same tests on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.emulated_gpu.fake_cuda_driver import FakeDriver, R, real

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "kernels" / "cuda"
RUNTIME = Path(__file__).resolve().parent / "cuda_emulation"
_DYNAMIC_SMEM = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;")
_KIND_SIZE = {"p": 8, "i": 4, "q": 8, "f": 4, "d": 8}
SMEM_OPT_IN = 227 << 10  # the most dynamic shared memory an sm_90 block may opt in to
SM_COUNT = 8  # few, so grid-stride loops and split heuristics take their long paths


class EmulatorUnavailable(RuntimeError):
    """No host C++ compiler (g++) or no CUDA headers to compile the kernels with."""


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise EmulatorUnavailable(f"no C++ compiler ({cxx}) to build the emulated kernels")
    return cxx


def _cache_dir() -> Path:
    base = os.environ.get("EAGERLM_EMULATOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagerlm",
        "emulator")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _rewrite(text: str) -> str:
    """Dynamic shared memory becomes a pointer to the launch's buffer."""
    return _DYNAMIC_SMEM.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(emu::S.smem);",
        text)


def build_module(module: str, kernels: list[str]) -> Path:
    """Kernel module `module` (kernels/cuda_kernels.py's MODULES: a `kernels/cuda/*.cu`
    source and its defines) as a host shared library with one `emu_launch_<name>` entry per
    kernel, cached by the content of everything it is built from."""
    from eagerlm.kernels.cuda_kernels import MODULES
    from eagerlm.kernels.nvrtc_build import cuda_include_dir

    cxx = _compiler()
    try:
        include = cuda_include_dir()
    except Exception as exc:
        raise EmulatorUnavailable(str(exc)) from exc
    source, defines = MODULES[module].source, [f"-D{k}={v}" for k, v in MODULES[module].defines]
    files = sorted([*SOURCES.glob("*.cu"), *SOURCES.glob("*.cuh"), *RUNTIME.rglob("*")])
    digest = hashlib.sha256(" ".join([cxx, source, *defines, *kernels]).encode())
    for f in files:
        if f.is_file():
            digest.update(f.name.encode() + f.read_bytes())
    out = _cache_dir() / f"{module}-{digest.hexdigest()[:20]}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(tmp)
        for f in [*SOURCES.glob("*.cu"), *SOURCES.glob("*.cuh")]:
            (build / f.name).write_text(_rewrite(f.read_text()))
        entries = "\n".join(
            f'extern "C" const char* emu_launch_{k}(const emu::Launch* l, void** args) {{\n'
            f"  return emu::launch(*l, [args] {{ emu::call({k}, args); }});\n}}"
            for k in kernels)
        unit = build / "unit.cpp"
        unit.write_text(f'#include "{source}.cu"\n{entries}\n')
        tmp_out = build / "module.so"
        cmd = [cxx, "-std=c++17", "-O1", "-g0", "-fPIC", "-shared", "-w", *defines,
               "-include", str(RUNTIME / "runtime.h"), f"-I{RUNTIME}", f"-I{build}",
               f"-I{include}", str(unit), "-o", str(tmp_out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"emulated build of {module} ({source}.cu) failed:\n"
                               f"{done.stderr[-4000:]}")
        shutil.move(str(tmp_out), out)
    return out


class _Launch(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_size_t)]


@functools.cache
def sm90_resources(module: str) -> dict[str, Any]:
    """Registers and launch bounds of `module`'s kernels as NVRTC compiles them for sm_90
    (the emulated device's architecture), so that a launch the real GPU would refuse (a
    block over its kernel's bound or over the register file) is refused here too; empty
    if NVRTC cannot compile here."""
    from eagerlm.kernels.cuda_kernels import MODULES
    from eagerlm.kernels.nvrtc_build import compile_kernel, cubin_resources

    m = MODULES[module]
    try:
        return cubin_resources(compile_kernel(m.source, "sm_90", defines=m.defines).image)
    except Exception:
        return {}


class KernelFailed(RuntimeError):
    """An emulated kernel broke CUDA's rules (deadlock, a bad collective, bad dimensions)."""


class EmulatedDriver(FakeDriver):
    """The fake driver, running the engine's kernels (see the module docstring)."""

    def __init__(self, memory_bytes: int = 2 << 30, n_devices: int = 1) -> None:
        super().__init__(memory_bytes, n_devices)
        self.modules: dict[int, ctypes.CDLL] = {}
        self.functions: dict[int, tuple[str, Any, str]] = {}  # id -> (name, entry, kinds)
        self.smem_allowed: dict[int, int] = {}  # function -> opted-in dynamic shared memory
        self.resources: dict[int, Any] = {}  # function -> KernelResources (sm_90 cubin)
        self.async_allocs: set[int] = set()
        self.launches = 0
        self.cublaslt: Any = None  # tests/fake_cublaslt.FakeCublasLt, set by emulated_gpu
        self.nccl: Any = None  # tests/fake_nccl.FakeNccl, set by emulated_gpu
        self.capturing: dict[int, set[int]] = {}  # stream -> allocations of its capture
        self.capture_threads: dict[int, int] = {}  # stream -> the thread capturing it
        self.capture_invalid: set[int] = set()  # captures a refused call invalidated
        self.capture_freed: set[int] = set()
        self.graphs: dict[int, tuple[list, set[int]]] = {}  # graph -> (work, owned memory)
        self.execs: dict[int, int] = {}  # exec -> graph
        self.graph_launches = 0

    def enqueue(self, stream: Any, fn: Any) -> None:
        w = self._stream(stream)
        if w is None:
            raise RuntimeError(f"unknown stream {stream}")
        w.put(fn)

    # -- attributes the kernels' host code asks for -------------------------------------

    def cuDeviceGetAttribute(self, attr: Any, dev: Any) -> tuple:
        a = real.CUdevice_attribute
        values = {
            a.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
            a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
            a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
            a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: SM_COUNT,
        }
        if err := self._enter("cuDeviceGetAttribute", (attr, dev), False):
            return err
        return (R.CUDA_SUCCESS, values.get(attr, 0))

    def cuDeviceGetDefaultMemPool(self, dev: Any) -> tuple:
        return self._enter("cuDeviceGetDefaultMemPool", (dev,)) or (
            R.CUDA_SUCCESS, real.CUmemoryPool(0x9001))

    def cuMemPoolSetAttribute(self, pool: Any, attr: Any, value: Any) -> tuple:
        return self._enter("cuMemPoolSetAttribute", (pool, attr, value)) or (R.CUDA_SUCCESS,)

    # -- stream-ordered memory and plain copies -----------------------------------------

    def cuMemAllocAsync(self, n: int, stream: Any) -> tuple:
        if err := self._enter("cuMemAllocAsync", (n, stream)):
            return err
        got = self._alloc(n)
        if int(got[0]) == 0:
            owned = self.capturing.get(int(stream))
            if owned is not None:
                owned.add(int(got[1]))
            else:
                self.async_allocs.add(int(got[1]))
        return got

    def cuMemFreeAsync(self, ptr: Any, stream: Any) -> tuple:
        if err := self._enter("cuMemFreeAsync", (ptr, stream)):
            return err
        addr = int(ptr)
        owned = self.capturing.get(int(stream))
        if owned is not None:  # inside a capture only the capture's own memory is freed
            if addr not in owned:
                self.capture_invalid.add(int(stream))
                return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
            self.capture_freed.add(addr)
            return (R.CUDA_SUCCESS,)
        if addr not in self.async_allocs or self._stream(stream) is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.async_allocs.discard(addr)
        self.enqueue(stream, lambda: self._free(addr))
        return (R.CUDA_SUCCESS,)

    def cuMemsetD8Async(self, ptr: Any, byte: int, n: int, stream: Any) -> tuple:
        if err := self._enter("cuMemsetD8Async", (ptr, byte, n, stream)):
            return err
        addr = int(ptr)
        if not self._device_ok(addr, n):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.enqueue(stream, lambda: ctypes.memset(addr, int(byte), n))
        return (R.CUDA_SUCCESS,)

    def cuMemcpyDtoH(self, dst: int, src: Any, n: int) -> tuple:
        if err := self._enter("cuMemcpyDtoH", (dst, src, n)):
            return err
        if not self._device_ok(int(src), n):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(int(dst), int(src), n)
        return (R.CUDA_SUCCESS,)

    def cuMemcpyHtoD(self, dst: Any, src: int, n: int) -> tuple:
        if err := self._enter("cuMemcpyHtoD", (dst, src, n)):
            return err
        if not self._device_ok(int(dst), n):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(int(dst), int(src), n)
        return (R.CUDA_SUCCESS,)

    # -- modules and launches ------------------------------------------------------------

    def cuModuleLoadData(self, image: Any) -> tuple:
        if err := self._enter("cuModuleLoadData", (image,)):
            return err
        if not isinstance(image, bytes) or not image.startswith(b"EMU:"):
            return (R.CUDA_ERROR_INVALID_IMAGE, None)
        from eagerlm.kernels.cuda_kernels import SIGNATURES

        module = image[4:].decode()
        names = [k for k, (mod, _) in SIGNATURES.items() if mod == module]
        lib = ctypes.CDLL(str(build_module(module, names)))
        h = next(self.ids)
        self.modules[h] = lib
        return (R.CUDA_SUCCESS, real.CUmodule(h))

    def cuModuleUnload(self, module: Any) -> tuple:
        if err := self._enter("cuModuleUnload", (module,)):
            return err
        return (R.CUDA_SUCCESS,) if self.modules.pop(int(module), None) else \
            (R.CUDA_ERROR_INVALID_HANDLE,)

    def cuModuleGetFunction(self, module: Any, name: bytes) -> tuple:
        if err := self._enter("cuModuleGetFunction", (module, name)):
            return err
        from eagerlm.kernels.cuda_kernels import SIGNATURES

        lib = self.modules.get(int(module))
        kname = name.decode()
        if lib is None or kname not in SIGNATURES:
            return (R.CUDA_ERROR_NOT_FOUND, None)
        entry = getattr(lib, f"emu_launch_{kname}")
        entry.restype = ctypes.c_char_p
        entry.argtypes = [ctypes.POINTER(_Launch), ctypes.c_void_p]
        h = next(self.ids)
        self.functions[h] = (kname, entry, SIGNATURES[kname][1])
        needs = sm90_resources(SIGNATURES[kname][0]).get(kname)
        if needs is not None:
            self.resources[h] = needs
        return (R.CUDA_SUCCESS, real.CUfunction(h))

    def cuFuncSetAttribute(self, f: Any, attr: Any, value: int) -> tuple:
        if err := self._enter("cuFuncSetAttribute", (f, attr, value)):
            return err
        opt_in = real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if int(f) not in self.functions or attr != opt_in or not 0 <= value <= SMEM_OPT_IN:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.smem_allowed[int(f)] = value
        return (R.CUDA_SUCCESS,)

    def cuLaunchKernel(self, f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                       smem: int, stream: Any, params: Any, extra: Any) -> tuple:
        args = (f, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
        if err := self._enter("cuLaunchKernel", args):
            return err
        fn = self.functions.get(int(f))
        if fn is None or self._stream(stream) is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        if smem > self.smem_allowed.get(int(f), 48 << 10):  # beyond 48 KiB: an opt-in
            return (R.CUDA_ERROR_INVALID_VALUE,)
        needs = self.resources.get(int(f))
        threads = bx * by * bz
        if needs is not None and not needs.block_fits(threads):  # as the compiled kernel
            return (R.CUDA_ERROR_INVALID_VALUE if threads > needs.thread_limit
                    else R.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,)
        name, entry, kinds = fn
        # The driver copies the argument values now: the caller reuses its buffers.
        ptrs = ctypes.cast(int(params), ctypes.POINTER(ctypes.c_void_p))
        copies = [ctypes.create_string_buffer(
            ctypes.string_at(ptrs[i], _KIND_SIZE[k]), _KIND_SIZE[k]) for i, k in enumerate(kinds)]
        array = (ctypes.c_void_p * max(1, len(kinds)))(*[ctypes.addressof(c) for c in copies])
        launch = _Launch(gx, gy, gz, bx, by, bz, smem)
        self.launches += 1

        def run() -> None:
            keep = copies  # noqa: F841  (alive until the kernel has read them)
            msg = entry(ctypes.byref(launch), ctypes.cast(array, ctypes.c_void_p))
            if msg is not None:
                raise KernelFailed(f"{name} <<<({gx},{gy},{gz}), ({bx},{by},{bz}), {smem}>>>: "
                                   f"{msg.decode()}")

        self.enqueue(stream, run)
        return (R.CUDA_SUCCESS,)

    # -- stream capture and graphs -------------------------------------------------------
    # Work enqueued on a capturing stream is recorded, not run; a graph replays it in
    # order. Memory allocated inside the capture belongs to the graph: it must be freed
    # inside the capture too (as CUDA requires of a graph relaunched without
    # AUTO_FREE_ON_LAUNCH), stays mapped for the replays and goes with the graph.
    # As on a GPU in CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, the capturing thread may not
    # call what could allocate or synchronize implicitly (UNSAFE_IN_CAPTURE), nor free
    # memory from outside the capture: such a call fails and invalidates the capture, so
    # that cuStreamEndCapture fails too, even where the caller ignored the first error.

    UNSAFE_IN_CAPTURE = frozenset({
        "cuMemAlloc", "cuMemFree", "cuCtxSynchronize", "cuMemcpyHtoD", "cuMemcpyDtoH",
        "cuMemcpyDtoD", "cuModuleLoadData"})

    def _enter(self, name: str, args: tuple, needs_ctx: bool = True) -> tuple | None:
        if name in self.UNSAFE_IN_CAPTURE:
            me = threading.get_ident()
            mine = [s for s, t in list(self.capture_threads.items()) if t == me]
            if mine:
                self.capture_invalid.update(mine)
                return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, None)
        return super()._enter(name, args, needs_ctx)

    def cuStreamBeginCapture(self, s: Any, mode: Any) -> tuple:
        if err := self._enter("cuStreamBeginCapture", (s, mode)):
            return err
        w = self._stream(s)
        if w is None or w.capture is not None:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        w.capture = []
        self.capturing[int(s)] = set()
        self.capture_threads[int(s)] = threading.get_ident()
        return (R.CUDA_SUCCESS,)

    def cuStreamEndCapture(self, s: Any) -> tuple:
        if err := self._enter("cuStreamEndCapture", (s,)):
            return err
        w = self._stream(s)
        if w is None or w.capture is None:
            return (R.CUDA_ERROR_ILLEGAL_STATE, None)
        work, w.capture = w.capture, None
        owned = self.capturing.pop(int(s))
        self.capture_threads.pop(int(s), None)
        live = owned - self.capture_freed
        if live or int(s) in self.capture_invalid:
            self.capture_invalid.discard(int(s))
            for addr in owned:  # the capture's memory goes with it
                self.capture_freed.discard(addr)
                self._free(addr)
            return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
        h = next(self.ids)
        self.graphs[h] = (work, owned)
        return (R.CUDA_SUCCESS, real.CUgraph(h))

    def cuGraphInstantiate(self, g: Any, flags: int) -> tuple:
        if err := self._enter("cuGraphInstantiate", (g, flags)):
            return err
        if int(g) not in self.graphs:
            return (R.CUDA_ERROR_INVALID_HANDLE, None)
        h = next(self.ids)
        self.execs[h] = int(g)
        return (R.CUDA_SUCCESS, real.CUgraphExec(h))

    def cuGraphLaunch(self, e: Any, s: Any) -> tuple:
        if err := self._enter("cuGraphLaunch", (e, s)):
            return err
        g = self.execs.get(int(e))
        w = self._stream(s)
        if g is None or w is None or g not in self.graphs:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        for fn in self.graphs[g][0]:
            w.put(fn)
        self.graph_launches += 1
        return (R.CUDA_SUCCESS,)

    def cuGraphExecDestroy(self, e: Any) -> tuple:
        if err := self._enter("cuGraphExecDestroy", (e,)):
            return err
        return (R.CUDA_SUCCESS,) if self.execs.pop(int(e), None) is not None else \
            (R.CUDA_ERROR_INVALID_HANDLE,)

    def cuGraphDestroy(self, g: Any) -> tuple:
        if err := self._enter("cuGraphDestroy", (g,)):
            return err
        got = self.graphs.pop(int(g), None)
        if got is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        for addr in got[1]:
            self.capture_freed.discard(addr)
            self._free(addr)
        return (R.CUDA_SUCCESS,)

    def failures(self) -> list[BaseException]:
        return [w.error for w in list(self.streams.values()) if w.error is not None]


@contextlib.contextmanager
def emulated_gpu_for_test(row_exact_gemm: bool = False,
                          devices: int = 1) -> Iterator[EmulatedDriver]:
    """`emulated_gpu` for a test fixture: the test is skipped where the emulator cannot be
    built, and fails if an emulated kernel failed on any stream."""
    import pytest

    try:
        with emulated_gpu(row_exact_gemm, devices) as drv:
            yield drv
            assert drv.failures() == [], "an emulated kernel failed"
    except EmulatorUnavailable as exc:
        pytest.skip(f"no kernel emulator ({exc})")


@contextlib.contextmanager
def emulated_gpu(row_exact_gemm: bool = False, devices: int = 1) -> Iterator[EmulatedDriver]:
    """Within: `open_device("cuda")` (and "cuda:N" for N < `devices`) gives a device on
    the emulated driver, kernels build for the host, cuBLASLt is fake_cublaslt.py
    (`row_exact_gemm`: see there) and NCCL fake_nccl.py."""
    import pytest

    import eagerlm.kernels.cublaslt
    import eagerlm.kernels.cuda_kernels
    import eagerlm.kernels.nccl_collective
    import eagerlm.vmm.cuda_driver

    _compiler()
    try:
        from eagerlm.kernels.nvrtc_build import cuda_include_dir

        cuda_include_dir()
    except Exception as exc:
        raise EmulatorUnavailable(str(exc)) from exc
    try:
        from tests.emulated_gpu.fake_cublaslt import FakeCublasLt
    except ImportError as exc:
        raise EmulatorUnavailable(f"nvmath-python, whose cuBLASLt bindings the fake "
                                  f"checks calls against, is not installed ({exc})") from exc
    drv = EmulatedDriver(n_devices=devices)
    drv.cublaslt = FakeCublasLt(drv, row_exact_gemm)
    if devices > 1:
        try:
            from tests.emulated_gpu.fake_nccl import FakeNccl
        except ImportError as exc:
            raise EmulatorUnavailable(f"nccl4py, whose bindings the fake NCCL checks calls "
                                      f"against, is not installed ({exc})") from exc
        drv.nccl = FakeNccl(drv)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eagerlm.vmm.cuda_driver, "_driver", drv)
        mp.setattr(eagerlm.kernels.cuda_kernels, "compile_module",
                   lambda module, arch: SimpleNamespace(image=b"EMU:" + module.encode()))
        mp.setattr(eagerlm.kernels.cublaslt, "_cublaslt", lambda: drv.cublaslt)
        mp.setattr(eagerlm.kernels.nccl_collective, "_nccl", lambda: drv.nccl)
        try:
            yield drv
        finally:
            for w in list(drv.streams.values()):
                w.stop()
