"""Linear layers as cuBLASLt GEMMs on raw device pointers (via nvmath.bindings.cublasLt).

y[T, out] = x[T, in] @ w[out, in]^T, bf16 inputs, float32 compute and scale, bf16 output
(float32 for the lm head, whose logits feed the sampler). Row-major y is column-major y^T,
so cuBLASLt computes D (out x T) = op(A) B with A = w seen column-major as (in x out),
transposed, and B = x seen column-major as (in x T): the "TN" case, the one the library
tunes best.

Descriptors and the heuristic's choice of algorithm are cached per shape and operand
alignment: the heuristic costs tens of microseconds, a launch a few. The alignment is part
of the key because the heuristic assumes every operand 256-byte aligned unless told
otherwise, and an algorithm chosen under that assumption refuses (CUBLAS_STATUS_NOT_SUPPORTED)
or faults on a less aligned pointer, such as a view that starts a few rows into a
buffer; so each plan tells the heuristic the alignment its pointers really have, as
PyTorch and TransformerEngine do. nvmath-python is an optional dependency (the `cuda` extra)
imported on first use, so everything else imports without it.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagerlm.errors import DeviceUnavailable

CUDA_R_16BF = 14  # cudaDataType_t values (library_types.h)
CUDA_R_32F = 0
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
WORKSPACE_BYTES = 32 << 20  # cuBLASLt's recommendation for Hopper
MAX_CACHED_SHAPES = 1024
MAX_ALIGNMENT = 256  # what the heuristic assumes of a pointer unless told less


def alignment(ptr: int) -> int:
    """The largest power of two up to MAX_ALIGNMENT that divides `ptr`."""
    return min(MAX_ALIGNMENT, ptr & -ptr) if ptr else MAX_ALIGNMENT


class CublasLtUnavailable(DeviceUnavailable):
    """nvmath-python (and the cuBLAS library) is needed for GEMMs on cuda:
    pip install 'eagerlm[cuda]'."""


def _cublaslt() -> Any:
    try:
        from nvmath.bindings import cublasLt
    except ImportError as exc:
        raise CublasLtUnavailable(
            f"nvmath-python is not installed ({exc}); pip install 'eagerlm[cuda]'") from exc
    return cublasLt


@dataclass
class _Plan:
    """Everything one GEMM shape needs, made once."""

    desc: int
    a: int
    b: int
    d: int
    heuristic: Any  # MatmulHeuristicResult: its first field is the algorithm
    workspace_size: int


class Gemm:
    """cuBLASLt matmuls for one device context (one handle, one workspace)."""

    def __init__(self, workspace_ptr: int, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.lt = _cublaslt()
        self.handle = self.lt.create()
        self.workspace_ptr = workspace_ptr
        self.workspace_bytes = workspace_bytes
        self._plans: OrderedDict[tuple[int, ...], _Plan] = OrderedDict()
        self._lock = threading.Lock()
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        self.heuristic_calls = 0

    def matmul(self, stream: int, y: int, x: int, w: int, n_tokens: int, n_in: int, n_out: int,
               out_dtype: int = CUDA_R_16BF, ldy: int | None = None) -> None:
        """Enqueue y[n_tokens, n_out] = x[n_tokens, n_in] @ w[n_out, n_in]^T on `stream`.
        `ldy` (default n_out) is the elements between rows of y: a larger one writes a
        column slice of a wider output (the quantized tile path's tiles of rows of w)."""
        if n_tokens == 0:
            return
        ldy = n_out if ldy is None else ldy
        key = (n_tokens, n_in, n_out, out_dtype, alignment(w), alignment(x), alignment(y), ldy)
        with self._lock:  # a plan is never evicted while a launch uses it
            plan = self._plan(key)
            self.lt.matmul(self.handle, plan.desc, self._alpha.ctypes.data, w, plan.a, x,
                           plan.b, self._beta.ctypes.data, y, plan.d, y, plan.d,
                           plan.heuristic.ptr, self.workspace_ptr, plan.workspace_size, stream)

    def _plan(self, key: tuple[int, ...]) -> _Plan:
        """The cached plan of a shape and alignment (lock held)."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = self._make_plan(*key)
        self._plans[key] = plan
        if len(self._plans) > MAX_CACHED_SHAPES:
            _, old = self._plans.popitem(last=False)
            self._destroy(old)
        return plan

    def _make_plan(self, n_tokens: int, k: int, n_out: int, out_dtype: int, align_w: int,
                   align_x: int, align_y: int, ldy: int) -> _Plan:
        lt = self.lt
        from nvmath.bindings import cublas

        desc = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F), CUDA_R_32F)
        for attr, value in ((lt.MatmulDescAttribute.TRANSA, CUBLAS_OP_T),
                            (lt.MatmulDescAttribute.TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int32(value)
            lt.matmul_desc_set_attribute(desc, int(attr), ctypes.addressof(v), 4)
        a = lt.matrix_layout_create(CUDA_R_16BF, k, n_out, k)  # w, read transposed
        b = lt.matrix_layout_create(CUDA_R_16BF, k, n_tokens, k)  # x
        d = lt.matrix_layout_create(out_dtype, n_out, n_tokens, ldy)  # y
        pref = lt.matmul_preference_create()
        try:
            ws = ctypes.c_uint64(self.workspace_bytes)
            lt.matmul_preference_set_attribute(
                pref, int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES),
                ctypes.addressof(ws), 8)
            pa = lt.MatmulPreferenceAttribute
            for attr, value in ((pa.MIN_ALIGNMENT_A_BYTES, align_w),
                                (pa.MIN_ALIGNMENT_B_BYTES, align_x),
                                (pa.MIN_ALIGNMENT_C_BYTES, align_y),
                                (pa.MIN_ALIGNMENT_D_BYTES, align_y)):
                v32 = ctypes.c_uint32(value)
                lt.matmul_preference_set_attribute(pref, int(attr), ctypes.addressof(v32), 4)
            result = lt.MatmulHeuristicResult(1)
            count = ctypes.c_int(0)
            lt.matmul_algo_get_heuristic(self.handle, desc, a, b, d, d, pref, 1, result.ptr,
                                         ctypes.addressof(count))
            self.heuristic_calls += 1
        finally:
            lt.matmul_preference_destroy(pref)
        if count.value < 1:
            for layout in (a, b, d):
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(desc)
            raise RuntimeError(f"cuBLASLt has no algorithm for a bf16 GEMM of {n_tokens}x{k} "
                               f"by {n_out}x{k}")
        return _Plan(desc, a, b, d, result, int(result.workspace_size))

    def _destroy(self, plan: _Plan) -> None:
        for layout in (plan.a, plan.b, plan.d):
            self.lt.matrix_layout_destroy(layout)
        self.lt.matmul_desc_destroy(plan.desc)

    def close(self) -> None:
        with self._lock:
            plans, self._plans = list(self._plans.values()), OrderedDict()
        for p in plans:
            self._destroy(p)
        if self.handle:
            self.lt.destroy(self.handle)
            self.handle = 0
