"""Speculative decoding's device steps on cuda (kernels/cuda/speculative.cu; the rules are
kernels/speculative.py's): `CudaSpeculation`, mixed into `CudaOps` as the speculation half of
kernels/backend.py's `RoundBackend`, which NumpyOps also satisfies.

Unlike the cpu backend, nothing here tells the host a speculating session's position: the
round's kernels are enqueued before the rounds before it have run. So `spec_prepare` leaves
each session's first position in `SpecBuffers.firsts`, and `spec_positions` makes a forward
batch's per-session descriptors, row positions and (through `sample_round`'s
`positions_at`) the sampler's draw positions from it, on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cuda_attention import BatchMeta
from eagerlm.kernels.cuda_kernels import OpsMixin
from eagerlm.kernels.device_tensor import DeviceIds, DeviceTensor
from eagerlm.kernels.speculative import SpecBuffers, SpecSeq
from eagerlm.vmm.cuda_driver import cu, driver

# Mirrors `struct SpecEntry` (kernels/cuda/speculative.cu); tests/test_kernel_build.py checks
# the kernels' parameters, tests/test_cuda_speculative.py the layout through the kernels.
SPEC_ENTRY = np.dtype([("slot", "<i4"), ("start", "<i4"), ("k", "<i4"), ("propose", "<i4"),
                       ("past", "<i4"), ("out", "<i4"), ("lookup", "<i4"), ("pad", "<i4")])
SPEC_THREADS = 256  # the block size speculative.cu's one-block kernels are written for


def spec_entries(seqs: Sequence[SpecSeq], rows: int = 0) -> np.ndarray:
    """The entries' table (SPEC_ENTRY rows), padded to `rows` with entries every kernel
    skips (slot -1)."""
    table = np.zeros(max(1, len(seqs), rows), SPEC_ENTRY)
    table["slot"] = -1
    for i, e in enumerate(seqs):
        table[i] = (e.slot, e.start, e.k, e.propose, e.past, e.out, int(e.lookup), 0)
    return table


class CudaSpeculation(OpsMixin):
    """The speculation methods of CudaOps (a mixin: they enqueue on the ops' stream)."""

    def round_cost(self, rows: int) -> float:
        """A round of `rows` rows relative to one of one row (dispatch/speculation.py). Not
        measured on a GPU yet: a memory-bound decode reads the weights once for all its
        rows, so each row is taken to add 5% (the cpu backend's is measured)."""
        return 1.0 + 0.05 * max(0, rows - 1)

    def _entries(self, seqs: Sequence[SpecSeq]) -> DeviceTensor:
        """The entries' table on the device. (Hold it in a variable until the launch that
        reads it is enqueued: a tensor's last reference enqueues its free.)"""
        return self.upload(spec_entries(seqs).view(np.uint8), "u8")

    def spec_prepare(self, meta: Any, buffers: SpecBuffers,
                     seqs: Sequence[SpecSeq]) -> list[int] | None:
        """Each entry's first position into `buffers.firsts[slot]` and its prompt-lookup
        proposal into its draft rows of `meta` (spec_prepare); None: the positions stay on
        the device (`spec_positions` uses them)."""
        if seqs:
            entries = self._entries(seqs)  # held until the launch is enqueued
            self.spec_prepare_device(entries, len(seqs), meta.ptr, buffers)
        return None

    def spec_prepare_device(self, entries: DeviceTensor, n: int, rows_ptr: int,
                            buffers: SpecBuffers) -> None:
        """`spec_prepare` with its table (SPEC_ENTRY rows, padding ones skipped) already on
        the device: the form a decode graph captures."""
        b = buffers
        self.kernels["spec_prepare"].launch(
            self._s, n, SPEC_THREADS, entries.ptr, rows_ptr, b.lengths.ptr, b.history.ptr,
            b.context + 1, b.proposals.ptr, b.k_max + 1, b.firsts.ptr, b.ngram_min,
            b.ngram_max)

    def spec_positions(self, batch: ForwardBatch, buffers: SpecBuffers,
                       past_of: Sequence[tuple[int, int] | None]) -> None:
        """`batch`'s descriptors uploaded, then fixed on the device for the sessions with
        `past_of[i]` = (slot, delta) (n_past = firsts[slot] + delta), and its row positions
        made from them (spec_positions): `batch.device_meta` and `batch.positions`."""
        meta = BatchMeta.of(batch, self.upload)
        table = self.upload(np.array([(-1, 0) if p is None else p for p in past_of],
                                     np.int32), "i32")
        positions = self.empty((len(batch.tokens),), "i32")
        self.spec_positions_device(meta, table, buffers, positions)
        batch.device_meta = meta
        batch.positions = positions  # type: ignore[assignment]  # on the device

    def spec_positions_device(self, meta: BatchMeta, past_of: DeviceTensor,
                              buffers: SpecBuffers, positions: DeviceTensor) -> None:
        """`spec_positions` on descriptors and a (slot, delta) table already on the
        device, into `positions` (int32 per row)."""
        self.kernels["spec_positions"].launch(
            self._s, 1, SPEC_THREADS, meta.seqs.ptr, past_of.ptr, buffers.firsts.ptr,
            meta.n_seqs, meta.row_seq.ptr, positions.shape[0], positions.ptr)

    def spec_accept(self, out: Any, token_buf: Any, buffers: SpecBuffers,
                    seqs: Sequence[SpecSeq], counts_at: int, stats_at: int) -> None:
        """The entries' accepted runs: counts and statistics into `out`, new lengths,
        histories and next inputs (spec_accept)."""
        if not seqs:
            return
        entries = self._entries(seqs)
        self.spec_accept_device(entries, len(seqs), out.ptr, counts_at, stats_at,
                                token_buf.ptr, buffers)

    def spec_accept_device(self, entries: DeviceTensor, n: int, out_ptr: int,
                           counts_at: int, stats_at: int, token_buf_ptr: int,
                           buffers: SpecBuffers) -> None:
        """`spec_accept` with its table already on the device (padding entries skipped)."""
        b = buffers
        self.kernels["spec_accept"].launch(
            self._s, -(-n // 64), 64, entries.ptr, n, out_ptr, counts_at, stats_at,
            token_buf_ptr, b.lengths.ptr, b.history.ptr, b.context + 1, b.proposals.ptr,
            b.k_max + 1, b.firsts.ptr)

    def draft_inputs(self, meta: Any, buffers: SpecBuffers, seqs: Sequence[SpecSeq],
                     step: int, prefill: Sequence[tuple[int, int]] = ()) -> DeviceIds:
        """The draft model's input rows at `step` in `buffers.draft_rows`: the `prefill`
        spans of `meta` copied, then the entries' rows (draft_rows)."""
        rows, at = buffers.draft_rows, 0
        d = driver()
        for start, n in prefill if step == 0 else ():
            cu("cuMemcpyDtoDAsync", d.CUdeviceptr(rows.ptr + at * 8),
               d.CUdeviceptr(meta.ptr + start * 8), n * 8, self._s)
            at += n
        if seqs:
            b, entries = buffers, self._entries(seqs)
            self.kernels["draft_rows"].launch(
                self._s, -(-len(seqs) // 64), 64, entries.ptr, len(seqs),
                b.firsts.ptr, b.history.ptr, b.context + 1, meta.ptr, step,
                rows.ptr + at * 8)
        n_rows = at + (2 if step == 0 else 1) * len(seqs)
        return DeviceIds(rows.ptr, n_rows, 0)

    def draft_propose(self, logits: DeviceTensor, meta: Any, buffers: SpecBuffers,
                      seqs: Sequence[SpecSeq], step: int) -> None:
        """The draft model's greedy proposals at `step` (draft_argmax), one logits row per
        entry."""
        if seqs:
            b, entries = buffers, self._entries(seqs)
            self.kernels["draft_argmax"].launch(
                self._s, len(seqs), SPEC_THREADS, logits.ptr, logits.shape[1],
                entries.ptr, step, b.proposals.ptr, b.k_max + 1, meta.ptr)

    def draw_positions(self, table: DeviceTensor, positions_at: tuple[DeviceTensor, Any],
                       n: int) -> None:
        """The sampler table's draw positions from the device's row positions: row i of
        `table` draws at positions[logit_rows[i]] + 1 (spec_draw_positions)."""
        positions, logit_rows = positions_at
        rows = self.upload(np.asarray(logit_rows, np.int64), "i64")
        self.draw_positions_device(table, positions, rows, n)

    def draw_positions_device(self, table: DeviceTensor, positions: DeviceTensor,
                              logit_rows: DeviceTensor, n: int) -> None:
        """`draw_positions` with the logit rows (int64) already on the device."""
        self.kernels["spec_draw_positions"].launch(self._s, -(-n // 64), 64, table.ptr,
                                                   positions.ptr, logit_rows.ptr, n)
