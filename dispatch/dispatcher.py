"""The dispatcher: the user layer's entry to the service and control threads.

`submit` is thread-safe and never blocks on the engine (it validates, then posts a message),
so async code can call it from the event loop, once it has compiled the request's
constraint, if any, on a worker thread (`grammars.matchers`: up to
`GrammarLimits.compile_seconds`). Outputs arrive through the request's sink, called on the
service thread.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from eagerlm.dispatch.control_thread import ControlConfig, ControlThread
from eagerlm.dispatch.errors import EmptyPrompt, PromptTooLong, TokenOutOfVocabulary
from eagerlm.dispatch.follower_thread import (
    DeviceGroup,
    DeviceRound,
    Followers,
    FollowerThread,
    GroupFailure,
    enter_on,
)
from eagerlm.dispatch.grammar import GrammarCompiler, GrammarLimits, GrammarMatcher
from eagerlm.dispatch.kv_capacity import KVCapacity, plan_capacity
from eagerlm.dispatch.mask_board import MaskBoard
from eagerlm.dispatch.messages import (
    Cancel,
    DeviceCall,
    Flush,
    Output,
    OutputSink,
    RoundDone,
    RoundTrace,
    Shutdown,
    Submit,
)
from eagerlm.dispatch.region_journal import JournaledPool
from eagerlm.dispatch.service_thread import ServiceThread
from eagerlm.dispatch.speculation import kv_layouts
from eagerlm.errors import EngineClosed, InvalidParameters
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import InvalidSamplingParams, SamplingParams
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.vmm.device import Device
from eagerlm.vmm.page_pool import PagePool

log = logging.getLogger("eagerlm")
T = TypeVar("T")


@dataclass(frozen=True)
class DispatcherConfig:
    control: ControlConfig = field(default_factory=ControlConfig)
    # the KV page pool on a host device; None: one full-context session, at least 1 GiB,
    # within memory_fraction of the memory available (dispatch/kv_capacity.py)
    kv_budget_bytes: int | None = None
    # of the memory left after weights: the pool on cuda, the default pool's cap on cpu
    memory_fraction: float = 0.9
    # context length in tokens; None: the model's (see ModelConfig.context_for), or less
    # where the pool holds less; a requested one the pool cannot hold is refused
    max_context: int | None = None
    # what one request's schema or grammar may cost (dispatch/grammar.py)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)


class Dispatcher:
    def __init__(self, device: Device, transformer: Transformer, tokenizer: Tokenizer,
                 config: DispatcherConfig | None = None,
                 draft: Transformer | None = None, group: DeviceGroup | None = None) -> None:
        """`draft`: a draft model for speculative decoding (dispatch/speculation.py), on the
        same device, with the same vocabulary (the engine checks it when loading).
        `group`: a model split over several devices (tensor parallelism), `device` and
        `transformer` its device 0's; one control thread per device
        (dispatch/follower_thread.py)."""
        self.config = config or DispatcherConfig()
        group = group if group is not None and group.size > 1 else None
        if group is not None:
            _check_group(group, device, transformer, self.config, draft)
        self.device = device
        self.tokenizer = tokenizer
        self.draft = draft
        cfg = transformer.config
        layout, _ = kv_layouts(transformer, draft)  # both models' KV per token
        # the pool and the context, sized together: one session alone can always reach
        # the context (KVPoolTooSmall for a --ctx it cannot)
        self.capacity: KVCapacity = plan_capacity(
            device, layout, cfg.context_for(self.config.max_context),
            context_requested=bool(self.config.max_context),
            kv_budget_bytes=self.config.kv_budget_bytes,
            memory_fraction=self.config.memory_fraction)
        self.context_length = self.capacity.context_length
        log.info("%s", self.capacity.describe())  # the CLI prints it (service/cli.py)
        ctl = self.config.control
        n_slots = ctl.lookahead + 2
        self.pool = (PagePool(device, self.capacity.n_pages) if group is None
                     else JournaledPool(device, self.capacity.n_pages))
        self.lookahead = threading.Semaphore(1 if ctl.sync else ctl.lookahead)
        to_control: queue.Queue = queue.Queue()
        to_service: queue.Queue = queue.Queue()
        # per-round instrumentation for the profiler, newest last
        self.traces: collections.deque[RoundTrace] = collections.deque(maxlen=100_000)
        # constraints: compiled before submission, their masks passed from the service thread
        # to the sampler through the board (dispatch/mask_board.py)
        self.grammars = GrammarCompiler(tokenizer, cfg.vocab_size,
                                        self.config.grammar_limits)
        self.masks = MaskBoard()
        self.service = ServiceThread(tokenizer, self.context_length, to_service, to_control,
                                     self.lookahead, on_round=self._on_round,
                                     masks=self.masks)
        # the other devices' control threads, each with its own pool of the same size
        self.group = group
        self.followers: list[FollowerThread] = []
        contexts = group.contexts if group is not None and group.contexts else None
        failure = GroupFailure(group.abort) if group is not None else None
        if group is not None:
            assert failure is not None
            sc = ctl.scheduler
            self.followers = [
                FollowerThread(r, group.devices[r], group.transformers[r],
                               self.capacity.n_pages, layout, max_batch=sc.max_batch,
                               max_round_tokens=sc.max_round_tokens, n_slots=n_slots,
                               max_context=self.context_length, failure=failure,
                               to_service=to_service,
                               context=contexts[r] if contexts else None,
                               cuda_graphs=ctl.cuda_graphs)
                for r in range(1, group.size)]
        self.control = ControlThread(
            device, transformer, self.pool, ctl, to_control, to_service, self.lookahead,
            self.context_length, masks=self.masks, draft=draft,
            followers=None if failure is None else Followers(self.followers, self.pool,
                                                             failure))
        self._leave = enter_on(self.control.compute, contexts[0] if contexts
                               and transformer.ops.stream is None else None)
        self._ids = itertools.count(1)
        self._closed = False
        self.service.start()
        for f in self.followers:
            f.start()
        self.control.start()

    @property
    def device_traces(self) -> list[collections.deque[DeviceRound]]:
        """Per follower (device 1 ..), its rounds' events, newest last: the profiler's
        lane of each device (device 0's are in `traces`)."""
        return [f.traces for f in self.followers]

    @property
    def pools(self) -> list[PagePool]:
        """Every device's page pool, device 0's first."""
        return [self.pool, *(f.pool for f in self.followers)]

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               sink: OutputSink, grammar: GrammarMatcher | None = None) -> int:
        """Queue a request; returns its id. Raises for a request that can never run
        (an invalid constraint: `InvalidConstraint`, naming the field, with llguidance's
        message). `grammar`: the matcher of `params.constraint`, compiled beforehand
        (`grammars.matcher`, fresh, one per request); without it the constraint is
        compiled here, the caller waiting (at most `GrammarLimits.compile_seconds`)."""
        if self._closed:
            raise EngineClosed("the engine is shut down")
        if not prompt_ids:
            raise EmptyPrompt()
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLong(len(prompt_ids), self.context_length)
        TokenOutOfVocabulary.check(prompt_ids, self.tokenizer.vocab_size, params,
                                   self.control.transformer.config.vocab_size)
        if self.group is not None and (
                self.config.control.speculation.method_for(params) == "draft"
                or (self.device.kind != "cpu"
                    and self.config.control.speculation.method_for(params) != "off")):
            raise InvalidSamplingParams("speculative", "is not supported yet with a model "
                                        "split over several devices (tensor_parallel > 1) "
                                        "but for 'ngram' on cpu")
        if (self.config.control.speculation.method_for(params) == "draft"
                and self.draft is None):
            raise InvalidSamplingParams("speculative", "is 'draft', but the engine has no "
                                        "draft model (--draft-model)")
        if params.constraint is None:
            grammar = None
        elif grammar is None:
            grammar = self.grammars.matcher(params.constraint)
        elif grammar.constraint != params.constraint or grammar.tokens:
            raise ValueError("the grammar given is not a fresh matcher of the request's "
                             "constraint")
        rid = next(self._ids)
        self.service.inbox.put(Submit(rid, list(prompt_ids), params.resolve_seed(), sink,
                                      grammar))
        return rid

    def _on_round(self, rd: RoundDone) -> None:
        if rd.trace is not None:
            self.traces.append(rd.trace)

    def cancel(self, request_id: int) -> None:
        self.service.inbox.put(Cancel(request_id))

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[Output]:
        """Submit and iterate the outputs from a plain thread (blocking)."""
        q: queue.Queue[Output] = queue.Queue()
        rid = self.submit(prompt_ids, params, q.put)
        done = False
        try:
            while not done:
                out = q.get()
                done = out.finish_reason is not None
                yield out
        finally:
            if not done:  # the caller stopped iterating early
                self.cancel(rid)

    def call_between_rounds(self, work: Callable[[], T]) -> T:
        """Run `work` (device work outside any session, e.g. an embedding's forward) on the
        compute stream between two rounds, launched by the control thread (`DeviceCall`),
        and wait for its result. Rounds go on before and after it."""
        if self._closed:
            raise EngineClosed("the engine is shut down")
        if self.group is not None:
            raise InvalidParameters("device work on device 0 alone cannot run on a model "
                                    "split over devices: call_on_every_device",
                                    param="tensor_parallel")
        return self._call(DeviceCall(work))

    def call_on_every_device(self, work: Callable[[Transformer], T]) -> T:
        """`work(transformer)` of every device (its share of the model), between two
        rounds as `call_between_rounds`; device 0's result. With a model split over
        devices, the parts run together (their collectives meet) and a part that raises
        aborts the group: the engine then fails, so check the input first."""
        if self._closed:
            raise EngineClosed("the engine is shut down")
        tf0 = self.control.transformer
        others = [] if self.group is None else self.group.transformers[1:]
        return self._call(DeviceCall(lambda: work(tf0),
                                     others=[lambda tf=tf: work(tf) for tf in others]))

    def _call(self, call: DeviceCall) -> T:
        self.control.inbox.put(call)
        while not call.done.wait(0.05):
            if self.failure is not None:  # the control thread will never run it
                raise EngineClosed(f"the engine cannot serve: {self.failure}")
        if call.error:
            raise call.error[0]
        return call.result[0]  # type: ignore[return-value]

    @property
    def failure(self) -> str | None:
        """Why this dispatcher can no longer serve, or None while it can: shut down, a
        thread gone (a bug that escaped it), or a device failure the threads reported.
        Read by the server's /health and its watchdog (service/http/liveness.py)."""
        if self._closed:
            return "the engine is shut down"
        if not self.control.alive:
            return self.service.failure or "the control thread has stopped"
        if not self.service.alive:
            return "the service thread has stopped"
        for f in self.followers:
            if not f.alive:
                return f.error or f"device {f.rank}'s control thread has stopped"
        return self.service.failure

    def flush(self, timeout: float = 30.0) -> None:
        """Drop cached prefixes and return every free page to the pool (waits)."""
        done = threading.Event()
        self.service.inbox.put(Flush(done))  # through the service: after pending cancels
        if not done.wait(timeout):
            raise TimeoutError("the control thread did not flush in time")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the threads; requests still running end with finish reason `error`."""
        if self._closed:
            return
        self._closed = True
        self.masks.shutdown()  # a round waiting for a mask: its tokens are discarded now
        self.control.inbox.put(Shutdown())
        self.control.join(timeout)
        for f in self.followers:  # after the leader's last order
            f.inbox.put(Shutdown())
        for f in self.followers:
            f.join(timeout)
        if self.group is not None and (self.control.alive
                                       or any(f.alive for f in self.followers)):
            # a device stuck in a collective for one that will never come: release it
            self.group.abort()
            self.control.join(timeout)
            for f in self.followers:
                f.join(timeout)
        self.service.inbox.put(Shutdown())  # after the control threads' last message
        self.service.join(timeout)
        self._leave()  # device 0's compute stream leaves its cores, then closes
        self.control.close()
        self.pool.close()
        for f in self.followers:
            f.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _check_group(group: DeviceGroup, device: Device, transformer: Transformer,
                 config: DispatcherConfig, draft: Transformer | None) -> None:
    """Refuse, with the setting to change, what the dispatcher does not do yet over
    several devices (docs/tensor_parallel.md, "Phase 2")."""
    if group.devices[0] is not device or group.transformers[0] is not transformer:
        raise ValueError("a device group's device 0 and its transformer are the "
                         "dispatcher's device and transformer")
    if len({d.kind for d in group.devices}) > 1:
        raise InvalidParameters("a device group's devices are of one kind",
                                param="tensor_parallel")
    method = config.control.speculation.method
    if draft is not None or method == "draft" or (device.kind != "cpu" and method != "off"):
        raise InvalidParameters("speculative decoding over several devices is built for "
                                "prompt lookup ('ngram') on cpu only so far",
                                param="speculative")
