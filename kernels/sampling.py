"""Token sampling: the numpy reference that the GPU sampler kernel must reproduce.

Two decisions shape this file.

**Filter order (llama.cpp's default chain).** llama.cpp's sampler chain (common_sampler_init)
is the logit bias, then `common_params_sampling.samplers`, which defaults to penalties -> DRY
-> top-n-sigma -> top-k -> typical-p -> top-p -> min-p -> XTC -> temperature, then the final
draw. Of those we implement the logit bias and the penalties (repetition, presence,
frequency; see `adjust_logits`), top-k, top-p and min-p, in that order, and apply the
temperature *after* them, to the survivors only. So the candidate set depends on the
model's own (temperature-1) distribution, and temperature only reshapes the probabilities
among candidates; a high temperature cannot let junk tokens in. (HF transformers applies
temperature first; its results differ whenever a filter is active.)

  1. top-k: keep the k largest logits (k = 0 or k >= vocab: off).
  2. top-p: softmax over the survivors, sort by probability, keep the shortest prefix whose
     cumulative probability reaches `top_p` (at least one token).
  3. min-p: keep tokens with p >= min_p * p_max, computed as llama.cpp does, in logit space:
     logit >= max_logit + log(min_p). The ratio p/p_max does not change when earlier
     filters renormalise, and the max token always survives.
  4. temperature T: survivors get weight exp((logit - max_logit) / T).
  5. draw with the uniform u of step "Draw" below.

Ties are broken by lower token id everywhere (greedy argmax, the top-k boundary, the top-p
sort), so the kept set is a function of the logits alone, not of a sort's whims.

**Counter-based randomness.** The uniform number for a row is a pure function of the
request's seed and the row's position, so a token does not depend on which other requests
share the batch or how many rounds ran before, and a CUDA kernel can compute the same
number with no generator state. With all arithmetic modulo 2**64::

    mix64(z):  z ^= z >> 30; z *= 0xBF58476D1CE4E5B9
               z ^= z >> 27; z *= 0x94D049BB133111EB
               z ^= z >> 31; return z                      # splitmix64's finaliser
    bits = mix64(mix64(seed) + (position + 1) * 0x9E3779B97F4A7C15)
    u    = (bits >> 11) * 2**-53                           # double in [0, 1)

that is, output number `position + 1` of a splitmix64 stream whose state starts at
mix64(seed) (hashing the seed keeps seeds s and s + gamma from giving shifted streams).

Draw: order the surviving tokens by ascending id, accumulate their weights in float64, and
return the first token whose running sum exceeds u * (total weight).

**Constraints.** A request may carry a `Constraint` (a JSON schema, a regular expression, a
Lark or a GBNF grammar). The sampler only sees its effect: an allowed-token bitmask per row
(int32 words, bit `t % 32` of word `t // 32` set when token t may come next), applied after
the logit bias and penalties and before everything else, so disallowed tokens get -inf and
no filter or draw can pick them (`apply_token_mask`). Who makes the masks, and when, is the
dispatcher's business (dispatch/grammar.py, dispatch/mask_board.py).

`seed=None` means "random": the caller gives each request a seed once, with
`SamplingParams.resolve_seed()` (or `fresh_seed()`), before its first round, so all of a
request's rounds draw from one stream and a logged seed reproduces the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eagerlm.errors import InvalidParameters

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI's API allows (+-100 bans or forces)
SEED_LIMIT = 1 << 64
POSITION_LIMIT = 1 << 63  # positions travel as int64 on the device
# speculative decoding (dispatch/speculation.py): a request's method and its most drafts
SPECULATIVE_METHODS = ("off", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16

_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
# The first top-p candidate set tried when no top-k bounds it; it grows 16x until it holds
# the nucleus, so typical nuclei cost one partition instead of a full 262k-entry sort.
_NUCLEUS_FIRST_GUESS = 64
_NUCLEUS_GROWTH = 16


class InvalidSamplingParams(InvalidParameters):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field} {message}", param=field)


CONSTRAINT_KINDS = ("json_schema", "regex", "lark", "gbnf")


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: a JSON schema (as JSON text), a regular
    expression, a Lark grammar or a GBNF grammar (llama.cpp's). Only the description: it is
    compiled against the model's tokenizer when the request is submitted
    (dispatch/grammar.py), where an invalid one is refused naming `field`, the request
    field it came from (a server sets it to its own field name)."""

    kind: str
    text: str
    field: str = dataclasses.field(default="constraint", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidSamplingParams(
                self.field, f"kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                f"got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text:
            raise InvalidSamplingParams(self.field, f"must be a non-empty string, got "
                                                    f"{self.text!r}")

    @classmethod
    def json_schema(cls, schema: dict | str | bool, field: str = "constraint") -> Constraint:
        """A JSON schema, as a mapping or JSON text (`{"type": "object"}` for any object)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, field)

    @classmethod
    def regex(cls, pattern: str, field: str = "constraint") -> Constraint:
        return cls("regex", pattern, field)

    @classmethod
    def lark(cls, grammar: str, field: str = "constraint") -> Constraint:
        return cls("lark", grammar, field)

    @classmethod
    def gbnf(cls, grammar: str, field: str = "constraint") -> Constraint:
        return cls("gbnf", grammar, field)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Validated on construction, so a bad request fails
    when it is submitted rather than inside a round shared with other requests."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = random; resolve before the first round
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # penalties, applied to the logits before everything else (llama.cpp's chain order);
    # repetition over prompt and output tokens, presence / frequency over output tokens
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages repeats
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output so far
    logprobs: int | None = None  # None = off; N = the sampled token's and N alternatives'
    # added to the logits before everything else, greedy included (OpenAI's logit_bias);
    # given as a mapping or pairs, kept as (token id, bias) pairs sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    # a reasoning model's `<think>` block, which stop strings skip (dispatch/reasoning.py):
    # "" none, "may_open" the reply may open one, "open" the prompt opened it; "harmony" a
    # gpt-oss reply, whose answer is its final channel (dispatch/harmony.py)
    reasoning_block: str = ""
    # the output must match it (None: free text); masked after the bias and penalties
    constraint: Constraint | None = None
    # vLLM's and SGLang's `skip_special_tokens`: leave control tokens out of the text (the
    # SGLang router asks for it on every request); off, they show as their text
    skip_special_tokens: bool = False
    # speculative decoding (dispatch/speculation.py): "ngram" (prompt lookup), "draft" (the
    # engine's draft model) or "off"; None: the engine's setting. It never changes the
    # tokens, only how many forwards produce them
    speculative: str | None = None
    num_speculative_tokens: int | None = None  # drafts per round at most; None: engine's

    def __post_init__(self) -> None:
        def fail(field: str, allowed: str) -> None:
            raise InvalidSamplingParams(field, f"must be {allowed}, got {getattr(self, field)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "an int >= 1")
        if not _is_real(self.temperature) or not (math.isfinite(self.temperature)
                                                 and self.temperature >= 0):
            fail("temperature", "a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "an int >= 0 (0 disables top-k)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "a number in (0, 1] (1 disables top-p)")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "a number in [0, 1] (0 disables min-p)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            fail("seed", "None or an int in [0, 2**64)")
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, (tuple, list)):
            fail("stop", f"a tuple of at most {MAX_STOP_STRINGS} non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParams(
                "stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams(
                    "stop", f"must contain only non-empty strings, got {s!r}")
        for flag in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                fail(flag, "a bool")
        if not _is_real(self.repetition_penalty) or not (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            fail("repetition_penalty", "a finite number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "a number in [-2, 2] (0 disables it)")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            fail("speculative", f"None or one of {', '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens)
                or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            fail("num_speculative_tokens", f"None or an int in [0, {MAX_SPECULATIVE_TOKENS}]")
        if self.reasoning_block not in ("", "may_open", "open", "harmony"):
            fail("reasoning_block", "'', 'may_open', 'open' or 'harmony'")
        object.__setattr__(self, "logit_bias", _canonical_logit_bias(self.logit_bias))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            fail("constraint", "None or a Constraint")
        # Canonical types, so equal parameters compare and hash equal.
        for name, kind in (("max_tokens", int), ("temperature", float), ("top_k", int),
                           ("top_p", float), ("min_p", float), ("ignore_eos", bool),
                           ("skip_special_tokens", bool),
                           ("repetition_penalty", float), ("presence_penalty", float),
                           ("frequency_penalty", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        for name in ("seed", "num_speculative_tokens"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs the request's token counts."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before drawing (a logit bias
        or penalties): such rows are sampled from an adjusted copy of the logits."""
        return self.penalized or bool(self.logit_bias)

    @property
    def constrained(self) -> bool:
        """Whether each token needs an allowed-token mask, which depends on the previous
        token: the sampling of such rows waits for the host (dispatch/mask_board.py)."""
        return self.constraint is not None

    def resolve_seed(self) -> SamplingParams:
        """These parameters with a concrete seed: unchanged if one is set, else a fresh one."""
        return self if self.seed is not None else dataclasses.replace(self, seed=fresh_seed())


def _canonical_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A logit bias as sorted (token id, float bias) pairs; InvalidSamplingParams for
    anything else than a mapping or pairs of an id >= 0 (each once) and a finite bias in
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]. (Ids beyond the vocabulary are refused at submission,
    where the vocabulary is known.)"""
    def fail(message: str) -> InvalidSamplingParams:
        return InvalidSamplingParams("logit_bias", message)

    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)):
        pairs = list(value)
    else:
        raise fail(f"must be a mapping of token id to bias, got {value!r}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise fail(f"must hold (token id, bias) pairs, got {pair!r}")
        token, bias = pair
        if not _is_int(token) or token < 0:
            raise fail(f"token ids must be ints >= 0, got {token!r}")
        if not _is_real(bias) or not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
            raise fail(f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                       f"got {bias!r} for token {token}")
        if int(token) in out:
            raise fail(f"names token {token} twice")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items()))


def dense_logit_bias(params: SamplingParams, vocab: int) -> np.ndarray:
    """The request's logit bias as float32 [vocab] (zero where it names no token): what
    the sampler adds to a row of logits. ValueError for an id outside the vocabulary."""
    bias = np.zeros(vocab, np.float32)
    if params.logit_bias:
        ids = np.array([t for t, _ in params.logit_bias], np.int64)
        if ids[-1] >= vocab:
            raise ValueError(f"logit_bias names token {int(ids[-1])}, but the vocabulary "
                             f"has {vocab} tokens")
        bias[ids] = [b for _, b in params.logit_bias]
    return bias


def fresh_seed() -> int:
    """A random 64-bit seed for a request that did not ask for one."""
    return secrets.randbits(64)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def draw_uniform(seeds: Sequence[int] | np.ndarray,
                 positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """The counter-based uniform in [0, 1) for each (seed, position); see the module doc."""
    seed = np.asarray(seeds, dtype=np.uint64)
    pos = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping modulo 2**64 is the point
        bits = _mix64(_mix64(seed) + (pos + np.uint64(1)) * _GAMMA)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, ordered by (logit descending, id ascending).

    A partition finds the k-th value; ties at that value are resolved toward lower ids, so
    the set is deterministic (np.argpartition alone leaves boundary ties unspecified).
    """
    kth = np.partition(logits, logits.size - k)[logits.size - k]
    above = np.flatnonzero(logits > kth)
    ties = np.flatnonzero(logits == kth)[: k - above.size]
    ids = np.concatenate([above, ties])
    return ids[np.argsort(-logits[ids], kind="stable")]


def _nucleus(logits: np.ndarray, max_logit: float, ids: np.ndarray | None,
             top_p: float) -> np.ndarray:
    """The top-p prefix of `ids` (or of the whole vocabulary when `ids` is None)."""
    if ids is not None:
        cumulative = np.cumsum(np.exp(logits[ids] - max_logit))
        target = top_p * float(cumulative[-1])
    else:
        weights = np.exp(logits - max_logit)
        target = top_p * float(weights.sum())
        k = _NUCLEUS_FIRST_GUESS
        while True:
            ids = _top_ids(logits, k) if k < logits.size else np.argsort(-logits, kind="stable")
            cumulative = np.cumsum(weights[ids])
            if k >= logits.size or cumulative[-1] >= target:
                break
            k *= _NUCLEUS_GROWTH
    # Shortest prefix reaching the target; if rounding leaves it unreached, keep them all.
    keep = int(np.searchsorted(cumulative, target, side="left")) + 1
    return ids[:keep]


def _check_row(logits: np.ndarray, row: int) -> float:
    max_logit = float(logits.max())
    if not math.isfinite(max_logit):
        raise ValueError(f"logits row {row} has no finite maximum (NaN, +inf or all -inf)")
    return max_logit


def filter_candidates(logits: np.ndarray, params: SamplingParams, *, row: int = 0) -> np.ndarray:
    """Token ids, ascending, that survive top-k -> top-p -> min-p for one row of logits.

    Greedy parameters keep exactly the argmax. Exposed so a device kernel can be checked
    against the reference set by set, not only token by token.
    """
    logits = np.asarray(logits, dtype=np.float64)
    max_logit = _check_row(logits, row)
    if params.greedy:
        return np.array([int(np.argmax(logits))], dtype=np.int64)
    ids: np.ndarray | None = None  # None: the whole vocabulary
    if 0 < params.top_k < logits.size:
        ids = _top_ids(logits, params.top_k)
    if params.top_p < 1.0:
        ids = _nucleus(logits, max_logit, ids, params.top_p)
    if params.min_p > 0.0:
        threshold = max_logit + math.log(params.min_p)
        ids = np.flatnonzero(logits >= threshold) if ids is None else ids[
            logits[ids] >= threshold]
    return np.arange(logits.size) if ids is None else np.sort(ids)


def _sample_row(logits: np.ndarray, params: SamplingParams, u: float, row: int) -> int:
    logits = logits.astype(np.float64)
    ids = filter_candidates(logits, params, row=row)
    if ids.size == 1:
        return int(ids[0])
    max_logit = float(logits.max())
    candidate_logits = logits if ids.size == logits.size else logits[ids]
    weights = np.exp((candidate_logits - max_logit) / params.temperature)
    cumulative = np.cumsum(weights)
    j = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    if j >= ids.size:  # u * total rounded up to total: take the last token with weight
        j = int(np.flatnonzero(weights)[-1])
    return int(ids[j])


@dataclass
class TokenCounts:
    """How often each token occurs in a request's prompt and in its output so far: what
    the penalties need. Kept beside the sampler (on the device side of the dispatcher), so
    penalties need no help from the host that reads tokens."""

    prompt: np.ndarray  # int32 [vocab]
    output: np.ndarray  # int32 [vocab]

    @classmethod
    def empty(cls, vocab: int) -> TokenCounts:
        return cls(np.zeros(vocab, np.int32), np.zeros(vocab, np.int32))

    @classmethod
    def of(cls, vocab: int, prompt: Sequence[int] | np.ndarray,
           output: Sequence[int] | np.ndarray = ()) -> TokenCounts:
        """The counts of a request whose tokens so far are `prompt` then `output`."""
        counts = cls.empty(vocab)
        counts.add(prompt, as_output=False)
        counts.add(output, as_output=True)
        return counts

    def add(self, tokens: Sequence[int] | np.ndarray, as_output: bool) -> None:
        np.add.at(self.output if as_output else self.prompt, np.asarray(tokens, np.int64), 1)


def apply_penalties(logits: np.ndarray, params: SamplingParams,
                    counts: TokenCounts) -> np.ndarray:
    """One row of logits with the penalties applied (a new float32 array).

    Repetition (as llama.cpp and HF do): a seen token's logit is divided by the penalty
    when positive, multiplied when negative. Presence and frequency (as OpenAI defines
    them): logit -= presence * [count > 0] + frequency * count, over output tokens."""
    out = np.array(logits, dtype=np.float32)
    if params.repetition_penalty != 1.0:
        seen = (counts.prompt + counts.output) > 0
        rp = np.float32(params.repetition_penalty)
        out[seen] = np.where(out[seen] > 0, out[seen] / rp, out[seen] * rp)
    if params.frequency_penalty:
        out -= np.float32(params.frequency_penalty) * counts.output
    if params.presence_penalty:
        out -= np.float32(params.presence_penalty) * (counts.output > 0)
    return out


def adjust_logits(logits: np.ndarray, params: SamplingParams, counts: TokenCounts | None,
                  bias: np.ndarray | None = None) -> np.ndarray:
    """One row of logits as the sampler sees it (a new float32 array): the logit bias
    added first (`bias`: `dense_logit_bias(params, vocab)`, made here when not given), then
    the penalties (`counts` needed when `params.penalized`), llama.cpp's order."""
    out = np.array(logits, dtype=np.float32)
    if params.logit_bias:
        out += dense_logit_bias(params, out.size) if bias is None else bias
    if params.penalized:
        if counts is None:
            raise ValueError("penalties need the request's token counts")
        out = apply_penalties(out, params, counts)
    return out


def mask_words(vocab: int) -> int:
    """int32 words in an allowed-token bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The bitmask as bool [vocab] (tokens past the mask's bits are not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, np.int32).view(np.uint8),
                         bitorder="little")
    out = np.zeros(vocab, bool)
    n = min(vocab, bits.size)
    out[:n] = bits[:n]
    return out


def apply_token_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One row of logits with the tokens the mask does not allow set to -inf (a new
    float32 array)."""
    out = np.array(logits, dtype=np.float32)
    out[~allowed_tokens(mask, out.size)] = -np.inf
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the `n` most likely alternatives', from the
    model's distribution (log-softmax of the raw logits, before the logit bias, penalties,
    filters and temperature, as OpenAI-compatible servers report them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    logp = x - math.log(float(np.exp(x).sum()))
    top = _top_ids(logp, n) if n else np.zeros(0, np.int64)
    return TokenLogprob(int(token), float(logp[token]),
                        tuple((int(i), float(logp[i])) for i in top))


def sample(logits: np.ndarray, params: Sequence[SamplingParams],
           positions: Sequence[int],
           counts: Sequence[TokenCounts | None] | None = None,
           biases: Sequence[np.ndarray | None] | None = None,
           masks: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
    """One token per row of `logits` [n, vocab]; row i uses params[i] and positions[i].

    `positions[i]` is the counter of the row's draw: the engine passes the sequence
    position the sampled token will occupy, which is unique per step of a request.
    Non-greedy rows need a resolved seed (see `SamplingParams.resolve_seed`). Rows whose
    params are `penalized` need `counts[i]`, the request's token counts so far; rows with a
    logit bias may pass it dense as `biases[i]` (else it is built from their params). A row
    with `masks[i]` (an allowed-token bitmask, int32 [mask_words(vocab)]) draws only among
    the tokens it allows; ValueError when it allows none.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    n, vocab = logits.shape
    if len(params) != n or len(positions) != n:
        raise ValueError(f"{n} logit rows need {n} params and positions, "
                         f"got {len(params)} and {len(positions)}")
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary")
    out = np.empty(n, dtype=np.int32)
    rows = [logits[i] for i in range(n)]
    for i, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        c = None if counts is None else counts[i]
        if p.penalized and c is None:
            raise ValueError(f"params[{i}] has penalties but no token counts were given")
        rows[i] = adjust_logits(rows[i], p, c, None if biases is None else biases[i])
    for i, mask in enumerate(masks or ()):
        if mask is not None:
            rows[i] = apply_token_mask(rows[i], mask)
            if not np.isfinite(rows[i]).any():
                raise ValueError(f"the token mask of row {i} allows no token it can draw")
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    for i in drawn:
        if params[i].seed is None:
            raise ValueError(f"params[{i}] has temperature > 0 but no seed; resolve it once "
                             f"per request with SamplingParams.resolve_seed()")
        if not 0 <= positions[i] < POSITION_LIMIT:
            raise ValueError(f"positions[{i}] must be in [0, 2**63), got {positions[i]}")
    uniforms = draw_uniform([params[i].seed for i in drawn], [positions[i] for i in drawn])
    u_of = dict(zip(drawn, uniforms.tolist(), strict=True))
    for i, p in enumerate(params):
        if p.greedy:
            token = int(np.argmax(rows[i]))
            if math.isnan(float(rows[i][token])):
                raise ValueError(f"logits row {i} contains NaN")
            out[i] = token
        else:
            out[i] = _sample_row(rows[i], p, u_of[i], i)
    return out


__all__ = [
    "CONSTRAINT_KINDS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_SPECULATIVE_TOKENS",
    "MAX_STOP_STRINGS",
    "SPECULATIVE_METHODS",
    "Constraint",
    "InvalidSamplingParams",
    "SamplingParams",
    "TokenCounts",
    "TokenLogprob",
    "adjust_logits",
    "allowed_tokens",
    "apply_penalties",
    "apply_token_mask",
    "dense_logit_bias",
    "draw_uniform",
    "filter_candidates",
    "fresh_seed",
    "mask_words",
    "sample",
    "token_logprob",
]
