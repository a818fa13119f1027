"""How compiled code calls a matrix's product kernel: one C signature for every weight type.

kernels/cpu_decode_program.py runs a whole decode forward in one compiled function, so
it cannot call each type's kernel through numba's dispatcher (a compiled caller is
specialised on, and cached by, the functions it calls: one table per mix of types, each
compiled on first use). It calls them through their addresses instead, all of one C
signature, `ROW_KERNEL`:

    kernel(w, x, scales, sums, y, n, k, rows, row_bytes, r0, r1)    every argument int64

computes rows r0 .. r1 - 1 of y `[n, rows]` (float32, at address y) = x @ W^T, where W is
`rows` rows of `row_bytes` bytes at address w, and x is `[n, k]` float32 at address x
(a kernel of float32 activations) or, for a kernel that multiplies 8-bit activations,
their codes at x with their scales and sums at `scales` and `sums`, laid out as
kernels/cpu_activations.py makes them for the type (`quantize_activations` or
`quantize_superblocks`, k padded to `RowKernel.pad`). A type's kernel is a numba `cfunc`
of that signature generated with the type's other kernels (kernels/cpu_kernel_registry.py)
and compiled (and cached) on first use; the table is compiled once for all of them.

A kernel of 8-bit activations comes with the function that makes them from float32 rows,
of the C signature `QUANTIZE`:

    quantize(x, codes, scales, sums, n, k)    every argument int64

which the table runs once per input and quantizer before the products that read them.

`row_kernel(w)` says which kernels serve a matrix the backend holds (a `RowKernel`), or
None where none does (the forward then runs op by op). Float32 matrices are served here
(F32's kernels, kernels/cpu_kernel_registry.py's `FLOAT32`); the quantized types register
theirs (`register`, kernels/quantized.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from numba import types
from numba.extending import intrinsic

from eagerlm.kernels.cpu_kernel_registry import kernels

ROW_KERNEL = types.void(*([types.int64] * 11))
QUANTIZE = types.void(*([types.int64] * 6))


@dataclass(frozen=True)
class RowKernel:
    """A matrix's product kernel (a `ROW_KERNEL`'s address) and, for 8-bit activations,
    the `QUANTIZE` that makes them (its address, 0 for float32 activations) with their
    layout: bytes per row's codes are k padded to `pad`; a row has padded / `scale_group`
    scales and padded / `sum_group` sums (4 bytes each)."""

    address: int
    quantize: int = 0
    scale_group: int = 0
    sum_group: int = 0
    pad: int = 1
    # the most rows of x it takes (more: the forward runs op by op, where such products
    # take the many-rows path)
    max_rows: int = 1 << 30


def _pointer_at(element: types.Type) -> Any:
    @intrinsic
    def at(typingctx, address):
        """The typed pointer at an integer address."""
        sig = types.CPointer(element)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return sig, codegen
    return at


f32_at = _pointer_at(types.float32)
i32_at = _pointer_at(types.int32)
i64_at = _pointer_at(types.int64)
i8_at = _pointer_at(types.int8)
u8_at = _pointer_at(types.uint8)


Resolver = Callable[[Any], "RowKernel | None"]


# Up to this many rows of x, the ops' float32 products (kernels/numpy_ops.py) call the
# replay's float32 row kernel too, not BLAS: a row then gets the same bits in any batch
# and replayed or not (BLAS picks its kernel, and its sums' order, by the row count).
# Past it (long prompts), BLAS's speed: docs/architecture.md, "Batch invariance".
FIXED_ORDER_ROWS = 64


@functools.cache
def _float32_kernel() -> int:
    """F32's row kernel: kernels/cpu_float_loops.py's `gemv` over a float32 matrix's rows
    as bytes (cpu_kernel_registry.FLOAT32), compiled on first use."""
    return kernels(GGMLQuantizationType.F32).row_kernel_address()


@functools.cache
def _float32_call() -> Callable[..., None]:
    return ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 11))(_float32_kernel())


def float32_rows(x: np.ndarray, w: np.ndarray, y: np.ndarray, r0: int, r1: int) -> None:
    """y[:, r0:r1] = x @ w[r0:r1]^T for C-contiguous float32 x `[n, k]`, w `[rows, k]`
    and y `[n, rows]`, by F32's row kernel (through ctypes, which releases the GIL): each
    value summed in an order fixed by k alone, the same bits in any batch."""
    (n, k), rows = x.shape, w.shape[0]
    _float32_call()(w.ctypes.data, x.ctypes.data, 0, 0, y.ctypes.data, n, k, rows, 4 * k,
                    r0, r1)


def warm_up_float32() -> None:
    """Compile (or load from the cache) F32's row kernel."""
    float32_rows(np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32),
                 np.empty((1, 1), np.float32), 0, 1)


def _float32(w: Any) -> RowKernel | None:
    if isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2 \
            and w.flags.c_contiguous:
        return RowKernel(_float32_kernel())
    return None


_resolvers: list[Resolver] = [_float32]


def register(resolver: Resolver) -> None:
    """Add a way to find a matrix's kernels: `resolver(w)` gives the `RowKernel` of the
    matrices it serves, None for the others."""
    _resolvers.append(resolver)


def row_kernel(w: Any) -> RowKernel | None:
    """The kernels that serve `w` in a compiled caller, or None."""
    for resolve in _resolvers:
        found = resolve(w)
        if found is not None:
            return found
    return None
