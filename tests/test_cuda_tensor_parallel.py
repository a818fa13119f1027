"""Tensor parallelism on the cuda backend: a model over 2 and 4 emulated GPUs
(tests/emulated_gpu/: N devices, NCCL as fake_nccl.py) against the same model on one, in
both emulator schedules; on a machine with several GPUs, the same over them.

Tolerance: the cuda backend's activations are bf16 and each device's share of a
sub-layer's output is rounded to bf16 before NCCL sums it (as vLLM all-reduces in the
activation type), where one device rounds the whole sum once: the logits agree within
bf16 rounding (1.5e-2 of their largest magnitude), not float32's. The cpu backend's
float32 test (test_tensor_parallel.py) holds the forward to float32 rounding.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.tensor_parallel import cuda_group
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from tests.cuda_testing import SCHEDULE_VARIABLE

SPECS = {
    "llama": tiny_spec("llama", n_layers=1),
    "qwen2": tiny_spec("qwen2", n_layers=1, tied_embeddings=True),
    "qwen3": tiny_spec("qwen3", n_layers=1, n_kv_heads=1),
    "gemma3": tiny_spec("gemma3", n_layers=2, tied_embeddings=True, final_logit_softcap=30.0),
    # mixtures: every expert's features split (whole 32-value units on each of 4
    # devices: the cuda expert products' unit), the router whole; gpt-oss's sinks by
    # head, its output biases on device 0 alone (loader/sharding.py)
    "qwen3moe": tiny_spec("qwen3moe", n_layers=1, d_ff_expert=128),
    "gpt-oss": tiny_spec("gpt-oss", n_layers=2, d_ff_expert=128),
}
PROMPT = [1, 17, 300, 42, 42, 7]


@pytest.fixture(params=[pytest.param("gpu", marks=pytest.mark.gpu), "emulated",
                        "emulated-reverse"])
def gpus(request, monkeypatch):
    """How many devices there are: every GPU of the machine (the test skips below 2), or
    4 emulated ones."""
    if request.param == "gpu":
        from eagerlm.vmm.cuda_driver import NoCudaDevice, device_count

        try:
            have = device_count()
        except NoCudaDevice:
            have = 0
        if have < 2:
            pytest.skip(f"tensor parallelism needs 2 CUDA devices, {have} present")
        yield have
        return
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    if request.param == "emulated-reverse":
        monkeypatch.setenv(SCHEDULE_VARIABLE, "reverse")
    with emulated_gpu_for_test(devices=4):
        yield 4


def _logits(model: ModelFile, n: int) -> list[np.ndarray]:
    group = cuda_group(model, n, poison_outputs=True)
    try:
        kvs = [group.transformers[r].ops.contiguous_kv(group.kv_layout(r), 32)
               for r in range(n)]
        out = [group.forward([ForwardBatch.single(PROMPT, 0, kv, np.arange(len(PROMPT)))
                              for kv in kvs])]
        for step, t in enumerate([5, 300]):
            out.append(group.forward([ForwardBatch.single([t], len(PROMPT) + step, kv)
                                      for kv in kvs]))
        for kv in kvs:
            kv.free()
        return out
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(SPECS))  # the families it splits
def test_logits_over_two_and_four_gpus_equal_one_gpus_within_bf16_rounding(gpus, tmp_path,
                                                                           arch):
    spec = SPECS[arch]
    model = ModelFile.open(write_synthetic_model(tmp_path / f"{arch}.gguf", spec))
    ref = _logits(model, 1)
    for n in (n for n in (2, 4) if n <= gpus):
        for a, b in zip(ref, _logits(model, n), strict=True):
            assert np.isfinite(b).all()
            np.testing.assert_allclose(b, a, rtol=0, atol=1.5e-2 * np.abs(a).max())


def _on_threads(fns):
    """Run each device's part on its own thread (a collective waits for every device)."""
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def test_the_all_reduce_is_captured_into_a_graph_and_replayed_on_emulated_gpus(monkeypatch):
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.nccl_collective import NcclCollective, init_communicators
    from eagerlm.vmm.cuda_driver import cu, driver
    from eagerlm.vmm.device import open_device
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    with emulated_gpu_for_test(devices=2) as drv:
        devices = [open_device(f"cuda:{r}") for r in range(2)]
        comms = init_communicators([0, 1])
        ops = [CudaOps(d, collective=NcclCollective(c, r, 2))
               for r, (d, c) in enumerate(zip(devices, comms, strict=True))]
        xs = [o.upload(np.full(8, r + 1.0, np.float32)) for r, o in enumerate(ops)]
        graphs: list = [None, None]

        def capture(r: int) -> None:
            o, d = ops[r], driver()
            o.ctx.bind()
            with o.capturing():
                cu("cuStreamBeginCapture", o.stream.handle,
                   d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                o.all_reduce(xs[r])
                graphs[r] = cu("cuGraphInstantiate",
                               cu("cuStreamEndCapture", o.stream.handle), 0)
        _on_threads([lambda r=r: capture(r) for r in range(2)])
        assert drv.nccl.comms[0].clique.calls == 0  # recorded, not run

        def replay(r: int) -> None:
            ops[r].ctx.bind()
            cu("cuGraphLaunch", graphs[r], ops[r].stream.handle)
        for _ in range(2):  # 1 + 2 = 3, then 3 + 3 = 6 on both devices
            _on_threads([lambda r=r: replay(r) for r in range(2)])
        for r in range(2):
            np.testing.assert_array_equal(ops[r].to_numpy(xs[r]), np.full(8, 6.0))


def test_the_emulated_gpus_nccl_holds_calls_to_nccl4pys_signatures_and_rules():
    from eagerlm.vmm.device import open_device
    from tests.emulated_gpu.fake_nccl import FakeNcclError
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    with emulated_gpu_for_test(devices=2) as drv:
        d0, d1 = open_device("cuda:0"), open_device("cuda:1")
        nccl = drv.nccl
        c0, c1 = nccl.comm_init_all(2, [0, 1])
        buf = d0.alloc(64)
        s0, s1 = d0.stream("s"), d1.stream("s")
        f32, total = int(nccl.DataType.Float32), int(nccl.RedOp.Sum)
        with pytest.raises(TypeError):  # a float where the binding takes size_t
            nccl.all_reduce(buf.ptr, buf.ptr, 16.0, f32, total, c0, int(s0.handle))
        with pytest.raises(TypeError):  # one argument short
            nccl.all_reduce(buf.ptr, buf.ptr, 16, f32, c0, int(s0.handle))
        with pytest.raises(FakeNcclError, match="not a stream of device 0"):
            nccl.all_reduce(buf.ptr, buf.ptr, 16, f32, total, c0, int(s1.handle))
        with pytest.raises(FakeNcclError, match="InvalidArgument"):  # past the buffer
            nccl.all_reduce(buf.ptr, buf.ptr, 17, f32, total, c0, int(s0.handle))
        with pytest.raises(FakeNcclError, match="devlist"):
            nccl.comm_init_all(2, [0, 0])
        nccl.comm_abort(c1)
        with pytest.raises(FakeNcclError, match="not a live communicator"):
            nccl.all_reduce(buf.ptr, buf.ptr, 16, f32, total, c1, int(s1.handle))
        s0.close()
        s1.close()
        buf.free()


def test_the_dispatcher_over_two_emulated_gpus_gives_each_request_its_run_alone(tmp_path):
    """Phase 2 on cuda: one control thread per emulated GPU, NCCL's all-reduces and the
    token broadcast through the fake NCCL, decode rounds through each device's own graphs.
    Each request's tokens are its run alone through the sequential loop over the same two
    GPUs (the emulated GEMM computes each row alone, so batching and padding change no
    bit), and every GPU's pages come back.

    The graphs: device 1 replays its share of every round device 0 replays, of every
    kind (penalties, logprobs, and a constrained request's forward-only rounds, whose
    logit rows are in sampling order: a follower gathering its rows in another order
    would hand the free requests other rows' logits), capturing at the same rounds."""
    import re

    from eagerlm.dispatch.follower_thread import DeviceGroup
    from eagerlm.dispatch.speculation import SpeculationConfig
    from eagerlm.errors import InvalidParameters
    from eagerlm.kernels.sampling import Constraint, SamplingParams
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test
    from tests.test_dispatcher import run_workload
    from tests.test_tensor_parallel_dispatch import alone, make

    spec = tiny_spec("qwen3", n_layers=2, context_length=96)
    model = ModelFile.open(write_synthetic_model(tmp_path / "q.gguf", spec))
    pattern = "(cat|mat|sat)( (cat|mat|sat)){2}"
    with emulated_gpu_for_test(row_exact_gemm=True, devices=2):
        group = cuda_group(model, 2)
        try:
            devices = [tf.ops.device for tf in group.transformers]
            # a penalized request and the constrained one end first: the batch's bucket (8)
            # then sees rounds of other kinds, each captured at its first round
            reqs = [(k, model.tokenizer.encode(f"the cat {k} sat on the mat"),
                     SamplingParams(temperature=0.0 if k % 2 else 0.8, seed=k,
                                    max_tokens=3 if k == 4 else 14, ignore_eos=True,
                                    frequency_penalty=0.7 if k == 4 else 0.0,
                                    logprobs=2 if k == 5 else None)) for k in range(6)]
            constrained = (6, model.tokenizer.encode("say it:"),
                           SamplingParams(temperature=0.0, max_tokens=20,
                                          constraint=Constraint.regex(pattern)))
            with pytest.raises(InvalidParameters, match="speculative"):  # not on cuda yet
                make((model, group), devices=devices, budget=None, memory_fraction=0.02,
                     speculation=SpeculationConfig("ngram"))
            d = make((model, group), devices=devices, budget=None, memory_fraction=0.02)
            assert isinstance(d.group, DeviceGroup)
            try:
                col = run_workload(d, [constrained, *reqs])
                d.flush()
                assert all(p.n_free == p.n_pages for p in d.pools)
                leader, follower = d.control._graphs, d.followers[0].graphs
                assert leader.adjusted_replays and leader.logprob_replays
                assert leader.forward_replays
                assert len({key[:2] for key in leader.steps}) < len(leader.steps)
                assert follower.shard_replays == leader.replays
                assert follower.captured == leader.captured and not follower.failures
            finally:
                d.shutdown()
            for key, prompt, params in reqs:
                assert col.result(key) == alone((model, group), prompt, params), key
            assert re.fullmatch(pattern, col.result(6)[1]), col.result(6)[1]
        finally:
            group.close()


def test_engine_load_with_tensor_parallel_2_on_two_emulated_gpus(tmp_path):
    """The front door on cuda: the model over two (emulated) GPUs through the engine; its
    greedy completion is the sequential loop's over a group of the same two GPUs, and a
    third GPU that is not there is refused naming the setting."""
    from eagerlm.errors import InvalidParameters
    from eagerlm.kernels.sampling import SamplingParams
    from eagerlm.service.api.engine import Engine
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test
    from tests.test_tensor_parallel_dispatch import alone

    path = write_synthetic_model(tmp_path / "q.gguf",
                                 tiny_spec("qwen3", n_layers=2, context_length=96))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with emulated_gpu_for_test(row_exact_gemm=True, devices=2):
        with pytest.raises(InvalidParameters, match="tensor_parallel 3"):
            Engine.load(path, "cuda", tensor_parallel=3)
        with Engine.load(path, "cuda", tensor_parallel=2, memory_fraction=0.02) as e:
            assert e.loaded.group is not None and e.loaded.group.size == 2
            prompt = e.tokenizer.encode("the cat sat")
            tokens = [t for out in e.dispatcher.stream(prompt, params)
                      for t in out.token_ids]
        model = ModelFile.open(path)
        group = cuda_group(model, 2)
        try:
            assert tokens == alone((model, group), prompt, params)[0]
        finally:
            group.close()
