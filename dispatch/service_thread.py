"""The service layer: one thread that does everything that needs the host to look at tokens.

It receives requests from the user layer and rounds from the control thread, waits for
each round's token copy (on the copy stream, after the round's event), appends tokens,
checks end tokens / stop strings / max tokens / cancellation, detokenizes incrementally and
sends text to the request's sink. When a request finishes it tells the control thread to
stop the session; tokens that rounds already in flight produce for it are discarded here,
never shown.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from eagerlm.dispatch.grammar import ConstraintFailed
from eagerlm.dispatch.mask_board import MaskBoard
from eagerlm.dispatch.messages import (
    AddSession,
    Cancel,
    ControlStopped,
    FinishReason,
    Flush,
    Output,
    OutputSink,
    RoundDone,
    SessionFailed,
    Shutdown,
    StopSession,
    Submit,
)
from eagerlm.dispatch.owned_thread import OwnedThread
from eagerlm.dispatch.token_judge import TokenJudge
from eagerlm.kernels.sampling import TokenLogprob
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.vmm.device import StreamError


@dataclass
class _Request:
    """The service thread's view of one request."""

    request_id: int
    prompt_ids: list[int]
    sink: OutputSink
    judge: TokenJudge
    cached_tokens: int = 0
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.judge.generated


@dataclass
class ServiceStats:
    """Counters the service thread keeps (read by tests and /metrics)."""

    rounds: int = 0
    tokens_accepted: int = 0
    tokens_discarded: int = 0  # produced by in-flight rounds after their session finished
    # speculative decoding: sessions' rounds with draft rows, the proposals they verified,
    # and how many of them were accepted
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class ServiceThread(OwnedThread):
    def __init__(self, tokenizer: Tokenizer, context_length: int, inbox: queue.Queue,
                 to_control: queue.Queue, lookahead: threading.Semaphore,
                 on_round: Callable[[RoundDone], None] | None = None,
                 masks: MaskBoard | None = None) -> None:
        self.tokenizer = tokenizer
        # constrained requests' masks, posted here as their tokens land (mask_board.py)
        self.masks = masks if masks is not None else MaskBoard()
        self.context_length = context_length
        self.inbox = inbox
        self.to_control = to_control
        self.lookahead = lookahead
        self.on_round = on_round  # instrumentation hook, called with each consumed round
        self.stats = ServiceStats()
        self._requests: dict[int, _Request] = {}
        self._dead: str | None = None  # why the engine stopped, once it has
        super().__init__("eagerlm-service")

    @property
    def failure(self) -> str | None:
        """Why this thread fails every request now (a dead device or control thread)."""
        return self._dead

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            msg = self.inbox.get()
            if isinstance(msg, Shutdown):  # the dispatcher's last word, after the control's
                self._fail_all("engine shut down")
                self.masks.shutdown()
                return
            try:
                self._handle(msg)
            except StreamError as exc:
                # a failed device stream stays failed (like a CUDA context): the engine is
                # dead. End every request now; the control thread stops and reports.
                self._dead = self._dead or f"device failure: {exc}"
                self._fail_all(self._dead)
                self.to_control.put(Shutdown())
            except Exception:
                traceback.print_exc()  # a bug, or a sink that raised: keep serving

    def _handle(self, msg: object) -> None:
        if isinstance(msg, Submit):
            if self._dead is not None:
                msg.sink(Output(msg.request_id, "", [], FinishReason.ERROR, self._dead,
                                prompt_tokens=len(msg.prompt_ids)))
            else:
                self._submit(msg)
        elif isinstance(msg, RoundDone):
            self._round(msg)
        elif isinstance(msg, Cancel):
            req = self._requests.get(msg.request_id)
            if req is not None and not req.done:
                self._finish(req, FinishReason.CANCELLED, "")
        elif isinstance(msg, Flush):
            if self._dead is not None:
                msg.done.set()
            else:
                self.to_control.put(msg)  # after the stops of everything before it
        elif isinstance(msg, SessionFailed):
            req = self._requests.get(msg.session_id)
            if req is not None and not req.done:
                self._finish(req, FinishReason.ERROR, "", error=msg.error)
        elif isinstance(msg, ControlStopped):
            self._dead = msg.error or "engine shut down"
            self._fail_all(self._dead)

    def _fail_all(self, error: str) -> None:
        for req in list(self._requests.values()):
            if not req.done:
                self._finish(req, FinishReason.ERROR, "", error=error, tell_control=False)

    def _submit(self, msg: Submit) -> None:
        max_new = min(msg.params.max_tokens, self.context_length - len(msg.prompt_ids))
        req = _Request(msg.request_id, msg.prompt_ids, msg.sink,
                       TokenJudge(self.tokenizer, msg.params, max_new, msg.grammar))
        self._requests[msg.request_id] = req
        if req.judge.constrained:  # its first mask, before any round can sample for it
            self.masks.open(msg.request_id)
            try:  # (computed when the constraint was compiled: this does not fail)
                self.masks.post(msg.request_id, 0, req.judge.next_mask())
            except ConstraintFailed as exc:
                self._finish(req, FinishReason.ERROR, "", error=str(exc),
                             error_param=exc.param, tell_control=False)
                return
        self.to_control.put(AddSession(msg.request_id, msg.prompt_ids, msg.params, max_new))

    def _round(self, rd: RoundDone) -> None:
        try:
            rd.copied.synchronize()
            if rd.trace is not None:
                rd.trace.tokens_ready = time.perf_counter()
            # read everything before the round's host buffers may be reused
            tokens = rd.tokens.tolist()
            per_session = rd.session_tokens(tokens)
            logprobs = _logprobs(rd, per_session)
            if rd.spec is not None:
                self._count_speculation(rd)
        finally:
            self.lookahead.release()  # whatever happens, the control thread goes on
        self.stats.rounds += 1
        for sid, cached in rd.prefill_tokens.items():
            if sid in self._requests:
                self._requests[sid].cached_tokens = cached
        rows = list(zip(rd.sessions, rd.generation, per_session, logprobs, strict=True))
        # constrained sessions first: a round in flight may be waiting for their masks
        rows.sort(key=lambda r: r[0] not in self._requests
                  or not self._requests[r[0]].judge.constrained)
        for sid, gen, toks, lps in rows:
            req = self._requests.get(sid)
            if req is None or req.done or (gen >= 0 and gen != len(req.generated)):
                self.stats.tokens_discarded += len(toks)
                continue
            for i, token in enumerate(toks):  # a speculating session's accepted run
                if req.done:  # ended inside the run: the rest is never shown
                    self.stats.tokens_discarded += len(toks) - i
                    break
                self._accept(req, token, lps[i])
        if self.on_round is not None:
            self.on_round(rd)

    def _count_speculation(self, rd: RoundDone) -> None:
        """Proposals checked and accepted in the round (decode rows with drafts)."""
        assert rd.spec is not None
        stats = rd.spec.stats
        drafted = int(stats[:, 0].sum())
        accepted = int(stats[:, 1].sum())
        # vLLM's num_drafts: entries whose proposals were checked (rows given to a
        # prompt's last chunk, or a lookup that found nothing, proposed none)
        self.stats.drafts += int((stats[:, 0] > 0).sum())
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        if rd.trace is not None:
            rd.trace.n_draft_tokens, rd.trace.n_accepted_tokens = drafted, accepted

    def _accept(self, req: _Request, token: int, lp: TokenLogprob | None) -> None:
        self.stats.tokens_accepted += 1
        text, finish = req.judge.accept(token)
        error, error_param = req.judge.error, req.judge.error_param
        if finish is None and req.judge.constrained and len(req.generated) < req.judge.max_new:
            try:
                self.masks.post(req.request_id, len(req.generated), req.judge.next_mask())
            except ConstraintFailed as exc:  # a step beyond the grammar's limits: this
                finish, error, error_param = FinishReason.ERROR, str(exc), exc.param
                # request ends here, the rounds waiting for its mask take none
        logprobs = None if lp is None else [lp]
        if finish is not None:
            self._finish(req, finish, text, [token], logprobs=logprobs, error=error,
                         error_param=error_param)
        else:
            self._deliver(req, Output(req.request_id, text, [token],
                                      prompt_tokens=len(req.prompt_ids),
                                      cached_tokens=req.cached_tokens, logprobs=logprobs))

    def _finish(self, req: _Request, reason: FinishReason, text: str,
                token_ids: list[int] | None = None, error: str | None = None,
                tell_control: bool = True,
                logprobs: list[TokenLogprob] | None = None,
                error_param: str | None = None) -> None:
        req.done = True
        self.masks.close(req.request_id)  # a round in flight samples it without a mask
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        if tell_control:
            # The KV holds the prompt and every accepted token but the last (never fed back).
            self.to_control.put(StopSession(req.request_id,
                                            req.prompt_ids + req.generated[:-1]))
        del self._requests[req.request_id]
        self._deliver(req, Output(req.request_id, text, token_ids or [], reason, error,
                                  error_param, prompt_tokens=len(req.prompt_ids),
                                  cached_tokens=req.cached_tokens, logprobs=logprobs))

    def _deliver(self, req: _Request, out: Output) -> None:
        """Hand an output to the request's sink; a sink that raises cancels its request
        (its consumer is gone) without disturbing the others."""
        try:
            req.sink(out)
        except Exception:
            traceback.print_exc()
            if not req.done:
                self._finish(req, FinishReason.CANCELLED, "")


def _logprobs(rd: RoundDone,
              per_session: list[list[int]]) -> list[list[TokenLogprob | None]]:
    """The sampler's logprobs of a round, as objects, per session and token (None for the
    sessions that did not ask)."""
    if rd.logprob_values is None or rd.logprob_ids is None:
        return [[None] * len(toks) for toks in per_session]
    out: list[list[TokenLogprob | None]] = []
    for j, (toks, n) in enumerate(zip(per_session, rd.logprob_n, strict=True)):
        if n is None:
            out.append([None] * len(toks))
            continue
        at = j if rd.spec is None else rd.spec.offsets[j]
        row: list[TokenLogprob | None] = []
        for i, token in enumerate(toks):
            values, ids = rd.logprob_values[at + i], rd.logprob_ids[at + i]
            row.append(TokenLogprob(token, float(values[0]), tuple(
                (int(ids[k]), float(values[1 + k])) for k in range(n))))
        out.append(row)
    return out
