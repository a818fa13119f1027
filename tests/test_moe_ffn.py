"""The mixture-of-experts FFN (`Ops.moe_ffn`) on the cpu against a float64 numpy reference.

Reference: `reference_moe` below, written from llama.cpp's build_moe_ffn (llama-graph.cpp)
in float64, row by row: router logits (+ bias), the gating (softmax over all experts, or
sigmoid; or top-k of the logits then a softmax over the k), top k, the weights normalized
by their sum (clamped at 6.1e-5) and scaled, each chosen expert's gated FFN (+ biases)
weighted and summed, plus a shared expert (sigmoid-gated) where there is one. Quantized
experts are dequantized by gguf-py (`gguf.quants`) for it. The cuda backend's kernels are
checked against the same reference in tests/test_cuda_moe.py.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from eagerlm.kernels import cpu_moe
from eagerlm.kernels.cpu_moe import ExpertMatrices, route
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.loader.config import Activation, ExpertGating, MoEConfig
from eagerlm.loader.synthetic import RANDOM_BYTE_TYPES, random_blocks
from eagerlm.loader.weights import MoEWeights
from tests.reference_forward import eight_bit


def _act64(g: np.ndarray, u: np.ndarray, act: Activation) -> np.ndarray:
    if act is Activation.SWIGLU_OAI:
        g = np.minimum(g, 7.0)
        return g / (1 + np.exp(-1.702 * g)) * (np.clip(u, -7.0, 7.0) + 1)
    return g / (1 + np.exp(-g)) * u


def reference_moe(x: np.ndarray, w: dict[str, np.ndarray | None], moe: MoEConfig,
                  act: Activation, eight_bit_group: int = 0) -> np.ndarray:
    """build_moe_ffn in float64, one row at a time (`w` holds float64 arrays). With
    `eight_bit_group`, each expert product's input is first rounded to 8 bits per that
    many values, as llama.cpp (and the cpu kernels) multiply quantized weights."""
    def rounded(v: np.ndarray) -> np.ndarray:
        return eight_bit(v, eight_bit_group) if eight_bit_group else v

    out = np.zeros(x.shape, np.float64)
    for r, h in enumerate(x.astype(np.float64)):
        logits = w["router"] @ h
        if w["router_bias"] is not None:
            logits = logits + w["router_bias"]
        if moe.gating is ExpertGating.SOFTMAX:
            e = np.exp(logits - logits.max())
            scores = e / e.sum()
        elif moe.gating is ExpertGating.SIGMOID:
            scores = 1 / (1 + np.exp(-logits))
        else:
            scores = logits
        chosen = np.argsort(-scores, kind="stable")[:moe.n_used]
        weights = scores[chosen]
        if moe.gating is ExpertGating.SOFTMAX_WEIGHT:
            e = np.exp(weights - weights.max())
            weights = e / e.sum()
        if moe.normalize:
            weights = weights / max(weights.sum(), 6.103515625e-5)
        weights = weights * moe.scale
        for wgt, ex in zip(weights, chosen, strict=True):
            g = w["gate"][ex] @ rounded(h) + (0 if w["gate_bias"] is None else
                                              w["gate_bias"][ex])
            u = w["up"][ex] @ rounded(h) + (0 if w["up_bias"] is None else w["up_bias"][ex])
            y = w["down"][ex] @ rounded(_act64(g, u, act))
            out[r] += wgt * (y + (0 if w["down_bias"] is None else w["down_bias"][ex]))
        if moe.d_ff_shared:
            y = w["shared_down"] @ _act64(w["shared_gate"] @ h, w["shared_up"] @ h, act)
            if w["shared_router"] is not None:
                y = y / (1 + math.exp(-float(w["shared_router"][0] @ h)))
            out[r] += y
    return out


def _experts(rng: np.random.Generator, shape: tuple[int, int, int],
             qtype: Q) -> tuple[ExpertMatrices | np.ndarray, np.ndarray]:
    """Random experts held as the cpu backend holds them, and their float64 values."""
    values = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    if qtype == Q.F32:
        return values, values.astype(np.float64)
    if qtype in RANDOM_BYTE_TYPES:  # gguf-py cannot quantize these: random blocks
        block = GGML_QUANT_SIZES[qtype][0]
        scales = rng.uniform(0.5, 1.5, values.size // block) * 2e-3
        raw = random_blocks(qtype, scales, rng).reshape(-1, shape[-1] // block *
                                                        GGML_QUANT_SIZES[qtype][1])
    else:
        raw = quants.quantize(values.reshape(-1, shape[-1]), qtype)
    held = ExpertMatrices.of(qtype, shape, np.ascontiguousarray(raw).reshape(-1))
    exact = quants.dequantize(raw, qtype).reshape(shape).astype(np.float64)
    return held, exact


def _layer(seed: int, moe: MoEConfig, d: int, qtype: Q
           ) -> tuple[MoEWeights, dict[str, np.ndarray | None]]:
    rng = np.random.default_rng(seed)
    e, ff = moe.n_experts, moe.d_ff
    held: dict[str, object] = {}
    exact: dict[str, np.ndarray | None] = {}
    router = rng.standard_normal((e, d)).astype(np.float32)
    held["router"], exact["router"] = router, router.astype(np.float64)
    for name, shape in (("gate", (e, ff, d)), ("up", (e, ff, d)), ("down", (e, d, ff))):
        held[name], exact[name] = _experts(rng, shape, qtype)
    for name, shape in (("router_bias", (e,)), ("gate_bias", (e, ff)), ("up_bias", (e, ff)),
                        ("down_bias", (e, d))):
        b = (0.5 * rng.standard_normal(shape)).astype(np.float32) if moe.biases else None
        held[name] = b
        exact[name] = None if b is None else b.astype(np.float64)
    for name, shape in (("shared_gate", (moe.d_ff_shared, d)),
                        ("shared_up", (moe.d_ff_shared, d)),
                        ("shared_down", (d, moe.d_ff_shared)), ("shared_router", (1, d))):
        present = moe.d_ff_shared and (name != "shared_router" or moe.shared_gate)
        m = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32) \
            if present else None
        held[name] = m
        exact[name] = None if m is None else m.astype(np.float64)
    return MoEWeights(**held), exact


CASES = {
    # Mixtral / Qwen3 MoE: softmax over all, top 2 of 8, normalized
    "softmax-normalized": (MoEConfig(8, 2, 48), Activation.SWIGLU),
    # Qwen2 MoE: not normalized, a shared expert behind a sigmoid gate
    "softmax-shared": (MoEConfig(8, 4, 32, normalize=False, d_ff_shared=64, shared_gate=True),
                       Activation.SWIGLU),
    # gpt-oss: top-k of the logits then a softmax, biases, clamped SwiGLU
    "softmax-weight-oai": (MoEConfig(6, 3, 40, gating=ExpertGating.SOFTMAX_WEIGHT,
                                     normalize=False, biases=True), Activation.SWIGLU_OAI),
    "sigmoid-scaled": (MoEConfig(8, 2, 32, gating=ExpertGating.SIGMOID, scale=2.5),
                       Activation.SWIGLU),
    "all-experts": (MoEConfig(4, 4, 32), Activation.SWIGLU),
}


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_ffn_equals_the_float64_reference(case, rows) -> None:
    moe, act = CASES[case]
    d = 64
    held, exact = _layer(rows, moe, d, Q.F32)
    x = np.random.default_rng(100 + rows).standard_normal((rows, d)).astype(np.float32)
    got = NumpyOps().moe_ffn(x, held, moe, act)
    want = reference_moe(x, exact, moe, act)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, 80])
def test_quantized_experts_equal_the_reference_on_their_dequantized_values(qtype, rows) -> None:
    """Experts kept as blocks (one expert's matrix a view of the 3-D tensor's blocks) go
    through the compiled quantized kernels' GEMV at any row count (in runs of `gemv_rows`
    rows), x in 8 bits per 32 values (per 256 for the superblock types). Against float64
    products of gguf-py's dequantized values with the inputs so rounded."""
    moe = MoEConfig(8, 2, 256)
    d = 256
    held, exact = _layer(7, moe, d, qtype)
    x = np.random.default_rng(rows).standard_normal((rows, d)).astype(np.float32)
    got = NumpyOps().moe_ffn(x, held, moe, Activation.SWIGLU)
    want = reference_moe(x, exact, moe, Activation.SWIGLU,
                         eight_bit_group=256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 3, 30])
def test_quantized_experts_grouped_over_the_cores_give_each_expert_paths_bits(rows) -> None:
    """The quantized experts' products go in two jobs over the cores (every chosen
    expert's gate and up, then every down: `cpu_moe._grouped_experts`). Each row gets
    the bits the expert-by-expert path gives it (`cpu_moe._expert`, through the ops'
    `linear`), with biases, a down matrix of another type (Q4_K_M files hold some as
    Q6_K) and products big enough to be split over the cores."""
    moe = MoEConfig(16, 8, 768, biases=True)
    d = 1024
    held, _ = _layer(11, moe, d, Q.Q4_K)
    held.down, _ = _experts(np.random.default_rng(12), (16, d, 768), Q.Q6_K)
    x = np.random.default_rng(rows).standard_normal((rows, d)).astype(np.float32)
    ops = NumpyOps()
    gated = partial(ops.gated_ffn_act, act=Activation.SWIGLU)
    ids, _ = route(x @ held.router.T + held.router_bias, moe)
    groups = [(int(e), np.flatnonzero((ids == e).any(axis=1))) for e in np.unique(ids)]
    got = cpu_moe._grouped_experts(gated, x, held, groups)
    for (e, rows_e), y in zip(groups, got, strict=True):
        want = cpu_moe._expert(ops.linear, gated, x[rows_e], held, e)
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("case", ["softmax-normalized", "sigmoid-scaled", "all-experts",
                                  "softmax-weight-oai"])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(case) -> None:
    """Batch invariance (docs/architecture.md): a row's routing and its weighted sum over
    its experts (in the order of their scores, whatever order a batch groups the experts
    in) are the same bits alone, in a batch, and in the decode replay, which calls the same
    compiled kernels (tests/test_cpu_decode_program.py)."""
    moe, act = CASES[case]
    moe = dataclasses.replace(moe, d_ff=64)  # whole Q8_0 blocks
    d = 256
    held, _ = _layer(21, moe, d, Q.Q8_0)
    x = np.random.default_rng(22).standard_normal((9, d)).astype(np.float32)
    together = NumpyOps().moe_ffn(x, held, moe, act)
    for r in range(len(x)):
        alone = NumpyOps().moe_ffn(x[r:r + 1], held, moe, act)
        np.testing.assert_array_equal(alone[0].view(np.uint32), together[r].view(np.uint32))


def test_a_batch_of_no_rows_gives_no_rows() -> None:
    moe = MoEConfig(8, 2, 256)
    held, _ = _layer(1, moe, 256, Q.Q8_0)
    out = NumpyOps().moe_ffn(np.zeros((0, 256), np.float32), held, moe, Activation.SWIGLU)
    assert out.shape == (0, 256) and out.dtype == np.float32


class _Counting(ExpertMatrices):
    """Experts that record which of them a product asked for."""

    def __init__(self, inner: ExpertMatrices, log: list[tuple[str, int]], name: str) -> None:
        object.__setattr__(self, "qtype", inner.qtype)
        object.__setattr__(self, "shape", inner.shape)
        object.__setattr__(self, "blocks", inner.blocks)
        object.__setattr__(self, "mapped", inner.mapped)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_name", name)

    def expert(self, e: int):  # type: ignore[no-untyped-def]
        self._log.append((self._name, e))
        return super().expert(e)


@pytest.mark.parametrize("rows", [1, 12])
def test_only_the_chosen_experts_are_read_and_each_once_per_matrix(rows) -> None:
    """Decode reads only the k chosen experts' matrices; a batch of rows groups them: every
    expert some row chose is multiplied once per matrix, with all its rows, and no other
    expert is touched."""
    moe = MoEConfig(16, 2, 256)
    d = 256
    held, _ = _layer(3, moe, d, Q.Q8_0)
    log: list[tuple[str, int]] = []
    for name in ("gate", "up", "down"):
        setattr(held, name, _Counting(getattr(held, name), log, name))
    x = np.random.default_rng(5).standard_normal((rows, d)).astype(np.float32)
    NumpyOps().moe_ffn(x, held, moe, Activation.SWIGLU)
    ids, _ = route(x @ held.router.T, moe)
    chosen = set(ids.reshape(-1).tolist())
    for name in ("gate", "up", "down"):
        asked = [e for n, e in log if n == name]
        assert sorted(asked) == sorted(chosen), name
    assert len(chosen) < moe.n_experts  # some experts were left alone


def test_routing_weights_follow_the_gating() -> None:
    """route's ids are in descending order of score and its weights are llama.cpp's."""
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 5.5, 0.0]], np.float32)
    ids, w = route(logits, MoEConfig(4, 2, 8))
    assert ids.tolist() == [[1, 3], [2, 0]]
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(w[0], p[[1, 3]] / p[[1, 3]].sum(), rtol=1e-6)
    ids, w = route(logits, MoEConfig(4, 2, 8, gating=ExpertGating.SOFTMAX_WEIGHT,
                                     normalize=False))
    np.testing.assert_allclose(w[1], np.exp([0.0, -0.5]) / np.exp([0.0, -0.5]).sum(),
                               rtol=1e-6)
    ties = np.array([[1.0, 2.0, 2.0, 1.0]], np.float32)  # equal scores: the lower index first
    assert route(ties, MoEConfig(4, 3, 8))[0].tolist() == [[1, 2, 0]]
