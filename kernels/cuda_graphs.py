"""Decode rounds as CUDA graphs: the whole forward plus the sampler, replayed with one launch.

A decode round issues hundreds of kernels (a dozen per layer); launched one by one from
Python, the host needs more time per round than a small model's GPU work takes, and the
GPU idles between launches. A graph captured once replays them all with a single
`cuGraphLaunch`, host work per round then being: fill one small pinned blob, one
host-to-device copy, one launch, one device-to-device copy of the sampled tokens.

A graph may be replayed only if nothing it reads moved, so everything that changes from
round to round lives in fixed device buffers that the round overwrites (laid out by
`BlobLayout`):
- per row: [host token id, token-buffer slot] (decode rows read the previous round's
  sample from the token buffer on the device, as in the eager path);
- per session: the SeqDesc (start, n_new = 1, n_past, KV base address: a session's KV
  region never moves, so its base pointer is simply data), the row -> session map,
  the rope position, the logits row, the sampler's parameters and output slot, and for
  rounds with penalties or a logit bias each session's token-count span and penalty row
  (the counts and the bias themselves are per-session device tensors that never move
  either).
Batches are padded up to a bucket size (1, 2, 4, 8, 16, 24, 32, 48, 64, ...) with rows
that read token 0, attend over a one-token scratch KV and sample into nowhere (slot -1)
(they all append their K and V to that one scratch slot at once: a race whose outcome
only the padding rows, whose results are dropped, ever see);
the context length is bucketed by powers of two (at least 512), which fixes how the
attention kernels split long contexts. One graph per (batch bucket, context bucket),
captured the first time it is needed (after one eager warm-up run, which loads modules
and plans GEMMs outside the capture) and kept.

A round with penalized or logit-biased sessions replays a variant of its bucket's graph
that also counts the round's inputs (count_tokens) and samples from adjusted logits
(penalize_rows; a session's bias is a device tensor that never moves, as its counts); a
round in which some session asks for logprobs, one that also runs token_logprobs into the
graph's own buffers, copied out after the replay as the sampled tokens are. A round with
constrained sessions (a JSON schema, a grammar) replays a forward-only variant, which
leaves the logits in a fixed buffer (`forward`): the round then samples from them as the
general path does, its unconstrained rows first and its constrained rows once the host has
their masks (dispatch/round_work.py), so the wait for the masks never holds back the
forward's launch. Prefill and mixed rounds run through the general eager path.

Every decode round that fits a bucket goes through these fixed buffers, graphs or not:
with `enabled = False`, or where a capture failed (the reason is kept in `failures`), the
same launches are made one by one. So turning graphs off changes how the kernels are
launched, never which kernels run on which shapes: a GEMM's rounding may depend on its row
count, and a batch padded to its bucket must not sample differently from the same batch
unpadded. The tests compare both paths token for token and logprob for logprob.

Over several devices (tensor parallelism) each device has its own: device 0's sample, and
a follower replays its share of each round (`forward_shard`: the forward alone, padded to
device 0's bucket, with device 0's logit rows), captured at the same rounds as device 0's,
so that every device's collectives meet (docs/tensor_parallel.md).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagerlm.kernels.backend import DecodeKind
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cuda_attention import SEQ_DESC, BatchMeta
from eagerlm.kernels.cuda_ops import CudaOps
from eagerlm.kernels.cuda_sampling import (
    COUNT_SPAN,
    PENALTY_ROW,
    SAMPLE_PARAMS,
    count_table,
    logprob_table,
    penalty_table,
    sample_table,
)
from eagerlm.kernels.device_tensor import ContiguousDeviceKV, DeviceIds, DeviceTensor
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import MAX_LOGPROBS, SamplingParams
from eagerlm.vmm.cuda_driver import check, cu, driver
from eagerlm.vmm.kv_layout import KVLayout

MIN_CONTEXT_BUCKET = 512


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ... up to and including max_batch."""
    out, b = [1, 2, 4, 8], 16
    while b < max_batch:
        out += [b, b + b // 2]
        b *= 2
    return sorted({x for x in out if x < max_batch} | {max_batch})


def context_bucket(n_total: int, max_context: int) -> int:
    """The smallest power of two >= n_total (and >= 512), capped at the model's context."""
    b = max(MIN_CONTEXT_BUCKET, 1 << max(0, math.ceil(math.log2(max(1, n_total)))))
    return min(b, max(max_context, n_total))


@dataclass(frozen=True)
class BlobLayout:
    """Where each field of a graph's input blob lies: `rows` entries of each field's size
    (bytes per entry), each field 16-byte aligned."""

    rows: int
    fields: tuple[tuple[str, int], ...]

    @functools.cached_property
    def _offsets(self) -> dict[str, int]:
        at, out = 0, {}
        for name, size in self.fields:
            out[name] = at
            at += -(-size * self.rows // 16) * 16
        out["end"] = at
        return out

    def offset(self, name: str) -> int:
        return self._offsets[name]

    @property
    def nbytes(self) -> int:
        return self._offsets["end"]

    def view(self, blob: np.ndarray, name: str, dtype: Any, per_row: int = 1) -> np.ndarray:
        """The field in a host blob, as `rows * per_row` values of `dtype`."""
        dt = np.dtype(dtype)
        at = self.offset(name)
        return blob[at:at + self.rows * per_row * dt.itemsize].view(dt)

    def tensor(self, buffer: Any, name: str, shape: tuple[int, ...],
               dtype: str) -> DeviceTensor:
        """The field in the device blob `buffer`, as a tensor a launch reads."""
        return DeviceTensor(buffer.ptr + self.offset(name), shape, dtype, buffer)


# a decode graph's blob, per row (kernels/cuda_spec_graphs.py has the speculative one's)
DECODE_FIELDS = (("rows", 8), ("seqs", SEQ_DESC.itemsize), ("row_seq", 4), ("positions", 4),
                 ("logit_rows", 8), ("params", SAMPLE_PARAMS.itemsize), ("out_slots", 4),
                 ("count_spans", COUNT_SPAN.itemsize), ("penalties", PENALTY_ROW.itemsize),
                 ("logprob_n", 4))


@dataclass
class _Step:
    """One (batch bucket, context bucket, kind, shard): its fixed buffers, its launches,
    and once captured, their graph. A shard step is a follower device's share of its
    leader's rounds of that kind: the forward alone (tensor parallelism)."""

    batch: int
    context: int
    kind: DecodeKind
    launch: Callable[[], None]  # the round's kernels, reading every input from `inputs`
    inputs: Any  # DeviceBuffer: the blob
    out: Any  # DeviceBuffer: int32 [batch] sampled tokens (None: a shard step)
    lp_values: Any  # DeviceBuffer: float32 [batch, 1 + MAX_LOGPROBS] (logprob kinds)
    lp_ids: Any  # DeviceBuffer: int32 [batch, MAX_LOGPROBS]
    logits: Any = None  # DeviceBuffer: float32 [batch, vocab] (forward-only kinds)
    graph: Any = None
    exec: Any = None  # None: launched eagerly (graphs off, or the capture failed)


class DecodeGraphs:
    """Captured decode rounds for one transformer, one token buffer and one KV layout."""

    def __init__(self, ops: CudaOps, transformer: Transformer, token_buf: Any, *,
                 max_batch: int, max_context: int, layout: KVLayout,
                 enabled: bool = True) -> None:
        self.ops = ops
        self.transformer = transformer
        self.token_buf = token_buf
        self.max_context = max_context
        self.buckets = batch_buckets(max_batch)
        self.enabled = enabled
        self.scratch = ContiguousDeviceKV(ops, layout, 1)  # what padding rows attend over
        # keyed by (batch bucket, context bucket, kind, shard)
        self.steps: dict[tuple[int, int, DecodeKind, bool], _Step] = {}
        self.failures: dict[tuple[int, int, DecodeKind, bool], str] = {}
        self.replays = 0
        self.adjusted_replays = 0  # of which, of graphs with penalties or a logit bias
        self.logprob_replays = 0  # and of graphs with logprobs
        self.forward_replays = 0  # and of forward-only graphs (rounds with constraints)
        self.shard_replays = 0  # and of a follower's shares of its leader's rounds
        self.captured = 0
        self.eager_rounds = 0  # rounds through the fixed buffers launched one by one
        self.spec: Any = None  # speculative rounds' buffers and graphs (cuda_spec_graphs)

    # -- per round -----------------------------------------------------------------------

    def kind(self, params: Sequence[SamplingParams], constrained: bool) -> DecodeKind | None:
        """The variant of its bucket a round of one row per session with `params` takes;
        None past the largest bucket."""
        if not params or len(params) > self.buckets[-1]:
            return None
        adjusted = any(p.adjusts_logits for p in params)
        if constrained:
            return DecodeKind(adjusted, False, forward_only=True)
        return DecodeKind(adjusted, any(p.logprobs is not None for p in params))

    def run(self, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
            params: Sequence[SamplingParams], out: Any, out_slots: Sequence[int],
            counts: Sequence[tuple[DeviceTensor, int] | None] | None = None,
            logprobs_out: tuple[Any, Any] | None = None,
            biases: Sequence[DeviceTensor | None] | None = None) -> bool:
        """Run the decode round through its bucket's fixed buffers: one row per session,
        `rows[i]` = [host token id, token-buffer slot or -1] as in the eager path's
        metadata, each row sampled into `out[i]` and into the token buffer at
        `out_slots[i]` (the session's slot: a row that read a host token, such as the
        last prompt token after a cached prefix, has no input slot to write back to).
        Penalized sessions need `counts[i]` = (their token counts, 1 if this row is still
        in the prompt else 0), sessions with a logit bias `biases[i]` (from
        `CudaOps.logit_bias`); rows asking for logprobs write them to `logprobs_out`
        (values, ids buffers, laid out as NumpyOps.sample_round's). The round is the
        bucket's graph replayed, or (graphs off, or its capture failed) the same launches
        made one by one. False only when the round has no bucket (the caller runs it
        through the general path)."""
        n = len(n_pasts)
        kind = self.kind(params, constrained=False)
        if kind is None:
            return False
        if kind.logprobs and logprobs_out is None:
            raise ValueError("a round with logprobs needs buffers for them")
        step = self._launch(kind, rows, n_pasts, kvs, params, out_slots, counts, biases)
        d, s = driver(), self.ops.stream.handle
        copies = [(out, step.out, n * 4)]
        if kind.logprobs and logprobs_out is not None:
            copies += [(logprobs_out[0], step.lp_values, n * (1 + MAX_LOGPROBS) * 4),
                       (logprobs_out[1], step.lp_ids, n * MAX_LOGPROBS * 4)]
        for dst, src, nbytes in copies:
            cu("cuMemcpyDtoDAsync", d.CUdeviceptr(dst.ptr), d.CUdeviceptr(src.ptr), nbytes, s)
        return True

    def forward(self, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
                params: Sequence[SamplingParams],
                counts: Sequence[tuple[DeviceTensor, int] | None] | None = None,
                order: Sequence[int] | None = None) -> DeviceTensor | None:
        """The decode round's forward only (counting penalized sessions' inputs, as `run`),
        through the forward-only variant of its bucket: the logits, float32 [n, vocab], in
        the variant's fixed buffer (valid until its next replay, which the stream orders
        after this round's sampling); logits row j is row `order[j]`'s (default: row j's).
        None when the round has no bucket."""
        n = len(n_pasts)
        kind = self.kind(params, constrained=True)
        if kind is None:
            return None
        step = self._launch(kind, rows, n_pasts, kvs, params, [-1] * n, counts, None,
                            penalties=False, order=order)
        vocab = self.transformer.config.vocab_size
        return DeviceTensor(step.logits.ptr, (n, vocab), "f32", step.logits)

    def forward_shard(self, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
                      logit_rows: Sequence[int], leader: DecodeKind) -> None:
        """A follower's share of a round its leader runs as `leader` (through its own
        `run` or `forward`): the same bucket, so every collective has the leader's size,
        and the leader's logit rows, so the all-gathered logits are its rows'. Keyed by the
        leader's kind, this device warms up and captures exactly when the leader does:
        a warm-up runs the forward, and its collectives must meet the leader's."""
        self._launch(leader, rows, n_pasts, kvs, None, [-1] * len(n_pasts), None, None,
                     penalties=False, order=logit_rows, shard=True)

    def _launch(self, kind: DecodeKind, rows: np.ndarray, n_pasts: Sequence[int],
                kvs: Sequence[Any], params: Sequence[SamplingParams] | None,
                out_slots: Sequence[int],
                counts: Sequence[tuple[DeviceTensor, int] | None] | None,
                biases: Sequence[DeviceTensor | None] | None, *,
                penalties: bool = True, order: Sequence[int] | None = None,
                shard: bool = False) -> _Step:
        """Fill the bucket's blob and replay its graph (or make its launches);
        `penalties`: whether the graph adjusts the logits (a forward-only one does not);
        `params` None: a shard's round (no sampling)."""
        b = next(x for x in self.buckets if x >= len(n_pasts))
        key = (b, context_bucket(max(n_pasts) + 1, self.max_context), kind, shard)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self._step(*key)
        if self.enabled and step.exec is None and key not in self.failures:
            warm = None if params is None else []
            self.capture(step, self._blob(b, np.zeros((0, 2), np.int32), [], [], warm), key)
        blob = self._blob(b, rows, n_pasts, kvs, params, out_slots, counts, biases,
                          penalties=penalties, order=order)
        self.ops._ring.upload(blob, DeviceTensor(step.inputs.ptr, (blob.size,), "u8"))
        if step.exec is not None:
            self.replay(step)
            self.replays += 1
            if shard:
                self.shard_replays += 1
            else:
                self.adjusted_replays += kind.adjusted
                self.logprob_replays += kind.logprobs
                self.forward_replays += kind.forward_only
        else:
            step.launch()
            self.eager_rounds += 1
        return step

    def _blob(self, b: int, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
              params: Sequence[SamplingParams] | None, out_slots: Sequence[int] = (),
              counts: Sequence[tuple[DeviceTensor, int] | None] | None = None,
              biases: Sequence[DeviceTensor | None] | None = None, *,
              penalties: bool = True, order: Sequence[int] | None = None) -> np.ndarray:
        """The graph's inputs for this round; rows past the real ones are padding.
        `params` None: a shard's round, which samples nothing (its sampling fields stay
        zero: no kernel of its graph reads them)."""
        n = len(n_pasts)
        lay = BlobLayout(b, DECODE_FIELDS)
        blob = np.zeros(lay.nbytes, np.uint8)

        def field(name: str, dtype: Any, per_row: int = 1) -> np.ndarray:
            return lay.view(blob, name, dtype, per_row)

        r = field("rows", np.int32, 2).reshape(b, 2)
        r[:n] = rows[:n]
        r[n:] = (0, -1)
        seqs = field("seqs", SEQ_DESC)
        seqs["start"] = np.arange(b)
        seqs["n_new"] = 1
        seqs["n_past"][:n] = n_pasts
        seqs["kv_base"][:n] = [kv.k_view(0).ptr for kv in kvs]
        seqs["kv_base"][n:] = self.scratch.k_view(0).ptr
        field("row_seq", np.int32)[:] = np.arange(b, dtype=np.int32)
        pos = field("positions", np.int32)
        pos[:n] = n_pasts
        pos[n:] = 0
        logit_rows = field("logit_rows", np.int64)
        logit_rows[:] = np.arange(b, dtype=np.int64)
        if order is not None:  # a forward-only round's logits in its sampling order
            logit_rows[:n] = order
        if params is None:
            return blob
        vocab = self.transformer.config.vocab_size
        table = field("params", SAMPLE_PARAMS)
        table[:n] = sample_table(params, [p + 1 for p in n_pasts], vocab)
        table[n:] = sample_table([SamplingParams(temperature=0.0)] * (b - n), [0] * (b - n),
                                 vocab)
        slots = field("out_slots", np.int32)
        slots[:n] = out_slots
        slots[n:] = -1
        want = field("logprob_n", np.int32)
        want[:n] = logprob_table([p.logprobs for p in params])
        want[n:] = -1
        if any(p.adjusts_logits for p in params):  # zeros elsewhere: nothing counted
            # or adjusted
            c = list(counts or [None] * n)
            field("count_spans", COUNT_SPAN)[:n] = count_table(
                [(None, i, 1, 0) if x is None else (x[0], i, 1, x[1]) for i, x in enumerate(c)])
            if penalties:
                field("penalties", PENALTY_ROW)[:n] = penalty_table(
                    params, [None if x is None else x[0] for x in c], biases, vocab)
        return blob

    # -- the fixed launches and their capture ---------------------------------------------

    def _step(self, b: int, ctx: int, kind: DecodeKind, shard: bool) -> _Step:
        """The bucket's buffers and its round: every launch reads its inputs from them."""
        ops = self.ops
        lay = BlobLayout(b, DECODE_FIELDS)
        inputs = ops.device.alloc(lay.nbytes)
        vocab = self.transformer.config.vocab_size
        samples = not shard
        out_buf = ops.device.alloc(b * 4) if samples else None
        lp_values = ops.device.alloc(b * (1 + MAX_LOGPROBS) * 4) \
            if samples and kind.logprobs else None
        lp_ids = ops.device.alloc(b * MAX_LOGPROBS * 4) if samples and kind.logprobs else None
        logits_buf = ops.device.alloc(b * vocab * 4) if samples and kind.forward_only \
            else None

        def tensor(name: str, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
            return lay.tensor(inputs, name, shape, dtype)

        k0 = self.scratch.k_view(0)
        meta = BatchMeta(batch=None, n_seqs=b, seqs=tensor("seqs", (b * SEQ_DESC.itemsize,), "u8"),
                         row_seq=tensor("row_seq", (b,), "i32"), first_kv=self.scratch,
                         kv_base0=k0.ptr, token_bytes=k0.strides[0], max_new=1,
                         max_total=ctx, offsets={})
        ids = DeviceIds(inputs.ptr + lay.offset("rows"), b, self.token_buf.ptr)
        batch = ForwardBatch(
            ids, [SeqSlice(i, 1, 0, self.scratch) for i in range(b)],  # type: ignore[arg-type]
            np.arange(b), device_meta=meta)
        batch.positions = tensor("positions", (b,), "i32")  # type: ignore[assignment]
        batch.logit_rows = tensor("logit_rows", (b,), "i64")  # type: ignore[assignment]
        params = tensor("params", (b * SAMPLE_PARAMS.itemsize,), "u8")
        slots = tensor("out_slots", (b,), "i32")
        out = DeviceTensor(out_buf.ptr, (b,), "i32", out_buf) if out_buf is not None else None

        spans = tensor("count_spans", (b * COUNT_SPAN.itemsize,), "u8")
        penalties = tensor("penalties", (b * PENALTY_ROW.itemsize,), "u8")

        want = tensor("logprob_n", (b,), "i32")

        def launch() -> None:  # as RoundWork's eager round, with every input in the blob
            if shard:  # the leader samples; this device's logits meet its in the gather
                self.transformer.forward(batch)
                return
            if kind.adjusted:
                ops.count_inputs_device(ids, spans, b, vocab)
            logits = self.transformer.forward(batch)
            if logits_buf is not None:  # forward only: the round samples from the buffer
                cu("cuMemcpyDtoDAsync", driver().CUdeviceptr(logits_buf.ptr),
                   driver().CUdeviceptr(logits.ptr), b * vocab * 4, ops.stream.handle)
                return
            drawn = ops.penalize_device(logits, penalties) if kind.adjusted else logits
            ops.sample_device(drawn, params, out=out, token_buf=self.token_buf.ptr,
                              out_slots=slots)
            if lp_values is not None and lp_ids is not None:
                ops.token_logprobs_device(logits, out, want, values=lp_values.ptr,
                                          top_ids=lp_ids.ptr)

        return _Step(b, ctx, kind, launch, inputs, out_buf, lp_values, lp_ids, logits_buf)

    def capture(self, step: Any, warm_blob: np.ndarray, key: Any) -> None:
        """Record `step`'s launches as a graph (a `_Step`, or a speculative round's,
        kernels/cuda_spec_graphs.py). They run once first on `warm_blob` (padding only: every
        row a padding row), to load modules and plan GEMMs outside the capture; if the
        capture fails, the step stays eager and the reason is kept in `failures[key]`."""
        ops, d = self.ops, driver()
        ops._ring.upload(warm_blob, DeviceTensor(step.inputs.ptr, (warm_blob.size,), "u8"))
        stream = ops.stream.handle
        try:
            step.launch()  # warm-up
            ops.synchronize()
            ops.ctx.bind()
            with ops.capturing():
                cu("cuStreamBeginCapture", stream,
                   d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                try:
                    step.launch()
                except BaseException:
                    with contextlib.suppress(Exception):  # the capture may be invalidated
                        cu("cuGraphDestroy", cu("cuStreamEndCapture", stream))
                    raise
                graph = cu("cuStreamEndCapture", stream)
            try:
                exec_ = cu("cuGraphInstantiate", graph, 0)
            except BaseException:
                cu("cuGraphDestroy", graph)
                raise
        except Exception as exc:  # this bucket stays eager; the reason is kept
            self.failures[key] = f"{type(exc).__name__}: {exc}"
            ops.synchronize()
            return
        step.graph, step.exec = graph, exec_
        self.captured += 1

    def replay(self, step: Any) -> None:
        """Launch `step`'s captured graph on the ops' stream."""
        self.ops.ctx.bind()
        check(driver().cuGraphLaunch(step.exec, self.ops.stream.handle), "cuGraphLaunch")

    def run_spec(self, rows: np.ndarray, seq_rows: Sequence[tuple[int, int, int]],
                 kvs: Sequence[Any], params: Sequence[SamplingParams],
                 out_slots: Sequence[int], seqs: Sequence[Any], buffers: Any,
                 counts_at: int, stats_at: int, out: Any,
                 logprobs_out: tuple[Any, Any] | None = None) -> bool:
        """A decode round with speculating sessions through fixed buffers (and its graph):
        kernels/cuda_spec_graphs.py's `SpecRounds.run`."""
        from eagerlm.kernels.cuda_spec_graphs import SpecRounds

        if self.spec is None or self.spec.buffers is not buffers:
            if self.spec is not None:
                self.spec.close()
            self.spec = SpecRounds(self, buffers)
        return self.spec.run(rows, seq_rows, kvs, params, out_slots, seqs, counts_at,
                             stats_at, out, logprobs_out)

    def close(self) -> None:
        """After the stream has finished every replay."""
        self.ops.synchronize()
        if self.spec is not None:
            self.spec.close()
        for step in self.steps.values():
            if step.exec is not None:
                cu("cuGraphExecDestroy", step.exec)
                cu("cuGraphDestroy", step.graph)
            for buf in (step.inputs, step.out, step.lp_values, step.lp_ids, step.logits):
                if buf is not None:
                    buf.free()
        self.steps.clear()
        self.scratch.free()
