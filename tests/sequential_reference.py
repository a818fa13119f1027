"""One request at a time, synchronously: prefill, then sample and decode token by token.

The simplest correct generation loop. It is the reference the eager dispatcher is tested
against ("equal to running each request alone") and the path `eagerlm generate` takes
until the dispatcher lands. Everything the host decides per token (end tokens, stop
strings, max tokens, context length, incremental detokenization) happens here in order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from eagerlm.dispatch.errors import EmptyPrompt, PromptTooLong, TokenOutOfVocabulary
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.token_judge import TokenJudge
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import (
    SamplingParams,
    TokenCounts,
    TokenLogprob,
    sample,
    token_logprob,
)
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.vmm.kv_layout import KVLayout


@dataclass
class ReferenceChunk:
    """One step of the reference loop: new text, the token that produced it, and at the
    end the reason generation finished. Not the engine's `eagerlm.Chunk`: its logprobs are
    the sampler's own `TokenLogprob`s, so tests check the engine's conversion to
    `TokenLogprobs` (text pieces, bytes) against them rather than against themselves."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first one (the first costs the prefill)."""
        dt = self.total_s - self.time_to_first_token_s
        return (self.generated_tokens - 1) / dt if self.generated_tokens > 1 and dt > 0 else 0.0


@dataclass
class SequentialGeneration:
    """Iterate to stream `ReferenceChunk`s; `stats` is complete once iteration ends."""

    transformer: Transformer
    tokenizer: Tokenizer
    prompt_ids: Sequence[int]
    params: SamplingParams
    max_context: int | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self) -> None:
        cfg = self.transformer.config
        self.context = cfg.context_for(self.max_context)
        if not self.prompt_ids:
            raise EmptyPrompt()
        if len(self.prompt_ids) >= self.context:
            raise PromptTooLong(len(self.prompt_ids), self.context)
        TokenOutOfVocabulary.check(self.prompt_ids, self.tokenizer.vocab_size, self.params,
                                   cfg.vocab_size)
        self.params = self.params.resolve_seed()

    def __iter__(self) -> Iterator[ReferenceChunk]:
        cfg, tok, params = self.transformer.config, self.tokenizer, self.params
        n_prompt = len(self.prompt_ids)
        budget = min(params.max_tokens, self.context - n_prompt)
        kv = self.transformer.ops.contiguous_kv(
            KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), n_prompt + budget)
        judge = TokenJudge(tok, params, budget)
        self.stats = GenerationStats(prompt_tokens=n_prompt)
        t0 = time.perf_counter()

        counts = TokenCounts.of(cfg.vocab_size, self.prompt_ids) if params.penalized else None
        batch = ForwardBatch.single(list(self.prompt_ids), 0, kv)
        n_past = 0
        while True:
            logits = np.asarray(self.transformer.forward(batch), dtype=np.float32)
            n_past += len(batch.tokens)
            token = int(sample(logits, [params], [n_past], [counts])[0])
            if counts is not None:
                counts.add([token], as_output=True)
            logprobs = None if params.logprobs is None else [
                token_logprob(logits[0], token, params.logprobs)]
            if self.stats.generated_tokens == 0:
                self.stats.time_to_first_token_s = time.perf_counter() - t0
            self.stats.generated_tokens += 1
            self.stats.total_s = time.perf_counter() - t0
            text, finish = judge.accept(token)
            yield ReferenceChunk(text, [token], finish, logprobs)
            if finish is not None:
                return
            batch = ForwardBatch.single([token], n_past, kv)
