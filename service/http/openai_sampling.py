"""The sampling fields both OpenAI generation routes share (`SamplingFields`: chat and
completions), mapped onto the engine's `SamplingParams`, and the limits that need the
prompt's length (`resolve_max_tokens`).

Extensions many OpenAI-compatible servers accept are supported too: `top_k`, `min_p`,
`ignore_eos`, `repetition_penalty` (vLLM's: > 0, 1 = off, over prompt and output tokens),
`skip_special_tokens` (vLLM's and SGLang's: control tokens left out of the text; off by
default here, so they show, as before).

`logit_bias` (both routes) is OpenAI's: a JSON object whose keys are token ids as decimal
strings and whose values are numbers in [-100, 100], e.g. `{"50256": -100}`; `{}` or null
is no bias. The bias is added to the logits before the penalties and every filter, greedy
included (+100 all but forces a token, -100 all but bans it). A key that is not a decimal
integer or a value that is not a number in range is a 400 naming `logit_bias`; a token id
outside the model's vocabulary is a 400 when the request is submitted.

Structured output (constrained decoding, dispatch/grammar.py): llama.cpp's `json_schema`
(a schema object) and `grammar` (GBNF text) are accepted on both routes (chat's
`response_format` is service/http/openai_requests.py). At most one constraint per request
(a forced tool call counts as one). An invalid schema or grammar, or one beyond the
grammar limits (dispatch/grammar.py's `GrammarLimits`: size, shape, compile time), is a
400 naming the field, with llguidance's message, when the request is submitted; one whose
token step outgrows the limits while generating ends the request with a 400 naming the
field too (streamed: an error event, then [DONE]). A reply cut by max_tokens ends with
`length` and need not parse; a grammar that completes ends the reply with `stop`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from eagerlm.kernels.sampling import MAX_LOGIT_BIAS, Constraint, SamplingParams
from eagerlm.service.http.openai_errors import OpenAIError, bad_request, brief
from eagerlm.service.http.openai_parsing import BodyPart, RequestBody
from eagerlm.service.http.request_sampling import Sampling

MAX_CHOICES = 16  # n


class StreamOptions(BodyPart):
    include_usage: bool | None = None


_TOKEN_ID = re.compile(r"[0-9]+")  # a logit_bias key
_TOKEN_ID_DIGITS = 18  # more can be no vocabulary's id (and could overflow an int64)


class SamplingFields(RequestBody):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None  # vLLM's and SGLang's; off by default here
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, Any] | None = None  # checked in `check`: ids and biases
    user: str | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's: the output's JSON schema
    grammar: str | None = Field(None, min_length=1)  # llama.cpp's: a GBNF grammar

    def check(self) -> None:
        """Rules across fields, once the fields are valid (raises OpenAIError)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                              param="stream_options")
        self.logit_bias_pairs()
        given = self.constraint_fields()
        if len(given) > 1:
            raise bad_request(f"Give at most one of {', '.join(repr(f) for f in given)}: "
                              f"each constrains the whole reply.", param=given[1],
                              code="invalid_value")

    def constraint_fields(self) -> list[str]:
        """The request fields that constrain the reply, as given."""
        return [name for name in ("json_schema", "grammar") if getattr(self, name) is not None]

    def constraint(self) -> Constraint | None:
        """The reply's constraint from the request's fields (None: free text)."""
        if self.json_schema is not None:
            return Constraint.json_schema(self.json_schema, "json_schema")
        if self.grammar is not None:
            return Constraint.gbnf(self.grammar, "grammar")
        return None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return logit_bias_pairs(self.logit_bias)

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return None

    def sampling(self) -> Sampling:
        """The request's sampling in no API's terms (service/http/request_sampling.py)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=stop,
            logit_bias=self.logit_bias_pairs(), repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=self.logprob_count,
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=bool(self.skip_special_tokens))

    def sampling_params(self, max_tokens: int, choice: int,
                        constraint: Constraint | None = None) -> SamplingParams:
        """The engine's parameters for choice `choice` of this request (`Sampling`'s
        rules). `constraint`: the reply's (`constraint()`, or a forced tool call's)."""
        return self.sampling().sampling_params(max_tokens, choice, constraint)

    @property
    def n_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)



def logit_bias_pairs(logit_bias: dict[str, Any] | None
                     ) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs; a 400 naming `logit_bias` for a key that
    is not a token id in decimal, an id given twice ("7" and "07"), or a value that is
    not a number in [-100, 100]."""
    def invalid(message: str, code: str = "invalid_value") -> OpenAIError:
        kind = "type" if code == "invalid_type" else "value"
        return bad_request(f"Invalid {kind} for 'logit_bias': {message}.",
                           param="logit_bias", code=code)

    pairs: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise invalid(f"keys must be token ids written in decimal digits, got "
                          f"{brief(key)}")
        if len(key) > _TOKEN_ID_DIGITS:
            raise invalid(f"token id {brief(key)} is out of range")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(f"the bias of token {key} must be a number, got "
                          f"{brief(value)}", code="invalid_type")
        if not abs(value) <= MAX_LOGIT_BIAS:  # NaN fails too
            raise invalid(f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, "
                          f"{MAX_LOGIT_BIAS:g}], got {brief(value)}")
        if int(key) in pairs:
            raise invalid(f"token {int(key)} is given twice")
        pairs[int(key)] = float(value)
    return tuple(pairs.items())


def resolve_max_tokens(requested: int | None, n_prompt: int, context: int,
                       default: int | None, prompt_param: str) -> int:
    """The max_tokens to run with, or a 400 as OpenAI answers: the prompt must leave room,
    and prompt + max_tokens must fit the context. Without a request, `default` (None: all
    the room left)."""
    room = context - n_prompt
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your "
            f"prompt has {n_prompt} tokens, which leaves no room for a completion. Please "
            f"reduce the length of the prompt.", param=prompt_param,
            code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    return requested


__all__ = ["MAX_CHOICES", "SamplingFields", "StreamOptions", "logit_bias_pairs",
           "resolve_max_tokens"]
