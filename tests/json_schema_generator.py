"""Seeded random JSON schemas for the structured-output tests: objects, arrays, enums,
numbers with bounds, strings with patterns or lengths, nesting, required and optional
fields. Every schema is bounded (no free additional properties, strings and arrays with a
maximum length), so a reply can finish in a few dozen tokens; what stays free is what a
model must choose."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("name", "age", "city", "score", "tags", "active", "level", "color", "items",
          "id", "price", "kind", "owner", "count", "label", "size", "rank", "note")
_PATTERNS = (r"^[a-z]{1,8}$", r"^[A-Z][a-z]{0,6}$", r"^[0-9]{3}-[0-9]{2}$",
             r"^(red|green|blue)$", r"^[a-f0-9]{4}$")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1 to 3 properties, some required."""
    names = rng.sample(_WORDS, rng.randint(1, 3))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": props,
                              "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean", "array"]
    if depth < 1:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        # a multiple of 1/4: at most two decimals, where a free fraction never has to end
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100),
                "multipleOf": 0.25}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2),
                "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", 1, 2, True, None],
                                   rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9},
                           {"enum": ["x", "y", "z"]},
                           {"type": "string", "maxLength": 5}])
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 2)}
    return random_schema(rng, depth + 1)


def random_schemas(n: int, seed: int = 22) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
