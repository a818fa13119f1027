"""Speculative decoding with a draft model (cpu backend): the draft proposes on the device,
in the round, with its KV beside the target's in each session's region; every row is
verified in the round's forward. Outputs are checked against the request run alone
(tests/sequential_reference.py), and the sampled tokens' distribution against the target
model's own probabilities."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest

from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.sampling import InvalidSamplingParams, SamplingParams
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.vmm.kv_layout import KVLayout
from tests.test_speculative import alone, make, repetitive_prompt, run

DRAFT = SpeculationConfig("draft", 4, adaptive=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "qwen3.gguf"
    m = ModelFile.open(write_synthetic_model(path, tiny_spec("qwen3", context_length=256)))
    return m, cpu_transformer(m)


@pytest.fixture(scope="module")
def bad_draft(tmp_path_factory):
    """Another architecture and shape with other weights, over the same vocabulary: its
    proposals are mostly wrong."""
    path = tmp_path_factory.mktemp("d") / "llama.gguf"
    spec = tiny_spec("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, seed=7,
                     context_length=256)
    return cpu_transformer(ModelFile.open(write_synthetic_model(path, spec)))


def test_the_model_as_its_own_draft_accepts_nearly_every_greedy_draft(model):
    """A check of the mechanics: the draft's KV kept beside the target's (and cached with
    it: a second turn's prefix), its catch-up row, its proposals into the draft rows.
    Greedy, it proposes what the target then says, so nearly all are accepted (not all:
    its one-row forwards and the target's several-row one may round differently)."""
    reqs = [(key, repetitive_prompt(model, key),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for key in range(6)]
    with make(model, spec=DRAFT, draft=model[1]) as d:
        col = run(d, reqs)
        stats = d.service.stats
        assert stats.draft_tokens > 100
        assert stats.accepted_tokens >= 0.95 * stats.draft_tokens
        # a second turn on a cached prefix: the draft's KV of it comes from the cache too
        prompt = reqs[0][1] + col.result(0)[0] + reqs[0][1][:5]
        params = reqs[0][2]
        before = stats.accepted_tokens, stats.draft_tokens
        again = run(d, [(9, prompt, params)]).result(9)
        assert d.control.cache.hits >= 1
        drafted = stats.draft_tokens - before[1]
        assert stats.accepted_tokens - before[0] >= 0.95 * drafted > 0
    assert again == alone(model, prompt, params)
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_adaptive_drafting_prices_the_draft_models_forwards(model, bad_draft):
    """With adaptive drafting, the plan prices the draft model's forwards: before any is
    measured at the bytes it reads over the model's (`ModelWeights.decode_bytes`), then
    from the rounds that ran it; the output stays the request's run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reqs = [(key, repetitive_prompt(model, key), params) for key in range(2)]
    with make(model, spec=SpeculationConfig("draft", 4), draft=bad_draft) as d:
        prior = bad_draft.weights.decode_bytes() / model[1].weights.decode_bytes()
        assert 0 < prior < 1 and d.control.scheduler.draft_prices() == (prior, prior)
        col = run(d, reqs)
        costs = d.control.round_costs
        assert costs is not None and costs.draft_rounds > 0
    for key, prompt, p in reqs:
        assert col.result(key) == alone(model, prompt, p), key


@pytest.mark.parametrize("sync", [False, True])
def test_output_with_a_bad_draft_model_equals_the_request_run_alone(model, bad_draft,
                                                                     sync):
    reqs = [(key, repetitive_prompt(model, key),
             SamplingParams(temperature=[0.0, 0.9][key % 2], seed=key, max_tokens=32,
                            ignore_eos=True, top_p=[1.0, 0.9][key % 3 == 0]))
            for key in range(6)]
    with make(model, spec=DRAFT, draft=bad_draft, sync=sync, round_tokens=32) as d:
        col = run(d, reqs)
        assert d.service.stats.draft_tokens > d.service.stats.accepted_tokens
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_draft_speculation_survives_preemption(model, preempt):
    """The draft's KV lives in the same region as the target's, so preemption (dropped
    and recomputed, or swapped out and back) carries it along: outputs stay exact and the
    draft keeps being accepted afterwards."""
    m, _ = model
    reqs = [(key, repetitive_prompt(model, key),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for key in range(8)]
    longest = max(len(p) for _, p, _ in reqs) + 40
    target = KVLayout(m.config.n_layers, m.config.n_kv_heads, m.config.head_dim)
    token_bytes = target.shared_with(target)[0].token_bytes
    with make(model, spec=DRAFT, draft=model[1], budget=2 * longest * token_bytes,
              preempt=preempt) as d:
        col = run(d, reqs)
        assert d.control.scheduler.preemptions > 0
        stats = d.service.stats
        assert stats.accepted_tokens >= 0.9 * stats.draft_tokens
        d.flush()
        assert d.pool.n_free == d.pool.n_pages
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_a_draft_request_without_a_draft_model_is_refused(model):
    with make(model) as d, pytest.raises(InvalidSamplingParams, match="draft model"):
        d.submit([5, 6], SamplingParams(speculative="draft"), lambda o: None)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["bad", "greedy self"])
def test_rejection_sampling_keeps_the_target_distribution(model, bad_draft, which):
    """3,000 seeds (0 .. 2999) of one prompt at temperature 0.3, three tokens each, one
    draft per round: the second token is the first speculative round's first row (the
    draft checked against it), the third either that round's second row (the draft was
    accepted) or the next round's first (it was rejected). Grouped by the tokens before it,
    each token's counts must fit the target's probabilities given them (float64 softmax of
    the logits / 0.3, from a one-session forward): the chi-square statistic, over bins of
    at least 5 expected draws and one bin for the rest, stays under its 0.1% critical
    value in every group of 100 draws or more. Two drafts: a bad one (another model: its
    drafts mostly rejected, the residual draw tested), and the target itself proposing
    greedily (about half accepted at this temperature: the tokens drawn after an accepted
    draft tested, which a bad draft gives too rarely to count)."""
    _, tf = model
    draft = bad_draft if which == "bad" else tf
    prompt = repetitive_prompt(model, 2)
    n, temperature = 3000, 0.3
    reqs = [(seed, prompt, SamplingParams(temperature=temperature, seed=seed, max_tokens=3,
                                          ignore_eos=True)) for seed in range(n)]
    with make(model, spec=SpeculationConfig("draft", 1, adaptive=False), draft=draft,
              max_batch=32, round_tokens=128) as d:
        col = run(d, reqs)
        stats = d.service.stats
    assert stats.draft_tokens >= n  # every request's first decode round drafted
    rejected = 1 - stats.accepted_tokens / stats.draft_tokens
    assert rejected > (0.5 if which == "bad" else 0.2)
    outputs = [tuple(col.result(seed)[0]) for seed in range(n)]
    tested, after_accepted = 0, 0
    for j in (1, 2):  # the token after j generated ones
        groups: dict[tuple[int, ...], list[int]] = {}
        for out in outputs:
            groups.setdefault(out[:j], []).append(out[j])
        for before, nexts in groups.items():
            if len(nexts) < 100:
                continue
            context = prompt + list(before)
            p = _next_token_probs(tf, context, temperature)
            assert _chi2(np.array(nexts), p) < _chi2_quantile_999(p, len(nexts)), before
            tested += 1
            if j == 2 and before[1] == _argmax_next(draft, prompt + [before[0]]):
                after_accepted += 1
    assert tested >= 3 and (after_accepted >= 1 or which == "bad")


def _chi2(draws: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic of `draws` against probabilities `p`: a bin per token expected
    5 times or more, one bin for all the others."""
    count = len(draws)
    expected = count * p
    keep = np.flatnonzero(expected >= 5)
    observed = np.array([(draws == t).sum() for t in keep], float)
    obs = np.append(observed, count - observed.sum())
    exp = np.append(expected[keep], count - expected[keep].sum())
    live = exp > 0
    return float((((obs - exp) ** 2)[live] / exp[live]).sum())


def _chi2_quantile_999(p: np.ndarray, count: int) -> float:
    """The chi-square 99.9% quantile for `_chi2`'s bins (df = bins - 1), by Wilson and
    Hilferty's cube-root normal approximation (within 1% of the exact value for df >= 3)."""
    expected = count * p
    bins = int((expected >= 5).sum()) + int(expected[expected < 5].sum() > 0)
    df = max(1, bins - 1)
    z, c = 3.0902, 2.0 / (9.0 * df)  # z: the standard normal's upper 0.1% point
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def _argmax_next(tf, tokens: list[int]) -> int:
    """A model's greedy next token (what the bad draft proposes)."""
    return int(np.argmax(_logits(tf, tokens)))


def _next_token_probs(tf, tokens: list[int], temperature: float) -> np.ndarray:
    """The target's next-token distribution at `temperature` (float64 softmax)."""
    logits = _logits(tf, tokens)
    e = np.exp((logits - logits.max()) / temperature)
    return e / e.sum()


def _logits(tf, tokens: list[int]) -> np.ndarray:
    cfg = tf.config
    kv = tf.ops.contiguous_kv(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim),
                              len(tokens))
    return np.asarray(tf.forward(ForwardBatch.single(tokens, 0, kv)), np.float64)[0]


def test_the_engine_speculates_as_its_settings_and_each_request_say(model, tmp_path):
    """`EngineSettings` (the CLI's --speculative, --num-speculative-tokens, --draft-model)
    set the default, a request's `SamplingParams` its own; a draft model with another
    vocabulary is refused when loading, naming the flag."""
    from prometheus_client.parser import text_string_to_metric_families

    from eagerlm.service.api.metrics import PrometheusText
    from eagerlm.service.api.model_loading import DraftVocabularyMismatch
    from eagerlm.service.api.sync_engine import SyncEngine
    from eagerlm.service.api.vllm_metrics import write_vllm_metrics

    m, _ = model
    path = str(m.path)
    prompt = repetitive_prompt(model, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = alone(model, prompt, greedy)[0]
    with SyncEngine.open(path, speculative="draft", draft_model=path,
                         kv_budget_bytes=1 << 22) as engine:
        dispatcher = engine.engine.dispatcher
        stats = dispatcher.service.stats
        for params in (greedy, dataclasses.replace(greedy, speculative="ngram"),
                       dataclasses.replace(greedy, speculative="off")):
            before = stats.draft_tokens
            assert list(engine.complete(prompt, params).token_ids) == want
            while stats.rounds < dispatcher.control.round_id:  # rounds still in flight
                time.sleep(0.01)
            assert (stats.draft_tokens > before) == (params.speculative != "off")
            if params is greedy:  # the draft model's forwards are timed apart: in the
                costs = dispatcher.control.round_costs  # rows' prices they would price
                assert costs is not None and costs.draft_rounds > 0  # prompt lookup out
        # vLLM's names for the counters (parsed by prometheus-client)
        out = PrometheusText()
        write_vllm_metrics(out, engine.engine.metrics, "m", engine.engine.vllm_gauges())
        samples = {s.name: s.value for f in text_string_to_metric_families(out.text())
                   for s in f.samples}
        assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.draft_tokens > 0
        assert samples["vllm:spec_decode_num_accepted_tokens_total"] == stats.accepted_tokens
        assert 0 < samples["vllm:spec_decode_num_drafts_total"] <= stats.draft_tokens
    other = tmp_path / "other.gguf"
    write_synthetic_model(other, tiny_spec("qwen3", vocab_size=300))
    with pytest.raises(DraftVocabularyMismatch, match="300 tokens") as err:
        SyncEngine.open(path, speculative="draft", draft_model=str(other))
    assert err.value.param == "draft_model"
