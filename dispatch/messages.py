"""The messages between the three layers of the dispatcher: the only interface between
their threads.

    user layer ──Submit/Cancel──► service thread ──AddSession/StopSession──► control thread
    user layer ◄──Output────────  service thread ◄──RoundDone─────────────── control thread

Each thread owns its state; nothing here is shared mutable state except the host token
buffer of a round, which the control thread fills on the device's copy stream and hands
over (with the event that says the copy is done) and does not touch again until the
service thread has consumed the round.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from eagerlm.dispatch.grammar import GrammarMatcher
from eagerlm.kernels.sampling import SamplingParams, TokenLogprob
from eagerlm.vmm.device import Event


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    CANCELLED = "cancelled"  # the user cancelled (or left the stream)
    ERROR = "error"  # the engine failed or shut down before the request finished


@dataclass
class Output:
    """What the user layer receives for a request: new text, the token ids that produced
    it, and at the end the reason generation finished (plus an error message if any)."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    # the request field at fault when the error is the request's own (a constraint that
    # failed while generating: dispatch/grammar.py's ConstraintFailed), None for the engine's
    error_param: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not prefilled
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for


OutputSink = Callable[[Output], None]


# -- user layer -> service thread ------------------------------------------------------

@dataclass
class Submit:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams  # seed already resolved
    sink: OutputSink
    grammar: GrammarMatcher | None = None  # compiled before submission for a constraint


@dataclass
class Cancel:
    request_id: int


# -- service thread -> control thread --------------------------------------------------

@dataclass
class AddSession:
    session_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the control thread never launches more decode steps than this


@dataclass
class StopSession:
    """Finish a session: remove it from the next round planned. `tokens` are the tokens
    the service thread accepted for it (prompt + generated), so its KV can be cached under
    that key."""

    session_id: int
    tokens: list[int] = field(default_factory=list)


@dataclass
class Shutdown:
    pass


@dataclass
class Flush:
    """Drop the prefix cache, wait for the device, reclaim every free page; then set
    `done`. After all requests have finished, every page is back in the pool."""

    done: threading.Event


@dataclass
class DeviceCall:
    """Device work outside any session (an embedding's forward), which the control thread
    launches on its compute stream between two rounds: the ops are then used by one
    thread at a time on either backend (cpu: the stream's thread; cuda: the control
    thread, which launches). `done` is set once `work` has run, its result or error kept."""

    work: Callable[[], object]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[object] = field(default_factory=list)
    error: list[BaseException] = field(default_factory=list)
    # a model split over devices: device r's part (r = 1 ..), launched by its own control
    # thread at the same point of its rounds (dispatch/follower_thread.py)
    others: list[Callable[[], object]] = field(default_factory=list)

    def __call__(self) -> None:
        try:
            self.result.append(self.work())
        except BaseException as e:  # handed to the caller, not the stream's thread
            self.error.append(e)
        finally:
            self.done.set()


# -- control thread -> service thread --------------------------------------------------

@dataclass
class SpecOutput:
    """Where a round with speculating sessions put each sampled session's tokens in its
    output (dispatch/round_work.py's SpecRound): session j's first at `offsets[j]`, one
    token unless it speculated (`entry_of[j]` >= 0): then `counts[entry]` of them. The
    arrays view the round's host buffer (valid once its copy completes)."""

    offsets: list[int]
    entry_of: list[int]
    counts: np.ndarray  # int32 [entries]: tokens accepted (the drafts' and one more)
    stats: np.ndarray  # int32 [entries, 3]: proposals checked, accepted, shadow match

    def tokens_of(self, j: int, tokens: list[int]) -> list[int]:
        """Sampled session j's tokens, from the round's output as a list."""
        e, at = self.entry_of[j], self.offsets[j]
        return tokens[at:at + (1 if e < 0 else int(self.counts[e]))]


@dataclass
class RoundDone:
    """A launched round. Rows of `tokens` (a host buffer, valid once `copied` completes)
    hold the token sampled for each session in `sessions`; `generation` counts how many
    tokens each session had sampled before this round (so the service thread can discard
    tokens of rounds it has already seen past a stop; -1 for a speculating session, whose
    count only the device knows). With speculating sessions, `spec` says where each
    session's tokens are (then the logprob rows follow the same layout)."""

    round_id: int
    sessions: list[int]
    generation: list[int]
    tokens: np.ndarray  # int32 [len(sessions)]
    copied: Event
    # per session: how many alternatives it asked for (None: no logprobs), and the host
    # buffers the sampler's logprobs land in (valid once `copied` completes)
    logprob_n: list[int | None] = field(default_factory=list)
    logprob_values: np.ndarray | None = None  # float32 [rows, 1 + MAX_LOGPROBS]
    logprob_ids: np.ndarray | None = None  # int32 [rows, MAX_LOGPROBS]
    prefill_tokens: dict[int, int] = field(default_factory=dict)  # session -> cached
    trace: RoundTrace | None = None
    spec: SpecOutput | None = None

    def session_tokens(self, tokens: list[int]) -> list[list[int]]:
        """Each session's tokens (in `sessions` order), from `tokens` as a list."""
        if self.spec is None:
            return [[t] for t in tokens]
        return [self.spec.tokens_of(j, tokens) for j in range(len(self.sessions))]


@dataclass
class SessionFailed:
    """The control thread could not run a session (e.g. it can never fit the KV pool)."""

    session_id: int
    error: str


@dataclass
class ControlStopped:
    """The control thread has ended; `error` is set when it died of an exception."""

    error: str | None = None


# -- instrumentation -------------------------------------------------------------------

@dataclass
class RoundTrace:
    """Timestamps of one round (seconds, time.perf_counter) for the profiler."""

    round_id: int
    plan_start: float = 0.0
    plan_end: float = 0.0
    launch_end: float = 0.0
    device_start: Event | None = None
    device_end: Event | None = None
    tokens_ready: float = 0.0  # when the service thread had the tokens
    n_decode: int = 0
    n_prefill_tokens: int = 0
    n_sessions: int = 0
    pages_in_use: int = 0
    # constrained rows sampled, and the seconds their sampling waited for the host's masks
    # (written on the compute stream, read once the round's tokens have landed)
    n_constrained: int = 0
    mask_wait: float = 0.0
    # speculation: draft rows in the round; proposals checked and accepted (filled in
    # once the round's output has landed)
    n_draft_rows: int = 0
    n_draft_tokens: int = 0
    n_accepted_tokens: int = 0
