"""What the cuda ops pass around: `DeviceTensor` (an address, a shape and an element
type), `DeviceIds` (token ids gathered on the device), a session's KV cache as the kernels
see it (`DeviceSessionKV`, and `ContiguousDeviceKV` for tests and single-request runs),
and the bf16 bit conversions the host side of every bf16 tensor goes through.

Kept apart from kernels/cuda_ops.py so that the graphs, the sampler, the loader's
expander and the tests can name these types without the ops that make them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.kv_region import StridedView

if TYPE_CHECKING:
    from eagerlm.kernels.cuda_ops import CudaOps

ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1}
NUMPY_DTYPE = {"f32": np.float32, "i32": np.int32, "i64": np.int64, "u8": np.uint8,
               "bf16": np.uint16}
KV_DTYPE = np.dtype(np.uint16)  # the KV cache element on cuda: bf16, stored as its bits


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even, NaN kept NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


@dataclass(frozen=True, eq=False)
class DeviceTensor:
    """A tensor in device memory: address, shape and element type ("bf16", "f32", "i32",
    "i64", "u8"). `owner` keeps the memory alive (several views may share one owner)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    owner: Any = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape: int | tuple[int, ...]) -> DeviceTensor:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        dims = tuple(int(d) for d in dims)  # type: ignore[arg-type]
        if dims.count(-1) == 1:
            known = math.prod(d for d in dims if d != -1)
            dims = tuple(self.size // known if d == -1 else d for d in dims)
        if math.prod(dims) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {dims}")
        return DeviceTensor(self.ptr, dims, self.dtype, self.owner)

    def view_at(self, byte_offset: int, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        """A sub-tensor sharing this memory (no bounds beyond the caller's word)."""
        return DeviceTensor(self.ptr + byte_offset, shape, dtype, self.owner)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        download = getattr(self.owner, "download", None)
        if download is None:
            raise TypeError("this device tensor has no stream to download it through; use "
                            "CudaOps.to_numpy")
        out = download(self)
        return out if dtype is None else out.astype(dtype, copy=False)


def check_tensor(t: DeviceTensor, dtype: str, what: str) -> None:
    """Raise TypeError unless `t` is a DeviceTensor of element type `dtype`."""
    if not isinstance(t, DeviceTensor):
        raise TypeError(f"{what}: expected a DeviceTensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{what}: expected {dtype}, got {t.dtype} {t.shape}")


@dataclass(frozen=True)
class DeviceIds:
    """Token ids that live on the device: row r's id is `rows[2r]`, or, when
    `rows[2r + 1] >= 0`, `token_buf[rows[2r + 1]]` (the control thread's round metadata:
    host id, source slot)."""

    rows_ptr: int
    n: int
    token_buf_ptr: int
    stride: int = 2

    def __len__(self) -> int:
        return self.n


class DeviceSessionKV(Protocol):
    """A session's KV cache as the cuda ops see it (KVRegion and ContiguousDeviceKV)."""

    capacity: int

    def k_view(self, layer: int) -> StridedView: ...

    def v_view(self, layer: int) -> StridedView: ...


class ContiguousDeviceKV:
    """A session's KV cache in one device allocation (token-major, bf16): the cuda
    counterpart of vmm.kv_layout.ContiguousKV, for tests and single-request runs."""

    def __init__(self, ops: CudaOps, layout: KVLayout, capacity: int) -> None:
        if layout.dtype.itemsize != 2:
            raise ValueError("the cuda KV cache is bf16: make the layout with KV_DTYPE")
        self.layout = layout
        self.capacity = capacity
        self.buffer = ops.device.alloc(max(1, capacity * layout.token_bytes))
        ops.fill(DeviceTensor(self.buffer.ptr, (self.buffer.nbytes,), "u8"), 0)

    def _view(self, layer: int, kv: int) -> StridedView:
        lay = self.layout
        head = lay.head_dim * 2
        ptr = self.buffer.ptr + (layer * 2 + kv) * lay.n_kv_heads * head
        return StridedView(ptr, (self.capacity, lay.n_kv_heads, lay.head_dim),
                           (lay.token_bytes, head, 2), lay.dtype)

    def k_view(self, layer: int) -> StridedView:
        return self._view(layer, 0)

    def v_view(self, layer: int) -> StridedView:
        return self._view(layer, 1)

    def free(self) -> None:
        self.buffer.free()
