"""How byte-level BPE vocabularies cut text into words and spell them, as llama.cpp does.

Before a `gpt2` (byte-level BPE) vocabulary merges anything, llama.cpp splits the text
into words with the pre-tokenizer that `tokenizer.ggml.pre` names, and spells each word's
UTF-8 bytes in GPT-2's byte-to-unicode alphabet, in which the vocabulary's tokens are
written. This module holds both: the alphabet (`BYTE_ALPHABET` and its two lookup
tables) and `PreTokenizer` with `PRE_TOKENIZERS`, the `tokenizer.ggml.pre` values eagerlm
knows, grouped in families that share one regex list and one set of loader flags. They
live apart from `Tokenizer` (loader/tokenizer.py) because they are tables copied from
llama.cpp, not the encoding algorithm, and loader/tiny_vocab.py builds test vocabularies
from them too.

Character classes (\\p{L}, \\p{N}, \\s...) come from the `regex` package, whose Unicode
tables may be newer than llama.cpp's: code points assigned in between can split
differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import regex


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
BYTE_TO_CHAR = {b: c for b, c in enumerate(BYTE_ALPHABET)}  # for str.translate
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_ALPHABET)}

# llama.cpp runs hand-written scanners for these three expressions; they match what the
# expressions match, so the `regex` package runs the expressions themselves. The GPT-2
# one gets llama.cpp's fallback `\s+` for a single space before a non-space.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss) and Mistral's tekken, as llama.cpp runs them: through std::regex
# on the "collapsed" text (see below), where \p{Lu} and \p{Ll} cannot be told apart, so
# llama.cpp writes tiktoken's [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] as "a letter that is not
# a-z" and [\p{Ll}\p{Lm}\p{Lo}\p{M}] as "a letter that is not A-Z": every non-ASCII letter
# counts as both, and a combining mark as neither. The `regex` package runs these same
# expressions on the real text with the same meaning.
_UPPERISH = r"(?=[\p{L}])[^a-z]"
_LOWERISH = r"(?=[\p{L}])[^A-Z]"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?(?:{_UPPERISH})*(?:{_LOWERISH})+(?:{_CONTRACTIONS})?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?(?:{_UPPERISH})+(?:{_LOWERISH})*(?:{_CONTRACTIONS})?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?(?:{_UPPERISH})*(?:{_LOWERISH})+"
           rf"|[^\r\n\p{{L}}\p{{N}}]?(?:{_UPPERISH})+(?:{_LOWERISH})*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
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
    **_family(PreTokenizer((_GPT4O,), clean_spaces=False), "gpt-4o", "llama4", "kanana2", "talkie",
              "minimax-m2"),
    **_family(PreTokenizer((_TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True),
              "tekken"),
}
