"""The cuda sampler (kernels/cuda_sampling.py, kernels/cuda/sampler.cu) against
kernels/sampling.py, on a GPU (skipped without one) and on the emulated GPU of
tests/emulated_gpu/gpu_emulator.py: the draw (greedy ties, seeded draws equal to the reference's,
independent of the batch, the token buffer and NaN rows), the logit bias and penalties
(to the bit), constrained rows' token masks (to the bit) and the round's split sampling,
the token counts kept on the device from a round's inputs, and logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest

from eagerlm.kernels.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    TokenCounts,
    adjust_logits,
    allowed_tokens,
    apply_penalties,
    apply_token_mask,
    filter_candidates,
    mask_words,
    sample,
    token_logprob,
)
from tests.cuda_testing import device, ops, rng  # noqa: F401  (fixtures)


def _logits(n: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((n, vocab)).astype(np.float32) * 3
    x[:, rng.integers(0, vocab, 5)] += 8  # a few likely tokens
    x[0, :] = np.round(x[0, :])  # many ties
    return x


def test_greedy_sampling_is_the_argmax_with_ties_to_the_lower_id(ops) -> None:
    logits = _logits(16, 5000)
    logits[3, [10, 20]] = 100.0  # a tie
    params = [SamplingParams(temperature=0.0)] * 16
    got = ops.to_numpy(ops.sample(ops.upload(logits), params, list(range(16))))
    np.testing.assert_array_equal(got, sample(logits, params, list(range(16))))
    assert got[3] == 10


SAMPLERS = [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=40, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(temperature=0.8, min_p=0.05, seed=4),
    SamplingParams(temperature=1.0, top_k=100, top_p=0.8, min_p=0.02, seed=5),
    SamplingParams(temperature=2.0, top_k=1, seed=6),
]


@pytest.mark.parametrize(("vocab", "n"), [(1000, 96), (151936, 30)])
def test_sampling_matches_the_reference(ops, vocab, n) -> None:
    """Every sampler on many rows of a small vocabulary, and five rows each of a real one
    (Qwen's; the emulated GPU takes ~0.5 s per row of it)."""
    logits = _logits(n, vocab)
    params = [SAMPLERS[i % len(SAMPLERS)] for i in range(n)]
    positions = [int(p) for p in rng.integers(0, 1 << 40, n)]
    got = ops.to_numpy(ops.sample(ops.upload(logits), params, positions))
    want = sample(logits, params, positions)
    for i in range(n):  # always a token the reference's filters keep
        assert got[i] in filter_candidates(logits[i], params[i]), i
    agree = float(np.mean(got == want))
    print(f"\nsampler agreement with the reference: {agree:.3f}")
    assert agree >= 0.97


def test_sampling_treats_negative_zero_as_zero(ops) -> None:
    """-0.0 == +0.0, so the top-k boundary among zeros goes to the lower id, whatever the
    sign bit (np.round gives -0.0 for small negative logits)."""
    row = np.array([-0.0, 1.0, 0.0, -0.0, 0.0, -3.0], np.float32)
    logits = np.tile(row, (64, 1))
    params = [SamplingParams(temperature=1.0, top_k=2, seed=7)] * 64
    positions = list(range(64))
    got = ops.to_numpy(ops.sample(ops.upload(logits), params, positions))
    assert set(got.tolist()) <= {0, 1}
    np.testing.assert_array_equal(got, sample(logits, params, positions))


def test_sampling_does_not_depend_on_the_batch(ops) -> None:
    logits = _logits(8, 3000)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=99)] * 8
    alone = [int(ops.to_numpy(ops.sample(ops.upload(logits[i:i + 1]), params[:1], [i]))[0])
             for i in range(8)]
    together = ops.to_numpy(ops.sample(ops.upload(logits), params, list(range(8))))
    assert alone == together.tolist()


def test_sampling_writes_the_token_buffer_and_flags_nan_rows(ops) -> None:
    logits = _logits(3, 100)
    logits[1, 7] = np.nan
    token_buf = ops.upload(np.full(4, -5, np.int32))
    slots = ops.upload(np.array([2, 0, -1], np.int32))
    params = [SamplingParams(temperature=0.0)] * 3
    out = ops.sample(ops.upload(logits), params, [0, 1, 2], token_buf=token_buf.ptr,
                     out_slots=slots)
    got, buf = ops.to_numpy(out), ops.to_numpy(token_buf)
    assert got[1] == -1 and got[0] == np.argmax(logits[0])
    assert buf.tolist() == [-1, -5, int(got[0]), -5]


PENALIZED = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.9, seed=11, repetition_penalty=0.8, frequency_penalty=-0.4),
    SamplingParams(temperature=1.0, top_k=50, seed=12, presence_penalty=-2.0),
    SamplingParams(temperature=0.0),  # no penalties: a row copied as it is
]


def _random_bias(vocab: int, n: int, seed: int) -> dict[int, float]:
    """n tokens, biased by -100..100, among them large ones that move the greedy choice."""
    g = np.random.default_rng(seed)
    ids = g.choice(vocab, n, replace=False)
    return {int(t): float(b) for t, b in zip(ids, g.uniform(-100, 100, n), strict=True)}


# logit biases alone and with penalties (the bias comes first: sampling.adjust_logits)
BIASED = [
    SamplingParams(temperature=0.0, logit_bias=_random_bias(3000, 40, seed=1)),
    SamplingParams(temperature=0.8, seed=13, logit_bias={5: 3.5, 2999: -0.25}),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                   logit_bias=_random_bias(3000, 300, seed=2)),
    SamplingParams(temperature=1.0, top_p=0.9, seed=14, presence_penalty=1.0,
                   logit_bias=_random_bias(3000, 5, seed=3)),
]


def _random_counts(vocab: int) -> TokenCounts:
    counts = TokenCounts.empty(vocab)
    counts.add(rng.integers(0, vocab, 60), as_output=False)
    counts.add(rng.integers(0, vocab // 10, 40), as_output=True)  # repeats among outputs
    return counts


def test_penalties_equal_the_reference_to_the_bit(ops) -> None:
    """penalize_rows against sampling.apply_penalties (float64 where numpy promotes), then
    the draw from the penalized rows against sampling.sample with the same counts."""
    vocab, n = 3000, len(PENALIZED)
    logits = _logits(n, vocab)
    host = [_random_counts(vocab) for _ in range(n)]
    # the same counts on the device, built from the tokens they count
    dev = [ops.token_counts(vocab, np.repeat(np.arange(vocab), h.prompt).tolist(),
                            np.repeat(np.arange(vocab), h.output).tolist()) for h in host]
    for d, h in zip(dev, host, strict=True):
        np.testing.assert_array_equal(ops.to_numpy(d), np.stack([h.prompt, h.output]))
    got = ops.to_numpy(ops.penalize(ops.upload(logits), PENALIZED, dev))
    for i, p in enumerate(PENALIZED):
        want = apply_penalties(logits[i], p, host[i]) if p.penalized else logits[i]
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
    positions = list(range(100, 100 + n))
    tokens = ops.to_numpy(ops.sample(ops.upload(logits), PENALIZED, positions, counts=dev))
    np.testing.assert_array_equal(tokens, sample(logits, PENALIZED, positions, host))


def test_logit_bias_and_penalties_equal_the_reference_to_the_bit(ops) -> None:
    """penalize_rows with each row's dense bias (CudaOps.logit_bias) against
    sampling.adjust_logits, mixed with penalized and plain rows; then the draw against
    sampling.sample, once with the biases given and once uploaded by `sample` itself."""
    vocab = 3000
    params = BIASED + PENALIZED
    n = len(params)
    logits = _logits(n, vocab)
    host = [_random_counts(vocab) if p.penalized else None for p in params]
    counts = [None if h is None else ops.token_counts(
        vocab, np.repeat(np.arange(vocab), h.prompt).tolist(),
        np.repeat(np.arange(vocab), h.output).tolist()) for h in host]
    biases = [ops.logit_bias(p, vocab) if p.logit_bias else None for p in params]
    got = ops.to_numpy(ops.penalize(ops.upload(logits), params, counts, biases))
    for i, p in enumerate(params):
        want = adjust_logits(logits[i], p, host[i]) if p.adjusts_logits else logits[i]
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
    positions = list(range(200, 200 + n))
    want_tokens = sample(logits, params, positions, host)
    for given in (biases, None):
        tokens = ops.to_numpy(ops.sample(ops.upload(logits), params, positions,
                                         counts=counts, biases=given))
        np.testing.assert_array_equal(tokens, want_tokens)
    # the biases moved greedy choices: the test could tell a dropped bias
    assert sample(logits[:1], params[:1], positions[:1])[0] != np.argmax(logits[0])


def test_biased_rows_need_a_bias_of_the_vocabulary(ops) -> None:
    from eagerlm.kernels.cuda_sampling import penalty_table

    with pytest.raises(ValueError, match="no bias"):
        penalty_table(BIASED[:1], None, [None], 3000)
    with pytest.raises(ValueError, match=r"biases\[0\] must be \[3000\]"):
        penalty_table(BIASED[:1], None, [ops.logit_bias(BIASED[0], 3001)], 3000)


def test_penalized_rows_need_their_counts(ops) -> None:
    logits = ops.upload(_logits(2, 100))
    with pytest.raises(ValueError, match="no token counts"):
        ops.sample(logits, PENALIZED[:2], [0, 1], counts=[ops.token_counts(100, [1], []), None])


def test_token_counts_follow_the_round_inputs_on_the_device(ops) -> None:
    """count_inputs reads each row's id where the embedding does (the host id, or the token
    buffer's entry for decode rows) and splits prompt from output rows; the numpy backend's
    count_inputs over the same ids is the reference."""
    from eagerlm.kernels.device_tensor import DeviceIds
    from eagerlm.kernels.numpy_ops import NumpyOps

    vocab = 50
    token_buf = np.array([7, 7, 3, -1], np.int32)  # -1: a failed sample, never counted
    rows = np.array([[4, -1], [9, -1], [4, -1], [0, 0],  # session a: 3 prompt rows + 1
                     [0, 1], [0, 3],                    # session b: two decode rows
                     [12, -1], [12, -1], [0, 2]], np.int32)
    spans = [(0, 4, 3), (4, 2, 0), (6, 3, 1)]  # (start, n, rows still in the prompt)
    ids = np.where(rows[:, 1] >= 0, token_buf[np.maximum(rows[:, 1], 0)], rows[:, 0])
    ids_ok = np.where(ids >= 0, ids, 0)  # the reference counts ids; -1 is checked apart
    cpu = [NumpyOps().token_counts(vocab, [1, 2], [2]) for _ in spans]
    NumpyOps().count_inputs(ids_ok, [(c, *sp) for c, sp in zip(cpu, spans, strict=True)])
    cpu[1].output[0] -= 1  # row 5 reads -1 from the token buffer: not a token
    dev = [ops.token_counts(vocab, [1, 2], [2]) for _ in spans]
    rows_d, buf_d = ops.upload(rows.reshape(-1)), ops.upload(token_buf)
    ops.count_inputs(DeviceIds(rows_d.ptr, len(rows), buf_d.ptr),
                     [(d, *sp) for d, sp in zip(dev, spans, strict=True)])
    for d, c in zip(dev, cpu, strict=True):
        np.testing.assert_array_equal(ops.to_numpy(d), np.stack([c.prompt, c.output]))


def test_logprobs_match_the_float64_reference(ops) -> None:
    """token_logprobs against sampling.token_logprob (a float64 numpy log-softmax): the
    sampled token's logprob and the top-n alternatives, ties ordered by id; rows that do
    not ask are left alone, a failed sample gets NaN."""
    vocab, n = 20000, 6
    logits = _logits(n, vocab)  # row 0 has many ties
    logits[2, [5, 9, 700]] = 30.0  # a three-way tie at the top
    want_n = [MAX_LOGPROBS, 0, 3, None, 5, 1]
    tokens = np.array([17, 3, 9, 4, -1, int(np.argmax(logits[5]))], np.int32)
    values = ops.upload(np.full((n, 1 + MAX_LOGPROBS), 7.0, np.float32))
    top_ids = ops.upload(np.full((n, MAX_LOGPROBS), -7, np.int32))
    ops.token_logprobs(ops.upload(logits), ops.upload(tokens), want_n, values=values.ptr,
                       top_ids=top_ids.ptr)
    got_v, got_ids = ops.to_numpy(values), ops.to_numpy(top_ids)
    for i, k in enumerate(want_n):
        if k is None:
            assert (got_v[i] == 7.0).all() and (got_ids[i] == -7).all()
            continue
        ref = token_logprob(logits[i], max(int(tokens[i]), 0), k)
        if tokens[i] < 0:
            assert np.isnan(got_v[i, 0])
        else:
            np.testing.assert_allclose(got_v[i, 0], ref.logprob, rtol=1e-6, atol=1e-6)
        assert got_ids[i, :k].tolist() == [t for t, _ in ref.top], i
        np.testing.assert_allclose(got_v[i, 1:1 + k], [v for _, v in ref.top], rtol=1e-6,
                                   atol=1e-6)
    assert got_ids[2, :3].tolist() == [5, 9, 700]


def _random_masks(n: int, vocab: int) -> list[np.ndarray | None]:
    """Allowed-token bitmasks (a few to a few hundred tokens allowed), every third row
    unmasked, one row allowing a single token past every 32-token word boundary."""
    words = mask_words(vocab)
    masks: list[np.ndarray | None] = []
    for i in range(n):
        if i % 3 == 2:
            masks.append(None)
            continue
        bits = np.zeros(words * 32, np.uint8)
        bits[rng.choice(vocab, int(rng.integers(1, 300)), replace=False)] = 1
        masks.append(np.packbits(bits, bitorder="little").view(np.int32))
    bits = np.zeros(words * 32, np.uint8)
    bits[vocab - 1] = 1  # the last token, in the last (partial) word
    masks[0] = np.packbits(bits, bitorder="little").view(np.int32)
    return masks


@pytest.mark.parametrize("vocab", [1000, 151936])
def test_masked_rows_equal_the_reference_and_draw_only_allowed_tokens(ops, vocab) -> None:
    """mask_rows against sampling.apply_token_mask (-inf where not allowed, to the bit),
    then the draw with the masks against sampling.sample's, greedy and seeded, on rows
    with and without a logit bias (masked in place on the adjusted copy)."""
    n = 30
    logits = _logits(n, vocab)
    masks = _random_masks(n, vocab)
    got = ops.to_numpy(ops.mask(ops.upload(logits), masks))
    for i, m in enumerate(masks):
        np.testing.assert_array_equal(got[i], logits[i] if m is None
                                      else apply_token_mask(logits[i], m), err_msg=f"row {i}")
    params = [SamplingParams(temperature=0.0, logit_bias={5: 50.0} if i % 4 == 0 else ())
              if i % 2 else SAMPLERS[i % len(SAMPLERS)] for i in range(n)]
    positions = list(range(7, 7 + n))
    tokens = ops.to_numpy(ops.sample(ops.upload(logits), params, positions, masks=masks))
    want = sample(logits, params, positions, masks=masks)
    for i, m in enumerate(masks):
        if m is not None:
            assert allowed_tokens(m, vocab)[tokens[i]], i
    assert float(np.mean(tokens == want)) >= 0.97
    greedy = [i for i, p in enumerate(params) if p.greedy]
    np.testing.assert_array_equal(tokens[greedy], want[greedy])


def test_a_round_samples_its_constrained_rows_after_the_others_into_their_own_rows(
        ops) -> None:
    """sample_round with `first_row`: the round's unconstrained rows first, then the
    constrained ones with their masks, each into its rows of the output and logprobs, as
    one call over all rows would (dispatch/round_work.py)."""
    vocab, n, split = 2000, 6, 4
    logits = _logits(n, vocab)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * n
    masks = _random_masks(n, vocab)[:n - split]
    out = ops.empty((n,), "i32")
    token_buf = ops.empty((n,), "i32")
    values = ops.empty((n, 1 + MAX_LOGPROBS), "f32")
    top = ops.empty((n, MAX_LOGPROBS), "i32")
    dev_logits = ops.upload(logits)
    for first, rows, m in ((0, range(split), None), (split, range(split, n), masks)):
        ops.sample_round(dev_logits, [params[i] for i in rows], [10 + i for i in rows],
                         [None] * len(rows), [None] * len(rows), out=out, token_buf=token_buf,
                         out_slots=list(rows), logprobs_out=(values, top), masks=m,
                         first_row=first)
    want = sample(logits, params, [10 + i for i in range(n)], masks=[None] * split + masks)
    np.testing.assert_array_equal(ops.to_numpy(out), want)
    np.testing.assert_array_equal(ops.to_numpy(token_buf), want)
    lp = ops.to_numpy(values)
    for i in range(n):  # the logprobs are the raw logits', for the drawn token
        assert lp[i, 0] == pytest.approx(token_logprob(logits[i], int(want[i]), 2).logprob,
                                         abs=1e-4)
