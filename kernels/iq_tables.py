"""The lookup tables of the IQ quantization types, from gguf-py: for the cpu decoders
(kernels/cpu_block_decoders.py, as arrays) and as a CUDA header.

The IQ types (llama.cpp's "i-quants") store indices into fixed grids of 4 or 8 values, sign
patterns indexed through a table, and (IQ4) a non-linear 16-value codebook. The kernels
need those tables; gguf-py's `quants.py` is what the engine already trusts for
dequantization (the float reference path and every reference in the tests go through
it), so it is the single source of truth: the cpu decoders read `grid_words`,
`sign_patterns` and `iq4_codebook`, and `kernels/cuda/iq_tables.cuh` is generated from
the same:

    python -m eagerlm.kernels.iq_tables          # rewrite the header
    python -m eagerlm.kernels.iq_tables --check  # exit 1 if the committed header is stale

The header is committed rather than generated at build time because both compilers read
`kernels/cuda/` as it is: NVRTC (whose cubin cache keys on the headers' text) and the
emulated GPU's g++ build; neither has to know that a file is generated, and an installed
package needs no build step. tests/test_kernel_build.py checks that the committed header
is what this module makes from the installed gguf now.

The tables are `__device__` globals, not `__constant__`: each thread of a warp looks up a
different grid entry, and the constant cache serializes divergent addresses, while global
loads go through L1. (They total 34 KiB, within the 64 KiB of constant memory anyway.)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from gguf import quants

from eagerlm.kernels.nvrtc_build import KERNEL_DIR

HEADER = KERNEL_DIR / "iq_tables.cuh"

# (C name, gguf-py class, bytes per entry): each grid entry is one unsigned integer whose
# byte k is value k of the entry (as ggml-common.h stores them); IQ1 values are int8.
_GRIDS: tuple[tuple[str, type, int], ...] = (
    ("iq2xxs_grid", quants.IQ2_XXS, 8),
    ("iq2xs_grid", quants.IQ2_XS, 8),
    ("iq2s_grid", quants.IQ2_S, 8),
    ("iq3xxs_grid", quants.IQ3_XXS, 4),
    ("iq3s_grid", quants.IQ3_S, 4),
    ("iq1s_grid", quants.IQ1_S, 8),  # IQ1_M uses the same grid (gguf-py: IQ1_S's grid_hex)
)


def grid_values(cls: type) -> np.ndarray:
    """gguf-py's grid of an IQ type as integers, [entries, values per entry]."""
    cls.init_grid()  # type: ignore[attr-defined]
    grid = np.asarray(cls.grid).reshape(cls.grid_shape)  # type: ignore[attr-defined]
    as_int = grid.astype(np.int64)
    if not np.array_equal(as_int, grid) or as_int.min() < -128 or as_int.max() > 255:
        raise ValueError(f"{cls.__name__}'s grid does not hold bytes; the header cannot "
                         "store it as they are")
    return as_int


def grid_words(cls: type, width: int) -> np.ndarray:
    """gguf-py's grid of an IQ type, each entry's values as one little-endian integer of
    `width` bytes (uint64 or uint32; int8 values as their two's-complement bytes): the
    layout both the CUDA header and the cpu decoders (kernels/cpu_block_decoders.py) read."""
    return _words(grid_values(cls), width)


def _words(byte_rows: np.ndarray, width: int) -> np.ndarray:
    """Each row of `width` bytes (int8 as its two's complement) as one little-endian
    integer: uint64 for 8 bytes a row, uint32 for 4."""
    as_bytes = (np.asarray(byte_rows, np.int64) & 0xFF).astype(np.uint64)
    shifts = (8 * np.arange(width, dtype=np.uint64))[None, :]
    words = np.bitwise_or.reduce(as_bytes << shifts, axis=1)
    return words.astype(np.uint64 if width == 8 else np.uint32)


def sign_patterns() -> np.ndarray:
    """IQ2 / IQ3's 128 sign patterns (bit k set: value k of an 8-value group negated)."""
    return np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()


def sign_masks() -> np.ndarray:
    """The sign patterns as uint64 words of 8 byte lanes, 0xFF where a value is negated:
    one table load per 8 values where a pattern byte took a load and the spreading of its
    bits over the lanes."""
    bits = (sign_patterns()[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return _words(bits * 0xFF, 8)


def iq4_codebook() -> np.ndarray:
    """The IQ4_NL / IQ4_XS codebook, int8."""
    return np.array(quants.IQ4_NL.kvalues, dtype=np.int8)


def _array(ctype: str, name: str, values: Sequence[int], digits: int, per_line: int) -> str:
    rows = [", ".join(f"0x{v:0{digits}x}" for v in values[i:i + per_line])
            for i in range(0, len(values), per_line)]
    body = ",\n".join("    " + r for r in rows)
    return f"static const __device__ {ctype} {name}[{len(values)}] = {{\n{body},\n}};\n"


# (macro name, gguf-py class with `kvalues`)
_CODEBOOKS: tuple[tuple[str, type], ...] = (
    ("KVALUES_IQ4NL", quants.IQ4_NL),
    ("KVALUES_MXFP4", quants.MXFP4),  # NVFP4's too (checked in render_header)
)


def _codebook(name: str, cls: type) -> str:
    values = [int(v) for v in cls.kvalues]  # type: ignore[attr-defined]
    if len(values) != 16 or min(values) < -128 or max(values) > 127:
        raise ValueError(f"{cls.__name__}'s codebook is not 16 int8 values")
    words = [sum((v & 0xFF) << (8 * k) for k, v in enumerate(values[i:i + 4]))
             for i in range(0, 16, 4)]
    listed = ", ".join(str(v) for v in values)
    return (f"// {listed}\n#define {name} " + ", ".join(f"0x{w:08x}u" for w in words) + "\n")


def render_header() -> str:
    """The text of `iq_tables.cuh` from the installed gguf's tables."""
    parts = [
        "// IQ quantization tables, generated by kernels/iq_tables.py from gguf-py's\n"
        "// quants.py (grids, sign patterns, 4-bit codebooks). Do not edit: run\n"
        "// `python -m eagerlm.kernels.iq_tables`. tests/test_kernel_build.py checks this file\n"
        "// against the generator.\n"
        "//\n"
        "// Grid entry i of a type is one integer whose byte k is value k of the entry\n"
        "// (iq1s_grid's bytes are int8: -1, 0, 1).\n"
        "#pragma once\n",
    ]
    for name, cls, width in _GRIDS:
        ctype = "unsigned long long" if width == 8 else "unsigned int"
        parts.append(_array(ctype, name, [int(v) for v in grid_words(cls, width)], 2 * width,
                            4 if width == 8 else 8))
    ksigns = [int(v) for v in sign_patterns()]
    parts.append("// Sign patterns: bit k set = value k of an 8-value group is negated.\n"
                 + _array("unsigned char", "ksigns_iq2xs", ksigns, 2, 16))
    if tuple(quants.NVFP4.kvalues) != tuple(quants.MXFP4.kvalues):
        raise ValueError("NVFP4's codebook is no longer MXFP4's: give it its own")
    parts.append(
        "// The 16-value codebooks of the 4-bit non-linear types, each as four words of four\n"
        "// int8 values (value i is byte i % 4 of word i / 4), the arguments of\n"
        "// quant_blocks.cuh's byte-permute lookup: IQ4_NL / IQ4_XS's, and MXFP4 / NVFP4's\n"
        "// E2M1 values doubled.\n"
        + "".join(_codebook(name, cls) for name, cls in _CODEBOOKS))
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    text = render_header()
    if args == ["--check"]:
        if HEADER.read_text() != text:
            print(f"{HEADER} is stale: run python -m eagerlm.kernels.iq_tables", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m eagerlm.kernels.iq_tables [--check]", file=sys.stderr)
        return 2
    HEADER.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
