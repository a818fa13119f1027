"""What one chat-template render may build: the size of every value and the total, and
the accounting that enforces both (loader/template_sandbox.py calls it from the sandbox's
hooks; loader/template_deadline.py installs a fresh budget for each render).

Every value a template builds (string, list, dict, ...) must have a text form of at most
MAX_VALUE_CHARS characters, counted as `str()`, `==` and JSON would walk it (a list
holding the same big string twice counts it twice), and one render may build at most
MAX_BUILT units (characters, 8 per list or dict slot) in all. Operations that can make a
big value in one step are estimated *before* they run (`admit` with the estimate: the
sandbox's binops, `~`, literals, and the filters and methods listed there; here
`join_bounded`, `dumps_bounded` and `percent_size`); every other result is charged after it
returns (`checked`: its size is within a small factor of its inputs). So doubling a string
in a loop stops at the limit, and no single C call walks more than a few times
MAX_VALUE_CHARS.
"""

from __future__ import annotations

import contextlib
import json
import operator
import re
import threading
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import Any, TypeVar

from jinja2.sandbox import SecurityError
from jinja2.utils import Namespace

T = TypeVar("T")

# A prompt longer than this is a runaway template, not a conversation: the largest
# contexts (~1M tokens) stay under it at a few characters a token. No single value a
# template builds may be longer than the longest prompt it may produce.
MAX_RENDERED_CHARS = 16 * 1024 * 1024
MAX_VALUE_CHARS = MAX_RENDERED_CHARS
# All a render may build: characters, and 8 per list/dict slot (about a byte each), so a
# render holds at most ~256 MB (1 GB of 4-byte characters) whatever it keeps alive.
MAX_BUILT = 16 * MAX_RENDERED_CHARS
# Integers above this many bits come only from runaway arithmetic (9**9**9, squaring).
MAX_INT_BITS = 4096
SLOT = 8


class TemplateLimitError(SecurityError):
    """The template ran past a time or size limit; the message names the limit."""


def _too_big(size: int) -> TemplateLimitError:
    return TemplateLimitError(
        f"chat template built a value of {size} characters; it exceeds the "
        f"{MAX_VALUE_CHARS}-character limit on any one value")


_local = threading.local()


class _Budget:
    """What one render has built so far (see MAX_BUILT)."""

    def __init__(self) -> None:
        self.built = 0


@contextlib.contextmanager
def fresh_budget() -> Iterator[None]:
    """A new build budget for the calling thread's render; the previous one afterwards."""
    previous = getattr(_local, "budget", None)
    _local.budget = _Budget()
    try:
        yield
    finally:
        _local.budget = previous


def text_size(value: Any, limit: int = MAX_VALUE_CHARS) -> int:
    """About `len(str(value))`, counting a part each time it is reachable, as `str()`,
    `==` and JSON walk it; stops counting past `limit`. Each distinct container is walked
    once, so a list repeating one object a million times costs a million steps, not more.
    """
    if type(value) is str:
        return len(value)
    return _size(value, {}, limit)


def _size(v: Any, memo: dict[int, int], limit: int) -> int:
    if isinstance(v, (str, bytes)):
        return len(v) + 3
    if v is None or isinstance(v, (bool, float)):
        return 24
    if isinstance(v, int):
        return v.bit_length() * 3 // 10 + 2
    if isinstance(v, Namespace):
        v = object.__getattribute__(v, "_Namespace__attrs")
    if isinstance(v, (ItemsView, KeysView, ValuesView)):  # a view of a dict: not memoized
        return _walk(v.mapping if isinstance(v, ItemsView) else v, memo, limit)
    if not isinstance(v, (Mapping, list, tuple, set, frozenset)):
        return 64  # macros, loop objects, ranges...: a short repr
    key = id(v)
    if key not in memo:
        memo[key] = 5  # a namespace that holds itself prints as {...}
        memo[key] = _walk(v, memo, limit)
    return memo[key]


def _walk(v: Any, memo: dict[int, int], limit: int) -> int:
    total = 2
    if isinstance(v, Mapping):  # keys and values one by one: item tuples are temporaries
        for k, x in v.items():
            total += _size(k, memo, limit) + _size(x, memo, limit) + 4
            if total > limit:
                break
    elif (types := set(map(type, v))) == {str}:  # flat lists of strings or ints: C speed
        total += sum(map(len, v)) + 5 * len(v)
    elif types == {int}:
        total += sum(map(int.bit_length, v)) * 3 // 10 + 4 * len(v)
    else:
        for x in v:
            total += _size(x, memo, limit) + 2
            if total > limit:
                break
    return total


def admit(size: int, cost: int) -> None:
    """Allow building a value of `size` characters (text_size) that costs `cost` units of
    the render's budget, or raise TemplateLimitError."""
    if size > MAX_VALUE_CHARS:
        raise _too_big(size)
    budget = getattr(_local, "budget", None)
    if budget is not None:  # None: constant folding while compiling
        budget.built += cost
        if budget.built > MAX_BUILT:
            raise TemplateLimitError(f"chat template rendering built more than {MAX_BUILT} "
                                     f"characters in all (the memory limit)")


def checked(value: T, inputs: tuple[Any, ...] = ()) -> T:
    """`value`, after charging it as built (unless it is one of `inputs`, returned as is)."""
    if isinstance(value, (str, bytes)):
        size = charge = len(value)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        size, charge = text_size(value), SLOT * len(value)
    elif isinstance(value, (Namespace, ItemsView, KeysView, ValuesView)):
        size, charge = text_size(value), 0
    elif isinstance(value, int) and not isinstance(value, bool):
        check_bits(value.bit_length())
        return value
    else:
        return value
    if any(value is x for x in inputs):
        charge = 0
    admit(size, charge)
    return value


def join_bounded(pieces: Iterable[str]) -> str:
    """`"".join(pieces)`, stopping as soon as the total passes MAX_VALUE_CHARS."""
    if isinstance(pieces, list):  # counted at C speed; the pieces exist already
        total = sum(map(len, pieces))
        admit(total, total)
        return "".join(pieces)
    out: list[str] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_VALUE_CHARS:
            raise _too_big(total)
        out.append(piece)
    admit(total, total)
    return "".join(out)


def dumps_bounded(value: Any, *, indent: int | str | None = None,
                  separators: tuple[str, str] | None = None, **options: Any) -> str:
    """`json.dumps`, measured before it runs: the compact form is within a small factor of
    the value's size plus its separators, and indentation adds, per line, the nesting
    depth times the indent (which can be far larger than the value itself)."""
    nodes, depth = _shape(value, {})
    item_sep, key_sep = separators or ((",", ": ") if indent is not None else (", ", ": "))
    admit(nodes * (len(item_sep) + len(key_sep)), 0)
    compact = json.dumps(value, separators=(item_sep, key_sep), **options)
    if indent is None:
        return checked(compact)
    width = len(indent) if isinstance(indent, str) else max(operator.index(indent), 0)
    size = len(compact) + (2 * nodes + 1) * (1 + width * depth)
    admit(size, size)
    return json.dumps(value, indent=indent, separators=(item_sep, key_sep), **options)


def _shape(v: Any, memo: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(nodes, nesting depth) of a JSON-like value, shared parts counted each time."""
    if not isinstance(v, (Mapping, list, tuple)):
        return 1, 0
    key = id(v)
    if key not in memo:
        memo[key] = (1, 0)  # a cycle: json.dumps refuses it anyway
        children = v.values() if isinstance(v, Mapping) else v
        nodes, depth = 1, 0
        for child in children:
            n, d = _shape(child, memo)
            nodes, depth = nodes + n + 1, max(depth, d)  # + 1: a key or a separator
        memo[key] = (nodes, depth + 1)
    return memo[key]


def spec_number(digits: str) -> int:
    return int(digits) if len(digits) <= 12 else MAX_VALUE_CHARS + 1


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def percent_size(fmt: str, args: Any) -> int:
    """An upper bound on `len(fmt % args)`: each conversion may print the widest argument
    (10 times over for %r/%a escapes) padded to its width and precision."""
    values = (list(args.values()) if isinstance(args, Mapping)
              else list(args) if isinstance(args, tuple) else [args])
    widest = max((text_size(v) for v in values), default=0)
    star = max((abs(v) for v in values if isinstance(v, int)), default=0)
    total = len(fmt)
    for width, precision, kind in _PERCENT.findall(fmt):
        for n in (width, precision):
            total += star if n == "*" else spec_number(n) if n else 0
        total += widest * (10 if kind in "ra" else 1)
    return total



def cost(value: Any) -> int:
    """What building a copy of `value` charges the budget."""
    if isinstance(value, (str, bytes)):
        return len(value)
    return SLOT * len(value) if isinstance(value, (list, tuple, dict)) else 0


def check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"chat template built an integer above {MAX_INT_BITS} "
                                 f"bits, which is not allowed")


__all__ = ["MAX_BUILT", "MAX_INT_BITS", "MAX_RENDERED_CHARS", "MAX_VALUE_CHARS", "SLOT",
           "TemplateLimitError", "admit", "check_bits", "checked", "cost", "dumps_bounded",
           "fresh_budget", "join_bounded", "percent_size", "spec_number", "text_size"]
