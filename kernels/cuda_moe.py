"""The mixture-of-experts FFN on a CUDA device: its expert tensors as held, and
`CudaOps.moe_ffn`'s launches (kernels/cuda/moe.cu).

A layer's experts are three 3-D tensors of the file, `[n_experts, out, in]`;
`DeviceExperts` holds one on the device as the file's blocks (or, for float experts and
with `--weights bf16`, as bf16), one expert's matrix a slice of `expert_bytes`.

Everything is decided on the device, so a decode round's launches are the same whatever
the router picks (a CUDA graph replays them) and the host never waits for the routing:
`moe_route` (router logits, gating, top k, weights), `moe_sort` (the round's (row, slot)
pairs grouped by expert, in chunks of up to MOE_CHUNK rows), the rows of x gathered in
that order (`gather_rows`), the type's `moe_gemv_<type>` (kernels/cuda/quant_matrix.cu: the
fused GEMV of the type over each chunk and its expert's slice, one launch per matrix: a
batch's rows that chose the same expert share its weights' reading) for the gate, up and
down products, the activation (`CudaOps`'s own), and `moe_combine` (each row's experts
weighted, summed, plus a shared expert). The grids are sized for the worst case the host
can bound (every pair its own chunk); blocks past the actual chunk count return at once.

The numpy reference is kernels/cpu_moe.py (tests/test_cuda_moe.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eagerlm.errors import UnsupportedModel
from eagerlm.kernels.cuda_quantized import GEMV_MAX_ROWS, GEMV_WARPS, warps_per_row
from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES, WeightType
from eagerlm.kernels.device_tensor import DeviceTensor, check_tensor
from eagerlm.loader.config import Activation, ExpertGating, MoEConfig

if TYPE_CHECKING:
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.loader.weights import MoEWeights

MOE_CHUNK = GEMV_MAX_ROWS  # MOE_CHUNK in kernels/cuda/moe.cu: a chunk is one GEMV's rows
MAX_EXPERTS = 512  # moe_route's shared arrays
MAX_USED = 32
_GATING = {ExpertGating.SOFTMAX: 0, ExpertGating.SOFTMAX_WEIGHT: 1, ExpertGating.SIGMOID: 2}


@dataclass(frozen=True, eq=False)
class DeviceExperts:
    """A 3-D expert tensor on the device: `shape` (n_experts, out, in), `ptr` the first of
    n_experts x out rows of the type's blocks (bf16 values for BF16), `owner` keeping the
    memory alive."""

    ptr: int
    qtype: GGMLQuantizationType
    shape: tuple[int, int, int]
    owner: Any = None

    @property
    def expert_bytes(self) -> int:
        _, out, n_in = self.shape
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return out * (n_in // block) * type_size

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.expert_bytes

    @property
    def type(self) -> WeightType:
        """The type's kernels (kernels/cuda_weight_types.py)."""
        return WEIGHT_TYPES[self.qtype]


def check_moe(moe: MoEConfig, d_model: int) -> None:
    """Refuse (before loading) a mixture the kernels cannot route or multiply: the GEMV
    reads rows of whole 32-value units."""
    if moe.n_experts > MAX_EXPERTS or moe.n_used > MAX_USED:
        raise UnsupportedModel(f"the cuda backend routes up to {MAX_EXPERTS} experts and "
                               f"{MAX_USED} per token, not {moe.n_experts} and {moe.n_used}")
    if d_model % 32 or moe.d_ff % 32:
        raise UnsupportedModel(f"the cuda backend's expert products need widths of whole "
                               f"32-value units, not {d_model} and {moe.d_ff}")


def _opt(t: DeviceTensor | None, what: str) -> int:
    if t is None:
        return 0
    check_tensor(t, "f32", what)
    return t.ptr


def moe_ffn(ops: CudaOps, x: DeviceTensor, w: MoEWeights, moe: MoEConfig,
            act: Activation) -> DeviceTensor:
    """The FFN of rows x (bf16 `[rows, d_model]`), bf16 out."""
    check_tensor(x, "bf16", "MoE input")
    check_tensor(w.router, "f32", "router")
    check_moe(moe, x.shape[-1])
    s = ops.stream.handle
    n, d = x.shape[0], x.shape[-1]
    k, e, ff = moe.n_used, moe.n_experts, moe.d_ff
    ids = ops.empty((n, k), "i32")
    weights = ops.empty((n, k), "f32")
    ops.kernels["moe_route"].launch(
        s, n, 128, ids.ptr, weights.ptr, x.ptr, w.router.ptr,
        _opt(w.router_bias, "router bias"), n, d, e, k, _GATING[moe.gating],
        int(moe.normalize), float(moe.scale))
    pairs = n * k
    max_chunks = -(-pairs // MOE_CHUNK) + min(e, pairs)
    pos = ops.empty((pairs,), "i32")
    rows = ops.empty((pairs,), "i64")
    chunks = ops.empty((max_chunks, 3), "i32")
    n_chunks = ops.empty((1,), "i32")
    ops.kernels["moe_sort"].launch(s, 1, 256, pos.ptr, rows.ptr, chunks.ptr, n_chunks.ptr,
                                   ids.ptr, pairs, k, e)

    def product(src: DeviceTensor, m: DeviceExperts, bias: DeviceTensor | None, n_in: int,
                n_out: int) -> DeviceTensor:
        per_row = warps_per_row(n_in)
        y = ops.empty((pairs, n_out), "bf16")
        ops.kernels[m.type.moe_gemv].launch(
            s, (-(-n_out // (GEMV_WARPS // per_row)), max_chunks, 1), 32 * GEMV_WARPS, y.ptr,
            src.ptr, m.ptr, m.expert_bytes, _opt(bias, "expert bias"), chunks.ptr,
            n_chunks.ptr, n_in, n_out, per_row)
        return y

    sorted_x = ops.rows(x, rows)  # x's rows in expert order, a chunk's rows consecutive
    gate = product(sorted_x, w.gate, w.gate_bias, d, ff)
    up = product(sorted_x, w.up, w.up_bias, d, ff)
    down = product(ops.gated_ffn_act(gate, up, act), w.down, w.down_bias, ff, d)
    shared = shared_logit = None
    if moe.d_ff_shared:
        shared = ops.linear(ops.gated_ffn_act(ops.linear(x, w.shared_gate),
                                              ops.linear(x, w.shared_up), act), w.shared_down)
        if w.shared_router is not None:
            shared_logit = ops.linear(x, w.shared_router)
    out = ops.empty((n, d), "bf16")
    ops.kernels["moe_combine"].launch(
        s, n, 256, out.ptr, down.ptr, pos.ptr, weights.ptr,
        0 if shared is None else shared.ptr, 0 if shared_logit is None else shared_logit.ptr,
        n, k, d)
    return out
