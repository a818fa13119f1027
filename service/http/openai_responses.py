"""The OpenAI wire format's response bodies: what the server sends back.

Whole bodies and streamed chunks of both routes (`chat_completion_body`,
`chat_chunk_body`, `completion_body`, `completion_chunk_body`, `usage_chunk_body`), the
parts they share (`ResponseIds`, `Usage`, finish reasons), tool calls as message entries
and stream deltas, log-probabilities in both APIs' formats, and the server-sent events
that carry chunks (`event`; a stream that fails ends with `error_event` and `DONE`).
Request bodies are service/http/openai_requests.py.

Log-probabilities are the model's (log-softmax of the raw logits, before the logit bias,
penalties, filters and temperature), one entry per generated token, in OpenAI's two formats:

- chat (`logprobs: true`, `top_logprobs: 0..20`): `choices[i].logprobs = {"content":
  [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]},
  ...], "refusal": null}`; a stream's chunks carry the entries of their own tokens;
- legacy completions (`logprobs: 0..20`): `choices[i].logprobs = {"tokens": [...],
  "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}, ...], "text_offset":
  [...]}`. Each `top_logprobs` dict holds the N most likely tokens and the sampled one
  ("up to logprobs + 1 elements", as OpenAI documents; tokens whose text coincides share
  a key, the more likely one kept). `text_offset[i]` is where token i starts in the
  concatenated `tokens` (as vLLM computes it), continuing across a stream's chunks.

A token's text is its tokenizer piece (special tokens spelled out), with bytes that are
not valid UTF-8 on their own (part of a character split across tokens) as U+FFFD; `bytes`
has the exact bytes. Log-probabilities below -9999.0 (-inf included) are reported as
-9999.0, since JSON has no infinities.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from eagerlm.dispatch.messages import FinishReason
from eagerlm.service.api.records import Completion, Logprob, TokenLogprobs
from eagerlm.service.api.tool_calls import Reply, ToolCall
from eagerlm.service.http.openai_errors import OpenAIError


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI has no "cancelled": a request cancelled by someone else simply stopped."""
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass
class ResponseIds:
    """The id, creation time and model name shared by every body of one response."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseIds:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def of(cls, groups: Iterable[Sequence[Completion]]) -> Usage:
        """Usage of prompts each answered by one or more choices: a prompt counts once."""
        u = cls()
        for choices in groups:
            u.prompt_tokens += choices[0].prompt_tokens
            u.cached_tokens += max(c.cached_tokens for c in choices)
            u.completion_tokens += sum(c.completion_tokens for c in choices)
        return u

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


LOGPROB_FLOOR = -9999.0  # the least logprob reported; -inf becomes this (as vLLM)


def _logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def _chat_entry(e: Logprob) -> dict[str, Any]:
    return {"token": e.text, "logprob": _logprob(e.logprob), "bytes": list(e.bytes)}


def chat_logprobs_body(entries: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
    """Chat's `choices[i].logprobs` for these tokens (None when not asked for)."""
    if entries is None:
        return None
    return {"content": [{**_chat_entry(e), "top_logprobs": [_chat_entry(t) for t in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs_body(entries: Sequence[TokenLogprobs] | None, offset: int = 0
                             ) -> dict[str, Any] | None:
    """Legacy completions' `choices[i].logprobs` for these tokens, the first starting at
    text offset `offset` (None when not asked for)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    top: list[dict[str, float]] = []
    for e in entries:
        alternatives: dict[str, float] = {}
        for t in (*e.top, e):  # the N most likely, then the sampled token if not among them
            alternatives.setdefault(t.text, _logprob(t.logprob))
        top.append(alternatives)
    return {"tokens": [e.text for e in entries],
            "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def text_length(entries: Sequence[TokenLogprobs]) -> int:
    """How far these tokens move the legacy `text_offset`."""
    return sum(len(e.text) for e in entries)


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """A streamed chunk's delta carrying call `index` of a choice, all of it at once."""
    return {"tool_calls": [{"index": index, **tool_call_body(call)}]}


def chat_finish_reason(reply: Reply, reason: FinishReason | None) -> str | None:
    """"tool_calls" when the reply made calls (only a reply that ended by itself is
    parsed for them), else the engine's reason."""
    return "tool_calls" if reply.tool_calls else finish_reason(reason)


def chat_completion_body(ids: ResponseIds, completions: Sequence[Completion],
                         replies: Sequence[Reply]) -> dict[str, Any]:
    """`replies[i]` is completion i's text split into content and tool calls."""
    choices = []
    for i, (c, reply) in enumerate(zip(completions, replies, strict=True)):
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [tool_call_body(call) for call in reply.tool_calls]
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs_body(c.logprobs),
                        "finish_reason": chat_finish_reason(reply, c.finish_reason)})
    return {
        "id": ids.id, "object": "chat.completion", "created": ids.created,
        "model": ids.model, "system_fingerprint": None, "choices": choices,
        "usage": Usage.of([completions]).body(),
    }


def _chunk_body(ids: ResponseIds, obj: str, choice: dict[str, Any],
                include_usage: bool) -> dict[str, Any]:
    """One streamed chunk of either route: the envelope is the same, the choice differs."""
    body: dict[str, Any] = {
        "id": ids.id, "object": obj, "created": ids.created,
        "model": ids.model, "system_fingerprint": None, "choices": [choice],
    }
    if include_usage:
        body["usage"] = None
    return body


def chat_chunk_body(ids: ResponseIds, index: int, delta: dict[str, Any],
                    finish: str | None, include_usage: bool,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return _chunk_body(ids, "chat.completion.chunk",
                       {"index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish}, include_usage)


def completion_body(ids: ResponseIds, groups: Sequence[Sequence[Completion]]
                    ) -> dict[str, Any]:
    choices = [c for group in groups for c in group]
    return {
        "id": ids.id, "object": "text_completion", "created": ids.created,
        "model": ids.model, "system_fingerprint": None,
        "choices": [{"index": i, "text": c.text,
                     "logprobs": completion_logprobs_body(c.logprobs),
                     "finish_reason": finish_reason(c.finish_reason)}
                    for i, c in enumerate(choices)],
        "usage": Usage.of(groups).body(),
    }


def completion_chunk_body(ids: ResponseIds, index: int, text: str, finish: str | None,
                          include_usage: bool,
                          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return _chunk_body(ids, "text_completion",
                       {"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": finish}, include_usage)


def usage_chunk_body(ids: ResponseIds, obj: str, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model,
            "system_fingerprint": None, "choices": [], "usage": usage.body()}


# -- server-sent events ---------------------------------------------------------------------

DONE = "data: [DONE]\n\n"


def event(body: dict[str, Any]) -> str:
    """One server-sent event carrying a chunk."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_event(error: OpenAIError) -> str:
    """An in-band error, ASCII whatever its message holds, so it always encodes."""
    return f"data: {json.dumps(error.body())}\n\n"


def error_ending(error: OpenAIError) -> str:
    """How a stream that fails or is cut ends: an error event, then [DONE]."""
    return error_event(error) + DONE
