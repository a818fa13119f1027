"""The cpu backend: the file's weights, kept in their GGUF blocks (or dequantized to
float32 on request), with the numpy ops and the compiled quantized kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType

from eagerlm.errors import InvalidParameters
from eagerlm.kernels.cpu_compile import start_compile
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES
from eagerlm.kernels.cpu_moe import ExpertMatrices
from eagerlm.kernels.cpu_threads import hold_blas_to_one_thread
from eagerlm.kernels.host_collective import HostCollective
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.quantized import QuantizedMatrix, dequantized_types
from eagerlm.kernels.weight_memory import available_memory, check_fits
from eagerlm.loader.gguf_file import GGUFFile, TensorInfo
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.sharding import Shard, ShardedFile
from eagerlm.loader.weights import build_weights, dequantize

WeightsMode = Literal["quantized", "float"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("quantized", "float")

CpuWeight = np.ndarray | QuantizedMatrix | ExpertMatrices


def keeps_blocks(info: TensorInfo, weights: WeightsMode) -> bool:
    """Whether the cpu backend holds this tensor as its blocks: every matrix not already
    float32 (and every 3-D expert tensor), in "quantized" mode; vectors (norms, biases)
    are float32 always."""
    return (weights == "quantized" and len(info.shape) in (2, 3)
            and info.qtype != GGMLQuantizationType.F32 and not info.name.endswith(".bias"))


def maps_in_place(info: TensorInfo, weights: WeightsMode) -> bool:
    """Whether the cpu backend reads this tensor in place from the file's map rather than
    copying it: the experts of a mixture of experts kept as blocks. A token reads only the
    experts its router picks, so most of a big MoE model's bytes are read rarely: mapped,
    they cost the page cache what is read, and a file near the machine's memory loads."""
    return len(info.shape) == 3 and keeps_blocks(info, weights)


def _in_place(f: GGUFFile | ShardedFile, info: TensorInfo, weights: WeightsMode) -> bool:
    """Whether this device reads the tensor in the file's map: `maps_in_place`, and under
    tensor parallelism a share that is a view of the file (`ShardedFile.in_place`: every
    expert's gate / up rows; a share of each expert's down columns is a copy)."""
    return maps_in_place(info, weights) and (not isinstance(f, ShardedFile)
                                             or f.in_place(info))


def held_bytes(model: ModelFile, weights: WeightsMode, shard: Shard | None = None) -> int:
    """Bytes the cpu backend holds for the file's weights as its own memory (one device's
    share of them with `shard`): the blocks where it keeps a copy of them, 4 bytes per
    value where it dequantizes; the mapped experts (`maps_in_place`) are the page cache's,
    not counted."""
    f = model.gguf if shard is None else ShardedFile(model.gguf, shard, model.config.head_dim)
    infos = [f.shard_info(name) if isinstance(f, ShardedFile) else info
             for name, info in f.tensors.items()]
    return sum(0 if _in_place(f, info, weights) else
               info.n_bytes if keeps_blocks(info, weights) else 4 * info.n_elements
               for info in infos)


def head_rows(w: CpuWeight, start: int, stop: int) -> CpuWeight:
    """Rows start .. stop - 1 of a matrix, without a copy: a tied lm head's share of the
    embedding table."""
    if isinstance(w, QuantizedMatrix):
        return QuantizedMatrix(w.qtype, (stop - start, w.shape[1]), w.blocks[start:stop])
    return w[start:stop]


def mapped_bytes(model: ModelFile, weights: WeightsMode) -> int:
    """Bytes of the file the cpu backend reads in place (`maps_in_place`)."""
    return sum(info.n_bytes for info in model.gguf.tensors.values()
               if maps_in_place(info, weights))


def cpu_transformer(model: ModelFile, on_bytes: Callable[[int, int], None] | None = None,
                    *, weights: WeightsMode = "quantized",
                    on_compile: Callable[[float | None], None] | None = None,
                    shard: Shard | None = None, collective: HostCollective | None = None,
                    context: int | None = None) -> Transformer[np.ndarray]:
    """The file's weights paired with numpy ops: with `weights="quantized"`, each matrix
    kept as the file's blocks (kernels/quantized.py's `QuantizedMatrix`), with "float" every
    weight dequantized to float32 (the reference path, four bytes per value).

    `on_bytes(done, total)` is called as tensors load (bytes of the file's tensor data), so
    a caller can show progress; it starts at (0, total) and ends at (total, total).
    `on_compile` is told None before the compiled kernels the model's types need are built
    (or read from numba's disk cache), and then the seconds it took. Raises ModelTooLarge,
    before loading anything, where the weights would not fit in memory.

    With `shard` (loader/sharding.py), only that device's share of the weights is loaded,
    and its ops reach the other devices of its group through `collective`
    (kernels/tensor_parallel.py's `cpu_group` builds every device of a group)."""
    if weights not in WEIGHTS_MODES:
        raise InvalidParameters(f"weights must be 'quantized' or 'float', not {weights!r}")
    held_as = "float32" if weights == "float" else "the file's blocks"
    check_fits(model, held_bytes(model, weights, shard), available_memory(),
               "the cpu backend", held_as,
               "run it on a GPU (--device cuda) or choose a smaller model")
    f = model.gguf if shard is None else ShardedFile(model.gguf, shard, model.config.head_dim)
    total = sum(info.n_bytes for info in f.tensors.values())
    done = 0

    def fetch(info: TensorInfo) -> CpuWeight:
        nonlocal done
        handle: CpuWeight
        in_place = _in_place(f, info, weights)
        if maps_in_place(info, weights):
            handle = ExpertMatrices.of(info.qtype, info.shape, f.mapped_bytes(info),
                                       mapped=in_place)
        elif keeps_blocks(info, weights):
            handle = QuantizedMatrix.of(info.qtype, info.shape, f.tensor_bytes(info))
        else:
            handle = dequantize(f, info)
        if not in_place:
            f.drop_pages(info)  # a copy: the mapped pages would count twice in the RSS
        done += info.n_bytes
        if on_bytes is not None:
            on_bytes(done, total)
        return handle

    # the kernels of the types held as blocks: a helper process starts compiling while
    # this one copies the weights (a type without kernels: `QuantizedMatrix.of` refuses
    # the file)
    held_types = {info.qtype for info in f.tensors.values()
                  if keeps_blocks(info, weights) and info.qtype in BLOCK_TYPES}
    embedding = f.tensors.get("token_embd.weight")
    float32 = any(len(info.shape) == 2 and not keeps_blocks(info, weights)
                  for info in f.tensors.values())  # products by F32's row kernel
    compiling = start_compile(held_types, dequantized_types(
        held_types, None if embedding is None else embedding.qtype),
        experts=model.config.moe is not None, float32=float32)
    if on_bytes is not None:
        on_bytes(0, total)
    held = build_weights(f, model.config,
                         fetch if not isinstance(f, ShardedFile) else f.fetching(fetch))
    config = model.config
    if shard is not None:
        config = shard.local_config(config)
        if shard.vocab_parallel and model.config.tied_embeddings:
            held.output = head_rows(held.token_embd, *shard.vocab)
    if on_bytes is not None:
        on_bytes(total, total)  # tensors the architecture does not use count as done
    if on_compile is not None:
        on_compile(None)
    seconds = compiling.finish()
    if on_compile is not None:
        on_compile(seconds)
    # the products split themselves over the cores; after the compiles, as numba may load
    # SciPy's BLAS too
    hold_blas_to_one_thread()
    return Transformer(config, held, NumpyOps(collective), context=context)
