"""Speculative decoding on the cuda backend (kernels/cuda/speculative.cu), on a GPU (skipped
without one) and on the emulated GPU: the device steps against kernels/speculative.py's
host reference, then the dispatcher with prompt lookup and with a draft model, where every
request must give exactly the tokens it gives alone without speculation (the emulated GEMM
computes each row on its own, `row_exact_gemm`, so exact equality is the specification, as
in tests/test_cuda_dispatch.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.kernels.speculative import (
    SPEC_STATS,
    SpecBuffers,
    SpecSeq,
    accept_on_host,
    prepare_on_host,
)
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from tests.cuda_testing import device, ops, rng  # noqa: F401  (fixtures)
from tests.test_cuda_dispatch import gpu  # noqa: F401  (fixture: the emulated GPU, row-exact)
from tests.test_dispatcher import Collector
from tests.test_speculative import repetitive_prompt

SLOTS, CONTEXT, K_MAX = 6, 48, 6


def _random_round(n_entries: int):
    """Histories with repeats (a small alphabet), lengths, and a round's entries."""
    history = rng.integers(0, 5, size=(SLOTS, CONTEXT + 1)).astype(np.int32)
    lengths = rng.integers(2, CONTEXT - K_MAX - 2, size=SLOTS).astype(np.int32)
    seqs, start, out = [], 0, 0
    for slot in rng.permutation(SLOTS)[:n_entries].tolist():
        k = int(rng.integers(0, 5))
        past = -1 if rng.random() < 0.7 else int(rng.integers(1, CONTEXT - K_MAX - 2))
        propose = k or int(rng.integers(0, 2))
        seqs.append(SpecSeq(slot, start, k, propose, past, out, bool(rng.random() < 0.8)))
        start += 1 + k + int(rng.integers(0, 3))  # other sessions' rows between
        out += 1 + k
    rows = np.zeros((start + 4, 2), np.int32)
    rows[:, 0] = rng.integers(0, 500, len(rows))
    return history, lengths, seqs, rows, out


def test_the_device_steps_equal_the_host_reference(ops) -> None:
    """spec_prepare (positions, prompt-lookup proposals into the draft rows) and
    spec_accept (runs, counts, statistics, lengths, histories, next inputs) against
    prepare_on_host / accept_on_host, on random rounds whose samples often match."""
    for trial in range(6):
        history, lengths, seqs, rows, n_out = _random_round(n_entries=1 + trial % SLOTS)
        proposals = np.zeros((SLOTS, 1 + K_MAX), np.int32)
        host = [a.copy() for a in (rows, lengths, history, proposals)]
        firsts = prepare_on_host(host[0], host[1], host[2], host[3], seqs, 1, 3)
        dev = SpecBuffers(ops.upload(lengths), ops.upload(history), ops.upload(proposals),
                          ops.upload(np.zeros(SLOTS, np.int32)),
                          ops.upload(np.zeros((64, 2), np.int32)), SLOTS, CONTEXT, K_MAX, 1, 3)
        meta = ops.upload(rows)
        assert ops.spec_prepare(meta, dev, seqs) is None  # positions stay on the device
        np.testing.assert_array_equal(ops.to_numpy(meta), host[0])
        got_firsts = ops.to_numpy(dev.firsts)
        assert [int(got_firsts[e.slot]) for e in seqs] == firsts
        got_prop = ops.to_numpy(dev.proposals)
        for e in seqs:
            n = host[3][e.slot, 0]
            np.testing.assert_array_equal(got_prop[e.slot, :1 + n], host[3][e.slot, :1 + n])
        # samples: the drafts (from the reference's rows) with a mismatch here and there
        out = rng.integers(0, 5, n_out + 3 * len(seqs) + len(seqs)).astype(np.int32)
        for e in seqs:
            drafts = host[0][e.start + 1:e.start + 1 + e.k, 0]
            out[e.out:e.out + e.k] = drafts
            cut = int(rng.integers(0, e.k + 1))
            out[e.out + cut] = 7  # never a draft: the run ends at `cut`
        token_buf = np.full(SLOTS, -1, np.int32)
        h_out, h_tok = out.copy(), token_buf.copy()
        n = len(seqs)
        accept_on_host(h_out, h_tok, host[1], host[2], host[3], seqs,
                       h_out[n_out:n_out + n], h_out[n_out + n:].reshape(n, SPEC_STATS))
        d_out, d_tok = ops.upload(out), ops.upload(token_buf)
        ops.spec_accept(d_out, d_tok, dev, seqs, n_out, n_out + n)
        np.testing.assert_array_equal(ops.to_numpy(d_out), h_out)
        np.testing.assert_array_equal(ops.to_numpy(d_tok), h_tok)
        np.testing.assert_array_equal(ops.to_numpy(dev.lengths), host[1])
        np.testing.assert_array_equal(ops.to_numpy(dev.history), host[2])


def test_device_positions_follow_the_device_lengths(ops) -> None:
    """spec_positions: sessions placed by the device take firsts[slot] + delta as their
    n_past (descriptors and row positions); the others keep the host's; the sampler's draw
    positions follow the rows'."""
    from eagerlm.kernels.device_tensor import KV_DTYPE, ContiguousDeviceKV
    from eagerlm.vmm.kv_layout import KVLayout

    kv = [ContiguousDeviceKV(ops, KVLayout(1, 1, 32, KV_DTYPE), 64) for _ in range(3)]
    batch = ForwardBatch(np.zeros(7, np.int32), [SeqSlice(0, 3, 40, kv[0]),
                                                 SeqSlice(3, 2, 10, kv[1]),
                                                 SeqSlice(5, 2, 50, kv[2])], np.arange(7))
    firsts = np.zeros(SLOTS, np.int32)
    firsts[4], firsts[1] = 17, 30
    buffers = SpecBuffers(None, None, None, ops.upload(firsts), None, SLOTS, CONTEXT, K_MAX,
                          1, 3)
    ops.spec_positions(batch, buffers, [(4, 0), None, (1, -1)])
    want = [17, 18, 19, 10, 11, 29, 30]
    np.testing.assert_array_equal(ops.to_numpy(batch.positions), want)
    table = ops.upload(np.zeros(3 * 32, np.uint8), "u8")
    ops.draw_positions(table, (batch.positions, np.array([2, 0, 6])), 3)
    drawn = ops.to_numpy(table).view(np.int64).reshape(3, 4)[:, 3]
    np.testing.assert_array_equal(drawn, [20, 18, 31])


def test_draft_proposals_are_the_argmax_with_ties_to_the_lower_id(ops) -> None:
    logits = rng.standard_normal((3, 3000)).astype(np.float32)
    logits[1, [100, 40]] = 50.0  # a tie
    seqs = [SpecSeq(2, 0, 2, 2, -1, 0, False), SpecSeq(0, 3, 0, 1, -1, 3, False),
            SpecSeq(5, 4, 3, 3, -1, 4, False)]
    rows = np.zeros((10, 2), np.int32)
    dev = SpecBuffers(None, None, ops.upload(np.zeros((SLOTS, 1 + K_MAX), np.int32)), None,
                      None, SLOTS, CONTEXT, K_MAX, 1, 3)
    meta = ops.upload(rows)
    ops.draft_propose(ops.upload(logits), meta, dev, seqs, 1)
    props = ops.to_numpy(dev.proposals)
    best = np.argmax(logits, axis=1)
    assert best[1] == 40
    for e, b in zip(seqs, best.tolist(), strict=True):
        assert props[e.slot, 0] == 2 and props[e.slot, 2] == b
    got_rows = ops.to_numpy(meta)
    assert got_rows[2].tolist() == [best[0], -1]  # row start + 1 + step
    assert got_rows[4 + 2].tolist() == [best[2], -1]
    assert got_rows[3 + 2].tolist() == [0, 0]  # the second has no draft row 2


# -- the dispatcher on the emulated GPU ------------------------------------------------------

@pytest.fixture(scope="module")
def model(gpu, tmp_path_factory):
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps

    path = tmp_path_factory.mktemp("m") / "qwen3.gguf"
    spec = tiny_spec("qwen3", context_length=160)  # tests/test_speculative.py's model
    m = ModelFile.open(write_synthetic_model(path, spec))
    target = cuda_transformer(m, ops=CudaOps(gpu))
    draft = cuda_transformer(m, ops=CudaOps.beside(target.ops))  # the model as its draft
    return m, target, draft


def _dispatcher(gpu, model, spec, *, pages=None, draft=False, **control) -> Dispatcher:
    m, tf, dr = model
    fraction = 0.05
    if pages is not None:
        free, _ = gpu.mem_info()
        fraction = (pages + 0.5) * gpu.page_size / free
    scheduler = SchedulerConfig(max_batch=control.pop("max_batch", 8),
                                max_round_tokens=control.pop("round_tokens", 64),
                                map_ahead=4, preempt=control.pop("preempt", "recompute"))
    return Dispatcher(gpu, tf, m.tokenizer, DispatcherConfig(
        control=ControlConfig(scheduler, speculation=spec, **control),
        memory_fraction=fraction), draft=dr if draft else None)


@pytest.fixture(scope="module")
def workload(model):
    """Greedy and sampled, logprobs or not; the first one's greedy output soon repeats one
    token, which prompt lookup then proposes and the target accepts."""
    m = model[0]
    return [(key, repetitive_prompt((m, None), i), SamplingParams(
                temperature=[0.0, 0.9][key % 2], seed=key, max_tokens=16, ignore_eos=True,
                logprobs=[None, 2][key % 3 == 0]))
            for key, i in enumerate((2, 1, 5, 3))]


@pytest.fixture(scope="module")
def alone(gpu, model, workload):
    out = {}
    for req in workload:
        with _dispatcher(gpu, model, SpeculationConfig(), max_batch=1) as d:
            out.update({req[0]: _run(d, [req]).result(req[0])})
    return out


def _run(d: Dispatcher, reqs) -> Collector:
    col = Collector()
    for key, prompt, params in reqs:
        d.submit(prompt, params, col.sink_for(key))
    col.wait(len(reqs), timeout=600)  # the emulated GPU is slow
    return col


NGRAM = SpeculationConfig("ngram", 3, adaptive=False)
DRAFT = SpeculationConfig("draft", 3, adaptive=False)
CONFIGS = {
    "ngram, graphs": dict(spec=NGRAM),
    "draft": dict(spec=DRAFT, draft=True),
    "ngram, eager launches": pytest.param(dict(spec=NGRAM, cuda_graphs=False),
                                          marks=pytest.mark.slow),
    "draft, sync": pytest.param(dict(spec=DRAFT, draft=True, sync=True),
                                marks=pytest.mark.slow),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_speculating_requests_equal_their_runs_alone(gpu, model, workload, alone,
                                                     config) -> None:
    """Every configuration gives each request exactly its tokens alone (greedy and sampled:
    the draws' positions come from the device), with drafts accepted: a check that the
    device's acceptance, lengths and token buffer carry the runs. Prompt lookup's rounds
    are decode graphs (kernels/cuda_spec_graphs.py), replayed, or with graphs off the same
    launches one by one; the draft model's take the general path."""
    kw = dict(config)
    with _dispatcher(gpu, model, kw.pop("spec"), **kw) as d:
        col = _run(d, workload)
        stats = d.service.stats
        spec_rounds = d.control._graphs.spec
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens > 0
    if not kw.get("draft"):
        assert spec_rounds is not None
        assert (spec_rounds.replays if kw.get("cuda_graphs", True)
                else spec_rounds.eager_rounds) > 0
    differ = {k: (col.result(k)[0], alone[k][0]) for k, _, _ in workload
              if col.result(k) != alone[k]}
    assert not differ, differ


@pytest.mark.slow
def test_speculating_sessions_preempted_midway_say_what_they_say_alone(gpu, model):
    """Three sessions of about 130 tokens of KV in a pool of three 128-token pages (the
    target's and the draft's KV, 512 bytes a token): each needs a second page midway, so
    the newest give way (their KV dropped, the draft's with it, recomputed on resume) in
    the middle of their speculative runs."""
    m = model[0]
    words = m.tokenizer.encode(" ".join(["gamma delta the cat"] * 40))
    reqs = [(key, [5 + key] + words[:119],  # 120 tokens: the second page comes midway
             SamplingParams(temperature=[0.0, 0.9][key % 2], seed=key, max_tokens=16,
                            ignore_eos=True)) for key in range(3)]
    with _dispatcher(gpu, model, DRAFT, draft=True, pages=3) as d:
        col = _run(d, reqs)
        assert d.control.scheduler.preemptions > 0
        assert d.service.stats.accepted_tokens > 0
    for req in reqs:
        with _dispatcher(gpu, model, SpeculationConfig(), max_batch=1) as d:
            assert col.result(req[0]) == _run(d, [req]).result(req[0]), req[0]


@pytest.mark.slow
def test_logprobs_of_an_accepted_run_are_each_tokens_own(gpu, model, workload):
    """A speculating session's logprobs come from the row that sampled each token."""
    _, prompt, params = workload[0]
    params = dataclasses.replace(params, logprobs=3)
    with _dispatcher(gpu, model, DRAFT, draft=True) as d:
        spec_out = list(d.stream(prompt, params))
    with _dispatcher(gpu, model, SpeculationConfig(), max_batch=1) as d:
        plain_out = list(d.stream(prompt, params))
    spec_lp = [lp for o in spec_out for lp in o.logprobs]
    plain_lp = [lp for o in plain_out for lp in o.logprobs]
    assert [lp.token for lp in spec_lp] == [lp.token for lp in plain_lp]
    for a, b in zip(spec_lp, plain_lp, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
