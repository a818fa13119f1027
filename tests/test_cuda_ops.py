"""The cuda ops against the numpy reference, on a GPU (skipped without one) and on the
emulated GPU of tests/emulated_gpu/gpu_emulator.py (the same kernels compiled for the host,
run with CUDA's block and warp semantics; cuBLASLt there is
tests/emulated_gpu/fake_cublaslt.py, whose products are numpy's).

Every op runs on fresh random inputs; inputs are rounded to bf16 first, so the comparison
measures the op and not the rounding of its inputs, and outputs are poisoned (NaN bytes)
before each run, so an element a kernel forgets to write fails. Tolerances are bf16's:
relative error of the whole output under 1e-2 and each element within a few bf16 ulps.

Then whole models: logits of synthetic models of each architecture, cuda vs cpu (top-1
agreement >= 99% where the reference is not a near-tie), and greedy generation of 64
tokens (the fraction of prompts with identical tokens is printed and must be a majority).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
)
from eagerlm.loader.config import Activation, RopeParams, RopeStyle
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests import block_reference
from tests.cuda_testing import (  # noqa: F401  (fixtures)
    REF,
    appended_batches,
    bf16,
    close,
    device,
    gemm_ops,
    is_emulated,
    ops,
    rand,
    region_tensor,
    rng,
    sessions,
)

Q = GGMLQuantizationType


# -- elementwise and norms ---------------------------------------------------------------


def test_embed_from_host_and_device_ids(ops) -> None:
    from eagerlm.kernels.device_tensor import DeviceIds

    table = rand(100, 48)
    t = ops.upload(table, "bf16")
    ids = np.array([3, 0, 99, 3], np.int32)
    close(ops.to_numpy(ops.embed(t, ids, 2.0)), REF.embed(table, ids, 2.0), ulps=1)
    rows = ops.upload(np.array([7, -1, 0, 1, 5, -1], np.int32))  # [host id, slot] pairs
    buf = ops.upload(np.array([42, 11], np.int32))
    got = ops.to_numpy(ops.embed(t, DeviceIds(rows.ptr, 3, buf.ptr), 1.0))
    close(got, table[[7, 11, 5]], ulps=0)
    bad = ops.to_numpy(ops.embed(t, np.array([5, 100], np.int32), 1.0))
    assert np.isnan(bad[1]).all() and np.isfinite(bad[0]).all()


@pytest.mark.parametrize("dim,rows", [(64, 5), (300, 3), (5120, 2), (128, 37)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_rms_norm(ops, dim, rows, dtype) -> None:
    x, w = rand(rows, dim, scale=3.0), rand(dim)
    got = ops.rms_norm(ops.upload(x, dtype), ops.upload(w), 1e-6)
    close(ops.to_numpy(got), REF.rms_norm(x, w, 1e-6))


def test_qk_norm_normalizes_each_head(ops) -> None:
    x, w = rand(7, 4, 32), rand(32)
    got = ops.rms_norm(ops.upload(x, "bf16").reshape(7, 4, 32), ops.upload(w), 1e-6)
    close(ops.to_numpy(got), REF.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dim", [64, 1000, 4096])
def test_add_rms_norm(ops, dim) -> None:
    r, x, w = rand(6, dim), rand(6, dim), rand(dim)
    h, y = ops.add_rms_norm(ops.upload(r), ops.upload(x, "bf16"), ops.upload(w), 1e-5)
    want_h, want_y = REF.add_rms_norm(r, x, w, 1e-5)
    close(ops.to_numpy(h), want_h, ulps=0.01)
    close(ops.to_numpy(y), want_y)


@pytest.mark.parametrize("act", [Activation.SWIGLU, Activation.GEGLU])
def test_gated_ffn_act(ops, act) -> None:
    g, u = rand(5, 333, scale=4.0), rand(5, 333)
    got = ops.gated_ffn_act(ops.upload(g, "bf16"), ops.upload(u, "bf16"), act)
    close(ops.to_numpy(got), REF.gated_ffn_act(g, u, act))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_softcap(ops, dtype) -> None:
    x = rand(3, 1000, scale=40.0)
    close(ops.to_numpy(ops.softcap(ops.upload(x, dtype), 30.0)), REF.softcap(x, 30.0))


def test_a_launch_with_more_than_48_kib_of_shared_memory_opts_in_first(ops) -> None:
    """CUDA refuses a launch asking for more dynamic shared memory than 48 KiB unless its
    function opted in (cuFuncSetAttribute); `Kernel.launch` does that when first asked."""
    x = rand(1000, scale=40.0)
    src, out = ops.upload(x, "f32"), ops.empty((1000,), "f32")
    kernel = ops.kernels["softcap_f32"]
    for smem in (64 << 10, 100 << 10, 80 << 10):
        ops.fill(out, 0xFF)
        kernel.launch(ops.stream.handle, 4, 256, out.ptr, src.ptr, 1000, 30.0, smem=smem)
        close(ops.to_numpy(out), REF.softcap(x, 30.0))


def test_a_block_larger_than_the_kernels_launch_bound_is_refused(ops) -> None:
    """attention_decode.cu declares __launch_bounds__(128): CUDA refuses a 256-thread
    block of it at launch (nothing runs, so null pointers are fine), and so does the
    emulated GPU, which reads the bound from the sm_90 cubin."""
    from eagerlm.vmm.cuda_driver import CudaError

    kernel = ops.kernels["attention_decode_hd64_g1"]
    args = [0] * len(kernel.kinds)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        kernel.launch(ops.stream.handle, 1, 256, *args)


def test_the_emulator_refuses_blocks_over_the_register_file(ops, monkeypatch) -> None:
    """A kernel compiled to 128 registers a thread fits 512 threads in an SM's 64K
    registers, not 1024: the emulated GPU refuses the launch with the error a GPU gives."""
    import eagerlm.vmm.cuda_driver
    from eagerlm.kernels.nvrtc_build import KernelResources
    from eagerlm.vmm.cuda_driver import CudaError

    drv = eagerlm.vmm.cuda_driver._driver
    if not is_emulated(ops.device):
        pytest.skip("sets the emulated driver's idea of the kernel's registers")
    kernel = ops.kernels["softcap_f32"]
    monkeypatch.setitem(drv.resources, int(kernel.function), KernelResources(128, None))
    x = ops.upload(rand(64))
    out = ops.empty((64,), "f32")
    kernel.launch(ops.stream.handle, 1, 512, out.ptr, x.ptr, 64, 30.0)
    with pytest.raises(CudaError, match="CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        kernel.launch(ops.stream.handle, 1, 1024, out.ptr, x.ptr, 64, 30.0)
    ops.synchronize()


def test_a_dropped_tensor_is_freed_once_the_stream_reaches_the_free(ops) -> None:
    """Memory goes back in stream order, after the work enqueued before its last reference
    went away. On the emulated GPU freed memory is unmapped, so a kernel that reads a
    tensor its caller had already dropped crashes the test instead of passing by luck (on
    a GPU the pool would hand that memory to the next allocation)."""
    import eagerlm.vmm.cuda_driver

    if not is_emulated(ops.device):
        pytest.skip("reads the emulated driver's allocation table")
    allocs = eagerlm.vmm.cuda_driver._driver.allocs
    host = rand(4096, scale=40.0)
    x = ops.upload(host)
    ptr = x.ptr
    y = ops.softcap(x, 30.0)  # enqueued before the free: it still reads x
    del x
    ops.synchronize()
    assert ptr not in allocs
    close(ops.to_numpy(y), REF.softcap(host, 30.0))


def test_rows(ops) -> None:
    x = rand(9, 70)
    rows = np.array([8, 0, 8, 3], np.int64)
    close(ops.to_numpy(ops.rows(ops.upload(x, "bf16"), rows)), x[rows], ulps=0)


# -- GEMMs (cuBLASLt) -------------------------------------------------------------------


def _padded(ops, host: np.ndarray, offset: int, dtype: str):
    """`host` on the device `offset` bytes into a larger allocation (the base is aligned):
    a view as unaligned as a tensor that starts a few rows into a buffer."""
    pad = np.zeros(offset // (2 if dtype == "bf16" else 4), host.dtype)
    big = ops.upload(np.concatenate([pad, host.reshape(-1)]), dtype)
    return big, big.view_at(offset, host.shape, dtype)


@pytest.mark.parametrize("n_tok,n_in,n_out", [(1, 64, 96), (3, 72, 200), (17, 640, 130)])
def test_linear_equals_the_float64_product(gemm_ops, n_tok, n_in, n_out) -> None:
    """Reference: the float64 product of the same bf16 inputs (numpy). A bf16 output is
    rounded before the bias is added, so an element that cancels is judged against its
    row's RMS."""
    ops = gemm_ops
    x, w, b = rand(n_tok, n_in), rand(n_out, n_in, scale=0.1), rand(n_out)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = ops.linear(ops.upload(x, "bf16"), ops.upload(w, "bf16"))
    close(ops.to_numpy(got), want, row=n_out)
    got = ops.linear(ops.upload(x, "bf16"), ops.upload(w, "bf16"), ops.upload(b))
    close(ops.to_numpy(got), want + b, row=n_out)


@pytest.mark.parametrize("offset", [0, 2, 16, 128])
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_gemm_operands_need_not_be_256_byte_aligned(gemm_ops, offset, out) -> None:
    """cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise; a view
    a few rows into a buffer is less aligned, and must still give the product (reference:
    float64 numpy of the same bf16 inputs)."""
    from eagerlm.kernels.cublaslt import CUDA_R_16BF, CUDA_R_32F

    ops = gemm_ops
    n_tok, n_in, n_out = 5, 64, 48
    x, w = rand(n_tok, n_in), rand(n_out, n_in, scale=0.1)
    _xb, xv = _padded(ops, x, offset, "bf16")
    _wb, wv = _padded(ops, w, offset, "bf16")
    y_offset = offset if out == "bf16" else -(-offset // 4) * 4  # float32: 4-byte aligned
    _yb, yv = _padded(ops, np.full((n_tok, n_out), np.nan, np.float32), y_offset, out)
    ops.gemm.matmul(int(ops.stream.handle), yv.ptr, xv.ptr, wv.ptr, n_tok, n_in, n_out,
                    CUDA_R_32F if out == "f32" else CUDA_R_16BF)
    close(ops.to_numpy(yv), x.astype(np.float64) @ w.astype(np.float64).T, row=n_out)


# -- rope --------------------------------------------------------------------------------


# YaRN as llama.cpp configures it for Qwen's "--rope-scaling yarn --rope-scale 4
# --yarn-orig-ctx 32768" (plus a rope.scaling.attn_factor), and for a layer that keeps its
# own freq_scale 1 under YaRN (gemma3's sliding-window layers): ramp, mscale and all.
YARN = dict(ext_factor=1.0, attn_factor=0.9, original_context=32768)
ROPES = {
    "plain": {},
    "linear": dict(freq_scale=0.5),
    "yarn": dict(freq_scale=0.25, **YARN),
    "yarn-unscaled-layer": dict(freq_scale=1.0, **YARN),
}


@pytest.mark.parametrize("style", [RopeStyle.NORM, RopeStyle.NEOX])
@pytest.mark.parametrize("rope_dim,factors", [(64, False), (32, False), (64, True)])
@pytest.mark.parametrize("scaling", list(ROPES))
def test_rope(ops, style, rope_dim, factors, scaling) -> None:
    x = rand(6, 3, 64)
    pos = np.array([0, 1, 17, 4095, 32767, 131071], np.int32)
    ff = (1.0 + rng.random(rope_dim // 2) * 8).astype(np.float32) if factors else None
    rope = RopeParams(style=style, dim=rope_dim, base=500000.0, **ROPES[scaling])
    if rope.ext_factor:
        low, high = rope.corr_dims()
        assert 0 < low < high < rope_dim // 2  # the ramp lies inside the rotated pairs
    got = ops.rope(ops.upload(x, "bf16").reshape(6, 3, 64), pos, rope,
                   ops.upload(ff) if factors else None)
    close(ops.to_numpy(got), REF.rope(x, pos, rope, ff))


# -- KV cache and attention --------------------------------------------------------------


@pytest.mark.parametrize("hd,n_heads,n_kv", [(16, 4, 2), (64, 8, 8), (128, 16, 4), (256, 4, 1),
                                              (80, 6, 2)])
@pytest.mark.parametrize("window", [0, 7])
def test_kv_append_and_attention(ops, hd, n_heads, n_kv, window, monkeypatch) -> None:
    """A mixed batch (prefill chunks, short and long decode rows) through every attention
    kernel that serves its head dim: the general one, and for 64 and 128 the tensor-core
    prefill kernel too (whatever CudaOps' start-up check decides)."""
    layer = 1
    specs = [(0, 19, 40), (5, 1, 8), (700, 1, 720), (33, 40, 100), (1500, 2, 1600)]
    bh, bd, n_tok = appended_batches(ops, specs, n_kv, hd, n_layers=3, layer=layer)
    q = rand(n_tok, n_heads, hd)
    for sh, sd in zip(bh.seqs, bd.seqs, strict=True):  # the region holds what the reference holds
        got = ops.to_numpy(region_tensor(sd.kv, sh.kv.data.shape))
        np.testing.assert_array_equal(got[: sh.n_total], bf16(sh.kv.data[: sh.n_total]))
    scale = 1 / math.sqrt(hd)
    want = REF.attention(bh, layer, q, scale=scale, window=window)
    for tensor_cores in (False, True) if hd in (64, 128) else (False,):
        monkeypatch.setattr(ops, "tensor_core_prefill", tensor_cores)
        got = ops.attention(bd, layer, ops.upload(q, "bf16").reshape(n_tok, n_heads, hd),
                            scale=scale, window=window)
        close(ops.to_numpy(got), want, row=hd)


def test_decode_attention_splits_long_contexts(ops) -> None:
    """One decode row over 5000 positions: the kernel splits the context and merges."""
    bh, bd, _ = appended_batches(ops, [(5000, 1, 5001)], 2, 128, n_layers=1, layer=0)
    q = rand(1, 8, 128)
    for window in (0, 1000):
        want = REF.attention(bh, 0, q, scale=0.1, window=window)
        got = ops.attention(bd, 0, ops.upload(q, "bf16").reshape(1, 8, 128), scale=0.1,
                            window=window)
        close(ops.to_numpy(got), want)


# -- dequantization ----------------------------------------------------------------------


def _blocks(qtype, n_blocks: int) -> np.ndarray:
    """Random valid blocks: quantized from random floats where gguf-py can, else random
    bytes with small finite scales (K-quants, IQ types, NVFP4: every other field of their
    blocks is a bounded integer, so every bit pattern is a block); Q1_0's from llama.cpp's
    fixture (tests/block_reference.py)."""
    from eagerlm.loader.synthetic import random_blocks

    block, _ = quants.GGML_QUANT_SIZES[qtype]
    if qtype in block_reference.LLAMA_CPP_TYPES:
        return block_reference.fixture_blocks(qtype, n_blocks, rng).reshape(-1)
    try:
        return quants.quantize(rand(n_blocks * block), qtype).reshape(-1)
    except NotImplementedError:
        scales = rng.random(n_blocks) * 0.1 + 0.001
        return random_blocks(qtype, scales, rng).reshape(-1)


# every type gguf-py 0.19 dequantizes (its quants.py), and Q1_0, which it only sizes,
# written out so that a type dropped from the registry fails here
DEQUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K,
                 Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S,
                 Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4,
                 Q.Q1_0]


def test_every_supported_type_has_its_kernels() -> None:
    from eagerlm.kernels.cuda_kernels import SIGNATURES
    from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES
    from eagerlm.loader.weights import SUPPORTED_TYPES

    assert set(WEIGHT_TYPES) == set(SUPPORTED_TYPES) == set(DEQUANT_TYPES)
    for t in WEIGHT_TYPES.values():
        assert set(t.kernels) <= set(SIGNATURES)
        assert (t.gemv8 is not None) == (t.qtype not in (Q.F32, Q.F16, Q.BF16))


@pytest.mark.parametrize("qtype", DEQUANT_TYPES, ids=lambda q: q.name)
def test_dequantization_equals_gguf(ops, qtype) -> None:
    """Reference: gguf-py's `quants.dequantize` of the same bytes (llama.cpp's values for
    Q1_0): the float32 output equal to the bit, the bf16 output that value rounded (within
    one bf16 ulp). 256 blocks: an IQ type's grid lookups then reach nearly every entry of
    its table (IQ1's 2048 included)."""
    from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES
    from eagerlm.kernels.device_tensor import to_bf16_bits

    raw = _blocks(qtype, 256)
    want = block_reference.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    n = want.size
    src = ops.upload(np.ascontiguousarray(raw).view(np.uint8))
    for out_dtype in ("bf16", "f32"):
        out = ops.empty((n,), out_dtype)
        ops.kernels[WEIGHT_TYPES[qtype].dequant(out_dtype)].launch(
            ops.stream.handle, -(-n // 256), 256, out.ptr, src.ptr, n)
        got = ops.to_numpy(out)
        if out_dtype == "f32":
            np.testing.assert_array_equal(got, want)
        else:  # equal after rounding to bf16, or within one bf16 ulp
            diff = np.abs(to_bf16_bits(got).astype(np.int32) -
                          to_bf16_bits(want).astype(np.int32))
            assert diff.max() <= 1


def test_a_model_of_iq_weights_loads_as_the_cpu_backend_dequantizes_it(ops, tmp_path) -> None:
    """IQ matrices through the whole cuda load path with weights="bf16" (slab loader, raw
    upload, the type's dequantization kernel): each matrix is the cpu backend's float32
    weight (gguf-py's dequantization) rounded to bf16, within one ulp; each vector equal.
    (Kept as blocks, the default, they are tests/test_cuda_quantized.py's.)"""
    from eagerlm.kernels.cuda_backend import free_weights, load_cuda_weights
    from eagerlm.kernels.device_tensor import to_bf16_bits
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import SyntheticSpec, write_synthetic_model
    from eagerlm.loader.weights import load_numpy_weights

    spec = SyntheticSpec("qwen3", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2,
                         head_dim=64, d_ff=256, vocab_size=512, weight_type=Q.IQ3_S,
                         embedding_type=Q.IQ4_NL)
    model = ModelFile.open(write_synthetic_model(tmp_path / "iq.gguf", spec))
    weights, _ = load_cuda_weights(model, ops, weights="bf16")
    try:
        want = list(load_numpy_weights(model.gguf, model.config).handles())
        got = list(weights.handles())
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            host = ops.to_numpy(g)
            if g.dtype == "f32":
                np.testing.assert_array_equal(host, w)
            else:
                diff = np.abs(to_bf16_bits(host).astype(np.int32) -
                              to_bf16_bits(w).astype(np.int32))
                assert diff.max() <= 1
    finally:
        free_weights(weights)


# -- whole models ------------------------------------------------------------------------

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
# gemma3 with YaRN by 4 from an original context of 16 (its sliding-window layers keep
# freq_scale 1): the 40 tokens below run well past it
YARN_GEMMA3 = dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_context=16,
                   rope_attn_factor=0.9)


def _model(tmp_path, arch, **kw):
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import SyntheticSpec, write_synthetic_model

    spec = SyntheticSpec(arch, n_layers=3, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
                         d_ff=256, vocab_size=512, weight_type=Q.Q8_0, **kw)
    return ModelFile.open(write_synthetic_model(tmp_path / f"{arch}.gguf", spec))


@pytest.mark.parametrize("arch", [*ARCHS, "gemma3-yarn"])
def test_model_logits_cuda_vs_cpu(gemm_ops, device, tmp_path, arch) -> None:
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import KV_DTYPE, ContiguousDeviceKV

    model = _model(tmp_path, "gemma3", **YARN_GEMMA3) if arch == "gemma3-yarn" else \
        _model(tmp_path, arch)
    cfg = model.config
    cpu = cpu_transformer(model)
    gpu = cuda_transformer(model, ops=CudaOps(device, poison_outputs=True))
    ids = rng.integers(0, cfg.vocab_size, 40).astype(np.int32)
    lay = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    want = cpu.forward(ForwardBatch.single(ids, 0, ContiguousKV(lay, 64), np.arange(40)))
    kv = ContiguousDeviceKV(gpu.ops, KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                              KV_DTYPE), 64)
    got = np.asarray(gpu.forward(ForwardBatch.single(ids, 0, kv, np.arange(40))))
    same = got.argmax(-1) == want.argmax(-1)
    # A random synthetic model's logits are Gaussian-flat: its top two often differ by less
    # than bf16 activations move a logit (about 0.02 here), where either answer is right.
    # Agreement is required where the float32 reference decides by >= 0.05.
    top2 = np.sort(want, -1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] >= 0.05
    print(f"\n{arch}: top-1 agreement {same.mean():.3f} overall, "
          f"{same[decisive].mean():.3f} on the {decisive.sum()} decisive positions")
    assert decisive.mean() >= 0.7
    assert same[decisive].mean() >= 0.99
    close(got, want, rel=5e-2, ulps=1e9)


NEAR_TIE = 0.05  # logits closer than this are a coin toss under bf16 activations


def _greedy(transformer, kv, prompt, steps):
    """Greedy tokens, and at each step the margin between the top two logits."""
    tokens, margins, n_past, batch = [], [], 0, ForwardBatch.single(prompt, 0, kv)
    for _ in range(steps):
        logits = np.asarray(transformer.forward(batch), dtype=np.float32)[0]
        n_past += len(batch.tokens)
        top2 = np.sort(logits)[-2:]
        tokens.append(int(np.argmax(logits)))
        margins.append(float(top2[1] - top2[0]))
        batch = ForwardBatch.single([tokens[-1]], n_past, kv)
    return tokens, margins


def _diverges_only_at_a_near_tie(got, want, margins) -> bool:
    """Identical, or the first differing step is one where the float32 reference's top
    two logits were within NEAR_TIE (after that the two runs continue different texts)."""
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    return k is None or margins[k] < NEAR_TIE


# Random synthetic models have flat (Gaussian) logits: at a few percent of steps their top
# two are within bf16 noise, so over 64 steps a run may take the other branch of a
# near-tie and continue differently. Each run must either match the float32 cpu run
# exactly or part from it only at such a near-tie; the fraction identical is printed.


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_cuda_vs_cpu(gemm_ops, device, tmp_path, arch) -> None:
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import KV_DTYPE, ContiguousDeviceKV

    model = _model(tmp_path, arch)
    cfg = model.config
    cpu = cpu_transformer(model)
    # bf16 matrices: the emulated GEMV makes each step several times slower, and the
    # quantized path's decode is tests/test_cuda_quantized.py's (qwen3, qwen2)
    gpu = cuda_transformer(model, ops=CudaOps(device), weights="bf16")
    same = 0
    lengths, steps = ((3, 17), 24) if is_emulated(device) else ((3, 9, 17, 30, 5), 64)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lengths]
    for prompt in prompts:
        lay = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        want, margins = _greedy(cpu, ContiguousKV(lay, 128), prompt, steps)
        kv = ContiguousDeviceKV(gpu.ops, KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                                  KV_DTYPE), 128)
        got, _ = _greedy(gpu, kv, prompt, steps)
        same += got == want
        assert _diverges_only_at_a_near_tie(got, want, margins)
    print(f"\n{arch}: identical {steps}-token greedy runs {same}/{len(prompts)}")


def test_greedy_generation_through_the_dispatcher_eager_equals_sync(gemm_ops, device,
                                                                      tmp_path) -> None:
    """The same dispatcher on cuda: eager and sync give identical tokens, with and without
    CUDA graphs, and each run matches the cpu backend's or parts from it at a near-tie."""
    from eagerlm.dispatch.control_thread import ControlConfig
    from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    model = _model(tmp_path, "qwen3")
    cfg = model.config
    lengths, steps = ((3, 17, 5), 24) if is_emulated(device) else ((3, 9, 17, 30, 5), 64)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]

    def run(transformer, sync: bool, graphs: bool = True) -> list[list[int]]:
        config = DispatcherConfig(control=ControlConfig(sync=sync, cuda_graphs=graphs),
                                  kv_budget_bytes=64 << 20, memory_fraction=0.05)
        with Dispatcher(device, transformer, model.tokenizer, config) as d:
            return [[t for o in d.stream(p, params) for t in o.token_ids] for p in prompts]

    # bf16 matrices, for the emulator's time: dispatching is the same on quantized ones
    # (tests/test_cuda_graphs.py runs the dispatcher on them)
    gpu = cuda_transformer(model, ops=CudaOps(device), weights="bf16")
    eager = run(gpu, sync=False)
    assert all(len(t) == steps for t in eager)
    assert eager == run(gpu, sync=True)
    assert eager == run(gpu, sync=False, graphs=False)
    cpu = cpu_transformer(model)
    lay = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    same = 0
    for prompt, got in zip(prompts, eager, strict=True):
        want, margins = _greedy(cpu, ContiguousKV(lay, 128), np.array(prompt, np.int32),
                                steps)
        same += got == want
        assert _diverges_only_at_a_near_tie(got, want, margins)
    print(f"\nqwen3 through the dispatcher: identical to cpu {same}/{len(prompts)}")


def test_penalties_and_logprobs_through_the_dispatcher(gemm_ops, device, tmp_path) -> None:
    """Penalized requests with logprobs, eagerly through the dispatcher on cuda, where the
    decode inputs the counts need exist only on the device. The specification: greedy with
    a huge repetition penalty picks, at each step, the most likely token (by the reported
    raw logprobs) not yet in the prompt or the output; eager equals sync; and the logprobs
    agree with the cpu backend's while the two runs' tokens agree."""
    from eagerlm.dispatch.control_thread import ControlConfig
    from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.vmm.device import open_device

    model = _model(tmp_path, "llama")
    steps = 10 if is_emulated(device) else 32
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True,
                            repetition_penalty=1e6, logprobs=MAX_LOGPROBS)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 12)]  # with repeats

    def run(transformer, sync: bool, on=device):
        config = DispatcherConfig(control=ControlConfig(sync=sync), kv_budget_bytes=64 << 20,
                                  memory_fraction=0.05)
        with Dispatcher(on, transformer, model.tokenizer, config) as d:
            outs = [list(d.stream(p, params)) for p in prompts]
        return [([t for o in out for t in o.token_ids],
                 [lp for o in out for lp in (o.logprobs or [])]) for out in outs]

    gpu = run(cuda_transformer(model, ops=CudaOps(device)), sync=False)
    assert [t for t, _ in gpu] == [t for t, _ in run(cuda_transformer(
        model, ops=CudaOps(device)), sync=True)]
    with open_device("cpu") as host:
        cpu = run(cpu_transformer(model), sync=False, on=host)
    for prompt, (got, got_lp), (want, want_lp) in zip(prompts, gpu, cpu, strict=True):
        for tokens, lps in ((got, got_lp), (want, want_lp)):
            assert len(tokens) == len(lps) == steps
            for k, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
                seen = set(prompt) | set(tokens[:k])
                assert t not in seen
                assert lp.token == t and len(lp.top) == MAX_LOGPROBS
                assert t == next(i for i, _ in lp.top if i not in seen)
        same = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), steps)
        for a, b in zip(got_lp[:same], want_lp[:same], strict=True):
            assert abs(a.logprob - b.logprob) < 0.05
        print(f"\nprompt of {len(prompt)}: cuda and cpu agree for {same}/{steps} tokens")
