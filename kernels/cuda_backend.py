"""The cuda backend: weights through the pinned slab loader, kept in their GGUF blocks or
dequantized on the GPU, and the same `Transformer` as the cpu backend with `CudaOps`.

What a tensor of the file becomes (`CudaWeights`), with `weights="quantized"` (the
default): a matrix of a type whose row in kernels/cuda_weight_types.py says "blocks" (every
block type, and F16) is uploaded as it is into its own buffer and held as such
(`DeviceQuantizedMatrix`, kernels/cuda_quantized.py: a fused dequantizing GEMV for decode,
bf16 tiles and cuBLASLt for prefill); a BF16 or F32 matrix is bf16 (the rows say why). With
`weights="bf16"`, the path before quantized weights: every matrix bf16, the GEMMs' input
type. Vectors (norms, biases, rope frequency factors) are float32 in both. A BF16 matrix or
an F32 vector is uploaded as it is; everything else is uploaded raw and expanded by its
type's dequantization kernel on the loader's stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

from gguf import GGMLQuantizationType as Q

from eagerlm.errors import InvalidParameters
from eagerlm.kernels.cuda_moe import DeviceExperts, check_moe
from eagerlm.kernels.cuda_ops import CudaOps
from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix, tile_bytes
from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES
from eagerlm.kernels.device_tensor import DeviceTensor
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.weight_memory import check_fits
from eagerlm.loader.errors import UnsupportedTensorType
from eagerlm.loader.gguf_file import TensorInfo
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.sharding import Shard, ShardedFile
from eagerlm.loader.slab_loader import LoadStats, SlabLoader
from eagerlm.loader.weights import ModelWeights, build_weights
from eagerlm.vmm.device import DeviceBuffer, Memory, Stream

CudaWeightsMode = Literal["quantized", "bf16"]
CUDA_WEIGHTS_MODES: tuple[CudaWeightsMode, ...] = ("quantized", "bf16")

CudaWeight = DeviceTensor | DeviceQuantizedMatrix | DeviceExperts


def weight_dtype(info: TensorInfo) -> str:
    """float32 for vectors, biases (the experts' are [n_experts, out]) and a mixture of
    experts' router (moe_route reads it as float32: routing is a choice, kept exact);
    bf16 for the other matrices."""
    if (len(info.shape) == 1 or info.name.endswith(".bias")
            or info.name.endswith("ffn_gate_inp.weight")):
        return "f32"
    return "bf16"


def keeps_blocks(info: TensorInfo, weights: CudaWeightsMode) -> bool:
    """Whether the cuda backend holds this tensor as the file's bytes: in "quantized" mode,
    every matrix (and 3-D expert tensor) of a type held as "blocks"
    (kernels/cuda_weight_types.py: all but BF16 and F32, whose matrices are bf16), not
    a router or a bias (float32); vectors are float32 always."""
    t = WEIGHT_TYPES.get(info.qtype)
    return (weights == "quantized" and len(info.shape) in (2, 3) and t is not None
            and t.held == "blocks" and weight_dtype(info) == "bf16")


def check_weights_mode(weights: str) -> CudaWeightsMode:
    if weights not in CUDA_WEIGHTS_MODES:
        raise InvalidParameters(f"the cuda backend's weights are 'quantized' or 'bf16', "
                                f"not {weights!r}")
    return weights  # type: ignore[return-value]


class CudaWeights:
    """The slab loader's WeightBuilder for cuda: upload as is (blocks kept as blocks, bf16
    matrices, float32 vectors), or dequantize on the GPU."""

    def __init__(self, ops: CudaOps, path: str = "",
                 weights: CudaWeightsMode = "quantized") -> None:
        self.ops = ops
        self.path = path
        self.weights = weights

    def is_final(self, info: TensorInfo) -> bool:
        dtype = weight_dtype(info)
        return keeps_blocks(info, self.weights) or \
            (dtype, info.qtype) in (("bf16", Q.BF16), ("f32", Q.F32))

    def wrap(self, buffer: DeviceBuffer, info: TensorInfo) -> CudaWeight:
        if keeps_blocks(info, self.weights):
            if len(info.shape) == 3:
                n, rows, cols = info.shape
                return DeviceExperts(buffer.ptr, info.qtype, (n, rows, cols), buffer)
            rows, cols = info.shape
            return DeviceQuantizedMatrix(buffer.ptr, info.qtype, (rows, cols), buffer)
        return _tensor(buffer, info, weight_dtype(info))

    def expand(self, stream: Stream, raw: Memory, info: TensorInfo) -> DeviceTensor:
        t = WEIGHT_TYPES.get(info.qtype)
        if t is None:
            raise UnsupportedTensorType(
                f"tensor {info.name!r} uses ggml type {info.qtype.name}, which the cuda "
                "backend cannot dequantize", path=self.path, field=info.name)
        dtype = weight_dtype(info)
        n = info.n_elements
        out = self.ops.device.alloc(n * (2 if dtype == "bf16" else 4))
        grid = max(1, min(-(-t.dequant_threads(n) // 256), self.ops.sm_count * 64))
        self.ops.kernels[t.dequant(dtype)].launch(
            stream.handle, grid, 256, out.ptr, raw.ptr, n)  # type: ignore[attr-defined]
        return _tensor(out, info, dtype)


def _tensor(memory: Any, info: TensorInfo, dtype: str) -> DeviceTensor | DeviceExperts:
    """A tensor of values on the device: 3-D experts (as bf16) the MoE kernels' way."""
    if len(info.shape) == 3 and dtype == "bf16":
        n, rows, cols = info.shape
        return DeviceExperts(memory.ptr, Q.BF16, (n, rows, cols), memory)
    return DeviceTensor(memory.ptr, info.shape, dtype, memory)


def device_weight_bytes(model: ModelFile, weights: CudaWeightsMode = "quantized",
                        shard: Shard | None = None) -> int:
    """What the weights take on the device (one device's share with `shard`): the blocks
    where they are kept, bf16 for the other matrices, float32 vectors, and the quantized
    tile path's scratch."""
    tensors = list(model.gguf.tensors.values())
    if shard is not None:
        view = ShardedFile(model.gguf, shard, model.config.head_dim)
        tensors = [view.shard_info(info.name) for info in tensors]
    held = sum(info.n_bytes if keeps_blocks(info, weights)
               else info.n_elements * (2 if weight_dtype(info) == "bf16" else 4)
               for info in tensors)
    return held + tile_bytes((info.shape[0], info.shape[1]) for info in tensors
                             if keeps_blocks(info, weights) and len(info.shape) == 2)


def load_cuda_weights(model: ModelFile, ops: CudaOps, *,
                      on_bytes: Callable[[int, int], None] | None = None,
                      weights: CudaWeightsMode = "quantized", shard: Shard | None = None,
                      **loader_options: Any) -> tuple[ModelWeights[CudaWeight], LoadStats]:
    """Every weight of the file on the device, through the slab loader (`weights`: see
    the module's docstring), and the tile scratch the blocks need; ModelTooLarge, before
    anything is uploaded, where they would not fit in the device's free memory.
    `on_bytes(done, total)` reports the upload as `cpu_transformer` reports its load.
    With `shard`, only that device's share is read and uploaded (loader/sharding.py)."""
    weights = check_weights_mode(weights)
    held_as = "bf16" if weights == "bf16" else "the file's blocks (bf16 for F32 and BF16 matrices)"
    advice = ("choose a smaller model" if weights == "quantized" else
              "keep them quantized (--weights quantized) or choose a smaller model")
    check_fits(model, device_weight_bytes(model, weights, shard), ops.device.mem_info()[0],
               "the cuda backend", held_as, advice)
    f = model.gguf if shard is None else ShardedFile(model.gguf, shard, model.config.head_dim)
    loader = SlabLoader(ops.device, f, CudaWeights(ops, model.path, weights),  # type: ignore[arg-type]
                        on_bytes=on_bytes, **loader_options)
    try:
        held = build_weights(f, model.config, loader.fetch if shard is None else
                             f.fetching(loader.fetch))  # type: ignore[union-attr]
    finally:
        stats = loader.finish()
    if shard is not None and shard.vocab_parallel and model.config.tied_embeddings:
        held.output = head_rows(held.token_embd, *shard.vocab)
    ops.quantized.reserve(w for w in held.handles() if isinstance(w, DeviceQuantizedMatrix))
    experts = {w.type.module for w in held.handles() if isinstance(w, DeviceExperts)}
    if experts:  # the MoE kernels too, at load (as `reserve` says why)
        ops.kernels.load_modules(sorted({"moe", "elementwise", *experts}))
    if on_bytes is not None:
        on_bytes(loader.total_bytes, loader.total_bytes)  # unused tensors count as done
    return held, stats


def head_rows(w: CudaWeight, start: int, stop: int) -> CudaWeight:
    """Rows start .. stop - 1 of a matrix on the device, sharing its memory (a tied lm
    head's share of the embedding table)."""
    if isinstance(w, DeviceQuantizedMatrix):
        row_bytes = w.row_bytes
        return DeviceQuantizedMatrix(w.ptr + start * row_bytes, w.qtype,
                                     (stop - start, w.shape[1]), None)
    return w.view_at(start * w.shape[1] * w.itemsize, (stop - start, w.shape[1]), w.dtype)


def cuda_transformer(model: ModelFile, device: Any = None, *,
                     on_bytes: Callable[[int, int], None] | None = None,
                     ops: CudaOps | None = None,
                     weights: CudaWeightsMode = "quantized",
                     shard: Shard | None = None,
                     context: int | None = None) -> Transformer[CudaWeight]:
    """The model on a CUDA device (the first one when `device` is None); `on_bytes` as for
    `load_cuda_weights`, and with it the loader's report on stderr; `weights` "quantized"
    (the default: matrices kept as their blocks) or "bf16". With `shard`, the device's
    share of a tensor-parallel group (its `ops` carry the group's NCCL communicator).
    `context` as for `Transformer` (LongRoPE's factors)."""
    if model.config.moe is not None:
        check_moe(model.config.moe, model.config.d_model)
    if ops is None:
        if device is None:
            from eagerlm.vmm.device import open_device

            device = open_device("cuda")
        ops = CudaOps(device)
    held, stats = load_cuda_weights(model, ops, on_bytes=on_bytes, weights=weights,
                                    shard=shard)
    if on_bytes is not None:
        print(stats.report(), file=sys.stderr)
    ops.lm_head = held.output
    config = model.config if shard is None else shard.local_config(model.config)
    return Transformer(config, held, ops, context=context)  # type: ignore[arg-type]


def free_weights(weights: ModelWeights[CudaWeight]) -> None:
    """Give the weights' device memory back (after the last forward that uses them)."""
    for w in weights.handles():
        free = getattr(w.owner, "free", None)
        if free is not None:
            free()
