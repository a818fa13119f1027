"""The decode attention kernels (kernels/cuda/attention_decode.cu) against the numpy
reference, on a GPU (skipped without one) and on the emulated GPU of
tests/emulated_gpu/gpu_emulator.py.

Decode batches: every session has one new row whose key and value kv_append has just
written; sessions of different lengths in one batch (n_past = 0, short, long enough to be
split), GQA group sizes 1..12 (12 takes two blocks per KV head), head dims 32/64/128/256,
with and without a sliding window smaller than the context. Splits are exercised both as
CudaOps.attention picks them and as a CUDA graph would size them, for a bound longer than
any session (most splits then hold no key and write empty partials).
"""

from __future__ import annotations

import math

import pytest

from tests.cuda_testing import REF, appended_batches, close, device, ops, rand  # noqa: F401


def _decode_batch(ops, hd: int, n_heads: int, n_kv: int, n_pasts: list[int], *,
                  n_layers: int = 2, layer: int = 1):
    """A decode batch (one row per session) on host and device with the new K/V appended,
    and its queries."""
    bh, bd, n_tok = appended_batches(ops, [(p, 1, p + 1) for p in n_pasts], n_kv, hd,
                                     n_layers=n_layers, layer=layer)
    q = rand(n_tok, n_heads, hd, scale=2.0)  # scores of a few units: a peaked softmax
    return bh, bd, q, ops.upload(q, "bf16").reshape(n_tok, n_heads, hd)


def _count_decode_calls(ops, monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = ops.attn.decode

    def spy(*args, **kw):
        calls.append((kw["n_splits"], kw["split_len"]))
        return real(*args, **kw)

    monkeypatch.setattr(ops.attn, "decode", spy)
    return calls


@pytest.mark.parametrize("hd,n_heads,n_kv", [
    (64, 4, 4),     # g = 1
    (32, 8, 4),     # g = 2
    (128, 4, 2),    # g = 2
    (128, 12, 4),   # g = 3: a block of 4 with one idle head
    (64, 8, 2),     # g = 4
    (256, 8, 1),    # g = 8
    (128, 16, 2),   # g = 8
    (256, 4, 2),    # g = 2
    (64, 12, 1),    # g = 12: two blocks per KV head
])
@pytest.mark.parametrize("window", [0, 6])
def test_decode_attention_matches_the_reference(ops, monkeypatch, hd, n_heads, n_kv,
                                                window) -> None:
    layer = 1
    bh, bd, q, qd = _decode_batch(ops, hd, n_heads, n_kv, [0, 3, 37, 600], layer=layer)
    calls = _count_decode_calls(ops, monkeypatch)
    scale = 1 / math.sqrt(hd)
    want = REF.attention(bh, layer, q, scale=scale, window=window)
    got = ops.attention(bd, layer, qd, scale=scale, window=window)
    close(ops.to_numpy(got), want)
    assert len(calls) == 1  # routed to the decode kernel
    if window == 0:
        assert calls[0][0] > 1  # the 601-key session is split (8 emulated SMs)


@pytest.mark.parametrize("window", [0, 1000])
def test_decode_attention_splits_a_long_context(ops, monkeypatch, window) -> None:
    """5000+ keys next to short sessions: several splits, merged; with a window the
    visible keys start mid-context."""
    bh, bd, q, qd = _decode_batch(ops, 128, 2, 1, [5100, 1, 300], n_layers=1, layer=0)
    calls = _count_decode_calls(ops, monkeypatch)
    want = REF.attention(bh, 0, q, scale=0.1, window=window)
    got = ops.attention(bd, 0, qd, scale=0.1, window=window)
    close(ops.to_numpy(got), want)
    assert len(calls) == 1 and calls[0][0] > 1


@pytest.mark.parametrize("window", [0, 50])
def test_a_launch_sized_for_a_bound_is_right_for_shorter_sessions(ops, window) -> None:
    """As a CUDA graph launches it: splits fixed by a bound (4096 keys) far above the
    sessions, so most blocks find no key and write empty partials; and the converse, too
    few splits for a session, where the last split takes the rest."""
    from eagerlm.kernels.cuda_attention import decode_attention_splits

    hd, n_heads, n_kv = 64, 4, 2
    bh, bd, q, qd = _decode_batch(ops, hd, n_heads, n_kv, [0, 130, 700], layer=1)
    want = REF.attention(bh, 1, q, scale=0.125, window=window)
    meta = ops.attn.batch_meta(bd)
    bound = decode_attention_splits(4096, 3, n_kv, n_heads, ops.sm_count)
    assert bound[0] * bound[1] >= 4096 and bound[0] > 3
    for n_splits, split_len in [bound, (3, 64), (1, 64)]:
        got = ops.attn.decode(meta, 1, qd, scale=0.125, window=window,
                              n_splits=n_splits, split_len=split_len)
        close(ops.to_numpy(got), want)


def test_split_plan() -> None:
    from eagerlm.kernels.cuda_attention import DECODE_MAX_SPLITS, decode_attention_splits

    # a big batch fills the GPU without splitting; one session is split
    assert decode_attention_splits(4096, 256, 8, 16, 132) == (1, 4096)
    n, length = decode_attention_splits(4096, 1, 8, 16, 132)
    assert n > 1 and n * length >= 4096 and length % 64 == 0
    # never below DECODE_MIN_SPLIT keys a split, never above the cap
    assert decode_attention_splits(300, 1, 1, 1, 132)[0] == 2
    assert decode_attention_splits(1, 1, 1, 1, 132) == (1, 64)
    assert decode_attention_splits(1 << 20, 1, 1, 1, 132)[0] == DECODE_MAX_SPLITS


def test_other_head_dims_keep_the_general_kernel(ops, monkeypatch) -> None:
    calls = _count_decode_calls(ops, monkeypatch)
    bh, bd, q, qd = _decode_batch(ops, 80, 4, 2, [3, 20], layer=1)  # no hd-80 decode kernel
    close(ops.to_numpy(ops.attention(bd, 1, qd, scale=0.1, window=0)),
          REF.attention(bh, 1, q, scale=0.1, window=0))
    assert calls == []
