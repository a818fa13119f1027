"""Turning a stream of token ids into text as the ids arrive.

`IncrementalDetokenizer` is what streams a request's text: it renders each token with
`Tokenizer.piece` and holds back bytes of a character that is not complete yet, so that
the joined outputs equal `Tokenizer.decode` of all the ids. It lives apart from the
tokenizer because it is per-request state over a shared, read-only `Tokenizer`.
"""

from __future__ import annotations

import codecs

from eagerlm.loader.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of ids into text as it arrives.

    All outputs joined equal `tokenizer.decode(all ids, skip_special)`; a piece that ends
    inside a UTF-8 character is held back until the character completes, so no output
    holds half a character (U+FFFD appears only for bytes that can never be valid). Work
    per token is constant: only the incomplete tail of the last character is buffered.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True
        self._strip = tokenizer.add_space_prefix
        self._held: int | None = None  # a possibly-final EOS that decode would drop

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is now complete."""
        tok, out = self._tok, ""
        if self._held is not None:
            out = self._emit(self._held)
            self._held = None
        if self._first:
            self._first = False
            if self._skip and tok.add_bos and token_id == tok.bos_id:
                self._strip = False
                return out
        if self._skip and tok.add_eos and token_id == tok.eos_id:
            self._held = token_id
            return out
        return out + self._emit(token_id)

    def _emit(self, token_id: int) -> str:
        piece = self._tok.piece(token_id, not self._skip)
        if self._strip:
            self._strip = False
            if piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """End of stream: the rest, with any incomplete character as U+FFFD."""
        self._held = None
        return self._utf8.decode(b"", final=True)
