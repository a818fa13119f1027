"""Speculative decode rounds through fixed buffers and CUDA graphs (kernels/cuda_graphs.py
says why decode rounds are graphs; kernels/speculative.py what speculation does).

A round in which every session decodes and some speculate (prompt lookup) has rows the
host laid out but positions only the device knows, and its acceptance decides the next
round's inputs: all of that is device work, so the whole round can be one graph. Its
kernels, in order: `spec_prepare` (positions into `SpecBuffers.firsts`, proposals into the
draft rows of the blob's row table), `spec_positions` (the descriptors' n_past and the row
positions), the forward, `spec_draw_positions` and the sampler over every row, logprobs
when asked, and `spec_accept` (runs, lengths, histories, next inputs).

What a graph fixes, per (rows bucket, context bucket, drafts bucket, logprobs): the rows
(padded with single-row sessions on a scratch KV, as decode graphs pad), the descriptor
table (as long as the rows bucket: sessions past the real and padding ones are empty,
n_new 0, which the attention kernels skip), the entries' table (padding entries have slot
-1, which every speculation kernel skips) and the most rows per session (1 + the drafts
bucket), which sets the attention kernel's grid. The round's counts and statistics land
at fixed places in the step's output (after its rows); they are copied to the round's
output buffer with its tokens.

Rounds with penalties or a logit bias, constrained sessions or a draft model take the
general eager path (RoundWork's), which runs the same kernels launched one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cuda_attention import SEQ_DESC, BatchMeta
from eagerlm.kernels.cuda_graphs import BlobLayout, context_bucket
from eagerlm.kernels.cuda_sampling import SAMPLE_PARAMS, logprob_table, sample_table
from eagerlm.kernels.cuda_speculative import SPEC_ENTRY, spec_entries
from eagerlm.kernels.device_tensor import DeviceIds, DeviceTensor
from eagerlm.kernels.sampling import MAX_LOGPROBS, SamplingParams
from eagerlm.kernels.speculative import SPEC_STATS, SpecBuffers, SpecSeq
from eagerlm.vmm.cuda_driver import cu, driver

if TYPE_CHECKING:
    from eagerlm.kernels.cuda_graphs import DecodeGraphs

DRAFT_BUCKETS = (1, 2, 4, 8, 16)  # most draft rows per session a graph allows


def rows_bucket(n: int) -> int:
    """The smallest of 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... at least `n` (decode
    graphs' batch buckets, kernels/cuda_graphs.py)."""
    for b in (1, 2, 4, 8):
        if n <= b:
            return b
    b = 16
    while True:
        if n <= b:
            return b
        if n <= b + b // 2:
            return b + b // 2
        b *= 2


# the blob of a speculative round's graph, per row (and per session or entry: at most as
# many as rows)
SPEC_FIELDS = (("rows", 8), ("seqs", SEQ_DESC.itemsize), ("row_seq", 4), ("positions", 4),
               ("logit_rows", 8), ("params", SAMPLE_PARAMS.itemsize), ("out_slots", 4),
               ("logprob_n", 4), ("entries", SPEC_ENTRY.itemsize), ("past_of", 8))


@dataclass(frozen=True)
class _Kind:
    max_new: int  # 1 + the drafts bucket: the most rows of one session
    logprobs: bool


@dataclass
class _Step:
    rows: int
    context: int
    kind: _Kind
    launch: Callable[[], None]
    inputs: Any  # DeviceBuffer: the blob
    out: Any  # DeviceBuffer: int32 [rows] samples, [rows] counts, [rows, 3] statistics
    lp_values: Any
    lp_ids: Any
    graph: Any = None
    exec: Any = None


class SpecRounds:
    """The speculative decode rounds of one DecodeGraphs (its ops, transformer, token
    buffer, scratch KV and capture)."""

    def __init__(self, graphs: DecodeGraphs, buffers: SpecBuffers) -> None:
        self.graphs = graphs
        self.buffers = buffers
        self.steps: dict[tuple[int, int, _Kind], _Step] = {}
        self.replays = 0
        self.eager_rounds = 0

    def run(self, rows: np.ndarray, seq_rows: Sequence[tuple[int, int, int]],
            kvs: Sequence[Any], params: Sequence[SamplingParams], out_slots: Sequence[int],
            seqs: Sequence[SpecSeq], counts_at: int, stats_at: int, out: Any,
            logprobs_out: tuple[Any, Any] | None) -> bool:
        """A decode round with speculating sessions (`seqs`, their entries) through its
        bucket's fixed buffers; every row is sampled, row order = output order. `rows` are
        the metadata rows, `seq_rows` (start, rows, n_past bound) per session, `out_slots`
        per session its token-buffer slot (-1 for a speculating one: its acceptance writes
        it). False when the round fits no bucket (the general path runs it)."""
        g = self.graphs
        n_rows = len(rows)
        drafts = max((e.k for e in seqs), default=0)
        if drafts > DRAFT_BUCKETS[-1] or not n_rows:
            return False
        r = rows_bucket(n_rows)
        kind = _Kind(1 + next(d for d in DRAFT_BUCKETS if d >= drafts),
                     any(p.logprobs is not None for p in params))
        if kind.logprobs and logprobs_out is None:
            raise ValueError("a round with logprobs needs buffers for them")
        ctx = context_bucket(max(past + n for _, n, past in seq_rows), g.max_context)
        key = (r, ctx, kind)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self._step(r, ctx, kind)
        if g.enabled and step.exec is None and key not in g.failures:
            g.capture(step, self._blob(r, np.zeros((0, 2), np.int32), [], [], [], [], []),
                      key)
        blob = self._blob(r, rows, seq_rows, kvs, params, out_slots, seqs)
        ops = g.ops
        ops._ring.upload(blob, DeviceTensor(step.inputs.ptr, (blob.size,), "u8"))
        if step.exec is not None:
            g.replay(step)
            self.replays += 1
        else:
            step.launch()
            self.eager_rounds += 1
        n_spec = len(seqs)
        copies = [(out.ptr, step.out.ptr, n_rows * 4),
                  (out.ptr + counts_at * 4, step.out.ptr + r * 4, n_spec * 4),
                  (out.ptr + stats_at * 4, step.out.ptr + 2 * r * 4, n_spec * SPEC_STATS * 4)]
        if kind.logprobs and logprobs_out is not None:
            copies += [(logprobs_out[0].ptr, step.lp_values.ptr,
                        n_rows * (1 + MAX_LOGPROBS) * 4),
                       (logprobs_out[1].ptr, step.lp_ids.ptr, n_rows * MAX_LOGPROBS * 4)]
        d, s = driver(), ops.stream.handle
        for dst, src, nbytes in copies:
            if nbytes:
                cu("cuMemcpyDtoDAsync", d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes, s)
        return True

    def _blob(self, r: int, rows: np.ndarray, seq_rows: Sequence[tuple[int, int, int]],
              kvs: Sequence[Any], params: Sequence[SamplingParams],
              out_slots: Sequence[int], seqs: Sequence[SpecSeq]) -> np.ndarray:
        """The graph's inputs: the real rows and sessions, then one padding session per
        padding row, then empty sessions; per row the sampler's parameters (its session's)."""
        g = self.graphs
        lay = BlobLayout(r, SPEC_FIELDS)
        blob = np.zeros(lay.nbytes, np.uint8)

        def field(name: str, dtype: Any, per_row: int = 1) -> np.ndarray:
            return lay.view(blob, name, dtype, per_row)

        n_rows, n_seqs = len(rows), len(seq_rows)
        table = field("rows", np.int32, 2).reshape(r, 2)
        table[:n_rows] = rows
        table[n_rows:] = (0, -1)
        descs = field("seqs", SEQ_DESC)
        row_seq = field("row_seq", np.int32)
        row_params: list[SamplingParams] = []
        slots = field("out_slots", np.int32)
        slots[:] = -1
        for i, ((start, n, past), kv) in enumerate(zip(seq_rows, kvs, strict=True)):
            descs[i] = (start, n, past, 0, kv.k_view(0).ptr)
            row_seq[start:start + n] = i
            row_params += [params[i]] * n
            slots[start + n - 1] = out_slots[i]  # a one-row session's
        scratch = g.scratch.k_view(0).ptr
        pad = r - n_rows
        for j in range(pad):  # a padding row: its own session on the scratch KV
            descs[n_seqs + j] = (n_rows + j, 1, 0, 0, scratch)
            row_seq[n_rows + j] = n_seqs + j
        descs[n_seqs + pad:] = (r, 0, 0, 0, scratch)  # empty: no rows, skipped
        field("positions", np.int32)[:] = 0  # made on the device
        field("logit_rows", np.int64)[:] = np.arange(r)
        vocab = g.transformer.config.vocab_size
        sp = field("params", SAMPLE_PARAMS)
        sp[:n_rows] = sample_table(row_params, [1] * n_rows, vocab)  # positions: device
        sp[n_rows:] = sample_table([SamplingParams(temperature=0.0)] * pad, [0] * pad, vocab)
        want = field("logprob_n", np.int32)
        want[:n_rows] = logprob_table([p.logprobs for p in row_params])
        want[n_rows:] = -1
        field("entries", SPEC_ENTRY)[:] = spec_entries(seqs, r)[:r]
        past_of = field("past_of", np.int32, 2).reshape(r, 2)
        past_of[:] = (-1, 0)
        for e in seqs:
            if e.past < 0:  # a decode entry: its session starts at the device's position
                past_of[int(row_seq[e.start])] = (e.slot, 0)
        return blob

    def _step(self, r: int, ctx: int, kind: _Kind) -> _Step:
        """The bucket's buffers and its round: every launch reads its inputs from them."""
        g = self.graphs
        ops, buffers = g.ops, self.buffers
        lay = BlobLayout(r, SPEC_FIELDS)
        inputs = ops.device.alloc(lay.nbytes)
        out_buf = ops.device.alloc(r * (2 + SPEC_STATS) * 4)
        lp_values = ops.device.alloc(r * (1 + MAX_LOGPROBS) * 4) if kind.logprobs else None
        lp_ids = ops.device.alloc(r * MAX_LOGPROBS * 4) if kind.logprobs else None

        def tensor(name: str, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
            return lay.tensor(inputs, name, shape, dtype)

        k0 = g.scratch.k_view(0)
        meta = BatchMeta(batch=None, n_seqs=r, seqs=tensor("seqs", (r * SEQ_DESC.itemsize,),
                                                           "u8"),
                         row_seq=tensor("row_seq", (r,), "i32"), first_kv=g.scratch,
                         kv_base0=k0.ptr, token_bytes=k0.strides[0], max_new=kind.max_new,
                         max_total=ctx, offsets={})
        ids = DeviceIds(inputs.ptr + lay.offset("rows"), r, g.token_buf.ptr)
        batch = ForwardBatch(ids, [SeqSlice(i, 1, 0, g.scratch) for i in range(r)],  # type: ignore[arg-type]
                             np.arange(r), device_meta=meta)
        positions = tensor("positions", (r,), "i32")
        batch.positions = positions  # type: ignore[assignment]
        logit_rows = tensor("logit_rows", (r,), "i64")
        batch.logit_rows = logit_rows  # type: ignore[assignment]
        params = tensor("params", (r * SAMPLE_PARAMS.itemsize,), "u8")
        slots = tensor("out_slots", (r,), "i32")
        want = tensor("logprob_n", (r,), "i32")
        entries = tensor("entries", (r * SPEC_ENTRY.itemsize,), "u8")
        past_of = tensor("past_of", (2 * r,), "i32")
        out = DeviceTensor(out_buf.ptr, (r,), "i32", out_buf)
        rows_ptr = inputs.ptr + lay.offset("rows")

        def launch() -> None:  # RoundWork's speculative round, every input in the blob
            ops.spec_prepare_device(entries, r, rows_ptr, buffers)
            ops.spec_positions_device(meta, past_of, buffers, positions)
            logits = g.transformer.forward(batch)
            ops.draw_positions_device(params, positions, logit_rows, r)
            ops.sample_device(logits, params, out=out, token_buf=g.token_buf.ptr,
                              out_slots=slots)
            if lp_values is not None and lp_ids is not None:
                ops.token_logprobs_device(logits, out, want, values=lp_values.ptr,
                                          top_ids=lp_ids.ptr)
            ops.spec_accept_device(entries, r, out_buf.ptr, r, 2 * r, g.token_buf.ptr,
                                   buffers)

        return _Step(r, ctx, kind, launch, inputs, out_buf, lp_values, lp_ids)

    def close(self) -> None:
        """After the stream has finished every replay (DecodeGraphs.close)."""
        for step in self.steps.values():
            if step.exec is not None:
                cu("cuGraphExecDestroy", step.exec)
                cu("cuGraphDestroy", step.graph)
            for buf in (step.inputs, step.out, step.lp_values, step.lp_ids):
                if buf is not None:
                    buf.free()
        self.steps.clear()
