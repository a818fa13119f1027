"""The cpu backend: the file's weights, kept in their GGUF blocks (or dequantized to
float32 on request), with the numpy ops and the compiled quantized kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType

from eagerlm.errors import InvalidParameters
from eagerlm.kernels.cpu_compile import compile_kernels
from eagerlm.kernels.cpu_threads import hold_blas_to_one_thread
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.quantized import QuantizedMatrix
from eagerlm.kernels.weight_memory import available_memory, check_fits
from eagerlm.loader.gguf_file import TensorInfo
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.weights import build_weights, dequantize

WeightsMode = Literal["quantized", "float"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("quantized", "float")

CpuWeight = np.ndarray | QuantizedMatrix


def keeps_blocks(info: TensorInfo, weights: WeightsMode) -> bool:
    """Whether the cpu backend holds this tensor as its blocks: every matrix not already
    float32, in "quantized" mode; vectors (norms, biases) are float32 always."""
    return (weights == "quantized" and len(info.shape) == 2
            and info.qtype != GGMLQuantizationType.F32)


def held_bytes(model: ModelFile, weights: WeightsMode) -> int:
    """Bytes the cpu backend holds for the file's weights: the blocks where it keeps them,
    4 bytes per value where it dequantizes."""
    return sum(info.n_bytes if keeps_blocks(info, weights) else 4 * info.n_elements
               for info in model.gguf.tensors.values())


def cpu_transformer(model: ModelFile, on_bytes: Callable[[int, int], None] | None = None,
                    *, weights: WeightsMode = "quantized",
                    on_compile: Callable[[float | None], None] | None = None,
                    ) -> Transformer[np.ndarray]:
    """The file's weights paired with numpy ops: with `weights="quantized"`, each matrix
    kept as the file's blocks (kernels/quantized.py's `QuantizedMatrix`), with "float" every
    weight dequantized to float32 (the reference path, four bytes per value).

    `on_bytes(done, total)` is called as tensors load (bytes of the file's tensor data), so
    a caller can show progress; it starts at (0, total) and ends at (total, total).
    `on_compile` is told None before the compiled kernels the model's types need are built
    (or read from numba's disk cache), and then the seconds it took. Raises ModelTooLarge,
    before loading anything, where the weights would not fit in memory."""
    if weights not in WEIGHTS_MODES:
        raise InvalidParameters(f"weights must be 'quantized' or 'float', not {weights!r}")
    held_as = "float32" if weights == "float" else "the file's blocks"
    check_fits(model, held_bytes(model, weights), available_memory(), "the cpu backend",
               held_as, "run it on a GPU (--device cuda) or choose a smaller model")
    f = model.gguf
    total = sum(info.n_bytes for info in f.tensors.values())
    done = 0

    def fetch(info: TensorInfo) -> CpuWeight:
        nonlocal done
        handle: CpuWeight
        if keeps_blocks(info, weights):
            handle = QuantizedMatrix.of(info.qtype, info.shape, f.tensor_bytes(info.name))
        else:
            handle = dequantize(f, info)
        f.drop_pages(info.name)  # a copy: the mapped pages would count twice in the RSS
        done += info.n_bytes
        if on_bytes is not None:
            on_bytes(done, total)
        return handle

    if on_bytes is not None:
        on_bytes(0, total)
    held = build_weights(f, model.config, fetch)
    if on_bytes is not None:
        on_bytes(total, total)  # tensors the architecture does not use count as done
    types = {w.qtype for w in held.handles() if isinstance(w, QuantizedMatrix)}
    if on_compile is not None:
        on_compile(None)
    seconds = compile_kernels(types)
    if on_compile is not None:
        on_compile(seconds)
    # the products split themselves over the cores; after the compiles, as numba may load
    # SciPy's BLAS too
    hold_blas_to_one_thread()
    return Transformer(model.config, held, NumpyOps())
