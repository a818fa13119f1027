"""The cpu backend: float32 numpy weights and the numpy reference ops."""

from __future__ import annotations

import numpy as np

from kernels.model import Transformer
from kernels.numpy_ops import NumpyOps
from loader.model_file import ModelFile
from loader.weights import load_numpy_weights


def cpu_transformer(model: ModelFile) -> Transformer[np.ndarray]:
    """Dequantize every weight of the file to float32 and pair them with numpy ops."""
    return Transformer(model.config, load_numpy_weights(model.gguf, model.config), NumpyOps())
