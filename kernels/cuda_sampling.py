"""The sampler on the cuda device, and the rest of a dispatcher round's work beside the
forward that concerns sampling: a session's penalty token counts and logit bias kept on the
device, a round's inputs counted into them, the logit bias and penalties applied to a copy
of the logits, constrained rows' allowed-token masks (uploaded per round from the host,
where the grammar is), the draw, and the sampled tokens' logprobs (kernels/cuda/sampler.cu;
the rules are kernels/sampling.py's).

`CudaSampling` holds these as methods of `CudaOps` (the sampling half of
kernels/backend.py's `RoundBackend`, which NumpyOps also satisfies), each with a `*_device`
form whose table is already on the device, which the decode graphs capture. The tables are
made here, on the host, checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from eagerlm.kernels.cuda_kernels import OpsMixin
from eagerlm.kernels.device_tensor import DeviceIds, DeviceTensor, check_tensor
from eagerlm.kernels.sampling import (
    MAX_LOGPROBS,
    POSITION_LIMIT,
    SamplingParams,
    TokenCounts,
    dense_logit_bias,
    mask_words,
)

# Mirror `struct SampleParams`, `struct PenaltyRow` and `struct CountSpan`
# (kernels/cuda/sampler.cu); tests/test_kernel_build.py checks SAMPLE_PARAMS.
SAMPLE_PARAMS = np.dtype([("temperature", "<f4"), ("top_k", "<i4"), ("top_p", "<f4"),
                          ("min_p", "<f4"), ("seed", "<u8"), ("position", "<i8")])
PENALTY_ROW = np.dtype([("counts", "<u8"), ("bias", "<u8"), ("repetition", "<f4"),
                        ("presence", "<f4"), ("frequency", "<f4"), ("pad", "<i4")])
COUNT_SPAN = np.dtype([("counts", "<u8"), ("start", "<i4"), ("n", "<i4"), ("split", "<i4"),
                       ("pad", "<i4")])
SAMPLER_THREADS = 1024  # sample_rows is written for exactly this block size


class CudaSampling(OpsMixin):
    """The sampling methods of CudaOps (a mixin: they enqueue on the ops' stream with its
    `upload`, `empty` and `kernels`)."""

    if TYPE_CHECKING:
        def draw_positions(self, table: DeviceTensor, positions_at: Any, n: int) -> None: ...

    # -- a round's sampling, as the dispatcher asks for it -------------------------------

    def token_counts(self, vocab: int, prompt: Sequence[int],
                     output: Sequence[int]) -> DeviceTensor:
        """A session's token counts for the penalties, int32 [2, vocab] (prompt counts,
        output counts), built from host tokens: when its counts must be (re)built. From
        then on `count_inputs` keeps them on the device, where the sampled tokens are."""
        host = TokenCounts.of(vocab, prompt, output)
        return self.upload(np.stack([host.prompt, host.output]))

    def count_inputs(self, tokens: DeviceIds,
                     spans: Sequence[tuple[DeviceTensor, int, int, int]]) -> None:
        """Add a round's input tokens to their sessions' counts: per span (counts, first
        row, rows, rows still in the prompt), one block of count_tokens."""
        if spans:
            self.count_inputs_device(tokens, self.upload(count_table(spans).view(np.uint8)),
                                     len(spans), spans[0][0].shape[1])

    def count_inputs_device(self, tokens: DeviceIds, table: DeviceTensor, n_spans: int,
                            vocab: int) -> None:
        """`count_inputs` with its span table (COUNT_SPAN rows) already on the device."""
        self.kernels["count_tokens"].launch(self._s, n_spans, 256, table.ptr, tokens.rows_ptr,
                                            tokens.stride, tokens.token_buf_ptr, vocab)

    def logit_bias(self, params: SamplingParams, vocab: int) -> DeviceTensor:
        """A session's logit bias on the device, uploaded once per session: float32
        [vocab] (`dense_logit_bias`), which penalize_rows adds to its rows."""
        return self.upload(dense_logit_bias(params, vocab))

    def sample_round(self, logits: DeviceTensor, params: Sequence[SamplingParams],
                     positions: Sequence[int], counts: Sequence[DeviceTensor | None],
                     biases: Sequence[DeviceTensor | None], *,
                     out: Any, token_buf: Any, out_slots: Sequence[int],
                     logprobs_out: tuple[Any, Any] | None = None,
                     masks: Sequence[np.ndarray | None] | None = None,
                     first_row: int = 0, positions_at: Any = None) -> None:
        """NumpyOps.sample_round on the device: logit bias and penalties, the masks, the
        draw, logprobs; rows `first_row ..` of the logits, into the same rows of `out` and
        the logprob buffers. With `positions_at` = (the batch's row positions on the
        device, each sampled row's batch row), the draws' positions are taken from them."""
        n, vocab = len(params), logits.shape[1]
        if first_row or n != logits.shape[0]:
            logits = logits.view_at(first_row * vocab * 4, (n, vocab), "f32")
        slots = self.upload(np.asarray(out_slots, dtype=np.int32), "i32")
        sampled = DeviceTensor(out.ptr + first_row * 4, (n,), "i32")
        self.sample(logits, params, positions, counts=counts, biases=biases, out=sampled,
                    token_buf=token_buf.ptr, out_slots=slots, masks=masks,
                    positions_at=positions_at)
        if logprobs_out is not None:
            cols = 1 + MAX_LOGPROBS
            self.token_logprobs(logits, sampled, [p.logprobs for p in params],
                                values=logprobs_out[0].ptr + first_row * cols * 4,
                                top_ids=logprobs_out[1].ptr + first_row * MAX_LOGPROBS * 4)

    # -- the steps, also launched by the decode graphs -----------------------------------

    def sample(self, logits: DeviceTensor, params: Sequence[SamplingParams],
               positions: Sequence[int], *,
               counts: Sequence[DeviceTensor | None] | None = None,
               biases: Sequence[DeviceTensor | None] | None = None,
               out: DeviceTensor | None = None, token_buf: int = 0,
               out_slots: DeviceTensor | None = None,
               masks: Sequence[np.ndarray | None] | None = None,
               positions_at: Any = None) -> DeviceTensor:
        """One token per row of float32 `logits` [n, vocab] (kernels/sampling.py's rules),
        written to `out` (int32 [n]) and, for rows whose `out_slots` entry is >= 0, to
        `token_buf[slot]`. Rows whose params are penalized need `counts[i]` (from
        `token_counts`); rows with a logit bias take `biases[i]` (from `logit_bias`), or
        have it uploaded here; rows with `masks[i]` (host int32 bitmasks) draw only among
        the tokens it allows. A row that cannot be sampled (NaN logits) gets -1. With
        `positions_at` the draws' positions come from the device (`draw_positions`)."""
        check_tensor(logits, "f32", "logits")
        n, vocab = logits.shape
        if len(params) != n or len(positions) != n:
            raise ValueError(f"{n} logit rows need {n} params and positions")
        table = sample_table(params, positions, vocab)
        adjusted = any(p.adjusts_logits for p in params)
        if adjusted:
            logits = self.penalize(logits, params, counts, biases)
        if masks is not None and any(m is not None for m in masks):
            logits = self.mask(logits, masks, in_place=adjusted)
        if out is None:
            out = self.empty((n,), "i32")
        device_table = self.upload(table.view(np.uint8), "u8")
        if positions_at is not None:
            self.draw_positions(device_table, positions_at, n)
        self.sample_device(logits, device_table, out=out, token_buf=token_buf,
                           out_slots=out_slots)
        return out

    def penalize(self, logits: DeviceTensor, params: Sequence[SamplingParams],
                 counts: Sequence[DeviceTensor | None] | None,
                 biases: Sequence[DeviceTensor | None] | None = None) -> DeviceTensor:
        """A copy of `logits` with each row's logit bias and penalties applied
        (sampling.adjust_logits): the raw logits stay for the logprobs. A biased row
        without its entry in `biases` has its bias uploaded here."""
        vocab = logits.shape[1]
        biases = [b if b is not None or not p.logit_bias else self.logit_bias(p, vocab)
                  for p, b in zip(params, biases or [None] * len(params), strict=True)]
        table = penalty_table(params, counts, biases, vocab)
        return self.penalize_device(logits, self.upload(table.view(np.uint8)))

    def mask(self, logits: DeviceTensor, masks: Sequence[np.ndarray | None], *,
             in_place: bool = False) -> DeviceTensor:
        """`logits` with each masked row's disallowed tokens at -inf (mask_rows): a copy,
        so the raw logits stay for the logprobs, unless `in_place` (they are already a
        copy). The round's masks are uploaded in one table; rows without one are copied."""
        n, vocab = logits.shape
        which, table = mask_table(masks, vocab)
        out = logits if in_place else self.empty((n, vocab), "f32")
        self.mask_device(logits, self.upload(table), self.upload(which), out=out)
        return out

    def mask_device(self, logits: DeviceTensor, table: DeviceTensor, which: DeviceTensor, *,
                    out: DeviceTensor) -> None:
        """`mask` with its table (int32 [masks, words]) and row index already on the
        device: the form a decode graph would capture."""
        n, vocab = logits.shape
        self.kernels["mask_rows"].launch(
            self._s, (min(-(-vocab // 2048), 128), n, 1), 256, out.ptr, logits.ptr, vocab,
            table.ptr, table.shape[1], which.ptr)

    def penalize_device(self, logits: DeviceTensor, table: DeviceTensor) -> DeviceTensor:
        """`penalize` with its table (PENALTY_ROW per row) already on the device."""
        n, vocab = logits.shape
        out = self.empty((n, vocab), "f32")
        self.kernels["penalize_rows"].launch(
            self._s, (min(-(-vocab // 2048), 128), n, 1), 256, out.ptr, logits.ptr, vocab,
            table.ptr)
        return out

    def token_logprobs(self, logits: DeviceTensor, tokens: DeviceTensor,
                       want: Sequence[int | None], *, values: int, top_ids: int) -> None:
        """Each row's sampled-token logprob and its `want[i]` best alternatives (None: the
        row is skipped), from the raw logits, into float32 `values` [n, 1 + MAX_LOGPROBS]
        and int32 `top_ids` [n, MAX_LOGPROBS] (NumpyOps.sample_round's layout)."""
        self.token_logprobs_device(logits, tokens, self.upload(logprob_table(want)),
                                   values=values, top_ids=top_ids)

    def token_logprobs_device(self, logits: DeviceTensor, tokens: DeviceTensor,
                              want: DeviceTensor, *, values: int, top_ids: int) -> None:
        """`token_logprobs` with `want` (int32 per row, -1 = none) already on the device."""
        n, vocab = logits.shape
        self.kernels["token_logprobs"].launch(
            self._s, n, SAMPLER_THREADS, values, top_ids, logits.ptr, vocab, vocab,
            tokens.ptr, want.ptr, MAX_LOGPROBS)

    def sample_device(self, logits: DeviceTensor, table: DeviceTensor, *, out: DeviceTensor,
                      token_buf: int = 0, out_slots: DeviceTensor | None = None) -> None:
        """`sample` with its parameter table (SAMPLE_PARAMS rows) already on the device."""
        n, vocab = logits.shape
        self.kernels["sample_rows"].launch(
            self._s, n, SAMPLER_THREADS, out.ptr, token_buf,
            out_slots.ptr if out_slots is not None else 0, logits.ptr, vocab, vocab, table.ptr)


def sample_table(params: Sequence[SamplingParams], positions: Sequence[int],
                 vocab: int) -> np.ndarray:
    """The sampler's per-row parameters (SAMPLE_PARAMS), checked. (The logit bias and
    penalties are not in it: `CudaOps.penalize` applies them to the logits first.)"""
    table = np.zeros(len(params), SAMPLE_PARAMS)
    for i, (p, pos) in enumerate(zip(params, positions, strict=True)):
        if not p.greedy and p.seed is None:
            raise ValueError(f"params[{i}] has temperature > 0 but no seed; resolve it "
                             f"once per request with SamplingParams.resolve_seed()")
        if not 0 <= pos < POSITION_LIMIT:
            raise ValueError(f"positions[{i}] must be in [0, 2**63), got {pos}")
        # top_k >= vocab is off, as 0 is; clamped so a huge one fits the int32 field
        table[i] = (p.temperature, min(p.top_k, vocab), p.top_p, p.min_p, p.seed or 0,
                    pos)
    return table


def penalty_table(params: Sequence[SamplingParams],
                  counts: Sequence[DeviceTensor | None] | None,
                  biases: Sequence[DeviceTensor | None] | None, vocab: int) -> np.ndarray:
    """penalize_rows' per-row table (PENALTY_ROW), checked: a penalized row needs its
    session's counts, int32 [2, vocab], a biased row its bias, float32 [vocab]; other rows
    get neither (copied unchanged)."""
    table = np.zeros(len(params), PENALTY_ROW)
    for i, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        c = None if counts is None or not p.penalized else counts[i]
        if p.penalized:
            if c is None:
                raise ValueError(f"params[{i}] has penalties but no token counts were given")
            check_tensor(c, "i32", f"counts[{i}]")
            if c.shape != (2, vocab):
                raise ValueError(f"counts[{i}] must be [2, {vocab}], got {c.shape}")
        b = None if biases is None or not p.logit_bias else biases[i]
        if p.logit_bias:
            if b is None:
                raise ValueError(f"params[{i}] has a logit bias but no bias was given")
            check_tensor(b, "f32", f"biases[{i}]")
            if b.shape != (vocab,):
                raise ValueError(f"biases[{i}] must be [{vocab}], got {b.shape}")
        table[i] = (0 if c is None else c.ptr, 0 if b is None else b.ptr,
                    p.repetition_penalty, p.presence_penalty, p.frequency_penalty, 0)
    return table


def mask_table(masks: Sequence[np.ndarray | None], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """mask_rows' row index (int32 per row: its mask's row in the table, -1 none) and table
    (int32 [masks, mask_words(vocab)]), checked."""
    words = mask_words(vocab)
    which = np.full(len(masks), -1, np.int32)
    given = [(i, m) for i, m in enumerate(masks) if m is not None]
    table = np.zeros((max(1, len(given)), words), np.int32)
    for k, (i, m) in enumerate(given):
        m = np.asarray(m, np.int32)
        if m.shape != (words,):
            raise ValueError(f"masks[{i}] must be int32 [{words}], got {m.shape}")
        table[k], which[i] = m, k
    return which, table


def logprob_table(want: Sequence[int | None]) -> np.ndarray:
    """token_logprobs' per-row alternatives wanted (int32; -1: no logprobs for the row)."""
    return np.array([-1 if k is None else min(k, MAX_LOGPROBS) for k in want], np.int32)


def count_table(spans: Sequence[tuple[DeviceTensor | None, int, int, int]]) -> np.ndarray:
    """count_tokens' span table (COUNT_SPAN): (counts or None, first row, rows, rows still
    in the prompt) per session; a span without counts is skipped by the kernel."""
    table = np.zeros(len(spans), COUNT_SPAN)
    for i, (counts, start, n, split) in enumerate(spans):
        if counts is not None:
            check_tensor(counts, "i32", "token counts")
        table[i] = (0 if counts is None else counts.ptr, start, n, split, 0)
    return table
