"""The dispatcher on the cuda backend, on the emulated GPU: whatever the configuration
(graphs or eager launches, prefix cache, chunked prefill, eager or sync, preemption by
recompute or swap, constrained requests among the others), every request gives exactly the
tokens it gives run alone.

On a GPU, as on the emulator's default GEMM, a row's rounding may depend on how many rows
share its GEMM, so batch composition can flip a near-tie; that is numerics, not dispatch.
Here the emulated GEMM computes each row on its own (`row_exact_gemm`), which makes exact
equality the specification: any difference is a dispatch bug (a token read from the wrong
slot, KV written to the wrong place), as the one a cached prefix once caused on cuda."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.kernels.sampling import Constraint
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test
from tests.test_dispatcher import random_workload, run_workload


@pytest.fixture(scope="module")
def gpu():
    from eagerlm.vmm.device import open_device

    with emulated_gpu_for_test(row_exact_gemm=True):
        device = open_device("cuda")
        yield device
        device.close()


@pytest.fixture(scope="module")
def model(gpu, tmp_path_factory):
    """gemma3: its sliding window (16) and softcapping beside the common path. Sessions
    span several pages (2 KiB of KV per token, 32 tokens per emulated page)."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    spec = tiny_spec("gemma3", n_layers=4, n_kv_heads=4, n_heads=4, head_dim=32,
                     d_model=64, context_length=160, final_logit_softcap=30.0)
    path = tmp_path_factory.mktemp("m") / "gemma3.gguf"
    m = ModelFile.open(write_synthetic_model(path, spec))
    return m, cuda_transformer(m, ops=CudaOps(gpu))


@pytest.fixture(scope="module")
def workload(model):
    """Seeded and greedy sampling, top-k, penalties, logprobs, EOS honoured or not. The
    last two repeat the first two's prompts (and run after the others: see `_results`),
    so they start from the prefix cache."""
    rng = random.Random(7)
    reqs = [(k, prompt, dataclasses.replace(
                params, repetition_penalty=rng.choice([1.0, 1.3]),
                frequency_penalty=rng.choice([0.0, 0.5]), logprobs=rng.choice([None, 2])))
            for k, prompt, params in random_workload(model, rng, 12)]
    return reqs + [(12 + k, prompt, params) for k, prompt, params in reqs[:2]]


def _dispatcher(gpu, model, *, pages: int | None = None, max_batch: int = 8,
                round_tokens: int = 32, preempt: str = "recompute",
                **control) -> Dispatcher:
    m, tf = model
    fraction = 0.05
    if pages is not None:  # a pool of about `pages` pages
        free, _ = gpu.mem_info()
        fraction = (pages + 0.5) * gpu.page_size / free
    scheduler = SchedulerConfig(max_batch=max_batch, max_round_tokens=round_tokens,
                                map_ahead=4, preempt=preempt)
    return Dispatcher(gpu, tf, m.tokenizer, DispatcherConfig(
        control=ControlConfig(scheduler, **control), memory_fraction=fraction))


def _results(d: Dispatcher, reqs, arrivals: random.Random | None = None,
             then: int = 2) -> tuple[dict, tuple[int, int, int]]:
    """Each request's (tokens, text, finish reason), the last `then` submitted once the
    others have finished; and (preemptions, pages in the pool, prefix-cache hits)."""
    with d:
        first = run_workload(d, reqs[:len(reqs) - then], arrivals)
        last = run_workload(d, reqs[len(reqs) - then:])
        stats = (d.control.scheduler.preemptions, d.pool.n_pages, d.control.cache.hits
                 if d.control.cache is not None else 0)
    return {k: (first if i < len(reqs) - then else last).result(k)
            for i, (k, _, _) in enumerate(reqs)}, stats


@pytest.fixture(scope="module")
def alone(gpu, model, workload):
    """Each request by itself: one session per round, whole prompts, no cache."""
    out = {}
    for req in workload:
        got, _ = _results(_dispatcher(gpu, model, max_batch=1, round_tokens=256,
                                      prefix_cache=False), [req], then=0)
        out.update(got)
    return out


CONFIGS = {  # settings paired where they do not interact, for the emulator's time
    "graphs": {},
    "eager launches, no prefix cache": dict(cuda_graphs=False, prefix_cache=False),
    "sync, chunked prefill": dict(sync=True, round_tokens=8),
    "preempt, recompute": dict(pages=10),
    "preempt, swap": dict(pages=10, preempt="swap"),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_every_request_equals_its_run_alone(gpu, model, workload, alone, config) -> None:
    kw = CONFIGS[config]
    got, (preemptions, n_pages, hits) = _results(_dispatcher(gpu, model, **kw), workload,
                                                 random.Random(5))
    if "pages" in kw:
        assert n_pages <= kw["pages"] + 1 and preemptions > 0, "the pool was not tight"
    if kw.get("prefix_cache", True) and "pages" not in kw:  # a tight pool evicts entries
        assert hits >= 2, "the repeated prompts did not start from the prefix cache"
    differ = [k for k in got if got[k] != alone[k]]
    assert not differ, {k: (got[k][0], alone[k][0]) for k in differ}


def test_an_evicted_prefix_waits_for_the_copy_that_reads_it(gpu, model) -> None:
    """A session starting from a cached prefix copies the entry's partial last page on
    the compute stream. If the pool then needs that entry's pages at once, evicting it
    must wait for the copy: its pages are unmapped and handed to the new session, and a
    copy still queued would read unmapped memory (a crash on the emulator; on a GPU, an
    illegal address or another session's KV). It did not wait. Here the compute stream
    is held by a gate while the session is admitted, so the copy is surely still queued
    (without the wait, this test crashes the emulator: the copy reads unmapped memory)."""
    import threading

    from eagerlm.kernels.sampling import SamplingParams
    from tests.test_dispatcher import Collector

    prompt = [(7 * i + 3) % 500 + 5 for i in range(40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with _dispatcher(gpu, model, pages=3, max_batch=2, round_tokens=256) as d:
        assert d.pool.n_pages == 3
        first = run_workload(d, [(0, prompt, greedy)]).result(0)[0]
        # 48 tokens cached = 1 whole page (32 tokens, shared) + a partial one (copied)
        longer = prompt + first + [(11 * i + 1) % 500 + 5 for i in range(40)]
        gate = d.control.compute.gate()
        threading.Timer(0.5, gate.open).start()
        col = Collector()
        d.submit(longer, greedy, col.sink_for(1))
        col.wait(1)
        got = col.result(1)
        assert d.control.cache.hits == 1
    want, _ = _results(_dispatcher(gpu, model, max_batch=1, round_tokens=256,
                                   prefix_cache=False), [(1, longer, greedy)], then=0)
    assert got == want[1]


def test_a_session_cancelled_before_its_first_round_waits_for_its_prefix_copy(gpu,
                                                                             model) -> None:
    """The same copy writes the new session's own page. A session cancelled before its
    first round (here it waits behind another, one session per round) keeps its region
    in the prefix cache; that entry may be evicted (its pages unmapped and reused) only
    after the copy: its event must come after it, not be missing (which meant: release
    at once)."""
    import time

    from eagerlm.dispatch.messages import FinishReason
    from eagerlm.kernels.sampling import SamplingParams
    from tests.test_dispatcher import Collector

    prompt = [(5 * i + 2) % 500 + 5 for i in range(40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    other = [(3 * i + 1) % 500 + 5 for i in range(12)]
    with _dispatcher(gpu, model, max_batch=1, round_tokens=256, lookahead=8) as d:
        first = run_workload(d, [(0, prompt, greedy)]).result(0)[0]
        col = Collector()
        # from here on the device waits behind the gate: the copy is surely still queued
        # when the cancel reaches the control thread (which may launch 8 rounds ahead)
        gate = d.control.compute.gate()
        try:
            d.submit(other, long, col.sink_for("other"))
            request = d.submit(prompt + first + [9, 10], greedy, col.sink_for("cancelled"))
            d.cancel(request)
            for _ in range(1000):  # until the cancelled session's region is cached
                if len(d.control.cache) == 2:
                    break
                time.sleep(0.01)
            assert d.control.cache.hits == 1 and len(d.control.cache) == 2
            entry = list(d.control.cache._entries.values())[-1]
            assert entry.event is not None and not entry.event.query()  # copy pending
        finally:
            gate.open()
        col.wait(2)
        entry.event.synchronize()
        assert col.result("cancelled")[2] is FinishReason.CANCELLED
        got = col.result("other")
    want, _ = _results(_dispatcher(gpu, model, max_batch=1, round_tokens=256,
                                   prefix_cache=False), [("other", other, long)], then=0)
    assert got == want["other"]


CONSTRAINTS = [Constraint.regex("[a-z]{2,6}(-[0-9]{1,3})?"),
               Constraint.gbnf('root ::= ("yes" | "no" | "maybe") (" " root)?'),
               Constraint.json_schema({"type": "object", "additionalProperties": False,
                                       "required": ["n"], "properties": {
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}}})]


@pytest.fixture(scope="module")
def constrained_workload(model):
    """Every other request constrained (a regex, a GBNF grammar or a JSON schema), mixed
    with unconstrained ones, penalties and logprobs, so decode rounds hold both."""
    rng = random.Random(11)
    return [(k, prompt, dataclasses.replace(
                params, max_tokens=max(params.max_tokens, 8),
                constraint=CONSTRAINTS[k % 3] if k % 2 else None,
                repetition_penalty=rng.choice([1.0, 1.3]), logprobs=rng.choice([None, 2])))
            for k, prompt, params in random_workload(model, rng, 8)]


@pytest.fixture(scope="module")
def constrained_alone(gpu, model, constrained_workload):
    """What each request of the constrained workload gives run alone (one per round)."""
    alone_ = {}
    for req in constrained_workload:
        got, _ = _results(_dispatcher(gpu, model, max_batch=1, round_tokens=256,
                                      prefix_cache=False), [req], then=0)
        alone_.update(got)
    return alone_


@pytest.mark.parametrize("config", ["graphs", "eager launches, no prefix cache",
                                    "sync, chunked prefill"])
def test_constrained_requests_equal_their_runs_alone(gpu, model, constrained_workload,
                                                     constrained_alone, config) -> None:
    """Decode rounds with constrained rows replay the forward-only graph variant (or its
    launches one by one), then sample free rows first and constrained ones with their
    masks: each request gives exactly the tokens it gives alone, and what the constrained
    ones give matches their constraint."""
    alone_ = constrained_alone
    d = _dispatcher(gpu, model, **CONFIGS[config])
    graphs = d.control._graphs
    got, _ = _results(d, constrained_workload, random.Random(5), then=0)
    differ = [k for k in got if got[k] != alone_[k]]
    assert not differ, {k: (got[k][0], alone_[k][0]) for k in differ}
    if config == "graphs":
        assert graphs is not None and graphs.forward_replays > 0
    for k, _, params in constrained_workload:
        if params.constraint is not None and got[k][2].value == "stop":
            text = got[k][1]
            if params.constraint.kind == "json_schema":
                assert 0 <= json.loads(text)["n"] <= 999
            elif params.constraint.kind == "regex":
                assert re.fullmatch("[a-z]{2,6}(-[0-9]{1,3})?", text), text
