"""The async Python API: an engine over one model, and streams of generated text.

    async with Engine.open("model.gguf", device="cpu") as engine:
        async for chunk in engine.generate("The capital of France is",
                                           SamplingParams(max_tokens=32)):
            print(chunk.text, end="")
        reply = await engine.chat_complete([{"role": "user", "content": "Hi!"}])

It runs under asyncio and trio (anyio). The dispatcher does the work on its own threads and
`submit` never blocks, so many generations share one event loop; tokenization and chat
templates run on worker threads (`anyio.to_thread`), not on the loop. Outputs come back
from the dispatcher's service thread through a fire-and-forget hop to the loop
(`loop_bridge`), so a slow consumer never holds up other requests.

A stream cancels its request when it is closed, garbage-collected (a `break` out of the
`async for`), or when the task awaiting it is cancelled; the session's KV then goes back
to the pool (through the prefix cache). Cancelling is a message to the dispatcher, so it
needs no event loop and is safe from `__del__`.

Every sampling choice is a field of `SamplingParams` (kernels/sampling.py), penalties
included. With `SamplingParams(logprobs=N)` each chunk, and the whole `Completion`, carries
one `TokenLogprobs` per generated token: the token's text piece, bytes and log-probability,
and its N most likely alternatives likewise.

`SyncEngine` (service/sync_engine.py) is the same engine with plain iterators.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.grammar import GrammarMatcher
from eagerlm.dispatch.messages import FinishReason, Output
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.errors import EagerLMError, EngineFailure, InvalidParameters
from eagerlm.kernels.sampling import SamplingParams, TokenLogprob
from eagerlm.loader.config import RopeOverride
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.service.api.chat_tokens import DEFAULT_MAX_TURNS, TurnMemory
from eagerlm.service.api.embeddings import Pooling, embed_ids, file_pooling
from eagerlm.service.api.loop_bridge import LoopWaker
from eagerlm.service.api.metrics import EngineMetrics, PrometheusText, recent_steady_bubble
from eagerlm.service.api.model_loading import (
    WEIGHTS_CHOICES,
    DraftModel,
    LoadedModel,
    ProgressCallback,
    open_draft,
    open_model,
)
from eagerlm.service.api.progress import log_progress
from eagerlm.service.api.vllm_metrics import VllmGauges

log = logging.getLogger("eagerlm")

ChatMessage = Mapping[str, Any]


@dataclass(frozen=True)
class EngineSettings:
    """How an engine is set up. The defaults suit one user on one machine; each is the
    default of the layer that owns the setting (DispatcherConfig, ControlConfig,
    SchedulerConfig, TurnMemory), so the engine and a bare dispatcher agree."""

    # context length in tokens (--ctx); default the model's trained context. Beyond it
    # only as far as the rope scaling supports (ModelConfig.context_for)
    max_context: int | None = DispatcherConfig.max_context
    # the user's rope scaling in place of the file's (loader/config.py RopeOverride):
    # "none", "linear" or "yarn", the factor, YaRN's original context; None keeps the file's
    rope_scaling: str | None = None
    rope_scale: float | None = None
    yarn_orig_ctx: int | None = None
    # cpu KV pool; None: fits the context (kv_capacity)
    kv_budget_bytes: int | None = DispatcherConfig.kv_budget_bytes
    # of memory left after weights: cuda pool, cpu cap
    memory_fraction: float = DispatcherConfig.memory_fraction
    page_size: int | None = None  # KV page bytes (cpu; default 2 MiB)
    max_batch: int = SchedulerConfig.max_batch  # sessions per round
    max_round_tokens: int = SchedulerConfig.max_round_tokens  # prefill + decode tokens per round
    lookahead: int = ControlConfig.lookahead  # rounds launched ahead of the service thread
    # keep finished sessions' KV for prompts that share a prefix
    prefix_cache: bool = ControlConfig.prefix_cache
    # replay decode rounds as CUDA graphs (cuda; off: run eagerly)
    cuda_graphs: bool = ControlConfig.cuda_graphs
    chat_turns_remembered: int = DEFAULT_MAX_TURNS  # see service/api/chat_tokens.py
    model_name: str | None = None  # the name clients use; default: the file's stem
    # how the backend holds the matrices: "quantized" (the file's blocks, read by the
    # kernels), "float" (cpu: float32) or "bf16" (cuda); None: quantized
    weights: str | None = None
    # speculative decoding for requests that do not choose (dispatch/speculation.py):
    # "ngram" (prompt lookup), "draft" (needs draft_model) or "off"; drafts per round
    speculative: str = SpeculationConfig.method
    num_speculative_tokens: int = SpeculationConfig.num_tokens
    draft_model: str | None = None  # a GGUF with the same vocabulary (--draft-model)

    def __post_init__(self) -> None:
        self.rope_override()  # bad values fail here, before anything is loaded
        if self.weights is not None and self.weights not in WEIGHTS_CHOICES:
            raise InvalidParameters(f"weights must be 'quantized' or 'float' (cpu), "
                                    f"'quantized' or 'bf16' (cuda), not {self.weights!r}")
        self.speculation()  # likewise
        if self.speculative == "draft" and self.draft_model is None:
            raise InvalidParameters("speculative 'draft' needs a draft model "
                                    "(--draft-model PATH)", param="draft_model")

    def speculation(self) -> SpeculationConfig:
        return SpeculationConfig(self.speculative, self.num_speculative_tokens)

    def rope_override(self) -> RopeOverride | None:
        """The rope scaling settings as the loader takes them (None: the file's)."""
        return RopeOverride.from_settings(self.rope_scaling, self.rope_scale,
                                          self.yarn_orig_ctx)

    def dispatcher_config(self) -> DispatcherConfig:
        control = ControlConfig(SchedulerConfig(max_batch=self.max_batch,
                                                max_round_tokens=self.max_round_tokens),
                                lookahead=self.lookahead, prefix_cache=self.prefix_cache,
                                cuda_graphs=self.cuda_graphs, speculation=self.speculation())
        return DispatcherConfig(control=control, kv_budget_bytes=self.kv_budget_bytes,
                                memory_fraction=self.memory_fraction,
                                max_context=self.max_context)


@dataclass(frozen=True)
class Prompt:
    """Token ids ready to submit. `chat_text` is the rendered conversation when the ids
    come from a chat, so the finished turn can be remembered for the next one."""

    ids: tuple[int, ...]
    chat_text: str | None = None


@dataclass(frozen=True)
class Logprob:
    """A token and its log-probability under the model: its id, its text piece (the
    tokenizer's bytes for it, invalid UTF-8 as U+FFFD) and those bytes."""

    token_id: int
    text: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs(Logprob):
    """A generated token's log-probability and its `top` most likely alternatives (most
    likely first; the token itself among them when it is one). Log-probabilities are of the
    model's distribution: log-softmax of the raw logits, before penalties, filters and
    temperature."""

    top: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """A piece of a generation: new text, the token ids behind it, and, on the last
    chunk, why generation finished. Every chunk repeats the prompt's token count and how
    many of them were reused from cached KV. With `SamplingParams.logprobs` set,
    `logprobs` holds one entry per token id (else None)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class Completion:
    """A whole generation. `logprobs`: one entry per token id when asked for, else None."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class GenerationError(EngineFailure):
    """The engine failed (or shut down) while the request was running."""


PromptInput = str | Sequence[int] | Prompt


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


class Engine:
    """One model on one device, with its dispatcher. Open it with `Engine.open` (async) or
    `Engine.load` (blocking); both end with `shutdown()`."""

    def __init__(self, loaded: LoadedModel, settings: EngineSettings,
                 draft: DraftModel | None = None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.draft = draft
        self.model: ModelFile = loaded.model
        self.tokenizer: Tokenizer = loaded.model.tokenizer
        self.dispatcher = Dispatcher(loaded.device, loaded.transformer, self.tokenizer,
                                     settings.dispatcher_config(),
                                     draft=None if draft is None else draft.transformer)
        self.name = settings.model_name or Path(loaded.model.path).stem
        self.metrics = EngineMetrics()
        self.turns = TurnMemory(self.tokenizer, settings.chat_turns_remembered)
        self._closed = False
        self._shutdown_lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str | Path, device: str = "cpu", *,
             on_progress: ProgressCallback | None = None, **settings: Any) -> Engine:
        """Load the model and start the dispatcher (blocking). `settings` are the fields
        of `EngineSettings`."""
        config = EngineSettings(**settings)
        loaded = open_model(model_path, device, page_size=config.page_size,
                            on_progress=on_progress or log_progress,
                            rope=config.rope_override(), max_context=config.max_context,
                            weights=config.weights)
        draft = None
        try:
            if config.draft_model is not None:
                draft = open_draft(config.draft_model, loaded, weights=config.weights)
            return cls(loaded, config, draft)
        except BaseException:
            if draft is not None:
                draft.close()
            loaded.close()
            raise

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, model_path: str | Path, device: str = "cpu", *,
                   on_progress: ProgressCallback | None = None,
                   **settings: Any) -> AsyncIterator[Engine]:
        """`async with Engine.open(path) as engine:` loads on a worker thread (the loop
        keeps running) and shuts the engine down on exit, whatever happened inside."""
        engine = await anyio.to_thread.run_sync(
            lambda: cls.load(model_path, device, on_progress=on_progress, **settings))
        try:
            yield engine
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(engine.shutdown)

    # -- facts ----------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.dispatcher.context_length

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve (shut down, a dispatcher thread dead, a
        failed device), or None while it can."""
        return self.dispatcher.failure

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet finished."""
        return self.metrics.running

    # -- preparing and submitting (blocking; also used by SyncEngine and the server) -----

    def prepare(self, prompt: PromptInput | Callable[[], Prompt]) -> Prompt:
        """Token ids for a prompt: text is encoded (with BOS when the model wants one),
        ids are taken as they are. Runs on a worker thread in the async API."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            return Prompt(tuple(self.tokenizer.encode(prompt)))
        if callable(prompt):
            return prompt()
        return Prompt(tuple(int(t) for t in prompt))

    def prepare_infill(self, prefix: str, suffix: str) -> Prompt:
        """A fill-in-the-middle prompt: the model writes what goes between `prefix` and
        `suffix` (Tokenizer.encode_infill). InvalidParameters for a model without FIM tokens."""
        return Prompt(tuple(self.tokenizer.encode_infill(prefix, suffix)))

    def prepare_chat(self, messages: Sequence[ChatMessage],
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
        """Render a conversation with the model's chat template and encode it, reusing
        the exact ids of a remembered earlier turn (service/chat_tokens.py). `tools` are
        OpenAI tool definitions for templates that show them to the model;
        `template_kwargs` more variables for the template (`enable_thinking=False`)."""
        text = self.model.render_chat([dict(m) for m in messages], tools=tools,
                                      template_kwargs=template_kwargs)
        return Prompt(tuple(self.turns.encode(text)), chat_text=text)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[Output], None], grammar: GrammarMatcher | None = None) -> int:
        """Submit to the dispatcher with metrics; `sink` runs on the service thread and
        must not block; `grammar` the constraint compiled beforehand (`Dispatcher.submit`).
        Raises what `Dispatcher.submit` raises for a bad request."""
        timer = self.metrics.start(len(prompt_ids))

        def observed(out: Output) -> None:
            try:
                timer.on_output(out)
                sink(out)
            except Exception:  # never let a consumer's failure kill the service thread
                log.exception("output sink failed")

        try:
            return self.dispatcher.submit(prompt_ids, params, observed, grammar)
        except BaseException:
            self.metrics.not_submitted(len(prompt_ids))
            raise

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's text piece and bytes, as logprobs report them: the tokenizer's piece
        (special tokens spelled out), invalid UTF-8 as U+FFFD."""
        piece = self.tokenizer.piece(token_id)
        return piece.decode("utf-8", "replace"), piece

    def token_logprobs(self, lp: TokenLogprob) -> TokenLogprobs:
        """The sampler's logprobs of one token, with the tokens' text."""
        def entry(token_id: int, logprob: float) -> Logprob:
            return Logprob(token_id, *self.token_piece(token_id), logprob)

        top = tuple(entry(t, v) for t, v in lp.top)
        return TokenLogprobs(lp.token, *self.token_piece(lp.token), lp.logprob, top)

    def finished_turn(self, prompt: Prompt, completion: Completion) -> None:
        """Remember a finished chat turn so the next one reuses its ids and KV."""
        if prompt.chat_text is not None:
            self.turns.remember(prompt.chat_text, prompt.ids, completion.text,
                                completion.token_ids)

    # -- generating ------------------------------------------------------------------------

    def generate(self, prompt: PromptInput,
                 params: SamplingParams | None = None) -> GenerationStream:
        """Stream the completion of `prompt` (text or token ids)."""
        return GenerationStream(self, prompt, params or SamplingParams())

    async def complete(self, prompt: PromptInput,
                       params: SamplingParams | None = None) -> Completion:
        return await self.generate(prompt, params).collect()

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams | None = None,
             *, tools: Sequence[Mapping[str, Any]] | None = None,
             template_kwargs: Mapping[str, Any] | None = None) -> GenerationStream:
        """Stream the assistant's reply to `messages` ({"role", "content"} dicts, and
        assistant `tool_calls` / `tool` results in Hugging Face's form). `tools`: OpenAI
        tool definitions, shown to the model by its chat template; the calls it writes
        are text, which service.tool_calls parses (`ToolCallParser(format_of_template(
        engine.model.chat_template), names).reply(...)`, as the server does).
        `template_kwargs`: more template variables (`{"enable_thinking": False}`)."""
        conversation = [dict(m) for m in messages]
        return GenerationStream(
            self, lambda: self.prepare_chat(conversation, tools, template_kwargs),
            params or SamplingParams())

    async def chat_complete(self, messages: Sequence[ChatMessage],
                            params: SamplingParams | None = None, *,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> Completion:
        return await self.chat(messages, params, tools=tools).collect()

    def generate_many(self, requests: Sequence[tuple[PromptInput, SamplingParams]]
                      ) -> MultiStream:
        """Several requests as one stream of (index, chunk)."""
        return MultiStream(self, requests)

    # -- housekeeping ----------------------------------------------------------------------

    def flush(self) -> None:
        """Drop cached prefixes and wait until every free page is back in the pool
        (blocking; after all requests have finished, every page is free)."""
        self.dispatcher.flush()

    @property
    def pooling(self) -> Pooling | None:
        """How the model file says to pool its embeddings (None: not an embedding model;
        `embed` then pools by mean)."""
        return file_pooling(self.model)

    def embed(self, inputs: Sequence[str | Sequence[int]],
              pooling: Pooling | None = None) -> list[np.ndarray]:
        """Unit-length float32 embeddings of texts or token-id lists (blocking; the
        server runs it on a worker thread). `pooling` defaults to the file's, else mean
        (service/api/embeddings.py). Runs between the dispatcher's rounds."""
        how = pooling or self.pooling or Pooling.MEAN
        transformer = self.loaded.transformer
        out = []
        for item in inputs:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            if len(ids) > self.context_length:
                raise InvalidParameters(f"an input has {len(ids)} tokens but the context "
                                        f"holds {self.context_length}", param="input")
            bad = next((t for t in ids if not 0 <= t < self.tokenizer.vocab_size), None)
            if bad is not None:
                raise InvalidParameters(f"token {bad} is not in the vocabulary", param="input")
            out.append(self.dispatcher.call_between_rounds(
                lambda ids=ids: embed_ids(transformer, ids, how)))
        return out

    def write_metrics(self, out: PrometheusText) -> None:
        self.metrics.write(out)
        pool = self.dispatcher.pool
        out.gauge("eagerlm_kv_pages_in_use", "KV pages mapped by sessions or cached prefixes.",
                  pool.n_pages - pool.n_free)
        out.gauge("eagerlm_kv_pages_total", "KV pages in the pool.", pool.n_pages)
        out.gauge("eagerlm_bubble_fraction",
                  "Device idle between rounds while sessions decode, over recent rounds.",
                  recent_steady_bubble(self.dispatcher.traces))
        stats = self.dispatcher.service.stats
        out.counter("eagerlm_spec_draft_tokens_total",
                    "Speculative decoding: draft tokens verified.", stats.draft_tokens)
        out.counter("eagerlm_spec_accepted_tokens_total",
                    "Speculative decoding: draft tokens accepted.", stats.accepted_tokens)

    def vllm_gauges(self, http_queued: int = 0) -> VllmGauges:
        """What vLLM's metric names need beside `metrics` (service/api/vllm_metrics.py)."""
        pool, stats = self.dispatcher.pool, self.dispatcher.service.stats
        return VllmGauges(pool.n_pages - pool.n_free, pool.n_pages, http_queued,
                          stats.drafts, stats.draft_tokens, stats.accepted_tokens)

    def shutdown(self) -> None:
        """Stop the dispatcher (running requests end with an error) and free the device."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        self.dispatcher.shutdown()
        if self.draft is not None:
            self.draft.close()
        self.loaded.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = [
    "Chunk",
    "Completion",
    "Engine",
    "EngineSettings",
    "FinishReason",
    "GenerationError",
    "GenerationStream",
    "Logprob",
    "MultiStream",
    "Prompt",
    "RequestResult",
    "SamplingParams",
    "TokenLogprobs",
]
