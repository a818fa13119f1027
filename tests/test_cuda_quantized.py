"""Weight matrices kept on the GPU as their GGUF blocks (kernels/cuda_quantized.py,
kernels/cuda/quant_matrix.cu): the fused GEMV, the tile path, the embedding lookup, the
loader and the memory check, and whole models against the cpu backend.

Reference: the same product in float64 over gguf-py's dequantization of the same random
blocks (`quants.dequantize`; llama.cpp's values for Q1_0, tests/block_reference.py), of the
bf16 activations the kernels read. The kernels'
own error is float32 accumulation and, for bf16 outputs, one rounding: `close`'s bf16
bound. Shapes are odd on purpose: output rows not a multiple of a GEMV block's four warps,
nor of a tile, inputs a few blocks wide (a lane with no unit to read), 1, 3 and 8 rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from eagerlm.kernels.device_tensor import DeviceTensor
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests import block_reference
from tests.cuda_testing import (  # noqa: F401  (fixtures)
    bf16,
    close,
    device,
    gemm_ops,
    ops,
    quantized_paths,
    rand,
    rng,
)

# every type (kernels/cuda_weight_types.py), in ggml's order
ALL_TYPES = [Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
             Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS, Q.IQ1_S, Q.IQ4_NL, Q.IQ3_S, Q.IQ2_S,
             Q.IQ4_XS, Q.IQ1_M, Q.BF16, Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4, Q.Q1_0]
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
BLOCK_TYPES = [t for t in ALL_TYPES if t not in FLOAT_TYPES]  # the int8 GEMV's


def _blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks of a `rows` x `cols` matrix, uint8 [rows, row bytes]: quantized
    from random floats where gguf-py can, else random bytes with small finite scales
    (every other field of a K-quant, IQ or NVFP4 block is a bounded integer); Q1_0's drawn
    from llama.cpp's fixture."""
    from eagerlm.loader.synthetic import random_blocks

    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    if qtype in block_reference.LLAMA_CPP_TYPES:
        return block_reference.fixture_blocks(qtype, n_blocks, rng).reshape(rows, -1)
    try:
        raw = quants.quantize(rand(rows, cols), qtype)
    except NotImplementedError:
        raw = random_blocks(qtype, rng.random(n_blocks) * 0.1 + 0.001, rng)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // block * type_size)


def _cols(qtype: Q, units: int) -> int:
    """A row of about `units` 32-value units, whole blocks."""
    block = max(32, GGML_QUANT_SIZES[qtype][0])
    return -(-units * 32 // block) * block


def _on_device(ops, qtype: Q, raw: np.ndarray, cols: int):
    from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix

    t = ops.upload(raw)
    return DeviceQuantizedMatrix(t.ptr, qtype, (raw.shape[0], cols), t)


def _reference(x: np.ndarray, raw: np.ndarray, qtype: Q, bias: np.ndarray | None, *,
               bf16_weights: bool = False) -> np.ndarray:
    """float64 x @ W^T (+ bias), W gguf-py's (llama.cpp's) values of the blocks (rounded to
    bf16 first with `bf16_weights`: what the tile path multiplies)."""
    w = block_reference.dequantize(raw, qtype).astype(np.float32).reshape(raw.shape[0], -1)
    if bf16_weights:
        w = bf16(w)
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if bias is None else y + bias


def _linear(ops, x: np.ndarray, w, bias: np.ndarray | None, logits: bool) -> np.ndarray:
    ops.lm_head = w if logits else None
    b = None if bias is None else ops.upload(bias.astype(np.float32))
    y = ops.linear(ops.upload(x, "bf16"), w, b)
    ops.lm_head = None
    assert y.dtype == ("f32" if logits else "bf16")
    return ops.to_numpy(y)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
def test_fused_gemv_shares_rows_between_warps_and_takes_up_to_eight_rows(ops, qtype) -> None:
    """The GEMV's loop, the same for every type: 1, 3 and 8 rows (the most one launch
    takes), 37 output rows of 70 or 72 units of 32 values (Q4_0 blocks, or 9 K-quant
    super-blocks); each row's units shared by 1, 2 or 4 warps (so a lane reads three units,
    or two, or one, or none); with a bias, and float32 logits."""
    from eagerlm.kernels.cuda_quantized import warps_per_row

    cols = 32 * 70 if GGML_QUANT_SIZES[qtype][0] == 32 else 256 * 9
    assert warps_per_row(cols) == 2
    raw = _blocks(qtype, 37, cols)
    w = _on_device(ops, qtype, raw, cols)
    bias = rand(37)
    q = ops.quantized
    for n, per_row in ((1, None), (3, 1), (3, 2), (3, 4), (8, None)):
        q.gemv_warps_per_row = per_row
        try:
            assert q.uses_gemv(n, w, ops.empty((n, cols), "bf16"))
            x = rand(n, cols)
            close(_linear(ops, x, w, bias, False), _reference(x, raw, qtype, bias))
            if per_row is None:
                close(_linear(ops, x, w, None, False), _reference(x, raw, qtype, None))
                want = _reference(x, raw, qtype, bias)
                got = _linear(ops, x, w, bias, True)
                np.testing.assert_allclose(got, want, rtol=1e-4,
                                           atol=1e-4 * np.abs(want).max())
        finally:
            q.gemv_warps_per_row = None


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_fused_gemv_equals_float64_dequantize_then_matmul(ops, qtype) -> None:
    """Every type's decoder in the float GEMV: 13 output rows (not a multiple of a block's
    four rows) of about 9 units (whole blocks: 9 units, or 10 of NVFP4, 12 of Q1_0, 16 of
    a super-block type), one row with a bias and bf16 out, then 5 rows over 4 warps per row
    (most lanes idle) as float32 logits; the weights are gguf-py's values exactly (F16's
    not rounded to bf16), so only float32 accumulation and the output's rounding differ."""
    cols = _cols(qtype, 9)
    raw = _blocks(qtype, 13, cols)
    w = _on_device(ops, qtype, raw, cols)
    assert w.nbytes == raw.nbytes
    bias = rand(13)
    x = rand(1, cols)
    assert ops.quantized.uses_gemv(1, w, ops.empty((1, cols), "bf16"))
    close(_linear(ops, x, w, bias, False), _reference(x, raw, qtype, bias))
    ops.quantized.gemv_warps_per_row = 4
    try:
        x = rand(5, cols)
        want = _reference(x, raw, qtype, None)
        got = _linear(ops, x, w, None, True)
    finally:
        ops.quantized.gemv_warps_per_row = None
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _int8_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as quantize_q8 makes it: int8 per 32 values, scale max |x| / 127 (float32), values
    rounded to nearest even; returns (q, scales)."""
    runs = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(runs).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(amax == 0, 0, np.rint(runs / d))
    return q.astype(np.int8).reshape(x.shape), d.reshape(-1)


def test_activations_quantize_to_int8_as_llama_cpps_q8(ops) -> None:
    """Bit for bit the numpy statement: scales, and values (ties to even), a run of zeros
    all zeros."""
    x = rand(3, 96)
    x[1, 32:64] = 0.0
    q, d = ops.quantized.quantize_q8(ops.upload(x, "bf16"), 9)
    want_q, want_d = _int8_activations(x)
    np.testing.assert_array_equal(ops.to_numpy(q).view(np.int8).reshape(3, 96), want_q)
    np.testing.assert_array_equal(ops.to_numpy(d), want_d)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_int8_gemv_equals_float64_product_of_the_int8_activations(ops, qtype) -> None:
    """The dp4a GEMV (`gemv_int8`) of every block type: the float64 product of the blocks'
    values and the activations as quantize_q8 rounds them; 1 row with a bias (bf16 out),
    then 8 rows over 4 warps per row as float32 logits; and within 3e-2 of the exact
    product (int8 activations' error)."""
    cols = _cols(qtype, 9)
    raw = _blocks(qtype, 13, cols)
    w = _on_device(ops, qtype, raw, cols)
    bias = rand(13)
    q = ops.quantized
    q.gemv_int8 = True
    try:
        for n, per_row, logits in ((1, None, False), (8, 4, True)):
            q.gemv_warps_per_row = per_row
            x = rand(n, cols)
            xq, d = _int8_activations(x)
            seen = (xq.reshape(-1, 32).astype(np.float64) * d[:, None]).reshape(x.shape)
            want = _reference(seen, raw, qtype, bias)
            got = _linear(ops, x, w, bias, logits)
            if logits:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
            else:
                close(got, want)
            exact = _reference(x, raw, qtype, bias)
            assert np.linalg.norm(got - exact) < 3e-2 * np.linalg.norm(exact)
    finally:
        q.gemv_int8 = False
        q.gemv_warps_per_row = None


def test_float_types_have_no_int8_gemv_and_take_the_float_one(ops) -> None:
    """With `gemv_int8`, an F16 matrix (no integers to multiply) still takes the float
    GEMV, exact in its weights."""
    raw = _blocks(Q.F16, 5, 96)
    w = _on_device(ops, Q.F16, raw, 96)
    assert w.type.gemv8 is None
    ops.quantized.gemv_int8 = True
    try:
        x = rand(2, 96)
        close(_linear(ops, x, w, None, False), _reference(x, raw, Q.F16, None))
    finally:
        ops.quantized.gemv_int8 = False


def test_long_rows_get_more_warps() -> None:
    from eagerlm.kernels.cuda_quantized import warps_per_row

    assert [warps_per_row(n) for n in (64, 1024, 2048, 3072, 4096, 14336)] == [1, 1, 2, 2, 4, 4]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_tile_path_equals_float64_dequantize_then_matmul(gemm_ops, qtype, monkeypatch) -> None:
    """Many rows, every type: bf16 tiles of the blocks into the scratch, each multiplied
    into its columns of the output (a BF16 matrix multiplied as it is). Tiles of 64 rows
    here, so a 150-row matrix takes three, the last one short; 11 rows of x, with a bias,
    then the float32 logits of 9 rows. The reference rounds the weights to bf16 as the
    tiles do (and is within 1e-2 of the exact product's norm)."""
    import eagerlm.kernels.cuda_quantized as cq

    ops = gemm_ops
    cols = 256
    monkeypatch.setattr(cq, "TILE_ELEMENTS", 64 * cols)
    assert cq.tile_rows((150, cols)) == 64
    raw = _blocks(qtype, 150, cols)
    w = _on_device(ops, qtype, raw, cols)
    bias = rand(150)
    x = rand(11, cols)
    assert not ops.quantized.uses_gemv(11, w, ops.empty((11, cols), "bf16"))
    got = _linear(ops, x, w, bias, False)
    # the bias is added to the product already rounded to bf16, as on the bf16 path
    product = bf16(_reference(x, raw, qtype, None, bf16_weights=True))
    close(got, product + bias)
    close(got, _reference(x, raw, qtype, bias), rel=1e-2, ulps=1e9)  # bf16 weights' error
    x = rand(9, cols)
    got = _linear(ops, x, w, None, True)
    want = _reference(x, raw, qtype, None, bf16_weights=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_gemv_types_fall_back_to_tiles_when_told_or_when_x_is_unaligned(gemm_ops) -> None:
    """`gemv_max_rows = 0` sends every product to the tile path (benchmarks compare the
    two); so does an activation whose address the GEMV's 16-byte loads cannot read."""
    ops = gemm_ops
    raw = _blocks(Q.Q4_K, 5, 256)
    w = _on_device(ops, Q.Q4_K, raw, 256)
    x = rand(2, 256)
    assert ops.quantized.uses_gemv(2, w, ops.empty((2, 256), "bf16"))
    ops.quantized.gemv_max_rows = 0
    try:
        assert not ops.quantized.uses_gemv(2, w, ops.empty((2, 256), "bf16"))
        tiled = _linear(ops, x, w, None, False)
    finally:
        ops.quantized.gemv_max_rows = 8
    close(tiled, _reference(x, raw, Q.Q4_K, None, bf16_weights=True))
    buf = ops.empty((2 * 256 + 8,), "bf16")
    assert not ops.quantized.uses_gemv(2, w, DeviceTensor(buf.ptr + 2, (2, 256), "bf16", buf))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_embedding_rows_of_a_block_table_are_gguf_values_times_the_scale(ops, qtype) -> None:
    """Equal to the bit to gguf-py's float32 value times the scale (the cpu backend's
    lookup); an id outside the vocabulary gives a NaN row."""
    raw = _blocks(qtype, 6, 256)
    table = _on_device(ops, qtype, raw, 256)
    ids = np.array([5, 0, 3, 6, 5], np.int32)
    got = ops.to_numpy(ops.embed(table, ids, 1.5))
    values = block_reference.dequantize(raw, qtype).astype(np.float32).reshape(6, 256)
    np.testing.assert_array_equal(got[[0, 1, 2, 4]], values[[5, 0, 3, 5]] * np.float32(1.5))
    assert np.isnan(got[3]).all()


# -- loading and memory ------------------------------------------------------------------


def _spec(architecture: str = "qwen3", **kw):
    from eagerlm.loader.synthetic import SyntheticSpec

    base = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                vocab_size=320, weight_type=Q.Q4_K, output_type=Q.Q6_K,
                embedding_type=Q.Q5_0)
    return SyntheticSpec(architecture, **{**base, **kw})


def test_quantized_weights_are_the_files_blocks_and_bf16_keeps_the_old_path(ops,
                                                                            tmp_path) -> None:
    """Each matrix of a block type is uploaded as it is (its bytes equal the file's); the
    memory check counts the blocks and the tile scratch, which the backend then holds;
    with weights="bf16" every matrix is bf16, as before quantized weights."""
    from eagerlm.kernels.cuda_backend import device_weight_bytes, free_weights, load_cuda_weights
    from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import write_synthetic_model

    model = ModelFile.open(write_synthetic_model(tmp_path / "q.gguf", _spec()))
    held, _ = load_cuda_weights(model, ops)
    try:
        matrices = [w for w in held.handles() if isinstance(w, DeviceQuantizedMatrix)]
        assert {w.qtype for w in matrices} == {Q.Q4_K, Q.Q6_K, Q.Q5_0}
        assert held.token_embd.qtype == Q.Q5_0 and held.output.qtype == Q.Q6_K
        for name, info in model.gguf.tensors.items():
            if len(info.shape) == 2:
                w = next(m for m in matrices if m.shape == info.shape
                         and m.qtype == info.qtype and _bytes(ops, m).tobytes()
                         == model.gguf.tensor_bytes(name).tobytes())
                assert w.nbytes == info.n_bytes
        blocks = sum(w.nbytes for w in matrices)
        vectors = sum(t.nbytes for t in held.handles() if isinstance(t, DeviceTensor))
        assert device_weight_bytes(model) == blocks + vectors + ops.quantized.scratch_bytes
        assert ops.quantized.scratch_bytes == 512 * 256 * 2  # the largest matrix, one tile
    finally:
        free_weights(held)
    as_bf16, _ = load_cuda_weights(model, ops, weights="bf16")
    try:
        assert all(isinstance(t, DeviceTensor) for t in as_bf16.handles())
        assert as_bf16.output.dtype == "bf16"
        bf16_bytes = sum(t.nbytes for t in as_bf16.handles())
        assert device_weight_bytes(model, "bf16") == bf16_bytes > 3 * blocks
    finally:
        free_weights(as_bf16)


def _bytes(ops, m) -> np.ndarray:
    return ops.to_numpy(DeviceTensor(m.ptr, (m.nbytes,), "u8"))


def test_weights_choices_are_checked_per_backend() -> None:
    from eagerlm.errors import InvalidParameters
    from eagerlm.service.api.model_loading import check_weights

    check_weights(None, "cuda")
    check_weights("bf16", "cuda:1")
    check_weights("quantized", "cuda")
    check_weights("float", "cpu")
    with pytest.raises(InvalidParameters, match="'quantized' or 'bf16'"):
        check_weights("float", "cuda")
    with pytest.raises(InvalidParameters, match="'quantized' or 'float'"):
        check_weights("bf16", "cpu")


def test_open_model_hands_the_weights_choice_to_the_cuda_backend(gemm_ops, tmp_path) -> None:
    """What `--weights` and `Engine.open(weights=...)` reach: blocks by default, bf16
    matrices with "bf16"."""
    from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix
    from eagerlm.loader.synthetic import write_synthetic_model
    from eagerlm.service.api.model_loading import open_model

    path = write_synthetic_model(tmp_path / "m.gguf", _spec(n_layers=1))
    for weights, held in ((None, DeviceQuantizedMatrix), ("bf16", DeviceTensor)):
        loaded = open_model(path, "cuda", weights=weights)
        try:
            assert isinstance(loaded.transformer.weights.layers[0].wq, held)
        finally:
            loaded.close()


# -- whole models ------------------------------------------------------------------------


@pytest.mark.parametrize("types", ["q4_k_m", "q5_0", "q4_k_m-int8", "f16"])
def test_model_logits_on_quantized_weights_match_the_cpu_backend(gemm_ops, device, tmp_path,
                                                                 types, monkeypatch) -> None:
    """A prompt of 12 tokens (the tile path), then 3 decode steps (the GEMV), against the
    cpu backend on the same file (float32 weights: the exact dequantized values): within
    bf16 activations' error of the float32 logits. Q4_K_M's mix (Q4_K, the lm head Q6_K,
    here a Q5_0 embedding) on qwen3, also through the int8 GEMV, and the demo model's
    (Q5_0 matrices, a Q8_0 embedding) on qwen2, whose q/k/v biases the GEMV adds; and an
    F16 file, its matrices and embedding kept as F16 (the float GEMV and lookup exact in
    them, the prompt's tiles rounded to bf16)."""
    from eagerlm.kernels.batch import ForwardBatch
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix
    from eagerlm.kernels.device_tensor import KV_DTYPE, ContiguousDeviceKV
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import write_synthetic_model

    spec = {"q5_0": _spec(architecture="qwen2", weight_type=Q.Q5_0, output_type=Q.Q5_0,
                          embedding_type=Q.Q8_0),
            "f16": _spec(weight_type=Q.F16, output_type=Q.F16, embedding_type=Q.F16),
            }.get(types) or _spec()
    model = ModelFile.open(write_synthetic_model(tmp_path / f"{types}.gguf", spec))
    cfg = model.config
    cpu = cpu_transformer(model, weights="float")
    gpu = cuda_transformer(model, ops=CudaOps(device, poison_outputs=True))
    assert isinstance(gpu.weights.layers[0].wq, DeviceQuantizedMatrix)
    assert isinstance(gpu.weights.token_embd, DeviceQuantizedMatrix)
    gpu.ops.quantized.gemv_int8 = types.endswith("int8")
    paths = quantized_paths(gpu.ops, monkeypatch)
    lay = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    kv_cpu = ContiguousKV(lay, 32)
    kv_gpu = ContiguousDeviceKV(gpu.ops, KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                                  KV_DTYPE), 32)
    ids = rng.integers(0, cfg.vocab_size, 12).astype(np.int32)
    steps = [(ids, 0, np.arange(12))] + [(ids[i:i + 1], 12 + i, np.arange(1))
                                         for i in range(3)]
    for tokens, n_past, rows in steps:
        want = cpu.forward(ForwardBatch.single(tokens, n_past, kv_cpu, rows))
        got = np.asarray(gpu.forward(ForwardBatch.single(tokens, n_past, kv_gpu, rows)))
        close(got, want, rel=5e-2, ulps=1e9)
        margin = np.diff(np.sort(want, -1)[:, -2:], axis=-1)[:, 0]
        decisive = margin >= 0.05
        assert (got.argmax(-1) == want.argmax(-1))[decisive].all()
    assert paths == {"gemv", "tile"}

