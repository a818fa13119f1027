"""The reference dequantization the tests hold every weight type's kernels to.

gguf-py's `quants.dequantize` for the types it reads. gguf-py 0.19 has no dequantizer for
Q1_0, so for it the reference is llama.cpp's own: its dequantization of the random blocks
of tests/fixtures/q1_0_llama.npz (made by tests/fixtures/make_q1_0_reference.py). A test's
Q1_0 matrix is drawn from those blocks (`fixture_blocks`), and `dequantize` gives for each
block llama.cpp's values, found by the block's bytes: a block not from the fixture has no
reference and fails the test.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

Q = GGMLQuantizationType
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "q1_0_llama.npz"
LLAMA_CPP_TYPES = frozenset({Q.Q1_0})  # the types whose reference is the fixture


@cache
def llama_cpp_blocks() -> tuple[np.ndarray, np.ndarray]:
    """The fixture's blocks [n, 18] and llama.cpp's values of them [n, 128]; the first
    have special scales (zero, infinities, NaN, ...), the rest finite ones."""
    with np.load(FIXTURE) as f:
        return f["blocks"], f["values"]


@cache
def _values_by_bytes() -> dict[bytes, np.ndarray]:
    blocks, values = llama_cpp_blocks()
    return {b.tobytes(): v for b, v in zip(blocks, values, strict=True)}


def fixture_blocks(qtype: GGMLQuantizationType, n_blocks: int,
                   rng: np.random.Generator) -> np.ndarray:
    """n_blocks of the fixture's blocks with finite scales (|d| 0.002 .. 0.02, either
    sign), drawn with `rng`: [n_blocks, bytes]."""
    if qtype not in LLAMA_CPP_TYPES:
        raise ValueError(f"no llama.cpp fixture for {qtype.name}")
    blocks, _ = llama_cpp_blocks()
    d = np.abs(blocks[:, :2].copy().view(np.float16)[:, 0])
    sane = blocks[(d >= 0.001) & (d <= 0.1)]
    return sane[rng.integers(0, len(sane), n_blocks)]


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`quants.dequantize(raw, qtype)`, and for the fixture's types llama.cpp's values of
    the same blocks (shaped as gguf-py shapes its output)."""
    if qtype not in LLAMA_CPP_TYPES:
        return quants.dequantize(raw, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = raw.view(np.uint8)
    table = _values_by_bytes()
    blocks = [b.tobytes() for b in raw.reshape(-1, size)]
    missing = sum(b not in table for b in blocks)
    assert not missing, f"{missing} {qtype.name} blocks are not the fixture's: no reference"
    values = np.stack([table[b] for b in blocks])
    return values.reshape(*raw.shape[:-1], raw.shape[-1] // size * block)
