"""Small, working vocabularies for synthetic test models.

A synthetic model needs a tokenizer that behaves like a real one (so prompts, chat
templates, stop strings and streaming are exercised for real) but is tiny and built
without downloads. Both kinds here learn their pieces with a few hundred steps of BPE
training on a built-in English and Python sample, so common words become single tokens;
anything else falls back to bytes, so every text round-trips.

Construction is deterministic (ties broken by the pieces' text, no hashing or randomness)
because tests compare these vocabularies' ids with ids llama.cpp produced from the same
vocabulary, rebuilt by this code.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import regex
from gguf import TokenType

from eagerlm.loader.pretokenizers import BYTE_ALPHABET, PRE_TOKENIZERS
from eagerlm.loader.tokenizer import SPACE_MARK

SAMPLE_TEXT = '''\
The river runs past the old mill, and in the morning the light comes through the trees
and falls on the water. People in the town say that the mill was built more than one
hundred years ago, when the first families came to the valley to farm the land. They
worked hard, and they were proud of what they made. Their children went to a small
school on the hill, where a teacher taught them to read, to write and to count.

Today the town is quiet. There is a market on Saturday, a library with long tables,
and a cafe where you can drink coffee and talk with your friends about the weather,
the news, and the game last night. If you walk along the river you will see birds,
boats, and sometimes a fisherman who has been standing there since before the sun came
up. He does not catch much, but he says that is not the point.

"What is the point, then?" I asked him once. He thought about it for a while and said:
"The point is to be here, and to notice things. Most people are always going somewhere
else. I would rather stay and watch the water." I have thought about his answer many
times since then, and I believe he was right about something important.

Questions and answers: How many people live here? About 4,200 in the summer and 3,900
in the winter. When does the train leave? At 7:45 in the morning and 6:30 in the evening.
What should I bring? Good shoes, a warm coat, water, and a little patience.

The system reads the model file, checks the header, and loads every tensor into memory.
Each request is split into tokens, the tokens are processed in batches, and the results
are returned to the user as soon as they are ready. We measure the time for each step,
compare it with the limit of the hardware, and report the numbers in a table.

def count_words(text: str) -> dict[str, int]:
    """Return how often each word appears in the text."""
    counts: dict[str, int] = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:\\"'()")
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return counts


class Request:
    def __init__(self, prompt: str, max_tokens: int = 128) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.finished = False

    def append(self, token: int) -> bool:
        self.tokens.append(token)
        if len(self.tokens) >= self.max_tokens:
            self.finished = True
        return self.finished


if __name__ == "__main__":
    import sys

    for line in sys.stdin:
        result = count_words(line)
        print(sorted(result.items(), key=lambda item: -item[1])[:10])
'''

_PIECES_CAP = 4000  # training steps; the sample runs out of repeated pairs well before
_BPE_WORDS = regex.compile(r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+")
# Words with their leading ▁, letters, digits and symbols apart (as SentencePiece splits
# by script); a run of ▁ leaves its last one to the word that follows.
_SPM_WORDS = regex.compile(r"▁?\p{L}+|▁?\p{N}+|▁?[^\s\p{L}\p{N}▁]+|▁+(?=▁[^\s▁])|▁+")
_BOS_NAMES = ("<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>", "<s>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "<|return|>", "<|endoftext|>", "</s>", "<eos>")


@dataclass(frozen=True, eq=False)
class TinyVocab:
    """A complete GGUF tokenizer description (what `metadata()` writes under
    `tokenizer.ggml.*`)."""

    model: str  # "llama" (SentencePiece-style) or "gpt2" (byte-level BPE)
    pre: str
    tokens: list[str]
    scores: np.ndarray  # float32, one per token
    token_types: np.ndarray  # int32 gguf.TokenType values
    merges: list[str]  # "left right", gpt2 only
    bos_id: int
    eos_id: int
    unknown_id: int | None
    padding_id: int | None
    add_bos: bool
    add_eos: bool = False
    add_space_prefix: bool = False

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def fingerprint(self) -> str:
        """A digest of everything `metadata()` writes, so fixtures made from a vocabulary
        can tell when the vocabulary this code builds has changed."""
        h = hashlib.sha256()
        for key, value in self.metadata().items():
            h.update(key.encode())
            h.update(value.tobytes() if isinstance(value, np.ndarray)
                     else json.dumps(value, ensure_ascii=False).encode())
        return h.hexdigest()

    def metadata(self) -> dict[str, Any]:
        """The `tokenizer.ggml.*` keys and values for a GGUF writer."""
        md: dict[str, Any] = {
            "tokenizer.ggml.model": self.model,
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": list(self.tokens),
            "tokenizer.ggml.scores": self.scores,
            "tokenizer.ggml.token_type": self.token_types,
        }
        if self.model == "gpt2":
            md["tokenizer.ggml.merges"] = list(self.merges)
        md["tokenizer.ggml.bos_token_id"] = self.bos_id
        md["tokenizer.ggml.eos_token_id"] = self.eos_id
        if self.unknown_id is not None:
            md["tokenizer.ggml.unknown_token_id"] = self.unknown_id
        if self.padding_id is not None:
            md["tokenizer.ggml.padding_token_id"] = self.padding_id
        md["tokenizer.ggml.add_bos_token"] = self.add_bos
        md["tokenizer.ggml.add_eos_token"] = self.add_eos
        md["tokenizer.ggml.add_space_prefix"] = self.add_space_prefix
        return md


def _train_merges(words: Counter[str], limit: int) -> list[tuple[str, str]]:
    """BPE training: repeatedly merge the most frequent adjacent pair (ties: the pair
    that sorts first), counting only pairs seen at least twice.

    Pair counts are updated only for the words a merge touches, and the best pair comes
    from a heap whose stale entries are skipped, so this stays fast in pure Python.
    """
    spelled = [list(w) for w in words]
    freq = list(words.values())
    counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, syms in enumerate(spelled):
        for pair in pairwise(syms):
            counts[pair] += freq[wi]
            where[pair].add(wi)
    heap = [(-c, p) for p, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < limit:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg:
            continue  # stale entry
        if -neg < 2:
            break
        merges.append(pair)
        merged = pair[0] + pair[1]
        changed: set[tuple[str, str]] = set()
        for wi in sorted(where.pop(pair, ())):
            syms, f = spelled[wi], freq[wi]
            for p in pairwise(syms):
                counts[p] -= f
                changed.add(p)
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            spelled[wi] = out
            for p in pairwise(out):
                counts[p] += f
                where[p].add(wi)
                changed.add(p)
        counts.pop(pair, None)
        for p in changed:
            if counts.get(p, 0) > 0:
                heapq.heappush(heap, (-counts[p], p))
            else:
                counts.pop(p, None)
    return merges


@functools.cache
def _bpe_merges() -> tuple[tuple[str, str], ...]:
    """Byte-level merges learned from the sample (words spelled in GPT-2's alphabet)."""
    words = Counter("".join(BYTE_ALPHABET[b] for b in w.encode("utf-8"))
                    for w in _BPE_WORDS.findall(SAMPLE_TEXT))
    return tuple(_train_merges(words, _PIECES_CAP))


@functools.cache
def _spm_pieces() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(single characters by frequency, merged pieces in training order) from the sample
    with spaces written as ▁ and attached to the following word, as SentencePiece does."""
    escaped = SAMPLE_TEXT.replace(" ", SPACE_MARK)
    chars = Counter(ch for ch in escaped if not ch.isspace())
    singles = tuple(sorted(chars, key=lambda ch: (-chars[ch], ch)))
    words = Counter(_SPM_WORDS.findall(escaped))
    words = Counter({w: c for w, c in words.items() if not w.isspace()})
    merges = _train_merges(words, _PIECES_CAP)
    return singles, tuple(a + b for a, b in merges)


def _fill(tokens: list[str], types: list[int], vocab_size: int, pattern: str) -> None:
    """Pad to `vocab_size` with UNUSED tokens: no text ever becomes one (they are not
    special, and no merge or piece reaches them) and they render as nothing."""
    taken = set(tokens)
    k = 0
    while len(tokens) < vocab_size:
        name = pattern.format(k)
        k += 1
        if name not in taken:
            tokens.append(name)
            types.append(TokenType.UNUSED)


def _dedupe(specials: Sequence[str], reserved: Sequence[str]) -> list[str]:
    out: list[str] = []
    for s in specials:
        if not s:
            raise ValueError("a special token cannot be empty")
        if s not in out and s not in reserved:
            out.append(s)
    return out


def spm_vocab(vocab_size: int, specials: Sequence[str] = ()) -> TinyVocab:
    """A SentencePiece-style (`llama` model) vocabulary like Gemma's or Llama 2's.

    Layout: <unk>, <s>, </s>, <pad>, the given specials (CONTROL), the 256 byte tokens
    <0x00>..<0xFF>, ▁ and the sample's characters, then learned pieces scored by training
    order (earlier = higher), then UNUSED padding. No space prefix is added, as in Gemma,
    so decode(encode(text)) == text for any text without U+2581.
    """
    head = ["<unk>", "<s>", "</s>", "<pad>"]
    extra = _dedupe(specials, head)
    tokens = [*head, *extra, *(f"<0x{b:02X}>" for b in range(256))]
    types = [TokenType.UNKNOWN, *[TokenType.CONTROL] * (3 + len(extra)),
             *[TokenType.BYTE] * 256]
    scores = [0.0] * len(tokens)
    if vocab_size < len(tokens):
        raise ValueError(f"an SPM vocabulary with {len(extra)} extra specials needs at "
                         f"least {len(tokens)} tokens, not {vocab_size}")
    singles, pieces = _spm_pieces()
    present = set(tokens)
    for i, ch in enumerate((SPACE_MARK, *(c for c in singles if c != SPACE_MARK))):
        if len(tokens) == vocab_size:
            break
        if ch not in present:
            present.add(ch)
            tokens.append(ch)
            types.append(TokenType.NORMAL)
            scores.append(-1e6 - i)  # never a merge result, so never compared
    for rank, piece in enumerate(pieces):
        if len(tokens) == vocab_size:
            break
        if piece not in present:
            present.add(piece)
            tokens.append(piece)
            types.append(TokenType.NORMAL)
            scores.append(-float(rank))
    n_real = len(tokens)
    _fill(tokens, types, vocab_size, "<unused{}>")
    scores += [0.0] * (len(tokens) - n_real)
    return TinyVocab(model="llama", pre="default", tokens=tokens,
                     scores=np.asarray(scores, dtype=np.float32),
                     token_types=np.asarray(types, dtype=np.int32), merges=[],
                     bos_id=1, eos_id=2, unknown_id=0, padding_id=3, add_bos=True)


def bpe_vocab(vocab_size: int, pre: str = "llama-bpe", specials: Sequence[str] = ()) -> TinyVocab:
    """A byte-level BPE (`gpt2` model) vocabulary like Llama 3's or Qwen 2's.

    Layout: the 256 byte symbols in byte order, the specials (CONTROL; '<|endoftext|>' is
    added first when none of the known BOS/EOS texts is given), the learned merges'
    results in rank order, then UNUSED padding. BOS is the first of <|begin_of_text|>,
    <|endoftext|>, ... present, EOS the first of <|end_of_text|>, <|endoftext|>, ...;
    BOS is added when the pre-tokenizer's family adds it (Llama 3 does, Qwen 2 does not).
    """
    if pre not in PRE_TOKENIZERS or not pre:
        raise ValueError(f"unknown pre-tokenizer {pre!r}")
    extra = _dedupe(specials, BYTE_ALPHABET)
    if not any(s in extra for s in (*_BOS_NAMES, *_EOS_NAMES)):
        extra.insert(0, "<|endoftext|>")
    tokens = [*BYTE_ALPHABET, *extra]
    types = [TokenType.NORMAL] * 256 + [TokenType.CONTROL] * len(extra)
    if vocab_size < len(tokens):
        raise ValueError(f"a BPE vocabulary with {len(extra)} specials needs at least "
                         f"{len(tokens)} tokens, not {vocab_size}")
    present = set(tokens)
    merges: list[str] = []
    for left, right in _bpe_merges():
        merged = left + right
        if merged not in present:
            if len(tokens) == vocab_size:
                break
            present.add(merged)
            tokens.append(merged)
            types.append(TokenType.NORMAL)
        merges.append(f"{left} {right}")
    _fill(tokens, types, vocab_size, "<|reserved_{}|>")
    bos = next(tokens.index(s) for s in (*_BOS_NAMES, *_EOS_NAMES) if s in present)
    eos = next(tokens.index(s) for s in (*_EOS_NAMES, *_BOS_NAMES) if s in present)
    return TinyVocab(model="gpt2", pre=pre, tokens=tokens,
                     scores=np.zeros(len(tokens), dtype=np.float32),
                     token_types=np.asarray(types, dtype=np.int32), merges=merges,
                     bos_id=bos, eos_id=eos, unknown_id=None, padding_id=eos,
                     add_bos=PRE_TOKENIZERS[pre].add_bos)
