"""Constraints compiled against the engine's own tokenizer, and one matcher per request.

llguidance (llama.cpp's and vLLM's "guidance" backend) does the work: it compiles a JSON
schema, a regex, a Lark or a GBNF grammar, and gives the allowed-token bitmask after each
token. It needs the vocabulary as bytes, which `loader/tokenizer.py` already renders as
llama.cpp does (`Tokenizer.piece`), so no Hugging Face tokenizer is involved: special
tokens are marked with a leading 0xFF byte (llguidance's convention, as its llama.cpp
binding does), the end-of-generation set is the tokenizer's, and ids the model's output
layer has beyond the vocabulary render as nothing, so are never allowed.

`GrammarCompiler` (one per dispatcher) builds the llguidance tokenizer once, on the first
constrained request (about a second for a 262k vocabulary), and turns a `Constraint` into a
`GrammarMatcher`, or into `InvalidConstraint` naming the request field with llguidance's
message. A `GrammarMatcher` is then owned by the service thread, which advances it as the
request's tokens land (dispatch/service_thread.py).

A schema or grammar is the user's input, so what it may cost is bounded (`GrammarLimits`,
every value measured against hostile inputs): its size and shape are checked before
llguidance sees it, llguidance runs under explicit parser limits, and the compilation
runs on a thread of its own with a large stack (llguidance recurses once per level of a
`$ref` chain or a chain of rules: a 75 KB schema crashed the process on an 8 MiB stack)
and a deadline. A compiled grammar whose mask or token step outgrows the parser limits
while generating raises `ConstraintFailed`, which ends that request alone.

A JSON schema's integers are bounded to 16 digits unless it bounds them itself
(dispatch/schema_integers.py, as llama.cpp's converter does): an unbounded one let a small
model write digits until max_tokens.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import llguidance
import numpy as np

from eagerlm.dispatch.schema_integers import bound_integers
from eagerlm.errors import InvalidParameters
from eagerlm.kernels.sampling import Constraint, mask_words
from eagerlm.loader.tokenizer import Tokenizer

# JSON output: compact separators with one space, no free whitespace between tokens. With
# llguidance's default (any whitespace allowed) a small model can emit newlines forever
# inside a valid object; this way the only freedom left is in the values.
# (A Lark grammar's embedded `%json {...}` takes them as the schema's "x-guidance" key.)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SPECIAL_MARK = b"\xff"
_KINDS = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar",
          "gbnf": "GBNF grammar"}
_MESSAGE_CHARS = 500  # llguidance's messages may quote the grammar, which may be 128 KiB
T = TypeVar("T")


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may cost, in time and memory: a schema or grammar comes from the
    request, so a hostile one must become a clear error (`InvalidConstraint`, a 400 naming
    the field), not a hang, a crash or gigabytes. Measured on a 2-core machine with the
    Gemma 3 vocabulary (262k tokens); the numbers quoted are what each limit stops.

    Checked by eagerlm before llguidance sees the constraint:

    - `max_text_bytes`: the schema or grammar text. Compile time and memory grow with it
      (about linearly once the shape limits below hold): at 300 KB the worst inputs found
      took 1.4 to 2 s and up to 216 MB; at 128 KiB at most 0.9 s and 100 MB. A real
      schema, even a forced call over dozens of tools, is a few to tens of KB (a
      10,000-value enum of 12-character strings, 160 KB, is over).
    - `max_object_properties`: properties of one object schema. llguidance compiles an
      object in time quadratic in its properties (10,000: 9 s and 114 MB); beyond about 450
      optional ones the grammar fails at its first token anyway (`step_max_items`).
      Counted in `json_schema` constraints and in a Lark grammar's `%json` schemas.
    - `max_gbnf_rules`: llguidance's GBNF-to-Lark conversion (Python, holding the GIL)
      is quadratic in a chain of rules: 1,000 take 0.7 to 0.9 s, 2,000 took 2.5 s, 5,000
      about 20 s (and then crashed llguidance on an 8 MiB stack).

    How the compilation runs:

    - `compile_seconds`: the deadline of one compilation (the checks, llguidance's
      compile and the first mask). Past it the request is refused; the compilation runs on
      to its end on its thread, bounded by the limits here, and its result is dropped. No
      input found takes more than about 1 s under the other limits: this is for what no one
      found.
    - `compile_stack_bytes`: the stack of the compiling thread (virtual: only what is used
      is committed). llguidance recurses 3 to 8 KB per level of a `$ref` chain or a chain
      of Lark rules: 1,000 levels of objects (a 75 KB schema) overflowed an 8 MiB stack
      and killed the process; the deepest chains that fit in `max_text_bytes` need about
      25 MB.

    llguidance's parser limits (`llguidance.LLParserLimits`, defaults in parentheses):

    - `step_max_items` (50,000): Earley items created for one token's mask. An ambiguous
      grammar (`s: s s | "a"`) costs a time quadratic in it per token: with the default a
      step reached 1.7 s by the 300th token (and every constrained request waits for the
      service thread); 10,000 allow 435 ms, 5,000 57 ms, 2,000 6 ms. JSON schemas up to
      450 optional properties, a C grammar with 150 nested parentheses and JSON 150 deep
      stay well under it.
    - `max_items_in_row` (2,000): items in one Earley row, the grammar's branching at one
      position (a choice of 5,000 literals fails at its first token).
    - `step_lexer_fuel` (200,000): the lexer's work for one mask (about 100 ns a unit, at
      most about 20 ms; exponential regexes such as `(x{1,1000}){1,1000}` stop here at
      about 2 ms a step).
    - `initial_lexer_fuel` (1,000,000): the lexer's work at compile time (a 100,000-value
      enum is refused in 0.4 s). An integer bounded to 16 digits
      (dispatch/schema_integers.py) costs about 8 times an unbounded one to compile: one
      object of 400 integer properties compiles in 0.5 to 0.7 s, of 600 required ones in
      0.9 s, and 700 or more are refused here (unbounded, 1,000 required ones compiled).
    - `max_lexer_states` (250,000): lexer states built while generating, 0.7 to 2 KB each:
      50,000 is at most about 40 to 100 MB per request instead of 200 to 500 MB (20,000
      lasted about 1,000 random tokens inside a length-bounded string).
    - `max_grammar_size` (500,000): symbols in the compiled grammar.
    - `verbose_errors` off: the verbose message holds the parser's state and the whole
      grammar, and the message goes back to the client.
    """

    max_text_bytes: int = 128 << 10
    max_object_properties: int = 1_000
    max_gbnf_rules: int = 1_000
    compile_seconds: float = 2.0
    compile_stack_bytes: int = 256 << 20
    step_max_items: int = 2_000
    max_items_in_row: int = 2_000
    step_lexer_fuel: int = 200_000
    initial_lexer_fuel: int = 1_000_000
    max_lexer_states: int = 50_000
    max_grammar_size: int = 500_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            precompute_large_lexemes=True, verbose_errors=False)


def _describe(constraint: Constraint) -> str:
    return f"{_KINDS[constraint.kind]} in '{constraint.field}'"


def _short(message: str) -> str:
    """llguidance's message as a client reads it: without its `<non-verbose/>` marker, cut
    to `_MESSAGE_CHARS` (it may quote the grammar)."""
    text = message.replace("<non-verbose/>", "").strip()
    if len(text) > _MESSAGE_CHARS:
        text = f"{text[:_MESSAGE_CHARS]}... ({len(text)} characters)"
    return text


class InvalidConstraint(InvalidParameters):
    """A schema or grammar refused at submission: llguidance refuses it, or it exceeds
    `GrammarLimits`; `param` names the request field."""

    def __init__(self, constraint: Constraint, message: str) -> None:
        super().__init__(f"invalid {_describe(constraint)}: {_short(message)}",
                         param=constraint.field)


class ConstraintFailed(InvalidParameters):
    """A compiled constraint that failed while generating: a token's mask or step needed
    more than the parser limits allow (`GrammarLimits`). It ends its request alone, as the
    request's mistake (a 400 naming the field), with what was generated so far."""

    def __init__(self, constraint: Constraint, tokens: int, message: str) -> None:
        super().__init__(f"the {_describe(constraint)} failed after {tokens} generated "
                         f"tokens: {_short(message)}",
                         param=constraint.field)
        self.reason = message  # llguidance's


class _VocabularyView:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer: each token's bytes,
    the special ids, BOS / EOS, and an encoder (used only for its own conveniences, such as
    tokenizing forced text; masks come from the bytes)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(
            tokenizer.end_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        n = min(vocab, tokenizer.vocab_size)
        # As llama.cpp's binding: a token is its text as rendered without special tokens;
        # only one that renders as nothing that way (control, unknown) is marked special.
        # User-defined tokens are text (Gemma 3's "\n" and "\n\n" are user-defined: marked
        # special, a grammar that forces a newline allowed them and then refused them).
        self.special_token_ids: list[int] = []
        self.tokens: list[bytes] = []
        for i in range(n):
            text = tokenizer.piece(i, special=False)
            if not text and (shown := tokenizer.piece(i)):
                self.special_token_ids.append(i)
                text = _SPECIAL_MARK + shown
            self.tokens.append(text)
        self.tokens += [b""] * (vocab - n)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class GrammarCompiler:
    """Compiles constraints for one model: its tokenizer and the width of its logits,
    within `limits`."""

    def __init__(self, tokenizer: Tokenizer, vocab: int,
                 limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.limits = limits or GrammarLimits()
        self._parser_limits = self.limits.parser_limits()
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer, built on first use (thread-safe)."""
        with self._lock:
            if self._ll is None:
                view = _VocabularyView(self.tokenizer, self.vocab)
                self._ll = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(view), n_vocab=self.vocab,
                    eos_token=sorted(self.tokenizer.end_ids) or [view.eos_token_id])
            return self._ll

    def grammar(self, constraint: Constraint) -> str:
        """llguidance's grammar text for a constraint; InvalidConstraint when the text
        is beyond the size and shape limits or does not even parse as its kind (a schema
        that is not JSON, a GBNF that does not convert)."""
        self._check_shape(constraint)
        try:
            if constraint.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    _integers_bounded(constraint.text), defaults=JSON_OPTIONS)
            return llguidance.grammar_from(constraint.kind, constraint.text)
        except ValueError as exc:
            raise InvalidConstraint(constraint, str(exc)) from None

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for one request, its first mask computed; InvalidConstraint for
        a schema or grammar llguidance refuses, with its message, or one beyond the
        limits. Compiles on a thread of its own (`GrammarLimits`: its stack, its
        deadline); the caller waits."""
        ll = self.ll_tokenizer()  # once per compiler, outside the deadline

        def compile_() -> GrammarMatcher:
            matcher = llguidance.LLMatcher(ll, self.grammar(constraint), log_level=0,
                                           limits=self._parser_limits)
            if matcher.is_error():
                raise InvalidConstraint(constraint, matcher.get_error())
            compiled = GrammarMatcher(matcher, self.vocab, constraint)
            try:
                compiled.mask()  # kept for the first sample: a grammar that fails here
            except ConstraintFailed as exc:  # (one that allows nothing) is refused now
                raise InvalidConstraint(constraint, f"its first token fails: {exc.reason}"
                                        ) from None
            return compiled

        return self._on_compile_thread(constraint, compile_)

    def matchers(self, constraints: Sequence[Constraint | None]
                 ) -> list[GrammarMatcher | None]:
        """A matcher for each constraint (None for none): one compilation per distinct
        constraint, copies for the rest (a request's `n` choices)."""
        compiled: dict[Constraint, GrammarMatcher] = {}
        out: list[GrammarMatcher | None] = []
        for constraint in constraints:
            if constraint is None:
                out.append(None)
            elif constraint in compiled:
                out.append(compiled[constraint].copy())
            else:
                compiled[constraint] = self.matcher(constraint)
                out.append(compiled[constraint])
        return out

    def _check_shape(self, constraint: Constraint) -> None:
        """The limits eagerlm checks itself, before llguidance sees the text."""
        limits = self.limits
        size = len(constraint.text.encode("utf-8", "surrogatepass"))
        if size > limits.max_text_bytes:
            raise InvalidConstraint(constraint, f"it is {size} bytes long; the limit is "
                                                f"{limits.max_text_bytes}")
        if constraint.kind == "gbnf":
            rules = len(_GBNF_RULE.findall(constraint.text))
            if rules > limits.max_gbnf_rules:
                raise InvalidConstraint(constraint, f"it has {rules} rules; the limit is "
                                                    f"{limits.max_gbnf_rules}")
        for schema in _schemas_in(constraint):
            widest = _widest_object(schema)
            if widest > limits.max_object_properties:
                raise InvalidConstraint(
                    constraint, f"an object schema has {widest} properties; the limit "
                                f"is {limits.max_object_properties}")

    def _on_compile_thread(self, constraint: Constraint, work: Callable[[], T]) -> T:
        """`work()` on a new thread with `compile_stack_bytes` of stack, waited for at most
        `compile_seconds`; its exception re-raised here."""
        outcome: list[tuple[bool, object]] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, work()))
            except BaseException as exc:  # handed to the waiting caller
                outcome.append((False, exc))
            finally:
                done.set()

        with _STACK_SIZE_LOCK:  # the stack size is process-wide: set it for this thread only
            previous = threading.stack_size(self.limits.compile_stack_bytes)
            try:
                threading.Thread(target=run, name="eagerlm-grammar-compile",
                                 daemon=True).start()
            finally:
                threading.stack_size(previous)
        if not done.wait(self.limits.compile_seconds):
            raise InvalidConstraint(
                constraint, f"it takes longer than {self.limits.compile_seconds:g} s to "
                            f"compile; simplify it")
        ok, value = outcome[0]
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]


_STACK_SIZE_LOCK = threading.Lock()
# llguidance's messages when a step goes beyond one of its parser limits (its parser.rs
# and regexvec.rs): step_max_items, max_items_in_row, step_lexer_fuel, max_lexer_states
_OVER_LIMITS = re.compile(r"Too many items \(limit|Current row has \d+ items; max is|"
                          r"too many expressions constructed|too many states")
# a GBNF rule starts a line: `name ::=` (what llguidance's converter parses as one)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)
_LARK_JSON = re.compile(r"%json\s*")


def _integers_bounded(text: str) -> str:
    """A schema's text with its integers bounded (dispatch/schema_integers.py); text that
    does not parse is left to llguidance, whose message is better."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return json.dumps(bound_integers(schema))


def _schemas_in(constraint: Constraint) -> list[object]:
    """The JSON schemas a constraint holds: a schema constraint's own, a Lark grammar's
    `%json {...}` ones (a GBNF text may be Lark too). Text that does not parse is left to
    llguidance, whose message is better."""
    text = constraint.text
    if constraint.kind == "json_schema":
        try:
            return [json.loads(text)]
        except (ValueError, RecursionError):
            return []
    if constraint.kind not in ("lark", "gbnf"):
        return []
    decoder, schemas = json.JSONDecoder(), []
    for found in _LARK_JSON.finditer(text):
        with contextlib.suppress(ValueError, RecursionError):
            schemas.append(decoder.raw_decode(text, found.end())[0])
    return schemas


def _widest_object(schema: object) -> int:
    """The most properties any object schema in `schema` lists (walked without recursion:
    the schema's depth is the user's)."""
    widest, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                widest = max(widest, len(properties))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return widest


class GrammarMatcher:
    """One request's position in its grammar: the mask of the tokens that may come next,
    advanced one sampled token at a time. Not thread-safe: its owner (the service thread)
    is the only one to touch it. A step beyond the parser limits puts llguidance's matcher
    in its error state for good: `mask` then raises `ConstraintFailed`, `accept` returns
    False (`over_limits`, `failure()`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int,
                 constraint: Constraint) -> None:
        self._matcher = matcher
        self.vocab = vocab
        self.constraint = constraint
        self.tokens = 0  # accepted so far
        self._next: np.ndarray | None = None  # the mask computed for the next token

    def mask(self) -> np.ndarray:
        """The allowed-token bitmask for the next token, int32 [mask_words(vocab)] (the
        first one was computed when the constraint was compiled)."""
        if self._next is None:
            out = np.zeros(mask_words(self.vocab), np.int32)
            self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            if self._matcher.is_error():
                raise self.failure()
            self._next = out
        return self._next

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not take it (the matcher
        is then in its error state). The mask allowed the token, so that is either a step
        beyond the parser limits (`over_limits`: the constraint's doing, `failure()`) or a
        bug."""
        self._next = None
        self.tokens += 1
        return bool(self._matcher.consume_token(token))

    @property
    def over_limits(self) -> bool:
        """The matcher failed on one of the parser limits (llguidance's message says so)."""
        return _OVER_LIMITS.search(self.error) is not None

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same position (llguidance's deep copy)."""
        twin = GrammarMatcher(self._matcher.deep_copy(), self.vocab, self.constraint)
        twin.tokens = self.tokens
        twin._next = None if self._next is None else self._next.copy()
        return twin

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but an end token): the request
        stops here, with finish reason `stop`."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's message once the matcher failed, else empty."""
        return self._matcher.get_error()

    def failure(self) -> ConstraintFailed:
        """The error that ends the request once the matcher failed."""
        return ConstraintFailed(self.constraint, self.tokens,
                                self.error or "the matcher failed")


__all__ = ["JSON_OPTIONS", "ConstraintFailed", "GrammarCompiler", "GrammarLimits",
           "GrammarMatcher", "InvalidConstraint"]
