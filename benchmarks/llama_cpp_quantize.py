"""GGUF files of every weight type, written by llama.cpp's own quantizer.

Why: eagerlm's kernels must be measured (and its logits checked) on files as people get
them, and those are written by llama.cpp: its recipes decide which tensor gets which type
(a Q4_K_M file holds Q4_K, Q6_K and Q5_0 where rows are not whole superblocks; an IQ2_XXS
file keeps its LM head in Q5_K), and its quantizers decide the blocks. So the benchmark
(benchmarks/bench_types.py) and the logits fixtures (tests/fixtures/make_types_reference.py)
write a float base model with loader/synthetic.py and hand it to
`llama_model_quantize` (llama-cpp-python 0.3.36, the `reference` extra, imported lazily),
as the `llama-quantize` tool does.

A recipe is llama.cpp's file type (`llama-quantize`'s argument: Q4_K_M, IQ2_XXS, ...). The
IQ1 / IQ2 / IQ3_XXS recipes (and Q2_K_S) need an importance matrix: llama.cpp refuses to
write those types without one. We give it a uniform one (every column weighted 1), which
makes its quantizer minimize the plain squared error of each row, as it does for the other
types: a synthetic model has no calibration text whose activations would say which
columns matter more.

MXFP4 has no dense-model recipe in llama.cpp (its MXFP4_MOE recipe puts only MoE experts
in MXFP4 and the rest in Q8_0), so its recipe here is `--pure`: every matrix in MXFP4.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType, LlamaFileType

Q = GGMLQuantizationType
F = LlamaFileType


@dataclass(frozen=True)
class Recipe:
    """One of llama.cpp's file types: its `llama_ftype`, the type most matrices get (what
    loader/synthetic.py writes for it when llama.cpp is not there), whether every matrix
    gets that type (`pure`), and whether llama.cpp needs an importance matrix for it."""

    name: str
    ftype: LlamaFileType
    qtype: GGMLQuantizationType
    pure: bool = False
    needs_imatrix: bool = False


def _r(name: str, qtype: GGMLQuantizationType, ftype: str | None = None, **kw: bool) -> Recipe:
    return Recipe(name, F[ftype or f"MOSTLY_{name}"], qtype, **kw)


# Every recipe, by name, in llama-quantize's spelling. `ALL_TYPES` picks one recipe for each
# ggml type llama.cpp writes (the K-quants as their _M mixes, as people download them).
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _r("F32", Q.F32, "ALL_F32"),
    _r("F16", Q.F16),
    _r("BF16", Q.BF16),
    _r("Q8_0", Q.Q8_0),
    _r("Q6_K", Q.Q6_K),
    _r("Q5_K_M", Q.Q5_K),
    _r("Q5_K_S", Q.Q5_K),
    _r("Q5_1", Q.Q5_1),
    _r("Q5_0", Q.Q5_0),
    _r("Q4_K_M", Q.Q4_K),
    _r("Q4_K_S", Q.Q4_K),
    _r("Q4_1", Q.Q4_1),
    _r("Q4_0", Q.Q4_0),
    _r("IQ4_NL", Q.IQ4_NL),
    _r("IQ4_XS", Q.IQ4_XS),
    _r("Q3_K_L", Q.Q3_K),
    _r("Q3_K_M", Q.Q3_K),
    _r("Q3_K_S", Q.Q3_K),
    _r("IQ3_M", Q.IQ3_S),
    _r("IQ3_S", Q.IQ3_S),
    _r("IQ3_XS", Q.IQ3_S, needs_imatrix=True),
    _r("IQ3_XXS", Q.IQ3_XXS, needs_imatrix=True),
    _r("Q2_K", Q.Q2_K),
    _r("Q2_K_S", Q.Q2_K, needs_imatrix=True),
    _r("IQ2_M", Q.IQ2_S, needs_imatrix=True),
    _r("IQ2_S", Q.IQ2_XS, needs_imatrix=True),  # llama.cpp's IQ2_S recipe is mostly IQ2_XS
    _r("IQ2_XS", Q.IQ2_XS, needs_imatrix=True),
    _r("IQ2_XXS", Q.IQ2_XXS, needs_imatrix=True),
    _r("IQ1_M", Q.IQ1_M, needs_imatrix=True),
    _r("IQ1_S", Q.IQ1_S, needs_imatrix=True),
    _r("TQ2_0", Q.TQ2_0),
    _r("TQ1_0", Q.TQ1_0),
    _r("MXFP4", Q.MXFP4, "MOSTLY_MXFP4_MOE", pure=True),
    _r("NVFP4", Q.NVFP4),
    _r("Q1_0", Q.Q1_0),
)}
ALL_TYPES: tuple[str, ...] = (
    "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0",
    "IQ4_NL", "IQ4_XS", "Q3_K_M", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_M", "IQ2_XS", "IQ2_XXS",
    "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0", "MXFP4", "NVFP4", "Q1_0", "F32")


class QuantizeError(RuntimeError):
    """llama.cpp refused or failed to write the file (its last log lines attached)."""


_log_tail: deque[str] = deque(maxlen=40)
_LOG_CALLBACK = None  # kept alive for as long as llama.cpp may call it


def _capture_logs() -> None:
    """Keep llama.cpp's log (a line per tensor while quantizing) off the terminal, its
    tail at hand for an error message."""
    global _LOG_CALLBACK
    import llama_cpp

    if _LOG_CALLBACK is None:
        def keep(level: int, text: bytes, data: object) -> None:
            _log_tail.append(text.decode(errors="replace"))
        _LOG_CALLBACK = llama_cpp.llama_log_callback(keep)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def uniform_imatrix(base: Path) -> list[tuple[str, int]]:
    """(tensor name, values per row) of every matrix of the base file: the entries of a
    uniform importance matrix (one weight per input column)."""
    from eagerlm.loader.gguf_file import GGUFFile

    with GGUFFile.open(base) as f:
        return [(name, info.shape[-1]) for name, info in f.tensors.items()
                if len(info.shape) == 2]


def quantize(base: Path, out: Path, recipe: Recipe, threads: int = 2) -> Path:
    """Write `out`, the float model `base` in `recipe`, with llama.cpp's quantizer."""
    import llama_cpp
    import numpy as np

    _capture_logs()
    _log_tail.clear()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = int(recipe.ftype)
    params.pure = recipe.pure
    keep: list[object] = []  # what the imatrix table points into, alive through the call
    if recipe.needs_imatrix:
        entries = uniform_imatrix(base)
        table = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for row, (name, n) in zip(table, entries):
            ones = np.ones(n, np.float32)
            keep += [ones, name.encode()]
            row.name = keep[-1]
            row.data = ones.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            row.size = n
        table[len(entries)].name = None  # the end of the table
        params.imatrix = table
        keep.append(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(base).encode(), str(out).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        out.unlink(missing_ok=True)
        tail = "".join(_log_tail).strip().splitlines()[-6:]
        raise QuantizeError(f"llama.cpp could not write {recipe.name} (code {rc}): "
                            + " | ".join(tail))
    return out
