"""The compiled kernels on one device: each kernel's argument list, loading, launching.

`SIGNATURES` is the single Python statement of every kernel's parameters, in order, and of
the module it is in. A wrong argument list is silent garbage on the device, so
tests/test_kernel_build.py checks each entry against the parameter table NVRTC wrote into
the cubin (offset and size of every parameter); a kernel added to a `.cu` file without an
entry here fails that test too.

A module is a source file compiled with given defines (`MODULES`): most are one file as it
is; `quant_matrix_<type>` is kernels/cuda/quant_matrix.cu once per weight type
(kernels/cuda_weight_types.py), so that a model compiles only its types' kernels.

Launching is cheap enough for hundreds of launches per round: each kernel owns, per
thread, a small argument block of 8-byte slots and the array of pointers to them, built
once; a launch is one `struct.pack_into` and one `cuLaunchKernel` with the array's address.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES
from eagerlm.kernels.nvrtc_build import Cubin, compile_kernel, kernel_sources
from eagerlm.vmm.cuda_driver import CudaContext, check, cu, driver

if TYPE_CHECKING:
    import numpy as np

    from eagerlm.kernels.device_tensor import DeviceTensor

# Parameter kinds: p = device pointer, i = int32, q = int64, f = float32, d = float64.
_KIND_SIZE = {"p": 8, "i": 4, "q": 8, "f": 4, "d": 8}
_KIND_FORMAT = {"p": "Q", "i": "i4x", "q": "q", "f": "f4x", "d": "d"}

_ATTENTION = {f"attention_hd{d}": "pppppqqqiiifiiiip" for d in (32, 64, 128, 256)}
# attention_decode.cu: one kernel per (head dim, query heads per block)
_ATTENTION_DECODE = {f"attention_decode_hd{d}_g{g}": "pppppqqqiifiiiip"
                     for d in (32, 64, 128, 256) for g in (1, 2, 4, 8)}

# Dynamic shared memory a launch gets without opting in (cuFuncSetAttribute); up to the
# device's maximum (227 KiB on sm_90) with it.
DEFAULT_SMEM_LIMIT = 48 << 10

# kernel name -> (module, parameter kinds in order)
SIGNATURES: dict[str, tuple[str, str]] = {
    "embed_rows": ("embed", "pppipiiif"),
    "rms_norm_f32": ("norm", "pppiif"),
    "rms_norm_bf16": ("norm", "pppiif"),
    "add_rms_norm": ("norm", "pppppiif"),
    "rope_norm": ("rope", "ppppiiidddddd"),
    "rope_neox": ("rope", "ppppiiidddddd"),
    "swiglu": ("elementwise", "pppq"),
    "swiglu_oai": ("elementwise", "pppq"),
    "geglu": ("elementwise", "pppq"),
    "softcap_f32": ("elementwise", "ppqf"),
    "softcap_bf16": ("elementwise", "ppqf"),
    "add_bias_bf16": ("elementwise", "ppqi"),
    "add_bias_f32": ("elementwise", "ppqi"),
    "gather_rows": ("elementwise", "pppiq"),
    "interleave_shards": ("elementwise", "ppiiq"),
    "kv_append": ("kv_append", "ppppiiqqq"),
    **{name: ("attention", sig) for name, sig in _ATTENTION.items()},
    "attention_merge": ("attention", "pppiiiip"),
    "attention_prefill_hd64": ("attention_prefill", "pppqqqiifi"),
    "attention_prefill_hd128": ("attention_prefill", "pppqqqiifi"),
    "mma_selftest": ("attention_prefill", "pppi"),  # tests only: mma.cuh fragment layouts
    **{name: ("attention_decode", sig) for name, sig in _ATTENTION_DECODE.items()},
    "sample_rows": ("sampler", "ppppiqp"),
    "penalize_rows": ("sampler", "ppip"),
    "mask_rows": ("sampler", "ppipip"),
    "count_tokens": ("sampler", "ppipi"),
    "token_logprobs": ("sampler", "pppiqppi"),
    "spec_prepare": ("speculative", "ppppipipii"),
    "spec_accept": ("speculative", "pipiipppipip"),
    "spec_positions": ("speculative", "pppipip"),
    "spec_draw_positions": ("speculative", "pppi"),
    "draft_rows": ("speculative", "pippipip"),
    "draft_argmax": ("speculative", "pipipip"),
    "quantize_q8": ("quant_matrix", "pppq"),
    "moe_route": ("moe", "pppppiiiiiif"),
    "moe_sort": ("moe", "pppppiii"),
    "moe_combine": ("moe", "ppppppiii"),
}
# quant_matrix.cu, per weight type: parameter kinds by the kernel name's first word
_WEIGHT_KINDS = {"dequant": "ppq", "gemv": "ppppiiiii", "gemv8": "pppppiiiii",
                 "embed": "pppipiiif", "moe": "pppqpppiii"}
for _t in WEIGHT_TYPES.values():
    for _name in _t.kernels:
        SIGNATURES[_name] = (_t.module, _WEIGHT_KINDS[_name.split("_")[0]])


@dataclass(frozen=True)
class Module:
    """A kernel module: `kernels/cuda/<source>.cu` compiled with `defines`."""

    source: str
    defines: tuple[tuple[str, str], ...] = ()


# module name -> what it is compiled from: every source as it is, and quant_matrix.cu per
# weight type
MODULES: dict[str, Module] = {
    **{src: Module(src) for src in kernel_sources()},
    **{t.module: Module("quant_matrix", t.defines) for t in WEIGHT_TYPES.values()},
}


def compile_module(module: str, arch: str) -> Cubin:
    """The cubin of `module` for `arch` (NVRTC, cached on disk)."""
    m = MODULES[module]
    return compile_kernel(m.source, arch, defines=m.defines)


def expected_params(kinds: str) -> list[tuple[int, int]]:
    """(offset, size) of each parameter of a kernel with these kinds, as the C ABI lays
    them out (each aligned to its size)."""
    out, at = [], 0
    for k in kinds:
        size = _KIND_SIZE[k]
        at = (at + size - 1) // size * size
        out.append((at, size))
        at += size
    return out


class Kernel:
    """One kernel function, launchable on any stream of its context."""

    def __init__(self, name: str, function: Any, kinds: str, ctx: CudaContext) -> None:
        self.name = name
        self.function = function
        self.kinds = kinds
        self.ctx = ctx
        self._format = "<" + "".join(_KIND_FORMAT[k] for k in kinds)
        self._local = threading.local()
        self._launch = driver().cuLaunchKernel
        self._smem_allowed = DEFAULT_SMEM_LIMIT

    def _args_block(self) -> tuple[ctypes.Array, int]:
        block = getattr(self._local, "block", None)
        if block is None:
            n = len(self.kinds)
            data = (ctypes.c_uint64 * max(n, 1))()
            ptrs = (ctypes.c_void_p * max(n, 1))(
                *[ctypes.addressof(data) + 8 * i for i in range(n)])
            block = self._local.block = (data, ptrs, ctypes.addressof(ptrs))
        return block[0], block[2]

    def launch(self, stream: Any, grid: tuple[int, int, int] | int,
               block: tuple[int, int, int] | int, *args: int | float, smem: int = 0) -> None:
        """Enqueue the kernel on `stream` (a CUstream handle) with `args` in declared order
        (pointers as ints)."""
        if len(args) != len(self.kinds):
            raise TypeError(f"{self.name} takes {len(self.kinds)} arguments, got {len(args)}")
        gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
        bx, by, bz = (block, 1, 1) if isinstance(block, int) else block
        if gx <= 0 or gy <= 0 or gz <= 0:
            return  # nothing to do (an empty batch)
        data, addr = self._args_block()
        struct.pack_into(self._format, data, 0, *args)
        self.ctx.bind()
        if smem > self._smem_allowed:
            self._allow_smem(smem)
        check(self._launch(self.function, gx, gy, gz, bx, by, bz, smem, stream, addr, 0),
              f"cuLaunchKernel({self.name})")

    def _allow_smem(self, smem: int) -> None:
        """Opt in to more dynamic shared memory than the default 48 KiB, as CUDA requires
        of each function (once; the attribute stays set). Never called while capturing: the
        first launch of a size happens in a graph's eager warm-up."""
        d = driver()
        cu("cuFuncSetAttribute", self.function,
           d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        self._smem_allowed = smem


@dataclass
class _Module:
    handle: Any
    image_bytes: int


class KernelLibrary:
    """Every kernel for one device, compiled (or read from the cubin cache) and loaded on
    first use, per module."""

    def __init__(self, ctx: CudaContext, arch: str | None = None) -> None:
        self.ctx = ctx
        if arch is None:
            d = driver()
            attr = d.CUdevice_attribute
            major = cu("cuDeviceGetAttribute",
                       attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ctx.device)
            minor = cu("cuDeviceGetAttribute",
                       attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ctx.device)
            arch = f"sm_{major}{minor}"
        self.arch = arch
        self._modules: dict[str, _Module] = {}
        self._kernels: dict[str, Kernel] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is not None:
            return k
        with self._lock:
            k = self._kernels.get(name)
            if k is None:
                source, kinds = SIGNATURES[name]
                module = self._module(source)
                self.ctx.bind()
                fn = cu("cuModuleGetFunction", module.handle, name.encode())
                k = self._kernels[name] = Kernel(name, fn, kinds, self.ctx)
            return k

    def _module(self, module: str) -> _Module:
        m = self._modules.get(module)
        if m is None:
            cubin = compile_module(module, self.arch)
            self.ctx.bind()
            handle = cu("cuModuleLoadData", cubin.image)
            m = self._modules[module] = _Module(handle, len(cubin.image))
        return m

    def load_modules(self, modules: Iterable[str]) -> None:
        """Compile (or read from the cubin cache) and load these modules now: at load
        time, so that neither the first request nor a graph capture (where loading a
        module is not allowed) pays for it."""
        with self._lock:
            for module in modules:
                self._module(module)

    def load_all(self) -> None:
        """Compile and load everything now (start-up), rather than at first use."""
        for name in SIGNATURES:
            self[name]

    def close(self) -> None:
        with self._lock:
            self._kernels.clear()
            modules, self._modules = self._modules, {}
        if not self.ctx.released:
            self.ctx.bind()
            for m in modules.values():
                cu("cuModuleUnload", m.handle)


class OpsMixin:
    """What CudaOps' mixins (CudaSampling, CudaSpeculation) use of it: its kernels, its
    stream's handle, uploads and fresh tensors (declared for type checkers; CudaOps has
    them)."""

    if TYPE_CHECKING:
        kernels: KernelLibrary

        @property
        def _s(self) -> Any: ...

        def upload(self, array: np.ndarray, dtype: str | None = None) -> DeviceTensor: ...

        def empty(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor: ...
