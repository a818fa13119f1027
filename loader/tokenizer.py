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
  with GPT-2's byte-to-unicode alphabet, and merges apply lowest rank first;
- the end-of-generation set and the attribute fix-ups are derived from token texts the
  way llama.cpp derives them, since GGUF files do not say.

Where llama.cpp's behaviour depends on hash-map iteration order (which of several
candidate texts becomes `eot_id`) the smallest id is taken; the end-of-generation set
does not depend on it. Character classes (\\p{L}, \\p{N}, \\s...) come from the `regex`
package, whose Unicode tables may be newer than llama.cpp's: code points assigned in
between can split differently.
"""

from __future__ import annotations

import codecs
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Any

import numpy as np
import regex

from eagerlm.errors import InvalidParameters
from eagerlm.loader.errors import MissingKey, ModelFileError, quoted

SPACE_MARK = "\u2581"  # SentencePiece's visible space, "▁"
_C_SPACES = " \t\n\v\f\r"  # what C's isspace() accepts in the "C" locale
_WORD_CACHE_LIMIT = 1 << 16


class TokenAttr(IntFlag):
    """llama.cpp's `llama_token_attr` bits (a token can carry several)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# GGUF `tokenizer.ggml.token_type` value (gguf.TokenType; 0 = undefined) -> attribute.
_TYPE_TO_ATTR = np.array([TokenAttr.UNDEFINED, TokenAttr.NORMAL, TokenAttr.UNKNOWN,
                          TokenAttr.CONTROL, TokenAttr.USER_DEFINED, TokenAttr.UNUSED,
                          TokenAttr.BYTE], dtype=np.int64)
# Plain ints for the hot paths (IntFlag arithmetic is slow).
_SPECIAL = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
_HIDDEN = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)  # not rendered unless asked for
_CONTROL, _NORMAL, _BYTE = int(TokenAttr.CONTROL), int(TokenAttr.NORMAL), int(TokenAttr.BYTE)
_LSTRIP, _RSTRIP = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
_UNUSED = int(TokenAttr.UNUSED)


def _gpt2_byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for every byte: printable Latin-1 bytes stand for
    themselves, the rest map to U+0100 upwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return chars


BYTE_ALPHABET: tuple[str, ...] = tuple(_gpt2_byte_alphabet())
_BYTE_TO_CHAR = {b: c for b, c in enumerate(BYTE_ALPHABET)}  # for str.translate
_CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_ALPHABET)}

# --- pre-tokenizers ----------------------------------------------------------------------

# llama.cpp runs hand-written scanners for these three expressions; they match what the
# expressions match, so the `regex` package runs the expressions themselves. The GPT-2
# one gets llama.cpp's fallback `\s+` for a single space before a non-space.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's default list runs through std::regex on a "collapsed" text in which every
# non-ASCII code point stands for its category; these are the same sets, uncollapsed.
_DEFAULT = (r"[\p{P}$+<=>^~|]+", _GPT2, r"\p{N}+", r"[0-9]{3}")
_DIGIT_THEN_GPT2 = (r"\p{N}", _GPT2)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text into words for one family of `tokenizer.ggml.pre` values.

    Each stage splits every chunk the previous stage produced: matches and the text
    between them both become chunks, as in llama.cpp's `unicode_regex_split`.
    `ignore_merges` takes a word that is itself a token as that token (Llama 3);
    `clean_spaces` is the vocabulary's `clean_up_tokenization_spaces`, which llama.cpp
    applies only in `llama_detokenize`.
    """

    stages: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    default_bos: bool = True  # whether the model's default BOS id (11) stands
    _compiled: tuple[regex.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(regex.compile(s) for s in self.stages))

    def split(self, text: str) -> list[str]:
        chunks = [text]
        for pattern in self._compiled:
            out: list[str] = []
            for chunk in chunks:
                pos = 0
                for m in pattern.finditer(chunk):
                    start, end = m.span()
                    if start > pos:
                        out.append(chunk[pos:start])
                    out.append(chunk[start:end])
                    pos = end
                if pos < len(chunk):
                    out.append(chunk[pos:])
            chunks = out
        return chunks


def _family(pre: PreTokenizer, *names: str) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names, pre)


# `tokenizer.ggml.pre` values whose llama.cpp pre-tokenizer is one of the above, with the
# flags llama.cpp's vocabulary loader sets for each.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_family(PreTokenizer(_DEFAULT), "default", ""),
    **_family(PreTokenizer((_GPT2,)), "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat",
              "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "jina-v1-en",
              "jina-v2-code", "roberta-bpe", "mpt", "olmo", "exaone4"),
    **_family(PreTokenizer((_GPT2,), clean_spaces=False), "trillion", "granite-docling"),
    **_family(PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True), "llama3",
              "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
              "jina-v5-nano"),
    **_family(PreTokenizer((_LLAMA3,)), "dbrx", "smaug-bpe"),
    **_family(PreTokenizer((_LLAMA3,), default_bos=False), "chatglm-bpe"),
    **_family(PreTokenizer((_LLAMA3,), ignore_merges=True, default_bos=False), "glm4", "glm5"),
    **_family(PreTokenizer((_QWEN2,), clean_spaces=False), "qwen2", "deepseek-r1-qwen",
              "kormo", "f2llmv2", "hunyuan", "solar-open"),
    **_family(PreTokenizer((_QWEN2,)), "megrez", "stablelm2"),
    **_family(PreTokenizer(_DIGIT_THEN_GPT2), "starcoder", "refact", "codeshell", "exaone",
              "minerva-7b", "mellum2"),
    **_family(PreTokenizer(_DIGIT_THEN_GPT2, clean_spaces=False), "command-r", "smollm"),
}

# --- special-token texts llama.cpp recognises (llama_vocab::impl::load) --------------------

_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

# Metadata keys for special ids, in llama.cpp's reading order (later keys win).
_ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
            ("eom", "eom_token_id"), ("unk", "unknown_token_id"),
            ("sep", "seperator_token_id"), ("pad", "padding_token_id"),
            ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
            ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
            ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
            ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
            ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}
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
        self.eot_id = ids.get("eot")
        self.eom_id = ids.get("eom")
        self.unk_id = ids.get("unk")
        self.pad_id = ids.get("pad")
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = False if self._spm else self._pre_tokenizer.clean_spaces
        self.end_ids = self._settle_special_tokens(dict(ids), model_name, architecture)
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
        in_range = (types >= 0) & (types < len(_TYPE_TO_ATTR))
        attrs = np.where(in_range, _TYPE_TO_ATTR[np.clip(types, 0, len(_TYPE_TO_ATTR) - 1)],
                         int(TokenAttr.UNDEFINED))
        pre_tok = PRE_TOKENIZERS.get(pre) if model == "gpt2" else None

        ids: dict[str, int | None] = dict(_DEFAULT_IDS[model])
        if pre_tok is not None and not pre_tok.default_bos:
            ids["bos"] = None
        for name in list(ids):
            if ids[name] is not None and ids[name] >= n:
                ids[name] = None
        for name, key in _ID_KEYS:
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

    def _settle_special_tokens(self, ids: dict[str, int | None], model_name: str,
                         architecture: str) -> frozenset[int]:
        """Fix attributes and find the end-of-generation set as llama.cpp's loader does:
        from ids in the metadata and from well-known token texts, since GGUF files do not
        mark end tokens."""
        attrs, t2i = self._attrs, self._token_to_id

        def found(texts: Iterable[str]) -> list[int]:
            return [t2i[t] for t in texts if t in t2i]

        def make_control(tid: int) -> None:
            attrs[tid] |= _CONTROL

        # Several candidates: llama.cpp takes the first its hash map yields; the first in
        # list order is what it yields for the Llama 3 and Qwen 2 vocabularies.
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if ids.get(name) is None and (hits := found(texts)):
                ids[name] = hits[0]
                make_control(hits[0])
        self.eot_id, self.eom_id = ids.get("eot"), ids.get("eom")
        self.fim_pre_id, self.fim_suf_id, self.fim_mid_id = (
            ids.get("fim_pre"), ids.get("fim_suf"), ids.get("fim_mid"))
        for tid, text in enumerate(self._tokens):  # control tokens named "unused"
            if attrs[tid] & _CONTROL and "unused" in text:
                attrs[tid] |= _UNUSED

        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids.get(k) is not None}
        for tid in found(_EOG_TEXTS):
            eog.add(tid)
            make_control(tid)
        for tid in found(_ALWAYS_RENDERED):
            attrs[tid] = int(TokenAttr.USER_DEFINED)
        eog.update(ids[k] for k in ("eos", "eot", "eom") if ids.get(k) is not None)

        # o200k_harmony and solar-open: "<|end|>" ends a message, not the generation.
        texts = {self._tokens[t]: t for t in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = int(TokenAttr.USER_DEFINED)
        # gemma4 and plamo have an ordinary "</s>".
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = _NORMAL

        # Special tokens are cut out of the text longest first (by UTF-8 length).
        special = [i for i, a in enumerate(attrs) if a & _SPECIAL]
        special.sort(key=lambda i: -len(self._tokens[i].encode("utf-8", "surrogateescape")))

        # Per-model attributes llama.cpp sets by name (after the cache above is built).
        name = model_name.lower()
        if any(p in self.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                a in architecture for a in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in t2i:
                attrs[t2i["<mask>"]] |= _LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for tid in special:
                attrs[tid] |= _RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False),
                             ("<|endoftext|>", False)):
                if text in t2i:
                    tid = t2i[text]
                    attrs[tid] = attrs[tid] | _RSTRIP if on else attrs[tid] & ~_RSTRIP
        elif "modern-bert" in name and "[MASK]" in t2i:
            attrs[t2i["[MASK]"]] |= _LSTRIP

        entries = [(i, self._tokens[i], bool(attrs[i] & _LSTRIP), bool(attrs[i] & _RSTRIP))
                   for i in special]
        self._specials_parsed = entries
        self._specials_plain = [e for e in entries if not attrs[e[0]] & _HIDDEN]
        return frozenset(eog)

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
        return bool(self._attrs[token_id] & _SPECIAL)

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
            _BYTE_TO_CHAR)
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
        if not special and self._attrs[token_id] & _HIDDEN:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id)
        return piece

    def _render(self, token_id: int) -> bytes:
        attr, text = self._attrs[token_id], self._tokens[token_id]
        if attr & _SPECIAL:
            return text.encode("utf-8", "surrogateescape")
        if attr & _NORMAL:
            if self._spm:
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return self._unspell(text)
        if attr & _BYTE:
            return bytes([_c_hex_prefix(text[3:5]) & 0xFF])
        return b""  # unused / undefined tokens render as nothing

    @staticmethod
    def _unspell(text: str) -> bytes:
        """Undo GPT-2's byte spelling (llama_decode_text), with llama.cpp's marker for a
        character outside the byte alphabet."""
        out = bytearray()
        raw = text.encode("utf-8", "surrogateescape")
        for ch in text:
            b = _CHAR_TO_BYTE.get(ch)
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
