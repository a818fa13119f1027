"""The device side of a round: what the control thread launches on the compute stream once
it has planned a round and copied its metadata up (dispatch/control_thread.py).

`RoundWork` gathers the round's inputs (host ids for prefill rows, the token buffer for
decode rows), runs the forward and samples, writing the samples to the token buffer and the
round's output buffer (and logprobs, if asked); a pure-decode round goes through the decode
graphs' fixed buffers where the backend has them. `SeqWork` is what it needs of each
session beyond the metadata rows; `SamplerState` holds the sessions' penalty token counts
and logit biases in the backend's form, touched only by work on the compute stream.

Constrained rows (a JSON schema, a grammar) need a mask that depends on the token their
session sampled in the previous round, which the host may not have yet: the round samples
its other rows first, then takes the constrained rows' masks from the `MaskBoard` (waiting
only if the host is late; dispatch/mask_board.py) and samples those.

Speculating sessions (`SpecRound`; kernels/speculative.py) add two device steps: before the
forward, their positions are read from the device and their proposals written into their
draft rows (`spec_prepare`); after the sampling, which samples each of their rows, the
accepted runs update their lengths, histories and next inputs (`spec_accept`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagerlm.dispatch.mask_board import MaskBoard
from eagerlm.dispatch.messages import RoundTrace, SpecOutput
from eagerlm.kernels.backend import DecodeKind, DecodeRounds, RoundBackend
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.kernels.speculative import SPEC_STATS, SpecBuffers, SpecSeq
from eagerlm.vmm.device import Event


@dataclass
class SeqWork:
    """What the device side needs to know of one session in a round, beyond the metadata
    rows: its sampling parameters, and for penalties where its prompt ends and, when its
    token counts must be (re)built, the tokens before this round's rows."""

    session_id: int
    prompt_len: int
    params: SamplingParams
    samples: bool
    slot: int  # the token-buffer row its sample goes to
    rebuild: list[int] | None
    generation: int = 0  # which of its tokens it samples (0: the first): its mask's key
    n_draft: int = 0  # rows after its first that verify proposals (each one sampled)


@dataclass
class SpecRound:
    """A round's speculating sessions: their device steps' entries (`seqs`, in output
    order), and where each sampled session's tokens land in the round's output (int32):
    session j's at `offsets[j]`, one token unless it is speculation entry `entry_of[j]`,
    whose accepted count is at `counts_at + entry` and statistics at `stats_at`."""

    buffers: SpecBuffers
    seqs: list[SpecSeq]
    offsets: list[int]
    entry_of: list[int]
    counts_at: int
    stats_at: int

    def output(self, host_out: np.ndarray) -> SpecOutput:
        """The round's output buffer (on the host) read as each session's tokens."""
        n = len(self.seqs)
        return SpecOutput(self.offsets, self.entry_of,
                          host_out[self.counts_at:self.counts_at + n],
                          host_out[self.stats_at:self.stats_at + n * SPEC_STATS].reshape(
                              n, SPEC_STATS))


class SamplerState:
    """Per-session token counts for the penalties and logit biases, in the backend's form
    (`token_counts`: TokenCounts on cpu, a device tensor on cuda; `logit_bias`: a dense
    array or tensor). Owned by the compute stream: only `RoundWork` (which runs there, in
    order) reads or changes it."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.counts: dict[int, Any] = {}
        self.biases: dict[int, Any] = {}


class RoundWork:
    """The device side of one round, launched on the compute stream: the inputs (host ids
    for prefill rows, the token buffer for decode rows), the forward, the sampler writing
    this round's samples to the token buffer and to the round's output buffer (and
    logprobs, if asked). Backend-specific steps are the backend's (`RoundBackend`,
    kernels/backend.py: `round_inputs`, `count_inputs`, `sample_round`...); on cuda this
    runs at launch and enqueues kernels, on cpu it runs on the stream."""

    def __init__(self, transformer: Transformer, meta: Any, token_buf: Any, sampled: Any,
                 n_rows: int, seq_rows: list[tuple[int, int, int]], kvs: list[Any],
                 seq_work: list[SeqWork], state: SamplerState, forget: list[int],
                 logprob_out: tuple[Any, Any] | None, masks: MaskBoard | None = None,
                 trace: RoundTrace | None = None, spec: SpecRound | None = None,
                 draft: DraftRound | None = None, broadcast: bool = False) -> None:
        """`broadcast`: the model is split over several devices; after sampling, the token
        buffer goes to every device's (`RoundBackend.broadcast_tokens`)."""
        self.transformer = transformer
        self.broadcast = broadcast
        self.backend: RoundBackend = transformer.ops
        self.meta, self.token_buf, self.sampled = meta, token_buf, sampled
        self.n_rows, self.seq_rows = n_rows, seq_rows
        self.kvs, self.seq_work = kvs, seq_work
        self.state, self.forget = state, forget
        self.logprob_out = logprob_out
        self.masks, self.trace = masks, trace
        self.spec, self.draft = spec, draft
        self.graph: tuple[DecodeRounds, np.ndarray] | None = None  # (graphs, host rows)

    def __call__(self) -> None:
        self._run()
        if self.broadcast:  # device 0's samples into every device's token buffer
            self.backend.broadcast_tokens(self.token_buf)

    def _run(self) -> None:
        backend = self.backend
        if self.graph is not None and self._replay(*self.graph):
            self.kvs = []
            return
        seq_rows, past_of = self.seq_rows, None
        if self.spec is not None:  # positions from the device, proposals into draft rows
            seq_rows, past_of = self._spec_prepare()
            if self.broadcast:  # the other devices' forwards need both (cpu: known here)
                backend.broadcast_round(self.meta, self.n_rows,
                                        [past for _, _, past in seq_rows])
        if self.draft is not None:
            stream = self.backend.stream
            start, t = stream.record() if stream is not None else None, time.perf_counter()
            self._draft_steps(seq_rows, past_of is not None)
            if start is not None and stream is not None:
                self.draft.events = (start, stream.record())
            else:
                self.draft.seconds = time.perf_counter() - t
        tokens = backend.round_inputs(self.meta, self.n_rows, self.token_buf)
        slices = [SeqSlice(st, n, past, kv)
                  for (st, n, past), kv in zip(seq_rows, self.kvs, strict=True)]
        counts = self._count_inputs(tokens)
        # sampled rows, unconstrained first: they never wait for the host
        work = sampled_order([(w, (st, n, past)) for w, (st, n, past)
                              in zip(self.seq_work, seq_rows, strict=True) if w.samples])
        # a speculating session's every row is sampled: the first, then its drafts'
        logit_rows = np.array([st + n - 1 - w.n_draft + j for w, (st, n, _) in work
                               for j in range(1 + w.n_draft)], dtype=np.int64)
        batch = ForwardBatch(tokens, slices, logit_rows)
        if past_of is not None:  # positions only the device knows (cuda)
            assert self.spec is not None
            self.backend.spec_positions(batch, self.spec.buffers, past_of)
        self._sample(self.transformer.forward(batch), work, counts,
                     None if past_of is None else batch.positions)
        if self.spec is not None:
            s = self.spec
            backend.spec_accept(self.sampled, self.token_buf, s.buffers, s.seqs, s.counts_at,
                                s.stats_at)
        self.kvs = []  # drop the views of the KV pages as soon as the work is done
        if self.draft is not None:
            self.draft.kvs = []

    def _spec_prepare(self) -> tuple[list[tuple[int, int, int]],
                                     list[tuple[int, int] | None] | None]:
        """The round's rows with speculating sessions' decode positions where the host
        learns them (cpu); else (cuda) the rows as planned (bounds) and, per session, the
        slot whose device position it takes (`spec_positions`' `past_of`). Their proposals
        are written into their draft rows meanwhile."""
        assert self.spec is not None
        s = self.spec
        firsts = self.backend.spec_prepare(self.meta, s.buffers, s.seqs)
        decode = {e.start: (j, e) for j, e in enumerate(s.seqs) if e.past < 0}
        if firsts is not None:
            return [(st, n, firsts[decode[st][0]] if st in decode else past)
                    for st, n, past in self.seq_rows], None
        return self.seq_rows, [(decode[st][1].slot, 0) if st in decode else None
                               for st, _, _ in self.seq_rows]

    def _draft_steps(self, seq_rows: list[tuple[int, int, int]], on_device: bool) -> None:
        """The draft model's forwards: step 0 takes its sessions' prompt rows and, per
        decode entry, the tokens at its first position and the one before; each step
        proposes one more token per entry still drafting (kernels/speculative.py). With
        `on_device`, the entries' positions are the device's (`spec_positions`)."""
        assert self.draft is not None
        d, backend = self.draft, self.backend
        seq_of = {st: i for i, (st, _, _) in enumerate(seq_rows)}
        entries = [self.spec.seqs[j] for j in d.entries] if self.spec is not None else []
        prefill = [seq_rows[i][:2] for i in d.prefill]
        slices, at = [], 0
        for i in d.prefill:
            _, n, past = seq_rows[i]
            slices.append(SeqSlice(at, n, past, d.kvs[i]))
            at += n
        firsts = [seq_rows[seq_of[e.start]][2] for e in entries]
        kvs = [d.kvs[seq_of[e.start]] for e in entries]
        for first, kv in zip(firsts, kvs, strict=True):
            slices.append(SeqSlice(at, 2, first - 1, kv))
            at += 2

        def place(batch: ForwardBatch, live: list[SpecSeq], delta: int) -> ForwardBatch:
            if on_device:
                past_of: list[tuple[int, int] | None] = [None] * (len(batch.seqs) - len(live))
                backend.spec_positions(batch, d.buffers,
                                       past_of + [(e.slot, delta) for e in live])
            return batch

        tokens = backend.draft_inputs(self.meta, d.buffers, entries, 0, prefill)
        rows = np.array([s.end - 1 for s in slices[len(prefill):]], np.int64)
        batch = place(ForwardBatch(tokens, slices, rows), entries, -1)
        if not entries:  # prompt rows only: the draft's KV, no proposal
            d.transformer.hidden_states(batch)
            return
        backend.draft_propose(d.transformer.forward(batch), self.meta, d.buffers, entries, 0)
        for step in range(1, max(e.k for e in entries)):
            live = [(e, first, kv) for e, first, kv in zip(entries, firsts, kvs, strict=True)
                    if e.k > step]
            tokens = backend.draft_inputs(self.meta, d.buffers, [e for e, _, _ in live], step)
            batch = ForwardBatch(tokens, [SeqSlice(i, 1, first + step, kv)
                                          for i, (_, first, kv) in enumerate(live)],
                                 np.arange(len(live), dtype=np.int64))
            batch = place(batch, [e for e, _, _ in live], step)
            backend.draft_propose(d.transformer.forward(batch), self.meta, d.buffers,
                                  [e for e, _, _ in live], step)

    def _sample(self, logits: Any, work: list[tuple[SeqWork, tuple[int, int, int]]],
                counts: dict[int, Any], device_positions: Any = None) -> None:
        """Sample the round's rows from their logits (in `sampled_order`, a speculating
        session's 1 + n_draft rows together): the unconstrained rows, then the constrained
        ones once their masks have come. A speculating session's rows write no token-buffer
        slot: its acceptance writes its next input. `device_positions`: the batch's row
        positions where only the device knows them (the draws' positions follow)."""
        backend = self.backend
        biases = dict(zip([w.session_id for w in self.seq_work], self._session_biases(),
                          strict=True))
        n_free = sum(not w.params.constrained for w, _ in work)
        speculating = set() if self.spec is None else {e.slot for e in self.spec.seqs}
        row = 0
        for part, constrained in ((work[:n_free], False), (work[n_free:], True)):
            if not part:
                continue
            masks = self._take_masks([w for w, _ in part]) if constrained else None
            rows = [(w, past + n - w.n_draft + j) for w, (_, n, past) in part
                    for j in range(1 + w.n_draft)]
            at = None if device_positions is None else (
                device_positions, np.array([st + n - 1 - w.n_draft + j
                                            for w, (st, n, _) in part
                                            for j in range(1 + w.n_draft)], np.int64))
            backend.sample_round(
                logits, [w.params for w, _ in rows], [pos for _, pos in rows],
                [counts.get(w.session_id) for w, _ in rows],
                [biases[w.session_id] for w, _ in rows], out=self.sampled,
                token_buf=self.token_buf,
                out_slots=[-1 if w.slot in speculating else w.slot for w, _ in rows],
                logprobs_out=self.logprob_out, masks=masks, first_row=row,
                positions_at=at)
            row += len(rows)

    def _take_masks(self, work: list[SeqWork]) -> list[np.ndarray | None]:
        """The constrained rows' masks, waiting for the host where it has not posted them
        yet; the time waited goes to the round's trace."""
        assert self.masks is not None, "a constrained row needs the dispatcher's MaskBoard"
        out, waited = [], 0.0
        for w in work:
            mask, wait = self.masks.take(w.session_id, w.generation)
            out.append(mask)
            waited += wait
        if self.trace is not None:
            self.trace.mask_wait += waited
            self.trace.n_constrained = len(work)
        return out

    def _replay(self, graphs: DecodeRounds, rows: np.ndarray) -> bool:
        """A decode round in which every session samples, through the decode graphs' fixed
        buffers (a replay, or their launches one by one), which also count penalized
        sessions' inputs and write logprobs where asked; False when it must take the
        general path."""
        if self.spec is not None:
            return all(w.samples for w in self.seq_work) and self._replay_spec(graphs, rows)
        kind = self.fixed_kind()
        if kind is None:
            return False
        counts = [None if c is None else (c, split)
                  for c, split in zip(self._session_counts(), self._prompt_rows(),
                                      strict=True)]
        if kind.forward_only:
            return self._replay_forward(graphs, rows, counts)
        return graphs.run(rows, [past for _, _, past in self.seq_rows], self.kvs,
                          [w.params for w in self.seq_work], self.sampled,
                          [w.slot for w in self.seq_work], counts, self.logprob_out,
                          self._session_biases())

    def fixed_kind(self) -> DecodeKind | None:
        """The fixed-buffer variant this round takes (not speculating: every session
        sampling its one row), None for the general path. Known before the round runs:
        over several devices the leader sends it with the round's order, and each
        follower runs its share padded to the same bucket (`DecodeRounds.forward_shard`)."""
        if self.graph is None or self.spec is not None or not all(
                w.samples for w in self.seq_work):
            return None
        return self.graph[0].kind([w.params for w in self.seq_work],
                                  constrained=any(w.params.constrained for w in self.seq_work))

    def _replay_spec(self, graphs: DecodeRounds, rows: np.ndarray) -> bool:
        """A decode round with speculating sessions through the graphs' speculative rounds
        (kernels/cuda_spec_graphs.py): the proposal, positions, forward, sampling and
        acceptance in fixed buffers. Rounds with constraints, penalties or a logit bias,
        or the draft model, take the general path."""
        assert self.spec is not None
        if self.draft is not None or any(w.params.constrained or w.params.adjusts_logits
                                         for w in self.seq_work):
            return False
        s = self.spec
        speculating = {e.slot for e in s.seqs}
        return graphs.run_spec(rows, self.seq_rows, self.kvs,
                               [w.params for w in self.seq_work],
                               [-1 if w.slot in speculating else w.slot
                                for w in self.seq_work], s.seqs, s.buffers, s.counts_at,
                               s.stats_at, self.sampled, self.logprob_out)

    def _replay_forward(self, graphs: DecodeRounds, rows: np.ndarray,
                        counts: list[Any]) -> bool:
        """A decode round with constrained rows: the forward-only graph (which also counts
        penalized sessions' inputs), then the general path's sampling from its logits. The
        graph's rows are in plan order, the sampling's in `sampled_order`: the logits are
        produced in that order (the graph's logit rows are a blob field)."""
        order = sampled_order([(w, i) for i, w in enumerate(self.seq_work)])
        logits = graphs.forward(rows, [past for _, _, past in self.seq_rows], self.kvs,
                                [w.params for w in self.seq_work], counts,
                                order=[i for _, i in order])
        if logits is None:
            return False
        work = [(w, self.seq_rows[i]) for w, i in order]
        self._sample(logits, work, self.state.counts)
        return True

    def _count_inputs(self, tokens: Any) -> dict[int, Any]:
        """Bring penalized sessions' token counts up to date with this round's inputs
        (`tokens`: what `round_inputs` returned), on the backend's side: on cuda the
        decode inputs are only on the device."""
        spans = [(c, start, n, split) for c, (start, n, _), split
                 in zip(self._session_counts(), self.seq_rows, self._prompt_rows(), strict=True)
                 if c is not None]
        if spans:
            self.backend.count_inputs(tokens, spans)
        return self.state.counts

    def _forget_ended(self) -> None:
        """Drop the sampler state of the sessions that ended since the last round."""
        for sid in self.forget:
            self.state.counts.pop(sid, None)
            self.state.biases.pop(sid, None)
        self.forget = []

    def _session_biases(self) -> list[Any]:
        """Per session of the round, its logit bias (None: it has none), made the first
        time the session is in a round and kept until it ends."""
        self._forget_ended()
        st, out = self.state, []
        for w in self.seq_work:
            bias = None
            if w.params.logit_bias:
                bias = st.biases.get(w.session_id)
                if bias is None:
                    bias = st.biases[w.session_id] = self.backend.logit_bias(w.params,
                                                                             st.vocab)
            out.append(bias)
        return out

    def _session_counts(self) -> list[Any]:
        """Per session of the round, its token counts (None: not penalized), after ended
        sessions' counts are dropped and those that must be are (re)built from tokens."""
        self._forget_ended()
        st = self.state
        out = []
        for w in self.seq_work:
            if not w.params.penalized:
                out.append(None)
                continue
            if w.rebuild is not None:  # once: a graph that cannot replay falls back here
                st.counts[w.session_id] = self.backend.token_counts(
                    st.vocab, w.rebuild[:w.prompt_len], w.rebuild[w.prompt_len:])
                w.rebuild = None
            out.append(st.counts[w.session_id])
        return out

    def _prompt_rows(self) -> list[int]:
        """Per session, how many of its rows in this round are still prompt tokens."""
        return [max(0, min(n, w.prompt_len - past))
                for w, (_, n, past) in zip(self.seq_work, self.seq_rows, strict=True)]


@dataclass
class DraftRound:
    """The draft model's part of a round (dispatch/speculation.py): its forward over its
    sessions' prompt rows (`prefill`: seq indices), and its proposals for their decode
    rows (`entries`: indices into the SpecRound's seqs), one draft step per proposed
    token, each session reading and writing its KV through `kvs[seq]` (its part of the
    session's region)."""

    transformer: Transformer
    buffers: SpecBuffers
    kvs: list[Any | None]
    prefill: list[int]
    entries: list[int]
    # the draft's forwards' time, as `RoundWork` measures it for the learned prices
    # (dispatch/round_costs.py): device events around them on a backend's own stream
    # (cuda), else the host's seconds (cpu: the round's work runs as it is called)
    events: tuple[Event, Event] | None = None
    seconds: float | None = None

    def elapsed(self) -> float | None:
        """Seconds the draft's forwards took on the device (once the round is done)."""
        if self.events is not None:
            return self.events[0].elapsed_ms(self.events[1]) / 1e3
        return self.seconds

    def forwards(self, seqs: list[SpecSeq]) -> int:
        """How many forwards of the draft model the round runs (`RoundWork._draft_steps`):
        one, then one per draft token past the first of its longest run of them."""
        if not self.entries:
            return 1 if self.prefill else 0
        return max(1, max(seqs[j].k for j in self.entries))


def sampled_order(rows: list[Any]) -> list[Any]:
    """A round's sampled rows in the order their samples are written: unconstrained
    first, then constrained, each in plan order. Items are (SeqWork, ...) or (Session, ...)
    pairs (the control thread lays out the round's output the same way)."""
    return sorted(rows, key=lambda r: r[0].params.constrained)
