"""The async Python API: an engine over one model.

    async with Engine.open("model.gguf", device="cpu") as engine:
        async for chunk in engine.generate("The capital of France is",
                                           SamplingParams(max_tokens=32)):
            print(chunk.text, end="")
        reply = await engine.chat_complete([{"role": "user", "content": "Hi!"}])

It runs under asyncio and trio (anyio). The dispatcher does the work on its own threads and
`submit` never blocks, so many generations share one event loop; tokenization and chat
templates run on worker threads (`anyio.to_thread`), not on the loop. The streams it hands
out, and how they cancel, are service/api/streams.py; what they yield,
service/api/records.py; its settings, service/api/engine_settings.py.

Every sampling choice is a field of `SamplingParams` (kernels/sampling.py), penalties
included.

`SyncEngine` (service/api/sync_engine.py) is the same engine with plain iterators.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from eagerlm.dispatch.dispatcher import Dispatcher
from eagerlm.dispatch.grammar import GrammarMatcher
from eagerlm.dispatch.messages import Output
from eagerlm.errors import InvalidParameters
from eagerlm.kernels.sampling import SamplingParams, TokenLogprob
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.service.api.chat_tokens import TurnMemory
from eagerlm.service.api.embeddings import Pooling, embed_ids, file_pooling
from eagerlm.service.api.engine_settings import EngineSettings
from eagerlm.service.api.metrics import EngineMetrics, PrometheusText, recent_steady_bubble
from eagerlm.service.api.model_loading import (
    DraftModel,
    LoadedModel,
    ProgressCallback,
    open_draft,
    open_model,
)
from eagerlm.service.api.progress import log_progress
from eagerlm.service.api.records import (
    ChatMessage,
    Completion,
    Logprob,
    Prompt,
    PromptInput,
    TokenLogprobs,
)
from eagerlm.service.api.streams import GenerationStream, MultiStream
from eagerlm.service.api.vllm_metrics import VllmGauges

log = logging.getLogger("eagerlm")


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
                                     draft=None if draft is None else draft.transformer,
                                     group=loaded.group)
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
                            weights=config.weights, tensor_parallel=config.tensor_parallel)
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
        out = []
        for item in inputs:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            if len(ids) > self.context_length:
                raise InvalidParameters(f"an input has {len(ids)} tokens but the context "
                                        f"holds {self.context_length}", param="input")
            bad = next((t for t in ids if not 0 <= t < self.tokenizer.vocab_size), None)
            if bad is not None:
                raise InvalidParameters(f"token {bad} is not in the vocabulary", param="input")
            if not ids:  # here: an error inside the call would fail every device's
                raise InvalidParameters("cannot embed an empty input", param="input")
            out.append(self.dispatcher.call_on_every_device(
                lambda tf, ids=ids: embed_ids(tf, ids, how)))
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



__all__ = ["Engine"]
