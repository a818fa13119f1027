"""The numpy reference implementation of every op the model forward uses.

This is the cpu backend's compute and the specification the CUDA kernels are tested
against, so each op is written for clarity first: float32 in, float32 out, accumulation in
float32 (BLAS), no in-place tricks that hide what is computed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from eagerlm.kernels import cpu_moe, speculative
from eagerlm.kernels import cpu_row_ops as row_ops
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cpu_attention import DecodeRows
from eagerlm.kernels.cpu_decode_program import TABLE_READY, DecodeProgram, record
from eagerlm.kernels.cpu_row_kernel import FIXED_ORDER_ROWS, float32_rows
from eagerlm.kernels.cpu_threads import SERIAL_MAX_VALUES, by_output_features, by_rows
from eagerlm.kernels.quantized import QuantizedMatrix, quantized_linear
from eagerlm.kernels.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    TokenCounts,
    dense_logit_bias,
    sample,
    token_logprob,
)
from eagerlm.loader.config import (
    Activation,
    MoEConfig,
    RopeParams,
    RopeStyle,
)
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout, TokenMajorKV

if TYPE_CHECKING:
    from eagerlm.kernels.host_collective import HostCollective
    from eagerlm.kernels.model import Transformer
    from eagerlm.loader.weights import MoEWeights
    from eagerlm.vmm.device import DeviceBuffer, HostBuffer, Stream
    from eagerlm.vmm.kv_region import KVRegion

# NumpyOps.round_cost: (rows, the round's time over a one-row round's), measured on the demo
# model's engine rounds (forward, sampling, acceptance; 2, 3 and 6 rows by the forward alone:
# the plan had never chosen them), docs/performance.md 2026-11-28; linear in between, and
# past the last point at the last segment's slope
ROUND_COST = ((1, 1.0), (2, 1.55), (3, 2.26), (4, 2.5), (6, 3.25), (8, 4.34), (12, 6.0),
              (16, 7.75), (24, 13.0), (40, 20.1))


# looked up, not interpolated, up to the last point: a plan prices every candidate draft
# row of every session each round (3.5 us a call interpolated); past it, the last slope
_COST_ROWS, _COSTS = zip(*ROUND_COST, strict=True)
_ROUND_COSTS = tuple(np.interp(np.arange(_COST_ROWS[-1] + 1), _COST_ROWS, _COSTS).tolist())
_COST_SLOPE = (_COSTS[-1] - _COSTS[-2]) / (_COST_ROWS[-1] - _COST_ROWS[-2])


def _attend(s: SeqSlice, layer: int, q: np.ndarray, out: np.ndarray, scale: np.float32,
            window: int, sinks: np.ndarray | None, a: int, b: int) -> None:
    """Query rows a .. b of session s (positions n_past + a ..) over the keys they see;
    `sinks` (one logit per query head) join each head's softmax without a value."""
    n_heads, hd = q.shape[1:]
    first, last = s.n_past + a, s.n_past + b  # query positions first .. last - 1
    lo = max(0, first - window + 1) if window else 0
    keys = s.kv.k(layer)[lo:last]  # [L, kv, hd]
    vals = s.kv.v(layer)[lo:last]
    n_kv = keys.shape[1]
    g = n_heads // n_kv
    n = b - a
    qs = q[s.start + a:s.start + b].reshape(n, n_kv, g, hd).transpose(1, 2, 0, 3)
    qs = qs.reshape(n_kv, g * n, hd) * scale
    scores = qs @ keys.transpose(1, 2, 0)  # [kv, g*n, L]
    qpos = np.arange(first, last)[:, None]
    kpos = np.arange(lo, last)[None, :]
    visible = kpos <= qpos
    if window:
        visible &= (qpos - kpos) < window
    scores = scores.reshape(n_kv, g, n, -1)
    scores = np.where(visible[None, None], scores, np.float32(-np.inf))
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.reshape(n_kv, g, 1, 1).astype(np.float32)
        top = np.maximum(top, sink)
    p = np.exp(scores - top)
    total = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sink - top)
    p /= total
    o = p.reshape(n_kv, g * n, -1) @ vals.transpose(1, 0, 2)  # [kv, g*n, hd]
    out[s.start + a:s.start + b] = o.reshape(n_kv, g, n, hd).transpose(2, 0, 1, 3).reshape(
        n, n_heads, hd)


def _float_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w^T, its output features split over the cores (BLAS itself runs on one thread:
    kernels/cpu_threads.py says why); up to `FIXED_ORDER_ROWS` rows of float32 x, by the
    decode replay's own float32 row kernel (each row the same bits in any batch)."""
    (n, in_features), out_features = x.shape, w.shape[0]
    n_values = n * out_features * in_features
    if (n <= FIXED_ORDER_ROWS and x.dtype == np.float32 and w.dtype == np.float32
            and w.flags.c_contiguous):
        xc = np.ascontiguousarray(x)
        out = np.empty((n, out_features), np.float32)
        by_output_features(n_values, out_features,
                           lambda a, b: float32_rows(xc, w, out, a, b))
        return out
    if n_values < SERIAL_MAX_VALUES:
        return x @ w.T  # one thread, without the output buffer the shares write into
    y = np.empty((n, out_features), np.result_type(x, w))

    def part(a: int, b: int) -> None:
        np.matmul(x, w[a:b].T, out=y[:, a:b])
    by_output_features(n_values, out_features, part)
    return y


def _host_view(buf: DeviceBuffer, dtype: type[np.generic] = np.int32) -> np.ndarray:
    """A device buffer's contents: on the cpu device, device memory is host memory
    (vmm/cpu_device.py's HostArray)."""
    return cast("HostBuffer", buf).array.view(dtype)


# the ops of kernels/model.py's forward (`Ops`), which the decode replay records (and
# benchmarks/profile_cpu_decode.py times; `_rope_table` is the rope op's helper)
FORWARD_OPS = ("embed", "rms_norm", "add_rms_norm", "linear", "gated_ffn_act", "moe_ffn",
                "softcap", "all_reduce", "all_gather", "rows", "rope", "kv_append",
                "attention", "_rope_table")


class NumpyOps:
    """Ops over numpy arrays. Activations are `[tokens, features]` float32; matrices are
    float32 arrays or `QuantizedMatrix` blocks. It is the cpu backend's whole `Backend`
    (kernels/backend.py)."""

    name = "cpu"
    kv_dtype = np.dtype(np.float32)  # the KV cache element
    stream: Stream | None = None  # it computes when called, on the dispatcher's own stream

    def __init__(self, collective: HostCollective | None = None) -> None:
        # rope setting -> (positions, cos, sin) of its last table (`_rope_table`)
        self._rope_memo: dict[tuple[RopeParams, int],
                              tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # this device's end of its tensor-parallel group (kernels/host_collective.py);
        # None alone
        self.collective = collective
        # (transformer, rows of a batch of decode rows) -> its recorded forward, or None
        # where the forward cannot be recorded (kernels/cpu_decode_program.py)
        self._programs: dict[tuple[int, int], DecodeProgram | None] = {}
        # the transformer each was recorded for (an id can be reused once it is gone)
        self._owners: weakref.WeakValueDictionary[tuple[int, int], Transformer] = \
            weakref.WeakValueDictionary()

    # -- one session outside the dispatcher ---------------------------------------------

    def contiguous_kv(self, layout: KVLayout, capacity: int) -> ContiguousKV:
        """A single session's cache in one allocation (sequential loop, perplexity)."""
        return ContiguousKV(dataclasses.replace(layout, dtype=self.kv_dtype), capacity)

    def to_numpy(self, t: np.ndarray) -> np.ndarray:
        """The array itself: it is on the host already."""
        return np.asarray(t)

    # -- what the dispatcher's rounds need beside the forward (RoundBackend) ------------

    def session_kv(self, region: KVRegion) -> TokenMajorKV:
        """A session's KV as the ops read it: a view taken now, at launch, so the work on
        the stream sees fixed arrays while the control thread maps pages ahead."""
        return TokenMajorKV(region.tokens())

    def round_inputs(self, rows: DeviceBuffer, n_rows: int,
                     token_buf: DeviceBuffer) -> np.ndarray:
        """A round's token ids from its metadata rows `[host id, token-buffer slot or -1]`:
        decode inputs are read from the token buffer the previous round's sampler wrote."""
        meta = _host_view(rows)[: 2 * n_rows].reshape(n_rows, 2)
        buf = _host_view(token_buf)
        return np.where(meta[:, 1] >= 0, buf[np.maximum(meta[:, 1], 0)],
                        meta[:, 0]).astype(np.int32)

    def token_counts(self, vocab: int, prompt: Sequence[int],
                     output: Sequence[int]) -> TokenCounts:
        """A session's token counts for the penalties, built from its tokens so far (when
        they must be rebuilt); `count_inputs` then keeps them up to date round by round."""
        return TokenCounts.of(vocab, prompt, output)

    def count_inputs(self, tokens: np.ndarray,
                     spans: Sequence[tuple[TokenCounts, int, int, int]]) -> None:
        """Add a round's input tokens (`round_inputs`' result) to their sessions' counts:
        per span (counts, first row, rows, how many of them are still in the prompt)."""
        ids = np.asarray(tokens)
        for counts, start, n, split in spans:
            counts.add(ids[start:start + split], as_output=False)
            counts.add(ids[start + split:start + n], as_output=True)

    def logit_bias(self, params: SamplingParams, vocab: int) -> np.ndarray:
        """A session's logit bias in the sampler's form, made once per session: float32
        [vocab] (`dense_logit_bias`)."""
        return dense_logit_bias(params, vocab)

    def sample_round(self, logits: np.ndarray, params: Sequence[SamplingParams],
                     positions: Sequence[int], counts: Sequence[TokenCounts | None],
                     biases: Sequence[np.ndarray | None], *,
                     out: DeviceBuffer, token_buf: DeviceBuffer, out_slots: Sequence[int],
                     logprobs_out: tuple[DeviceBuffer, DeviceBuffer] | None = None,
                     masks: Sequence[np.ndarray | None] | None = None,
                     first_row: int = 0, positions_at: Any = None) -> None:
        """Sample one token per row into `out` and into the token buffer at `out_slots`;
        rows with penalties need their `counts`, rows with a logit bias their `biases`
        (from `logit_bias`), constrained rows their allowed-token `masks`. With
        `logprobs_out`, also each row's logprobs (rows whose params ask for them). The
        rows are `logits[first_row:first_row + len(params)]`, and so are their places in
        `out` and the logprob buffers. (`positions_at` is for backends whose positions only
        the device knows; here `positions` are exact, kernels/speculative.py.)"""
        n = len(params)
        logits = np.asarray(logits, dtype=np.float32)[first_row:first_row + n]
        tokens = sample(logits, params, positions, counts, biases, masks).astype(np.int32)
        slots = np.asarray(out_slots, np.int64)
        keep = slots >= 0  # as the device sampler: a negative slot writes no token buffer row
        _host_view(token_buf)[slots[keep]] = tokens[keep]
        _host_view(out)[first_row:first_row + n] = tokens
        if logprobs_out is None:
            return
        values = _host_view(logprobs_out[0], np.float32).reshape(-1, 1 + MAX_LOGPROBS)
        top_ids = _host_view(logprobs_out[1]).reshape(-1, MAX_LOGPROBS)
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            lp = token_logprob(logits[i], int(tokens[i]), p.logprobs)
            values[first_row + i, 0] = lp.logprob
            for j, (tid, v) in enumerate(lp.top):
                values[first_row + i, 1 + j] = v
                top_ids[first_row + i, j] = tid

    def round_cost(self, rows: int) -> float:
        """A round of `rows` rows relative to one of one row (dispatch/speculation.py),
        from `ROUND_COST`. On this backend each row of x costs its multiply-adds: about
        0.45 of a one-row round per row, a little less from one to four (the kernels take
        four rows of x per pass over each decoded weight row). An earlier model, steps of
        0.85 per four rows fitted to forwards of up to 12 rows, priced 8 rows at 2.7
        one-row rounds against the 4.3 measured, and 8 requests lost 10-20% to drafts that
        did not pay."""
        if rows <= 1:
            return 1.0
        if rows < len(_ROUND_COSTS):
            return _ROUND_COSTS[rows]
        return _ROUND_COSTS[-1] + (rows - _COST_ROWS[-1]) * _COST_SLOPE

    def spec_prepare(self, meta: DeviceBuffer, buffers: speculative.SpecBuffers,
                     seqs: Sequence[speculative.SpecSeq]) -> list[int]:
        """Speculating sessions' first positions (a decode row's from `buffers.lengths`)
        and prompt-lookup proposals, written into their draft rows of the round's metadata
        (kernels/speculative.py's `prepare_on_host`, on this backend's host memory)."""
        b = buffers
        return speculative.prepare_on_host(
            _host_view(meta).reshape(-1, 2), _host_view(b.lengths),
            _host_view(b.history).reshape(b.slots, -1),
            _host_view(b.proposals).reshape(b.slots, -1), seqs, b.ngram_min, b.ngram_max)

    def spec_positions(self, batch: ForwardBatch, buffers: speculative.SpecBuffers,
                       past_of: Sequence[tuple[int, int] | None]) -> None:
        """Never needed here: `spec_prepare` gives the host the positions."""
        raise NotImplementedError("the cpu backend's positions are known on the host")

    def spec_accept(self, out: DeviceBuffer, token_buf: DeviceBuffer,
                    buffers: speculative.SpecBuffers, seqs: Sequence[speculative.SpecSeq],
                    counts_at: int, stats_at: int) -> None:
        """Speculating sessions' accepted runs after the round's sampling: counts and
        statistics into `out` (int32 offsets `counts_at`, `stats_at`), new lengths,
        histories and next inputs (`accept_on_host`)."""
        b, o = buffers, _host_view(out)
        n = len(seqs)
        speculative.accept_on_host(
            o, _host_view(token_buf), _host_view(b.lengths),
            _host_view(b.history).reshape(b.slots, -1),
            _host_view(b.proposals).reshape(b.slots, -1), seqs, o[counts_at:counts_at + n],
            o[stats_at:stats_at + n * speculative.SPEC_STATS].reshape(n, -1))

    def draft_inputs(self, meta: DeviceBuffer, buffers: speculative.SpecBuffers,
                     seqs: Sequence[speculative.SpecSeq], step: int,
                     prefill: Sequence[tuple[int, int]] = ()) -> np.ndarray:
        """The draft model's input tokens at `step` of a round (`draft_inputs_on_host`)."""
        b = buffers
        return speculative.draft_inputs_on_host(
            _host_view(meta).reshape(-1, 2), _host_view(b.lengths),
            _host_view(b.history).reshape(b.slots, -1), seqs, step, prefill)

    def draft_propose(self, logits: np.ndarray, meta: DeviceBuffer,
                      buffers: speculative.SpecBuffers, seqs: Sequence[speculative.SpecSeq],
                      step: int) -> None:
        """The draft model's proposals at `step`, from its logits, into the draft rows
        (`draft_propose_on_host`)."""
        b = buffers
        speculative.draft_propose_on_host(
            logits, _host_view(meta).reshape(-1, 2),
            _host_view(b.proposals).reshape(b.slots, -1), seqs, step)

    def decode_graphs(self, transformer: Transformer, token_buf: DeviceBuffer, *,
                      max_batch: int, max_context: int, layout: KVLayout,
                      enabled: bool = True) -> None:
        """None: every round runs eagerly (a numpy round has no launches to replay)."""
        return None

    # -- elementwise and norms --------------------------------------------------------

    def embed(self, table: np.ndarray | QuantizedMatrix, ids: np.ndarray,
              scale: float) -> np.ndarray:
        """Rows `ids` of the table times `scale`; a quantized table's rows are dequantized
        as they are looked up (kernels/quantized.py)."""
        if isinstance(table, QuantizedMatrix):
            x = table.take(ids)
            return x * np.float32(scale) if scale != 1.0 else x
        x = table[ids]
        return x * np.float32(scale) if scale != 1.0 else x.copy()

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x / sqrt(mean(x^2) + eps) * w over the last axis (also per head for QK-norm),
        compiled (kernels/cpu_row_ops.py). One thread: split over the cores, a 128-token
        prefill's norms took twice as long (each thread's Python between numpy's loops
        waited for the GIL)."""
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty_like(x)
        d = x.shape[-1]
        row_ops.rms_norm(x.reshape(-1, d), w, eps, out.reshape(-1, d))
        return out

    def add_rms_norm(self, residual: np.ndarray, x: np.ndarray, w: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray]:
        """residual + x, and its RMS norm: the fused step between two sub-layers."""
        residual = np.ascontiguousarray(residual, np.float32)
        x = np.ascontiguousarray(x, np.float32)
        h, out = np.empty_like(x), np.empty_like(x)
        row_ops.add_rms_norm(residual, x, w, eps, h, out)
        return h, out

    def linear(self, x: np.ndarray, w: np.ndarray | QuantizedMatrix,
               bias: np.ndarray | None = None) -> np.ndarray:
        """x @ w^T with w stored (out_features, in_features), as GGUF stores it: a float32
        array, or the file's blocks (kernels/quantized.py's compiled kernels)."""
        y = quantized_linear(x, w) if isinstance(w, QuantizedMatrix) else _float_linear(x, w)
        return y + bias if bias is not None else y

    def gated_ffn_act(self, gate: np.ndarray, up: np.ndarray, act: Activation) -> np.ndarray:
        """act(gate) * up: SwiGLU, GeGLU and gpt-oss's clamped SwiGLU, compiled
        (kernels/cpu_row_ops.py's `gated`, the decode replay's too: the same bits on both
        paths); the rows split over the cores."""
        g = np.ascontiguousarray(gate, np.float32)
        u = np.ascontiguousarray(up, np.float32)
        out = np.empty(g.shape, np.float32)
        oai, gelu = act is Activation.SWIGLU_OAI, act is Activation.GEGLU

        def part(a: int, b: int) -> None:
            if oai:
                row_ops.gated_oai(g[a:b], u[a:b], out[a:b])
            else:
                row_ops.gated(g[a:b], u[a:b], gelu, out[a:b])
        by_rows(len(gate), part)
        return out

    def moe_ffn(self, x: np.ndarray, w: MoEWeights, moe: MoEConfig,
                act: Activation) -> np.ndarray:
        """The mixture-of-experts FFN of rows x: router, top-k, the chosen experts'
        products grouped by expert (kernels/cpu_moe.py)."""
        return cpu_moe.moe_ffn(self.linear, partial(self.gated_ffn_act, act=act),
                               np.ascontiguousarray(x, np.float32), w, moe)

    # -- tensor parallelism (kernels/host_collective.py) -------------------------------

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of `x` over the devices of the group, through shared host memory; `x`
        itself on a device alone."""
        return x if self.collective is None else self.collective.all_reduce(x)

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """Every device's `x` `[rows, n]` side by side along the last axis, by rank."""
        return x if self.collective is None else self.collective.all_gather(x)

    def broadcast_tokens(self, token_buf: DeviceBuffer) -> None:
        """Device 0's token buffer in every device's, through shared host memory."""
        if self.collective is None:
            return
        buf = _host_view(token_buf)
        got = self.collective.broadcast(buf, root=0)
        if self.collective.rank != 0:
            buf[:] = got

    def broadcast_round(self, rows: DeviceBuffer, n_rows: int,
                        pasts: Sequence[int] | None) -> list[int]:
        """Device 0's rows and positions on every device, through shared host memory."""
        meta = _host_view(rows)[:2 * n_rows]
        if self.collective is None:
            assert pasts is not None
            return list(pasts)
        mine = np.concatenate([meta, np.asarray(pasts if pasts is not None else [],
                                                np.int32)]).astype(np.int32)
        got = self.collective.broadcast(mine, root=0)
        if self.collective.rank != 0:
            meta[:] = got[:2 * n_rows]
        return [int(p) for p in got[2 * n_rows:]]

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return np.tanh(x / np.float32(cap)) * np.float32(cap)

    def rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    # -- rotary embedding ------------------------------------------------------------

    def rope(self, x: np.ndarray, positions: np.ndarray, rope: RopeParams,
             freq_factors: np.ndarray | None = None) -> np.ndarray:
        """Rotate the first `rope.dim` dims of each head of x `[T, heads, head_dim]`.

        Pair i at position p turns by theta_e = p * base^(-2i / dim) / factor_i
        extrapolated, freq_scale * theta_e interpolated, and with YaRN (ext_factor != 0) a
        per-pair blend of the two along the ramp between the correction dims; cos and sin
        are scaled by mscale (see `RopeParams`). Angles in float64, cos and sin rounded to
        float32, the rotation float32 (compiled, kernels/cpu_row_ops.py): the pairs are
        (i, i + dim / 2) in NEOX style, (2i, 2i + 1) in NORM style.
        """
        cos, sin = self._rope_table(positions, rope, freq_factors)
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty_like(x)
        row_ops.rope(x, cos.reshape(len(x), -1), sin.reshape(len(x), -1), rope.dim,
                     rope.style is RopeStyle.NEOX, out)
        return out

    def _rope_table(self, positions: np.ndarray, rope: RopeParams,
                    freq_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin `[T, 1, dim / 2]` for these positions. The last table of each rope
        setting is kept: q and k of a layer, and every layer with the same setting, turn
        by the same angles, and their float64 cos and sin were 6% of a 128-token prefill
        of the demo model."""
        key = (rope, id(freq_factors))
        hit = self._rope_memo.get(key)
        if hit is not None and np.array_equal(hit[0], positions):
            return hit[1], hit[2]
        dim = rope.dim
        half = dim // 2
        pair = np.arange(half, dtype=np.float64)
        inv_freq = rope.base ** (-pair * 2.0 / dim)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        extrap = positions.astype(np.float64)[:, None] * inv_freq[None, :]
        theta = rope.freq_scale * extrap
        if rope.ext_factor != 0.0:
            low, high = rope.corr_dims()
            ramp = 1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)
            mix = ramp * rope.ext_factor
            theta = theta * (1.0 - mix) + extrap * mix
        mscale = rope.mscale
        cos = (np.cos(theta) * mscale).astype(np.float32)[:, None, :]
        sin = (np.sin(theta) * mscale).astype(np.float32)[:, None, :]
        self._rope_memo[key] = (np.array(positions, copy=True), cos, sin)
        return cos, sin

    # -- the forward in one call ------------------------------------------------------

    def replay(self, transformer: Transformer, batch: ForwardBatch) -> np.ndarray | None:
        """A batch of n rows whose logits are all wanted (every session one new row, or
        a speculative round's verification rows: a session's rows, each at its own
        position, attend as rows alone do), or at least half of them (a draft model's
        first forward of a round: every row's, then those), from the recording of the
        first such forward
        (kernels/cpu_decode_program.py: one compiled call instead of ~16 per layer; on a
        device of a tensor-parallel group, one between each two of its collectives); None
        for any other batch, ops whose class changes one of these ops' arithmetic (a
        test's reference, which the recording would bypass), a model the recording cannot
        express, or while the table's kernel is still compiling in the background
        (`TABLE_READY`, kernels/cpu_compile.py). The devices of a group decide alike: the
        same batch, the same model's shares."""
        if not self._own_ops() or not TABLE_READY.is_set():
            return None
        decode = DecodeRows.of(batch)
        n = len(batch.tokens)
        if decode is None or len(decode.rows) != n or not np.array_equal(decode.rows,
                                                                          np.arange(n)):
            return None
        wanted = batch.logit_rows
        if not np.array_equal(wanted, np.arange(n)):
            # at least half the rows' logits wanted (a draft model's first forward of a
            # round: two rows a session, the last's): every row's, then those, costs
            # less than the forward op by op (prompts, one row wanted, never come here)
            if len(wanted) == 0 or 2 * len(wanted) < n or wanted.min() < 0 \
                    or wanted.max() >= n:
                return None
            logits = self.replay(transformer, ForwardBatch(batch.tokens, batch.seqs,
                                                           np.arange(n, dtype=np.int64)))
            return None if logits is None else logits[wanted]
        key = (id(transformer), n)
        if key not in self._programs or self._owners.get(key) is not transformer:
            self._programs[key] = record(transformer, batch, decode, self.collective)
            self._owners[key] = transformer
        program = self._programs[key]
        if program is None or program.layout != (decode.n_layers, decode.kv_dim):
            return None
        return program.run(self, batch, decode)

    @classmethod
    def _own_ops(cls) -> bool:
        """Whether every op of the forward is NumpyOps' own (what RecordingOps mirrors)."""
        return all(getattr(cls, name) is getattr(NumpyOps, name) for name in FORWARD_OPS)

    # -- KV cache and attention ------------------------------------------------------

    def kv_append(self, batch: ForwardBatch, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write this batch's K and V `[T, kv_heads, head_dim]` at their positions: every
        row in one compiled call (kernels/cpu_attention.py), a cache it cannot address by
        slices."""
        decode = DecodeRows.of(batch)
        if decode is not None:
            decode.append(layer, k, v)
        for s in batch.seqs:
            if decode is None or s.start not in decode.starts:
                s.kv.k(layer)[s.n_past:s.n_total] = k[s.start:s.end]
                s.kv.v(layer)[s.n_past:s.n_total] = v[s.start:s.end]

    def attention(self, batch: ForwardBatch, layer: int, q: np.ndarray, *, scale: float,
                  window: int, sinks: np.ndarray | None = None) -> np.ndarray:
        """Causal GQA attention of q `[T, heads, head_dim]` over each session's cache.

        A key at position j is visible from position p when j <= p and, with a sliding
        window, p - j < window. With `sinks` (float32 [heads], gpt-oss's attention sinks)
        each head's softmax also counts that logit, which has no value: the weights of the
        keys sum to less than one. Returns `[T, heads * head_dim]`.
        """
        n_tok, n_heads, hd = q.shape
        out = np.empty((n_tok, n_heads, hd), dtype=np.float32)
        decode = DecodeRows.of(batch)
        if decode is not None:  # every row, in one compiled call
            decode.attend(layer, q, out, scale, window, sinks)
        for s in batch.seqs:  # a cache it cannot address: its rows split over the cores
            if decode is None or s.start not in decode.starts:
                by_rows(s.n_new, partial(_attend, s, layer, q, out, np.float32(scale),
                                         window, sinks), causal=True)
        return out.reshape(n_tok, n_heads * hd)
