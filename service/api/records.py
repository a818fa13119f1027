"""The typed records the Python API takes and hands out: a `Prompt` ready to submit, and
a generation's `Chunk`s, its `Completion` and their `TokenLogprobs`.

With `SamplingParams(logprobs=N)` each chunk, and the whole `Completion`, carries one
`TokenLogprobs` per generated token: the token's text piece, bytes and log-probability,
and its N most likely alternatives likewise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagerlm.dispatch.messages import FinishReason

ChatMessage = Mapping[str, Any]  # {"role", "content"}, in Hugging Face's form


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



PromptInput = str | Sequence[int] | Prompt

__all__ = ["ChatMessage", "Chunk", "Completion", "Logprob", "Prompt", "PromptInput",
           "TokenLogprobs"]
