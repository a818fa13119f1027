"""The cuda backend: weights through the pinned slab loader, dequantized on the GPU, and the
same `Transformer` as the cpu backend with `CudaOps`.

What a tensor of the file becomes (`CudaWeights`): matrices are bf16 (the GEMMs' input
type), vectors (norms, biases, rope frequency factors) float32. A BF16 matrix or an F32
vector is uploaded as it is into its own buffer; everything else is uploaded raw and
expanded by a dequantization kernel on the loader's stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from gguf import GGMLQuantizationType

from eagerlm.kernels.cuda_ops import CudaOps
from eagerlm.kernels.device_tensor import DeviceTensor
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.weight_memory import check_fits
from eagerlm.loader.errors import UnsupportedTensorType
from eagerlm.loader.gguf_file import TensorInfo
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.slab_loader import LoadStats, SlabLoader
from eagerlm.loader.weights import ModelWeights, build_weights
from eagerlm.vmm.device import DeviceBuffer, Memory, Stream

Q = GGMLQuantizationType
DEQUANT_KERNEL = {
    Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1",
    Q.Q5_0: "q5_0", Q.Q5_1: "q5_1", Q.Q8_0: "q8_0", Q.Q2_K: "q2_k", Q.Q3_K: "q3_k",
    Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k", Q.IQ2_XXS: "iq2_xxs", Q.IQ2_XS: "iq2_xs",
    Q.IQ2_S: "iq2_s", Q.IQ3_XXS: "iq3_xxs", Q.IQ3_S: "iq3_s", Q.IQ1_S: "iq1_s",
    Q.IQ1_M: "iq1_m", Q.IQ4_NL: "iq4_nl", Q.IQ4_XS: "iq4_xs",
}


def weight_dtype(info: TensorInfo) -> str:
    return "f32" if len(info.shape) == 1 else "bf16"


class CudaWeights:
    """The slab loader's WeightBuilder for cuda: upload as is, or dequantize on the GPU."""

    def __init__(self, ops: CudaOps, path: str = "") -> None:
        self.ops = ops
        self.path = path

    def is_final(self, info: TensorInfo) -> bool:
        dtype = weight_dtype(info)
        return (dtype, info.qtype) in (("bf16", Q.BF16), ("f32", Q.F32))

    def wrap(self, buffer: DeviceBuffer, info: TensorInfo) -> DeviceTensor:
        return DeviceTensor(buffer.ptr, info.shape, weight_dtype(info), buffer)

    def expand(self, stream: Stream, raw: Memory, info: TensorInfo) -> DeviceTensor:
        kind = DEQUANT_KERNEL.get(info.qtype)
        if kind is None:
            raise UnsupportedTensorType(
                f"tensor {info.name!r} uses ggml type {info.qtype.name}, which the cuda "
                "backend cannot dequantize", path=self.path, field=info.name)
        dtype = weight_dtype(info)
        n = info.n_elements
        out = self.ops.device.alloc(n * (2 if dtype == "bf16" else 4))
        grid = max(1, min(-(-n // 256), self.ops.sm_count * 64))
        self.ops.kernels[f"dequant_{kind}_{dtype}"].launch(
            stream.handle, grid, 256, out.ptr, raw.ptr, n)  # type: ignore[attr-defined]
        return DeviceTensor(out.ptr, info.shape, dtype, out)


def device_weight_bytes(model: ModelFile) -> int:
    """What the weights take on the device (bf16 matrices, float32 vectors)."""
    return sum(info.n_elements * (2 if weight_dtype(info) == "bf16" else 4)
               for info in model.gguf.tensors.values())


def load_cuda_weights(model: ModelFile, ops: CudaOps, *,
                      on_bytes: Callable[[int, int], None] | None = None,
                      **loader_options: Any) -> tuple[ModelWeights[DeviceTensor], LoadStats]:
    """Every weight of the file on the device, through the slab loader; ModelTooLarge,
    before anything is uploaded, where they would not fit in the device's free memory.
    `on_bytes(done, total)` reports the upload as `cpu_transformer` reports its load."""
    check_fits(model, device_weight_bytes(model), ops.device.mem_info()[0], "the cuda backend",
               "bf16", "choose a smaller model (the cpu backend holds twice as much)")
    loader = SlabLoader(ops.device, model.gguf, CudaWeights(ops, model.path),
                        on_bytes=on_bytes, **loader_options)
    try:
        weights = build_weights(model.gguf, model.config, loader.fetch)
    finally:
        stats = loader.finish()
    if on_bytes is not None:
        on_bytes(loader.total_bytes, loader.total_bytes)  # unused tensors count as done
    return weights, stats


def cuda_transformer(model: ModelFile, device: Any = None, *,
                     on_bytes: Callable[[int, int], None] | None = None,
                     ops: CudaOps | None = None) -> Transformer[DeviceTensor]:
    """The model on a CUDA device (the first one when `device` is None); `on_bytes` as for
    `load_cuda_weights`, and with it the loader's report on stderr."""
    if ops is None:
        if device is None:
            from eagerlm.vmm.device import open_device

            device = open_device("cuda")
        ops = CudaOps(device)
    weights, stats = load_cuda_weights(model, ops, on_bytes=on_bytes)
    if on_bytes is not None:
        print(stats.report(), file=sys.stderr)
    ops.lm_head = weights.output
    return Transformer(model.config, weights, ops)


def free_weights(weights: ModelWeights[DeviceTensor]) -> None:
    """Give the weights' device memory back (after the last forward that uses them)."""
    for w in weights.handles():
        free = getattr(w.owner, "free", None)
        if free is not None:
            free()
