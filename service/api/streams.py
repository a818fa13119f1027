"""A generation in flight, seen from the event loop: `MultiStream` (several requests as one
async iterator of (index, chunk): the server's `n` choices and prompt lists),
`GenerationStream` (one request), and `RequestResult`, which turns a request's outputs
into chunks and its `Completion` for the async streams and the sync iterators alike.

Outputs come back from the dispatcher's service thread through a fire-and-forget hop to
the loop (`loop_bridge`), so a slow consumer never holds up other requests. A stream
cancels its requests when it is closed, garbage-collected (a `break` out of the `async
for`), or when the task awaiting it is cancelled; the session's KV then goes back to the
pool (through the prefix cache). Cancelling is a message to the dispatcher, so it needs no
event loop and is safe from `__del__`.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio

from eagerlm.dispatch.grammar import GrammarMatcher
from eagerlm.dispatch.messages import FinishReason, Output
from eagerlm.errors import EagerLMError, EngineFailure, InvalidParameters
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.service.api.loop_bridge import LoopWaker
from eagerlm.service.api.records import Chunk, Completion, Prompt, PromptInput, TokenLogprobs

if TYPE_CHECKING:
    from eagerlm.service.api.engine import Engine


class GenerationError(EngineFailure):
    """The engine failed (or shut down) while the request was running."""


class RequestResult:
    """Turns one request's outputs into chunks and, once finished, a `Completion`.

    Shared by the async streams and the sync iterators so both report the same thing;
    raises `GenerationError` for a request that ended in an engine error, and
    `InvalidParameters` naming the field for one that failed by its own fault (a schema
    or grammar beyond its limits while generating: dispatch/grammar.py).
    """

    def __init__(self, engine: Engine, prompt: Prompt,
                 params: SamplingParams | None = None) -> None:
        self.engine = engine
        self.prompt = prompt
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.finish: FinishReason | None = None
        self.cached_tokens = 0
        self.wants_logprobs = params is not None and params.logprobs is not None
        self.logprobs: list[TokenLogprobs] = []

    def add(self, out: Output) -> Chunk:
        self.texts.append(out.text)
        self.ids.extend(out.token_ids)
        self.cached_tokens = out.cached_tokens
        if out.finish_reason is FinishReason.ERROR:
            self.finish = out.finish_reason
            if out.error_param is not None:  # the request's own (a constraint that failed)
                raise InvalidParameters(out.error or "the request failed",
                                        param=out.error_param)
            raise GenerationError(out.error or "the engine failed")
        logprobs = None
        if self.wants_logprobs:
            logprobs = self._logprobs(out)
            self.logprobs.extend(logprobs)
        if out.finish_reason is not None:
            self.finish = out.finish_reason
            self.engine.finished_turn(self.prompt, self.completion())
        return Chunk(out.text, tuple(out.token_ids), out.finish_reason, len(self.prompt.ids),
                     out.cached_tokens, logprobs)

    def _logprobs(self, out: Output) -> tuple[TokenLogprobs, ...]:
        given = out.logprobs or []
        if len(given) != len(out.token_ids):
            self.finish = FinishReason.ERROR
            raise GenerationError(f"the engine returned {len(given)} logprobs for "
                                  f"{len(out.token_ids)} tokens")
        return tuple(self.engine.token_logprobs(lp) for lp in given)

    def completion(self) -> Completion:
        assert self.finish is not None, "the request has not finished"
        return Completion("".join(self.texts), tuple(self.ids), self.finish,
                          len(self.prompt.ids), self.cached_tokens,
                          tuple(self.logprobs) if self.wants_logprobs else None)


class _Inbox:
    """Outputs of a stream's requests, tagged with the request's index. Lives on the
    event loop: the service thread reaches it only through `LoopWaker.call_soon`."""

    def __init__(self) -> None:
        self.items: deque[tuple[int, Output]] = deque()
        self._wakeup: anyio.Event | None = None

    def put(self, index: int, out: Output) -> None:
        self.items.append((index, out))
        if self._wakeup is not None:
            self._wakeup.set()

    async def get(self) -> tuple[int, Output]:
        while not self.items:
            self._wakeup = anyio.Event()
            try:
                await self._wakeup.wait()
            finally:
                self._wakeup = None
        return self.items.popleft()


class MultiStream:
    """Several requests generating at once, as one async iterator of (index, Chunk),
    chunks of each request in order. The server's `n` choices and prompt lists use it;
    `GenerationStream` is the one-request case.

    Nothing runs until `start()` (or the first `__anext__`): then prompts are prepared on a
    worker thread and every request is submitted; a request the engine refuses raises
    there (PromptTooLong, EmptyPrompt, ValueError) and none of the group runs.
    """

    def __init__(self, engine: Engine,
                 requests: Sequence[tuple[PromptInput | Callable[[], Prompt], SamplingParams]]
                 ) -> None:
        self._engine = engine
        self._requests = list(requests)
        self._results: list[RequestResult | None] = [None] * len(self._requests)
        self._ids: list[int | None] = [None] * len(self._requests)
        self._inbox = _Inbox()
        self._open = len(self._requests)
        self._started = False
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Prepare and submit every request (idempotent)."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("the stream is closed")
        self._started = True
        engine = self._engine
        try:
            def prepare() -> tuple[list[Prompt], list[GrammarMatcher | None]]:
                prompts = [engine.prepare(p) for p, _ in self._requests]
                # constraints compiled here, not on the event loop (the llguidance
                # tokenizer on first use, about a second for a large vocabulary; then
                # each schema or grammar, bounded by dispatch/grammar.py's GrammarLimits)
                return prompts, engine.dispatcher.grammars.matchers(
                    [params.constraint for _, params in self._requests])

            prompts, grammars = await anyio.to_thread.run_sync(prepare)
            waker = LoopWaker()
            inbox = self._inbox  # the sink must not keep the stream alive (see __del__)
            for i, (prompt, (_, params)) in enumerate(zip(prompts, self._requests)):
                def sink(out: Output, i: int = i) -> None:
                    waker.call_soon(inbox.put, i, out)
                self._results[i] = RequestResult(engine, prompt, params)
                self._ids[i] = engine.submit(prompt.ids, params, sink, grammars[i])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Cancel every request still running (idempotent, callable from any thread)."""
        if self._closed:
            return
        self._closed = True
        if self._open:
            for rid in self._ids:
                if rid is not None:
                    self._engine.dispatcher.cancel(rid)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    async def __aenter__(self) -> MultiStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- iteration ----------------------------------------------------------------------

    def __aiter__(self) -> MultiStream:
        return self

    async def __anext__(self) -> tuple[int, Chunk]:
        if not self._open:
            raise StopAsyncIteration
        if self._closed:
            raise RuntimeError("the stream was closed before its requests finished")
        try:
            await self.start()
            index, out = await self._inbox.get()
        except BaseException:  # cancelled, interrupted: the requests end with the task
            self.close()
            raise
        if out.finish_reason is not None:
            self._open -= 1
        result = self._results[index]
        assert result is not None
        try:
            return index, result.add(out)
        except EagerLMError:  # the others end with it
            self.close()
            raise

    @property
    def finished(self) -> bool:
        return self._open == 0

    def completions(self) -> list[Completion]:
        """The completions of every request, in request order, once all have finished."""
        if not self.finished:
            raise RuntimeError("the requests have not finished")
        return [r.completion() for r in self._results if r is not None]

    async def collect(self) -> list[Completion]:
        """Run every request to its end; their completions in request order."""
        async with self:
            async for _ in self:
                pass
        return self.completions()


class GenerationStream:
    """One request's chunks as an async iterator (`async for chunk in stream`)."""

    def __init__(self, engine: Engine, prompt: PromptInput | Callable[[], Prompt],
                 params: SamplingParams) -> None:
        self._multi = MultiStream(engine, [(prompt, params)])

    async def start(self) -> None:
        """Prepare and submit now, so a refused request raises here (idempotent)."""
        await self._multi.start()

    def close(self) -> None:
        self._multi.close()

    async def aclose(self) -> None:
        self._multi.close()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Chunk:
        _, chunk = await self._multi.__anext__()
        return chunk

    async def collect(self) -> Completion:
        return (await self._multi.collect())[0]



__all__ = ["GenerationError", "GenerationStream", "MultiStream", "RequestResult"]
