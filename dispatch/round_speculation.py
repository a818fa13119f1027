"""The control thread's side of speculative decoding (dispatch/speculation.py says what it
is; kernels/speculative.py what the device does): `RoundSpeculation` owns the device state
of speculating sessions (`SpecBuffers`, made at the first one) and the host staging of
their histories, and turns a planned round into the device steps' records: `SpecRound`
(the speculating sessions' entries and where each sampled session's tokens land) and
`DraftRound` (the draft model's part). It also applies what a harvested round says about
a speculating session: its bounds corrected, its acceptance recorded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eagerlm.dispatch.round_work import DraftRound, SpecRound
from eagerlm.dispatch.scheduler import RoundPlan, Session
from eagerlm.dispatch.speculation import SpecSession, SpeculationConfig, kv_layouts
from eagerlm.kernels.backend import RoundBackend
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import MAX_SPECULATIVE_TOKENS, SamplingParams
from eagerlm.kernels.speculative import SpecBuffers, SpecSeq
from eagerlm.vmm.device import Device, HostBuffer, Stream


def drafts(s: Session) -> bool:
    """Whether the session speculates with the draft model."""
    return s.spec is not None and s.spec.method == "draft"


class RoundSpeculation:
    """Speculating sessions' state and rounds, for one control thread (its device, its
    sessions' KV layout shared with the draft model's, its ring of `n_slots` rounds)."""

    def __init__(self, config: SpeculationConfig, device: Device, backend: RoundBackend,
                 transformer: Transformer, draft: Transformer | None, *, slots: int,
                 context: int, round_rows: int, n_slots: int) -> None:
        self.config = config
        self.device = device
        self.backend = backend
        self.draft = draft  # the draft model, sharing each session's KV region
        self.layout, self.draft_layout = kv_layouts(transformer, draft)
        self.slots, self.context, self.round_rows = slots, context, round_rows
        self.buffers: SpecBuffers | None = None  # made at the first speculating session
        # per ring slot, the host staging of the histories a round sends
        self._staging: list[HostBuffer | None] = [None] * n_slots

    def session(self, params: SamplingParams) -> SpecSession | None:
        """A new session's speculation record (None: it does not speculate). A request
        for the draft model without one is refused at submission (Dispatcher.submit)."""
        method = self.config.method_for(params)
        if method == "off" or (method == "draft" and self.draft is None):
            return None
        if self.buffers is None:
            cfg = self.config
            self.buffers = SpecBuffers.alloc(self.device, self.slots, self.context,
                                             MAX_SPECULATIVE_TOKENS, cfg.ngram_min,
                                             cfg.ngram_max, self.round_rows)
        return SpecSession(method, self.config.tokens_for(params))

    def round(self, plan: RoundPlan, sampled: list[tuple[Session, int, int]],
              seq_rows: list[tuple[int, int, int]]) -> SpecRound | None:
        """The round's speculating sessions as the device steps take them (SpecSeq), and
        where each sampled session's tokens land in the round's output (`sampled`: each
        sampled session, its generation, its index in the plan, in output order): a
        speculating session's every row is sampled, in order."""
        if self.buffers is None or not any(s.spec is not None for s, _, _ in sampled):
            return None
        entries, offsets, entry_of, out = [], [], [], 0
        for s, _, i in sampled:
            r = plan.rows[i]
            offsets.append(out)
            if s.spec is None:
                entry_of.append(-1)
                out += 1
                continue
            start = seq_rows[i][0]
            lookup = s.spec.method == "ngram"
            if r.from_slot:  # a decode row: its position is on the device; with no draft
                # rows, one token is still proposed, to measure (dispatch/speculation.py)
                e = SpecSeq(s.slot, start, r.n_draft, r.n_draft or 1, -1, out, lookup)
            else:  # a prompt's last chunk: its last row samples the first token
                e = SpecSeq(s.slot, start + r.n_new - 1, 0, 0, r.n_past + r.n_new - 1, out,
                            lookup)
            entry_of.append(len(entries))
            entries.append(e)
            out += 1 + e.k
        return SpecRound(self.buffers, entries, offsets, entry_of, counts_at=out,
                         stats_at=out + len(entries))

    def draft_round(self, plan: RoundPlan, spec: SpecRound | None,
                    seq_rows: list[tuple[int, int, int]]) -> DraftRound | None:
        """The draft model's part of the round: its sessions' prompt rows, and the decode
        entries it proposes for, each through its part of the session's region."""
        if self.draft is None or not any(drafts(r.session) for r in plan.rows):
            return None
        assert self.buffers is not None and self.draft_layout is not None
        entry_at = {} if spec is None else {e.start: j for j, e in enumerate(spec.seqs)
                                            if e.past < 0}
        kvs: list[Any | None] = []
        prefill, entries = [], []
        for i, r in enumerate(plan.rows):
            s = r.session
            if not drafts(s):
                kvs.append(None)
                continue
            assert s.region is not None
            kvs.append(self.backend.session_kv(s.region.part(self.draft_layout)))
            if r.from_slot:
                entries.append(entry_at[seq_rows[i][0]])
            else:
                prefill.append(i)
        return DraftRound(self.draft, self.buffers, kvs, prefill, entries)

    def send_histories(self, slot: int, plan: RoundPlan, stream: Stream) -> None:
        """Copy the tokens of speculating sessions new to their slot (admitted, or resumed
        after a preemption) into their device history, on `stream` (the compute stream)
        before the round: the prompt lookup searches them, the acceptance appends to them.
        The ring slot's staging is reused once its round was harvested (its copies ran)."""
        fresh = [r.session for r in plan.rows
                 if r.session.spec is not None and not r.session.spec.history_sent]
        if not fresh:
            return
        assert self.buffers is not None
        n = sum(len(s.tokens) for s in fresh)
        host = self._staging[slot]
        if host is None or host.nbytes < n * 4:
            if host is not None:  # its last copy ran before this slot's round was harvested
                host.free()
            host = self._staging[slot] = self.device.alloc_host(max(n, 1024) * 4)
        staged = host.array.view(np.int32)
        row_bytes = (self.context + 1) * 4
        at = 0
        for s in fresh:
            assert s.spec is not None and s.slot is not None
            staged[at:at + len(s.tokens)] = s.tokens
            stream.copy_h2d(self.buffers.history, host, len(s.tokens) * 4,
                            dst_offset=s.slot * row_bytes, src_offset=at * 4)
            at += len(s.tokens)
            s.spec.history_sent = True

    @staticmethod
    def harvested(s: Session, e: SpecSeq, stats: np.ndarray) -> None:
        """A speculating session's part of a harvested round (`stats`: proposals checked,
        accepted, shadow): its bounds corrected (dispatch/scheduler.py's Session), its
        acceptance recorded."""
        assert s.spec is not None
        proposed, accepted, shadow = (int(x) for x in stats)
        s.n_cached -= e.k - accepted  # rows launched but not accepted
        s.n_sampled += accepted  # tokens beyond the one counted at launch
        if e.past < 0:  # a decode row: its acceptance measures the proposer
            s.spec.observe(e.k, proposed, accepted, shadow)

    def free(self) -> None:
        """Give the device state and staging back (after the streams are drained)."""
        for host in self._staging:
            if host is not None:
                host.free()
        self._staging = [None] * len(self._staging)
        if self.buffers is not None:
            self.buffers.free()
            self.buffers = None

