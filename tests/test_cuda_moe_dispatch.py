"""Mixtures of experts through the dispatcher on the cuda backend, on the emulated GPU:
the router, the expert grouping and the expert products all run on the device, so a
decode round's launches do not depend on what the router picks and CUDA graphs replay
them. With the emulator's row-exact GEMM (tests/test_cuda_dispatch.py says why) every
request must give exactly the tokens it gives alone, with graphs and with eager launches,
when its rows share expert products with other sessions' rows."""

from __future__ import annotations

import dataclasses
import random

import pytest

from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from tests.test_cuda_dispatch import _dispatcher, _results, gpu  # noqa: F401  (fixture)
from tests.test_dispatcher import random_workload

SPECS = {
    # sinks, sliding window, biases, the clamped SwiGLU, float experts as bf16
    "gpt-oss": dict(architecture="gpt-oss", n_layers=2, context_length=160),
    "qwen3moe": dict(architecture="qwen3moe", n_layers=2, context_length=160),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def model(gpu, request, tmp_path_factory):
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    args = dict(SPECS[request.param])
    path = tmp_path_factory.mktemp("moe") / f"{request.param}.gguf"
    m = ModelFile.open(write_synthetic_model(path, tiny_spec(args.pop("architecture"),
                                                             **args)))
    return m, cuda_transformer(m, ops=CudaOps(gpu))


@pytest.mark.slow
def test_every_request_equals_its_run_alone_with_graphs_and_without(gpu, model) -> None:
    reqs = [(k, prompt, dataclasses.replace(params, max_tokens=min(params.max_tokens, 8)))
            for k, prompt, params in random_workload(model, random.Random(5), 4)]
    alone = {}
    for req in reqs:
        got, _ = _results(_dispatcher(gpu, model, max_batch=1, round_tokens=256,
                                      prefix_cache=False), [req], then=0)
        alone.update(got)
    for control in ({}, {"cuda_graphs": False}):
        d = _dispatcher(gpu, model, **control)
        graphs = d.control._graphs
        got, _ = _results(d, reqs, then=0)
        assert got == alone, control
        if not control:  # the decode rounds were captured and replayed, none failed
            assert graphs.captured > 0 and graphs.replays > 0 and not graphs.failures
