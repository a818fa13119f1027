"""The cpu backend: float32 numpy weights and the numpy reference ops."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from eagerlm.kernels.model import Transformer
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.weight_memory import available_memory, check_fits, n_parameters
from eagerlm.loader.gguf_file import TensorInfo
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.weights import build_weights, dequantize


def cpu_transformer(model: ModelFile, on_bytes: Callable[[int, int], None] | None = None
                    ) -> Transformer[np.ndarray]:
    """Dequantize every weight of the file to float32 and pair them with numpy ops.

    `on_bytes(done, total)` is called as tensors load (bytes of the file's tensor data), so
    a caller can show progress; it starts at (0, total) and ends at (total, total). Raises
    ModelTooLarge, before loading anything, where the weights would not fit in memory."""
    check_fits(model, 4 * n_parameters(model), available_memory(), "the cpu backend",
               "float32", "run it on a GPU (--device cuda) or choose a smaller model")
    f = model.gguf
    total = sum(info.n_bytes for info in f.tensors.values())
    done = 0

    def fetch(info: TensorInfo) -> np.ndarray:
        nonlocal done
        array = dequantize(f, info)
        done += info.n_bytes
        if on_bytes is not None:
            on_bytes(done, total)
        return array

    if on_bytes is not None:
        on_bytes(0, total)
    weights = build_weights(f, model.config, fetch)
    if on_bytes is not None:
        on_bytes(total, total)  # tensors the architecture does not use count as done
    return Transformer(model.config, weights, NumpyOps())
