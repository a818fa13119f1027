"""The Ops protocol of kernels/model.py on a CUDA device, so the same `Transformer.forward`
runs on cuda and cpu.

Data types: activations that feed GEMMs are bf16, the residual stream is float32 (the
embedding's output and the sum kept by `add_rms_norm`), logits are float32 (the lm head
GEMM writes float32), weight matrices are bf16 and weight vectors (norms, biases, rope
frequency factors) float32. Every kernel accumulates in float32. The KV cache is bf16.

Memory: every op returns a fresh `DeviceTensor` from the stream-ordered allocator
(kernels/cuda_memory.py), freed in stream order after the work already enqueued once its
last Python reference goes, so a tensor may be dropped as soon as the launches that read it
are enqueued. A tensor that another stream reads must be kept alive until that stream is
done (the dispatcher copies sampled tokens out of buffers it owns, not out of these).

Host data (token ids, positions, per-session descriptors) goes up through the pinned
staging ring. Uploads are cached by the identity of the host object, so the positions the
forward passes to every layer's rope are uploaded once per batch.

The ops live here; the tensor types in kernels/device_tensor.py, attention's kernel choice
and launches in kernels/cuda_attention.py (`CudaOps.attn`), the sampler's methods in
kernels/cuda_sampling.py (`CudaSampling`, which `CudaOps` mixes in).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from eagerlm.kernels import cuda_moe
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cuda_attention import CudaAttention
from eagerlm.kernels.cuda_kernels import KernelLibrary
from eagerlm.kernels.cuda_memory import StagingRing, StreamAllocator
from eagerlm.kernels.cuda_quantized import DeviceQuantizedMatrix, QuantizedLinear
from eagerlm.kernels.cuda_sampling import CudaSampling
from eagerlm.kernels.cuda_speculative import CudaSpeculation
from eagerlm.kernels.device_tensor import (
    ITEMSIZE,
    KV_DTYPE,
    NUMPY_DTYPE,
    ContiguousDeviceKV,
    DeviceIds,
    DeviceTensor,
    check_tensor,
    from_bf16_bits,
    to_bf16_bits,
)
from eagerlm.loader.config import Activation, MoEConfig, RopeParams, RopeStyle
from eagerlm.vmm.cuda_driver import cu, driver
from eagerlm.vmm.kv_layout import KVLayout

if TYPE_CHECKING:
    from collections.abc import Sequence

    from eagerlm.kernels.cuda_graphs import DecodeGraphs
    from eagerlm.kernels.model import Transformer
    from eagerlm.loader.weights import MoEWeights
    from eagerlm.vmm.device import DeviceBuffer, Stream
    from eagerlm.vmm.kv_region import KVRegion


@functools.lru_cache(maxsize=256)
def _rope_constants(rope: RopeParams) -> tuple[float, float, float, float, float, float]:
    """The rope kernels' (base, freq_scale, ext_factor, corr_low, corr_high, mscale): per
    layer constants, derived once (a layer's launches repeat them, graphs capture them)."""
    low, high = rope.corr_dims() if rope.ext_factor != 0.0 else (0.0, 0.0)
    return (float(rope.base), float(rope.freq_scale), float(rope.ext_factor), low, high,
            float(rope.mscale))


class CudaOps(CudaSampling, CudaSpeculation):
    """Ops over DeviceTensors, all enqueued on one stream: the cuda backend's `Backend`
    (kernels/backend.py). Attention is its `attn` (kernels/cuda_attention.py), the
    sampler's methods come from `CudaSampling` (kernels/cuda_sampling.py), speculative
    decoding's from `CudaSpeculation` (kernels/cuda_speculative.py), memory from its
    `memory` and staging ring (kernels/cuda_memory.py)."""

    name = "cuda"
    kv_dtype = KV_DTYPE
    use_decode_attention = True  # False: decode rounds use attention.cu too (benchmarks)

    def __init__(self, device: Any, stream: Any = None, *,
                 lm_head: DeviceTensor | DeviceQuantizedMatrix | None = None,
                 poison_outputs: bool = False, collective: Any = None) -> None:
        self.device = device
        # this device's end of its tensor-parallel group (kernels/nccl_collective.py's
        # NcclCollective); None alone
        self.collective = collective
        self.ctx = device.ctx
        # every op enqueues here, so the dispatcher's rounds use it as their compute stream
        self.stream: Stream = stream if stream is not None else device.stream("compute")
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
        self.memory = StreamAllocator(self)
        self._ring = StagingRing(self)
        self._uploads: collections.OrderedDict[int, tuple[Any, DeviceTensor]] = (
            collections.OrderedDict())
        self.attn = CudaAttention(self)
        # The mma.sync prefill kernel (attention_prefill.cu) for prefill batches: True
        # always, False never, None (the default) once `attn.prefill_kernel_agrees` has checked
        # it against attention.cu on this device. It rounds the softmax weights to bf16
        # before P.V, as FlashAttention does: relative error ~2e-3, each element within 2.2
        # bf16 ulps of its head's RMS on the emulated GPU (the attention tests' bound is 4),
        # whose mma fragment layouts are our reading of the PTX manual; it has not yet run
        # on a real GPU, hence the check there.
        self.tensor_core_prefill: bool | None = None
        self._gemm: Any = None
        self._workspace: Any = None
        # matrices kept as GGUF blocks: the fused GEMV, the tile path and its scratch
        self.quantized = QuantizedLinear(self)

    @classmethod
    def beside(cls, other: CudaOps) -> CudaOps:
        """Ops for another model (a draft model) on `other`'s device and stream, so their
        launches are ordered with `other`'s in the dispatcher's rounds."""
        return cls(other.device, other.stream, poison_outputs=other.poison_outputs)

    @property
    def _s(self) -> Any:
        return self.stream.handle

    # -- memory --------------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        alloc = self.memory.alloc(nbytes)
        t = DeviceTensor(alloc.ptr, tuple(shape), dtype, alloc)
        if self.poison_outputs and nbytes:
            self.fill(t, 0xFF)  # NaN in bf16 and float32, -1 in ints
        return t

    def capturing(self) -> contextlib.AbstractContextManager[None]:
        """Around a capture of this ops' stream (kernels/cuda_graphs.py): no garbage
        collection inside it, and a tensor from before it released meanwhile is freed after
        it (`StreamAllocator.capturing`)."""
        return self.memory.capturing()

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
            a.astype(NUMPY_DTYPE[dtype], copy=False)
        t = self.empty(a.shape, dtype)
        self._ring.upload(data, t)
        return t

    def _uploaded(self, host: np.ndarray | DeviceTensor, dtype: str) -> DeviceTensor:
        """`host` on the device, uploaded once while the same object is passed again. A
        DeviceTensor is already there (a captured graph's inputs live in fixed buffers)."""
        if isinstance(host, DeviceTensor):
            check_tensor(host, dtype, "index input")
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
        host = np.empty(t.shape, dtype=NUMPY_DTYPE[t.dtype])
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

    def embed(self, table: DeviceTensor | DeviceQuantizedMatrix, ids: Any,
              scale: float) -> DeviceTensor:
        vocab, d = table.shape
        if not isinstance(table, DeviceQuantizedMatrix):
            check_tensor(table, "bf16", "embedding table")
        if isinstance(ids, DeviceIds):
            n, ids_ptr, stride, buf = ids.n, ids.rows_ptr, ids.stride, ids.token_buf_ptr
        else:
            host = ids if isinstance(ids, np.ndarray) else np.asarray(ids, np.int32)
            dev = self._uploaded(host, "i32")
            n, ids_ptr, stride, buf = len(host), dev.ptr, 1, 0
        out = self.empty((n, d), "f32")
        if isinstance(table, DeviceQuantizedMatrix):
            self.quantized.embed(table, out, ids_ptr, stride, buf, n, scale)
            return out
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
        check_tensor(w, "f32", "norm weight")
        out = self.empty(x.shape, "bf16")
        block, grid = self._norm_shape(dim, rows)
        name = {"f32": "rms_norm_f32", "bf16": "rms_norm_bf16"}[x.dtype]
        self.kernels[name].launch(self._s, grid, block, out.ptr, x.ptr, w.ptr, rows, dim,
                                  float(eps))
        return out

    def add_rms_norm(self, residual: DeviceTensor, x: DeviceTensor, w: DeviceTensor,
                     eps: float) -> tuple[DeviceTensor, DeviceTensor]:
        check_tensor(residual, "f32", "residual")
        check_tensor(x, "bf16", "sub-layer output")
        dim = residual.shape[-1]
        rows = residual.size // dim
        h = self.empty(residual.shape, "f32")
        y = self.empty(residual.shape, "bf16")
        block, grid = self._norm_shape(dim, rows)
        self.kernels["add_rms_norm"].launch(self._s, grid, block, h.ptr, y.ptr, residual.ptr,
                                            x.ptr, w.ptr, rows, dim, float(eps))
        return h, y

    def linear(self, x: DeviceTensor, w: DeviceTensor | DeviceQuantizedMatrix,
               bias: DeviceTensor | None = None) -> DeviceTensor:
        """x @ w^T (+ bias): bf16 out, float32 for the lm head's logits. A matrix kept as
        blocks goes through `self.quantized` (kernels/cuda_quantized.py), a bf16 one
        through cuBLASLt."""
        from eagerlm.kernels.cublaslt import CUDA_R_16BF, CUDA_R_32F

        n_out, n_in = w.shape
        check_tensor(x, "bf16", "GEMM input")
        if not isinstance(w, DeviceQuantizedMatrix):
            check_tensor(w, "bf16", "weight matrix")
        if x.shape[-1] != n_in:
            raise ValueError(f"linear: input {x.shape} does not match weight {w.shape}")
        n_tok = x.size // n_in
        logits = w is self.lm_head
        y = self.empty((*x.shape[:-1], n_out), "f32" if logits else "bf16")
        if isinstance(w, DeviceQuantizedMatrix):
            if self.quantized.linear(x, w, y, bias):
                return y
        else:
            self.gemm.matmul(int(self._s), y.ptr, x.ptr, w.ptr, n_tok, n_in, n_out,
                             CUDA_R_32F if logits else CUDA_R_16BF)
        if bias is not None:
            check_tensor(bias, "f32", "bias")
            name = "add_bias_f32" if logits else "add_bias_bf16"
            self.kernels[name].launch(self._s, self._grid(y.size), 256, y.ptr, bias.ptr, y.size,
                                      n_out)
        return y

    @property
    def gemm(self) -> Any:
        if self._gemm is None:
            from eagerlm.kernels.cublaslt import WORKSPACE_BYTES, Gemm

            self._workspace = self.device.alloc(WORKSPACE_BYTES)
            self._gemm = Gemm(self._workspace.ptr, WORKSPACE_BYTES)
        return self._gemm

    def gated_ffn_act(self, gate: DeviceTensor, up: DeviceTensor,
                      act: Activation) -> DeviceTensor:
        check_tensor(gate, "bf16", "gate")
        check_tensor(up, "bf16", "up")
        out = self.empty(gate.shape, "bf16")
        name = {Activation.SWIGLU: "swiglu", Activation.GEGLU: "geglu",
                Activation.SWIGLU_OAI: "swiglu_oai"}[act]
        self.kernels[name].launch(self._s, self._grid(out.size), 256, out.ptr, gate.ptr, up.ptr,
                                  out.size)
        return out

    def moe_ffn(self, x: DeviceTensor, w: MoEWeights[Any], moe: MoEConfig,
                act: Activation) -> DeviceTensor:
        """The mixture-of-experts FFN, routed and grouped on the device
        (kernels/cuda_moe.py)."""
        return cuda_moe.moe_ffn(self, x, w, moe, act)

    # -- tensor parallelism (kernels/nccl_collective.py) --------------------------------

    def all_reduce(self, x: DeviceTensor) -> DeviceTensor:
        """The sum of `x` over the devices of the group (NCCL, in place, on this stream);
        `x` itself on a device alone."""
        return x if self.collective is None else self.collective.all_reduce(self, x)

    def all_gather(self, x: DeviceTensor) -> DeviceTensor:
        """Every device's `x` `[rows, n]` side by side along the last axis, by rank."""
        return x if self.collective is None else self.collective.all_gather(self, x)

    def broadcast_tokens(self, token_buf: DeviceBuffer) -> None:
        """Device 0's token buffer in every device's (ncclBroadcast, in place, on this
        stream)."""
        if self.collective is not None:
            self.collective.broadcast_ints(self, token_buf.ptr, token_buf.nbytes // 4)

    def broadcast_round(self, rows: DeviceBuffer, n_rows: int,
                        pasts: Sequence[int] | None) -> list[int]:
        """Refused: a speculative round's positions stay on the device on cuda
        (`spec_positions`); the dispatcher does not speculate over several GPUs."""
        raise NotImplementedError("speculative decoding over several GPUs is not built")

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
        check_tensor(x, "bf16", "rope input")
        n_tok, n_heads, hd = x.shape
        pos = self._uploaded(positions if isinstance(positions, (np.ndarray, DeviceTensor))
                             else np.asarray(positions, np.int32), "i32")
        out = self.empty(x.shape, "bf16")
        ff = 0
        if freq_factors is not None:
            check_tensor(freq_factors, "f32", "rope frequency factors")
            ff = freq_factors.ptr
        block = min(128, max(32, -(-(rope.dim // 2) // 32) * 32))
        name = "rope_neox" if rope.style is RopeStyle.NEOX else "rope_norm"
        self.kernels[name].launch(self._s, n_tok * n_heads, block, out.ptr, x.ptr, pos.ptr, ff,
                                  n_heads, hd, rope.dim, *_rope_constants(rope))
        return out

    # -- KV cache and attention ----------------------------------------------------------

    def kv_append(self, batch: ForwardBatch, layer: int, k: DeviceTensor,
                  v: DeviceTensor) -> None:
        check_tensor(k, "bf16", "keys")
        check_tensor(v, "bf16", "values")
        meta = self.attn.batch_meta(batch)
        n_tok = k.shape[0]
        kv_dim = k.size // n_tok
        k_off, v_off = meta.layer_offsets(layer)
        self.kernels["kv_append"].launch(self._s, n_tok, 128, k.ptr, v.ptr, meta.seqs.ptr,
                                         meta.row_seq.ptr, n_tok, kv_dim, k_off, v_off,
                                         meta.token_bytes)

    def attention(self, batch: ForwardBatch, layer: int, q: DeviceTensor, *, scale: float,
                  window: int, sinks: DeviceTensor | None = None) -> DeviceTensor:
        check_tensor(q, "bf16", "queries")
        return self.attn.attend(batch, layer, q, scale=scale, window=window, sinks=sinks)

    # -- a round's KV and inputs (its sampling: CudaSampling) -----------------------------

    def contiguous_kv(self, layout: KVLayout, capacity: int) -> ContiguousDeviceKV:
        return ContiguousDeviceKV(self, dataclasses.replace(layout, dtype=KV_DTYPE), capacity)

    def session_kv(self, region: KVRegion) -> KVRegion:
        """The region itself: the kernels read its base pointer and strides."""
        return region

    def round_inputs(self, rows: DeviceBuffer, n_rows: int,
                     token_buf: DeviceBuffer) -> DeviceIds:
        """The embedding kernel gathers the ids on the device, from the metadata rows
        `[host id, token-buffer slot or -1]` and the token buffer."""
        return DeviceIds(rows.ptr, n_rows, token_buf.ptr)

    def replay(self, transformer: Transformer, batch: ForwardBatch) -> DeviceTensor | None:
        """None: the forward runs op by op (its launches captured in the decode graphs)."""
        return None

    def decode_graphs(self, transformer: Transformer, token_buf: DeviceBuffer, *,
                      max_batch: int, max_context: int, layout: KVLayout,
                      enabled: bool = True) -> DecodeGraphs:
        """Decode rounds replayed as CUDA graphs (kernels/cuda_graphs.py)."""
        from eagerlm.kernels.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self, transformer, token_buf, max_batch=max_batch,
                            max_context=max_context,
                            layout=dataclasses.replace(layout, dtype=KV_DTYPE), enabled=enabled)

    def close(self) -> None:
        self.synchronize()
        self._uploads.clear()
        self.attn.meta = None
        self.quantized.release()
        if self._gemm is not None:
            self._gemm.close()
            self._workspace.free()
            self._gemm = None
        self.kernels.close()
