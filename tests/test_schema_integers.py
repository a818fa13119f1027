"""JSON schema integers bounded to 16 digits unless the schema bounds them itself
(dispatch/schema_integers.py), as llama.cpp's schema converter bounds them: checked on the
schema rewrite, and on what the compiled constraint lets through, token by token, with the
synthetic model's tokenizer (the digits each answer has are counted by hand here, the
independent reference)."""

from __future__ import annotations

import json

import pytest

from eagerlm.dispatch.grammar import GrammarCompiler
from eagerlm.dispatch.schema_integers import INTEGER_LIMIT, bound_integers
from eagerlm.kernels.sampling import Constraint
from eagerlm.service.api.tool_calls import ToolCallFormat, forced_call
from tests.test_dispatcher import model as model  # the module-scoped synthetic model

BOUNDS = {"minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}


def test_every_unbounded_integer_of_a_schema_gets_sixteen_digit_bounds():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "const": {"type": ["integer", "null"]},
                       "x": {"type": "number"}, "either": {"type": ["integer", "number"]}},
        "$defs": {"count": {"type": "integer", "minimum": 0}},
        "items": {"anyOf": [{"type": "integer", "exclusiveMaximum": 5}, {"$ref": "#/$defs/c"}]},
        "prefixItems": [{"type": "integer"}],
        "additionalProperties": {"type": "integer", "minimum": 10**20},
        "const": {"type": "integer"}, "enum": [{"type": "integer"}],
    }
    out = bound_integers(json.loads(json.dumps(schema)))
    assert out["properties"]["n"] == {"type": "integer", **BOUNDS}
    assert out["properties"]["const"] == {"type": ["integer", "null"], **BOUNDS}  # a name
    assert out["properties"]["x"] == {"type": "number"}  # numbers are left alone
    assert out["properties"]["either"] == {"type": ["integer", "number"]}
    assert out["$defs"]["count"] == {"type": "integer", "minimum": 0,
                                     "maximum": INTEGER_LIMIT}
    assert out["items"]["anyOf"][0] == {"type": "integer", "exclusiveMaximum": 5,
                                        "minimum": -INTEGER_LIMIT}
    assert out["prefixItems"][0] == {"type": "integer", **BOUNDS}
    # a schema asking for integers longer than ours keeps that side open
    assert out["additionalProperties"] == {"type": "integer", "minimum": 10**20}
    # data is never rewritten
    assert out["const"] == schema["const"] and out["enum"] == schema["enum"]


@pytest.fixture(scope="module")
def compiler(model):
    m, _ = model
    return GrammarCompiler(m.tokenizer, m.config.vocab_size)


def takes(model, compiler, constraint: Constraint, text: str) -> bool:
    """Whether the constraint lets `text` through, every token of it."""
    tok = model[0].tokenizer
    matcher = compiler.matcher(constraint)
    return all(matcher.accept(t) for t in tok.encode(text, add_special=False))


def test_an_unbounded_integer_takes_sixteen_digits_and_no_more(model, compiler):
    schema = Constraint.json_schema({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]})
    assert takes(model, compiler, schema, '{"n": ' + "9" * 15 + "8}")
    assert takes(model, compiler, schema, '{"n": -' + "9" * 15 + "8}")
    assert takes(model, compiler, schema, '{"n": 1' + "0" * 15 + "}")
    assert not takes(model, compiler, schema, '{"n": 1' + "0" * 16)  # 10^16: 17 digits
    assert not takes(model, compiler, schema, '{"n": ' + "9" * 17)
    # the schema's own bound wins: eighteen digits where it asks for them (llguidance
    # takes bounds as int64s)
    wide = Constraint.json_schema({"type": "integer", "minimum": 0, "maximum": 10**18})
    assert takes(model, compiler, wide, "9" * 18)


def test_a_forced_tool_calls_integer_arguments_are_bounded_too(model, compiler):
    tools = [("set_count", {"type": "object", "properties": {"n": {"type": "integer"}},
                            "required": ["n"], "additionalProperties": False})]
    constraint = forced_call(ToolCallFormat.LLAMA3_JSON, tools, lambda _: False)
    call = '{"name": "set_count", "parameters": {"n": '
    assert takes(model, compiler, constraint, call + "9" * 15 + "8}}")
    assert not takes(model, compiler, constraint, call + "1" + "0" * 16)
    assert tools[0][1]["properties"]["n"] == {"type": "integer"}  # the request's, unchanged
