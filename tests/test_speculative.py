"""Speculative decoding through the eager dispatcher (cpu backend): prompt lookup proposes
on the device, every row is verified in the same forward, the accepted run lands in the
token buffer. Speculation changes how many forwards produce the tokens, never which: every
output here is checked against the same request run alone, one token per forward, through
the sequential reference loop (tests/sequential_reference.py)."""

from __future__ import annotations

import copy
import dataclasses
import queue
import random

import numpy as np
import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.round_costs import RoundCosts
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.dispatch.speculation import (
    SpecSession,
    SpeculationConfig,
    allocate_drafts,
    linear_cost,
)
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.kernels.speculative import accepted_run, ngram_proposal
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.vmm.device import open_device
from tests.sequential_reference import SequentialGeneration
from tests.test_dispatcher import Collector, _overlaps, slow_forwards

PAGE = 4096
NGRAM = SpeculationConfig("ngram", 4, adaptive=False)  # always the most drafts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "qwen3.gguf"
    m = ModelFile.open(write_synthetic_model(path, tiny_spec("qwen3", context_length=256)))
    return m, cpu_transformer(m)


def make(model, spec=NGRAM, *, sync=False, budget=1 << 22, max_batch=8, round_tokens=64,
         preempt="recompute", prefix_cache=True, tokenizer=None, draft=None):
    m, tf = model
    cfg = DispatcherConfig(
        control=ControlConfig(SchedulerConfig(max_batch=max_batch,
                                              max_round_tokens=round_tokens, map_ahead=4,
                                              preempt=preempt),
                              sync=sync, prefix_cache=prefix_cache, speculation=spec),
        kv_budget_bytes=budget)
    return Dispatcher(open_device("cpu", page_size=PAGE), tf, tokenizer or m.tokenizer, cfg,
                      draft=draft)


def alone(model, prompt, params, tokenizer=None):
    m, tf = model
    chunks = list(SequentialGeneration(tf, tokenizer or m.tokenizer, prompt, params))
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
            chunks[-1].finish_reason)


def repetitive_prompt(model, i: int) -> list[int]:
    """A prompt whose phrases repeat (what prompt lookup finds), different per i."""
    m, _ = model
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat"]
    rng = random.Random(i)
    phrase = " ".join(rng.choice(words) for _ in range(rng.randint(3, 6)))
    return m.tokenizer.encode(" ".join([phrase] * rng.randint(2, 4)) + " " + words[i % 9])


def run(d: Dispatcher, reqs) -> Collector:
    col = Collector()
    for key, prompt, params in reqs:
        d.submit(prompt, params, col.sink_for(key))
    col.wait(len(reqs))
    return col


# -- the device steps' reference ---------------------------------------------------------

def _naive_lookup(history, k, n_min, n_max):
    for n in range(n_max, n_min - 1, -1):
        if n >= len(history):
            continue
        suffix = list(history[-n:])
        for p in range(len(history) - n - 1, -1, -1):  # most recent first
            if list(history[p:p + n]) == suffix:
                out = list(history)
                for i in range(k):  # copying through its own end
                    out.append(out[p + n + i])
                return out[len(history):]
    return []


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    rng = np.random.default_rng(0)
    for _ in range(300):
        h = rng.integers(0, 6, size=rng.integers(1, 40)).astype(np.int32)
        k, n_min = int(rng.integers(0, 6)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        want = _naive_lookup(h, k, n_min, n_max) if k else []
        assert ngram_proposal(h, k, n_min, n_max).tolist() == want
    # the longest suffix wins over a more recent shorter one
    assert ngram_proposal(np.array([1, 2, 3, 9, 2, 3, 7, 1, 2, 3]), 2, 1, 3).tolist() == [9, 2]
    # a repeating tail is proposed repeated
    assert ngram_proposal(np.array([4, 5, 6, 5, 6]), 5, 1, 3).tolist() == [5, 6, 5, 6, 5]


def test_the_accepted_run_is_the_longest_prefix_where_samples_equal_drafts():
    assert accepted_run(np.array([5, 6, 7, 8]), np.array([5, 6, 9])) == 2
    assert accepted_run(np.array([5, 6, 7, 8]), np.array([5, 6, 7])) == 3
    assert accepted_run(np.array([5]), np.array([], np.int32)) == 0
    assert accepted_run(np.array([4, 6]), np.array([5])) == 0


def test_round_costs_are_learned_from_the_rounds_run():
    """Prices by (rows, drafted) in one-row rounds: the prior's (the backend's table)
    until a kind is seen in MIN_ROUNDS rounds, then its measured mean; a kind not seen
    keeps the prior's shape through the nearest size seen of its kind."""
    prior = NumpyOps().round_cost
    costs = RoundCosts(prior)
    assert [costs(r, d) for r in (1, 4, 9) for d in (False, True)] == [
        prior(r) for r in (1, 4, 9) for _ in (0, 1)]
    for _ in range(3):  # not yet enough rounds to trust
        costs.observe(1, False, 0.010)
        costs.observe(9, True, 0.020)
    assert costs(9, True) == prior(9)
    costs.observe(1, False, 0.010)
    costs.observe(9, True, 0.020)
    # a machine where 9 rows with drafts cost 2 one-row rounds, not the table's ~4.9
    assert costs(1, False) == 1.0 and costs(9, True) == pytest.approx(2.0)
    assert costs(5, True) == pytest.approx(1.5)  # on the line from one row's 1.0
    assert costs(13, True) == pytest.approx(2.0 * prior(13) / prior(9))  # the prior's growth
    assert costs(9, False) == prior(9)  # no plain 9-row round seen: the prior
    # cheap drafted rounds seen: more drafts than the table alone gives; then drafts that
    # did not pay are seen, priced up, and chosen less
    by_table = allocate_drafts([0.8], [8], 1, 1, RoundCosts(prior), 100)[0]
    cheap = allocate_drafts([0.8], [8], 1, 1, costs, 100)[0]
    assert cheap > by_table
    for _ in range(30):
        costs.observe(9, True, 0.060)
    assert costs(9, True) == pytest.approx(6.0, rel=0.1)
    assert allocate_drafts([0.8], [8], 1, 1, costs, 100)[0] < cheap
    # with no one-row round seen, the unit comes from the kind seen most, through the prior
    wide = RoundCosts(prior)
    for _ in range(5):
        wide.observe(8, False, 0.040)
    assert wide(8, False) == pytest.approx(prior(8))


def test_a_draft_models_forwards_are_priced_beside_the_rows_they_add():
    """A draft model's session pays the draft's first forward every round whatever its
    drafts (the proposal of its first token, which keeps the draft's KV current), and one
    more per draft token past the first. Worked by hand, rows at 0.2 of a one-row round,
    a session accepting 90%, every draft forward at 0.5 of a one-row round: expected
    tokens / cost are 1 / 1.5 without drafts (0.8 with the 1.2 margin), then 1.9 / 1.7 =
    1.118, 2.71 / 2.4 = 1.129, 3.439 / 3.1 = 1.109 for 1, 2, 3 drafts: 2."""
    lin = linear_cost(0.2)

    def alloc(first: float, step: float, drafter: bool = True) -> list[int]:
        return allocate_drafts([0.9], [8], 1, 1, lin, 100, drafter=[drafter],
                               draft_first=first, draft_step=step)
    assert alloc(0.0, 0.0) == [7]  # unpriced: as prompt lookup's
    assert alloc(0.5, 0.5) == [2]
    assert alloc(0.5, 0.5, drafter=False) == [7]  # prompt lookup's drafts: no draft model
    # however dear its forwards, a first draft costs only a row: the first forward runs
    # anyway (1.9 / 3.2 beats 1.2 * 1 / 3; two drafts: 2.71 / 5.4 do not)
    assert alloc(2.0, 2.0) == [1]
    # a dear first forward (two rows a session, every round) and cheap further ones: the
    # first is paid either way, so the further ones decide (8 drafts: 6.125 / 6.0)
    assert alloc(2.0, 0.2) == [8]
    # beside a prompt-lookup session accepting as often, the draft model's drafts past
    # its first rank after the other's: with rows free and a draft forward as dear as a
    # round, (2 + 0.9 + 0.81 + 0.729 + 0.656 + 0.9) / 2 = 3.0 beats any with more of the
    # draft model's (its second: 5.42 / 3 with two of the other's)
    assert allocate_drafts([0.9, 0.9], [4, 4], 2, 2, linear_cost(0.0), 100,
                           drafter=[False, True], draft_first=1.0, draft_step=1.0) == [4, 1]


def test_a_draft_forwards_price_is_learned_from_the_rounds_that_ran_it():
    """The draft model's first forward of a round and each further one, in one-row
    rounds: `draft_prior` until MIN_ROUNDS rounds show each; rounds of one forward give
    the first's, rounds of K the further ones' as (time - the first's) / (K - 1). Here a
    one-row round takes 10 ms, the draft's first forward 20 ms, each further one 4 ms,
    later 8 ms."""
    costs = RoundCosts(NumpyOps().round_cost, draft_prior=0.25)
    assert costs.draft_prices() == (0.25, 0.25)
    for _ in range(4):
        costs.observe(1, False, 0.010)
    for _ in range(3):
        costs.observe_draft(1, 0.020)
    assert costs.draft_prices() == (0.25, 0.25)  # three rounds: not yet trusted
    costs.observe_draft(1, 0.020)
    assert costs.draft_prices() == (pytest.approx(2.0), 0.25)  # the further ones: untried
    for _ in range(4):
        costs.observe_draft(3, 0.020 + 2 * 0.004)
    assert costs.draft_prices() == (pytest.approx(2.0), pytest.approx(0.4))
    for _ in range(40):  # the further forwards got dearer
        costs.observe_draft(5, 0.020 + 4 * 0.008)
    assert costs.draft_prices()[1] == pytest.approx(0.8, rel=0.05)
    # no one-forward round seen: every forward alike
    alike = RoundCosts(NumpyOps().round_cost, draft_prior=0.25)
    for _ in range(4):
        alike.observe(1, False, 0.010)
        alike.observe_draft(4, 4 * 0.006)
    assert alike.draft_prices() == (0.25, pytest.approx(0.6))
    # with no round's time to price them in, the prior
    unseen = RoundCosts(NumpyOps().round_cost, draft_prior=0.25)
    for _ in range(8):
        unseen.observe_draft(1, 0.008)
    assert unseen.draft_prices() == (0.25, 0.25)


def test_draft_rows_go_by_expected_gain_while_they_pay_for_themselves():
    # one session at batch 1, each row costing 0.2 of a one-row round: as many drafts as
    # maximise the expected tokens per cost
    lin = linear_cost(0.2)
    assert allocate_drafts([0.95], [8], 1, 1, lin, 100) == [8]
    assert allocate_drafts([0.9], [8], 1, 1, lin, 100) == [7]  # 8 drafts: 5.13/2.6 < 4.7/2.4
    assert allocate_drafts([0.1], [8], 1, 1, lin, 100) == [0]
    # a wide batch earns more per cost: a draft must be likelier to pay
    assert allocate_drafts([0.5], [8], 1, 1, lin, 100)[0] > allocate_drafts(
        [0.5] + [0.0] * 7, [8] * 8, 8, 8, lin, 100)[0]
    # the better session gets the rows first, within the budget
    assert allocate_drafts([0.9, 0.5], [4, 4], 2, 2, linear_cost(0.0), 3) == [3, 0]
    # the cpu backend's measured costs (each row about 0.45 of a one-row round): at batch 1
    # a session accepting 95% of its drafts gets several, one accepting 70% none (no count
    # of them beats one row by the margin); 8 sessions' rows already cost 4.3 one-row
    # rounds, so none of them gets one even at 95%
    measured = RoundCosts(NumpyOps().round_cost)  # nothing observed yet: the table
    assert allocate_drafts([0.95], [16], 1, 1, measured, 100)[0] >= 4
    assert allocate_drafts([0.7], [16], 1, 1, measured, 100) == [0]
    assert allocate_drafts([0.95] * 8, [16] * 8, 8, 8, measured, 100) == [0] * 8
    # the record moves toward what is observed, shadows included
    s = SpecSession("ngram", 4)
    for _ in range(20):
        s.observe(0, 0, 0, shadow=0)
    assert s.rate < 0.05
    for _ in range(20):
        s.observe(4, 4, 4, shadow=-1)
    assert s.rate > 0.9


# -- through the dispatcher -----------------------------------------------------------------

@pytest.mark.parametrize("sync", [False, True])
def test_output_with_prompt_lookup_equals_the_request_run_alone(model, sync):
    """Greedy and sampled requests, several at once, speculating with up to 4 drafts each
    round: identical tokens, text and finish reasons to one token per forward, with many
    drafts accepted (runs of several tokens emitted by one forward)."""
    reqs = []
    for key in range(8):
        params = SamplingParams(temperature=[0.0, 0.8][key % 2], seed=key, max_tokens=48,
                                ignore_eos=key % 3 != 0, top_k=[0, 20][key % 4 // 2])
        reqs.append((key, repetitive_prompt(model, key), params))
    with make(model, sync=sync) as d:
        col = run(d, reqs)
        stats = d.service.stats
        costs = d.control.round_costs
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key
    assert stats.accepted_tokens > 20 and stats.draft_tokens > 100
    # the plan's prices are learned from the rounds run (those that prefill nothing)
    assert costs is not None and any(costs.seen(rows, True) for rows in range(2, 64))


def test_stop_strings_end_tokens_and_max_tokens_cut_an_accepted_run_at_the_right_token(model):
    """Every stop position across a long speculative greedy run (a stop string, an end
    token, max_tokens): the output ends exactly where the request run alone ends, also
    where the stop falls inside a run of accepted tokens."""
    m, _ = model
    prompt = repetitive_prompt(model, 3)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref_tokens, ref_text, _ = alone(model, prompt, free)
    pieces = [m.tokenizer.decode([t]) for t in ref_tokens]
    variants = [dataclasses.replace(free, max_tokens=n) for n in range(1, 40)]
    variants += [dataclasses.replace(free, stop=(ref_text[c:c + 3],))
                 for c in range(0, len(ref_text) - 3, max(1, len(ref_text) // 30))]
    with make(model) as d:
        col = run(d, [(i, prompt, p) for i, p in enumerate(variants)])
        assert d.service.stats.accepted_tokens > 20
    for i, params in enumerate(variants):
        assert col.result(i) == alone(model, prompt, params), params
    # an end token: one the run says several times, made an end token of the tokenizer
    end = max(set(ref_tokens[5:]), key=ref_tokens.count)
    tok = copy.copy(m.tokenizer)
    tok.end_ids = frozenset({*m.tokenizer.end_ids, end})
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with make(model, tokenizer=tok) as d:
        got = run(d, [(0, prompt, params)]).result(0)
    assert got == alone(model, prompt, params, tokenizer=tok)
    assert got[2] is FinishReason.STOP and len(got[0]) < 40 and pieces


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_in_the_middle_of_speculative_runs_changes_no_token(model, preempt):
    m, _ = model
    reqs = [(key, repetitive_prompt(model, key),
             SamplingParams(temperature=[0.0, 1.0][key % 2], seed=key, max_tokens=40,
                            ignore_eos=True)) for key in range(8)]
    layout_bytes = m.config.n_layers * 2 * m.config.kv_dim * 4
    longest = max(len(p) for _, p, _ in reqs) + 40
    with make(model, budget=2 * longest * layout_bytes, preempt=preempt) as d:
        col = run(d, reqs)
        assert d.control.scheduler.preemptions > 0
        assert d.service.stats.accepted_tokens > 0
        d.flush()
        assert d.pool.n_free == d.pool.n_pages
        d.pool.audit()
    for key, prompt, params in reqs:
        assert col.result(key) == alone(model, prompt, params), key


def test_rejected_positions_never_reach_the_prefix_cache_and_pages_return(model):
    """A finished speculating session's KV is cached under its accepted tokens only (its
    rejected drafts' positions are past them): a second turn that reuses it says what the
    turn says alone; the idle pool gets every page back."""
    prompt = repetitive_prompt(model, 5)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with make(model) as d:
        first = run(d, [(0, prompt, params)]).result(0)[0]
        assert d.service.stats.draft_tokens > d.service.stats.accepted_tokens > 0
        second = prompt + first + prompt[:7]
        got = run(d, [(1, second, params)]).result(1)
        assert d.control.cache.hits == 1
        d.flush()
        assert d.pool.n_free == d.pool.n_pages
        d.pool.audit()
    assert got == alone(model, second, params)


def test_a_cancelled_speculating_stream_ends_and_frees_its_session(model):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with make(model, prefix_cache=False) as d:
        got = queue.Queue()
        rid = d.submit(repetitive_prompt(model, 1), params, got.put)
        outs = [got.get(timeout=30)]
        d.cancel(rid)
        while outs[-1].finish_reason is None:
            outs.append(got.get(timeout=30))
        assert outs[-1].finish_reason is FinishReason.CANCELLED
        d.flush()
        assert not d.control.sessions and d.pool.n_free == d.pool.n_pages
        other = repetitive_prompt(model, 2)
        assert run(d, [(0, other, params)]).result(0) == alone(model, other, params)


def test_adaptive_drafts_stop_where_proposals_fail_and_go_on_where_they_hold(model):
    """Free text (a random prompt on a random model: lookups rarely match what is said)
    ends up with no draft rows; a repeating one keeps drafting. Outputs stay exact."""
    m, _ = model
    rng = random.Random(9)
    noise = [rng.randrange(10, m.config.vocab_size) for _ in range(40)]
    reqs = [(0, noise, SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                      ignore_eos=True)),
            (1, repetitive_prompt(model, 2), SamplingParams(temperature=0.0, max_tokens=60,
                                                            ignore_eos=True))]
    adaptive = SpeculationConfig("ngram", 4, row_cost=0.2)
    for key, prompt, params in reqs:
        with make(model, spec=adaptive) as d:
            got = run(d, [(key, prompt, params)]).result(key)
            traces = sorted(d.traces, key=lambda t: t.round_id)
        assert got == alone(model, prompt, params)
        late = [t.n_draft_rows for t in traces[len(traces) // 2:]]
        if key == 0:
            assert sum(late) <= len(late) // 4, late
        else:
            assert sum(late) >= 2 * len(late), late


def test_penalized_and_constrained_requests_do_not_speculate(model):
    cfg = SpeculationConfig("ngram", 4)
    assert cfg.method_for(SamplingParams(frequency_penalty=0.5)) == "off"
    assert cfg.method_for(SamplingParams(num_speculative_tokens=0)) == "off"
    assert cfg.method_for(SamplingParams(speculative="off")) == "off"
    assert SpeculationConfig().method_for(SamplingParams(speculative="ngram")) == "ngram"


def test_constrained_requests_beside_speculating_ones_are_unchanged(model):
    """A grammar's mask for token t + 1 needs token t, so constrained sessions do not
    speculate; in the same rounds as speculating ones (their rows sampled last, after the
    drafts' rows), they say what they say in an engine that does not speculate."""
    from eagerlm.kernels.sampling import Constraint

    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    reqs = []
    for key in range(6):
        constraint = Constraint.regex(regex) if key % 2 else None
        reqs.append((key, repetitive_prompt(model, key),
                     SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                    constraint=constraint)))
    with make(model) as d:
        got = run(d, reqs)
        assert d.service.stats.accepted_tokens > 0
    with make(model, spec=SpeculationConfig()) as d:
        plain = run(d, reqs)
    for key, prompt, params in reqs:
        assert got.result(key) == plain.result(key), key
        if params.constraint is None:
            assert got.result(key) == alone(model, prompt, params)


def test_speculative_rounds_are_launched_before_the_last_ones_tokens_are_known(
        model, monkeypatch):
    """No host wait is added: with acceptance decided on the device, round n + 1 (its
    positions and inputs depending on how many tokens round n accepted) is launched before
    round n's tokens reach the service thread, as without speculation (each forward made
    to take 20 ms, as tests/test_dispatcher.py's eagerness test does)."""
    _, tf = model
    slow_forwards(tf, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with make(model) as d:
        got = run(d, [(0, repetitive_prompt(model, 2), params)]).result(0)
        traces = list(d.traces)
        assert d.service.stats.accepted_tokens > 10
    assert got == alone(model, repetitive_prompt(model, 2), params)
    assert _overlaps(traces) > (len(traces) - 1) // 2, (_overlaps(traces), len(traces))
