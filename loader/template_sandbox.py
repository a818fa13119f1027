"""A Jinja sandbox whose renders end: bounded in time, in the size of every value, and in
memory built.

Chat templates arrive inside downloaded model files, so a template is untrusted code that
runs on the caller's thread (the CLI's main thread, a server worker thread). Jinja's
immutable sandbox already stops attribute walks and mutation; it does not stop a template
that loops for hours or builds a 2 GB string in one C call. Two mechanisms close that:

Time: `run_bounded(fn, seconds)` raises `TemplateLimitError` in the rendering thread once the
deadline passes. One watchdog thread interrupts it with `PyThreadState_SetAsyncExc`, which
raises at the rendering thread's next bytecode boundary. Why this rather than the
alternatives: a deadline checked inside the template's loops misses recursion through
macros and loops inside filters; a render in another thread or process that is abandoned
leaks the thread (and a server's concurrency slot) or costs a process per request; SIGALRM
works on the main thread only. The async exception reaches every pure-Python loop of
Jinja; what it cannot interrupt is one long C call, which is why C calls are kept small
(below). The exception is a `BaseException` so no `except Exception` in Jinja or a filter
swallows it, and `run_bounded` clears it if it is still pending when the render ends, so
it can never surface in the caller's code afterwards (CPython only).

Size: every value a template builds (string, list, dict, ...) must have a text form of at
most MAX_VALUE_CHARS characters, counted as `str()`, `==` and JSON would walk it (a list
holding the same big string twice counts it twice), and one render may build at most
MAX_BUILT units (characters, 8 per list or dict slot) in all. Operations that can make a
big value in one step are estimated *before* they run: `+ * % **` (intercepted binops),
`~` (a code generator hook), macro and block output (`concat`), list/tuple/dict literals,
the filters center, indent, wordwrap, replace, join, format, batch, slice and sum, and the
str/bytes methods center, ljust, rjust, zfill, expandtabs, join, replace, translate,
format(_map) and int.to_bytes. Every other call and filter result is checked after it
returns (its size is within a small factor of its inputs). So doubling a string in a loop
stops at the limit, and no single C call walks more than a few times MAX_VALUE_CHARS.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import inspect
import json
import operator
import re
import threading
import time
import types
from collections.abc import Callable, ItemsView, Iterable, KeysView, Mapping, ValuesView
from string import Formatter
from typing import Any, TypeVar

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.runtime import Macro, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError
from jinja2.utils import Namespace
from markupsafe import EscapeFormatter, Markup

T = TypeVar("T")

# A prompt longer than this is a runaway template, not a conversation: the largest
# contexts (~1M tokens) stay under it at a few characters a token. No single value a
# template builds may be longer than the longest prompt it may produce.
MAX_RENDERED_CHARS = 16 * 1024 * 1024
MAX_VALUE_CHARS = MAX_RENDERED_CHARS
# All a render may build: characters, and 8 per list/dict slot (about a byte each), so a
# render holds at most ~256 MB (1 GB of 4-byte characters) whatever it keeps alive.
MAX_BUILT = 16 * MAX_RENDERED_CHARS
# Real templates render in milliseconds; a few seconds is a runaway loop.
RENDER_TIME_LIMIT_S = 5.0
# Integers above this many bits come only from runaway arithmetic (9**9**9, squaring).
MAX_INT_BITS = 4096
_SLOT = 8


class TemplateLimitError(SecurityError):
    """The template ran past a time or size limit; the message names the limit."""


def _too_big(size: int) -> TemplateLimitError:
    return TemplateLimitError(
        f"chat template built a value of {size} characters; it exceeds the "
        f"{MAX_VALUE_CHARS}-character limit on any one value")


# -- time ----------------------------------------------------------------------------------

class _Alarm(BaseException):
    """Raised asynchronously in a render whose time is up (see the module docstring)."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Schedule `exc` in thread `thread_id` (None clears a scheduled one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


class _Watch:
    __slots__ = ("deadline", "done", "fired", "thread_id")

    def __init__(self, deadline: float, thread_id: int) -> None:
        self.deadline, self.thread_id = deadline, thread_id
        self.done = self.fired = False

    def __lt__(self, other: _Watch) -> bool:
        return self.deadline < other.deadline


class _Watchdog:
    """One daemon thread sleeping until the earliest deadline of the renders in progress.
    `done` and `fired` change only under the lock, so a render that ends just as its time
    is up is either interrupted (and `disarm` clears a pending alarm) or left alone."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._watches: list[_Watch] = []
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Watch:
        watch = _Watch(time.monotonic() + seconds, threading.get_ident())
        with self._wake:
            if self._thread is None or not self._thread.is_alive():  # first use, or forked
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="chat-template-watchdog")
                self._thread.start()
            heapq.heappush(self._watches, watch)
            if self._watches[0] is watch:
                self._wake.notify()
        return watch

    def disarm(self, watch: _Watch) -> None:
        with self._wake:
            watch.done = True
            fired = watch.fired
        if fired:
            _raise_in(watch.thread_id, None)  # delivered already, or cleared here

    def _run(self) -> None:
        with self._wake:
            while True:
                now = time.monotonic()
                while self._watches and (self._watches[0].done
                                         or self._watches[0].deadline <= now):
                    watch = heapq.heappop(self._watches)
                    if not watch.done:
                        watch.fired = True
                        _raise_in(watch.thread_id, _Alarm)
                self._wake.wait(self._watches[0].deadline - now if self._watches else None)


_WATCHDOG = _Watchdog()
_local = threading.local()


class _Budget:
    """What one render has built so far (see MAX_BUILT)."""

    def __init__(self) -> None:
        self.built = 0


def run_bounded(fn: Callable[[], T], time_limit_s: float) -> T:
    """`fn()` with a fresh build budget, raising TemplateLimitError after `time_limit_s`.

    Whatever happens, no alarm is pending and no budget is installed when this returns.
    """
    previous = getattr(_local, "budget", None)
    watch = _WATCHDOG.arm(time_limit_s)
    try:
        try:
            try:
                _local.budget = _Budget()
                return fn()
            finally:
                _WATCHDOG.disarm(watch)
        except _Alarm:
            raise TemplateLimitError(f"chat template rendering exceeded the {time_limit_s:g} s "
                                     f"time limit") from None
    finally:
        _local.budget = previous


# -- size ----------------------------------------------------------------------------------

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
        size = cost = len(value)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        size, cost = text_size(value), _SLOT * len(value)
    elif isinstance(value, (Namespace, ItemsView, KeysView, ValuesView)):
        size, cost = text_size(value), 0
    elif isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"chat template built an integer above {MAX_INT_BITS} "
                                 f"bits, which is not allowed")
        return value
    else:
        return value
    if any(value is x for x in inputs):
        cost = 0
    admit(size, cost)
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


def _number(digits: str) -> int:
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
            total += star if n == "*" else _number(n) if n else 0
        total += widest * (10 if kind in "ra" else 1)
    return total


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, checking each field before formatting it: the widths
    and precisions in its spec (nested fields already substituted) plus the value."""

    def __init__(self, env: jinja2.Environment, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._size = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._size += text_size(value) + sum(map(_number, re.findall(r"\d+", format_spec)))
        admit(self._size, 0)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


# -- estimates for the filters and methods that can build big values in one step -----------

def _str_len(v: Any) -> int:
    return len(v) if isinstance(v, (str, bytes)) else text_size(v)


def _materialized(a: dict[str, Any], key: str) -> list[Any]:
    """Replace an iterable argument by a list, so it can be measured and then used."""
    a[key] = items = list(a[key])
    return items


def _joined(items: list[Any], sep: Any) -> int:
    return sum(_str_len(x) for x in items) + _str_len(sep) * max(len(items) - 1, 0)


def _replaced(s: Any, old: Any, new: Any, count: Any) -> int:
    s, old, new = (x if isinstance(x, (str, bytes)) else str(x) for x in (s, old, new))
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _no_sequence_sum(a: dict[str, Any]) -> int:
    if not isinstance(a["start"], (int, float)):
        raise TemplateLimitError("chat template summed sequences, which is not allowed "
                                 "(quadratic copying)")
    return 0


# name -> (bound arguments -> size of the result), for filters that take a size argument
_FILTER_ESTIMATES: dict[str, Callable[[dict[str, Any]], int]] = {
    "center": lambda a: max(_str_len(a["value"]), a["width"]),
    "indent": lambda a: _str_len(a["s"]) + (str(a["s"]).count("\n") + 1) * (
        len(a["width"]) if isinstance(a["width"], str) else a["width"]),
    "wordwrap": lambda a: _str_len(a["s"]) * (1 + len(a["wrapstring"] or "\n")),
    "replace": lambda a: _replaced(a["s"], a["old"], a["new"], a["count"]),
    "join": lambda a: _joined(_materialized(a, "value"), a["d"]),
    "format": lambda a: percent_size(str(a["value"]), a["kwargs"] or a["args"]),
    "batch": lambda a: 0 if a["fill_with"] is None else a["linecount"] * (
        text_size(a["fill_with"]) + 2),
    "slice": lambda a: a["slices"] * _SLOT,
    "sum": _no_sequence_sum,
}

# method name -> (self, args) -> size of the result, for str/bytes/int methods
_METHOD_ESTIMATES: dict[str, Callable[[Any, list[Any]], int]] = {
    "center": lambda s, a: max(len(s), a[0]),
    "ljust": lambda s, a: max(len(s), a[0]),
    "rjust": lambda s, a: max(len(s), a[0]),
    "zfill": lambda s, a: max(len(s), a[0]),
    "expandtabs": lambda s, a: len(s) + s.count("\t" if isinstance(s, str) else b"\t") * (
        a[0] if a else 8),
    "join": lambda s, a: _joined(a[0], s),
    "replace": lambda s, a: _replaced(s, a[0], a[1], a[2] if len(a) > 2 else -1),
    "translate": lambda s, a: len(s) * max([1] + [len(x) for x in a[0].values()
                                                  if isinstance(x, (str, bytes))]
                                           if isinstance(a[0], Mapping) else [1]),
    "to_bytes": lambda s, a: a[0] if a else 1,
}


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """`f`, estimated before it runs when it takes a size argument, checked after."""
    if getattr(f, "jinja_async_variant", False):  # this environment is not async: the
        f = f.__wrapped__  # sync function the wrapper would run (it takes one argument less)
    estimate = _FILTER_ESTIMATES.get(name)
    signature = inspect.signature(f) if estimate is not None else None

    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marker
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if estimate is not None and signature is not None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            try:
                size = estimate(bound.arguments)
            except (TypeError, ValueError, AttributeError):
                size = 0  # bad arguments: the filter itself says what is wrong
            admit(size, size)
            args, kwargs = bound.args, bound.kwargs
            return f(*args, **kwargs)
        return checked(f(*args, **kwargs), args)

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """Routes `~` and non-constant list/tuple/dict literals through the environment's
    checks; Jinja compiles them to plain Python otherwise."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        escape = ("context.eval_ctx.autoescape" if frame.eval_ctx.volatile
                  else repr(bool(frame.eval_ctx.autoescape)))
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {escape})")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._literal(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment target
            super().visit_Tuple(node, frame)
        else:
            self._literal(super().visit_Tuple, node, frame)

    def _literal(self, visit: Callable[[Any, Frame], None], node: nodes.Expr,
                 frame: Frame) -> None:
        try:
            node.as_const(frame.eval_ctx)  # a constant is no bigger than the source
            visit(node, frame)
            return
        except nodes.Impossible:
            pass
        self.write("environment.checked_literal(")
        visit(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, made loud and bounded (see the module docstring).

    Loud: Jinja's sandbox answers an unsafe attribute with a silent undefined that only
    fails if used further; here the access itself raises, so probing a template is an
    error rather than an empty string. `lipsum` and `pprint` are removed: they build text
    in loops of their own sized by an argument, and no chat template uses them.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        del self.globals["lipsum"]
        del self.filters["pprint"]
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, f: Callable[..., Any]) -> None:
        """Register a filter, bounded like the built-in ones."""
        self.filters[name] = _bounded_filter(name, f)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    # -- the hooks compiled templates call --------------------------------------------------

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "+":
            if type(left) is str and type(right) is str:  # the common case, kept fast
                size = len(left) + len(right)
                admit(size, size)
                return left + right
            if isinstance(left, (str, bytes, list, tuple)) and type(left) is type(right):
                admit(text_size(left) + text_size(right), _cost(left) + _cost(right))
                return operator.add(left, right)
            return checked(operator.add(left, right))
        if op == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
                    n = max(count, 0)
                    admit(text_size(seq) * n, _cost(seq) * n)
            if isinstance(left, int) and isinstance(right, int):
                _check_bits(left.bit_length() + right.bit_length())
            return operator.mul(left, right)
        if op == "%":
            if isinstance(left, str):
                size = percent_size(left, right)
                admit(size, size)
            return operator.mod(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_bits(left.bit_length() * right)
        return operator.pow(left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(__obj, "__self__", None)
        estimate = (_METHOD_ESTIMATES.get(getattr(__obj, "__name__", ""))
                    if isinstance(owner, (str, bytes, int)) else None)
        if estimate is not None:
            if args and __obj.__name__ == "join":
                args = (list(args[0]), *args[1:])
            try:
                size = estimate(owner, list(args) + list(kwargs.values()))
            except (TypeError, ValueError, AttributeError, IndexError):
                size = 0  # bad arguments: the method itself says what is wrong
            admit(size, size)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(__obj, Macro):  # its output was charged by concat
            return result
        return checked(result, (owner, *args, *kwargs.values()))

    def getitem(self, obj: Any, argument: Any) -> Any:
        if type(argument) is not slice:  # hot: message['role']; Jinja's own first try
            try:
                return obj[argument]
            except (TypeError, LookupError):
                return super().getitem(obj, argument)
        value = super().getitem(obj, argument)
        admit(0, _cost(value))  # a slice is a copy
        return value

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Jinja's own wrapper for `str.format`/`format_map`, with a bounded formatter."""
        if (not isinstance(value, (types.MethodType, types.BuiltinMethodType))
                or value.__name__ not in ("format", "format_map")
                or not isinstance(value.__self__, str)):
            return None
        f_self: str = value.__self__
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            formatter: Formatter = (
                _BoundedEscapeFormatter(self, escape=f_self.escape)
                if isinstance(f_self, Markup) else _BoundedFormatter(self))
            return checked(type(f_self)(formatter.vformat(f_self, args, kwargs)))

        return functools.update_wrapper(wrapper, value)

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Joins a macro's, block's or `{% set %}` block's output."""
        return join_bounded(pieces)

    def concat_values(self, values: tuple[Any, ...], escape: bool) -> str:
        """`a ~ b ~ ...`: measured before joining."""
        texts = [v if type(v) is str else str(v) for v in values]
        size = sum(map(len, texts))
        admit(size, size)
        return markup_join(values) if escape else "".join(texts)

    def checked_literal(self, value: T) -> T:
        return checked(value)


def _cost(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    return _SLOT * len(value) if isinstance(value, (list, tuple, dict)) else 0


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"chat template built an integer above {MAX_INT_BITS} "
                                 f"bits, which is not allowed")


__all__ = ["MAX_BUILT", "MAX_INT_BITS", "MAX_RENDERED_CHARS", "MAX_VALUE_CHARS",
           "RENDER_TIME_LIMIT_S", "BoundedSandbox", "TemplateLimitError", "admit", "checked",
           "dumps_bounded", "join_bounded", "percent_size", "run_bounded", "text_size"]
