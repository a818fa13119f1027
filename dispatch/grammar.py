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
"""

from __future__ import annotations

import threading

import llguidance
import numpy as np

from eagerlm.errors import InvalidParameters
from eagerlm.kernels.sampling import Constraint, mask_words
from eagerlm.loader.tokenizer import Tokenizer

# JSON output: compact separators with one space, no free whitespace between tokens. With
# llguidance's default (any whitespace allowed) a small model can emit newlines forever
# inside a valid object; this way the only freedom left is in the values.
# (A Lark grammar's embedded `%json {...}` takes them as the schema's "x-guidance" key.)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SPECIAL_MARK = b"\xff"


class InvalidConstraint(InvalidParameters):
    """A schema or grammar llguidance refuses; `param` names the request field."""

    def __init__(self, constraint: Constraint, message: str) -> None:
        what = {"json_schema": "JSON schema", "regex": "regular expression",
                "lark": "Lark grammar", "gbnf": "GBNF grammar"}[constraint.kind]
        super().__init__(f"invalid {what} in '{constraint.field}': {message.strip()}",
                         param=constraint.field)


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
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [_SPECIAL_MARK + tokenizer.piece(i) if i in special
                       else tokenizer.piece(i) for i in range(n)]
        self.tokens += [b""] * (vocab - n)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class GrammarCompiler:
    """Compiles constraints for one model: its tokenizer and the width of its logits."""

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
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
        does not even parse as its kind (a schema that is not JSON, a GBNF that does not
        convert)."""
        try:
            if constraint.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.text, defaults=JSON_OPTIONS)
            return llguidance.grammar_from(constraint.kind, constraint.text)
        except ValueError as exc:
            raise InvalidConstraint(constraint, str(exc)) from None

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for one request; InvalidConstraint for a schema or grammar
        llguidance refuses, with its message."""
        grammar = self.grammar(constraint)
        ll = self.ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if error and not error.startswith("WARNING"):
            raise InvalidConstraint(constraint, error)
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidConstraint(constraint, matcher.get_error())
        return GrammarMatcher(matcher, self.vocab)


class GrammarMatcher:
    """One request's position in its grammar: the mask of the tokens that may come next,
    advanced one sampled token at a time. Not thread-safe: its owner (the service thread)
    is the only one to touch it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self.vocab = vocab

    def mask(self) -> np.ndarray:
        """The allowed-token bitmask for the next token, int32 [mask_words(vocab)]."""
        out = np.zeros(mask_words(self.vocab), np.int32)
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the
        matcher is then in its error state, `error`)."""
        return bool(self._matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but an end token): the request
        stops here, with finish reason `stop`."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


__all__ = ["JSON_OPTIONS", "GrammarCompiler", "GrammarMatcher", "InvalidConstraint"]
