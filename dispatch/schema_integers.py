"""JSON schema integers bounded to at most 16 digits, unless the schema bounds them itself.

An unbounded `{"type": "integer"}` lets a constrained model write digits until max_tokens:
the demo model (Gemma 3 270M) answered one with hundreds of zeros, valid per the schema and
useless to the client. llama.cpp's schema converter writes an integer's integral part as
at most 16 digits (`[1-9][0-9]{0,15}`); llguidance has no such option (its JSON options are
separators, whitespace, `coerce_one_of`, `lenient` and escapes), so an integer schema that
lacks a lower or an upper bound gets one here before llguidance compiles it.

The bound is ±9,999,999,999,999,998, not 10^16 - 1: llguidance reads bounds as doubles, in
which 10^16 - 1 rounds to 10^16, and the demo model then wrote exactly 10000000000000000,
17 digits. 10^16 - 2 is even, so a double holds it exactly: every integer of at most 16
digits is allowed but 16 nines. A bound the schema gives is kept; when it is beyond ours
(a `minimum` of 10^20 with no `maximum`), the other side is left open, as the schema asks
for integers that long.

Applied to every JSON-schema constraint (dispatch/grammar.py: both server routes and the
Python API) and to a forced tool call's parameter schemas (service/api/tool_calls.py).
"""

from __future__ import annotations

from typing import Any

INTEGER_DIGITS = 16
INTEGER_LIMIT = 10**INTEGER_DIGITS - 2  # the largest such bound a double holds exactly

# keywords whose value is one subschema, a list of them, or a map of names to them
# (JSON Schema 2020-12, plus draft 4-7's spellings); `const`, `enum`, `default` and
# `examples` hold data, which is never rewritten
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bound_integers(schema: Any) -> Any:
    """`schema` (a parsed JSON schema, changed in place and returned) with every integer
    subschema that lacks a bound given ours. Walked without recursion: the depth is the
    user's."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if _is_integer(node):
            _bound(node)
        for key in _ONE:
            stack.append(node.get(key))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return schema


def _is_integer(node: dict[str, Any]) -> bool:
    """An integer schema (`"integer"`, or a type list with it but not "number", which
    bounds nothing here)."""
    kind = node.get("type")
    if isinstance(kind, list):
        return "integer" in kind and "number" not in kind
    return kind == "integer"


def _number(value: Any) -> float | None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if is_number else None


def _bound(node: dict[str, Any]) -> None:
    """A bound is added on a side the schema leaves open; a side it names, even with a
    value that is no number, is left to llguidance (which refuses what it cannot read)."""
    lower = [_number(node[k]) for k in ("minimum", "exclusiveMinimum") if k in node]
    upper = [_number(node[k]) for k in ("maximum", "exclusiveMaximum") if k in node]
    if not lower and not any(b is not None and b < -INTEGER_LIMIT for b in upper):
        node["minimum"] = -INTEGER_LIMIT
    if not upper and not any(b is not None and b > INTEGER_LIMIT for b in lower):
        node["maximum"] = INTEGER_LIMIT


__all__ = ["INTEGER_DIGITS", "INTEGER_LIMIT", "bound_integers"]
