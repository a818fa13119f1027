"""The pinned slab loader's host-side logic, run for real on the cpu device (streams are
threads, copies are memmoves, events complete when reached), with a numpy expander in
place of the GPU dequantization kernels.

- loading a model gives exactly the weights the numpy loader gives;
- staging buffers are reused by size; sizes that occur once are not pooled and are freed
  when their upload completes;
- a buffer is never handed out again before the event of its last upload completes;
- preparing the next tensor does not wait for the previous upload (the stream can be held
  shut while several tensors are prepared), and the pinned budget makes `take` wait;
- progress reported as bytes uploaded of the total, which the CLI's bar draws with the
  load's size and GB/s, and a report with the load's size, time and GB/s.

The cuda expander (kernels/cuda_backend.py) is tested on a GPU in tests/test_cuda_ops.py.
"""

from __future__ import annotations

import io
import itertools
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from eagerlm.loader.gguf_file import TensorInfo
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.slab_loader import SizePool, SlabLoader
from eagerlm.loader.synthetic import SyntheticSpec, write_synthetic_model
from eagerlm.loader.weights import build_weights, load_numpy_weights
from eagerlm.service.api.model_loading import LoadProgress
from eagerlm.service.api.progress import ProgressBar
from eagerlm.vmm.cpu_device import CpuDevice
from eagerlm.vmm.device import DeviceBuffer, Memory, Stream

Q = GGMLQuantizationType


def _expand_bytes(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    if info.qtype == Q.F32:
        return raw.view(np.float32).reshape(info.shape)
    if info.qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(info.shape)
    rows = raw.reshape(-1, raw.size // max(1, int(np.prod(info.shape[:-1]))))
    return quants.dequantize(rows, info.qtype).astype(np.float32).reshape(info.shape)


class HostWeights:
    """A WeightBuilder for the cpu device: F32 tensors are final, the rest is expanded by
    numpy on the loader's stream thread (where the GPU would run its kernel)."""

    def __init__(self, device: CpuDevice) -> None:
        self.device = device
        self.expanded = 0

    def is_final(self, info: TensorInfo) -> bool:
        return info.qtype == Q.F32

    def wrap(self, buffer: DeviceBuffer, info: TensorInfo) -> np.ndarray:
        return buffer.array.view(np.float32).reshape(info.shape)  # type: ignore[attr-defined]

    def expand(self, stream: Stream, raw: Memory, info: TensorInfo) -> np.ndarray:
        out = self.device.alloc(info.n_elements * 4)
        weight = out.array.view(np.float32).reshape(info.shape)
        src = raw.array[: info.n_bytes]  # type: ignore[attr-defined]

        def run() -> None:
            weight[...] = _expand_bytes(src, info)

        stream.submit(run)  # type: ignore[attr-defined]
        self.expanded += 1
        return weight


@pytest.fixture()
def device():
    d = CpuDevice()
    yield d
    d.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    spec = SyntheticSpec("qwen2", n_layers=3, weight_type=Q.Q8_0, embedding_type=Q.Q4_K,
                         d_model=256, d_ff=512, vocab_size=512)
    return write_synthetic_model(tmp_path_factory.mktemp("slab") / "q.gguf", spec)


def test_loaded_weights_equal_the_numpy_loader(device, model_path) -> None:
    model = ModelFile.open(model_path)
    builder = HostWeights(device)
    loader = SlabLoader(device, model.gguf, builder)
    weights = build_weights(model.gguf, model.config, loader.fetch)
    stats = loader.finish()
    reference = load_numpy_weights(model.gguf, model.config)
    got = list(weights.handles())
    want = list(reference.handles())
    assert len(got) == len(want) == stats.tensors
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert builder.expanded > 0  # the quantized tensors went through the expander
    assert stats.bytes == sum(model.gguf.tensors[n].n_bytes for n in model.gguf.tensors
                              if n != "output.weight" or not model.config.tied_embeddings)


def test_staging_buffers_are_reused_by_size_and_rare_sizes_are_not_pooled(device,
                                                                          model_path) -> None:
    model = ModelFile.open(model_path)
    budget = 512 << 10  # a few tensors' worth: the slab must recycle to stay under it
    loader = SlabLoader(device, model.gguf, HostWeights(device), budget_bytes=budget)
    build_weights(model.gguf, model.config, loader.fetch)
    stats = loader.finish()
    assert stats.staging.peak_bytes <= budget
    sizes = [i.n_bytes for i in model.gguf.tensors.values()]
    rare = [s for s in sizes if sizes.count(s) < 2]
    pooled_tensors = stats.tensors - stats.staging.unpooled
    assert stats.staging.unpooled == len(rare) >= 1  # the embedding, at least
    assert stats.staging.reuses > 0
    assert stats.staging.allocs + stats.staging.reuses == pooled_tensors
    assert stats.staging.allocs < pooled_tensors  # fewer buffers than tensors
    assert loader.staging.held_bytes == 0 and loader.scratch.held_bytes == 0
    assert "GB/s" in stats.report() and stats.gb_per_s > 0


def test_a_buffer_is_not_handed_out_before_its_upload_completes(device) -> None:
    stream = device.stream("upload")
    pool: SizePool = SizePool(device.alloc_host, lambda n: True, budget_bytes=1 << 20)
    gate = stream.gate()
    a = pool.take(4096)
    pool.give_back(a, after=stream.record())  # behind the closed gate
    b = pool.take(4096)
    assert b is not a
    assert pool.stats.allocs == 2 and pool.stats.reuses == 0
    gate.open()
    stream.synchronize()
    c = pool.take(4096)
    assert c is a and pool.stats.reuses == 1
    pool.give_back(b, after=stream.record())
    pool.give_back(c, after=stream.record())
    pool.close()
    assert pool.held_bytes == 0


def test_unpooled_buffers_are_freed_when_their_event_completes(device) -> None:
    stream = device.stream("upload")
    pool: SizePool = SizePool(device.alloc_host, lambda n: n == 64, budget_bytes=1 << 20)
    gate = stream.gate()
    big = pool.take(10_000)
    pool.give_back(big, after=stream.record())
    assert pool.collect() == 0 and pool.held_bytes == 10_000
    gate.open()
    stream.synchronize()
    assert pool.collect() == 1
    assert pool.held_bytes == 0 and not pool.free[10_000]
    with pytest.raises(RuntimeError):
        _ = big.array  # freed, not kept
    assert pool.stats.unpooled == 1


def test_preparing_the_next_tensor_does_not_wait_for_the_previous_upload(device,
                                                                         model_path) -> None:
    model = ModelFile.open(model_path)
    stream = device.stream("loader")
    loader = SlabLoader(device, model.gguf, HostWeights(device), stream=stream)
    gate = stream.gate()  # the "DMA" cannot run
    infos = [model.gguf.tensor_info(f"blk.{i}.attn_q.weight") for i in range(3)]
    weights = [loader.fetch(info) for info in infos]  # returns with nothing uploaded
    assert all(not w.any() for w in weights)
    assert loader.staging.stats.allocs == 3  # one staging buffer per upload in flight
    gate.open()
    loader.finish()
    reference = load_numpy_weights(model.gguf, model.config)
    for i, w in enumerate(weights):
        np.testing.assert_array_equal(w, reference.layers[i].wq)


def test_the_pinned_budget_makes_take_wait_for_the_oldest_upload(device) -> None:
    stream = device.stream("upload")
    pool: SizePool = SizePool(device.alloc_host, lambda n: True, budget_bytes=8192)
    gate = stream.gate()
    for _ in range(2):
        pool.give_back(pool.take(4096), after=stream.record())
    threading.Timer(0.2, gate.open).start()
    third = pool.take(4096)  # over budget: waits for the gate, then reuses a buffer
    assert pool.stats.waits >= 1
    assert pool.stats.allocs == 2 and pool.stats.reuses == 1
    assert pool.held_bytes <= 8192
    pool.give_back(third, after=stream.record())
    pool.close()


def test_progress_counts_bytes_uploaded_from_zero_of_the_total(device, model_path) -> None:
    model = ModelFile.open(model_path)
    seen: list[tuple[int, int]] = []
    loader = SlabLoader(device, model.gguf, HostWeights(device),
                        on_bytes=lambda done, total: seen.append((done, total)))
    build_weights(model.gguf, model.config, loader.fetch)
    stats = loader.finish()
    total = sum(info.n_bytes for info in model.gguf.tensors.values())
    assert seen[0] == (0, total) and seen[-1] == (stats.bytes, total)
    assert len(seen) == stats.tensors + 1
    assert all(a[0] < b[0] and b[1] == total for a, b in itertools.pairwise(seen))


def test_progress_bar_reports_bytes_and_rate() -> None:
    out = io.StringIO()  # not a terminal: one line, once the weights are loaded
    bar = ProgressBar(out)
    bar.update(1_000_000_000, 2_000_000_000)
    bar.update(2_000_000_000, 2_000_000_000)
    text = out.getvalue()
    assert "100%" in text and "2.00/2.00 GB" in text and "GB/s" in text
    assert text.endswith("\n") and text.count("\n") == 1 and "\r" not in text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_redraws_in_place_and_ends_its_line_once() -> None:
    out = _Terminal()
    bar = ProgressBar(out)
    for p in [LoadProgress("header"), LoadProgress("weights", 0, 4_000_000),
              LoadProgress("weights", 4_000_000, 4_000_000),
              LoadProgress("weights", 4_000_000, 4_000_000), LoadProgress("ready", elapsed_s=1.5)]:
        bar(p)
    lines = out.getvalue().split("\n")
    assert lines[0].startswith("\rweights [") and "  0%" in lines[0]
    assert lines[0].count("\r") == 2 and lines[0].count("100%") == 1  # 0%, then 100%
    assert "4.00/4.00 MB" in lines[0] and lines[0].endswith(" MB/s")
    assert lines[1:] == ["loaded in 1.5 s", ""]


@pytest.mark.gpu
def test_cuda_loading_equals_the_numpy_loader_in_bf16(model_path) -> None:
    """On a GPU, with weights="bf16": the slab loader with the dequantization kernels gives
    the numpy loader's weights, rounded to bf16 (matrices) or exact (float32 vectors)."""
    from eagerlm.kernels.cuda_backend import free_weights, load_cuda_weights
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import from_bf16_bits, to_bf16_bits
    from eagerlm.vmm.cuda_driver import NoCudaDevice
    from eagerlm.vmm.device import open_device

    try:
        gpu = open_device("cuda")
    except NoCudaDevice as exc:
        pytest.skip(f"no CUDA device ({exc})")
    try:
        ops = CudaOps(gpu)
        model = ModelFile.open(model_path)
        weights, stats = load_cuda_weights(model, ops, budget_bytes=512 << 10, weights="bf16")
        reference = load_numpy_weights(model.gguf, model.config)
        for got, want in zip(weights.handles(), reference.handles(), strict=True):
            host = ops.to_numpy(got)
            if got.dtype == "f32":
                np.testing.assert_array_equal(host, want)
            else:
                diff = np.abs(to_bf16_bits(host).astype(np.int32)
                              - to_bf16_bits(want).astype(np.int32))
                assert diff.max() <= 1, np.abs(host - from_bf16_bits(to_bf16_bits(want))).max()
        assert stats.staging.reuses > 0
        print(f"\n{stats.report()}")
        free_weights(weights)
        ops.close()
    finally:
        gpu.close()


def test_a_model_too_large_for_the_gpu_is_refused_before_any_upload(model_path,
                                                                     monkeypatch) -> None:
    """On the emulated GPU, counted here from the file's tensor table: with weights="bf16"
    the weights take 2 bytes per matrix element (bf16) and 4 per vector element (float32);
    kept quantized (the default), each matrix its blocks' bytes, plus the tile path's
    scratch (this model's largest matrix in bf16: each fits one tile). With one byte less
    free than that nothing is uploaded, with exactly that the model loads."""
    from eagerlm.kernels.cuda_backend import free_weights, load_cuda_weights
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.weight_memory import ModelTooLarge
    from eagerlm.vmm.device import open_device
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    with emulated_gpu_for_test() as drv:
        gpu = open_device("cuda")
        ops = CudaOps(gpu)
        model = ModelFile.open(model_path)
        tensors = model.gguf.tensors.values()
        as_bf16 = sum(int(np.prod(t.shape)) * (2 if len(t.shape) > 1 else 4) for t in tensors)
        quantized = sum(t.n_bytes if len(t.shape) > 1 else 4 * int(np.prod(t.shape))
                        for t in tensors)
        quantized += max(2 * int(np.prod(t.shape)) for t in tensors)
        for weights, need, held_as in (("bf16", as_bf16, "bf16"),
                                       ("quantized", quantized, "the file's blocks")):
            uploads = drv.calls.get("cuMemcpyHtoDAsync", 0)
            monkeypatch.setattr(gpu, "mem_info", lambda need=need: (need - 1, 80 << 30))
            with pytest.raises(ModelTooLarge, match=held_as):
                load_cuda_weights(model, ops, weights=weights)
            assert drv.calls.get("cuMemcpyHtoDAsync", 0) == uploads
            monkeypatch.setattr(gpu, "mem_info", lambda need=need: (need, 80 << 30))
            weights_held, _ = load_cuda_weights(model, ops, weights=weights)
            assert drv.calls.get("cuMemcpyHtoDAsync", 0) > uploads
            free_weights(weights_held)
        ops.close()
        gpu.close()
