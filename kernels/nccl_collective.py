"""The cuda backend's collectives: NCCL through nccl4py's low-level bindings
(`nccl.bindings.nccl`, the `cuda` extra's `nccl4py[cu13]`).

One communicator per device of a tensor-parallel group, all made by one
`ncclCommInitAll` (one process drives every device, as here). Each collective is
enqueued on the device's compute stream, the stream its ops enqueue on, so it is ordered
with the forward's kernels without a host wait and is captured into decode graphs like
any launch (NCCL's collectives are capturable). The all-reduce works in place on the
sub-layer's output (bf16, as vLLM all-reduces in the model's activation type); the
all-gather of the lm head's float32 logit shares lands in a scratch `[devices, rows,
cols]`, NCCL's layout, which `interleave_shards` (cuda/elementwise.cu) lays side by side.

NCCL calls from one thread for several devices would have to be grouped
(ncclGroupStart / End): each device's forward runs on its own thread instead
(kernels/tensor_parallel.py; the dispatcher's control threads, one per device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from eagerlm.errors import DeviceUnavailable

if TYPE_CHECKING:
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import DeviceTensor


class NcclUnavailable(DeviceUnavailable):
    """Tensor parallelism on cuda needs nccl4py (the `cuda` extra) and its NCCL library."""


def _nccl() -> Any:
    """nccl4py's low-level module (the emulated GPU's tests put a fake in its place)."""
    try:
        from nccl.bindings import nccl
    except ImportError as exc:  # pragma: no cover (the cuda extra installs it)
        raise NcclUnavailable(f"tensor parallelism on cuda needs nccl4py "
                              f"(pip install 'eagerlm[cuda]'): {exc}") from exc
    return nccl


def init_communicators(ordinals: Sequence[int]) -> list[Any]:
    """One NCCL communicator per device (CUDA ordinals), rank r on `ordinals[r]`."""
    nccl = _nccl()
    return list(nccl.comm_init_all(len(ordinals), list(ordinals)))


class NcclCollective:
    """Device `rank`'s end of its group's communicator, for its `CudaOps`."""

    def __init__(self, comm: Any, rank: int, size: int) -> None:
        self.nccl = _nccl()
        self.comm = comm
        self.rank = rank
        self.size = size
        dt = self.nccl.DataType
        self._dtypes = {"bf16": int(dt.Bfloat16), "f32": int(dt.Float32),
                        "i32": int(dt.Int32)}

    def all_reduce(self, ops: CudaOps, x: DeviceTensor) -> DeviceTensor:
        """The sum of `x` over the group, in place, on the ops' stream."""
        ops.ctx.bind()
        self.nccl.all_reduce(x.ptr, x.ptr, x.size, self._dtypes[x.dtype],
                             int(self.nccl.RedOp.Sum), self.comm, int(ops.stream.handle))
        return x

    def all_gather(self, ops: CudaOps, x: DeviceTensor) -> DeviceTensor:
        """Every device's `x` `[rows, cols]` side by side, `[rows, size * cols]`."""
        rows, cols = x.size // x.shape[-1], x.shape[-1]
        blocks = ops.empty((self.size, rows, cols), x.dtype)
        ops.ctx.bind()
        self.nccl.all_gather(x.ptr, blocks.ptr, x.size, self._dtypes[x.dtype], self.comm,
                             int(ops.stream.handle))
        if rows == 1:
            return blocks.reshape((*x.shape[:-1], self.size * cols))
        out = ops.empty((*x.shape[:-1], self.size * cols), x.dtype)
        ops.kernels["interleave_shards"].launch(ops._s, ops._grid(blocks.size), 256, out.ptr,
                                                blocks.ptr, self.size, rows, cols)
        return out

    def broadcast(self, ops: CudaOps, x: DeviceTensor, root: int = 0) -> DeviceTensor:
        """Device `root`'s `x` in every device's `x` (in place)."""
        ops.ctx.bind()
        self.nccl.broadcast(x.ptr, x.ptr, x.size, self._dtypes[x.dtype], root, self.comm,
                            int(ops.stream.handle))
        return x

    def broadcast_ints(self, ops: CudaOps, ptr: int, n: int, root: int = 0) -> None:
        """Device `root`'s `n` int32 at `ptr` in every device's (in place): a token buffer."""
        ops.ctx.bind()
        self.nccl.broadcast(ptr, ptr, n, self._dtypes["i32"], root, self.comm,
                            int(ops.stream.handle))

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            self.nccl.comm_destroy(comm)
