"""Which tokens of a vocabulary are special, and how llama.cpp finds out.

GGUF files store each token's type (normal, control, user-defined, byte...) and some
special ids (`tokenizer.ggml.bos_token_id`, ...), but not which tokens end a generation,
and llama.cpp's loader fixes some types by name. This module holds what that takes:
`TokenAttr`, llama.cpp's attribute bits; the token texts llama.cpp recognises as EOT, EOM,
fill-in-the-middle and end-of-generation tokens; the metadata keys of the special ids and
each model's defaults; and `settle_special_tokens`, which applies llama.cpp's rules
(`llama_vocab::impl::load`) to one vocabulary. `Tokenizer` (loader/tokenizer.py) calls it
once when it is built; the tables and rules live here because they are llama.cpp's
bookkeeping, not the encoding algorithm.

Where llama.cpp's behaviour depends on hash-map iteration order (which of several
candidate texts becomes `eot_id`) the smallest id is taken; the end-of-generation set
does not depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntFlag

import numpy as np


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
TYPE_TO_ATTR = np.array([TokenAttr.UNDEFINED, TokenAttr.NORMAL, TokenAttr.UNKNOWN,
                         TokenAttr.CONTROL, TokenAttr.USER_DEFINED, TokenAttr.UNUSED,
                         TokenAttr.BYTE], dtype=np.int64)
# Plain ints for the hot paths (IntFlag arithmetic is slow).
SPECIAL = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
HIDDEN = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)  # not rendered unless asked for
NORMAL, BYTE = int(TokenAttr.NORMAL), int(TokenAttr.BYTE)
_CONTROL = int(TokenAttr.CONTROL)
_LSTRIP, _RSTRIP = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
_UNUSED = int(TokenAttr.UNUSED)


# Special-token texts llama.cpp recognises (llama_vocab::impl::load).
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
ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
           ("eom", "eom_token_id"), ("unk", "unknown_token_id"),
           ("sep", "seperator_token_id"), ("pad", "padding_token_id"),
           ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
           ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
           ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
           ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
           ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))
DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}


@dataclass(frozen=True)
class SpecialTokens:
    """What `settle_special_tokens` finds in one vocabulary."""

    ids: dict[str, int | None]  # the metadata's special ids, completed from token texts
    end_ids: frozenset[int]  # llama.cpp's end-of-generation set
    # (id, text, lstrip, rstrip) of the tokens cut out of text before tokenizing, longest
    # text first: all special tokens (`parsed`), or those rendered as text (`plain`).
    parsed: list[tuple[int, str, bool, bool]]
    plain: list[tuple[int, str, bool, bool]]


def settle_special_tokens(tokens: Sequence[str], token_to_id: Mapping[str, int],
                          attrs: list[int], ids: Mapping[str, int | None], pre: str,
                          model_name: str, architecture: str) -> SpecialTokens:
    """Fix attributes and find the end-of-generation set as llama.cpp's loader does:
    from ids in the metadata and from well-known token texts, since GGUF files do not
    mark end tokens. `attrs` (one per token) is fixed in place."""
    ids, t2i = dict(ids), token_to_id

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
    for tid, text in enumerate(tokens):  # control tokens named "unused"
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
    texts = {tokens[t]: t for t in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        end = texts["<|end|>"]
        eog.discard(end)
        attrs[end] = int(TokenAttr.USER_DEFINED)
        if ids.get("eot") == end:  # an end of turn that no longer ends: the next that does
            ids["eot"] = next((t for t in found(_EOT_TEXTS) if t in eog), None)
    # gemma4 and plamo have an ordinary "</s>".
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = NORMAL

    # Special tokens are cut out of the text longest first (by UTF-8 length).
    special = [i for i, a in enumerate(attrs) if a & SPECIAL]
    special.sort(key=lambda i: -len(tokens[i].encode("utf-8", "surrogateescape")))

    # Per-model attributes llama.cpp sets by name (after the cache above is built).
    name = model_name.lower()
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
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

    entries = [(i, tokens[i], bool(attrs[i] & _LSTRIP), bool(attrs[i] & _RSTRIP))
               for i in special]
    plain = [e for e in entries if not attrs[e[0]] & HIDDEN]
    return SpecialTokens(ids=ids, end_ids=frozenset(eog), parsed=entries, plain=plain)
