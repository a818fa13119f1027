"""The Ops protocol of kernels/model.py on a CUDA device, so the same `Transformer.forward`
runs on cuda and cpu.

Data types: activations that feed GEMMs are bf16, the residual stream is float32 (the
embedding's output and the sum kept by `add_rms_norm`), logits are float32 (the lm head
GEMM writes float32), weight matrices are bf16 and weight vectors (norms, biases, rope
frequency factors) float32. Every kernel accumulates in float32. The KV cache is bf16.

Memory: every op returns a fresh `DeviceTensor` from the stream-ordered allocator
(cuMemAllocAsync on the compute stream, the pool keeping freed memory for reuse); when the
last Python reference to it goes, its memory is freed in stream order after the work
already enqueued, so a tensor may be dropped as soon as the launches that read it are
enqueued. A tensor that another stream reads must be kept alive until that stream is done
(the dispatcher copies sampled tokens out of buffers it owns, not out of these).

Host data (token ids, positions, per-session descriptors) goes up through a pinned
staging ring: a copy from pageable memory would synchronize the stream and undo the eager
dispatch. Uploads are cached by the identity of the host object, so the positions the
forward passes to every layer's rope are uploaded once per batch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import math
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kernels.batch import ForwardBatch, SeqSlice
from kernels.cuda_kernels import KernelLibrary
from kernels.sampling import (
    MAX_LOGPROBS,
    POSITION_LIMIT,
    SamplingParams,
    TokenCounts,
    dense_logit_bias,
)
from loader.config import Activation, RopeParams, RopeStyle
from vmm.cuda_driver import cu, driver
from vmm.device import Event, HostBuffer
from vmm.kv_layout import KVLayout
from vmm.kv_region import StridedView

ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1}
_NUMPY = {"f32": np.float32, "i32": np.int32, "i64": np.int64, "u8": np.uint8, "bf16": np.uint16}
KV_DTYPE = np.dtype(np.uint16)  # the KV cache element on cuda: bf16, stored as its bits

# Mirrors `struct SeqDesc` (kernels/cuda/common.cuh) and `struct SampleParams`
# (kernels/cuda/sampler.cu); tests/test_cuda_ops.py checks the sizes.
SEQ_DESC = np.dtype([("start", "<i4"), ("n_new", "<i4"), ("n_past", "<i4"), ("pad", "<i4"),
                     ("kv_base", "<u8")])
SAMPLE_PARAMS = np.dtype([("temperature", "<f4"), ("top_k", "<i4"), ("top_p", "<f4"),
                          ("min_p", "<f4"), ("seed", "<u8"), ("position", "<i8")])
# ... and `struct PenaltyRow` and `struct CountSpan` (kernels/cuda/sampler.cu)
PENALTY_ROW = np.dtype([("counts", "<u8"), ("bias", "<u8"), ("repetition", "<f4"),
                        ("presence", "<f4"), ("frequency", "<f4"), ("pad", "<i4")])
COUNT_SPAN = np.dtype([("counts", "<u8"), ("start", "<i4"), ("n", "<i4"), ("split", "<i4"),
                       ("pad", "<i4")])

ATT_QB = 16  # query vectors per attention block (ATT_QB in attention.cu)
ATT_BK = 32  # keys per attention tile
PF_BM = 128  # query vectors per block of attention_prefill.cu (PF_BM there)
PF_BN = 64  # keys per K/V tile of attention_prefill.cu (PF_BN there)
PF_MIN_NEW = 16  # batches whose longest session adds this many rows take the prefill kernel
SAMPLER_THREADS = 1024  # sample_rows is written for exactly this block size
_LOG2E = 1.4426950408889634

# Decode attention (kernels/cuda/attention_decode.cu): head dims with a kernel, query heads
# per block (G), threads per block (DEC_THREADS), and how the context is split.
DECODE_HEAD_DIMS = (32, 64, 128, 256)
DECODE_GROUPS = (1, 2, 4, 8)
DECODE_THREADS = 128
DECODE_MIN_SPLIT = 256  # keys: shorter splits cost more in partials and merging than they gain
DECODE_MAX_SPLITS = 64
DECODE_BLOCKS_PER_SM = 8  # split until the grid has about this many blocks per SM


def decode_head_group(g: int) -> tuple[int, int]:
    """(G, chunks) for GQA group size g: the decode kernel's query heads per block and how
    many blocks share one KV head (1 unless g > 8)."""
    G = next((x for x in DECODE_GROUPS if x >= g), DECODE_GROUPS[-1])
    return G, -(-g // G)


def decode_attention_splits(max_keys: int, n_seqs: int, n_kv_heads: int, n_heads: int,
                            sm_count: int) -> tuple[int, int]:
    """(n_splits, split_len) of a decode attention launch for sessions of at most
    `max_keys` visible keys (n_past + 1, or the window if smaller): the context is split
    until the grid has about DECODE_BLOCKS_PER_SM blocks per SM, splits of at least
    DECODE_MIN_SPLIT keys. Any pair is correct for any lengths (the last split takes what
    lies beyond n_splits * split_len), so a CUDA graph may size it by a bound."""
    _, chunks = decode_head_group(max(1, n_heads // max(1, n_kv_heads)))
    blocks = max(1, n_seqs * n_kv_heads * chunks)
    max_keys = max(1, max_keys)
    want = -(-DECODE_BLOCKS_PER_SM * sm_count // blocks)
    n = max(1, min(want, DECODE_MAX_SPLITS, -(-max_keys // DECODE_MIN_SPLIT)))
    split_len = -(-max_keys // n)
    split_len = -(-split_len // 64) * 64
    return -(-max_keys // split_len), split_len


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


class _Allocation:
    """Stream-ordered device memory: freed on its stream, after the work enqueued before
    the last reference went away. One from before a stream capture whose last reference
    goes away during it is freed after the capture (see `CudaOps.capturing`)."""

    __slots__ = ("__weakref__", "captured", "nbytes", "ops", "ptr")

    def __init__(self, ops: CudaOps, nbytes: int) -> None:
        self.ops = ops
        self.nbytes = nbytes
        self.captured = ops._in_capture  # the capture's own: freed inside it, as CUDA asks
        ops.ctx.bind()
        self.ptr = int(cu("cuMemAllocAsync", max(nbytes, 1), ops.stream.handle))

    def download(self, t: DeviceTensor) -> np.ndarray:
        return self.ops.to_numpy(t)

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        with contextlib.suppress(Exception):  # interpreter shutdown
            if not self.captured and self.ops._defer_free(ptr):
                return
            if not self.ops.ctx.released:
                self.ops._free(ptr)


class _StagingRing:
    """Pinned host memory for small uploads, reused in ring order: a region is rewritten
    only after the event of the copy that last read it has completed."""

    def __init__(self, ops: CudaOps, nbytes: int = 8 << 20) -> None:
        self.ops = ops
        self.buf: HostBuffer = ops.device.alloc_host(nbytes)
        self.size = nbytes
        self.head = 0
        self.in_flight: collections.deque[tuple[int, int, Event]] = collections.deque()
        self.lock = threading.Lock()

    def upload(self, data: np.ndarray, out: DeviceTensor) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        n = raw.size
        if n == 0:
            return
        if n > self.size:  # rare: a one-off pinned buffer, freed once its copy is done
            host = self.ops.device.alloc_host(n)
            host.array[:n] = raw
            self.ops.stream.copy_h2d(_Mem(out.ptr, n), host, n)
            self.ops.stream.synchronize()
            host.free()
            return
        with self.lock:
            wrap = self.head + n > self.size
            start = 0 if wrap else self.head
            end = start + (n + 255) // 256 * 256
            # The in-flight copies are queued in ring order from `head` on: those at or past
            # head (the previous lap's) are the oldest. Wrapping skips the tail [head, size),
            # so its copies must leave the queue first, or the check below would stop at one
            # of them and miss a newer copy at the front of the ring that the write overlaps.
            while self.in_flight and ((wrap and self.in_flight[0][0] >= self.head) or (
                    self.in_flight[0][0] < end and start < self.in_flight[0][1])):
                self.in_flight.popleft()[2].synchronize()
            self.buf.array[start:start + n] = raw
            self.ops.stream.copy_h2d(_Mem(out.ptr, n), self.buf, n, src_offset=start)
            ev = self.ops.stream.record(self.ops.device.event(timing=False))
            self.in_flight.append((start, min(end, self.size), ev))
            self.head = min(end, self.size)


@dataclass(frozen=True)
class _Mem:
    ptr: int
    nbytes: int


@dataclass
class _BatchMeta:
    """A batch's per-session descriptors on the device, made once per forward."""

    batch: ForwardBatch | None  # None in a captured graph: the sizes below are all there is
    n_seqs: int
    seqs: DeviceTensor  # SEQ_DESC [n_seqs]
    row_seq: DeviceTensor  # int32 [n_tokens]
    first_kv: DeviceSessionKV
    kv_base0: int
    token_bytes: int
    max_new: int
    max_total: int
    offsets: dict[int, tuple[int, int]]  # layer -> (K offset, V offset) in a token

    def layer_offsets(self, layer: int) -> tuple[int, int]:
        off = self.offsets.get(layer)
        if off is None:
            off = (self.first_kv.k_view(layer).ptr - self.kv_base0,
                   self.first_kv.v_view(layer).ptr - self.kv_base0)
            self.offsets[layer] = off
        return off


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


class CudaOps:
    """Ops over DeviceTensors, all enqueued on one stream."""

    name = "cuda"
    kv_dtype = KV_DTYPE
    use_decode_attention = True  # False: decode rounds use attention.cu too (benchmarks)

    def __init__(self, device: Any, stream: Any = None, *, lm_head: DeviceTensor | None = None,
                 poison_outputs: bool = False) -> None:
        self.device = device
        self.ctx = device.ctx
        self.stream = stream if stream is not None else device.stream("compute")
        self.kernels = KernelLibrary(self.ctx)
        self.lm_head = lm_head  # the weight whose GEMM writes float32 logits
        self.poison_outputs = poison_outputs  # fill fresh outputs with NaN bytes (tests)
        d = driver()
        self.sm_count = int(cu("cuDeviceGetAttribute",
                               d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                               self.ctx.device))
        self.ctx.bind()
        pool = cu("cuDeviceGetDefaultMemPool", self.ctx.device)
        cu("cuMemPoolSetAttribute", pool,
           d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(2**64 - 1))
        self._ring = _StagingRing(self)
        self._uploads: collections.OrderedDict[int, tuple[Any, DeviceTensor]] = (
            collections.OrderedDict())
        self._meta: _BatchMeta | None = None
        # The mma.sync prefill kernel (attention_prefill.cu) for prefill batches: True
        # always, False never, None (the default) once `_prefill_kernel_agrees` has checked
        # it against attention.cu on this device. It rounds the softmax weights to bf16
        # before P.V, as FlashAttention does: relative error ~2e-3, each element within 2.2
        # bf16 ulps of its head's RMS on the emulated GPU (the attention tests' bound is 4),
        # whose mma fragment layouts are our reading of the PTX manual; it has not yet run
        # on a real GPU, hence the check there.
        self.tensor_core_prefill: bool | None = None
        self._prefill_checked: dict[int, bool] = {}
        self._gemm: Any = None
        self._workspace: Any = None
        self._capture_lock = threading.RLock()  # RLock: a __del__ may run while held
        self._in_capture = False
        self._deferred_frees: list[int] = []

    @property
    def _s(self) -> Any:
        return self.stream.handle

    # -- memory --------------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        alloc = _Allocation(self, nbytes)
        t = DeviceTensor(alloc.ptr, tuple(shape), dtype, alloc)
        if self.poison_outputs and nbytes:
            self.fill(t, 0xFF)  # NaN in bf16 and float32, -1 in ints
        return t

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a capture of this ops' stream (kernels/cuda_graphs.py). A free captured
        into a graph may only free memory the capture itself allocated: anything else
        fails and invalidates the capture on a GPU. So a tensor from before the capture
        whose last reference goes away meanwhile (a garbage-collected cycle, another
        thread dropping it) is freed once the capture has ended, and no garbage
        collection runs inside it."""
        gc_enabled = gc.isenabled()
        gc.disable()
        with self._capture_lock:
            self._in_capture = True
        try:
            yield
        finally:
            with self._capture_lock:
                self._in_capture = False
                deferred, self._deferred_frees = self._deferred_frees, []
            if gc_enabled:
                gc.enable()
            for ptr in deferred:
                self._free(ptr)

    def _defer_free(self, ptr: int) -> bool:
        """Keep `ptr` for the end of the capture under way, if one is (see `capturing`)."""
        with self._capture_lock:
            if self._in_capture:
                self._deferred_frees.append(ptr)
            return self._in_capture

    def _free(self, ptr: int) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown, dead context
            self.ctx.bind()
            cu("cuMemFreeAsync", driver().CUdeviceptr(ptr), self._s)

    def fill(self, t: DeviceTensor, byte: int) -> None:
        self.ctx.bind()
        cu("cuMemsetD8Async", driver().CUdeviceptr(t.ptr), byte, t.nbytes, self._s)

    def upload(self, array: np.ndarray, dtype: str | None = None) -> DeviceTensor:
        """A host array on the device (float arrays become bf16 when dtype == 'bf16')."""
        a = np.asarray(array)
        if dtype is None:
            dtype = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32",
                     np.dtype(np.int64): "i64", np.dtype(np.uint8): "u8"}[a.dtype]
        data = to_bf16_bits(a) if dtype == "bf16" and a.dtype != np.uint16 else \
            a.astype(_NUMPY[dtype], copy=False)
        t = self.empty(a.shape, dtype)
        self._ring.upload(data, t)
        return t

    def _uploaded(self, host: np.ndarray | DeviceTensor, dtype: str) -> DeviceTensor:
        """`host` on the device, uploaded once while the same object is passed again. A
        DeviceTensor is already there (a captured graph's inputs live in fixed buffers)."""
        if isinstance(host, DeviceTensor):
            _require(host, dtype, "index input")
            return host
        hit = self._uploads.get(id(host))
        if hit is not None and hit[0] is host:
            return hit[1]
        t = self.upload(host, dtype)
        self._uploads[id(host)] = (host, t)
        while len(self._uploads) > 16:
            self._uploads.popitem(last=False)
        return t

    def to_numpy(self, t: DeviceTensor) -> np.ndarray:
        """Synchronize the stream and copy `t` to the host (bf16 becomes float32)."""
        host = np.empty(t.shape, dtype=_NUMPY[t.dtype])
        self.stream.synchronize()
        if t.nbytes:
            self.ctx.bind()
            cu("cuMemcpyDtoH", host.ctypes.data, driver().CUdeviceptr(t.ptr), t.nbytes)
        return from_bf16_bits(host) if t.dtype == "bf16" else host

    def synchronize(self) -> None:
        self.stream.synchronize()

    # -- launch helpers ------------------------------------------------------------------

    def _grid(self, n: int, block: int = 256) -> int:
        return max(1, min(-(-n // block), self.sm_count * 32))

    # -- elementwise and norms -----------------------------------------------------------

    def embed(self, table: DeviceTensor, ids: Any, scale: float) -> DeviceTensor:
        vocab, d = table.shape
        _require(table, "bf16", "embedding table")
        if isinstance(ids, DeviceIds):
            n, ids_ptr, stride, buf = ids.n, ids.rows_ptr, ids.stride, ids.token_buf_ptr
        else:
            host = ids if isinstance(ids, np.ndarray) else np.asarray(ids, np.int32)
            dev = self._uploaded(host, "i32")
            n, ids_ptr, stride, buf = len(host), dev.ptr, 1, 0
        out = self.empty((n, d), "f32")
        self.kernels["embed_rows"].launch(self._s, n, 256, out.ptr, table.ptr, ids_ptr, stride,
                                          buf, n, d, vocab, float(scale))
        return out

    def _norm_shape(self, dim: int, rows: int) -> tuple[tuple[int, int, int], int]:
        if dim <= 256:
            return (32, 8, 1), -(-rows // 8)
        return (256 if dim <= 4096 else 1024, 1, 1), rows

    def rms_norm(self, x: DeviceTensor, w: DeviceTensor, eps: float) -> DeviceTensor:
        dim = x.shape[-1]
        rows = x.size // dim
        _require(w, "f32", "norm weight")
        out = self.empty(x.shape, "bf16")
        block, grid = self._norm_shape(dim, rows)
        name = {"f32": "rms_norm_f32", "bf16": "rms_norm_bf16"}[x.dtype]
        self.kernels[name].launch(self._s, grid, block, out.ptr, x.ptr, w.ptr, rows, dim,
                                  float(eps))
        return out

    def add_rms_norm(self, residual: DeviceTensor, x: DeviceTensor, w: DeviceTensor,
                     eps: float) -> tuple[DeviceTensor, DeviceTensor]:
        _require(residual, "f32", "residual")
        _require(x, "bf16", "sub-layer output")
        dim = residual.shape[-1]
        rows = residual.size // dim
        h = self.empty(residual.shape, "f32")
        y = self.empty(residual.shape, "bf16")
        block, grid = self._norm_shape(dim, rows)
        self.kernels["add_rms_norm"].launch(self._s, grid, block, h.ptr, y.ptr, residual.ptr,
                                            x.ptr, w.ptr, rows, dim, float(eps))
        return h, y

    def linear(self, x: DeviceTensor, w: DeviceTensor,
               bias: DeviceTensor | None = None) -> DeviceTensor:
        from kernels.cublaslt import CUDA_R_16BF, CUDA_R_32F

        n_out, n_in = w.shape
        _require(x, "bf16", "GEMM input")
        _require(w, "bf16", "weight matrix")
        if x.shape[-1] != n_in:
            raise ValueError(f"linear: input {x.shape} does not match weight {w.shape}")
        n_tok = x.size // n_in
        logits = w is self.lm_head
        y = self.empty((*x.shape[:-1], n_out), "f32" if logits else "bf16")
        self.gemm.matmul(int(self._s), y.ptr, x.ptr, w.ptr, n_tok, n_in, n_out,
                         CUDA_R_32F if logits else CUDA_R_16BF)
        if bias is not None:
            _require(bias, "f32", "bias")
            name = "add_bias_f32" if logits else "add_bias_bf16"
            self.kernels[name].launch(self._s, self._grid(y.size), 256, y.ptr, bias.ptr, y.size,
                                      n_out)
        return y

    @property
    def gemm(self) -> Any:
        if self._gemm is None:
            from kernels.cublaslt import WORKSPACE_BYTES, Gemm

            self._workspace = self.device.alloc(WORKSPACE_BYTES)
            self._gemm = Gemm(self._workspace.ptr, WORKSPACE_BYTES)
        return self._gemm

    def gated_ffn_act(self, gate: DeviceTensor, up: DeviceTensor,
                      act: Activation) -> DeviceTensor:
        _require(gate, "bf16", "gate")
        _require(up, "bf16", "up")
        out = self.empty(gate.shape, "bf16")
        name = "swiglu" if act is Activation.SWIGLU else "geglu"
        self.kernels[name].launch(self._s, self._grid(out.size), 256, out.ptr, gate.ptr, up.ptr,
                                  out.size)
        return out

    def softcap(self, x: DeviceTensor, cap: float) -> DeviceTensor:
        out = self.empty(x.shape, x.dtype)
        self.kernels[f"softcap_{x.dtype}"].launch(self._s, self._grid(x.size), 256, out.ptr,
                                                  x.ptr, x.size, float(cap))
        return out

    def rows(self, x: DeviceTensor, rows: Any) -> DeviceTensor:
        host = rows if isinstance(rows, (np.ndarray, DeviceTensor)) else \
            np.asarray(rows, np.int64)
        idx = self._uploaded(host, "i64")
        n = len(host)
        row_bytes = (x.size // x.shape[0]) * x.itemsize
        out = self.empty((n, *x.shape[1:]), x.dtype)
        words = row_bytes // 2
        self.kernels["gather_rows"].launch(self._s, self._grid(n * words), 256, out.ptr, x.ptr,
                                           idx.ptr, n, words)
        return out

    # -- rotary embedding ----------------------------------------------------------------

    def rope(self, x: DeviceTensor, positions: Any, rope: RopeParams,
             freq_factors: DeviceTensor | None = None) -> DeviceTensor:
        _require(x, "bf16", "rope input")
        n_tok, n_heads, hd = x.shape
        pos = self._uploaded(positions if isinstance(positions, (np.ndarray, DeviceTensor))
                             else np.asarray(positions, np.int32), "i32")
        out = self.empty(x.shape, "bf16")
        ff = 0
        if freq_factors is not None:
            _require(freq_factors, "f32", "rope frequency factors")
            ff = freq_factors.ptr
        block = min(128, max(32, -(-(rope.dim // 2) // 32) * 32))
        name = "rope_neox" if rope.style is RopeStyle.NEOX else "rope_norm"
        self.kernels[name].launch(self._s, n_tok * n_heads, block, out.ptr, x.ptr, pos.ptr, ff,
                                  n_heads, hd, rope.dim, *_rope_constants(rope))
        return out

    # -- KV cache and attention ----------------------------------------------------------

    def _batch_meta(self, batch: ForwardBatch) -> _BatchMeta:
        if batch.device_meta is not None:  # made by the caller, in fixed device buffers
            return batch.device_meta
        meta = self._meta
        if meta is not None and meta.batch is batch:
            return meta
        if not batch.seqs:
            raise ValueError("an empty batch has no KV to attend to")
        descs = np.zeros(len(batch.seqs), SEQ_DESC)
        row_seq = np.empty(len(batch.tokens), np.int32)
        first = batch.seqs[0].kv
        k0 = first.k_view(0)
        token_bytes = k0.strides[0]
        for i, s in enumerate(batch.seqs):
            view = s.kv.k_view(0)
            if view.strides != k0.strides or view.dtype.itemsize != 2:
                raise ValueError("every session of a cuda batch needs a bf16 KV cache of one "
                                 f"layout; got strides {view.strides}, dtype {view.dtype}")
            descs[i] = (s.start, s.n_new, s.n_past, 0, view.ptr)
            row_seq[s.start:s.end] = i
        blob = np.concatenate([descs.view(np.uint8), row_seq.view(np.uint8)])
        dev = self.upload(blob, "u8")
        meta = _BatchMeta(
            batch=batch,
            n_seqs=len(descs),
            seqs=dev.view_at(0, (len(descs),), "u8"),
            row_seq=dev.view_at(descs.nbytes, (len(row_seq),), "i32"),
            first_kv=first, kv_base0=k0.ptr, token_bytes=token_bytes,
            max_new=max(s.n_new for s in batch.seqs),
            max_total=max(s.n_total for s in batch.seqs), offsets={})
        self._meta = meta
        return meta

    def kv_append(self, batch: ForwardBatch, layer: int, k: DeviceTensor,
                  v: DeviceTensor) -> None:
        _require(k, "bf16", "keys")
        _require(v, "bf16", "values")
        meta = self._batch_meta(batch)
        n_tok = k.shape[0]
        kv_dim = k.size // n_tok
        k_off, v_off = meta.layer_offsets(layer)
        self.kernels["kv_append"].launch(self._s, n_tok, 128, k.ptr, v.ptr, meta.seqs.ptr,
                                         meta.row_seq.ptr, n_tok, kv_dim, k_off, v_off,
                                         meta.token_bytes)

    def attention(self, batch: ForwardBatch, layer: int, q: DeviceTensor, *, scale: float,
                  window: int) -> DeviceTensor:
        _require(q, "bf16", "queries")
        meta = self._batch_meta(batch)
        _, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        if meta.max_new == 1 and self._decode_attention_ok(meta, layer, n_heads, n_kv, hd):
            keys = meta.max_total if window <= 0 else min(meta.max_total, window)
            n_splits, split_len = decode_attention_splits(keys, len(batch.seqs), n_kv, n_heads,
                                                          self.sm_count)
            return self._attention_decode(meta, layer, q, scale=scale, window=window,
                                          n_splits=n_splits, split_len=split_len,
                                          n_seqs=len(batch.seqs))
        if (self.tensor_core_prefill is not False and meta.max_new >= PF_MIN_NEW
                and self._prefill_attention_ok(meta, q, n_kv)
                and (self.tensor_core_prefill or self._prefill_kernel_agrees(hd))):
            return self._attention_prefill(meta, layer, q, scale=scale, window=window)
        return self._attention_general(meta, layer, q, scale=scale, window=window)

    def _attention_general(self, meta: _BatchMeta, layer: int, q: DeviceTensor, *,
                           scale: float, window: int) -> DeviceTensor:
        """attention.cu: any batch, head dims up to 256, context split when the grid is
        small."""
        n_tok, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        hpl = next((h for h in (32, 64, 128, 256) if hd <= h), None)
        if hpl is None:
            raise NotImplementedError(f"attention supports head_dim <= 256, not {hd}")
        g = n_heads // n_kv
        n_seqs = meta.n_seqs
        tiles = -(-meta.max_new * g // ATT_QB)
        blocks = tiles * n_kv * n_seqs
        n_splits = 1
        if blocks < 2 * self.sm_count and meta.max_total > 512:
            n_splits = max(1, min(32, -(-2 * self.sm_count // blocks),
                                  -(-meta.max_total // 256)))
        split_len = -(-meta.max_total // n_splits)
        split_len = -(-split_len // ATT_BK) * ATT_BK
        n_splits = -(-meta.max_total // split_len)
        out = self.empty((n_tok, n_heads * hd), "bf16")
        part_o, part_ml = self._split_partials(n_splits, n_tok, n_heads, hd)
        k_off, v_off = meta.layer_offsets(layer)
        smem = (ATT_QB * hd + ATT_BK * (hd + 2)) * 2
        self.kernels[f"attention_hd{hpl}"].launch(
            self._s, (tiles, n_kv * n_splits, n_seqs), 128,
            out.ptr, 0 if part_o is None else part_o.ptr, 0 if part_ml is None else part_ml.ptr,
            q.ptr,
            meta.seqs.ptr, k_off, v_off, meta.token_bytes, n_heads, n_kv, hd,
            float(scale) * _LOG2E, int(window), n_splits, split_len, n_tok, smem=smem)
        self._merge_splits(out, part_o, part_ml)
        return out

    def _split_partials(self, n_splits: int, n_tok: int, n_heads: int,
                        hd: int) -> tuple[DeviceTensor | None, DeviceTensor | None]:
        """Float32 workspaces of a context split in `n_splits` (none for one): each split's
        unnormalised output [split, row, head, hd] and its (max, sum) [split, row, head, 2],
        the layout attention_merge reads."""
        if n_splits <= 1:
            return None, None
        return (self.empty((n_splits, n_tok, n_heads, hd), "f32"),
                self.empty((n_splits, n_tok, n_heads, 2), "f32"))

    def _merge_splits(self, out: DeviceTensor, part_o: DeviceTensor | None,
                      part_ml: DeviceTensor | None) -> None:
        """attention_merge: the splits' partials into `out` [rows, heads * hd] (bf16)."""
        if part_o is None or part_ml is None:
            return
        n_splits, n_tok, n_heads, hd = part_o.shape
        self.kernels["attention_merge"].launch(
            self._s, n_tok * n_heads, min(256, -(-hd // 32) * 32), out.ptr, part_o.ptr,
            part_ml.ptr, n_tok, n_heads, hd, n_splits)

    def _decode_attention_ok(self, meta: _BatchMeta, layer: int, n_heads: int, n_kv: int,
                             hd: int) -> bool:
        """Whether attention_decode.cu serves this layer: a head dim it has a kernel for,
        and K/V rows 16-byte aligned (its loads are uint4; KV regions start page- or
        allocation-aligned, so the first session's base stands for all)."""
        if not self.use_decode_attention or hd not in DECODE_HEAD_DIMS or n_heads % n_kv:
            return False
        k_off, v_off = meta.layer_offsets(layer)
        return all(x % 16 == 0 for x in (meta.kv_base0, meta.token_bytes, k_off, v_off))

    def _prefill_kernel_agrees(self, hd: int) -> bool:
        """Whether attention_prefill.cu gives attention.cu's answer on this device, checked
        once per head dim on a random causal batch (two sessions, GQA 2): its mma.sync
        fragment layouts are the hardware's, so they are verified where it runs instead of
        assumed. Each kernel is within 4 bf16 ulps of the float32 truth (of an element or
        its head's RMS) in the tests, so they must agree within 8; a layout error is off by
        the whole value. A disagreement keeps the general kernel (a warning says so)."""
        ok = self._prefill_checked.get(hd)
        if ok is not None:
            return ok
        rng = np.random.default_rng(hd)
        n_kv, n_heads, specs = 2, 4, ((0, 70), (30, 50))  # (n_past, n_new) per session
        layout = KVLayout(1, n_kv, hd, KV_DTYPE)
        kvs = [ContiguousDeviceKV(self, layout, past + new) for past, new in specs]

        def batch_of(lengths: Sequence[tuple[int, int]]) -> ForwardBatch:  # (n_past, n_new)
            starts = np.cumsum([0] + [new for _, new in lengths]).tolist()
            return ForwardBatch(np.zeros(starts[-1], np.int32),
                                [SeqSlice(st, new, past, kv) for st, (past, new), kv
                                 in zip(starts[:-1], lengths, kvs, strict=True)],
                                np.arange(starts[-1]))

        def random(*shape: int) -> DeviceTensor:
            x = rng.standard_normal(shape).astype(np.float32)
            return self.upload(x, "bf16").reshape(*shape)

        rows = sum(past + new for past, new in specs)  # every position's K and V
        self.kv_append(batch_of([(0, past + new) for past, new in specs]), 0,
                       random(rows, n_kv, hd), random(rows, n_kv, hd))
        meta = self._batch_meta(batch_of(specs))
        q = random(len(meta.batch.tokens), n_heads, hd)
        tc = self.to_numpy(self._attention_prefill(meta, 0, q, scale=hd**-0.5, window=0))
        ref = self.to_numpy(self._attention_general(meta, 0, q, scale=hd**-0.5, window=0))
        self._meta = None
        for kv in kvs:
            kv.free()
        ref_rows, err = ref.reshape(-1, hd), np.abs(tc - ref).reshape(-1, hd)
        floor = np.maximum(np.abs(ref_rows), np.sqrt((ref_rows**2).mean(-1, keepdims=True)))
        ok = bool(np.isfinite(tc).all() and (err <= 8 * 2.0**-8 * floor).all())
        if not ok:
            warnings.warn(f"attention_prefill.cu disagrees with attention.cu for head dim "
                          f"{hd} on this device (max error {float(err.max()):.3g}); using "
                          f"attention.cu", RuntimeWarning, stacklevel=2)
        self._prefill_checked[hd] = ok
        return ok

    @staticmethod
    def _prefill_attention_ok(meta: _BatchMeta, q: DeviceTensor, n_kv: int) -> bool:
        """attention_prefill.cu's reach: head dims 64 and 128, whole GQA groups, and 16-byte
        aligned Q and K/V rows (its cp.async loads); a captured decode batch has no `batch`."""
        _, n_heads, hd = q.shape
        return (hd in (64, 128) and n_heads % n_kv == 0 and meta.batch is not None
                and q.ptr % 16 == 0 and meta.token_bytes % 16 == 0 and meta.kv_base0 % 16 == 0)

    def _attention_prefill(self, meta: _BatchMeta, layer: int, q: DeviceTensor, *,
                           scale: float, window: int) -> DeviceTensor:
        """Tensor-core flash attention (kernels/cuda/attention_prefill.cu): one block per
        PF_BM query vectors (row, head of the group) of one session and KV head."""
        n_tok, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        tiles = -(-meta.max_new * (n_heads // n_kv) // PF_BM)
        out = self.empty((n_tok, n_heads * hd), "bf16")
        k_off, v_off = meta.layer_offsets(layer)
        smem = 2 * PF_BN * hd * 2  # one K and one V tile of bf16
        self.kernels[f"attention_prefill_hd{hd}"].launch(
            self._s, (n_kv, tiles, meta.n_seqs), PF_BM // 16 * 32, out.ptr, q.ptr,
            meta.seqs.ptr, k_off, v_off, meta.token_bytes, n_heads, n_kv,
            float(scale) * _LOG2E, int(window), smem=smem)
        return out

    def _attention_decode(self, meta: _BatchMeta, layer: int, q: DeviceTensor, *,
                          scale: float, window: int, n_splits: int, split_len: int,
                          n_seqs: int | None = None) -> DeviceTensor:
        """Attention of a decode batch (every session of `meta` has at most one row; q is
        [rows, n_heads, hd]) with attention_decode.cu: one block per (split, KV head,
        session), splits merged by attention_merge. `n_splits` / `split_len` come from
        decode_attention_splits, for the longest session or for any bound: the launch is
        right for every length. `n_seqs` defaults to one session per row."""
        n_tok, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        group, chunks = decode_head_group(n_heads // n_kv)
        n_seqs = n_tok if n_seqs is None else n_seqs
        out = self.empty((n_tok, n_heads * hd), "bf16")
        part_o, part_ml = self._split_partials(n_splits, n_tok, n_heads, hd)
        k_off, v_off = meta.layer_offsets(layer)
        n_groups = DECODE_THREADS // (hd // 8)  # key groups per block (NG in the kernel)
        smem = (n_groups * group * hd + 2 * n_groups * group + 2 * group) * 4
        self.kernels[f"attention_decode_hd{hd}_g{group}"].launch(
            self._s, (n_splits, n_kv * chunks, n_seqs), DECODE_THREADS,
            out.ptr, 0 if part_o is None else part_o.ptr, 0 if part_ml is None else part_ml.ptr,
            q.ptr, meta.seqs.ptr, k_off, v_off, meta.token_bytes, n_heads, n_kv,
            float(scale) * _LOG2E, int(window), n_splits, split_len, n_tok, smem=smem)
        self._merge_splits(out, part_o, part_ml)
        return out

    # -- what the dispatcher's rounds need beside the forward ----------------------------

    def contiguous_kv(self, layout: KVLayout, capacity: int) -> ContiguousDeviceKV:
        return ContiguousDeviceKV(self, dataclasses.replace(layout, dtype=KV_DTYPE), capacity)

    def session_kv(self, region: Any) -> Any:
        """The region itself: the kernels read its base pointer and strides."""
        return region

    def round_inputs(self, rows: Any, n_rows: int, token_buf: Any) -> DeviceIds:
        """The embedding kernel gathers the ids on the device, from the metadata rows
        `[host id, token-buffer slot or -1]` and the token buffer."""
        return DeviceIds(rows.ptr, n_rows, token_buf.ptr)

    def token_counts(self, vocab: int, prompt: Sequence[int],
                     output: Sequence[int]) -> DeviceTensor:
        """A session's token counts for the penalties, int32 [2, vocab] (prompt counts,
        output counts), built from host tokens: when its counts must be (re)built. From
        then on `count_inputs` keeps them on the device, where the sampled tokens are."""
        host = TokenCounts.of(vocab, prompt, output)
        return self.upload(np.stack([host.prompt, host.output]))

    def count_inputs(self, tokens: DeviceIds,
                     spans: Sequence[tuple[DeviceTensor, int, int, int]]) -> None:
        """Add a round's input tokens to their sessions' counts: per span (counts, first
        row, rows, rows still in the prompt), one block of count_tokens."""
        if spans:
            self.count_inputs_device(tokens, self.upload(count_table(spans).view(np.uint8)),
                                     len(spans), spans[0][0].shape[1])

    def count_inputs_device(self, tokens: DeviceIds, table: DeviceTensor, n_spans: int,
                            vocab: int) -> None:
        """`count_inputs` with its span table (COUNT_SPAN rows) already on the device."""
        self.kernels["count_tokens"].launch(self._s, n_spans, 256, table.ptr, tokens.rows_ptr,
                                            tokens.stride, tokens.token_buf_ptr, vocab)

    def logit_bias(self, params: SamplingParams, vocab: int) -> DeviceTensor:
        """A session's logit bias on the device, uploaded once per session: float32
        [vocab] (`dense_logit_bias`), which penalize_rows adds to its rows."""
        return self.upload(dense_logit_bias(params, vocab))

    def sample_round(self, logits: DeviceTensor, params: Sequence[SamplingParams],
                     positions: Sequence[int], counts: Sequence[DeviceTensor | None],
                     biases: Sequence[DeviceTensor | None], *,
                     out: Any, token_buf: Any, out_slots: Sequence[int],
                     logprobs_out: tuple[Any, Any] | None = None) -> None:
        """NumpyOps.sample_round on the device: logit bias and penalties, the draw,
        logprobs."""
        slots = self.upload(np.asarray(out_slots, dtype=np.int32), "i32")
        sampled = DeviceTensor(out.ptr, (len(params),), "i32")
        self.sample(logits, params, positions, counts=counts, biases=biases, out=sampled,
                    token_buf=token_buf.ptr, out_slots=slots)
        if logprobs_out is not None:
            self.token_logprobs(logits, sampled, [p.logprobs for p in params],
                                values=logprobs_out[0].ptr, top_ids=logprobs_out[1].ptr)

    # -- sampling ------------------------------------------------------------------------

    def sample(self, logits: DeviceTensor, params: Sequence[SamplingParams],
               positions: Sequence[int], *,
               counts: Sequence[DeviceTensor | None] | None = None,
               biases: Sequence[DeviceTensor | None] | None = None,
               out: DeviceTensor | None = None, token_buf: int = 0,
               out_slots: DeviceTensor | None = None) -> DeviceTensor:
        """One token per row of float32 `logits` [n, vocab] (kernels/sampling.py's rules),
        written to `out` (int32 [n]) and, for rows whose `out_slots` entry is >= 0, to
        `token_buf[slot]`. Rows whose params are penalized need `counts[i]` (from
        `token_counts`); rows with a logit bias take `biases[i]` (from `logit_bias`), or
        have it uploaded here. A row that cannot be sampled (NaN logits) gets -1."""
        _require(logits, "f32", "logits")
        n, vocab = logits.shape
        if len(params) != n or len(positions) != n:
            raise ValueError(f"{n} logit rows need {n} params and positions")
        table = sample_table(params, positions, vocab)
        if any(p.adjusts_logits for p in params):
            logits = self.penalize(logits, params, counts, biases)
        if out is None:
            out = self.empty((n,), "i32")
        self.sample_device(logits, self.upload(table.view(np.uint8), "u8"), out=out,
                           token_buf=token_buf, out_slots=out_slots)
        return out

    def penalize(self, logits: DeviceTensor, params: Sequence[SamplingParams],
                 counts: Sequence[DeviceTensor | None] | None,
                 biases: Sequence[DeviceTensor | None] | None = None) -> DeviceTensor:
        """A copy of `logits` with each row's logit bias and penalties applied
        (sampling.adjust_logits): the raw logits stay for the logprobs. A biased row
        without its entry in `biases` has its bias uploaded here."""
        vocab = logits.shape[1]
        biases = [b if b is not None or not p.logit_bias else self.logit_bias(p, vocab)
                  for p, b in zip(params, biases or [None] * len(params), strict=True)]
        table = penalty_table(params, counts, biases, vocab)
        return self.penalize_device(logits, self.upload(table.view(np.uint8)))

    def penalize_device(self, logits: DeviceTensor, table: DeviceTensor) -> DeviceTensor:
        """`penalize` with its table (PENALTY_ROW per row) already on the device."""
        n, vocab = logits.shape
        out = self.empty((n, vocab), "f32")
        self.kernels["penalize_rows"].launch(
            self._s, (min(-(-vocab // 2048), 128), n, 1), 256, out.ptr, logits.ptr, vocab,
            table.ptr)
        return out

    def token_logprobs(self, logits: DeviceTensor, tokens: DeviceTensor,
                       want: Sequence[int | None], *, values: int, top_ids: int) -> None:
        """Each row's sampled-token logprob and its `want[i]` best alternatives (None: the
        row is skipped), from the raw logits, into float32 `values` [n, 1 + MAX_LOGPROBS]
        and int32 `top_ids` [n, MAX_LOGPROBS] (NumpyOps.sample_round's layout)."""
        self.token_logprobs_device(logits, tokens, self.upload(logprob_table(want)),
                                   values=values, top_ids=top_ids)

    def token_logprobs_device(self, logits: DeviceTensor, tokens: DeviceTensor,
                              want: DeviceTensor, *, values: int, top_ids: int) -> None:
        """`token_logprobs` with `want` (int32 per row, -1 = none) already on the device."""
        n, vocab = logits.shape
        self.kernels["token_logprobs"].launch(
            self._s, n, SAMPLER_THREADS, values, top_ids, logits.ptr, vocab, vocab,
            tokens.ptr, want.ptr, MAX_LOGPROBS)

    def sample_device(self, logits: DeviceTensor, table: DeviceTensor, *, out: DeviceTensor,
                      token_buf: int = 0, out_slots: DeviceTensor | None = None) -> None:
        """`sample` with its parameter table (SAMPLE_PARAMS rows) already on the device."""
        n, vocab = logits.shape
        self.kernels["sample_rows"].launch(
            self._s, n, SAMPLER_THREADS, out.ptr, token_buf,
            out_slots.ptr if out_slots is not None else 0, logits.ptr, vocab, vocab, table.ptr)

    def decode_graphs(self, transformer: Any, token_buf: Any, *, max_batch: int,
                      max_context: int, layout: KVLayout, enabled: bool = True) -> Any:
        """Decode rounds replayed as CUDA graphs (kernels/cuda_graphs.py)."""
        from kernels.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self, transformer, token_buf, max_batch=max_batch,
                            max_context=max_context,
                            layout=dataclasses.replace(layout, dtype=KV_DTYPE), enabled=enabled)

    def close(self) -> None:
        self.synchronize()
        self._uploads.clear()
        self._meta = None
        if self._gemm is not None:
            self._gemm.close()
            self._workspace.free()
            self._gemm = None
        self.kernels.close()


def sample_table(params: Sequence[SamplingParams], positions: Sequence[int],
                 vocab: int) -> np.ndarray:
    """The sampler's per-row parameters (SAMPLE_PARAMS), checked. (The logit bias and
    penalties are not in it: `CudaOps.penalize` applies them to the logits first.)"""
    table = np.zeros(len(params), SAMPLE_PARAMS)
    for i, (p, pos) in enumerate(zip(params, positions, strict=True)):
        if not p.greedy and p.seed is None:
            raise ValueError(f"params[{i}] has temperature > 0 but no seed; resolve it "
                             f"once per request with SamplingParams.resolve_seed()")
        if not 0 <= pos < POSITION_LIMIT:
            raise ValueError(f"positions[{i}] must be in [0, 2**63), got {pos}")
        # top_k >= vocab is off, as 0 is; clamped so a huge one fits the int32 field
        table[i] = (p.temperature, min(p.top_k, vocab), p.top_p, p.min_p, p.seed or 0,
                    pos)
    return table


def penalty_table(params: Sequence[SamplingParams],
                  counts: Sequence[DeviceTensor | None] | None,
                  biases: Sequence[DeviceTensor | None] | None, vocab: int) -> np.ndarray:
    """penalize_rows' per-row table (PENALTY_ROW), checked: a penalized row needs its
    session's counts, int32 [2, vocab], a biased row its bias, float32 [vocab]; other rows
    get neither (copied unchanged)."""
    table = np.zeros(len(params), PENALTY_ROW)
    for i, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        c = None if counts is None or not p.penalized else counts[i]
        if p.penalized:
            if c is None:
                raise ValueError(f"params[{i}] has penalties but no token counts were given")
            _require(c, "i32", f"counts[{i}]")
            if c.shape != (2, vocab):
                raise ValueError(f"counts[{i}] must be [2, {vocab}], got {c.shape}")
        b = None if biases is None or not p.logit_bias else biases[i]
        if p.logit_bias:
            if b is None:
                raise ValueError(f"params[{i}] has a logit bias but no bias was given")
            _require(b, "f32", f"biases[{i}]")
            if b.shape != (vocab,):
                raise ValueError(f"biases[{i}] must be [{vocab}], got {b.shape}")
        table[i] = (0 if c is None else c.ptr, 0 if b is None else b.ptr,
                    p.repetition_penalty, p.presence_penalty, p.frequency_penalty, 0)
    return table


def logprob_table(want: Sequence[int | None]) -> np.ndarray:
    """token_logprobs' per-row alternatives wanted (int32; -1: no logprobs for the row)."""
    return np.array([-1 if k is None else min(k, MAX_LOGPROBS) for k in want], np.int32)


def count_table(spans: Sequence[tuple[DeviceTensor | None, int, int, int]]) -> np.ndarray:
    """count_tokens' span table (COUNT_SPAN): (counts or None, first row, rows, rows still
    in the prompt) per session; a span without counts is skipped by the kernel."""
    table = np.zeros(len(spans), COUNT_SPAN)
    for i, (counts, start, n, split) in enumerate(spans):
        if counts is not None:
            _require(counts, "i32", "token counts")
        table[i] = (0 if counts is None else counts.ptr, start, n, split, 0)
    return table


@functools.lru_cache(maxsize=256)
def _rope_constants(rope: RopeParams) -> tuple[float, float, float, float, float, float]:
    """The rope kernels' (base, freq_scale, ext_factor, corr_low, corr_high, mscale): per
    layer constants, derived once (a layer's launches repeat them, graphs capture them)."""
    low, high = rope.corr_dims() if rope.ext_factor != 0.0 else (0.0, 0.0)
    return (float(rope.base), float(rope.freq_scale), float(rope.ext_factor), low, high,
            float(rope.mscale))


def _require(t: DeviceTensor, dtype: str, what: str) -> None:
    if not isinstance(t, DeviceTensor):
        raise TypeError(f"{what}: expected a DeviceTensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{what}: expected {dtype}, got {t.dtype} {t.shape}")
