"""The eager dispatcher on the cpu backend: continuous batching, eagerness, stops,
cancellation, preemption and KV reuse, with every request's output checked against the
same request run alone through the sequential loop (`dispatch/sequential.py`)."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import random
import time

import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.messages import FinishReason, Output
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.vmm.device import open_device
from tests.sequential_reference import SequentialGeneration

PAGE = 4096


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "qwen3.gguf"
    m = ModelFile.open(write_synthetic_model(path, tiny_spec("qwen3", context_length=160)))
    return m, cpu_transformer(m)


def make(model, *, sync=False, budget=1 << 22, max_batch=8, round_tokens=32, lookahead=2,
         prefix_cache=True, preempt="recompute"):
    m, tf = model
    cfg = DispatcherConfig(
        control=ControlConfig(SchedulerConfig(max_batch=max_batch,
                                              max_round_tokens=round_tokens, map_ahead=4,
                                              preempt=preempt),
                              lookahead=lookahead, sync=sync, prefix_cache=prefix_cache),
        kv_budget_bytes=budget)
    return Dispatcher(open_device("cpu", page_size=PAGE), tf, m.tokenizer, cfg)


def alone(model, prompt, params):
    m, tf = model
    chunks = list(SequentialGeneration(tf, m.tokenizer, prompt, params))
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
            chunks[-1].finish_reason)


class Collector:
    """Gathers each request's outputs; `wait` returns once all have finished."""

    def __init__(self) -> None:
        self.outputs: dict[int, list[Output]] = {}
        self.done = queue.Queue()

    def sink_for(self, key):
        self.outputs[key] = []

        def sink(out: Output) -> None:
            self.outputs[key].append(out)
            if out.finish_reason is not None:
                self.done.put(key)
        return sink

    def wait(self, n: int, timeout: float = 60) -> None:
        for _ in range(n):
            self.done.get(timeout=timeout)

    def result(self, key):
        outs = self.outputs[key]
        return ([t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                outs[-1].finish_reason)


def random_workload(model, rng: random.Random, n: int):
    m, _ = model
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "42"]
    reqs = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 25)))
        prompt = m.tokenizer.encode(text)
        params = SamplingParams(temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(1000),
                                max_tokens=rng.randint(1, 24), top_k=rng.choice([0, 20]),
                                ignore_eos=rng.random() < 0.5)
        reqs.append((i, prompt, params))
    return reqs


def run_workload(d: Dispatcher, reqs, rng: random.Random | None = None) -> Collector:
    col = Collector()
    for key, prompt, params in reqs:
        d.submit(prompt, params, col.sink_for(key))
        if rng is not None and rng.random() < 0.3:
            time.sleep(rng.random() * 0.01)  # arrivals spread over several rounds
    col.wait(len(reqs))
    return col


def test_every_request_equals_its_run_alone(model):
    """Randomized arrivals, prompt and output lengths, sampling settings, stop strings and
    cancellations: no token lost, duplicated or reordered, and the right finish reason for
    every request."""
    rng = random.Random(1)
    reqs = []
    for key, prompt, params in random_workload(model, rng, 24):
        if rng.random() < 0.3:  # a stop string taken from what the request would say
            text = alone(model, prompt, params)[1]
            if len(text) > 4:
                cut = rng.randrange(len(text) - 2)
                params = dataclasses.replace(params, stop=(text[cut:cut + 2],))
        reqs.append((key, prompt, params))
    cancel = set(rng.sample(range(len(reqs)), 5))
    with make(model) as d:
        col = Collector()
        ids = {}
        for key, prompt, params in reqs:
            ids[key] = d.submit(prompt, params, col.sink_for(key))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)  # arrivals spread over several rounds
            if key in cancel:
                d.cancel(ids[key])
        col.wait(len(reqs))
    for key, prompt, params in reqs:
        tokens, text, reason = col.result(key)
        ref_tokens, ref_text, ref_reason = alone(model, prompt, params)
        if key in cancel and reason is FinishReason.CANCELLED:
            # cut short: what it did say is the start of what it would have said
            assert ref_tokens[:len(tokens)] == tokens and ref_text.startswith(text), key
        else:
            assert (tokens, text, reason) == (ref_tokens, ref_text, ref_reason), key


def test_eager_and_sync_modes_give_identical_output(model):
    rng = random.Random(2)
    reqs = random_workload(model, rng, 12)
    results = []
    for sync in (False, True):
        with make(model, sync=sync) as d:
            col = run_workload(d, reqs)
        results.append({k: col.result(k) for k, _, _ in reqs})
    assert results[0] == results[1]


def _overlaps(traces) -> int:
    """Rounds launched before the previous round's tokens reached the service thread."""
    ts = sorted(traces, key=lambda t: t.round_id)
    return sum(1 for a, b in itertools.pairwise(ts) if b.launch_end < a.tokens_ready)


def slow_forwards(tf, monkeypatch, seconds: float = 0.02) -> None:
    """Make each of `tf`'s forwards take `seconds` more on the device, as a real model's
    would: a tiny model's sub-millisecond rounds could otherwise finish before the control
    thread gets to launch the next one, whatever the dispatch."""
    forward = tf.forward

    def slow_forward(batch):
        time.sleep(seconds)
        return forward(batch)

    monkeypatch.setattr(tf, "forward", slow_forward)


def test_eagerness_is_observable_in_the_timestamps(model, monkeypatch):
    """Eager: round n + 1 is launched before round n's tokens reach the service thread;
    sync: never. Each forward is made to take 20 ms on the device, as a real model's
    would, so that a tiny model's sub-millisecond rounds cannot finish before the control
    thread gets to launch the next one (which made this test flaky on a loaded machine)."""
    m, tf = model
    slow_forwards(tf, monkeypatch)
    prompt = m.tokenizer.encode("the cat sat")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for sync in (False, True):
        with make(model, sync=sync) as d:
            list(d.stream(prompt, params))
            traces = list(d.traces)
        assert len(traces) == 40
        if sync:
            assert _overlaps(traces) == 0
        else:
            assert _overlaps(traces) > len(traces) // 2


def test_stop_strings_and_wasted_tokens_bounded_by_lookahead(model):
    m, _ = model
    rng = random.Random(3)
    reqs = []
    for key in range(8):
        prompt = m.tokenizer.encode(f"stop test {key}")
        free = alone(model, prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True))[1]
        cut = rng.randint(3, max(4, len(free) - 4))
        reqs.append((key, prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                 ignore_eos=True, stop=(free[cut:cut + 2],))))
    k = 2
    with make(model, lookahead=k) as d:
        col = run_workload(d, reqs)
        finished = sum(d.service.stats.finished.values())
        discarded = d.service.stats.tokens_discarded
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params)
    assert discarded <= k * finished


def test_cancellation_ends_the_request_and_frees_its_session(model):
    m, _ = model
    prompt = m.tokenizer.encode("cancel me")
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    with make(model, prefix_cache=False) as d:
        got = queue.Queue()
        rid = d.submit(prompt, params, got.put)
        first = got.get(timeout=30)
        assert first.finish_reason is None
        d.cancel(rid)
        outs = [first]
        while outs[-1].finish_reason is None:
            outs.append(got.get(timeout=30))
        assert outs[-1].finish_reason is FinishReason.CANCELLED
        d.flush()
        # rounds already in flight when it was cancelled (at most k = 2) are discarded
        assert d.service.stats.tokens_discarded <= 2
        assert not d.control.sessions
        assert d.pool.n_free == d.pool.n_pages


def test_leaving_a_stream_early_cancels_it(model):
    m, _ = model
    with make(model, prefix_cache=False) as d:
        it = d.stream(m.tokenizer.encode("leave"), SamplingParams(temperature=0.0,
                                                                  max_tokens=100,
                                                                  ignore_eos=True))
        next(it)
        it.close()
        d.flush()
        assert not d.control.sessions and d.pool.n_free == d.pool.n_pages


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_small_pool_preempts_and_still_matches(model, preempt):
    """A pool too small for the offered load: everything completes, through preemption
    (KV dropped and recomputed, or swapped to host memory and back), with outputs identical
    to unconstrained runs, and no page is leaked once idle."""
    m, _ = model
    rng = random.Random(4)
    reqs = []
    for key in range(10):
        prompt = m.tokenizer.encode(" ".join(["delta gamma"] * rng.randint(4, 10)))
        reqs.append((key, prompt, SamplingParams(temperature=rng.choice([0.0, 1.0]),
                                                 seed=key, max_tokens=40, ignore_eos=True,
                                                 frequency_penalty=0.5 * (key % 2))))
    layout_bytes = m.config.n_layers * 2 * m.config.kv_dim * 4  # float32 KV per token
    longest = max(len(p) for _, p, _ in reqs) + 40
    budget = 2 * longest * layout_bytes  # about two sessions' worth at full length
    with make(model, budget=budget, round_tokens=64, preempt=preempt) as d:
        col = run_workload(d, reqs)
        assert d.control.scheduler.preemptions > 0
        assert (d.control.scheduler.swaps > 0) == (preempt == "swap")
        d.flush()
        assert d.pool.n_free == d.pool.n_pages
        d.pool.audit()
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_second_chat_turn_prefills_only_new_tokens(model):
    m, _ = model
    first = m.tokenizer.encode("user: tell me about the cat and the mat and the alpha beta")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with make(model) as d:
        outs = list(d.stream(first, params))
        reply = [t for o in outs for t in o.token_ids]
        second = first + reply + m.tokenizer.encode(" user: and then?")
        warm = list(d.stream(second, params))
        assert d.control.cache.hits == 1
    reused = warm[-1].cached_tokens
    # everything but the last reply token (never fed back) is reused
    assert reused == len(first) + len(reply) - 1
    assert [t for o in warm for t in o.token_ids] == alone(model, second, params)[0]


def test_shutdown_with_requests_in_flight_ends_them_with_error(model):
    m, _ = model
    d = make(model)
    col = Collector()
    for key in range(4):
        d.submit(m.tokenizer.encode(f"long {key}"),
                 SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True),
                 col.sink_for(key))
    time.sleep(0.05)
    d.shutdown()
    col.wait(4, timeout=10)
    reasons = {col.result(k)[2] for k in range(4)}
    assert reasons == {FinishReason.ERROR}
    assert all(col.outputs[k][-1].error for k in range(4))


def test_invalid_requests_are_refused_and_the_engine_keeps_serving(model):
    from eagerlm.dispatch.errors import EmptyPrompt, PromptTooLong, TokenOutOfVocabulary

    m, _ = model
    vocab = m.config.vocab_size
    with make(model) as d:
        with pytest.raises(PromptTooLong):
            d.submit(list(range(3, 200)), SamplingParams(), lambda o: None)
        with pytest.raises(EmptyPrompt):
            d.submit([], SamplingParams(), lambda o: None)
        with pytest.raises(TokenOutOfVocabulary, match="the prompt names token 1000000"):
            d.submit([5, 10**6], SamplingParams(), lambda o: None)
        with pytest.raises(TokenOutOfVocabulary, match=f"logit_bias names token {vocab}"):
            d.submit([5], SamplingParams(logit_bias={3: 1.0, vocab: -1.0}), lambda o: None)
        prompt = m.tokenizer.encode("still fine")
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        assert [t for o in d.stream(prompt, params) for t in o.token_ids] == alone(
            model, prompt, params)[0]



def test_a_failing_device_ends_every_request_with_an_error_and_never_hangs(model):
    """A stream failure is sticky (like a CUDA error): every request in flight ends with
    finish reason `error`, and later requests are answered with an error at once."""
    m, tf = model
    calls = {"n": 0}
    real_forward = tf.forward

    def failing_forward(batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated device fault")
        return real_forward(batch)

    d = make(model)
    tf.forward = failing_forward
    try:
        col = Collector()
        for key in range(3):
            d.submit(m.tokenizer.encode(f"fault {key}"),
                     SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                     col.sink_for(key))
        col.wait(3, timeout=20)
        assert {col.result(k)[2] for k in range(3)} == {FinishReason.ERROR}
        assert "simulated device fault" in col.outputs[0][-1].error
        late = queue.Queue()
        d.submit(m.tokenizer.encode("late"), SamplingParams(max_tokens=3), late.put)
        out = late.get(timeout=10)
        assert out.finish_reason is FinishReason.ERROR and out.error
    finally:
        tf.forward = real_forward
        d.shutdown()


def test_a_sink_that_raises_cancels_only_its_own_request(model):
    m, _ = model
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def broken_sink(out):
        raise ValueError("consumer went away")

    with make(model) as d:
        d.submit(m.tokenizer.encode("broken"), params, broken_sink)
        prompt = m.tokenizer.encode("healthy")
        assert [t for o in d.stream(prompt, params) for t in o.token_ids] == alone(
            model, prompt, params)[0]
        d.flush()
        assert not d.control.sessions


def test_penalties_and_logprobs_match_the_request_run_alone(model):
    """Penalty counts live beside the device sampler (no host help), including across a
    chunked prefill, a prefix-cache hit and preemption; a logit bias is applied there too;
    logprobs travel with the tokens."""
    m, _ = model
    prompt = m.tokenizer.encode("alpha beta alpha beta gamma delta alpha " * 3)
    variants = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                       repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True,
                       presence_penalty=0.7, frequency_penalty=0.4, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5),
        # the prompt's tokens banned, one favoured a little, and a penalty on top
        SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True,
                       frequency_penalty=0.5, logprobs=1,
                       logit_bias={**dict.fromkeys(set(prompt), -100.0), 11: 2.0}),
    ]
    with make(model, round_tokens=16) as d:
        col = Collector()
        for key, params in enumerate(variants):
            d.submit(prompt, params, col.sink_for(key))
        col.wait(len(variants))
    for key, params in enumerate(variants):
        chunks = list(SequentialGeneration(model[1], m.tokenizer, prompt, params))
        ref_lps = [lp for c in chunks for lp in c.logprobs]
        outs = col.outputs[key]
        assert [t for o in outs for t in o.token_ids] == [t for c in chunks
                                                           for t in c.token_ids]
        lps = [lp for o in outs for lp in o.logprobs]
        assert len(lps) == len(ref_lps) == 24
        for got, ref in zip(lps, ref_lps, strict=True):
            assert got.token == ref.token
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in ref.top]
            assert len(got.top) == params.logprobs
    banned = {t for t, b in variants[3].logit_bias if b == -100.0}
    assert banned and not banned & {t for o in col.outputs[3] for t in o.token_ids}
