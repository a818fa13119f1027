"""The control layer: one thread per device that plans rounds and launches them eagerly.

Per round (shared/DESIGN.md, "One round, eagerly"):
1. drain commands (new sessions, stops), reclaim pages whose last event completed, plan;
2. map pages for the positions the round writes (the scheduler, with map-ahead);
3. write the round's metadata into a pinned ring slot and copy it to the device on the
   compute stream;
4. decode inputs are not known here: the round reads them on the device from the token
   buffer where the previous round's sampler wrote them;
5. launch forward + sampler (`RoundWork`, dispatch/round_work.py), record an event,
   enqueue the device-to-host copy of the sampled tokens on the copy stream after that
   event, hand the round to the service thread and go straight on;
6. the only wait is the bounded lookahead: at most `k` rounds not yet consumed by the
   service thread. In `sync` mode the thread instead waits for each round to be consumed
   (tokens seen, stop decisions made) before planning the next.

Speculating sessions (dispatch/speculation.py) keep their length and tokens on the device
(kernels/speculative.py): their decode rows read both there, and the round writes back how
many tokens it accepted. The thread learns those counts when it harvests a round's output
(at the latest when its ring slot is reused; rounds whose copy has completed are harvested
before each plan, without waiting), and uses them only to bound later rounds.

A model split over several devices (tensor parallelism) has one control thread per
device: this one, device 0's, is the leader, which plans each round once and sends the
others their orders before launching its own part (dispatch/follower_thread.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from eagerlm.dispatch.follower_thread import Followers
from eagerlm.dispatch.mask_board import MaskBoard
from eagerlm.dispatch.messages import (
    AddSession,
    ControlStopped,
    DeviceCall,
    Flush,
    RoundDone,
    RoundTrace,
    SessionFailed,
    Shutdown,
    StopSession,
)
from eagerlm.dispatch.owned_thread import OwnedThread
from eagerlm.dispatch.prefix_cache import PrefixCache
from eagerlm.dispatch.round_costs import RoundCosts
from eagerlm.dispatch.round_speculation import RoundSpeculation, drafts
from eagerlm.dispatch.round_work import (
    DraftRound,
    RoundWork,
    SamplerState,
    SeqWork,
    SpecRound,
    sampled_order,
)
from eagerlm.dispatch.scheduler import RoundPlan, Scheduler, SchedulerConfig, Session
from eagerlm.dispatch.speculation import (
    SpeculationConfig,
    kv_layouts,
    linear_cost,
)
from eagerlm.kernels.backend import DecodeRounds, RoundBackend
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import MAX_LOGPROBS
from eagerlm.kernels.speculative import SPEC_STATS
from eagerlm.vmm.device import Device, Event, HostBuffer, StreamError
from eagerlm.vmm.page_pool import OutOfPages, PagePool

# ring slot metadata: per row [host token id, source slot or -1]; per session
# [start, n_new, n_past, output slot or -1]
_ROW_FIELDS = 2
_SEQ_FIELDS = 4


@dataclass(frozen=True)
class ControlConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lookahead: int = 2  # rounds launched but not yet consumed by the service thread
    sync: bool = False  # wait for each round's stop decisions before planning the next
    prefix_cache: bool = True
    prefix_cache_entries: int = 64
    # replay decode rounds as CUDA graphs (on backends that can); off, the same padded
    # launches are made one by one, so the tokens are the same
    cuda_graphs: bool = True
    # speculative decoding, the engine's default for requests (dispatch/speculation.py)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)


@dataclass
class _RoundRecord:
    """What the control thread remembers of a launched round until its ring slot is
    reused: which sessions it sampled for, where their tokens land on the host."""

    rows: list[tuple[Session, int]]  # (session, generation index)
    host_tokens: np.ndarray  # the round's output (tokens, then speculation's counts, stats)
    copied: Event
    spec: SpecRound | None = None  # its speculating sessions
    harvested: bool = False
    # what the round costs are learned from: its device events, rows, whether it had
    # draft rows, and the draft model's part (None: it prefilled, a cost of another kind)
    timing: tuple[Event, Event, int, bool, DraftRound | None] | None = None


class ControlThread(OwnedThread):
    def __init__(self, device: Device, transformer: Transformer, pool: PagePool,
                 config: ControlConfig, inbox: queue.Queue, to_service: queue.Queue,
                 lookahead: threading.Semaphore, context_length: int,
                 masks: MaskBoard | None = None, draft: Transformer | None = None,
                 followers: Followers | None = None) -> None:
        """`followers`: with a model split over several devices (dispatch/follower_thread.py),
        this is device 0's thread, the leader: each round's order goes to the others."""
        self.device = device
        self.followers = followers
        self.masks = masks  # constrained sessions' token masks, posted by the service
        self.transformer = transformer
        self.backend: RoundBackend = transformer.ops  # what a round asks of the backend
        self.pool = pool
        self.config = config
        self.inbox = inbox
        self.to_service = to_service
        self.lookahead = lookahead
        self.context_length = context_length
        self.layout, _ = kv_layouts(transformer, draft)
        spec = config.speculation
        self.scheduler = Scheduler(config.scheduler, pool, self.layout, context_length,
                                   sync_event=_sync)
        # the plan's prices of rounds by their rows: learned from the rounds harvested
        # (dispatch/round_costs.py), unless the settings fix them
        self.round_costs = (RoundCosts(self.backend.round_cost) if spec.row_cost is None
                            else None)
        if spec.adaptive:
            self.scheduler.round_cost = (linear_cost(spec.row_cost)
                                         if spec.row_cost is not None else self.round_costs)
            # a draft-model forward, until one is measured: the bytes it reads over ours
            prior = 0.0 if draft is None else (draft.weights.decode_bytes()
                                               / max(1, transformer.weights.decode_bytes()))
            if self.round_costs is not None:
                self.round_costs.draft_prior = prior
                self.scheduler.draft_prices = self.round_costs.draft_prices
            else:
                self.scheduler.draft_prices = lambda: (prior, prior)
        self.scheduler.resolve_tokens = self._generated_tokens
        self.cache = PrefixCache(config.prefix_cache_entries) if config.prefix_cache else None
        self.scheduler.evict_cached = self._evict_cached
        self.sessions: dict[int, Session] = {}
        self.generated: dict[int, list[int]] = {}  # harvested samples, per session id

        sc = config.scheduler
        # a backend that enqueues on its own stream (cuda) makes it the rounds' compute
        # stream, which then outlives this thread; one that computes when called (numpy)
        # runs each round's work on a stream of ours
        backend_stream = self.backend.stream
        self._owns_compute = backend_stream is None
        self.compute = backend_stream if backend_stream is not None else device.stream(
            "compute")
        self.copy = device.stream("copy")
        n_slots = config.lookahead + 2
        meta_ints = sc.max_round_tokens * _ROW_FIELDS + sc.max_batch * _SEQ_FIELDS
        self._meta_host: list[HostBuffer] = [device.alloc_host(meta_ints * 4)
                                             for _ in range(n_slots)]
        # a round's output: a token per sampled row (a speculating session samples each of
        # its rows), then per speculating session its accepted count and statistics
        out_rows = max(sc.max_batch, sc.max_round_tokens)
        out_ints = out_rows + sc.max_batch * (1 + SPEC_STATS)
        self._tokens_host: list[HostBuffer] = [device.alloc_host(out_ints * 4)
                                               for _ in range(n_slots)]
        self._meta_dev = device.alloc(meta_ints * 4)
        self._sampled_dev = [device.alloc(out_ints * 4) for _ in range(n_slots)]
        self._token_buf = device.alloc(sc.max_batch * 4)  # each session's last sample
        lp_cols = 1 + MAX_LOGPROBS
        self._lp_dev = [device.alloc(out_rows * lp_cols * 4) for _ in range(n_slots)]
        self._lp_ids_dev = [device.alloc(out_rows * MAX_LOGPROBS * 4)
                            for _ in range(n_slots)]
        self._lp_host = [device.alloc_host(out_rows * lp_cols * 4) for _ in range(n_slots)]
        self._lp_ids_host = [device.alloc_host(out_rows * MAX_LOGPROBS * 4)
                             for _ in range(n_slots)]
        # speculating sessions' device state and rounds (dispatch/round_speculation.py)
        self.spec = RoundSpeculation(config.speculation, device, self.backend, transformer,
                                     draft, slots=sc.max_batch, context=context_length,
                                     round_rows=sc.max_round_tokens, n_slots=n_slots)
        # penalty token counts live with the sampler, touched only by work on the compute
        # stream; the control thread only says when to rebuild or forget a session's
        self._sampler_state = SamplerState(transformer.config.vocab_size)
        self._forget: list[int] = []
        # over several devices each follower has its own, padded to the buckets this
        # thread's rounds take (`RoundOrder.fixed`)
        self._graphs: DecodeRounds | None = self.backend.decode_graphs(
            transformer, self._token_buf, max_batch=sc.max_batch, max_context=context_length,
            layout=self.layout, enabled=config.cuda_graphs)
        self._records: list[_RoundRecord | None] = [None] * n_slots
        self.round_id = 0
        self.last_event: Event | None = None
        self._stalled = False  # the last plan was empty: wait for a message, briefly
        super().__init__("eagerlm-control")

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        error = None
        try:
            while self._step():
                pass
        except BaseException as exc:  # report, never die silently
            error = f"control thread failed: {exc!r}"
            traceback.print_exc()
            if self.followers is not None:
                self.followers.abort(error)  # no device waits for a round never coming
        finally:
            try:
                with contextlib.suppress(StreamError):  # already reported above
                    self._drain_device()
            finally:
                self.to_service.put(ControlStopped(error))

    def _step(self) -> bool:
        """Plan and launch one round (or wait for work). False once shut down."""
        idle = self.scheduler.idle()
        if (idle or self._stalled) and not self._drain(
                block=True, timeout=None if idle else 0.005):
            return False
        # Take the lookahead permit before planning, so the plan sees every stop the
        # service thread sent while this thread waited: at most k rounds are wasted.
        self.lookahead.acquire()
        t_plan = time.perf_counter()
        if not self._drain(block=False):
            self.lookahead.release()
            return False
        self.pool.reclaim()
        self._harvest_ready()
        plan = self.scheduler.plan()
        self._stalled = not plan.rows
        if not plan.rows:
            self.lookahead.release()
            if self.scheduler.waiting:
                # the head of the queue cannot be admitted yet: let releases in flight
                # complete so their pages come back
                self._drain_device()
            return True
        trace = RoundTrace(self.round_id, plan_start=t_plan, plan_end=time.perf_counter())
        self._launch(plan, trace)
        if self.config.sync:
            self.lookahead.acquire()  # the service has consumed this round...
            self.lookahead.release()  # ...and sent its stops, which the next drain sees
        return True

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Handle every queued command (waiting for the first one if `block`); False once
        a Shutdown arrived."""
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, AddSession):
                self._add(msg)
            elif isinstance(msg, StopSession):
                self._stop(msg)
            elif isinstance(msg, Flush):
                if self.cache is not None:
                    self.cache.clear()
                self._drain_device()
                if self.followers is not None:
                    self.followers.sync()
                msg.done.set()
            elif isinstance(msg, DeviceCall):
                if self.followers is not None:  # every device's part, each guarded
                    self.followers.send_call(msg.others)
                    msg.work = self.followers.guard(msg.work)
                self.compute.launch(msg)  # in order after the rounds launched so far

    def _add(self, msg: AddSession) -> None:
        s = Session(msg.session_id, list(msg.prompt_ids), msg.params, msg.max_new_tokens)
        s.spec = self.spec.session(s.params)
        if not self.scheduler.can_ever_fit(s):  # a guard: the context fits the pool
            self.to_service.put(SessionFailed(s.id, (
                f"the request needs {self.scheduler.pages_for(s.prompt_len + s.max_new)} KV "
                f"pages but the pool has {self.pool.n_pages}")))
            return
        self.sessions[s.id] = s
        self.generated[s.id] = []
        if self.cache is not None:
            self._reuse_prefix(s)
        self.scheduler.add(s)

    def _reuse_prefix(self, s: Session) -> None:
        """Start `s` from the longest cached prefix of its prompt, if any."""
        assert self.cache is not None
        entry, n = self.cache.longest(s.tokens, need_draft=drafts(s))
        n = min(n, len(s.tokens) - 1)  # at least one token is computed, to sample from
        if entry is None or n <= 0:
            return
        region = self.pool.new_region(self.layout, self.context_length)
        while True:
            try:
                region.share_prefix_from(entry.region, n, stream=self.compute)
                break
            except OutOfPages:
                # A pool full of other cached prefixes (an idle replica's usual state) must
                # not cost the hit: evict them, least recently used first (`longest` has
                # just made this entry the most recent), as the scheduler would for pages.
                if len(self.cache) <= 1 or not self._evict_cached():
                    region.release()
                    return
        # the copy of the partial page reads the entry after its last round and writes the
        # new region before any: releasing either (eviction; a cancel or preemption before
        # the first round) must wait for the copy, or a page is unmapped and reused under it
        copied = self.compute.record(self.device.event(timing=False))
        entry.event = copied
        s.region, s.n_cached, s.n_reused, s.last_event = region, n, n, copied
        self.cache.hits += 1
        self.cache.reused_tokens += n

    def _stop(self, msg: StopSession) -> None:
        s = self.sessions.pop(msg.session_id, None)
        self.generated.pop(msg.session_id, None)
        if s is None:
            return
        if s.params.adjusts_logits:
            self._forget.append(s.id)
        self.scheduler.remove(s)
        if s.region is None:
            return
        keep = min(len(msg.tokens), s.n_cached)
        if self.cache is not None and keep > 0 and s.region.n_pages:
            self.cache.add(msg.tokens[:keep], s.region, s.last_event, draft_kv=drafts(s))
        else:
            s.region.release(after=s.last_event)
        s.region = None

    def _evict_cached(self) -> bool:
        entry = self.cache.evict_one() if self.cache is not None else None
        if entry is None:
            return False
        _sync(entry.event)  # so that reclaim gets its pages back now
        self.pool.reclaim()
        return True

    # -- launching ----------------------------------------------------------------------

    def _launch(self, plan: RoundPlan, trace: RoundTrace) -> None:
        slot = self.round_id % len(self._records)
        self._harvest(slot)
        meta_host = self._meta_host[slot].array.view(np.int32)
        n_rows, n_seqs = plan.n_tokens, len(plan.rows)
        rows = meta_host[: n_rows * _ROW_FIELDS].reshape(n_rows, _ROW_FIELDS)
        seqs = meta_host[n_rows * _ROW_FIELDS:
                         n_rows * _ROW_FIELDS + n_seqs * _SEQ_FIELDS].reshape(n_seqs, _SEQ_FIELDS)
        start = 0
        kvs, seq_rows, seq_work, sampled_rows = [], [], [], []
        for i, r in enumerate(plan.rows):
            s = r.session
            if r.from_slot:
                rows[start] = (0, s.slot)
                rows[start + 1:start + r.n_new] = (0, -1)  # drafts: written on the device
            else:
                rows[start:start + r.n_new, 0] = s.tokens[r.n_past:r.n_past + r.n_new]
                rows[start:start + r.n_new, 1] = -1
            seqs[i] = (start, r.n_new, r.n_past, s.slot if r.samples else -1)
            assert s.region is not None
            kvs.append(self.backend.session_kv(s.region))
            seq_rows.append((start, r.n_new, r.n_past))
            rebuild = None
            if s.params.penalized and not s.counts_valid:
                rebuild = s.tokens[:r.n_past]
                s.counts_valid = True
            seq_work.append(SeqWork(s.id, s.prompt_len, s.params, r.samples, s.slot,
                                    rebuild, s.n_sampled, n_draft=r.n_draft))
            if r.samples:
                sampled_rows.append((s, s.n_sampled, i))
            start += r.n_new
        n_meta = (n_rows * _ROW_FIELDS + n_seqs * _SEQ_FIELDS) * 4
        sampled_rows = sampled_order(sampled_rows)  # as RoundWork writes the samples
        spec = self.spec.round(plan, sampled_rows, seq_rows)
        n_out = spec.counts_at if spec is not None else len(sampled_rows)
        logprob_n = [s.params.logprobs for s, _, _ in sampled_rows]
        want_logprobs = any(n is not None for n in logprob_n)

        self.compute.copy_h2d(self._meta_dev, self._meta_host[slot], n_meta)
        if spec is not None:
            self.spec.send_histories(slot, plan, self.compute)
        trace.device_start = self.compute.record(self.device.event())
        draft = self.spec.draft_round(plan, spec, seq_rows)
        run = RoundWork(self.transformer, self._meta_dev, self._token_buf,
                         self._sampled_dev[slot], n_rows, seq_rows, kvs, seq_work,
                         self._sampler_state, self._forget,
                         (self._lp_dev[slot], self._lp_ids_dev[slot]) if want_logprobs
                         else None, masks=self.masks, trace=trace, spec=spec, draft=draft,
                         broadcast=self.followers is not None)
        # a decode round: fixed buffers (one with constrained rows replays the forward
        # only, then samples its free rows before waiting for the masks; one with
        # speculating sessions runs their steps there too)
        # (over several devices, not a speculative round: its steps are device 0's alone)
        if self._graphs is not None and plan.n_decode == n_seqs and (
                n_rows == n_seqs if spec is None else
                draft is None and self.followers is None):
            run.graph = (self._graphs, rows.copy())
        self._forget = []
        if self.followers is None:
            self.compute.launch(run)
        else:  # the order first: the leader's work meets the followers' in collectives
            self.followers.send_round(
                self.round_id, meta_host[:n_meta // 4], n_rows, seq_rows,
                [r.session.region.rid for r in plan.rows],  # type: ignore[union-attr]
                [seq_rows[i][0] + seq_rows[i][1] - 1 - plan.rows[i].n_draft + j
                 for _, _, i in sampled_rows for j in range(1 + plan.rows[i].n_draft)],
                speculative=spec is not None, fixed=run.fixed_kind())
            self.compute.launch(self.followers.guard(run))
        done = self.compute.record(self.device.event())
        trace.device_end = done
        self.copy.wait_event(done)
        n_copy = n_out if spec is None else spec.stats_at + len(spec.seqs) * SPEC_STATS
        self.copy.copy_d2h(self._tokens_host[slot], self._sampled_dev[slot], n_copy * 4)
        lp_values = lp_ids = None
        if want_logprobs:
            cols = 1 + MAX_LOGPROBS
            self.copy.copy_d2h(self._lp_host[slot], self._lp_dev[slot], n_out * cols * 4)
            self.copy.copy_d2h(self._lp_ids_host[slot], self._lp_ids_dev[slot],
                               n_out * MAX_LOGPROBS * 4)
            lp_values = self._lp_host[slot].array.view(np.float32)[:n_out * cols].reshape(
                n_out, cols)
            lp_ids = self._lp_ids_host[slot].array.view(np.int32)[
                :n_out * MAX_LOGPROBS].reshape(n_out, MAX_LOGPROBS)
        copied = self.copy.record(self.device.event(timing=False))
        self.scheduler.launched(plan, done)
        self.last_event = done
        host_out = self._tokens_host[slot].array.view(np.int32)[:n_copy]
        rec_rows = [(s, g) for s, g, _ in sampled_rows]
        n_prefill = plan.n_tokens - plan.n_decode - plan.n_draft
        # timed for the learned round costs: rounds that prefill nothing, the draft
        # model's forwards apart (in a round's time they would price prompt lookup's
        # draft rows, which do not pay them: after a draft model's rounds, prompt lookup
        # stopped drafting)
        timing = None if n_prefill or trace.device_start is None else (
            trace.device_start, done, plan.n_decode + plan.n_draft, plan.n_draft > 0, draft)
        self._records[slot] = _RoundRecord(rec_rows, host_out, copied, spec, timing=timing)
        trace.launch_end = time.perf_counter()
        trace.n_decode = plan.n_decode
        trace.n_prefill_tokens = n_prefill
        trace.n_draft_rows = plan.n_draft
        trace.n_sessions = n_seqs
        trace.pages_in_use = self.pool.n_pages - self.pool.n_free
        prefill = {r.session.id: r.session.n_reused for r in plan.rows if r.samples
                   and not r.from_slot}
        self.to_service.put(RoundDone(
            self.round_id, [s.id for s, _ in rec_rows],
            [-1 if s.spec is not None else g for s, g in rec_rows],
            host_out, copied, logprob_n=logprob_n, logprob_values=lp_values,
            logprob_ids=lp_ids, prefill_tokens=prefill, trace=trace,
            spec=None if spec is None else spec.output(host_out)))
        self.round_id += 1

    def _harvest(self, slot: int) -> None:
        """Copy a finished round's samples into the sessions' histories (needed only to
        recompute a preempted session) before its ring slot is reused; for speculating
        sessions, also correct their bounds with the counts the device accepted and
        record their acceptance."""
        rec = self._records[slot]
        if rec is None or rec.harvested:
            return
        rec.copied.synchronize()
        if rec.timing is not None and self.round_costs is not None:
            start, end, rows, drafted, draft = rec.timing
            seconds = start.elapsed_ms(end) / 1e3
            if draft is not None and rec.spec is not None and (
                    spent := draft.elapsed()) is not None:
                self.round_costs.observe_draft(draft.forwards(rec.spec.seqs), spent)
                seconds -= spent
            self.round_costs.observe(rows, drafted, seconds)
        tokens = rec.host_tokens.tolist()
        if rec.spec is None:
            for (s, gen), token in zip(rec.rows, tokens, strict=True):
                hist = self.generated.get(s.id)
                if hist is not None and len(hist) == gen:
                    hist.append(token)
        else:
            out = rec.spec.output(rec.host_tokens)
            for j, (s, gen) in enumerate(rec.rows):
                hist = self.generated.get(s.id)
                got = out.tokens_of(j, tokens)
                e = rec.spec.entry_of[j]
                if e >= 0:
                    self.spec.harvested(s, rec.spec.seqs[e], out.stats[e])
                    if hist is not None:
                        hist.extend(got)
                elif hist is not None and len(hist) == gen:
                    hist.extend(got)
        rec.harvested = True

    def _harvest_ready(self) -> None:
        """Harvest, oldest first, every round whose output has landed, without waiting."""
        n = len(self._records)
        for k in range(n):
            idx = (self.round_id + k) % n
            rec = self._records[idx]
            if rec is None or rec.harvested:
                continue
            if not rec.copied.query():
                return
            self._harvest(idx)

    def _generated_tokens(self, s: Session) -> list[int]:
        """Every token sampled for `s` so far (waits for rounds in flight)."""
        for k in range(len(self._records)):  # oldest first
            self._harvest((self.round_id + k) % len(self._records))
        return list(self.generated.get(s.id, []))

    def _drain_device(self) -> None:
        self.compute.synchronize()
        self.copy.synchronize()
        self.pool.reclaim()

    def close(self) -> None:
        """Free everything (after the thread has ended)."""
        if self.cache is not None:
            self.cache.clear()
        for s in list(self.sessions.values()):
            if s.region is not None:
                s.region.release(after=s.last_event)
        self.sessions.clear()
        with contextlib.suppress(StreamError):  # a failed device has nothing left to drain
            self._drain_device()
        if self._graphs is not None:
            with contextlib.suppress(Exception):  # a failed device: nothing to destroy
                self._graphs.close()
        if self._owns_compute:
            self.compute.close()
        self.copy.close()
        self._records = [None] * len(self._records)  # their host arrays view the buffers
        buffers = [self._meta_dev, self._token_buf, *self._meta_host, *self._tokens_host,
                   *self._sampled_dev, *self._lp_dev, *self._lp_ids_dev, *self._lp_host,
                   *self._lp_ids_host]
        with contextlib.suppress(Exception):
            self.spec.free()
        for buf in buffers:
            with contextlib.suppress(Exception):  # a view still held keeps a host buffer
                buf.free()


def _sync(event: Event | None) -> None:
    if event is not None:
        event.synchronize()
