"""The engine for scripts, notebooks and the CLI: plain iterators, no event loop.

    with SyncEngine.open("model.gguf") as engine:
        for chunk in engine.generate("Once upon a time", SamplingParams(max_tokens=64)):
            print(chunk.text, end="", flush=True)

The dispatcher already runs on its own threads, so a blocking iterator needs no event loop
of its own: outputs go into a queue the caller's thread waits on. That wait is
interruptible, so Ctrl-C in a script (or the interactive `eagerlm chat`) lands in the
iterator, which cancels its request on the way out, as does leaving a `for` loop early.
It works the same inside a notebook whose own event loop is running.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eagerlm.dispatch.messages import Output
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.model_loading import ProgressCallback
from eagerlm.service.api.records import ChatMessage, Chunk, Completion, Prompt, PromptInput
from eagerlm.service.api.streams import RequestResult


class SyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def open(cls, model_path: str | Path, device: str = "cpu", *,
             on_progress: ProgressCallback | None = None, **settings: Any) -> SyncEngine:
        """Load a model (blocking); use as a context manager or call `close()`."""
        return cls(Engine.load(model_path, device, on_progress=on_progress, **settings))

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def generate(self, prompt: PromptInput,
                 params: SamplingParams | None = None) -> SyncStream:
        """Chunks of the completion of `prompt` (text or ids). A request the engine
        refuses raises here (PromptTooLong, EmptyPrompt, ValueError)."""
        return SyncStream(self.engine, self.engine.prepare(prompt), params or SamplingParams())

    def infill(self, prefix: str, suffix: str,
               params: SamplingParams | None = None) -> SyncStream:
        """Chunks of what goes between `prefix` and `suffix` (fill-in-the-middle, for
        models with FIM tokens; ValueError for others)."""
        return SyncStream(self.engine, self.engine.prepare_infill(prefix, suffix),
                          params or SamplingParams())

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams | None = None,
             *, tools: Sequence[Mapping[str, Any]] | None = None) -> SyncStream:
        """Chunks of the assistant's reply to `messages`, reusing earlier turns' KV
        (`tools`: as Engine.chat's)."""
        return SyncStream(self.engine, self.engine.prepare_chat(messages, tools),
                          params or SamplingParams())

    def complete(self, prompt: PromptInput, params: SamplingParams | None = None) -> Completion:
        return self.generate(prompt, params).collect()

    def chat_complete(self, messages: Sequence[ChatMessage],
                      params: SamplingParams | None = None, *,
                      tools: Sequence[Mapping[str, Any]] | None = None) -> Completion:
        return self.chat(messages, params, tools=tools).collect()

    def flush(self) -> None:
        self.engine.flush()

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncStream:
    """One request's chunks as a plain iterator. The request is submitted on creation and
    cancelled when the stream is closed, garbage-collected (a `break` out of the `for`),
    or when an exception such as KeyboardInterrupt interrupts the wait for a chunk."""

    def __init__(self, engine: Engine, prompt: Prompt, params: SamplingParams) -> None:
        self._engine = engine
        self._outputs: queue.SimpleQueue[Output] = queue.SimpleQueue()
        self._result = RequestResult(engine, prompt, params)
        self._finished = False
        self._request_id = engine.submit(prompt.ids, params, self._outputs.put)

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> Chunk:
        if self._finished:
            raise StopIteration
        try:
            out = self._outputs.get()
        except BaseException:
            self.close()
            raise
        self._finished = out.finish_reason is not None
        return self._result.add(out)

    def collect(self) -> Completion:
        """Run to the end; the whole completion."""
        for _ in self:
            pass
        return self._result.completion()

    def close(self) -> None:
        """Cancel the request if it is still running (idempotent)."""
        if not self._finished:
            self._finished = True
            self._engine.dispatcher.cancel(self._request_id)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
