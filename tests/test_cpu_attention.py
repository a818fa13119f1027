"""The cpu backend's compiled attention rows (kernels/cpu_attention.py): every row's KV
append and attention in one call per layer, decode rows and prompts' rows alike, held to a
float64 numpy computation of causal (and sliding-window) GQA attention written here from
the cache contents, and to the numpy path a cache the kernels cannot address takes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cpu_attention import QUERY_BLOCK, TILE_FLOATS, DecodeRows
from eagerlm.kernels.cpu_threads import SERIAL_MAX_VALUES
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.vmm.kv_layout import TokenMajorKV

N_LAYERS, N_KV, HEAD_DIM, N_HEADS = 3, 2, 16, 6  # GQA: 3 query heads per KV head
CAPACITY = 48


def cache(rng: np.random.Generator) -> TokenMajorKV:
    return TokenMajorKV(rng.standard_normal((CAPACITY, N_LAYERS, 2, N_KV, HEAD_DIM)).astype(
        np.float32))


class SlicedKV:
    """A `SessionKV` the kernels cannot address (not a token-major array): the numpy
    path serves it."""

    def __init__(self, inner: TokenMajorKV) -> None:
        self.inner = inner
        self.capacity = inner.capacity

    def k(self, layer: int) -> np.ndarray:
        return self.inner.k(layer)

    def v(self, layer: int) -> np.ndarray:
        return self.inner.v(layer)


def batch_of(kvs, n_pasts, n_news) -> ForwardBatch:
    seqs, start = [], 0
    for kv, n_past, n_new in zip(kvs, n_pasts, n_news, strict=True):
        seqs.append(SeqSlice(start, n_new, n_past, kv))
        start += n_new
    return ForwardBatch(np.zeros(start, np.int32), seqs, np.arange(start, dtype=np.int64))


def float64_attention(kv, layer: int, q_rows: np.ndarray, first: int, scale: float,
                      window: int) -> np.ndarray:
    """Rows of q at positions first, first + 1, ... over the cache, in float64."""
    out = np.empty(q_rows.shape)
    group = q_rows.shape[1] // kv.k(layer).shape[1]
    for r, q in enumerate(q_rows.astype(np.float64)):
        pos = first + r
        lo = max(0, pos - window + 1) if window else 0
        keys = kv.k(layer)[lo:pos + 1].astype(np.float64)
        values = kv.v(layer)[lo:pos + 1].astype(np.float64)
        for head in range(q_rows.shape[1]):
            s = keys[:, head // group] @ q[head] * scale
            p = np.exp(s - s.max())
            out[r, head] = p @ values[:, head // group] / p.sum()
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_decode_rows_attend_like_float64_attention_beside_a_prompt(window):
    """Sessions at position 0, in the middle and at the cache's last slot decode beside a
    4-row prompt (its rows in the table too, each at its position); every layer's K/V
    lands where it belongs and every row's attention is the float64 one within float32
    rounding."""
    rng = np.random.default_rng(0)
    kvs = [cache(rng) for _ in range(4)]
    before = [kv.data.copy() for kv in kvs]
    n_pasts, n_news = [0, 20, 10, CAPACITY - 1], [1, 1, 4, 1]
    batch = batch_of(kvs, n_pasts, n_news)
    table = DecodeRows.of(batch)
    assert table is not None and table.starts == {0, 1, 2, 6}
    assert list(table.positions) == [0, 20, 10, 11, 12, 13, CAPACITY - 1]
    ops = NumpyOps()
    n = len(batch.tokens)
    for layer in range(N_LAYERS):
        k = rng.standard_normal((n, N_KV, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((n, N_KV, HEAD_DIM)).astype(np.float32)
        q = rng.standard_normal((n, N_HEADS, HEAD_DIM)).astype(np.float32)
        ops.kv_append(batch, layer, k, v)
        out = ops.attention(batch, layer, q, scale=0.3, window=window).reshape(
            n, N_HEADS, HEAD_DIM)
        for s, old in zip(batch.seqs, before, strict=True):
            rows = slice(s.start, s.end)
            np.testing.assert_array_equal(s.kv.k(layer)[s.n_past:s.n_total], k[rows])
            np.testing.assert_array_equal(s.kv.v(layer)[s.n_past:s.n_total], v[rows])
            old[s.n_past:s.n_total, layer, 0] = k[rows]
            old[s.n_past:s.n_total, layer, 1] = v[rows]
            want = float64_attention(s.kv, layer, q[rows], s.n_past, 0.3, window)
            np.testing.assert_allclose(out[rows], want, rtol=2e-5, atol=2e-6)
    for kv, old in zip(kvs, before, strict=True):  # nothing else was written
        np.testing.assert_array_equal(kv.data, old)


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 12])  # 12: the dots' value-by-value path
def test_a_prompts_rows_attend_alike_at_once_in_chunks_and_beside_other_sessions(head_dim):
    """A row's attention is the same bits however its prompt is cut into rounds, and so
    into the kernel's blocks of `QUERY_BLOCK` rows (the quantized kernels' 8-bit
    activations would turn a last-bit difference into a whole rounding step)."""
    n = 40
    assert n > 2 * QUERY_BLOCK
    rng = np.random.default_rng(3)
    k = rng.standard_normal((n, N_KV, head_dim)).astype(np.float32)
    q = rng.standard_normal((n, N_HEADS, head_dim)).astype(np.float32)
    ops = NumpyOps()

    def new_cache(seed) -> TokenMajorKV:
        return TokenMajorKV(np.random.default_rng(seed).standard_normal(
            (CAPACITY, N_LAYERS, 2, N_KV, head_dim)).astype(np.float32))

    def prefill(cuts: list[int], other: bool) -> np.ndarray:
        kv, out = new_cache(4), []
        for a, b in itertools.pairwise(cuts):
            kvs, n_pasts, n_news = [kv], [a], [b - a]
            kq, qq = k[a:b], q[a:b]
            if other:  # a decode session before the prompt's rows
                kvs, n_pasts, n_news = [new_cache(5)] + kvs, [5] + n_pasts, [1] + n_news
                kq, qq = np.concatenate([k[:1], kq]), np.concatenate([q[:1], qq])
            batch = batch_of(kvs, n_pasts, n_news)
            ops.kv_append(batch, 0, kq, kq)
            rows = ops.attention(batch, 0, qq, scale=0.3, window=0)
            out.append(rows[1:] if other else rows)
        return np.concatenate(out)

    whole = prefill([0, n], False)
    for cuts, other in (([0, 1, 5, 12, n], False), ([0, 7, 23, n], True), ([0, n], True),
                        (list(range(n + 1)), False)):
        np.testing.assert_array_equal(prefill(cuts, other), whole)


@pytest.mark.parametrize("window", [0, 70])
def test_rows_over_several_tiles_of_keys_attend_like_float64_and_alike_in_any_block(window):
    """Past a tile of keys (`TILE_FLOATS` / head_dim: 64 keys at head_dim 64), with blocks
    and windows that cross tiles: every row within float32 rounding of float64, and a
    prompt's rows the same bits as each row alone (a decode row at its position)."""
    head_dim, n_heads, n_kv, first, n = 64, 8, 2, 150, 50
    tile_keys = TILE_FLOATS // head_dim
    assert first < 3 * tile_keys < first + n
    rng = np.random.default_rng(6)
    kv = TokenMajorKV(rng.standard_normal((first + n, 4, 2, n_kv, head_dim)).astype(
        np.float32))
    q = rng.standard_normal((n, n_heads, head_dim)).astype(np.float32)
    ops = NumpyOps()
    prompt = ops.attention(batch_of([kv], [first], [n]), 2, q, scale=0.125,
                           window=window).reshape(q.shape)
    np.testing.assert_allclose(prompt, float64_attention(kv, 2, q, first, 0.125, window),
                               rtol=2e-5, atol=2e-6)
    for r in (0, n // 2, n - 1):
        alone = ops.attention(batch_of([kv], [first + r], [1]), 2, q[r:r + 1], scale=0.125,
                              window=window).reshape(1, n_heads, head_dim)
        np.testing.assert_array_equal(alone[0], prompt[r])


def test_a_cache_the_kernels_cannot_address_takes_the_numpy_path():
    rng = np.random.default_rng(1)
    kvs = [cache(rng), SlicedKV(cache(rng))]
    batch = batch_of(kvs, [7, 9], [1, 1])
    table = DecodeRows.of(batch)
    assert table is not None and table.starts == {0}
    assert DecodeRows.of(batch_of([SlicedKV(cache(rng))], [3], [1])) is None
    ops = NumpyOps()
    k = rng.standard_normal((2, N_KV, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((2, N_HEADS, HEAD_DIM)).astype(np.float32)
    ops.kv_append(batch, 1, k, k)
    out = ops.attention(batch, 1, q, scale=0.25, window=0).reshape(2, N_HEADS, HEAD_DIM)
    for s in batch.seqs:
        np.testing.assert_array_equal(s.kv.k(1)[s.n_past], k[s.start])
        want = float64_attention(s.kv, 1, q[s.start:s.end], s.n_past, 0.25, 0)
        np.testing.assert_allclose(out[s.start:s.end], want, rtol=2e-5, atol=2e-6)


def test_many_sessions_split_over_the_cores_give_the_same_rows():
    """Above SERIAL_MAX_VALUES multiply-adds the (session, KV head) items run on every
    core; each row is computed by one item alone, so the result is the one-thread one."""
    rng = np.random.default_rng(2)
    n = 40
    kvs = [cache(rng) for _ in range(n)]
    batch = batch_of(kvs, [CAPACITY - 1] * n, [1] * n)
    assert n * CAPACITY * N_HEADS * HEAD_DIM * 2 >= SERIAL_MAX_VALUES
    q = rng.standard_normal((n, N_HEADS, HEAD_DIM)).astype(np.float32)
    out = NumpyOps().attention(batch, 2, q, scale=0.25, window=0).reshape(
        n, N_HEADS, HEAD_DIM)
    for s in batch.seqs:
        want = float64_attention(s.kv, 2, q[s.start:s.end], s.n_past, 0.25, 0)
        np.testing.assert_allclose(out[s.start:s.end], want, rtol=2e-5, atol=2e-6)


def test_a_cache_shared_with_a_draft_models_kv_attends_like_its_own_bit_for_bit():
    """A draft model's KV beside the target's, token by token (KVLayout.shared_with), makes
    the target's cache strided; the kernels must address it alike (they took the numpy path
    for it, whose sums differ: an engine opened with a draft model decoded differently)."""
    from eagerlm.vmm.kv_layout import KVLayout

    rng = np.random.default_rng(3)
    own = KVLayout(N_LAYERS, N_KV, HEAD_DIM)
    shared, draft = own.shared_with(KVLayout(1, 1, HEAD_DIM))
    plain = cache(rng)
    buf = np.full(CAPACITY * shared.token_bytes // 4, np.nan, np.float32)
    strided = TokenMajorKV(shared.view(buf))
    strided.data[:] = plain.data
    assert not strided.data.flags.c_contiguous
    ops = NumpyOps()
    k = rng.standard_normal((3, N_KV, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((3, N_HEADS, HEAD_DIM)).astype(np.float32)
    outs = []
    for kv in (plain, strided):
        batch = batch_of([kv], [9], [3])
        assert DecodeRows.of(batch) is not None
        ops.kv_append(batch, 2, k, k)
        outs.append(ops.attention(batch, 2, q, scale=0.25, window=0))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(strided.data, plain.data)
    assert np.isnan(draft.view(buf)).all()  # the draft's part untouched
