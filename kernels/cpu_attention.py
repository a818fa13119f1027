"""KV append and attention on the cpu, compiled (numba, cached, GIL released): decode rows
and prompts' rows alike, a row's arithmetic the same wherever it is.

A decode round gives each session one new row. Done in numpy, every session costs a few
Python calls per layer (two KV slice writes, a dozen small array ops for its attention):
at 16 sessions that was 70% of a decode round of a 2-layer model and ~30 µs per session
and layer of any model, all of it holding the GIL, so the host threads that eager dispatch
overlaps with a round waited for it (or it for them). Here one call per layer writes every
row's K and V and one attends every row, whatever the session count, with the GIL
released. A prompt's rows are attended the same way, each at its own position, so that a
row's result does not depend on how its prompt was cut into rounds (`DecodeRows` says why);
its consecutive rows go in blocks of `QUERY_BLOCK` that read each key and value once (a
128-token prompt's attention took 15% less CPU, a 512-token one 33% less, than row by
row); only caches the kernels cannot address take the numpy path (kernels/numpy_ops.py).
Keys are read a tile at a time, copied out of the cache first: in the token-major cache
one layer's rows of consecutive keys are a power of two apart and share the L1 and L2
sets (2026-11-28: a 1B model's 128-token prompt attention 44 -> 24 ms, one row at a
2048-token context 17.6 -> 12.6 ms for the 16 layers).

Sessions' caches are separate regions (vmm/kv_region.py), so the kernels address them
through a table of base addresses built once per batch (`DecodeRows`) and reused by every
layer: each cache is token-major, `[capacity, n_layers, 2, n_kv_heads, head_dim]` float32
(vmm/kv_layout.py), so layer l's K of position p is at base + (p * n_layers + l) * 2 *
kv_dim floats. The table keeps the arrays it points into alive, and ForwardBatch has
already checked that every position a row touches is inside its session's capacity.

The arithmetic is `_attend`'s: scores of q * scale against the visible keys (causal, and
the sliding window where the layer has one), softmax after subtracting the row's maximum
(with the head's sink logit in it where the model has attention sinks; the exponentials
eight at a time, kernels/cpu_vector_math.py), then the weighted sum of the values; float32
sums in a different order than BLAS's, so results agree with the numpy path within float32
rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_simd import (
    lane_sums8,
    load_f32x8,
    muladd,
    prefetch,
    store_f32x8,
    zeros_f32x8,
)
from eagerlm.kernels.cpu_threads import on_cores
from eagerlm.kernels.cpu_vector_math import exp_shifted
from eagerlm.kernels.numba_settings import JIT as _JIT
from eagerlm.vmm.kv_layout import TokenMajorKV


@intrinsic
def _f32_at(typingctx, address):
    """The float32 pointer at an integer address (a session's cache base)."""
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


@njit(**_JIT)
def _append(k: np.ndarray, v: np.ndarray, rows: np.ndarray, bases: np.ndarray,
            positions: np.ndarray, layer_offset: int, token_stride: int) -> None:
    """K and V rows `rows[i]` of k, v `[T, kv_dim]` into session i's cache at
    positions[i]."""
    kv_dim = k.shape[1]
    for i in range(len(rows)):
        at = positions[i] * token_stride + layer_offset
        cache = numba.carray(_f32_at(bases[i]), (at + 2 * kv_dim,))
        for d in range(kv_dim):
            cache[at + d] = k[rows[i], d]
            cache[at + kv_dim + d] = v[rows[i], d]


QUERY_BLOCK = 16  # a prompt's consecutive rows attended together: each key read once for them
PREFETCH_KEYS = 8  # keys ahead of the one in use whose K (or V) lines are asked for
TILE_FLOATS = 4096  # a tile of K (or V) rows copied together (16 KiB: in L1 with the rest)


@njit(inline="always", **_JIT)
def _prefetch_row(cache: np.ndarray, at: int, hd: int) -> None:
    """Ask for the lines of one head's K or V row (hd floats from `at`)."""
    for d in range(0, hd, 16):
        prefetch(cache, at + d)


@njit(inline="always", **_JIT)
def _gather(tile: np.ndarray, cache: np.ndarray, at: int, stride: int, a: int, b: int,
            hd: int, span: int) -> None:
    """tile[(t - a) * span:(t - a) * span + hd] = the cache row of key t (hd floats from
    t * stride + at; `span` is hd rounded up to a multiple of 32, and the tile's floats in
    between stay the zeros `_attend_rows` wrote), t = a .. b - 1, asking for the rows
    PREFETCH_KEYS keys on as it goes. The rows of consecutive keys in a token-major
    cache lie a token apart, 64 KiB for a 16-layer model: they all fall in the same sets
    of the L1 and L2 caches, which then hold 8 of them, so the dots and sums read a tile
    copied here instead."""
    whole = hd // 8 * 8
    for t in range(a, b):
        _prefetch_row(cache, (t + PREFETCH_KEYS) * stride + at, hd)
        o = (t - a) * span
        for d in range(0, whole, 8):
            store_f32x8(tile, o + d, load_f32x8(cache, t * stride + at + d))
        for d in range(whole, hd):
            tile[o + d] = cache[t * stride + at + d]


@njit(inline="always", **_JIT)
def _scores8(qs: np.ndarray, q_at: int, cache: np.ndarray, at: int, stride: int,
             count: int, hd: int):
    """The dots of one query (qs[q_at:q_at + hd], hd a multiple of 8) with `count` (1-8)
    consecutive keys (K rows `stride` floats apart from cache offset `at`), as the lanes of
    a Float32x8: each key's dot in one chain of fused multiply-adds over its eight-float
    pieces, then `lane_sums8`. Lanes past `count` repeat the last key. A key's score is
    the same bits in any lane, beside any other keys: rows attend alike in any block."""
    last = count - 1
    o0, o1 = at, at + min(1, last) * stride
    o2, o3 = at + min(2, last) * stride, at + min(3, last) * stride
    o4, o5 = at + min(4, last) * stride, at + min(5, last) * stride
    o6, o7 = at + min(6, last) * stride, at + min(7, last) * stride
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zeros_f32x8()
    for d in range(0, hd, 8):
        x = load_f32x8(qs, q_at + d)
        a0 = muladd(x, load_f32x8(cache, o0 + d), a0)
        a1 = muladd(x, load_f32x8(cache, o1 + d), a1)
        a2 = muladd(x, load_f32x8(cache, o2 + d), a2)
        a3 = muladd(x, load_f32x8(cache, o3 + d), a3)
        a4 = muladd(x, load_f32x8(cache, o4 + d), a4)
        a5 = muladd(x, load_f32x8(cache, o5 + d), a5)
        a6 = muladd(x, load_f32x8(cache, o6 + d), a6)
        a7 = muladd(x, load_f32x8(cache, o7 + d), a7)
    return lane_sums8(a0, a1, a2, a3, a4, a5, a6, a7)


@njit(inline="always", **_JIT)
def _add_values(acc: np.ndarray, acc_at: int, weights: np.ndarray, w_at: int,
                cache: np.ndarray, v_at: int, stride: int, a: int, b: int, hd: int) -> None:
    """acc[acc_at:acc_at + hd] += weights[w_at + t] * V_t for keys t = a .. b - 1 in that
    order (V_t at cache offset t * stride + v_at; hd a multiple of 32): 32 floats of the
    sum at a time in four registers over all the keys, so that acc is read and written
    once per call, not once per key."""
    for d0 in range(0, hd, 32):
        x0, x1 = load_f32x8(acc, acc_at + d0), load_f32x8(acc, acc_at + d0 + 8)
        x2, x3 = load_f32x8(acc, acc_at + d0 + 16), load_f32x8(acc, acc_at + d0 + 24)
        for t in range(a, b):
            p = zeros_f32x8() + weights[w_at + t]
            o = t * stride + v_at + d0
            x0 = muladd(load_f32x8(cache, o), p, x0)
            x1 = muladd(load_f32x8(cache, o + 8), p, x1)
            x2 = muladd(load_f32x8(cache, o + 16), p, x2)
            x3 = muladd(load_f32x8(cache, o + 24), p, x3)
        store_f32x8(acc, acc_at + d0, x0)
        store_f32x8(acc, acc_at + d0 + 8, x1)
        store_f32x8(acc, acc_at + d0 + 16, x2)
        store_f32x8(acc, acc_at + d0 + 24, x3)


@njit(inline="always", **_JIT)
def _first_key(pos: int, window: int) -> int:
    """The first key position a query at `pos` sees (causal, and the sliding window)."""
    return max(0, pos - window + 1) if window > 0 else 0


@njit(inline="always", **_JIT)
def _tile_keys_seen(pos: int, window: int, t0: int, t1: int) -> tuple[int, int, int]:
    """A row at `pos`: its first key, and the keys a .. e - 1 of tile t0 .. t1 - 1 it sees
    (none where a >= e)."""
    row_lo = _first_key(pos, window)
    return row_lo, max(t0, row_lo), min(t1, pos + 1)


@njit(inline="always", **_JIT)
def _largest(a: np.ndarray, n: int):
    """The largest of a[0 .. n - 1] (n >= 1), by a loop: numba's `ndarray.max` compiles
    its own implementation first, 0.8 s of a cold load for the two here."""
    top = a[0]
    for i in range(1, n):
        top = max(top, a[i])
    return top


@njit(**_JIT)
def _attend_rows(q: np.ndarray, out: np.ndarray, rows: np.ndarray, bases: np.ndarray,
                 positions: np.ndarray, layer_offset: int, token_stride: int, n_kv: int,
                 scale: float, window: int, sinks: np.ndarray, use_sinks: bool, share: int,
                 shares: int) -> None:
    """out[rows[i]] = attention of q[rows[i]] `[n_heads, head_dim]` (position
    positions[i]) over its session's cached keys. A work item is a block of up to
    `QUERY_BLOCK` consecutive rows of one session (a prompt's; a decode row is a block of
    one) and one KV head: each key and value row is read once for the block's rows and the
    query heads that share it (GQA), a tile at a time copied out of the cache (`_gather`):
    the scores eight keys at a time (`_scores8`), the sums over the values 32 floats at a
    time in registers (`_add_values`). A row's arithmetic (its dots, its softmax, its sum
    over the values in key order) does not depend on the block or the tile it is in: the
    same bits alone, in a prompt, or in a decode batch.
    With `use_sinks`, head h's softmax also counts a logit sinks[h] with no value
    (attention sinks), as ggml's soft_max does. This call takes items share, share +
    shares, ... (one thread's share; interleaved, as a prompt's later rows cost more).
    (The dots and the sums over the values are explicit vectors at computed offsets:
    numba checks a computed index for wrap-around, which kept LLVM from vectorizing, and a
    row's view in the hot loop counts references: each was 2.5-6x slower.)"""
    n_heads, hd = q.shape[1], q.shape[2]
    group = n_heads // n_kv
    kv_dim = n_kv * hd
    n = len(rows)
    starts = np.empty(n + 1, np.int64)
    n_blocks = 0
    i = 0
    while i < n:
        starts[n_blocks] = i
        n_blocks += 1
        j = i + 1
        while (j < n and j - i < QUERY_BLOCK and bases[j] == bases[i]
               and positions[j] == positions[j - 1] + 1):
            j += 1
        i = j
    starts[n_blocks] = n
    # one set of buffers for every item of this call (an allocation per item was a fifth
    # of a prompt's attention): a block's queries, scores, sums and outputs, pair (row r,
    # query head j) at k = r * group + j
    most_keys = _largest(positions, n) + 1 if n else 0
    if window > 0:
        most_keys = min(most_keys, window + QUERY_BLOCK - 1)
    width = most_keys + 8  # a pair's scores, and room for `_scores8`'s last lanes
    # rows of hd rounded up to a multiple of 32, zeros after hd: every loop in whole vectors
    # (the zeros add nothing to a dot or a sum), one code path to compile where head sizes
    # not a multiple of 8 or 32 took two more (a cold load's attention 4.4 -> 3.6 s)
    span = (hd + 31) // 32 * 32
    tile_keys = max(8, TILE_FLOATS // span // 8 * 8)
    qs = np.empty(QUERY_BLOCK * group * span, np.float32)
    scores = np.empty(QUERY_BLOCK * group * width, np.float32)  # pair k's from its first key
    totals = np.empty(QUERY_BLOCK * group, np.float32)
    acc = np.empty(QUERY_BLOCK * group * span, np.float32)
    tile = np.empty(tile_keys * span, np.float32)  # a tile's K (then V) rows, contiguous
    # the padding past hd, zeros never written after this; none to zero for the usual head
    # sizes (the decode replay makes these buffers once per row and KV head)
    if span > hd:
        qs[:] = 0.0
        tile[:] = 0.0
    for item in range(share, n_blocks * n_kv, shares):
        b, h = item // n_kv, item % n_kv
        i0, m = starts[b], starts[b + 1] - starts[b]
        first, last = positions[i0], positions[i0 + m - 1]
        lo = _first_key(first, window)
        cache = numba.carray(_f32_at(bases[i0]), ((last + 1) * token_stride,))
        k_at = layer_offset + h * hd
        v_at = k_at + kv_dim
        for r in range(m):
            for j in range(group):
                for d in range(hd):
                    qs[(r * group + j) * span + d] = (q[rows[i0 + r], h * group + j, d]
                                                      * np.float32(scale))
        # the scores, a tile of keys at a time for every row and head that sees them
        for t0 in range(lo, last + 1, tile_keys):
            t1 = min(t0 + tile_keys, last + 1)
            _gather(tile, cache, k_at, token_stride, t0, t1, hd, span)
            for r in range(m):
                row_lo, a, e = _tile_keys_seen(first + r, window, t0, t1)
                for j in range(group):
                    k = r * group + j
                    at = k * width - row_lo  # key t's score at scores[at + t]
                    for c in range(a, e, 8):
                        store_f32x8(scores, at + c, _scores8(
                            qs, k * span, tile, (c - t0) * span, span, min(8, e - c), span))
        for r in range(m):
            pos = first + r
            seen = pos + 1 - _first_key(pos, window)
            for j in range(group):
                k = r * group + j
                weights = scores[k * width:k * width + seen]
                top = _largest(weights, seen)
                if use_sinks:
                    top = max(top, sinks[h * group + j])
                total = exp_shifted(weights, seen, top)
                if use_sinks:
                    total += np.exp(sinks[h * group + j] - top)
                totals[k] = total
        acc[:m * group * span] = 0.0
        for t0 in range(lo, last + 1, tile_keys):
            t1 = min(t0 + tile_keys, last + 1)
            _gather(tile, cache, v_at, token_stride, t0, t1, hd, span)
            for r in range(m):
                row_lo, a, e = _tile_keys_seen(first + r, window, t0, t1)
                for j in range(group):
                    k = r * group + j
                    _add_values(acc, k * span, scores, k * width - row_lo, tile, -t0 * span,
                                span, a, e, span)
        for r in range(m):
            for j in range(group):
                k = r * group + j
                for d in range(hd):
                    out[rows[i0 + r], h * group + j, d] = acc[k * span + d] / totals[k]


@dataclass(frozen=True)
class DecodeRows:
    """Every row of the batch's sessions whose caches the kernels can address (a decode
    session's one row, each row of a prompt at its own position): their rows in the batch,
    their sessions' cache base addresses, their positions, and the caches themselves (kept
    alive while the table is). Built once per batch (`of`) and kept on it for every layer.

    A prompt's rows go through the same kernel as decode rows, one row at a time in a fixed
    order: a row's attention is then the same bits whether its prompt is prefilled at once,
    in chunks or beside other sessions. BLAS (the numpy path, `_attend`) sums in an order
    that depends on the call's rows and keys, and the quantized kernels' 8-bit activations
    turn such a last-bit difference into a whole rounding step: a batched request drifted
    from the same request alone. (At 128-512 prompt rows the kernel also took a third to
    an eighth of the numpy path's time: it skips the masked half of the keys.)"""

    rows: np.ndarray  # int64 [n]: each row's index in the batch
    bases: np.ndarray  # int64 [n]: address of its session's cache (position 0, layer 0, K)
    positions: np.ndarray  # int64 [n]: each row's position
    caches: tuple[np.ndarray, ...]
    starts: frozenset[int]  # the sessions' first rows, to tell the numpy path which to leave
    n_layers: int
    kv_dim: int  # n_kv_heads * head_dim
    # float32 elements from one token to the next: the token's own K and V, or more where
    # the cache is shared with a draft model's KV token by token (KVLayout.shared_with)
    token_stride: int

    @classmethod
    def of(cls, batch: ForwardBatch) -> DecodeRows | None:
        """The table for `batch` (None when no session's cache is a host float32
        token-major array)."""
        cached = batch.ops_cache.get(cls)
        if cached is not None or cls in batch.ops_cache:
            return cached
        picked = [s for s in batch.seqs if _addressable(s.kv)]
        table = None
        if picked:
            caches = tuple(s.kv.data for s in picked)  # type: ignore[attr-defined]
            _, n_layers, _, n_kv, hd = caches[0].shape
            stride = caches[0].strides[0]
            if all(c.shape[1:] == caches[0].shape[1:] and c.strides[0] == stride
                   for c in caches):
                table = cls(np.concatenate([np.arange(s.start, s.end) for s in picked]),
                            np.concatenate([np.full(s.n_new, c.ctypes.data, np.int64)
                                            for s, c in zip(picked, caches, strict=True)]),
                            np.concatenate([np.arange(s.n_past, s.n_total) for s in picked]),
                            caches, frozenset(s.start for s in picked), n_layers, n_kv * hd,
                            stride // 4)
        batch.ops_cache[cls] = table
        return table

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write the rows' K and V `[T, n_kv_heads, head_dim]` of `layer`."""
        n = len(k)
        _append(np.ascontiguousarray(k, np.float32).reshape(n, -1),
                np.ascontiguousarray(v, np.float32).reshape(n, -1), self.rows, self.bases,
                self.positions, layer * 2 * self.kv_dim, self.token_stride)

    def attend(self, layer: int, q: np.ndarray, out: np.ndarray, scale: float,
               window: int, sinks: np.ndarray | None = None) -> None:
        """out[row] = the row's attention over its cache (the keys up to its position),
        for every row of the table (with `sinks`, one logit per query head in every
        softmax)."""
        n_heads, hd = q.shape[1:]
        n_kv = self.kv_dim // hd
        keys = int(np.sum(np.minimum(self.positions + 1, window) if window
                          else self.positions + 1))
        q = np.ascontiguousarray(q, np.float32)
        use_sinks = sinks is not None
        sinks = np.ascontiguousarray(sinks, np.float32) if use_sinks else _NO_SINKS

        def share(i: int, shares: int) -> None:
            _attend_rows(q, out, self.rows, self.bases, self.positions,
                         layer * 2 * self.kv_dim, self.token_stride, n_kv, scale, window,
                         sinks, use_sinks, i, shares)
        on_cores(keys * n_heads * hd * 2, share)


_NO_SINKS = np.zeros(1, np.float32)


def _addressable(kv: object) -> bool:
    """A host float32 token-major cache whose tokens are each contiguous, one after the
    other at a fixed stride of whole float32s (its own K and V; with a draft model's KV
    beside them, KVLayout.shared_with, more)."""
    data = getattr(kv, "data", None)
    if not (isinstance(kv, TokenMajorKV) and isinstance(data, np.ndarray)
            and data.dtype == np.float32 and data.ndim == 5):
        return False
    token = data[0] if len(data) else data
    own = 4 * int(np.prod(data.shape[1:]))
    return ((len(data) == 0 or token.flags.c_contiguous) and data.strides[0] >= own
            and data.strides[0] % 4 == 0)


KERNELS = (_append, _attend_rows)  # for kernels/cpu_compile.py


def warm_up() -> None:
    """Compile (or load from numba's disk cache) both kernels on a one-token cache."""
    from eagerlm.kernels.batch import SeqSlice

    kv = TokenMajorKV(np.zeros((1, 1, 2, 1, 1), np.float32))
    batch = ForwardBatch(np.zeros(1, np.int32), [SeqSlice(0, 1, 0, kv)], np.zeros(1, np.int64))
    table = DecodeRows.of(batch)
    assert table is not None
    x = np.zeros((1, 1, 1), np.float32)
    table.append(0, x, x)
    table.attend(0, x, np.empty_like(x), 1.0, 0)
