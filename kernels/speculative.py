"""Speculative decoding's device-side steps, as the numpy reference the CUDA kernels must
reproduce (kernels/cuda/speculative.cu): the prompt-lookup proposal and the acceptance.

A speculating session keeps its length and its tokens on the device side (in buffers the
dispatcher owns, `SpecBuffers`): per token-buffer slot, `lengths[slot]` is how many of its
positions hold accepted KV (so the next input, `token_buf[slot]`, goes at that position),
and `history[slot, :lengths[slot] + 1]` its tokens (prompt and output, the next input
last). A round reads them on the device, so its launch never waits for the host to learn
how many tokens the round before accepted.

**Proposal (prompt lookup, vLLM's `ngram`, llama.cpp's lookup).** The last n tokens of the
history, for n from `n_max` down to `n_min`, are looked for earlier in the history; at the
most recent earlier occurrence of the longest n that has one, the k tokens that followed it
are the proposal (copied through their own end, as LZ77 copies: a repeating pattern is
proposed whole even where its last occurrence is the one just before the suffix). The most
recent occurrence rather than the first: text being copied or edited continues where it
last was.

**Acceptance.** A session proposing d_1..d_m contributes rows [t, d_1, .., d_k] (k >= m;
rows past m carry filler) at positions L .. L + k, and every row is sampled as if it were
the only one: row i with the request's own rules at position L + i + 1, giving x_i. The
accepted run is the longest a <= m with x_{i-1} = d_i for i = 1..a; the session emits
x_0 .. x_a (a + 1 tokens), its KV keeps positions L .. L + a, and x_a is its next input.

For a greedy request that is "the longest prefix equal to the target's argmax". For a
sampled one it is rejection sampling (Leviathan et al. 2023, Chen et al. 2023) with a
deterministic draft, q = one-hot(d_i): accept d_i with probability min(1, p(d_i) /
q(d_i)) = p(d_i), else draw from the residual max(0, p - q) normalised, which is p with d_i
taken out. Drawing x_i ~ p and accepting iff x_i = d_i does exactly that with one uniform
(P[accept] = p(d_i); given a rejection, x_i is distributed as p without d_i), so each
emitted token is distributed as the target's sampler would have drawn it. And because the
uniform of row i is the counter-based one of its position (kernels/sampling.py), the tokens
are the very ones the request draws without speculation: speculation changes how many
forwards produce them, never which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# per entry of a round's speculation statistics: proposals checked, accepted, shadow
SPEC_STATS = 3


@dataclass(frozen=True)
class SpecBuffers:
    """The device-side state of speculating sessions, one row per token-buffer slot, owned
    by the dispatcher's control thread and touched only by rounds on the compute stream."""

    lengths: Any  # DeviceBuffer, int32 [slots]: positions holding accepted KV
    history: Any  # DeviceBuffer, int32 [slots, context + 1]: tokens by position
    proposals: Any  # DeviceBuffer, int32 [slots, 1 + k_max]: a round's count, then tokens
    firsts: Any  # DeviceBuffer, int32 [slots]: a round's first positions (cuda's steps)
    draft_rows: Any  # DeviceBuffer, int32 [rows, 2]: the draft model's inputs (cuda)
    slots: int
    context: int
    k_max: int
    ngram_min: int
    ngram_max: int

    @classmethod
    def alloc(cls, device: Any, slots: int, context: int, k_max: int, ngram_min: int,
              ngram_max: int, round_rows: int) -> SpecBuffers:
        return cls(device.alloc(slots * 4), device.alloc(slots * (context + 1) * 4),
                   device.alloc(slots * (1 + k_max) * 4), device.alloc(slots * 4),
                   device.alloc((round_rows + 2 * slots) * 8), slots, context, k_max,
                   ngram_min, ngram_max)

    def free(self) -> None:
        for buf in (self.lengths, self.history, self.proposals, self.firsts,
                    self.draft_rows):
            buf.free()


@dataclass(frozen=True)
class SpecSeq:
    """One speculating session's part of a round, as the device steps see it: its rows
    start at `start`; the first sampled one is its input at position `past` (-1: at
    `lengths[slot]`, which only the device knows: a decode row), then `k` draft rows.
    `propose` tokens are proposed (k; 1 with no draft rows, a shadow proposal that only
    measures; 0 for a prompt's last chunk): looked up in its history (`lookup`), else by
    the draft model (the round's draft steps). Its samples are the round's output tokens
    `out .. out + k`."""

    slot: int
    start: int
    k: int
    propose: int
    past: int
    out: int
    lookup: bool = True


def ngram_proposal(history: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """`k` tokens (int32) following the most recent earlier occurrence of the history's
    last n tokens, for the longest n in [n_min, n_max] that occurs earlier (with at least
    one token after it); empty when none does (or k is 0). The continuation is copied as
    LZ77 copies, through its own end: past the history it repeats what it has proposed,
    so a pattern of period P near the end is proposed as that pattern repeated."""
    h = np.ascontiguousarray(history, np.int32)
    size = len(h)
    if k <= 0:
        return np.zeros(0, np.int32)
    # the tokens as bytes, searched from the end by `bytes.rfind` (a match must start on a
    # token): the cpu backend runs this on the host thread every round, beside the
    # forward's threads, and numpy's sliding windows took ~0.4 ms a round there
    earlier = h[:size - 1].tobytes()  # a window here has a token after it
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = h[size - n:].tobytes()
        end = len(earlier)
        while (found := earlier.rfind(suffix, 0, end)) >= 0:
            if found % 4 == 0:
                at = found // 4 + n  # the first token copied
                period = size - at
                return h[at + np.arange(k) % period]
            end = found + len(suffix) - 1  # an earlier match, ending before this one
    return np.zeros(0, np.int32)


def accepted_run(samples: np.ndarray, drafts: np.ndarray) -> int:
    """How many of the drafts are accepted: the longest a with samples[i] == drafts[i] for
    every i < a (samples[i] is row i's token, drafts[i] the proposal row i checks)."""
    n = min(len(drafts), len(samples))
    same = np.asarray(samples[:n]) == np.asarray(drafts[:n])
    return n if same.all() else int(np.argmin(same))


def prepare_on_host(rows: np.ndarray, lengths: np.ndarray, history: np.ndarray,
                    proposals: np.ndarray, seqs: Sequence[SpecSeq], ngram_min: int,
                    ngram_max: int) -> list[int]:
    """The speculation step before a round's forward, on host arrays (the cpu backend's
    device memory): per entry, its first position (`lengths[slot]` for a decode row) and
    its prompt-lookup proposal over its history, kept in `proposals[slot]` and written
    into its draft rows' host-id column of `rows` (filler 0 past the proposal). Returns
    the first positions."""
    firsts = []
    for e in seqs:
        first = int(lengths[e.slot]) if e.past < 0 else e.past
        firsts.append(first)
        found = (ngram_proposal(history[e.slot, :first + 1], e.propose, ngram_min, ngram_max)
                 if e.lookup else np.zeros(0, np.int32))  # the draft model's come later
        proposals[e.slot, 0] = len(found)
        proposals[e.slot, 1:1 + len(found)] = found
        if e.k:
            drafts = rows[e.start + 1:e.start + 1 + e.k]
            drafts[:, 0] = 0
            drafts[:len(found), 0] = found[:e.k]
            drafts[:, 1] = -1
    return firsts


def accept_on_host(samples: np.ndarray, token_buf: np.ndarray, lengths: np.ndarray,
                   history: np.ndarray, proposals: np.ndarray, seqs: Sequence[SpecSeq],
                   counts: np.ndarray, stats: np.ndarray) -> None:
    """The acceptance after a round's sampling, on host arrays: per entry, the accepted
    run of its samples, its count (`counts[j]`) and statistics (`stats[j]`: proposals
    checked, accepted, shadow match 1 / 0 / -1 none), and its new length, history and next
    input. Run after `prepare_on_host` of the same round, whose lengths it reads again."""
    for j, e in enumerate(seqs):
        first = int(lengths[e.slot]) if e.past < 0 else e.past
        x = samples[e.out:e.out + e.k + 1]
        m = int(proposals[e.slot, 0])
        drafts = proposals[e.slot, 1:1 + min(m, e.k)]
        a = accepted_run(x, drafts)
        shadow = -1 if e.k or m == 0 else int(x[0] == proposals[e.slot, 1])
        history[e.slot, first + 1:first + a + 2] = x[:a + 1]
        lengths[e.slot] = first + a + 1
        token_buf[e.slot] = x[a]
        counts[j] = a + 1
        stats[j] = (len(drafts), a, shadow)


def draft_inputs_on_host(rows: np.ndarray, lengths: np.ndarray, history: np.ndarray,
                         seqs: Sequence[SpecSeq], step: int,
                         prefill: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """The draft model's input tokens for step `step` of a round: at step 0, the rows of
    `prefill` spans (start, n) of the round's metadata, then per decode entry the two
    tokens before and at its first position (the one before rewrites the draft's KV of the
    last accepted token, which it never computed when every draft was accepted); at step
    j > 0, per entry its draft row j (the proposal the step before made)."""
    if step == 0:
        parts = [rows[st:st + n, 0] for st, n in prefill]
        for e in seqs:
            first = int(lengths[e.slot])
            parts.append(history[e.slot, first - 1:first + 1])
        return (np.concatenate(parts) if parts else np.zeros(0, np.int32)).astype(np.int32)
    return np.array([rows[e.start + step, 0] for e in seqs], np.int32)


def draft_propose_on_host(logits: np.ndarray, rows: np.ndarray, proposals: np.ndarray,
                          seqs: Sequence[SpecSeq], step: int) -> None:
    """The draft model's proposal at step `step`: per entry the argmax of its logits row
    becomes its proposal `step` (kept in `proposals[slot]`), and its draft row `step + 1`
    of the round's metadata when it has one."""
    tokens = np.argmax(np.asarray(logits), axis=1).astype(np.int32)
    for e, token in zip(seqs, tokens.tolist(), strict=True):
        proposals[e.slot, 1 + step] = token
        proposals[e.slot, 0] = step + 1
        if e.k > step:
            rows[e.start + 1 + step] = (token, -1)
