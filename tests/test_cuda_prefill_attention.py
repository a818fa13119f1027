"""The tensor-core prefill attention (kernels/cuda/attention_prefill.cu) against the numpy
reference, and the mma.sync / ldmatrix fragment layouts of kernels/cuda/mma.cuh, on a GPU
(skipped without one) and on the emulated GPU of tests/emulated_gpu/gpu_emulator.py.

Batches mix sessions of different lengths: fresh prompts whose lengths are not multiples of
the kernel's tiles, chunked prefill continuing a cached prefix (n_past > 0), and a single
decode row riding along; GQA groups of 1, 2 and 4 query heads per KV head (and 3 and 7,
whose rows straddle blocks); head dims 64 and 128; full causal attention and a sliding
window.

Tolerance: the kernel rounds the softmax weights P to bf16 for the P.V product (as every
flash-attention kernel does), an error of about 2^-9 relative per weight. An output element
is the weighted average of many V values, so that error is ~1e-3 of the output's scale,
not of the element: an element that happens to be near zero cannot be held to a few bf16
ulps of itself. So each element must be within 4 bf16 ulps of the larger of its own
magnitude and the RMS of its (row, head) output vector, and the whole output within 1e-2
relative error. An indexing or masking mistake is off by the order of the scale itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.cuda_testing import (  # noqa: F401  (fixtures)
    REF,
    appended_batches,
    close,
    device,
    ops,
    rand,
    rng,
    sessions,
)

# (n_past, n_new, capacity): a fresh prompt of 37 rows, a chunk of 20 after 50 cached
# positions, one decode row, a chunk of 70 after 130 (several K/V tiles and, with g >= 2,
# several query tiles).
SPECS = [(0, 37, 40), (50, 20, 72), (9, 1, 12), (130, 70, 200)]


def _run(ops, monkeypatch, specs, hd, n_kv, g, window, *, scale=None):
    n_heads, layer = n_kv * g, 1
    bh, bd, n_tok = appended_batches(ops, specs, n_kv, hd, layer=layer)
    q = rand(n_tok, n_heads, hd)
    scale = 1 / math.sqrt(hd) if scale is None else scale

    # the batch must take the new kernel, whatever CudaOps' start-up check decided
    monkeypatch.setattr(ops, "tensor_core_prefill", True)
    name = f"attention_prefill_hd{hd}"
    kernel = ops.kernels[name]
    launches = []
    real_launch = kernel.launch
    monkeypatch.setattr(kernel, "launch",
                        lambda *a, **kw: (launches.append(a[1]), real_launch(*a, **kw))[1])
    got = ops.attention(bd, layer, ops.upload(q, "bf16").reshape(n_tok, n_heads, hd),
                        scale=scale, window=window)
    assert len(launches) == 1, f"{name} was not launched"
    want = REF.attention(bh, layer, q, scale=scale, window=window)
    close(ops.to_numpy(got), want, row=hd)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("window", [0, 24])
def test_prefill_attention_matches_the_reference(ops, monkeypatch, hd, g, window) -> None:
    _run(ops, monkeypatch, SPECS, hd, 2, g, window)


def test_prefill_attention_long_chunk_many_tiles(ops, monkeypatch) -> None:
    """A 150-row chunk after 100 cached positions, g = 1: two query tiles per KV head, the
    first spanning the causal diagonal over three K/V tiles; a window of 70 makes blocks
    start mid-context and skip whole tiles for some warps."""
    for window in (0, 70):
        _run(ops, monkeypatch, [(100, 150, 256), (0, 16, 16)], 64, 1, 1, window)


@pytest.mark.parametrize("g,hd,window", [(7, 128, 0), (3, 64, 5)])
def test_prefill_attention_groups_not_a_power_of_two(ops, monkeypatch, g, hd, window) -> None:
    """7 query heads per KV head (Qwen2.5-7B's 28 / 4): a block's 128 query vectors end
    mid-row, so rows straddle blocks and warps."""
    _run(ops, monkeypatch, [(3, 45, 64), (200, 17, 240)], hd, 2, g, window)


def test_prefill_attention_peaked_scores(ops, monkeypatch) -> None:
    """Large scores (scale 1): the running max moves between tiles and the rescaling of
    the accumulated output and sums must follow it."""
    _run(ops, monkeypatch, [(60, 40, 100)], 64, 1, 4, 0, scale=1.0)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_mma_fragment_layouts(ops, mode) -> None:
    """D = C + A.B through mma_bf16_16816 with the fragments built by the PTX ISA's tables
    (mode 0) or loaded by ldmatrix (1: B from its columns, as K; 2: .trans from its rows,
    as V). On a GPU this checks mma.cuh against the hardware; under the emulator, it checks
    the emulator's model of the instructions against numpy."""
    a, b = rand(16, 16), rand(16, 16)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    d, a_dev, b_dev = ops.upload(c), ops.upload(a, "bf16"), ops.upload(b, "bf16")
    ops.kernels["mma_selftest"].launch(ops.stream.handle, 1, 32, d.ptr, a_dev.ptr, b_dev.ptr,
                                       mode, smem=3 * 16 * 16 * 2)
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(ops.to_numpy(d), want, rtol=1e-5, atol=1e-5)


def _prefill_batch(ops, hd: int):
    bh, bd, n_tok = appended_batches(ops, [(10, 40, 60), (0, 1, 4)], 2, hd, layer=1)
    return bh, bd, ops.upload(rand(n_tok, 4, hd), "bf16").reshape(n_tok, 4, hd)


def test_by_default_the_kernel_is_used_once_it_agrees_with_the_general_one(
        ops, monkeypatch) -> None:
    """CudaOps.tensor_core_prefill = None (the default): the first prefill batch of a head
    dim runs CudaOps' one-off check of this kernel against attention.cu on the device, and
    on agreement the kernel serves that head dim from then on."""
    fresh = type(ops)(ops.device)
    assert fresh.tensor_core_prefill is None  # the default
    fresh.close()
    monkeypatch.setattr(ops.attn, "prefill_checked", {})  # the shared fixture's: as new
    _, bd, q = _prefill_batch(ops, 64)
    launches = []
    kernel = ops.kernels["attention_prefill_hd64"]
    real = kernel.launch
    kernel.launch = lambda *a, **kw: (launches.append(1), real(*a, **kw))[1]
    try:
        ops.attention(bd, 1, q, scale=0.125, window=0)
        ops.attention(bd, 1, q, scale=0.125, window=0)
    finally:
        del kernel.launch
    assert ops.attn.prefill_checked == {64: True}
    assert len(launches) == 3  # the check's, then one per call


def test_a_kernel_that_disagrees_is_not_used(ops, monkeypatch) -> None:
    """If the kernel's answer on this device differs from attention.cu's (as a wrong mma
    fragment layout would make it), the check says so and the general kernel serves."""
    monkeypatch.setattr(ops.attn, "prefill_checked", {})
    bh, bd, q = _prefill_batch(ops, 128)
    real = type(ops.attn).prefill

    def wrong(self, meta, layer, q, **kw):  # off by a permutation of the head dim
        out = real(self, meta, layer, q, **kw)
        flipped = self.ops.to_numpy(out).reshape(out.shape[0], -1, 128)[..., ::-1]
        return self.ops.upload(np.ascontiguousarray(flipped).reshape(out.shape), "bf16")

    monkeypatch.setattr(type(ops.attn), "prefill", wrong)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        got = ops.attention(bd, 1, q, scale=0.1, window=0)
    assert ops.attn.prefill_checked == {128: False}
    want = REF.attention(bh, 1, ops.to_numpy(q), scale=0.1, window=0)
    close(ops.to_numpy(got), want, row=128)
