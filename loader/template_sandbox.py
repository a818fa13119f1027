"""A Jinja sandbox whose renders end: bounded in time, in the size of every value, and in
memory built.

Chat templates arrive inside downloaded model files, so a template is untrusted code.
Jinja's immutable sandbox already stops attribute walks and mutation; it does not stop a
template that loops for hours or builds a 2 GB string in one C call. Three modules close
that: loader/template_deadline.py stops a render at its time limit
(`run_bounded`), loader/template_budget.py counts what a render builds against the size
limits, and this module routes every way a template can build a value through that count.

Operations that can make a big value in one step are estimated *before* they run: `+ * %
**` (intercepted binops), `~` (a code generator hook), macro and block output (`concat`),
list/tuple/dict literals, the filters center, indent, wordwrap, replace, join, format,
batch, slice and sum, and the str/bytes methods center, ljust, rjust, zfill, expandtabs,
join, replace, translate, format(_map) and int.to_bytes. Every other call and filter
result is checked after it returns.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
import types
from collections.abc import Callable, Iterable, Mapping
from string import Formatter
from typing import Any, TypeVar

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.runtime import Macro, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError
from markupsafe import EscapeFormatter, Markup

from eagerlm.loader.template_budget import (
    SLOT,
    TemplateLimitError,
    admit,
    check_bits,
    checked,
    cost,
    join_bounded,
    percent_size,
    spec_number,
    text_size,
)

T = TypeVar("T")


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, checking each field before formatting it: the widths
    and precisions in its spec (nested fields already substituted) plus the value."""

    def __init__(self, env: jinja2.Environment, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._size = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._size += text_size(value) + sum(map(spec_number, re.findall(r"\d+", format_spec)))
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
    "slice": lambda a: a["slices"] * SLOT,
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
                admit(text_size(left) + text_size(right), cost(left) + cost(right))
                return operator.add(left, right)
            return checked(operator.add(left, right))
        if op == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
                    n = max(count, 0)
                    admit(text_size(seq) * n, cost(seq) * n)
            if isinstance(left, int) and isinstance(right, int):
                check_bits(left.bit_length() + right.bit_length())
            return operator.mul(left, right)
        if op == "%":
            if isinstance(left, str):
                size = percent_size(left, right)
                admit(size, size)
            return operator.mod(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            check_bits(left.bit_length() * right)
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
        admit(0, cost(value))  # a slice is a copy
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

__all__ = ["BoundedSandbox"]
