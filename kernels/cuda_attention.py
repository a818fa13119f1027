"""Attention on the cuda device: which kernel serves a batch, and its launches.

Three kernels (kernels/cuda/): `attention.cu`, the general causal GQA kernel for any batch,
its context split when the grid is small and the splits merged by `attention_merge`;
`attention_decode.cu`, flash-decoding for batches of one new row per session, its splits
fixed by the host (`decode_attention_splits`) so that a CUDA graph's launch fits any
length; `attention_prefill.cu`, mma.sync flash attention for prefill batches, first checked
once per head dim against `attention.cu` on the device (`prefill_kernel_agrees`), since its
fragment layouts are the hardware's. `CudaAttention` is owned by `CudaOps`, which calls it
from `kv_append` and `attention`; it also keeps the batch's per-session descriptors on the
device (`BatchMeta`), which both read.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.device_tensor import (
    KV_DTYPE,
    ContiguousDeviceKV,
    DeviceSessionKV,
    DeviceTensor,
    check_tensor,
)
from eagerlm.vmm.kv_layout import KVLayout

if TYPE_CHECKING:
    from eagerlm.kernels.cuda_ops import CudaOps

# Mirrors `struct SeqDesc` (kernels/cuda/common.cuh); tests/test_kernel_build.py checks it.
SEQ_DESC = np.dtype([("start", "<i4"), ("n_new", "<i4"), ("n_past", "<i4"), ("pad", "<i4"),
                     ("kv_base", "<u8")])

ATT_QB = 16  # query vectors per attention block (ATT_QB in attention.cu)
ATT_BK = 32  # keys per attention tile
PF_BM = 128  # query vectors per block of attention_prefill.cu (PF_BM there)
PF_BN = 64  # keys per K/V tile of attention_prefill.cu (PF_BN there)
PF_MIN_NEW = 16  # batches whose longest session adds this many rows take the prefill kernel
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


@dataclass
class BatchMeta:
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

    @classmethod
    def of(cls, batch: ForwardBatch,
           upload: Callable[[np.ndarray, str], DeviceTensor]) -> BatchMeta:
        """`batch`'s descriptors, checked and uploaded with `upload` (CudaOps.upload)."""
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
        dev = upload(blob, "u8")
        return cls(
            batch=batch,
            n_seqs=len(descs),
            seqs=dev.view_at(0, (len(descs),), "u8"),
            row_seq=dev.view_at(descs.nbytes, (len(row_seq),), "i32"),
            first_kv=first, kv_base0=k0.ptr, token_bytes=token_bytes,
            max_new=max(s.n_new for s in batch.seqs),
            max_total=max(s.n_total for s in batch.seqs), offsets={})

    def layer_offsets(self, layer: int) -> tuple[int, int]:
        off = self.offsets.get(layer)
        if off is None:
            off = (self.first_kv.k_view(layer).ptr - self.kv_base0,
                   self.first_kv.v_view(layer).ptr - self.kv_base0)
            self.offsets[layer] = off
        return off


class CudaAttention:
    """The attention kernels of one CudaOps (its stream, allocator, kernels and settings
    `use_decode_attention` and `tensor_core_prefill`): the choice per batch, the launches,
    the prefill kernel's check per head dim, and the last batch's descriptors."""

    def __init__(self, ops: CudaOps) -> None:
        self.ops = ops
        self.meta: BatchMeta | None = None  # the last batch's, reused by its every layer
        self.prefill_checked: dict[int, bool] = {}  # head dim -> prefill_kernel_agrees

    @property
    def _s(self) -> Any:
        return self.ops.stream.handle

    def batch_meta(self, batch: ForwardBatch) -> BatchMeta:
        """`batch`'s descriptors on the device: its own `device_meta` if it has one, else
        made once and kept while the same batch is passed again."""
        if batch.device_meta is not None:  # made by the caller, in fixed device buffers
            return batch.device_meta
        meta = self.meta
        if meta is not None and meta.batch is batch:
            return meta
        meta = BatchMeta.of(batch, self.ops.upload)
        self.meta = meta
        return meta

    def attend(self, batch: ForwardBatch, layer: int, q: DeviceTensor, *, scale: float,
               window: int, sinks: DeviceTensor | None = None) -> DeviceTensor:
        """CudaOps.attention: the decode kernel for decode batches it serves, the prefill
        kernel for prefill batches it serves (where it agrees on this device, and without
        attention sinks, which it does not take), else the general one."""
        ops = self.ops
        meta = self.batch_meta(batch)
        _, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        if meta.max_new == 1 and self._decode_ok(meta, layer, n_heads, n_kv, hd):
            keys = meta.max_total if window <= 0 else min(meta.max_total, window)
            n_splits, split_len = decode_attention_splits(keys, len(batch.seqs), n_kv, n_heads,
                                                          ops.sm_count)
            return self.decode(meta, layer, q, scale=scale, window=window,
                               n_splits=n_splits, split_len=split_len, n_seqs=len(batch.seqs),
                               sinks=sinks)
        if (sinks is None and ops.tensor_core_prefill is not False
                and meta.max_new >= PF_MIN_NEW and self._prefill_ok(meta, q, n_kv)
                and (ops.tensor_core_prefill or self.prefill_kernel_agrees(hd))):
            return self.prefill(meta, layer, q, scale=scale, window=window)
        return self.general(meta, layer, q, scale=scale, window=window, sinks=sinks)

    def general(self, meta: BatchMeta, layer: int, q: DeviceTensor, *,
                scale: float, window: int, sinks: DeviceTensor | None = None) -> DeviceTensor:
        """attention.cu: any batch, head dims up to 256, context split when the grid is
        small; `sinks` (float32 [heads]) join each head's softmax."""
        ops = self.ops
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
        if blocks < 2 * ops.sm_count and meta.max_total > 512:
            n_splits = max(1, min(32, -(-2 * ops.sm_count // blocks),
                                  -(-meta.max_total // 256)))
        split_len = -(-meta.max_total // n_splits)
        split_len = -(-split_len // ATT_BK) * ATT_BK
        n_splits = -(-meta.max_total // split_len)
        out = ops.empty((n_tok, n_heads * hd), "bf16")
        part_o, part_ml = self._split_partials(n_splits, n_tok, n_heads, hd)
        k_off, v_off = meta.layer_offsets(layer)
        smem = (ATT_QB * hd + ATT_BK * (hd + 2)) * 2
        ops.kernels[f"attention_hd{hpl}"].launch(
            self._s, (tiles, n_kv * n_splits, n_seqs), 128,
            out.ptr, 0 if part_o is None else part_o.ptr, 0 if part_ml is None else part_ml.ptr,
            q.ptr,
            meta.seqs.ptr, k_off, v_off, meta.token_bytes, n_heads, n_kv, hd,
            float(scale) * _LOG2E, int(window), n_splits, split_len, n_tok, _ptr(sinks),
            smem=smem)
        self._merge_splits(out, part_o, part_ml, sinks)
        return out

    def _split_partials(self, n_splits: int, n_tok: int, n_heads: int,
                        hd: int) -> tuple[DeviceTensor | None, DeviceTensor | None]:
        """Float32 workspaces of a context split in `n_splits` (none for one): each split's
        unnormalised output [split, row, head, hd] and its (max, sum) [split, row, head, 2],
        the layout attention_merge reads."""
        if n_splits <= 1:
            return None, None
        return (self.ops.empty((n_splits, n_tok, n_heads, hd), "f32"),
                self.ops.empty((n_splits, n_tok, n_heads, 2), "f32"))

    def _merge_splits(self, out: DeviceTensor, part_o: DeviceTensor | None,
                      part_ml: DeviceTensor | None, sinks: DeviceTensor | None) -> None:
        """attention_merge: the splits' partials (and the heads' sinks) into `out`
        [rows, heads * hd] (bf16)."""
        if part_o is None or part_ml is None:
            return
        n_splits, n_tok, n_heads, hd = part_o.shape
        self.ops.kernels["attention_merge"].launch(
            self._s, n_tok * n_heads, min(256, -(-hd // 32) * 32), out.ptr, part_o.ptr,
            part_ml.ptr, n_tok, n_heads, hd, n_splits, _ptr(sinks))

    def _decode_ok(self, meta: BatchMeta, layer: int, n_heads: int, n_kv: int,
                   hd: int) -> bool:
        """Whether attention_decode.cu serves this layer: a head dim it has a kernel for,
        and K/V rows 16-byte aligned (its loads are uint4; KV regions start page- or
        allocation-aligned, so the first session's base stands for all)."""
        if not self.ops.use_decode_attention or hd not in DECODE_HEAD_DIMS or n_heads % n_kv:
            return False
        k_off, v_off = meta.layer_offsets(layer)
        return all(x % 16 == 0 for x in (meta.kv_base0, meta.token_bytes, k_off, v_off))

    def prefill_kernel_agrees(self, hd: int) -> bool:
        """Whether attention_prefill.cu gives attention.cu's answer on this device, checked
        once per head dim on a random causal batch (two sessions, GQA 2): its mma.sync
        fragment layouts are the hardware's, so they are verified where it runs instead of
        assumed. Each kernel is within 4 bf16 ulps of the float32 truth (of an element or
        its head's RMS) in the tests, so they must agree within 8; a layout error is off by
        the whole value. A disagreement keeps the general kernel (a warning says so)."""
        ok = self.prefill_checked.get(hd)
        if ok is not None:
            return ok
        ops = self.ops
        rng = np.random.default_rng(hd)
        n_kv, n_heads, specs = 2, 4, ((0, 70), (30, 50))  # (n_past, n_new) per session
        layout = KVLayout(1, n_kv, hd, KV_DTYPE)
        kvs = [ContiguousDeviceKV(ops, layout, past + new) for past, new in specs]

        def batch_of(lengths: Sequence[tuple[int, int]]) -> ForwardBatch:  # (n_past, n_new)
            starts = np.cumsum([0] + [new for _, new in lengths]).tolist()
            return ForwardBatch(np.zeros(starts[-1], np.int32),
                                [SeqSlice(st, new, past, kv) for st, (past, new), kv
                                 in zip(starts[:-1], lengths, kvs, strict=True)],
                                np.arange(starts[-1]))

        def random(*shape: int) -> DeviceTensor:
            x = rng.standard_normal(shape).astype(np.float32)
            return ops.upload(x, "bf16").reshape(*shape)

        rows = sum(past + new for past, new in specs)  # every position's K and V
        ops.kv_append(batch_of([(0, past + new) for past, new in specs]), 0,
                      random(rows, n_kv, hd), random(rows, n_kv, hd))
        meta = self.batch_meta(batch_of(specs))
        q = random(len(meta.batch.tokens), n_heads, hd)
        tc = ops.to_numpy(self.prefill(meta, 0, q, scale=hd**-0.5, window=0))
        ref = ops.to_numpy(self.general(meta, 0, q, scale=hd**-0.5, window=0))
        self.meta = None
        for kv in kvs:
            kv.free()
        ref_rows, err = ref.reshape(-1, hd), np.abs(tc - ref).reshape(-1, hd)
        floor = np.maximum(np.abs(ref_rows), np.sqrt((ref_rows**2).mean(-1, keepdims=True)))
        ok = bool(np.isfinite(tc).all() and (err <= 8 * 2.0**-8 * floor).all())
        if not ok:
            warnings.warn(f"attention_prefill.cu disagrees with attention.cu for head dim "
                          f"{hd} on this device (max error {float(err.max()):.3g}); using "
                          f"attention.cu", RuntimeWarning, stacklevel=2)
        self.prefill_checked[hd] = ok
        return ok

    @staticmethod
    def _prefill_ok(meta: BatchMeta, q: DeviceTensor, n_kv: int) -> bool:
        """attention_prefill.cu's reach: head dims 64 and 128, whole GQA groups, and 16-byte
        aligned Q and K/V rows (its cp.async loads); a captured decode batch has no `batch`."""
        _, n_heads, hd = q.shape
        return (hd in (64, 128) and n_heads % n_kv == 0 and meta.batch is not None
                and q.ptr % 16 == 0 and meta.token_bytes % 16 == 0 and meta.kv_base0 % 16 == 0)

    def prefill(self, meta: BatchMeta, layer: int, q: DeviceTensor, *,
                scale: float, window: int) -> DeviceTensor:
        """Tensor-core flash attention (kernels/cuda/attention_prefill.cu): one block per
        PF_BM query vectors (row, head of the group) of one session and KV head."""
        n_tok, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        tiles = -(-meta.max_new * (n_heads // n_kv) // PF_BM)
        out = self.ops.empty((n_tok, n_heads * hd), "bf16")
        k_off, v_off = meta.layer_offsets(layer)
        smem = 2 * PF_BN * hd * 2  # one K and one V tile of bf16
        self.ops.kernels[f"attention_prefill_hd{hd}"].launch(
            self._s, (n_kv, tiles, meta.n_seqs), PF_BM // 16 * 32, out.ptr, q.ptr,
            meta.seqs.ptr, k_off, v_off, meta.token_bytes, n_heads, n_kv,
            float(scale) * _LOG2E, int(window), smem=smem)
        return out

    def decode(self, meta: BatchMeta, layer: int, q: DeviceTensor, *,
               scale: float, window: int, n_splits: int, split_len: int,
               n_seqs: int | None = None, sinks: DeviceTensor | None = None) -> DeviceTensor:
        """Attention of a decode batch (every session of `meta` has at most one row; q is
        [rows, n_heads, hd]) with attention_decode.cu: one block per (split, KV head,
        session), splits merged by attention_merge. `n_splits` / `split_len` come from
        decode_attention_splits, for the longest session or for any bound: the launch is
        right for every length. `n_seqs` defaults to one session per row."""
        n_tok, n_heads, hd = q.shape
        n_kv = meta.first_kv.k_view(layer).shape[1]
        group, chunks = decode_head_group(n_heads // n_kv)
        n_seqs = n_tok if n_seqs is None else n_seqs
        out = self.ops.empty((n_tok, n_heads * hd), "bf16")
        part_o, part_ml = self._split_partials(n_splits, n_tok, n_heads, hd)
        k_off, v_off = meta.layer_offsets(layer)
        n_groups = DECODE_THREADS // (hd // 8)  # key groups per block (NG in the kernel)
        smem = (n_groups * group * hd + 2 * n_groups * group + 2 * group) * 4
        self.ops.kernels[f"attention_decode_hd{hd}_g{group}"].launch(
            self._s, (n_splits, n_kv * chunks, n_seqs), DECODE_THREADS,
            out.ptr, 0 if part_o is None else part_o.ptr, 0 if part_ml is None else part_ml.ptr,
            q.ptr, meta.seqs.ptr, k_off, v_off, meta.token_bytes, n_heads, n_kv,
            float(scale) * _LOG2E, int(window), n_splits, split_len, n_tok, _ptr(sinks),
            smem=smem)
        self._merge_splits(out, part_o, part_ml, sinks)
        return out


def _ptr(t: DeviceTensor | None) -> int:
    """A kernel's optional float32 input: its address, or null."""
    if t is None:
        return 0
    check_tensor(t, "f32", "attention sinks")
    return t.ptr
