"""The reference sampler, specified by independent references.

Each expectation is computed here from first principles (pure-Python splitmix64, softmax
with `math.exp`, nuclei from a full sort), never by calling the code under test twice.
Random draws use fixed seeds, so every statistical check is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagerlm.kernels.sampling import (
    InvalidSamplingParams,
    SamplingParams,
    draw_uniform,
    filter_candidates,
    fresh_seed,
    sample,
)

MASK = (1 << 64) - 1
# chi2.ppf(0.999, df): a correct sampler fails one of these once in a thousand seeds, and
# the seeds are fixed, so a pass is permanent.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 7: 24.322, 9: 27.877}


def ref_uniform(seed: int, position: int) -> float:
    """The documented counter-based generator, in plain Python integers."""
    def mix64(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)
    bits = mix64((mix64(seed) + (position + 1) * 0x9E3779B97F4A7C15) & MASK)
    return (bits >> 11) / 2.0**53


def softmax(logits, temperature: float = 1.0) -> list[float]:
    weights = [math.exp(x / temperature) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def draw_many(logits_row, params: SamplingParams, n: int = 20_000) -> np.ndarray:
    """n draws of one request at positions 0..n-1 (one batch row per position)."""
    batch = np.tile(np.asarray(logits_row, dtype=np.float32), (n, 1))
    return sample(batch, [params] * n, list(range(n)))


def chi_square(tokens: np.ndarray, probs: list[float]) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    n = len(tokens)
    support = [i for i, p in enumerate(probs) if p > 0]
    assert counts[[i for i, p in enumerate(probs) if p == 0]].sum() == 0
    return sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)


def logits_of(probs) -> list[float]:
    return [math.log(p) if p > 0 else -math.inf for p in probs]


# --- the generator ---------------------------------------------------------------------


def test_uniform_is_the_documented_splitmix64_function():
    cases = [(0, 0), (1, 0), (0, 1), (12345, 678), (2**64 - 1, 2**63 - 1), (2**63, 42)]
    got = draw_uniform([s for s, _ in cases], [p for _, p in cases])
    assert got.tolist() == [ref_uniform(s, p) for s, p in cases]
    assert ((got >= 0) & (got < 1)).all()


def test_uniform_is_uniform_over_positions():
    u = draw_uniform([7] * 20_000, range(20_000))
    chi = chi_square(np.minimum((u * 10).astype(int), 9), [0.1] * 10)
    assert chi < CHI2_999[9]


# --- greedy ----------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id():
    rng = np.random.default_rng(1)
    logits = rng.integers(-3, 4, size=(32, 50)).astype(np.float32)  # many ties
    got = sample(logits, [SamplingParams(temperature=0)] * 32, [0] * 32)
    expected = [min(j for j in range(50) if row[j] == max(row)) for row in logits.tolist()]
    assert got.tolist() == expected
    assert got.dtype == np.int32


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(2)
    logits = rng.integers(-3, 4, size=(64, 40)).astype(np.float32)
    params = [SamplingParams(top_k=1, seed=s, temperature=1.5) for s in range(64)]
    greedy = [int(np.argmax(row)) for row in logits]  # numpy argmax: first maximum
    assert sample(logits, params, range(64)).tolist() == greedy


# --- reproducibility -------------------------------------------------------------------


def test_same_seed_and_position_same_token_whatever_the_batch():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 1000)).astype(np.float32)
    params = [SamplingParams(seed=100 + i, top_p=0.9 if i % 2 else 1.0) for i in range(5)]
    positions = [10, 11, 12, 3, 900]
    together = sample(logits, params, positions)
    alone = [sample(logits[i:i + 1], params[i:i + 1], positions[i:i + 1])[0] for i in range(5)]
    reversed_batch = sample(logits[::-1], params[::-1], positions[::-1])[::-1]
    assert together.tolist() == alone == reversed_batch.tolist()
    again = sample(logits, params, positions)
    assert again.tolist() == together.tolist()


def test_token_is_the_inverse_cdf_of_the_documented_uniform():
    probs = [0.1, 0.2, 0.3, 0.4]
    params = SamplingParams(seed=99)
    for position in range(200):
        u = ref_uniform(99, position)
        expected = next(i for i in range(4) if sum(probs[: i + 1]) > u)
        got = sample(np.array([logits_of(probs)], np.float32), [params], [position])[0]
        assert got == expected


def test_unseeded_random_params_are_rejected_and_resolve_seed_fixes_them():
    params = SamplingParams()
    with pytest.raises(ValueError, match="resolve_seed"):
        sample(np.zeros((1, 4), np.float32), [params], [0])
    resolved = params.resolve_seed()
    assert resolved.seed is not None and resolved.resolve_seed() is resolved
    assert 0 <= fresh_seed() < 2**64
    # greedy rows need no seed
    assert sample(np.array([[0, 2, 1]], np.float32), [SamplingParams(temperature=0)], [0])[0] == 1


# --- the distribution ------------------------------------------------------------------


def test_temperature_1_matches_softmax():
    logits = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]
    tokens = draw_many(logits, SamplingParams(seed=2024))
    assert chi_square(tokens, softmax(logits)) < CHI2_999[7]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    logits = [1.0, 0.0, -1.0, 0.5, 2.0]
    tokens = draw_many(logits, SamplingParams(seed=7, temperature=temperature))
    assert chi_square(tokens, softmax(logits, temperature)) < CHI2_999[4]
    # and it is distinguishable from temperature 1
    assert chi_square(tokens, softmax(logits)) > CHI2_999[4]


# --- filters ---------------------------------------------------------------------------


def test_top_k_keeps_k_largest_ties_to_lower_ids():
    kept = filter_candidates(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), SamplingParams(top_k=2))
    assert kept.tolist() == [1, 2]
    kept = filter_candidates(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), SamplingParams(top_k=4))
    assert kept.tolist() == [1, 2, 3, 4]
    assert filter_candidates(np.zeros(6), SamplingParams(top_k=100)).tolist() == list(range(6))


def test_top_p_keeps_the_smallest_nucleus():
    probs = [0.05, 0.40, 0.25, 0.20, 0.10]
    # sorted: 0.40 (1), 0.25 (2), 0.20 (3), 0.10 (4), 0.05 (0); cumulative .40 .65 .85 .95
    for top_p, nucleus in [(0.3, [1]), (0.6, [1, 2]), (0.7, [1, 2, 3]), (0.9, [1, 2, 3, 4]),
                           (0.99, [0, 1, 2, 3, 4])]:
        params = SamplingParams(top_p=top_p, seed=5)
        assert filter_candidates(np.array(logits_of(probs)), params).tolist() == nucleus
    tokens = draw_many(logits_of(probs), SamplingParams(top_p=0.7, seed=5))
    renormalised = [0, 0.40 / 0.85, 0.25 / 0.85, 0.20 / 0.85, 0]
    assert chi_square(tokens, renormalised) < CHI2_999[2]


def test_top_p_after_top_k_uses_the_renormalised_top_k():
    probs = [0.30, 0.25, 0.20, 0.15, 0.10]
    # top-k 3 -> .30 .25 .20, renormalised .40 .333 .267; top-p .5 needs two of them
    params = SamplingParams(top_k=3, top_p=0.5)
    assert filter_candidates(np.array(logits_of(probs)), params).tolist() == [0, 1]


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.95])
def test_top_p_on_a_full_vocabulary_matches_a_full_sort(top_p):
    """262,144 tokens with many ties: exercises the growing partial candidate set."""
    rng = np.random.default_rng(11)
    logits = np.round(rng.standard_normal(262_144) * 4) / 2  # steps of 0.5: ties everywhere
    order = np.lexsort((np.arange(logits.size), -logits))  # by logit desc, then id asc
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    size = int(np.argmax(np.cumsum(probs) >= top_p)) + 1
    expected = np.sort(order[:size])
    got = filter_candidates(logits, SamplingParams(top_p=top_p))
    assert got.tolist() == expected.tolist()


def test_min_p_keeps_tokens_above_a_fraction_of_the_max():
    probs = [0.50, 0.20, 0.04, 0.26]
    logits = np.array(logits_of(probs))
    assert filter_candidates(logits, SamplingParams(min_p=0.1)).tolist() == [0, 1, 3]
    assert filter_candidates(logits, SamplingParams(min_p=0.5)).tolist() == [0, 3]
    assert filter_candidates(logits, SamplingParams(min_p=1.0)).tolist() == [0]
    tokens = draw_many(logits, SamplingParams(min_p=0.1, seed=3))
    assert chi_square(tokens, [0.50 / 0.96, 0.20 / 0.96, 0, 0.26 / 0.96]) < CHI2_999[2]


def test_filters_see_the_untempered_distribution():
    """llama.cpp order: the candidate set does not depend on the temperature."""
    probs = [0.05, 0.40, 0.25, 0.20, 0.10]
    logits = np.array(logits_of(probs))
    for temperature in (0.3, 1.0, 5.0):
        params = SamplingParams(top_p=0.7, min_p=0.55, temperature=temperature)
        assert filter_candidates(logits, params).tolist() == [1, 2]
    tokens = draw_many(logits, SamplingParams(top_p=0.7, temperature=5.0, seed=8))
    hot = softmax([math.log(0.40), math.log(0.25), math.log(0.20)], 5.0)
    assert chi_square(tokens, [0, *hot, 0]) < CHI2_999[2]


def test_masked_tokens_are_never_drawn():
    logits = np.array([[0.0, -np.inf, 0.0, -np.inf]], np.float32)
    params = [SamplingParams(seed=1, temperature=3.0)]
    drawn = {int(sample(logits, params, [p])[0]) for p in range(300)}
    assert drawn == {0, 2}


def test_full_vocabulary_batch_with_mixed_params():
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((4, 262_144)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=40, seed=1),
              SamplingParams(top_p=0.9, min_p=0.05, seed=2), SamplingParams(seed=3)]
    got = sample(logits, params, [5, 5, 5, 5])
    assert got[0] == int(np.argmax(logits[0]))
    assert got[1] in set(np.argsort(-logits[1])[:40].tolist())
    assert logits[2, got[2]] >= logits[2].max() + math.log(0.05)


# --- input checking --------------------------------------------------------------------


def test_bad_logits_and_lengths_are_rejected():
    p = SamplingParams(seed=1)
    with pytest.raises(ValueError, match=r"\[n, vocab\]"):
        sample(np.zeros(4, np.float32), [p], [0])
    with pytest.raises(ValueError, match="need 2 params"):
        sample(np.zeros((2, 4), np.float32), [p], [0, 1])
    with pytest.raises(ValueError, match="no finite maximum"):
        sample(np.array([[0.0, np.nan]], np.float32), [p], [0])
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([[0.0, np.nan]], np.float32), [SamplingParams(temperature=0)], [0])
    with pytest.raises(ValueError, match="positions"):
        sample(np.zeros((1, 4), np.float32), [p], [-1])


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("temperature", "hot"),
    ("top_k", -1), ("top_k", 2.0),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("stop", "END"), ("stop", ("",)), ("stop", (1,)), ("stop", tuple("abcdefghijklmnopq")),
    ("ignore_eos", "yes"),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams, match=f"^{field} ") as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_valid_edges_are_accepted_and_normalised():
    p = SamplingParams(max_tokens=1, temperature=0, top_k=0, top_p=1, min_p=1, seed=2**64 - 1,
                       stop=["a"] * 16, ignore_eos=True)
    assert p.greedy and p.stop == ("a",) * 16 and isinstance(p.temperature, float)
    assert SamplingParams(temperature=1) == SamplingParams(temperature=1.0)
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))


# -- penalties and logprobs -------------------------------------------------------------
# References are written out by hand from the definitions (llama.cpp / HF for repetition,
# OpenAI's API reference for presence and frequency).

def _counts(vocab, prompt=(), output=()):
    from eagerlm.kernels.sampling import TokenCounts

    c = TokenCounts.empty(vocab)
    c.add(list(prompt), as_output=False)
    c.add(list(output), as_output=True)
    return c


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    from eagerlm.kernels.sampling import apply_penalties

    logits = np.array([2.0, -1.0, 3.0, 0.5], np.float32)
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0),
                          _counts(4, prompt=[0], output=[1]))
    np.testing.assert_allclose(out, [1.0, -2.0, 3.0, 0.5])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    from eagerlm.kernels.sampling import apply_penalties

    logits = np.zeros(4, np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, _counts(4, prompt=[3, 3], output=[1, 1, 1, 2]))
    # token 1: 0.5 + 3 * 0.25; token 2: 0.5 + 0.25; token 3 only in the prompt: untouched
    np.testing.assert_allclose(out, [0.0, -1.25, -0.75, 0.0])


def test_penalties_change_the_greedy_choice():
    logits = np.array([[5.0, 4.9, 0.0]], np.float32)
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sample(logits, [plain], [0])[0] == 0
    assert sample(logits, [penalized], [0], [_counts(3, output=[0])])[0] == 1


def test_penalized_row_without_counts_is_refused():
    with pytest.raises(ValueError, match="penalties"):
        sample(np.zeros((1, 3), np.float32), [SamplingParams(presence_penalty=1.0)], [0])


@pytest.mark.parametrize("field, value", [("repetition_penalty", 0.0),
                                          ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3.0), ("logprobs", 21),
                                          ("logprobs", -1)])
def test_invalid_penalty_and_logprob_settings_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})


def test_token_logprob_is_the_log_softmax_with_top_alternatives():
    from eagerlm.kernels.sampling import token_logprob

    logits = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    lp = token_logprob(logits, 2, 3)
    assert lp.token == 2 and lp.logprob == pytest.approx(ref[2])
    # most likely first, ties by lower id
    assert [t for t, _ in lp.top] == [1, 3, 2]
    assert [v for _, v in lp.top] == pytest.approx([ref[1], ref[3], ref[2]])
    assert token_logprob(logits, 0, 0).top == ()


# --- logit bias ---------------------------------------------------------------------------


def test_logit_bias_is_kept_as_sorted_pairs_whatever_form_it_came_in():
    as_dict = SamplingParams(logit_bias={7: 1, 2: -100.0})
    as_pairs = SamplingParams(logit_bias=[(2, -100), (7, 1.0)])
    assert as_dict.logit_bias == ((2, -100.0), (7, 1.0))
    assert as_dict == as_pairs and hash(as_dict) == hash(as_pairs)
    assert as_dict.adjusts_logits and not as_dict.penalized
    assert not SamplingParams().adjusts_logits


@pytest.mark.parametrize("bias", [{-1: 1.0}, {True: 1.0}, {1.5: 1.0}, {"3": 1.0},
                                  {3: 100.5}, {3: -101}, {3: math.nan}, {3: math.inf},
                                  {3: "1"}, [(3, 1.0), (3, 2.0)], [(3,)], 5, "3:1"])
def test_invalid_logit_bias_names_the_field(bias):
    with pytest.raises(InvalidSamplingParams, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_added_to_the_logits():
    from eagerlm.kernels.sampling import adjust_logits

    logits = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    out = adjust_logits(logits, SamplingParams(logit_bias={1: 3.0, 3: -0.25}), None)
    np.testing.assert_array_equal(out, np.float32([0.5, 2.0, 2.0, -0.25]))
    assert out is not logits and logits[1] == -1.0  # the raw logits stay for the logprobs


def test_logit_bias_comes_before_the_penalties():
    """llama.cpp's chain: bias first, so a repetition penalty of 2 acts on the biased
    logit of a seen token: (1 + 1) / 2 = 1.0 (not 1 / 2 + 1 = 1.5), and (-1 + 5) / 2 = 2.0
    (not -1 * 2 + 5 = 3.0); an unseen token only gets its bias."""
    from eagerlm.kernels.sampling import adjust_logits

    logits = np.array([1.0, -1.0, 0.0], np.float32)
    params = SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0, 1: 5.0, 2: 0.5})
    out = adjust_logits(logits, params, _counts(3, prompt=[0, 1]))
    np.testing.assert_array_equal(out, np.float32([1.0, 2.0, 0.5]))


def test_a_bias_of_100_forces_or_bans_a_token_greedy_or_not():
    logits = np.array([[3.0, 2.0, 1.0, 0.0]], np.float32)
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias={0: -100})], [0])[0] == 1
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias={3: 100})], [0])[0] == 3
    drawn = draw_many(logits[0], SamplingParams(temperature=1.5, seed=3, logit_bias={2: 100}),
                      n=2000)
    assert set(drawn.tolist()) == {2}


def test_biased_draws_follow_the_biased_softmax():
    """A bias of log(4) on token 1 of a uniform 3-token row gives probabilities 1/6, 4/6,
    1/6 (softmax by hand)."""
    params = SamplingParams(temperature=1.0, seed=21, logit_bias={1: math.log(4.0)})
    drawn = draw_many([0.0, 0.0, 0.0], params)
    assert chi_square(drawn, [1 / 6, 4 / 6, 1 / 6]) < CHI2_999[2]


def test_dense_logit_bias_refuses_an_id_beyond_the_vocabulary():
    from eagerlm.kernels.sampling import dense_logit_bias

    params = SamplingParams(logit_bias={2: 1.5, 9: -2.0})
    np.testing.assert_array_equal(dense_logit_bias(params, 10),
                                  np.float32([0, 0, 1.5, 0, 0, 0, 0, 0, 0, -2.0]))
    with pytest.raises(ValueError, match="token 9"):
        dense_logit_bias(params, 9)
