"""Test-wide fixtures."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _seeded_rng(request) -> None:
    """Each test's random inputs (`tests.cuda_testing.rng`) depend on the test alone, not
    on which tests ran before it in the same process: a failure seen once reproduces
    when the test runs by itself."""
    from tests import cuda_testing

    seed = zlib.crc32(request.node.nodeid.encode())
    cuda_testing.rng.bit_generator.state = np.random.PCG64(seed).state
