"""The cpu backend's row-wise ops (RMS norm and rope compiled in kernels/cpu_row_ops.py;
the gated activation numpy's), through NumpyOps, each held to the same formula computed
here in float64 numpy: RMS norm alone, per head and fused with the residual add, the
rotary embedding in both pairings with a partial rotary dim, and both gated activations
(SiLU's overflow included)."""

from __future__ import annotations

import numpy as np
import pytest

from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.loader.config import Activation, RopeParams, RopeStyle

RTOL, ATOL = 2e-6, 2e-6  # float32 rounding of values of order one


def f64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


def norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = f64(x)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * f64(w)


@pytest.mark.parametrize("shape", [(1, 640), (7, 33), (5, 4, 256)])
def test_rms_norm_is_the_float64_formula(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = NumpyOps().rms_norm(x, w, 1e-6)
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_allclose(got, norm64(x, w, 1e-6), rtol=RTOL, atol=ATOL)


def test_add_rms_norm_returns_the_sum_and_its_norm():
    rng = np.random.default_rng(1)
    r, x = (rng.standard_normal((6, 100)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(100).astype(np.float32)
    h, normed = NumpyOps().add_rms_norm(r, x, w, 1e-5)
    np.testing.assert_array_equal(h, r + x)  # one float32 add: exact
    np.testing.assert_allclose(normed, norm64(r + x, w, 1e-5), rtol=RTOL, atol=ATOL)


def rope64(x: np.ndarray, positions: np.ndarray, base: float, dim: int,
           neox: bool) -> np.ndarray:
    """Pair i turns by p * base^(-2i / dim): (i, i + dim/2) in NEOX style, else (2i, 2i+1);
    values beyond `dim` unchanged."""
    out = f64(x).copy()
    half = dim // 2
    theta = positions[:, None].astype(np.float64) * base ** (-np.arange(half) * 2.0 / dim)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    ia = np.arange(half) if neox else np.arange(0, dim, 2)
    ib = ia + half if neox else ia + 1
    a, b = f64(x)[..., ia], f64(x)[..., ib]
    out[..., ia] = a * cos - b * sin
    out[..., ib] = a * sin + b * cos
    return out


@pytest.mark.parametrize("style", [RopeStyle.NEOX, RopeStyle.NORM])
@pytest.mark.parametrize("dim", [16, 8])  # 8 of 16: a partial rotary dim
def test_rope_rotates_the_pairs_of_its_style(style, dim):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 4095], np.int32)
    rope = RopeParams(style, dim, 10000.0)
    got = NumpyOps().rope(x, positions, rope)
    want = rope64(x, positions, 10000.0, dim, style is RopeStyle.NEOX)
    # cos and sin are rounded to float32 first (the op's contract): a few ulps more
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., dim:], x[..., dim:])


@pytest.mark.parametrize("act", [Activation.SWIGLU, Activation.GEGLU, Activation.SWIGLU_OAI])
def test_gated_activation_is_the_float64_formula(act):
    """gpt-oss's clamped SwiGLU as ggml's swiglu_oai writes it: the gate clamped above at
    7, up to [-7, 7] (the values past the limits below hit both), gate * sigmoid(1.702
    gate) * (up + 1)."""
    rng = np.random.default_rng(3)
    gate = rng.standard_normal((40, 70)).astype(np.float32) * 4
    gate[0, :3] = [-200.0, 200.0, 0.0]  # exp(-gate) overflows for the first: SiLU -> 0
    up = rng.standard_normal((40, 70)).astype(np.float32) * (4 if act is
                                                             Activation.SWIGLU_OAI else 1)
    got = NumpyOps().gated_ffn_act(gate, up, act)
    g = f64(gate)
    if act is Activation.SWIGLU:
        with np.errstate(over="ignore"):
            want = g / (1 + np.exp(-g)) * f64(up)
    elif act is Activation.SWIGLU_OAI:
        assert (gate > 7).any() and (up > 7).any() and (up < -7).any()
        g = np.minimum(g, 7.0)
        with np.errstate(over="ignore"):
            want = g / (1 + np.exp(-1.702 * g)) * (np.clip(f64(up), -7.0, 7.0) + 1)
    else:
        want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * f64(up)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
