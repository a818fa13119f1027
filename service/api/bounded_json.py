"""JSON text from outside (request bodies, tool-call arguments, a model's tool calls)
decoded without the two ways valid-looking JSON can hurt a server.

- Depth: Python's `json` parser recurses once per nested array or object, so
  `[[[[...]]]]` a few thousand deep raises RecursionError, an internal error from a
  client's mistake. The depth is measured first, without recursion and in linear time
  (regular expressions and numpy over the text, no Python loop per character), and text
  nested deeper than MAX_JSON_DEPTH is refused before the parser sees it.
- Lone surrogates: JSON may spell a UTF-16 surrogate on its own (`"\\ud800"`), which
  decodes to a Python str that cannot be encoded as UTF-8; carried into a prompt or an
  error message it fails far from where it came in. I-JSON (RFC 7493) forbids them, and
  so do we: such text is refused here.

Both refusals are `JSONRefused`, a ValueError, so callers that already catch the parser's
ValueError treat them as any other invalid JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 128  # nested arrays and objects; serde_json's default recursion limit

# A JSON string from its opening quote: to its closing quote, or to the end of the text
# when unterminated (so a failed match never makes the search restart inside it, which
# would be quadratic). Possessive repeats: no backtracking.
_STRING = re.compile(r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_OPENERS = np.zeros(256, dtype=np.int8)
_OPENERS[[ord("["), ord("{")]] = 1
# Only a `\u` escape can make a surrogate (UTF-8 text cannot hold one): when the text has
# no such escape, the decoded value has none, and is not walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class JSONRefused(ValueError):
    """Text that is JSON but is not decoded: nested too deep, or with a lone surrogate."""


def nesting_depth(text: str) -> int:
    """How deeply arrays and objects nest in `text` (0 for a scalar): the most brackets
    open at once outside strings. Exact for any prefix the JSON parser would accept, so
    it bounds the parser's recursion whether or not the text is valid."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = 2 * _OPENERS[codes].astype(np.int64) - 1  # +1 opens, -1 closes
    return max(0, int(np.cumsum(steps).max()))


def loads(text: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads(text), refusing (JSONRefused) nesting deeper than `max_depth` and lone
    surrogates; the parser's own ValueError for invalid JSON."""
    _check_depth(text, max_depth)
    return _without_surrogates(json.loads(text), text)


def raw_decode(text: str, pos: int = 0, *, max_depth: int = MAX_JSON_DEPTH,
               depth_checked: bool = False) -> tuple[Any, int]:
    """json.JSONDecoder().raw_decode(text, pos) with `loads`'s refusals: the value that
    starts at `pos` and where it ends.

    A caller reading values one after another from one text checks
    `nesting_depth(text) <= max_depth` once and passes `depth_checked=True`, so the reads
    stay linear in all: from the end of any value the depth is at most the whole text's.
    """
    if not depth_checked:
        _check_depth(text[pos:], max_depth)
    value, end = _DECODER.raw_decode(text, pos)
    return _without_surrogates(value, text[pos:end]), end


_DECODER = json.JSONDecoder()


def _check_depth(text: str, max_depth: int) -> None:
    if nesting_depth(text) > max_depth:
        raise JSONRefused(f"arrays and objects nest deeper than {max_depth} levels")


def _without_surrogates(value: Any, text: str) -> Any:
    """`value`, after checking that no string in it (keys included) holds a lone
    surrogate. The walk keeps its own stack: depth is bounded, but no recursion is
    needed either."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return value
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                raise JSONRefused(f"a string holds the lone UTF-16 surrogate "
                                  f"{ascii(found.group())[1:-1]}, which is not a "
                                  f"Unicode character")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


__all__ = ["MAX_JSON_DEPTH", "JSONRefused", "loads", "nesting_depth", "raw_decode"]
