"""Decode rounds replayed as CUDA graphs (kernels/cuda_graphs.py): the same tokens as eager
launches, whatever sessions come and go, on a GPU and on the emulated GPU (whose driver
records a capture and replays it, refusing what CUDA refuses inside one: synchronizing,
recording events, freeing memory the capture did not allocate, leaving capture memory
unfreed)."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pytest

from eagerlm.kernels.cuda_graphs import batch_buckets, context_bucket
from eagerlm.kernels.sampling import SamplingParams
from tests.cuda_testing import device, quantized_paths, rng  # noqa: F401  (fixtures)

FORWARD_SCHEDULE_ONLY = True  # whole models: see tests/cuda_testing.py


def test_batch_buckets_cover_every_size_up_to_the_limit() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(3) == [1, 2, 3]


def test_context_buckets_are_powers_of_two_capped_at_the_context() -> None:
    assert context_bucket(1, 4096) == 512
    assert context_bucket(513, 4096) == 1024
    assert context_bucket(4096, 4096) == 4096
    assert context_bucket(3000, 2500) == 3000  # never below what the round needs


def _run(device, model, transformer, prompts, params, *, graphs: bool, spy: list,
         logprobs: list | None = None, one_by_one: bool = False, prefix_cache: bool = True,
         max_round_tokens: int = 256):
    """Each request's tokens (and into `logprobs`, if given, each one's TokenLogprobs).
    All requests are submitted at once, or with `one_by_one` each after the previous one
    has finished (so later ones may start from the prefix cache)."""
    from eagerlm.dispatch.control_thread import ControlConfig
    from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
    from eagerlm.dispatch.scheduler import SchedulerConfig

    ops = transformer.ops
    make = type(ops).decode_graphs

    def record(*args, **kw):
        g = make(ops, *args, **kw)
        spy.append(g)
        return g

    ops.decode_graphs = record
    try:
        config = DispatcherConfig(
            control=ControlConfig(SchedulerConfig(max_round_tokens=max_round_tokens),
                                  cuda_graphs=graphs, prefix_cache=prefix_cache),
            kv_budget_bytes=64 << 20, memory_fraction=0.05)
        with Dispatcher(device, transformer, model.tokenizer, config) as d:
            queues = [queue.Queue() for _ in prompts]
            outs = []

            def submit(i: int) -> None:
                d.submit(prompts[i], params[i], queues[i].put)

            if not one_by_one:
                for i in range(len(prompts)):
                    submit(i)
            for i, q in enumerate(queues):
                if one_by_one:
                    submit(i)
                tokens, lps, done = [], [], False
                while not done:
                    o = q.get(timeout=600)
                    assert o.error is None, o.error
                    tokens += o.token_ids
                    lps += o.logprobs or []
                    done = o.finish_reason is not None
                outs.append(tokens)
                if logprobs is not None:
                    logprobs.append(lps)
    finally:
        del ops.decode_graphs
    return outs


def _qwen3(tmp_path, **rope: Any):
    from gguf import GGMLQuantizationType

    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import SyntheticSpec, write_synthetic_model

    # head_dim 32: the smallest the flash-decoding kernel serves, so the captured decode
    # rounds run attention_decode.cu (with 16 they would take the general kernel)
    spec = SyntheticSpec("qwen3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                         head_dim=32, d_ff=128, vocab_size=300,
                         weight_type=GGMLQuantizationType.BF16, **rope)
    return ModelFile.open(write_synthetic_model(tmp_path / "q.gguf", spec))


@pytest.fixture
def qwen3(tmp_path):
    return _qwen3(tmp_path)


@pytest.fixture
def qwen3_yarn(tmp_path):
    """YaRN by 4 from an original context of 8: the decode rounds run past it."""
    return _qwen3(tmp_path, rope_scaling="yarn", rope_scaling_factor=4.0,
                  rope_original_context=8)


@pytest.mark.parametrize("model", ["qwen3", "qwen3_yarn"])
def test_graph_replays_give_the_eager_tokens(device, model, request) -> None:
    """Concurrent requests of different lengths (so rounds of 1..5 sessions, padded to
    their bucket), greedy and seeded sampling:
    identical tokens with graphs on and off, and graphs were really replayed (also with
    YaRN, whose rope constants the graphs capture)."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    qwen3 = request.getfixturevalue(model)
    gpu = cuda_transformer(qwen3, ops=CudaOps(device))
    prompts = [rng.integers(0, 300, n).tolist() for n in (3, 11, 6, 20, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 5, 20, 9, 16)]
    params[1] = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14,
                               ignore_eos=True)
    params[3] = SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=9,
                               ignore_eos=True)
    spy_on: list = []
    with_graphs = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=spy_on)
    spy_off: list = []
    without = _run(device, qwen3, gpu, prompts, params, graphs=False, spy=spy_off)
    assert with_graphs == without
    assert [len(t) for t in with_graphs] == [p.max_tokens for p in params]
    (graphs,) = spy_on
    assert graphs.replays > 0 and not graphs.failures
    assert graphs.captured >= 2  # several batch buckets
    assert spy_off[0].replays == 0 and spy_off[0].eager_rounds > 0


@pytest.mark.parametrize("gemv,types", [("float", ("F16", "Q5_0")), ("int8", ("MXFP4", "NVFP4"))],
                         ids=["float-F16", "int8-MXFP4"])
def test_graphs_capture_the_quantized_weights_kernels(device, tmp_path, monkeypatch,
                                                      gemv, types) -> None:
    """Matrices kept as the file's values (F16 matrices and the lm head with a Q5_0
    embedding table; or MXFP4 ones with an NVFP4 table): rounds of 1 and 2 sessions replay
    the fused GEMV (float, or int8 with its activations' quantization), rounds of up to 4
    (bucket 4) the tile path (its dequantization into the fixed scratch and cuBLASLt),
    with the GEMV told to take at most 2 rows; the tokens are those of eager launches.
    Every request is greedy with the int8 GEMV: which sessions share a round depends on
    when the requests reach the control thread, so a row may take the int8 GEMV in one
    run and the tile path in the other, whose logits differ by the activations' 8-bit
    rounding, enough to change a sampled token (a sampled request failed this test once
    in CI, on a loaded machine, at its 8th token)."""
    from gguf import GGMLQuantizationType as Q

    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import SyntheticSpec, write_synthetic_model

    spec = SyntheticSpec("qwen3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                         head_dim=32, d_ff=128, vocab_size=300, weight_type=Q[types[0]],
                         embedding_type=Q[types[1]])
    model = ModelFile.open(write_synthetic_model(tmp_path / "q.gguf", spec))
    gpu = cuda_transformer(model, ops=CudaOps(device))
    assert isinstance(gpu.weights.token_embd, DeviceQuantizedMatrix)
    assert {gpu.weights.output.qtype, gpu.weights.layers[0].wq.qtype} == {Q[types[0]]}
    gpu.ops.quantized.gemv_max_rows = 2
    gpu.ops.quantized.gemv_int8 = gemv == "int8"
    paths = quantized_paths(gpu.ops, monkeypatch)
    prompts = [rng.integers(0, 300, n).tolist() for n in (3, 11, 6, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (8, 4, 10, 6)]
    if gemv == "float":  # (see the docstring)
        params[2] = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10,
                                   ignore_eos=True)
    spy_on: list = []
    with_graphs = _run(device, model, gpu, prompts, params, graphs=True, spy=spy_on)
    without = _run(device, model, gpu, prompts, params, graphs=False, spy=[])
    assert with_graphs == without
    (graphs,) = spy_on
    assert graphs.replays > 0 and not graphs.failures
    assert graphs.captured >= 2  # buckets 1 or 2 (GEMV) and 4 (tiles)
    assert paths == {"gemv", "tile"}


def test_rows_that_read_host_tokens_sample_into_their_sessions_slots(device, qwen3) -> None:
    """A round of one row per session is replayed even when a row reads its token from
    the host rather than the token buffer: the last prompt token of a prompt served from
    the prefix cache, or of a prefill whose last chunk is a single token. Its sample must
    still reach the session's slot, or the next round decodes from a stale token. (It did
    not: every later token of such a session was wrong.) Reference: the same requests
    without the prefix cache, in rounds that prefill whole prompts at once."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    gpu = cuda_transformer(qwen3, ops=CudaOps(device))
    base = rng.integers(0, 300, 9).tolist()
    prompts = [base, base, base[:6] + [7, 8], rng.integers(0, 300, 9).tolist()]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 4
    want = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=[], one_by_one=True,
                prefix_cache=False)
    spy: list = []
    cached = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=spy,
                  one_by_one=True)
    assert cached == want
    assert want[0] == want[1]
    assert spy[0].replays > 0
    chunked = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=[], one_by_one=True,
                   prefix_cache=False, max_round_tokens=8)  # 9 = 8 + a 1-row round
    assert chunked == want


def test_graphs_capture_the_general_attention_kernel_too(device, qwen3) -> None:
    """Head dims the flash-decoding kernel does not serve decode with attention.cu; its
    launch must take every size from the graph's fixed inputs, not from a batch."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    ops = CudaOps(device)
    ops.use_decode_attention = False
    gpu = cuda_transformer(qwen3, ops=ops)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 4)]
    spy: list = []
    got = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=spy)
    assert not spy[0].failures and spy[0].replays > 0
    assert got == _run(device, qwen3, gpu, prompts, params, graphs=False, spy=[])


def test_rounds_with_penalties_or_logprobs_replay_graphs_that_hold_them(device,
                                                                       qwen3) -> None:
    """Rounds with penalized or logit-biased sessions replay a variant of their bucket's
    graph that counts the round's inputs and adjusts the logits on the device; rounds in
    which a session asks for logprobs, one that also computes them. Tokens and logprobs
    equal those of a run without graphs, including a penalized session whose counts are
    built while others decode (prompts of different lengths). The biased session outlives
    the penalized ones, so some rounds adjust its logits alone: a bias of +100 on token 7
    makes all its tokens 7."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    gpu = cuda_transformer(qwen3, ops=CudaOps(device))
    prompts = [rng.integers(0, 40, n).tolist() for n in (4, 9, 6, 3, 5)]  # with repeats
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.5, frequency_penalty=0.5, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, max_tokens=5, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0.9, seed=8, max_tokens=10, ignore_eos=True,
                             presence_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                             logit_bias={7: 100.0, 3: -5.0})]
    spy_on: list = []
    lp_on: list = []
    with_graphs = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=spy_on,
                       logprobs=lp_on)
    lp_off: list = []
    without = _run(device, qwen3, gpu, prompts, params, graphs=False, spy=[],
                   logprobs=lp_off)
    assert with_graphs == without
    # the same kernels on the same padded shapes, launched as a graph or one by one
    assert lp_on == lp_off
    assert [len(x) for x in lp_on] == [0, 12, 5, 0, 0]
    assert with_graphs[4] == [7] * 14
    graphs = spy_on[0]
    assert graphs.replays > 0 and not graphs.failures
    assert 0 < graphs.adjusted_replays < graphs.replays  # both kinds were replayed
    assert 0 < graphs.logprob_replays < graphs.replays


def test_a_failed_capture_leaves_that_bucket_eager(device, qwen3,
                                                   monkeypatch) -> None:
    import eagerlm.vmm.cuda_driver
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    drv = eagerlm.vmm.cuda_driver._driver
    if not hasattr(drv, "graph_launches"):
        pytest.skip("needs the emulated driver to make capture fail")
    from tests.emulated_gpu.fake_cuda_driver import R

    monkeypatch.setattr(drv, "cuStreamBeginCapture",
                        lambda s, mode: (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,))
    gpu = cuda_transformer(qwen3, ops=CudaOps(device))
    prompts = [[5, 6, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    spy: list = []
    got = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=spy)
    want = _run(device, qwen3, gpu, prompts, params, graphs=False, spy=[])
    assert got == want
    assert spy[0].replays == 0 and spy[0].eager_rounds > 0
    assert all("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" in v for v in spy[0].failures.values())
    assert np.all([len(t) == 6 for t in got])


def _emulated_driver():
    import eagerlm.vmm.cuda_driver

    drv = eagerlm.vmm.cuda_driver._driver
    if not hasattr(drv, "capture_threads"):
        pytest.skip("needs the emulated driver to act inside a capture")
    return drv


def _once_inside_a_capture(monkeypatch, ops, drv, action) -> list:
    """Run `action` at the sampler's launch the first time it comes inside a capture;
    the returned list records that it ran."""
    ran: list = []
    sample = ops.sample_device

    def sample_device(*args, **kw):
        if drv.capture_threads and not ran:
            ran.append(action())
        return sample(*args, **kw)

    monkeypatch.setattr(ops, "sample_device", sample_device)
    return ran


def test_a_tensor_released_during_a_capture_is_freed_after_it(device, qwen3,
                                                              monkeypatch) -> None:
    """CUDA lets a captured free release only the capture's own memory; a tensor from
    before the capture whose last reference goes away during it (a garbage-collected
    cycle, another thread) must wait for the capture to end, or the graph is lost."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    drv = _emulated_driver()
    gpu = cuda_transformer(qwen3, ops=CudaOps(device))
    held = [gpu.ops.empty((64,), "f32")]
    ptr = held[0].ptr
    ran = _once_inside_a_capture(monkeypatch, gpu.ops, drv, held.clear)
    spy: list = []
    got = _run(device, qwen3, gpu, [[5, 6, 7]],
               [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)],
               graphs=True, spy=spy)
    assert ran and not held
    assert not spy[0].failures and spy[0].replays > 0
    assert ptr not in drv.async_allocs  # freed once the capture had ended
    assert [len(t) for t in got] == [6]


def test_a_refused_call_inside_a_capture_leaves_the_bucket_eager(device, qwen3,
                                                                 monkeypatch) -> None:
    """A call CUDA refuses inside a thread-local capture (here a context synchronization
    whose error is ignored) invalidates the capture, on a GPU and on the emulator: the
    bucket stays eager, with the reason kept, and the tokens are those of eager launches."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    drv = _emulated_driver()
    gpu = cuda_transformer(qwen3, ops=CudaOps(device))
    ran = _once_inside_a_capture(monkeypatch, gpu.ops, drv, drv.cuCtxSynchronize)
    prompts = [[5, 6, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    spy: list = []
    got = _run(device, qwen3, gpu, prompts, params, graphs=True, spy=spy)
    assert ran and "STREAM_CAPTURE_UNSUPPORTED" in str(ran[0][0])
    (reason,) = spy[0].failures.values()
    assert "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED" in reason
    assert got == _run(device, qwen3, gpu, prompts, params, graphs=False, spy=[])
