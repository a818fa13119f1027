"""Constrained decoding: the sampler's token mask, the mask hand-off between the host and
the sampler, and constrained requests through the eager dispatcher (cpu backend, a small
synthetic model: its random weights make the model want anything, so only the constraint
keeps the output in shape).

The independent checks are Python's `re` for regexes and `jsonschema` for JSON schemas;
eager against sync mode, and constrained requests among unconstrained ones against the
same unconstrained requests run alone (tests/sequential_reference.py), pin the dispatch.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest

from eagerlm.dispatch.grammar import GrammarCompiler, InvalidConstraint
from eagerlm.dispatch.mask_board import MaskBoard
from eagerlm.dispatch.messages import FinishReason
from eagerlm.kernels.sampling import (
    Constraint,
    InvalidSamplingParams,
    SamplingParams,
    allowed_tokens,
    mask_words,
    sample,
)
from eagerlm.service.api.tool_calls import ToolCallFormat, forced_call
from tests.test_dispatcher import Collector, alone, make
from tests.test_dispatcher import model as model  # the module-scoped synthetic model

VOCAB = 1000


def bitmask(allowed: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    bits = np.zeros(mask_words(vocab) * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


# -- the sampler's mask -------------------------------------------------------------------

def test_a_masked_row_draws_only_allowed_tokens_greedy_and_sampled():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, VOCAB)).astype(np.float32) * 4
    masks = [bitmask(rng.choice(VOCAB, rng.integers(1, 20), replace=False)) for _ in range(64)]
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)):
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
                  for i in range(64)]
        tokens = sample(logits, params, list(range(64)), masks=masks)
        for row, (token, mask) in enumerate(zip(tokens, masks, strict=True)):
            allowed = np.flatnonzero(allowed_tokens(mask, VOCAB))
            assert token in allowed
            if temperature == 0.0:  # greedy: the best allowed token
                assert token == allowed[np.argmax(logits[row, allowed])]


def test_the_mask_comes_after_the_logit_bias_so_a_bias_cannot_force_a_banned_token():
    logits = np.zeros((1, VOCAB), np.float32)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0})]
    assert sample(logits, params, [0], masks=[bitmask(np.array([3, 9]))])[0] == 3
    assert sample(logits, params, [0])[0] == 7


def test_unmasked_rows_are_sampled_as_without_masks():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(4)]
    assert list(sample(logits, params, [5] * 4, masks=[None] * 4)) == list(
        sample(logits, params, [5] * 4))


def test_a_mask_that_allows_nothing_is_an_error_not_a_token():
    with pytest.raises(ValueError, match="allows no token"):
        sample(np.zeros((1, VOCAB), np.float32), [SamplingParams(temperature=0.0)], [0],
               masks=[np.zeros(mask_words(VOCAB), np.int32)])


def test_a_constraint_names_its_kind():
    assert Constraint.json_schema({"type": "object"}).text == '{"type": "object"}'
    with pytest.raises(InvalidSamplingParams, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(InvalidSamplingParams, match="non-empty"):
        Constraint.regex("")
    with pytest.raises(InvalidSamplingParams, match="constraint"):
        SamplingParams(constraint="[a-z]+")  # a string is not a Constraint


# -- the board between the host and the sampler -------------------------------------------

def test_the_sampler_waits_for_a_mask_until_the_host_posts_it():
    board, got = MaskBoard(), []
    board.open(1)
    taker = threading.Thread(target=lambda: got.append(board.take(1, 0)))
    taker.start()
    time.sleep(0.05)
    assert taker.is_alive()  # nothing posted yet
    board.post(1, 0, np.ones(2, np.int32))
    taker.join(5)
    mask, waited = got[0]
    assert list(mask) == [1, 1] and waited >= 0.04


def test_a_closed_session_releases_its_waiting_sampler_with_no_mask():
    board, got = MaskBoard(), []
    board.open(1)
    taker = threading.Thread(target=lambda: got.append(board.take(1, 3)))
    taker.start()
    time.sleep(0.02)
    board.close(1)
    taker.join(5)
    assert got[0][0] is None
    assert board.take(1, 4)[0] is None  # and any later take returns at once
    board.open(2)
    board.shutdown()
    assert board.take(2, 0)[0] is None


def test_a_posted_mask_is_taken_without_waiting_and_only_once():
    board = MaskBoard()
    board.open(5)
    board.post(5, 0, np.zeros(1, np.int32))
    assert board.take(5, 0)[1] == 0.0
    board.close(5)
    assert board.open_sessions() == 0


# -- through the dispatcher ---------------------------------------------------------------

def run_all(d, requests):
    """Submit (prompt, params) pairs at once; each one's (token ids, text, finish)."""
    col = Collector()
    for key, (prompt, params) in enumerate(requests):
        d.submit(prompt, params, col.sink_for(key))
    col.wait(len(requests), timeout=120)
    return [col.result(k) for k in range(len(requests))]


def prompt_of(model, text):
    return model[0].tokenizer.encode(text)


def greedy(constraint=None, max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint, **kw)


REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
GBNF = 'root ::= answer " " answer\nanswer ::= "yes" | "no" | "maybe"'
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green"]}}}


def test_regex_gbnf_and_schema_outputs_match_and_end_with_stop(model):
    with make(model) as d:
        (_, regex_text, r1), (_, gbnf_text, r2), (_, json_text, r3) = run_all(d, [
            (prompt_of(model, "Code:"), greedy(Constraint.regex(REGEX))),
            (prompt_of(model, "Two answers:"), greedy(Constraint.gbnf(GBNF))),
            (prompt_of(model, "JSON:"),
             SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                            constraint=Constraint.json_schema(SCHEMA)))])
    assert re.fullmatch(REGEX, regex_text), regex_text
    assert re.fullmatch(r"(yes|no|maybe) (yes|no|maybe)", gbnf_text), gbnf_text
    jsonschema.validate(json.loads(json_text), SCHEMA)
    assert r1 == r2 == r3 == FinishReason.STOP  # the grammar ended each, not an end token


def test_a_reply_cut_by_max_tokens_before_the_grammar_ends_finishes_with_length(model):
    with make(model) as d:
        [(ids, text, reason)] = run_all(d, [
            (prompt_of(model, "Letters:"), greedy(Constraint.regex("[a-z]{200}"),
                                                  max_tokens=5))])
    assert reason == FinishReason.LENGTH and len(ids) == 5
    assert re.fullmatch("[a-z]*", text)


def test_an_invalid_schema_or_grammar_is_refused_at_submit_naming_the_field(model):
    with make(model) as d:
        for constraint, message in (
                (Constraint.json_schema({"type": "objectx"}, "response_format"), "objectx"),
                (Constraint.regex("[a-z", "regex_field"), "unclosed"),
                (Constraint.gbnf("root ::= \"a\" undefined", "grammar"), "undefined"),
                (Constraint.json_schema("{not json", "json_schema"), "json_schema")):
            with pytest.raises(InvalidConstraint, match=message) as err:
                d.submit(prompt_of(model, "x"), greedy(constraint), lambda o: None)
            assert err.value.param == constraint.field
        # and the dispatcher keeps serving
        [(_, text, _)] = run_all(d, [(prompt_of(model, "x"), greedy(Constraint.regex("ab")))])
        assert text == "ab"


MIXED = [("Code:", Constraint.regex(REGEX)), ("Once upon a time", None),
         ("JSON:", Constraint.json_schema(SCHEMA)), ("The river", None),
         ("Two answers:", Constraint.gbnf(GBNF)), ("def f(x):", None)]


def mixed_requests(model, sampled=False):
    return [(prompt_of(model, text),
             SamplingParams(temperature=0.9 if sampled else 0.0, seed=i, max_tokens=24,
                            constraint=c))
            for i, (text, c) in enumerate(MIXED)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_constrained_requests_give_the_same_output_in_eager_and_sync_mode(model, sampled):
    requests = mixed_requests(model, sampled)
    with make(model, max_batch=4) as d:
        eager = run_all(d, requests)
    with make(model, max_batch=4, sync=True) as d:
        synced = run_all(d, requests)
    assert eager == synced
    assert re.fullmatch(REGEX, eager[0][1])


def test_unconstrained_requests_among_constrained_ones_are_unchanged(model):
    requests = mixed_requests(model, sampled=True)
    with make(model, max_batch=8) as d:
        results = run_all(d, requests)
        traces = list(d.traces)
    for (prompt, params), got in zip(requests, results, strict=True):
        if params.constraint is None:
            assert got == alone(model, prompt, params)
    # the constrained rows' sampling took their masks from the host in every round
    assert any(tr.n_constrained for tr in traces)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_constrained_sessions_survive_preemption_with_the_same_output(model, preempt):
    """A pool for about two sessions: constrained sessions are preempted and resumed, and
    their masks still follow their tokens (the mask's key is the sample's index, which
    preemption keeps)."""
    m, _ = model
    requests = [(prompt_of(model, " ".join(["delta gamma"] * (4 + i))),
                 SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True,
                                constraint=Constraint.regex("[a-z ]{30,60}") if i % 2 else None))
                for i in range(8)]
    layout_bytes = m.config.n_layers * 2 * m.config.kv_dim * 4
    budget = 2 * (max(len(p) for p, _ in requests) + 40) * layout_bytes
    with make(model, max_batch=8) as d:
        roomy = run_all(d, requests)
    # no prefix cache: the prompts extend one another, and shared pages could make room
    with make(model, max_batch=8, budget=budget, round_tokens=64, preempt=preempt,
              prefix_cache=False) as d:
        tight = run_all(d, requests)
        assert d.control.scheduler.preemptions > 0
    assert roomy == tight
    for (_, params), (_, text, _) in zip(requests, tight, strict=True):
        if params.constraint is not None:
            assert re.fullmatch("[a-z ]{30,60}", text)


@pytest.mark.parametrize("fmt, text", [
    (ToolCallFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (ToolCallFormat.HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
])
def test_a_forced_call_grammar_takes_exactly_a_valid_call_in_the_models_format(model, fmt,
                                                                               text):
    """The forced-call constraint of both call formats (the hermes markers spelled out,
    as in a vocabulary where they are not special tokens): a valid call is accepted to
    the grammar's end, a call of another tool or with arguments outside the schema is
    not."""
    m, _ = model
    tools = [("get_weather", {"type": "object", "additionalProperties": False,
                              "required": ["city"],
                              "properties": {"city": {"enum": ["Oslo", "Rome"]}}}),
             ("get_time", None)]
    compiler = GrammarCompiler(m.tokenizer, m.config.vocab_size)

    def accepts(reply: str) -> bool:
        matcher = compiler.matcher(forced_call(fmt, tools, lambda _: False))
        return all(matcher.accept(t) for t in m.tokenizer.encode(
            reply, add_special=False)) and matcher.finished

    assert accepts(text)
    assert not accepts(text.replace("Oslo", "Paris"))
    assert not accepts(text.replace("get_weather", "launch_rockets"))
    assert accepts(text.replace('"get_weather"', '"get_time"').replace(
        '{"city": "Oslo"}', '{"zone": "CET"}'))  # no schema: any object
