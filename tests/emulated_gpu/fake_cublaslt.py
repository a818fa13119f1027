"""cuBLASLt for the emulated GPU: the `nvmath.bindings.cublasLt` calls kernels/cublaslt.py
makes, answered by numpy under the library's documented contract.

The emulator used to replace the engine's whole `Gemm` class with a numpy GEMM, so the
code that builds descriptors, layouts, preferences and plans had never run anywhere. With
this module in place of the library, the real `Gemm` runs on the emulated GPU, and what the
cuBLASLt documentation (docs.nvidia.com/cuda/cublas, section cuBLASLt API) asks of a
caller is checked:

- every call binds to the real nvmath binding's signature, and where no driver is present
  the real binding is also called, so an argument of the wrong kind raises TypeError as
  it would on a GPU (its library load then fails, which is ignored; see FakeDriver);
- attribute buffers have the size of the attribute's type (the binding's
  `get_*_attribute_dtype`); layouts are column-major with `ld >= rows`;
- the heuristic answers only type combinations of cublasLtMatmul's table that the engine
  uses (compute 32F, scale 32F, A and B bf16, C = D bf16 or float32) and only consistent
  shapes; the algorithm it returns needs no more workspace than the preference allows;
- `matmul` refuses (CUBLAS_STATUS_NOT_SUPPORTED, as the library does) an operand less
  aligned than the preference's minimum alignment, 256 bytes unless set; an algorithm
  from another problem; less workspace than the algorithm needs;
- alpha and beta are read from host memory at the call (the default pointer mode); the
  product runs in stream order and reads and writes only mapped device memory.

The product itself is a float32 numpy GEMM, or with `row_exact` a float64 product per
output column (a token's row in the engine's terms), so that a row never depends on the
others in the batch.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nvmath.bindings import cublas
from nvmath.bindings import cublasLt as real

from tests.emulated_gpu.fake_cuda_driver import _VALIDATE

R_16BF, R_32F = 14, 0  # cudaDataType_t
ITEMSIZE = {R_16BF: 2, R_32F: 4}
COMPUTE_32F = int(cublas.ComputeType.COMPUTE_32F)
# (compute, scale, A/B, C/D) rows of cublasLtMatmul's table of supported types in use here
SUPPORTED = {(COMPUTE_32F, R_32F, R_16BF, R_16BF), (COMPUTE_32F, R_32F, R_16BF, R_32F)}
DEFAULT_ALIGNMENT = 256  # CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES when not set
NOT_SUPPORTED = int(cublas.Status.NOT_SUPPORTED)
INVALID_VALUE = int(cublas.Status.INVALID_VALUE)
_ALGO_WORKSPACE = 1 << 20  # what each fake algorithm asks for, up to the preference's limit


class FakeCublasLtError(Exception):
    """nvmath's cuBLASLtError, which cannot be built without the library."""

    def __init__(self, status: int, what: str) -> None:
        super().__init__(f"{cublas.Status(status).name}: {what}")
        self.status = status


@dataclass(frozen=True)
class _Layout:
    dtype: int
    rows: int
    cols: int
    ld: int


@dataclass
class _Desc:
    compute: int
    scale: int
    attrs: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Problem:
    """What an algorithm is chosen for."""

    compute: int
    scale: int
    trans_a: bool
    trans_b: bool
    a: _Layout
    b: _Layout
    c: _Layout
    d: _Layout


@dataclass(frozen=True)
class _Algo:
    problem: _Problem
    alignment: tuple[int, int, int, int]  # A, B, C, D, as the preference promised
    workspace: int


def host_array(ptr: int, n: int, dtype: Any) -> np.ndarray:
    """`n` elements of `dtype` at address `ptr`, as a writable numpy view."""
    size = n * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=dtype, count=n)


def _scalar(ptr: int, dtype: Any) -> Any:
    return host_array(ptr, 1, dtype)[0]


class FakeCublasLt:
    """The module `kernels.cublaslt._cublaslt()` returns, on an emulated driver."""

    MatmulDescAttribute = real.MatmulDescAttribute
    MatmulPreferenceAttribute = real.MatmulPreferenceAttribute
    MatmulHeuristicResult = real.MatmulHeuristicResult

    def __init__(self, drv: Any, row_exact: bool = False) -> None:
        self.drv = drv
        self.row_exact = row_exact
        self._ids = itertools.count(0x10000, 16)
        self._lock = threading.Lock()
        self.handles: set[int] = set()
        self.descs: dict[int, _Desc] = {}
        self.layouts: dict[int, _Layout] = {}
        self.prefs: dict[int, dict[int, int]] = {}
        self.algos: dict[int, _Algo] = {}
        self.matmuls = 0

    def live_objects(self) -> int:
        """Handles, descriptors, layouts and preferences not destroyed yet."""
        return len(self.handles) + len(self.descs) + len(self.layouts) + len(self.prefs)

    # -- plumbing --------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> None:
        inspect.signature(getattr(real, name)).bind(*args)
        if _VALIDATE:  # no driver: the real binding converts the arguments, then fails
            try:
                getattr(real, name)(*args)
            except TypeError:
                raise
            except Exception:
                pass

    def _new(self) -> int:
        return next(self._ids)

    @staticmethod
    def _get(table: dict[int, Any] | set[int], key: int, what: str) -> Any:
        if key not in table:
            raise FakeCublasLtError(INVALID_VALUE, f"{what} {key:#x} is not live")
        return table[key] if isinstance(table, dict) else key

    @staticmethod
    def _read_attr(dtype: Any, buf: int, size: int, what: str) -> int:
        want = np.dtype(dtype).itemsize
        if size != want:
            raise FakeCublasLtError(INVALID_VALUE, f"{what}: {size} bytes, its type has {want}")
        return int(_scalar(buf, dtype))

    # -- handle ----------------------------------------------------------------------

    def create(self) -> int:
        self._call("create")
        h = self._new()
        self.handles.add(h)
        return h

    def destroy(self, handle: int) -> None:
        self._call("destroy", handle)
        self.handles.remove(self._get(self.handles, handle, "handle"))

    # -- descriptors and layouts ------------------------------------------------------

    def matmul_desc_create(self, compute_type: int, scale_type: int) -> int:
        self._call("matmul_desc_create", compute_type, scale_type)
        d = self._new()
        self.descs[d] = _Desc(compute_type, scale_type)
        return d

    def matmul_desc_set_attribute(self, desc: int, attr: int, buf: int, size: int) -> None:
        self._call("matmul_desc_set_attribute", desc, attr, buf, size)
        self._get(self.descs, desc, "matmul descriptor").attrs[attr] = self._read_attr(
            real.get_matmul_desc_attribute_dtype(attr), buf, size, f"matmul attribute {attr}")

    def matmul_desc_destroy(self, desc: int) -> None:
        self._call("matmul_desc_destroy", desc)
        self._get(self.descs, desc, "matmul descriptor")
        del self.descs[desc]

    def matrix_layout_create(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        self._call("matrix_layout_create", dtype, rows, cols, ld)
        if dtype not in ITEMSIZE or rows < 1 or cols < 1 or ld < rows:
            raise FakeCublasLtError(INVALID_VALUE,
                                    f"layout type {dtype} {rows}x{cols} ld {ld} (column-major)")
        h = self._new()
        self.layouts[h] = _Layout(dtype, rows, cols, ld)
        return h

    def matrix_layout_destroy(self, layout: int) -> None:
        self._call("matrix_layout_destroy", layout)
        self._get(self.layouts, layout, "layout")
        del self.layouts[layout]

    def matmul_preference_create(self) -> int:
        self._call("matmul_preference_create")
        h = self._new()
        self.prefs[h] = {}
        return h

    def matmul_preference_set_attribute(self, pref: int, attr: int, buf: int,
                                        size: int) -> None:
        self._call("matmul_preference_set_attribute", pref, attr, buf, size)
        self._get(self.prefs, pref, "preference")[attr] = self._read_attr(
            real.get_matmul_preference_attribute_dtype(attr), buf, size,
            f"preference attribute {attr}")

    def matmul_preference_destroy(self, pref: int) -> None:
        self._call("matmul_preference_destroy", pref)
        self._get(self.prefs, pref, "preference")
        del self.prefs[pref]

    # -- heuristic and matmul ---------------------------------------------------------

    def _problem(self, desc: int, a: int, b: int, c: int, d: int) -> _Problem:
        md = self._get(self.descs, desc, "matmul descriptor")
        ta = md.attrs.get(int(real.MatmulDescAttribute.TRANSA), 0)
        tb = md.attrs.get(int(real.MatmulDescAttribute.TRANSB), 0)
        if ta not in (0, 1) or tb not in (0, 1):
            raise FakeCublasLtError(NOT_SUPPORTED, f"operations {ta}, {tb}")
        la, lb, lc, ld = (self._get(self.layouts, h, "layout") for h in (a, b, c, d))
        m, k = (la.cols, la.rows) if ta else (la.rows, la.cols)
        k2, n = (lb.cols, lb.rows) if tb else (lb.rows, lb.cols)
        if k != k2 or (lc.rows, lc.cols) != (m, n) or (ld.rows, ld.cols) != (m, n):
            raise FakeCublasLtError(INVALID_VALUE, f"op(A) {m}x{k}, op(B) {k2}x{n}, "
                                    f"C {lc.rows}x{lc.cols}, D {ld.rows}x{ld.cols}")
        if la.dtype != lb.dtype or lc.dtype != ld.dtype or \
                (md.compute, md.scale, la.dtype, ld.dtype) not in SUPPORTED:
            raise FakeCublasLtError(NOT_SUPPORTED, f"types {md}, {la}, {lb}, {ld}")
        return _Problem(md.compute, md.scale, bool(ta), bool(tb), la, lb, lc, ld)

    def matmul_algo_get_heuristic(self, handle: int, desc: int, a: int, b: int, c: int,
                                  d: int, pref: int, requested: int, results: int,
                                  count: int) -> None:
        self._call("matmul_algo_get_heuristic", handle, desc, a, b, c, d, pref, requested,
                   results, count)
        self._get(self.handles, handle, "handle")
        problem = self._problem(desc, a, b, c, d)
        prefs = self._get(self.prefs, pref, "preference")
        pa = real.MatmulPreferenceAttribute
        align = tuple(prefs.get(int(attr), DEFAULT_ALIGNMENT) for attr in (
            pa.MIN_ALIGNMENT_A_BYTES, pa.MIN_ALIGNMENT_B_BYTES, pa.MIN_ALIGNMENT_C_BYTES,
            pa.MIN_ALIGNMENT_D_BYTES))
        workspace = min(prefs.get(int(pa.MAX_WORKSPACE_BYTES), 0), _ALGO_WORKSPACE)
        if requested < 1:
            raise FakeCublasLtError(INVALID_VALUE, "requested_algo_count < 1")
        algo_id = self._new()
        with self._lock:
            self.algos[algo_id] = _Algo(problem, align, workspace)  # type: ignore[arg-type]
        out = np.frombuffer((ctypes.c_char * real.matmul_heuristic_result_dtype.itemsize)
                            .from_address(results), real.matmul_heuristic_result_dtype)
        out["algo"]["data_"][0] = [algo_id, *[0] * 7]
        out["workspace_size"][0] = workspace
        out["state"][0] = 0
        out["waves_count"][0] = 1.0
        host_array(count, 1, np.int32)[0] = 1

    def matmul(self, handle: int, desc: int, alpha: int, a: int, adesc: int, b: int,
               bdesc: int, beta: int, c: int, cdesc: int, d: int, ddesc: int, algo: int,
               workspace: int, workspace_size: int, stream: int) -> None:
        self._call("matmul", handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d,
                   ddesc, algo, workspace, workspace_size, stream)
        self._get(self.handles, handle, "handle")
        problem = self._problem(desc, adesc, bdesc, cdesc, ddesc)
        with self._lock:
            chosen = self.algos.get(int(_scalar(algo, np.uint64)))
        if chosen is None or chosen.problem != problem:
            raise FakeCublasLtError(INVALID_VALUE, "the algorithm was chosen for another "
                                    "problem (or by no heuristic)")
        for name, ptr, need in zip("ABCD", (a, b, c, d), chosen.alignment):
            if ptr % need:
                raise FakeCublasLtError(NOT_SUPPORTED, f"{name} at {ptr:#x} is not {need}-byte "
                                        "aligned, as the algorithm's preference promised")
        if workspace_size < chosen.workspace:
            raise FakeCublasLtError(INVALID_VALUE, f"workspace {workspace_size} bytes, the "
                                    f"algorithm needs {chosen.workspace}")
        al, be = float(_scalar(alpha, np.float32)), float(_scalar(beta, np.float32))
        self.matmuls += 1
        self.drv.enqueue(stream, lambda: self._run(problem, al, a, b, be, c, d, workspace,
                                                   chosen.workspace))

    def _matrix(self, ptr: int, lay: _Layout) -> np.ndarray:
        """The column-major matrix at `ptr` as a (rows, cols) float view or copy."""
        from eagerlm.kernels.device_tensor import from_bf16_bits

        n = (lay.cols - 1) * lay.ld + lay.rows
        raw = host_array(ptr, n, np.uint16 if lay.dtype == R_16BF else np.float32)
        vals = from_bf16_bits(raw) if lay.dtype == R_16BF else raw
        return np.lib.stride_tricks.as_strided(
            vals, (lay.rows, lay.cols), (vals.itemsize, vals.itemsize * lay.ld))

    def _run(self, p: _Problem, alpha: float, a: int, b: int, beta: float, c: int, d: int,
             workspace: int, workspace_bytes: int) -> None:
        from eagerlm.kernels.device_tensor import to_bf16_bits

        for name, ptr, lay in (("A", a, p.a), ("B", b, p.b), ("C", c, p.c), ("D", d, p.d)):
            nbytes = ((lay.cols - 1) * lay.ld + lay.rows) * ITEMSIZE[lay.dtype]
            if not self.drv._device_ok(ptr, nbytes):
                raise RuntimeError(f"cublasLtMatmul: {name} [{ptr:#x}, +{nbytes}) is not "
                                   "mapped device memory")
        if workspace_bytes and not self.drv._device_ok(workspace, workspace_bytes):
            raise RuntimeError("cublasLtMatmul: the workspace is not mapped device memory")
        op_a = self._matrix(a, p.a)
        op_b = self._matrix(b, p.b)
        op_a, op_b = (op_a.T if p.trans_a else op_a), (op_b.T if p.trans_b else op_b)
        if self.row_exact:
            a64 = op_a.astype(np.float64)
            prod = np.stack([a64 @ col for col in op_b.T.astype(np.float64)], axis=1)
        else:
            prod = op_a.astype(np.float32) @ op_b.astype(np.float32)
        out = alpha * prod
        if beta != 0.0:
            out = out + beta * self._matrix(c, p.c)
        out = out.astype(np.float32)
        lay = p.d
        n = (lay.cols - 1) * lay.ld + lay.rows
        if lay.dtype == R_16BF:
            raw = host_array(d, n, np.uint16)
            out_bits = to_bf16_bits(out)
        else:
            raw = host_array(d, n, np.float32)
            out_bits = out
        np.lib.stride_tricks.as_strided(raw, (lay.rows, lay.cols),
                                        (raw.itemsize, raw.itemsize * lay.ld))[:] = out_bits
