"""The forward's row-wise ops on the cpu, compiled (numba, cached on disk, GIL released).

RMS norm (alone and fused with the residual add) and the rotary embedding's rotation are a
few numpy calls each; at decode, on rows of a few hundred values, numpy's per-call
overhead is the whole cost: 8-20 µs per norm and per rope, 108 norms and 36 ropes per token
of the demo model, all of it holding the GIL. Compiled, each is one call of 1-3 µs that
releases the GIL, which also leaves the host threads of eager dispatch more of the round
to overlap with. The gated FFN activation (SwiGLU, GeGLU) is compiled too, on
kernels/cpu_vector_math.py's vector exp: the decode replay (kernels/cpu_decode_program.py)
must compute the bits the ops compute, and it cannot call numpy.

Each kernel computes what kernels/numpy_ops.py's docstrings specify, in float32, with
`fastmath` sums (a different order than numpy's pairwise sums: the tests hold them to a
float64 computation within float32 rounding). Inputs are C-contiguous float32, seen as
rows `[n, features]` (the callers reshape).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from eagerlm.kernels.cpu_vector_math import gated_oai_row, gated_row
from eagerlm.kernels.numba_settings import JIT
from eagerlm.loader.config import Activation

# `fastmath` without the no-NaN / no-inf promises, so an overflow stays visible
_JIT = {**JIT, "fastmath": {"reassoc", "contract", "nsz", "arcp"}}
_ONE = np.float32(1.0)


@njit(inline="always", **_JIT)
def _norm_row(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    d = x.shape[0]
    s = np.float32(0.0)
    for j in range(d):
        s += x[j] * x[j]
    r = _ONE / np.sqrt(s / np.float32(d) + np.float32(eps))
    for j in range(d):
        out[j] = x[j] * r * w[j]


@njit(**_JIT)
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = x / sqrt(mean(x^2) + eps) * w, per row of x `[n, d]`."""
    for i in range(x.shape[0]):
        _norm_row(x[i], w, eps, out[i])


@njit(**_JIT)
def add_rms_norm(residual: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float,
                 h: np.ndarray, out: np.ndarray) -> None:
    """h = residual + x; out = rms_norm(h) * w, per row."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            h[i, j] = residual[i, j] + x[i, j]
        _norm_row(h[i], w, eps, out[i])


@njit(**_JIT)
def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dim: int, neox: bool,
         out: np.ndarray) -> None:
    """Rotate the first `dim` values of each head of x `[T, heads, head_dim]` by the
    angles of row t of cos, sin `[T, dim / 2]`; the rest of each head is copied. Pair i is
    (i, i + dim / 2) with `neox`, else (2i, 2i + 1)."""
    half = dim // 2
    n_tok, n_heads, hd = x.shape
    for t in range(n_tok):
        c, s = cos[t], sin[t]
        for h in range(n_heads):
            xr, orow = x[t, h], out[t, h]
            for i in range(half):
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = xr[ia], xr[ib]
                orow[ia] = a * c[i] - b * s[i]
                orow[ib] = a * s[i] + b * c[i]
            for j in range(dim, hd):
                orow[j] = xr[j]


@njit(**_JIT)
def gated(gate: np.ndarray, up: np.ndarray, gelu: bool, out: np.ndarray) -> None:
    """out = act(gate) * up per row `[n, d]`: SiLU (SwiGLU) or with `gelu` GELU's tanh
    approximation (GeGLU), eight values at a time through kernels/cpu_vector_math.py's exp
    (libm's scalar exp took six times as long), each value alone: a row's values are the
    same bits in any batch, and in the decode replay (kernels/cpu_decode_program.py),
    which calls this for its rows."""
    for i in range(gate.shape[0]):
        gated_row(gate[i], up[i], gelu, out[i])


@njit(**_JIT)
def gated_oai(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """`gated` for gpt-oss's clamped SwiGLU (cpu_vector_math's `gated_oai_row`): a kernel
    of its own, compiled only for a model that has it (kernels/cpu_compile.py's experts
    group), so that every other model's first load does not compile it."""
    for i in range(gate.shape[0]):
        gated_oai_row(gate[i], up[i], out[i])


# `gated_kind`'s codes, as the decode replay's ACT step holds them
SILU, GELU, SILU_OAI = 0, 1, 2


def gated_kind(act: Activation) -> int:
    """The code of a model's activation (`gated` for SILU and GELU, `gated_oai`)."""
    return {Activation.SWIGLU: SILU, Activation.GEGLU: GELU,
            Activation.SWIGLU_OAI: SILU_OAI}[act]


KERNELS = (rms_norm, add_rms_norm, rope, gated)  # for kernels/cpu_compile.py


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every kernel on one-value inputs."""
    x = np.ones((1, 2), np.float32)
    w = np.ones(2, np.float32)
    rms_norm(x, w, 1e-6, np.empty_like(x))
    add_rms_norm(x, x, w, 1e-6, np.empty_like(x), np.empty_like(x))
    for neox in (True, False):
        rope(x.reshape(1, 1, 2), x[:, :1], x[:, :1], 2, neox, np.empty((1, 1, 2), np.float32))
    gated(x, x, False, np.empty_like(x))  # (gelu a run-time bool: one compile)
