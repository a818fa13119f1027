"""kernels/cpu_vector_math.py's exp on eight lanes, held to float64's e^x (numpy), and the
property the row ops rely on: a value's result does not depend on where it sits in a row."""

from __future__ import annotations

import numpy as np

from eagerlm.kernels.cpu_vector_math import exp_row


def test_exp_is_within_about_one_ulp_of_float64_over_the_normal_range():
    x = np.linspace(-87.3, 88.37, 1_000_003, dtype=np.float32)
    got = np.empty_like(x)
    exp_row(x, got)
    want = np.exp(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.01


def test_exp_keeps_nan_and_infinities_and_flushes_past_the_range():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -88.5, -200.0, 88.5, 200.0], np.float32)
    got = np.empty_like(x)
    exp_row(x, got)
    assert np.isnan(got[0])
    np.testing.assert_array_equal(got[1:], [np.inf, 0.0, 1.0, 1.0, 0.0, 0.0, np.inf, np.inf])


def test_a_values_exp_is_the_same_bits_in_a_rows_body_and_in_its_last_short_group():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(21) * 10).astype(np.float32)
    whole = np.empty_like(x)
    exp_row(x, whole)
    for start in range(8):  # every value lands in a short last group once
        part = np.empty_like(x[start:])
        exp_row(x[start:].copy(), part)
        np.testing.assert_array_equal(part, whole[start:])
