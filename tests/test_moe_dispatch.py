"""The new families through the eager dispatcher on the cpu backend: mixtures of experts
(qwen3moe with Q8_0 experts read in place from the file's map, gpt-oss with MXFP4 experts,
attention sinks and sliding-window layers, Mixtral-style llama) and phi3. Each request must
equal its run alone through the sequential loop (tests/sequential_reference.py) with
batching, in eager and sync dispatch, through preemption and the prefix cache, as
tests/test_dispatcher.py checks for the dense families."""

from __future__ import annotations

import random

import pytest
from gguf import GGMLQuantizationType as Q

from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.cpu_moe import ExpertMatrices
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from tests.test_dispatcher import alone, make, random_workload, run_workload

SPECS = {
    # float32 dense matrices as in tests/test_dispatcher.py: a quantized matrix's product
    # over more than its type's `gemv_rows` rows (a prompt beside other sessions) takes
    # float32 tiles, whose last bits differ from the 8-bit GEMV's (docs/architecture.md,
    # "Batch invariance"); the experts and router stay on the GEMV path at any batch size
    "qwen3moe": tiny_spec("qwen3moe", weight_type=Q.F32, expert_type=Q.Q8_0,
                          context_length=160),
    "gpt-oss": tiny_spec("gpt-oss", expert_type=Q.MXFP4, n_layers=3, context_length=160),
    "llama-moe": tiny_spec("llama", n_experts=4, n_experts_used=2, context_length=160),
    "phi3": tiny_spec("phi3", long_rope=True, context_length=160),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / f"{request.param}.gguf"
    m = ModelFile.open(write_synthetic_model(path, SPECS[request.param]))
    return m, cpu_transformer(m)


def test_experts_are_read_in_place_from_the_file(model) -> None:
    m, tf = model
    if m.config.moe is None:
        pytest.skip("a dense model")
    experts = tf.weights.layers[0].moe.gate
    if m.config.architecture == "llama":  # float32 experts are dequantized copies
        assert not isinstance(experts, ExpertMatrices)
        return
    assert isinstance(experts, ExpertMatrices) and experts.mapped
    assert not experts.blocks.flags.owndata  # a view of the map, not a copy


def test_batched_requests_equal_their_runs_alone(model) -> None:
    rng = random.Random(11)
    reqs = random_workload(model, rng, 10)
    with make(model) as d:
        col = run_workload(d, reqs, rng)
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_eager_and_sync_dispatch_give_identical_greedy_output(model) -> None:
    m, _ = model
    rng = random.Random(12)
    reqs = [(k, m.tokenizer.encode(" ".join(rng.choice(["alpha", "the", "cat", "mat"])
                                            for _ in range(rng.randint(2, 12)))),
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            for k in range(6)]
    results = []
    for sync in (False, True):
        with make(model, sync=sync) as d:
            col = run_workload(d, reqs)
        results.append({k: col.result(k) for k, _, _ in reqs})
    assert results[0] == results[1]


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_keeps_every_output(model, preempt) -> None:
    m, _ = model
    reqs = [(k, m.tokenizer.encode(" ".join(["delta gamma"] * (4 + k % 5))),
             SamplingParams(temperature=0.0 if k % 2 else 1.0, seed=k, max_tokens=30,
                            ignore_eos=True)) for k in range(8)]
    per_token = m.config.n_layers * 2 * m.config.kv_dim * 4
    longest = max(len(p) for _, p, _ in reqs) + 30
    with make(model, budget=2 * longest * per_token, round_tokens=64, preempt=preempt) as d:
        col = run_workload(d, reqs)
        assert d.control.scheduler.preemptions > 0
        d.flush()
        assert d.pool.n_free == d.pool.n_pages
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_a_second_turn_reuses_the_cached_prefix(model) -> None:
    m, _ = model
    first = m.tokenizer.encode("user: tell me about the cat and the mat and the alpha beta")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with make(model) as d:
        reply = [t for o in d.stream(first, params) for t in o.token_ids]
        second = first + reply + m.tokenizer.encode(" user: and then?")
        warm = list(d.stream(second, params))
        assert d.control.cache.hits == 1
    assert warm[-1].cached_tokens == len(first) + len(reply) - 1
    assert [t for o in warm for t in o.token_ids] == alone(model, second, params)[0]
