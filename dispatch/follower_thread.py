"""The dispatcher over N devices (tensor parallelism, docs/tensor_parallel.md "Phase 2"):
the followers' control threads and the orders the leader sends them.

Control thread 0, the leader (dispatch/control_thread.py), plans each round once, as with
one device, and before launching its own part sends every follower a `RoundOrder`: the
round's metadata rows (the bytes it copies to its own device), each session's rows and
region, the rows whose logits the round samples, and the region operations its scheduler
and prefix cache made since the last order (dispatch/region_journal.py). A follower
(`FollowerThread`) applies the operations to its own page pool, copies the metadata to its
own device and launches `FollowerWork` on its own compute stream: the round's forward over
its share of the model, which meets the other devices in the collectives, then the
broadcast of the tokens device 0 sampled into its own token buffer, so its next round's
decode inputs are there before that round runs. Nothing waits for the host: a follower is
bounded by the orders it has, the leader by its lookahead permits. In a round with
speculating sessions (prompt lookup, cpu), device 0's rows (its proposals) and positions
are broadcast before the forward, and a follower's round takes them in place of its own.

Failure: work that raises on any device aborts the group's collectives (`abort`), so every
device waiting in one raises instead of waiting forever; a follower thread that fails says
so to the service thread (which ends every request with an error) and ends.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagerlm.dispatch.messages import ControlStopped, Shutdown
from eagerlm.dispatch.owned_thread import OwnedThread
from eagerlm.dispatch.region_journal import JournaledPool, RegionMirror, RegionOp
from eagerlm.kernels.backend import DecodeKind, DecodeRounds, RoundBackend
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.model import Transformer
from eagerlm.vmm.device import Device, Event, Stream, StreamError
from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.page_pool import PagePool

# what a cpu device's compute stream enters on its thread (its share of the cores)
DeviceContext = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass
class DeviceGroup:
    """A model split over N devices, as the dispatcher drives it: device r's `Device` and
    `Transformer` (its share, its ops meeting the others' in the collectives), what its
    compute stream's thread runs inside (`contexts[r]`, cpu: pinned to its cores; None:
    nothing), and `abort`, which releases every device waiting in a collective."""

    devices: list[Device]
    transformers: list[Transformer]
    abort: Callable[[], None]
    contexts: list[DeviceContext] | None = None

    @property
    def size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class RoundOrder:
    """One round, as the leader planned it, for a follower to launch on its device."""

    round_id: int
    ops: list[RegionOp]  # the region operations since the last order, in order
    meta: np.ndarray  # int32 metadata rows, as the leader copies them (read-only)
    n_rows: int
    seq_rows: list[tuple[int, int, int]]  # per session: (first row, rows, n_past)
    regions: list[int]  # per session: its region (the leader's id)
    logit_rows: np.ndarray  # the rows the round samples, in the sampler's order
    # speculating sessions: their draft rows' tokens and their positions are device 0's,
    # broadcast at the start of the round (`RoundBackend.broadcast_round`)
    speculative: bool = False
    # the leader runs this decode round through its fixed buffers as this kind (cuda),
    # padded to a bucket: the follower runs its share padded alike, through its own
    # (`DecodeRounds.forward_shard`), so that the collectives have the same sizes
    fixed: DecodeKind | None = None


@dataclass(frozen=True)
class DeviceRound:
    """A follower's part of one round on its compute stream, for the profiler's lane of
    its device: events recorded before and after its work (the time its collectives
    waited for the other devices included)."""

    round_id: int
    device_start: Event
    device_end: Event


@dataclass(frozen=True)
class CallOrder:
    """Device work outside any session (an embedding's forward: dispatch/messages.py's
    DeviceCall), this device's part, launched between the same two rounds as device 0's;
    its result is device 0's to return."""

    work: Callable[[], object]


@dataclass(frozen=True)
class SyncOrder:
    """Apply `ops`, wait for the device and reclaim every free page, then set `done` (the
    leader's flush)."""

    ops: list[RegionOp]
    done: threading.Event


class GroupFailure:
    """Why a group's collectives were aborted: the first device's failure, written once,
    so the error every device's stream then reports (device 0's reaches the requests)
    names the fault, not the abort."""

    def __init__(self, abort: Callable[[], None]) -> None:
        self._abort = abort
        self._lock = threading.Lock()
        self.reason: str | None = None

    def fail(self, reason: str) -> None:
        with self._lock:
            self.reason = self.reason or reason
        self._abort()


class Guarded:
    """A device's round work that aborts the group's collectives when it raises, so the
    other devices' work waiting in a collective for this one raises too, with the first
    failure's reason."""

    def __init__(self, work: Callable[[], object], failure: GroupFailure, rank: int) -> None:
        self.work, self.failure, self.rank = work, failure, rank

    def __call__(self) -> object:
        aborted = False
        try:
            return self.work()
        except threading.BrokenBarrierError as exc:
            aborted = True
            exc.__traceback__ = None  # its frames hold the round's KV views
        except BaseException as exc:
            self.failure.fail(f"device {self.rank} failed: {exc!r}")
            raise
        finally:
            self.work = _done  # drop the round's buffers and KV views now
        if aborted:  # raised outside the handler: no context holding the failed frames
            raise RuntimeError(self.failure.reason or "another device of the group failed")


def _done() -> None:
    pass


def enter_on(stream: Stream, context: DeviceContext | None) -> Callable[[], None]:
    """Make `stream`'s thread enter `context` (a cpu device's cores) for good; returns
    what exits it there (enqueued, so after the stream's work so far). Only for a compute
    stream of our own (numpy: its thread runs the round's work); a backend's own stream
    (cuda) runs work on the thread that launches it, which enters the context itself."""
    if context is None:
        return _done
    stack = contextlib.ExitStack()
    stream.launch(lambda: stack.enter_context(context()))
    return lambda: stream.launch(stack.close)


class FollowerWork:
    """A follower's side of one round, on its compute stream: the inputs (host ids, or the
    token buffer device 0's samples were broadcast into), the forward with the leader's
    logit rows (its collectives meet the leader's), then the tokens' broadcast."""

    def __init__(self, transformer: Transformer, meta: Any, token_buf: Any, n_rows: int,
                 seq_rows: list[tuple[int, int, int]], kvs: list[Any],
                 logit_rows: np.ndarray, speculative: bool = False,
                 fixed: tuple[DecodeRounds, np.ndarray, DecodeKind] | None = None) -> None:
        """`fixed`: (this device's decode rounds, the round's host rows, the leader's
        kind) where the leader runs the round through its fixed buffers."""
        self.transformer = transformer
        self.meta, self.token_buf, self.n_rows = meta, token_buf, n_rows
        self.seq_rows, self.kvs, self.logit_rows = seq_rows, kvs, logit_rows
        self.speculative = speculative
        self.fixed = fixed

    def __call__(self) -> None:
        backend: RoundBackend = self.transformer.ops
        seq_rows = self.seq_rows
        if self.fixed is not None:
            graphs, rows, kind = self.fixed
            graphs.forward_shard(rows, [past for _, _, past in seq_rows], self.kvs,
                                 self.logit_rows.tolist(), kind)
            self.kvs = []
            backend.broadcast_tokens(self.token_buf)
            return
        if self.speculative:  # device 0's proposals and positions
            pasts = backend.broadcast_round(self.meta, self.n_rows, None)
            seq_rows = [(st, n, past) for (st, n, _), past in zip(seq_rows, pasts,
                                                                  strict=True)]
        tokens = backend.round_inputs(self.meta, self.n_rows, self.token_buf)
        slices = [SeqSlice(st, n, past, kv)
                  for (st, n, past), kv in zip(seq_rows, self.kvs, strict=True)]
        self.transformer.forward(ForwardBatch(tokens, slices, self.logit_rows))
        self.kvs = []
        backend.broadcast_tokens(self.token_buf)


class FollowerThread(OwnedThread):
    """Device r's control thread (r > 0): takes the leader's orders, keeps its own page
    pool, regions and buffers, launches each round on its own compute stream."""

    def __init__(self, rank: int, device: Device, transformer: Transformer, n_pages: int,
                 layout: KVLayout, *, max_batch: int, max_round_tokens: int, n_slots: int,
                 max_context: int, failure: GroupFailure, to_service: queue.Queue,
                 context: DeviceContext | None = None, cuda_graphs: bool = True) -> None:
        """`max_context`, `cuda_graphs`: as the leader's, whose decode buckets this
        device's fixed-buffer rounds follow."""
        self.rank, self.device, self.transformer = rank, device, transformer
        self.backend: RoundBackend = transformer.ops
        self.failure = failure
        self.to_service = to_service
        self.inbox: queue.Queue = queue.Queue()
        stream = self.backend.stream
        self._owns_compute = stream is None
        self.compute = stream if stream is not None else device.stream(f"compute-{rank}")
        # where the round's work runs: on our compute stream's thread (cpu), else on this
        # control thread, which launches it (cuda: its device's context current there)
        self._leave = enter_on(self.compute, context) if self._owns_compute else _done
        self._context = None if self._owns_compute else context
        self.pool = PagePool(device, n_pages)
        self.mirror = RegionMirror(self.pool, layout, self.compute, self._fence)
        meta_ints = max_round_tokens * 2 + max_batch * 4  # as the leader's ring slots
        self._meta_host = [device.alloc_host(meta_ints * 4) for _ in range(n_slots)]
        self._meta_dev = device.alloc(meta_ints * 4)
        self._token_buf = device.alloc(max_batch * 4)
        self.graphs: DecodeRounds | None = self.backend.decode_graphs(
            transformer, self._token_buf, max_batch=max_batch, max_context=max_context,
            layout=layout, enabled=cuda_graphs)
        self.error: str | None = None
        # its rounds, newest last (read by the profiler as the leader's RoundTraces are)
        self.traces: collections.deque[DeviceRound] = collections.deque(maxlen=100_000)
        super().__init__(f"eagerlm-control-{rank}")

    def _run(self) -> None:
        with self._context() if self._context is not None else contextlib.nullcontext():
            self._serve()

    def _serve(self) -> None:
        try:
            while not isinstance(msg := self.inbox.get(), Shutdown):
                if isinstance(msg, RoundOrder):
                    self._launch(msg)
                elif isinstance(msg, CallOrder):
                    self.compute.launch(Guarded(msg.work, self.failure, self.rank))
                elif isinstance(msg, SyncOrder):
                    self.mirror.apply(msg.ops)
                    self._drain_device()
                    msg.done.set()
        except BaseException as exc:  # report, never die silently
            self.error = f"device {self.rank}'s control thread failed: {exc!r}"
            traceback.print_exc()
            self.failure.fail(self.error)
            self.to_service.put(ControlStopped(self.error))
        finally:
            with contextlib.suppress(StreamError):  # a failed stream: reported above
                self._drain_device()

    def _launch(self, order: RoundOrder) -> None:
        self.mirror.apply(order.ops)
        fixed = None
        if order.fixed is not None:  # the rows go in the graph's blob
            assert self.graphs is not None, "the leader's backend has decode graphs, so has ours"
            fixed = (self.graphs, order.meta[:order.n_rows * 2].reshape(order.n_rows, 2),
                     order.fixed)
        else:
            host = self._meta_host[order.round_id % len(self._meta_host)]
            host.array.view(np.int32)[:order.meta.size] = order.meta
            self.compute.copy_h2d(self._meta_dev, host, order.meta.nbytes)
        kvs = [self.backend.session_kv(self.mirror.regions[r]) for r in order.regions]
        start = self.compute.record(self.device.event())
        self.compute.launch(Guarded(FollowerWork(
            self.transformer, self._meta_dev, self._token_buf, order.n_rows, order.seq_rows,
            kvs, order.logit_rows, order.speculative, fixed), self.failure, self.rank))
        self.traces.append(DeviceRound(order.round_id, start,
                                       self.compute.record(self.device.event())))

    def _fence(self) -> Event:
        return self.compute.record(self.device.event(timing=False))

    def _drain_device(self) -> None:
        self.compute.synchronize()
        self.pool.reclaim()

    def close(self) -> None:
        """Free everything (after the thread has ended)."""
        self.mirror.close()
        with contextlib.suppress(StreamError):
            self._drain_device()
        if self.graphs is not None:
            with contextlib.suppress(Exception):  # a failed device: nothing to destroy
                self.graphs.close()
        self._leave()
        if self._owns_compute:
            self.compute.close()
        for buf in [self._meta_dev, self._token_buf, *self._meta_host]:
            with contextlib.suppress(Exception):
                buf.free()
        self.pool.close()


class Followers:
    """The leader's end of its followers: it sends each round's order to all of them
    (`send_round`), and waits for them at a flush (`sync`)."""

    def __init__(self, threads: Sequence[FollowerThread], pool: JournaledPool,
                 failure: GroupFailure) -> None:
        self.threads = list(threads)
        self.pool = pool
        self.failure = failure

    def abort(self, reason: str) -> None:
        self.failure.fail(reason)

    def send_round(self, round_id: int, meta: np.ndarray, n_rows: int,
                   seq_rows: list[tuple[int, int, int]], regions: list[int],
                   logit_rows: list[int], speculative: bool = False,
                   fixed: DecodeKind | None = None) -> None:
        meta = meta.copy()
        meta.flags.writeable = False
        logit_rows = np.array(logit_rows, np.int64)
        logit_rows.flags.writeable = False
        order = RoundOrder(round_id, self.pool.take_journal(), meta, n_rows, list(seq_rows),
                           list(regions), logit_rows, speculative, fixed)
        for t in self.threads:
            t.inbox.put(order)

    def sync(self) -> None:
        """Every follower applies the leader's region operations so far, waits for its
        device and reclaims its free pages (a dead follower is not waited for)."""
        ops = self.pool.take_journal()
        waits = []
        for t in self.threads:
            done = threading.Event()
            t.inbox.put(SyncOrder(ops, done))
            waits.append((t, done))
        for t, done in waits:
            while not done.wait(0.05) and t.alive:
                pass

    def guard(self, work: Callable[[], object]) -> Guarded:
        return Guarded(work, self.failure, 0)

    def send_call(self, works: Sequence[Callable[[], object]]) -> None:
        """Each follower's part of a DeviceCall, in order after the rounds sent so far."""
        for t, work in zip(self.threads, works, strict=True):
            t.inbox.put(CallOrder(work))
