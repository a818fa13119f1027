"""numpy (de)quantization of every ggml block type the engine reads: gguf-py's
`gguf.quants`, and ports of ggml's own code for the types gguf-py 0.19 knows by size but
cannot (de)quantize (it raises NotImplementedError for them; we cannot change gguf-py).

The ported types, one row each in `PORTED`:

- Q1_0 (ggml type 41, 128 values in 18 bytes): a float16 scale d, then 16 bytes of bits,
  bit i % 8 of byte i // 8 for value i; value = +d where the bit is set, else -d
  (ggml-quants.c's `dequantize_row_q1_0`). ggml's reference quantizer
  (`quantize_row_q1_0_ref`, what llama.cpp writes a Q1_0 file with) sets d to the block's
  mean |x|, summed in float32 in order, and a bit where x >= 0.

Both are checked, to the bit, against llama.cpp's own functions on the blocks and rows of
tests/fixtures/q1_0_llama.npz. `dequantize` and `quantize` take and give arrays shaped as
gguf-py's do: [..., bytes of a row] uint8 <-> [..., values of a row] float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

Q = GGMLQuantizationType


def _dequantize_q1_0(blocks: np.ndarray) -> np.ndarray:
    """[n, 18] blocks -> [n, 128] float32."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little")
    return np.where(bits.astype(bool), d, -d)


def _quantize_q1_0(values: np.ndarray) -> np.ndarray:
    """[n, 128] float32 -> [n, 18] blocks. The mean |x| is summed in order, in float32, as
    ggml's loop sums it (numpy's cumsum adds in order; its sum would add pairwise)."""
    total = np.cumsum(np.abs(values), axis=1, dtype=np.float32)[:, -1]
    d = (total / np.float32(128)).astype(np.float16)
    bits = np.packbits(values >= 0, axis=1, bitorder="little")
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), bits], axis=1)


@dataclass(frozen=True)
class PortedType:
    """A type gguf-py cannot (de)quantize: numpy over [blocks, bytes] <-> [blocks, values]."""

    dequantize: Callable[[np.ndarray], np.ndarray]
    quantize: Callable[[np.ndarray], np.ndarray]


PORTED: dict[GGMLQuantizationType, PortedType] = {
    Q.Q1_0: PortedType(_dequantize_q1_0, _quantize_q1_0),
}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.dequantize`, for the ported types too."""
    ported = PORTED.get(qtype)
    if ported is None:
        return quants.dequantize(raw, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = raw.view(np.uint8)
    if raw.shape[-1] % size:
        raise ValueError(f"{qtype.name} rows are whole {size}-byte blocks, got {raw.shape[-1]}")
    values = ported.dequantize(raw.reshape(-1, size))
    return values.reshape(*raw.shape[:-1], raw.shape[-1] // size * block)


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.quantize`, for the ported types too."""
    ported = PORTED.get(qtype)
    if ported is None:
        return quants.quantize(values, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    values = np.asarray(values, np.float32)
    if values.shape[-1] % block:
        raise ValueError(f"{qtype.name} rows are whole {block}-value blocks, "
                         f"got {values.shape[-1]}")
    raw = ported.quantize(values.reshape(-1, block))
    return raw.reshape(*values.shape[:-1], values.shape[-1] // block * size)
