"""The tokenizer a GGUF file describes, giving exactly the ids llama.cpp gives.

Exactness is the point: prompts must become the same ids as in the reference engine so
logits can be compared token for token, and a prefix cache keyed on ids only hits when
equal texts give equal ids. So this module follows llama.cpp's `src/llama-vocab.cpp`
(llama-cpp-python 0.3.36) step by step, quirks included, rather than the Hugging Face
tokenizers the vocabularies came from:

- special tokens (CONTROL, USER_DEFINED, UNKNOWN) are cut out of the text first, longest
  first, each over the whole text before the next (`tokenizer_st_partition`);
- model `llama` (SentencePiece-style, `llm_tokenizer_spm`): spaces become U+2581, the
  best-scoring adjacent pair whose concatenation is a token merges first (ties to the
  left), symbols that are not tokens fall back to `<0xNN>` byte tokens;
- model `gpt2` (byte-level BPE, `llm_tokenizer_bpe`): the pre-tokenizer named by
  `tokenizer.ggml.pre` splits the text into words, each word's UTF-8 bytes are spelled
  with GPT-2's byte-to-unicode alphabet (both in loader/pretokenizers.py), and merges
  apply lowest rank first;
- the end-of-generation set and the attribute fix-ups are derived from token texts the
  way llama.cpp derives them, since GGUF files do not say (loader/special_tokens.py).

This module holds the encoding and decoding algorithms; the tables they run on are
llama.cpp's and live beside it: loader/pretokenizers.py (word splitting and the byte
alphabet) and loader/special_tokens.py (token attributes and special-token rules).
Streaming text out token by token is loader/detokenizer.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import regex

from eagerlm.errors import InvalidParameters
from eagerlm.loader.errors import MissingKey, ModelFileError, quoted
from eagerlm.loader.pretokenizers import BYTE_TO_CHAR, CHAR_TO_BYTE, PRE_TOKENIZERS
from eagerlm.loader.special_tokens import (
    BYTE,
    DEFAULT_IDS,
    HIDDEN,
    ID_KEYS,
    NORMAL,
    SPECIAL,
    TYPE_TO_ATTR,
    TokenAttr,
    settle_special_tokens,
)

SPACE_MARK = "\u2581"  # SentencePiece's visible space, "▁"
_C_SPACES = " \t\n\v\f\r"  # what C's isspace() accepts in the "C" locale
_WORD_CACHE_LIMIT = 1 << 16
MODELS = ("llama", "gpt2")


def _key(name: str) -> str:
    return f"tokenizer.ggml.{name}"


def _c_hex_prefix(text: str) -> int:
    """`strtol(text, NULL, 16)` on at most two characters, as llama.cpp reads <0xNN>."""
    value = 0
    for ch in text[:2]:
        digit = int(ch, 16) if ch in "0123456789abcdefABCDEF" else -1
        if digit < 0:
            break
        value = value * 16 + digit
    return value


class Tokenizer:
    """A GGUF vocabulary with llama.cpp's encode and token-to-piece behaviour.

    Build it with `from_metadata`. Public attributes: `model` ("llama" or "gpt2"), `pre`,
    `vocab_size`, `bos_id`, `eos_id`, `eot_id`, `eom_id`, `unk_id`, `pad_id` (None when
    the vocabulary has none), `add_bos`, `add_eos`, `add_space_prefix`, `clean_spaces`,
    and `end_ids`, llama.cpp's end-of-generation set (EOS, EOT, EOM and every token whose
    text marks an end: <end_of_turn>, <|im_end|>, <|eot_id|>, <|endoftext|>, </s>, ...).
    """

    def __init__(self, *, model: str, tokens: Sequence[str], scores: Sequence[float],
                 attrs: Sequence[int], merges: Sequence[str], pre: str,
                 ids: Mapping[str, int | None], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, model_name: str = "",
                 architecture: str = "") -> None:
        self.model = model
        self.pre = pre
        self._spm = model == "llama"
        self._pre_tokenizer = None if self._spm else PRE_TOKENIZERS[pre]
        self._tokens = list(tokens)
        self._scores = list(scores)
        self._attrs = list(attrs)
        self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        if len(self._token_to_id) != len(self._tokens):
            raise ModelFileError("the token list holds the same text twice",
                                 field=_key("tokens"))
        # First occurrence wins, like std::unordered_map::emplace in llama.cpp.
        self._ranks = {m: i for i, m in reversed(list(enumerate(merges)))}
        self.bos_id = ids.get("bos")
        self.eos_id = ids.get("eos")
        self.unk_id = ids.get("unk")
        self.pad_id = ids.get("pad")
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = False if self._spm else self._pre_tokenizer.clean_spaces
        special = settle_special_tokens(self._tokens, self._token_to_id, self._attrs, ids,
                                        pre, model_name, architecture)
        self.eot_id, self.eom_id = special.ids.get("eot"), special.ids.get("eom")
        self.fim_pre_id, self.fim_suf_id, self.fim_mid_id = (
            special.ids.get("fim_pre"), special.ids.get("fim_suf"), special.ids.get("fim_mid"))
        self.end_ids = special.end_ids
        self._specials_parsed, self._specials_plain = special.parsed, special.plain
        self._byte_ids = [self._byte_token(b) for b in range(256)] if self._spm else []
        self._pieces: list[bytes | None] = [None] * len(self._tokens)
        self._word_cache: dict[str, list[int]] = {}

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer of a GGUF file's metadata (`tokenizer.ggml.*` keys)."""
        model = md.get(_key("model"))
        if model is None:
            raise MissingKey("the model file has no tokenizer (tokenizer.ggml.model)",
                             field=_key("model"))
        if model not in MODELS:
            raise ModelFileError(
                f"tokenizer model {quoted(model)} is not supported: eagerlm implements 'llama' "
                "(SentencePiece-style) and 'gpt2' (byte-level BPE)", field=_key("model"))
        tokens = md.get(_key("tokens"))
        if tokens is None:
            raise MissingKey("the tokenizer has no token list", field=_key("tokens"))
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        if n == 0:
            raise ModelFileError("the tokenizer's token list is empty", field=_key("tokens"))
        pre = str(md.get(_key("pre"), ""))
        merges: Sequence[str] = ()
        if model == "gpt2":
            if pre not in PRE_TOKENIZERS:
                known = ", ".join(sorted(p for p in PRE_TOKENIZERS if p))
                raise ModelFileError(
                    f"pre-tokenizer {quoted(pre)} is not supported (supported: {known})",
                    field=_key("pre"))
            merges = md.get(_key("merges"))
            if merges is None:
                raise MissingKey("a gpt2 (BPE) tokenizer needs its merges",
                                 field=_key("merges"))
        scores = cls._per_token(md, "scores", n, 0.0)
        types = cls._per_token(md, "token_type", n, 1).astype(np.int64)
        in_range = (types >= 0) & (types < len(TYPE_TO_ATTR))
        attrs = np.where(in_range, TYPE_TO_ATTR[np.clip(types, 0, len(TYPE_TO_ATTR) - 1)],
                         int(TokenAttr.UNDEFINED))
        pre_tok = PRE_TOKENIZERS.get(pre) if model == "gpt2" else None

        ids: dict[str, int | None] = dict(DEFAULT_IDS[model])
        if pre_tok is not None and not pre_tok.default_bos:
            ids["bos"] = None
        for name in list(ids):
            if ids[name] is not None and ids[name] >= n:
                ids[name] = None
        for name, key in ID_KEYS:
            value = md.get(_key(key))
            if value is not None and 0 <= int(value) < n:
                ids[name] = int(value)

        if model == "llama":
            add_bos, add_eos, add_space_prefix = True, False, True
        else:
            add_bos, add_eos, add_space_prefix = pre_tok.add_bos, False, False
        add_space_prefix = bool(md.get(_key("add_space_prefix"), add_space_prefix))
        add_bos = bool(md.get(_key("add_bos_token"), add_bos))
        add_eos = bool(md.get(_key("add_eos_token"), add_eos))
        return cls(model=model, tokens=tokens, scores=scores.tolist(), attrs=attrs.tolist(),
                   merges=list(merges), pre=pre, ids=ids, add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=add_space_prefix,
                   model_name=str(md.get("general.name", "")),
                   architecture=str(md.get("general.architecture", "")))

    @staticmethod
    def _per_token(md: Mapping[str, Any], name: str, n: int, default: float) -> np.ndarray:
        value = md.get(_key(name))
        if value is None:
            return np.full(n, default)
        arr = np.asarray(value)
        if arr.ndim != 1 or len(arr) < n:
            raise ModelFileError(f"{name} has {arr.size} entries for {n} tokens",
                                 field=_key(name))
        return arr[:n]

    def _byte_token(self, b: int) -> int | None:
        """The token of one raw byte (SPM byte fallback): <0xNN>, else the byte itself."""
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None:
            tid = self._token_to_id.get(bytes([b]).decode("utf-8", "surrogateescape"))
        return tid

    # -- vocabulary -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (▁ and byte-level spelling kept)."""
        return self._tokens[token_id]

    def token_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    def token_attr(self, token_id: int) -> TokenAttr:
        return TokenAttr(self._attrs[token_id])

    def is_special(self, token_id: int) -> bool:
        """Whether the token is cut out of text before tokenizing (control, user-defined
        or unknown), as llama.cpp's special-token cache has it."""
        return bool(self._attrs[token_id] & SPECIAL)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, "
                f"vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})")

    # -- encoding ---------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True,
               parse_special: bool = True) -> list[int]:
        """The ids llama.cpp's `llama_tokenize(text, add_special, parse_special)` gives.

        `add_special` adds BOS/EOS as the vocabulary asks (add_bos_token /
        add_eos_token); `parse_special` lets control tokens written in the text become
        those tokens (user-defined tokens always do).
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._required(self.bos_id, "BOS"))
        prev_special = True  # SPM: a space prefix goes before text that starts a segment
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self._spm:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_tokenize(frag.replace(" ", SPACE_MARK), out)
                prev_special = False
            else:
                self._bpe_tokenize(frag, out)
        if add_special and self.add_eos:
            out.append(self._required(self.eos_id, "EOS"))
        return out

    @property
    def has_infill(self) -> bool:
        """Whether the vocabulary has the fill-in-the-middle tokens `encode_infill` needs."""
        return None not in (self.fim_pre_id, self.fim_suf_id, self.fim_mid_id)

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt, as llama.cpp's server builds one (format_infill,
        prefix-suffix-middle order, no repository context): [BOS] FIM_PRE prefix FIM_SUF
        suffix FIM_MID, the texts encoded without special tokens and without parsing
        control-token texts in them (code may well contain "<|fim_suffix|>"). The model
        then writes the middle. InvalidParameters for a vocabulary without them."""
        if not self.has_infill:
            raise InvalidParameters(
                "this model's vocabulary has no fill-in-the-middle tokens (FIM prefix, "
                "suffix and middle), so it cannot complete between a prefix and a suffix",
                param="suffix")
        out = [self._required(self.bos_id, "BOS")] if self.add_bos else []
        out += [self.fim_pre_id, *self.encode(prefix, False, False),  # type: ignore[list-item]
                self.fim_suf_id, *self.encode(suffix, False, False), self.fim_mid_id]
        return out

    @staticmethod
    def _required(token_id: int | None, what: str) -> int:
        if token_id is None:
            raise ModelFileError(f"the tokenizer must add {what} but has no {what} token")
        return token_id

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of the text: for each special token, longest first, every
        occurrence in every remaining text fragment (llama.cpp's tokenizer_st_partition)."""
        if not text:
            return []
        fragments: list[str | int] = [text]
        for tid, special, lstrip, rstrip in (
                self._specials_parsed if parse_special else self._specials_plain):
            if special not in text:
                continue
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                pos, end = 0, len(frag)
                while (match := frag.find(special, pos)) >= 0:
                    left_end = match
                    if lstrip:
                        while left_end > pos and frag[left_end - 1] in _C_SPACES:
                            left_end -= 1
                    if left_end > pos:
                        out.append(frag[pos:left_end])
                    out.append(tid)
                    pos = match + len(special)
                    if rstrip:
                        while pos < end and frag[pos] in _C_SPACES:
                            pos += 1
                if pos < end:
                    out.append(frag[pos:])
            fragments = out
        return fragments

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm: characters merge pairwise, best score first (ties to the
        left), as long as the merged text is a token; leftovers become byte tokens.

        A symbol always starts at its own character index (merges only absorb the right
        neighbour), so `length[i]` is all that changes.
        """
        t2i, scores = self._token_to_id, self._scores
        n = len(text)
        if n == 0:
            return
        length = [1] * n
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            tid = t2i.get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            n_left, n_right = length[left], length[right]
            if not n_left or not n_right or n_left + n_right != size:
                continue  # one side changed since this pair was queued
            length[left], length[right] = size, 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                both = length[before] + size
                tid = t2i.get(text[before:before + both])
                if tid is not None:
                    push(heap, (-scores[tid], before, left, both))
            if after >= 0:
                both = size + length[after]
                tid = t2i.get(text[left:left + both])
                if tid is not None:
                    push(heap, (-scores[tid], left, after, both))
        i = 0
        while i >= 0:
            piece = text[i:i + length[i]]
            tid = t2i.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.encode("utf-8", "surrogatepass"):
                    byte_id = self._byte_ids[b]
                    if byte_id is None:
                        raise ModelFileError(f"the vocabulary has no token for byte 0x{b:02X}")
                    out.append(byte_id)
            i = nxt[i]

    def _bpe_tokenize(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        for word in self._pre_tokenizer.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> list[int]:
        """llm_tokenizer_bpe on one pre-tokenized word."""
        t2i = self._token_to_id
        spelled = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(
            BYTE_TO_CHAR)
        if self._pre_tokenizer.ignore_merges and spelled in t2i:
            return [t2i[spelled]]
        ids = []
        for symbol in self._bpe_merge(spelled):
            tid = t2i.get(symbol)
            if tid is not None:
                ids.append(tid)
                continue
            # llama.cpp looks each UTF-8 byte of the symbol up as a one-byte token and
            # drops the bytes that are not tokens.
            for b in symbol.encode("utf-8"):
                tid = t2i.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if tid is not None:
                    ids.append(tid)
        return ids

    def _bpe_merge(self, word: str) -> list[str]:
        """Apply merges lowest rank first (ties to the left) until none applies."""
        syms = list(word)
        n = len(syms)
        if n < 2:
            return syms
        ranks = self._ranks
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            rank = ranks.get(f"{syms[i]} {syms[i + 1]}")
            if rank is not None:
                heap.append((rank, i, i + 1, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, merged = pop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or a + b != merged:
                continue  # outdated pair
            syms[left], syms[right] = merged, ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0 and (rank := ranks.get(f"{syms[before]} {merged}")) is not None:
                push(heap, (rank, before, left, syms[before] + merged))
            if after >= 0 and (rank := ranks.get(f"{merged} {syms[after]}")) is not None:
                push(heap, (rank, left, after, merged + syms[after]))
        return [s for s in syms if s]

    # -- decoding ---------------------------------------------------------------------

    def piece(self, token_id: int, special: bool = True) -> bytes:
        """The token's bytes as llama.cpp's token_to_piece renders them: ▁ becomes a space
        (SPM), byte-level spelling is undone (BPE), byte tokens give their byte, control
        and unknown tokens give their text only when `special`."""
        if not special and self._attrs[token_id] & HIDDEN:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id)
        return piece

    def _render(self, token_id: int) -> bytes:
        attr, text = self._attrs[token_id], self._tokens[token_id]
        if attr & SPECIAL:
            return text.encode("utf-8", "surrogateescape")
        if attr & NORMAL:
            if self._spm:
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return self._unspell(text)
        if attr & BYTE:
            return bytes([_c_hex_prefix(text[3:5]) & 0xFF])
        return b""  # unused / undefined tokens render as nothing

    @staticmethod
    def _unspell(text: str) -> bytes:
        """Undo GPT-2's byte spelling (llama_decode_text), with llama.cpp's marker for a
        character outside the byte alphabet."""
        out = bytearray()
        raw = text.encode("utf-8", "surrogateescape")
        for ch in text:
            b = CHAR_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
                continue
            cpt = "\ufffd" if "\udc80" <= ch <= "\udcff" else ch
            out += b"[UNK_BYTE_0x" + cpt.encode("utf-8", "surrogatepass").hex().encode()
            out += raw + b"]"
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False, *,
               clean_up_spaces: bool = False) -> str:
        """The text of `ids`: llama.cpp's llama_detokenize(ids, remove_special=skip_special,
        unparse_special=not skip_special) without its clean-up pass, i.e. the pieces
        llama.cpp's server streams, joined. Invalid UTF-8 becomes U+FFFD.

        The first piece loses one leading space when the vocabulary adds a space prefix.
        `clean_up_spaces=True` also applies the clean-up pass when the vocabulary asks for
        it (`clean_spaces`), giving llama_detokenize's text exactly; streaming leaves it
        out because it rewrites text ("a ." -> "a.") across token boundaries.
        """
        ids = list(ids)
        strip = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, strip = ids[1:], False
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self.piece(i, not skip_special) for i in ids]
        if strip and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        data = b"".join(pieces)
        if clean_up_spaces and self.clean_spaces:
            data = _clean_up_spaces(data)
        return data.decode("utf-8", "replace")


def _clean_up_spaces(data: bytes) -> bytes:
    """llama_detokenize's three clean-up passes (clean_up_tokenization_spaces)."""
    data = regex.sub(rb" (?=[?!.,])", b"", data)
    data = data.replace(b" ' ", b"'")
    return regex.sub(rb" '(?=[sm]|re|ve)", b"'", data)
