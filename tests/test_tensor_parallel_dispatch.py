"""The dispatcher over two cpu devices (tensor parallelism, phase 2: one control thread per
device, dispatch/follower_thread.py): every request against the same request run alone
through the sequential loop over the same two devices (the group's own forward,
kernels/tensor_parallel.py, itself checked against one device in test_tensor_parallel.py),
eager against sync, preemption, the prefix cache, every device's pages back to idle, a
device failure, and what is refused over several devices."""

from __future__ import annotations

import itertools
import queue
import random
import re
import threading
import time

import anyio
import numpy as np
import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.follower_thread import DeviceGroup
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.errors import InvalidParameters
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.sampling import Constraint, SamplingParams
from eagerlm.kernels.tensor_parallel import TensorParallelModel, cpu_group
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.sharding import UnevenShard
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.engine_settings import EngineSettings
from eagerlm.service.cli.commands import build_parser
from eagerlm.vmm.device import open_device
from tests.sequential_reference import SequentialGeneration
from tests.test_dispatcher import Collector, random_workload, run_workload

PAGE = 4096


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "qwen3.gguf"
    return write_synthetic_model(path, tiny_spec("qwen3", context_length=160))


@pytest.fixture(scope="module")
def model(model_path):
    m = ModelFile.open(model_path)
    group = cpu_group(m, 2)
    yield m, group
    group.close()


class _DeviceKVs(list):
    """One session's caches, one per device (each of its KV heads)."""

    @property
    def capacity(self) -> int:
        return min(kv.capacity for kv in self)


class _GroupForward:
    """The group as the sequential loop drives one transformer: a session's KV is one
    contiguous cache per device (its KV heads), each forward runs on every device."""

    def __init__(self, group: TensorParallelModel) -> None:
        self.group = group
        self.config = group.transformers[0].config  # its heads; the model's vocabulary
        self.ops = self

    def contiguous_kv(self, layout, capacity):
        return _DeviceKVs(tf.ops.contiguous_kv(self.group.kv_layout(r), capacity)
                          for r, tf in enumerate(self.group.transformers))

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        (s,) = batch.seqs
        return self.group.forward([
            ForwardBatch(batch.tokens, [SeqSlice(s.start, s.n_new, s.n_past, kv)],
                         batch.logit_rows) for kv in s.kv])


def alone(model, prompt, params):
    m, group = model
    chunks = list(SequentialGeneration(_GroupForward(group), m.tokenizer, prompt, params))
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
            chunks[-1].finish_reason)


def make(model, group=None, *, sync=False, budget=1 << 22, preempt="recompute",
         prefix_cache=True, speculation=None, devices=None, memory_fraction=0.9):
    m, tp = model
    tp = group or tp
    devices = devices or [open_device("cpu", page_size=PAGE) for _ in range(tp.size)]
    cfg = DispatcherConfig(
        control=ControlConfig(SchedulerConfig(max_batch=8, max_round_tokens=32, map_ahead=4,
                                              preempt=preempt),
                              sync=sync, prefix_cache=prefix_cache,
                              speculation=speculation or SpeculationConfig()),
        kv_budget_bytes=budget, memory_fraction=memory_fraction)
    group = DeviceGroup(devices, list(tp.transformers), tp.abort, tp.threads.contexts)
    return Dispatcher(devices[0], tp.transformers[0], m.tokenizer, cfg, group=group)


def assert_idle(d: Dispatcher) -> None:
    """Every device's pages back in its pool, its accounting sound."""
    d.flush()
    for pool in d.pools:
        assert pool.n_free == pool.n_pages
        pool.audit()


def test_every_request_over_two_devices_equals_its_run_alone(model):
    """Randomized arrivals, lengths and sampling settings, batched over two devices: no
    token lost, duplicated or reordered, the right finish reason for every request."""
    rng = random.Random(7)
    reqs = random_workload((model[0], None), rng, 14)
    with make(model) as d:
        col = run_workload(d, reqs, rng)
        assert len(d.pools) == 2 and all(p.stats().maps > 0 for p in d.pools)
        assert_idle(d)
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_eager_and_sync_give_the_same_greedy_tokens_over_two_devices(model):
    m, _ = model
    reqs = [(k, m.tokenizer.encode(f"the cat {k} sat on the mat " * (k + 1)),
             SamplingParams(temperature=0.0, max_tokens=12 + k, ignore_eos=True))
            for k in range(5)]
    results = []
    for sync in (False, True):
        with make(model, sync=sync) as d:
            col = run_workload(d, reqs)
        results.append({k: col.result(k) for k, _, _ in reqs})
    assert results[0] == results[1]
    assert results[0][0] == alone(model, reqs[0][1], reqs[0][2])


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_a_small_pool_preempts_on_every_device_and_still_matches(model, preempt):
    m, _ = model
    reqs = [(k, m.tokenizer.encode(" ".join(["delta gamma"] * (4 + k))),
             SamplingParams(temperature=0.0 if k % 2 else 1.0, seed=k, max_tokens=30,
                            ignore_eos=True, frequency_penalty=0.5 * (k % 2)))
            for k in range(6)]
    layout = model[1].kv_layout(0)
    longest = max(len(p) for _, p, _ in reqs) + 30
    budget = 2 * longest * layout.token_bytes  # about two sessions at full length
    with make(model, budget=budget, preempt=preempt) as d:
        col = run_workload(d, reqs)
        assert d.control.scheduler.preemptions > 0
        assert (d.control.scheduler.swaps > 0) == (preempt == "swap")
        assert_idle(d)
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_the_prefix_cache_serves_a_second_turn_on_every_device(model):
    m, _ = model
    first = m.tokenizer.encode("user: tell me about the cat and the mat and the alpha beta")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with make(model) as d:
        reply = [t for o in d.stream(first, params) for t in o.token_ids]
        second = first + reply + m.tokenizer.encode(" user: and then?")
        warm = list(d.stream(second, params))
        assert d.control.cache.hits == 1
        assert warm[-1].cached_tokens == len(first) + len(reply) - 1
        assert_idle(d)
    assert reply == alone(model, first, params)[0]
    assert [t for o in warm for t in o.token_ids] == alone(model, second, params)[0]


def test_rounds_are_launched_eagerly_over_two_devices(model, monkeypatch):
    """Round n + 1 is launched on both devices before round n's tokens reach the service
    thread (sync: never): device 0's samples reach device 1 by the broadcast inside the
    round, not through the host. Device 1's forward takes 20 ms, so the round's collectives
    wait for it and a tiny model's rounds cannot finish before the next launch."""
    m, group = model
    tf = group.transformers[1]
    forward = tf.forward

    def slow_forward(batch):
        time.sleep(0.02)
        return forward(batch)

    monkeypatch.setattr(tf, "forward", slow_forward)
    prompt = m.tokenizer.encode("the cat sat")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    overlaps = {}
    for sync in (False, True):
        with make(model, sync=sync) as d:
            tokens = [t for o in d.stream(prompt, params) for t in o.token_ids]
            ts = sorted(d.traces, key=lambda t: t.round_id)
        assert len(ts) == 30 and len(tokens) == 30
        overlaps[sync] = sum(1 for a, b in itertools.pairwise(ts)
                             if b.launch_end < a.tokens_ready)
    assert overlaps[True] == 0
    assert overlaps[False] > 15


def test_constrained_requests_over_two_devices_match_their_grammar(model):
    """Only device 0 samples, so only it waits for a constrained row's mask; eager and sync
    give the same tokens, the text matches the grammar, and unconstrained requests beside
    it are their runs alone."""
    m, _ = model
    pattern = "(cat|mat|sat)( (cat|mat|sat)){3}"
    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reqs = [(0, m.tokenizer.encode("say it:"),
             SamplingParams(temperature=0.0, max_tokens=30,
                            constraint=Constraint.regex(pattern))),
            (1, m.tokenizer.encode("alpha beta"), free),
            (2, m.tokenizer.encode("the cat sat on"), free)]
    results = []
    for sync in (False, True):
        with make(model, sync=sync) as d:
            col = run_workload(d, reqs)
            assert_idle(d)
        results.append({k: col.result(k) for k, _, _ in reqs})
    assert results[0] == results[1]
    assert re.fullmatch(pattern, results[0][0][1]), results[0][0][1]
    assert results[0][0][2] is FinishReason.STOP
    for key in (1, 2):
        assert results[0][key] == alone(model, reqs[key][1], free)


def test_four_devices_with_one_kv_head_each_of_two_replicated(tmp_path):
    """Over four devices the two KV heads are each held by two devices; every request is
    still its run alone through the sequential loop over the same four devices."""
    m = ModelFile.open(write_synthetic_model(tmp_path / "q.gguf",
                                             tiny_spec("qwen3", context_length=160)))
    group = cpu_group(m, 4)
    try:
        rng = random.Random(11)
        reqs = random_workload((m, None), rng, 6)
        d = make((m, group))
        try:
            col = run_workload(d, reqs, rng)
            d.flush()
            assert len(d.pools) == 4
            assert all(p.n_free == p.n_pages for p in d.pools)
        finally:
            d.shutdown()
        for key, prompt, params in reqs:
            assert col.result(key) == alone((m, group), prompt, params), key
    finally:
        group.close()


@pytest.mark.parametrize("where", ["forward on device 1", "forward on device 0",
                                   "control thread of device 1"])
def test_a_failure_on_one_device_ends_every_request_and_the_engine_closes(tmp_path, where):
    """A device's forward raises (on the follower, or on the leader), or a follower's
    control thread dies outside its rounds: the group's collectives are aborted, so the
    other device's round fails too instead of waiting; every request ends with `error`
    naming the fault, a later one is answered with an error at once, and shutdown returns
    (nothing waits in a collective forever)."""
    path = tmp_path / "qwen3.gguf"
    m = ModelFile.open(write_synthetic_model(path, tiny_spec("qwen3", context_length=160)))
    group = cpu_group(m, 2)
    rank = 0 if where.endswith("device 0") else 1
    tf = group.transformers[rank]
    calls = {"n": 0}
    real_forward = tf.forward

    def failing_forward(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError(f"simulated fault on device {rank}")
        return real_forward(batch)

    if where.startswith("forward"):
        tf.forward = failing_forward
    d = make((m, group))
    if where.startswith("control"):
        mirror = d.followers[0].mirror
        real_apply = mirror.apply

        def failing_apply(ops):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("simulated fault on device 1")
            real_apply(ops)

        mirror.apply = failing_apply
    try:
        col = Collector()
        for key in range(3):
            d.submit(m.tokenizer.encode(f"fault {key}"),
                     SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                     col.sink_for(key))
        col.wait(3, timeout=30)
        assert {col.result(k)[2] for k in range(3)} == {FinishReason.ERROR}
        assert f"simulated fault on device {rank}" in col.outputs[0][-1].error
        late = queue.Queue()
        d.submit(m.tokenizer.encode("late"), SamplingParams(max_tokens=3), late.put)
        out = late.get(timeout=10)
        assert out.finish_reason is FinishReason.ERROR and out.error
        assert d.failure is not None
    finally:
        t0 = time.perf_counter()
        closer = threading.Thread(target=d.shutdown, daemon=True)
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "shutdown hung"
        assert time.perf_counter() - t0 < 30
        tf.forward = real_forward
        group.close()


def test_embeddings_run_on_every_device_between_rounds(model, model_path):
    """An embedding's forward over two devices (each its share, meeting in the
    all-reduces) between the rounds of a request in flight, which goes on unchanged; the
    vector is a float64 numpy forward's (tests/reference_forward.py), within the cpu
    backend's rounding."""
    from eagerlm.service.api.embeddings import Pooling, embed_ids
    from tests.test_embeddings import reference_embedding

    m, _ = model
    ids = m.tokenizer.encode("the cat sat on the mat and then some")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [1, 2, 3]
    with make(model) as d:
        stream = d.stream(prompt, params)
        first = next(stream)
        for pooling in (Pooling.LAST, Pooling.MEAN):
            v = d.call_on_every_device(lambda tf, p=pooling: embed_ids(tf, ids, p))
            np.testing.assert_allclose(v, reference_embedding(str(model_path), ids, pooling),
                                       atol=5e-3)
        assert first.token_ids + [t for o in stream for t in o.token_ids] == alone(
            model, prompt, params)[0]
        assert_idle(d)


def test_prompt_lookup_speculation_over_two_devices_changes_no_token(model):
    """Speculating sessions' proposals and positions are made on device 0 inside the
    round and broadcast to device 1 before the forward: every request, greedy or
    sampled, is still its run alone (without speculation) through the sequential loop,
    and proposals were accepted (so rounds did verify drafts over both devices)."""
    from tests.test_speculative import repetitive_prompt

    reqs = [(k, repetitive_prompt(model, k),
             SamplingParams(temperature=0.0 if k < 3 else 0.8, seed=k, max_tokens=48,
                            ignore_eos=True)) for k in range(4)]
    spec = SpeculationConfig("ngram", num_tokens=4, adaptive=False)
    with make(model, speculation=spec) as d:
        col = run_workload(d, reqs)
        traces = list(d.traces)
        assert_idle(d)
    assert sum(t.n_draft_rows for t in traces) > 0
    assert d.service.stats.accepted_tokens > 0
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_what_two_devices_do_not_do_yet_is_refused(model):
    m, _ = model
    prompt = m.tokenizer.encode("hello")
    with make(model) as d:
        with pytest.raises(InvalidParameters, match="speculative"):
            d.submit(prompt, SamplingParams(speculative="draft"), lambda out: None)
        with pytest.raises(InvalidParameters, match="call_on_every_device"):
            d.call_between_rounds(lambda: None)  # device 0 alone would wait for device 1
        # and the engine keeps serving
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert [t for o in d.stream(prompt, params) for t in o.token_ids] == alone(
            model, prompt, params)[0]
    with pytest.raises(InvalidParameters, match="speculative"):
        make(model, speculation=SpeculationConfig("draft"))


def test_engine_open_with_tensor_parallel_2_serves_end_to_end(model, model_path):
    """The front door: `Engine.open(..., tensor_parallel=2)` loads the model over two cpu
    devices and completes a prompt as the sequential loop over two devices does."""
    m, _ = model
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main():
        async with Engine.open(model_path, tensor_parallel=2, page_size=PAGE,
                               kv_budget_bytes=1 << 22) as e:
            assert e.loaded.group is not None and e.loaded.group.size == 2
            done = await e.complete("the cat sat on the mat", params)
            with pytest.raises(InvalidParameters, match="empty"):
                e.embed([""])  # refused before any device: one failing would fail all
            assert np.linalg.norm(e.embed(["the cat"])[0]) == pytest.approx(1.0)
            assert e.failure is None
            return done

    done = anyio.run(main)
    prompt = m.tokenizer.encode("the cat sat on the mat")
    assert list(done.token_ids) == alone(model, prompt, params)[0]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_a_mixture_of_experts_over_two_devices_serves_end_to_end(tmp_path, arch):
    """A mixture split within its experts (loader/sharding.py) through the front door:
    each request's greedy tokens are those of the sequential loop over the same two
    devices, and their pages go back to every device's pool."""
    path = write_synthetic_model(tmp_path / f"{arch}.gguf",
                                 tiny_spec(arch, context_length=160))
    m = ModelFile.open(path)
    group = cpu_group(m, 2)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = ["the cat sat on the mat", "a b c d e f g", "one two three"]
    try:
        want = [alone((m, group), m.tokenizer.encode(p), params)[0] for p in prompts]
    finally:
        group.close()

    async def main():
        async with Engine.open(path, tensor_parallel=2, page_size=PAGE,
                               kv_budget_bytes=1 << 22) as e:
            assert e.loaded.group is not None and e.loaded.group.size == 2
            async with anyio.create_task_group() as tg:
                got: dict[int, list[int]] = {}

                async def one(i: int) -> None:
                    got[i] = list((await e.complete(prompts[i], params)).token_ids)
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert e.failure is None
            return [got[i] for i in range(len(prompts))]

    assert anyio.run(main) == want


def test_the_front_ends_take_tensor_parallel_and_refuse_what_cannot_run(model_path):
    args = build_parser().parse_args(["generate", "-m", str(model_path), "-tp", "2", "-p", "hi"])
    assert args.tensor_parallel == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "-m", str(model_path), "-tp", "0", "-p", "hi"])
    with pytest.raises(InvalidParameters, match="tensor_parallel"):
        EngineSettings(tensor_parallel=0)
    with pytest.raises(InvalidParameters, match="speculative"):
        EngineSettings(tensor_parallel=2, speculative="draft", draft_model="draft.gguf")
    assert EngineSettings(tensor_parallel=2, speculative="ngram").tensor_parallel == 2
    with pytest.raises(UnevenShard, match="heads"):  # 4 query heads over 3 devices
        Engine.load(model_path, tensor_parallel=3)


def test_bench_offline_over_two_devices_produces_every_requested_token(tmp_path, capsys):
    """`eagerlm bench offline -tp 2`: the measurement tools load the model over two
    devices and drive the same dispatcher (service/measure/harness.py)."""
    import json

    out = tmp_path / "offline.json"
    args = build_parser().parse_args(
        ["bench", "offline", "--synthetic", "tiny", "-tp", "2", "-n", "4", "--input-len",
         "4-16", "--output-len", "2-8", "--json", str(out)])
    assert args.func(args) == 0
    assert "Throughput:" in capsys.readouterr().out
    s = json.loads(out.read_text())["summary"]
    assert s["n_failed"] == 0 and s["output_tokens"] > 0


def test_the_profiler_shows_a_lane_per_device(model):
    """Each round's span on device 1 (its own events, its own clock) beside device 0's:
    the two overlap in every round (they meet in its collectives), and the Perfetto trace
    has device 1's track with every round."""
    from eagerlm.service.measure.profiler import RoundCollector
    from eagerlm.service.measure.round_timeline import DeviceClock
    from eagerlm.service.measure.trace_export import PEER_TID, TracedRun, chrome_trace

    m, _ = model
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with make(model) as d:
        with RoundCollector(d, DeviceClock.calibrate(d.device)) as collector:
            list(d.stream(m.tokenizer.encode("the cat sat"), params))
    spans = collector.spans
    assert len(spans) == 10
    for s in spans:
        (start, end), = s.peers
        assert start < s.device_end and s.device_start < end, s
    events = chrome_trace([TracedRun("eager", spans)])["traceEvents"]
    assert len([e for e in events if e.get("tid") == PEER_TID and e["ph"] == "X"]) == 10
    assert any(e.get("tid") == PEER_TID and e["ph"] == "M"
               and e["args"].get("name") == "device 1 (compute stream)" for e in events)
    from eagerlm.service.measure.timeline_plot import rows_for

    assert rows_for(spans) == ("control: plan", "control: launch", "device", "device 1",
                               "service: tokens")
    # the summary's figures for device 1, from its own lane: a bubble and a round time
    from eagerlm.service.measure.round_timeline import timeline_stats

    stats = timeline_stats(spans)
    (bubble,), (ms,) = stats.peer_bubble, stats.peer_device_ms
    assert 0.0 <= bubble < 1.0 and ms > 0.0
