"""A request's sampling in no API's terms: what each API dialect's body says about how
tokens are picked (each in its own field names and ranges), as one record that makes the
engine's `SamplingParams` for each choice (`Sampling.sampling_params`, the
`ChoiceSampling` of service/http/chat_request.py).

The rules every dialect shares live here once: a field left out is the engine's default,
`top_p` 0 is greedy (the smallest nucleus is the most likely token), with a seed choice i
draws from seed + i (choices differ, the request is reproducible), and a value the engine
refuses is a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagerlm.kernels.sampling import Constraint, InvalidSamplingParams, SamplingParams
from eagerlm.service.http.openai_errors import bad_request


@dataclass(frozen=True)
class Sampling:
    """None or empty: the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or less: off
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    ignore_eos: bool = False
    skip_special_tokens: bool = False

    def sampling_params(self, max_tokens: int, choice: int,
                        constraint: Constraint | None = None) -> SamplingParams:
        """The engine's parameters for choice `choice`; `constraint`: the reply's (a
        response format, or a forced tool call's)."""
        seed = None if self.seed is None else (self.seed + choice) % (1 << 64)
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0.0:
            temperature, top_p = 0.0, 1.0
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature,
                top_k=max(0, self.top_k or 0), top_p=top_p, min_p=self.min_p or 0.0,
                seed=seed, stop=self.stop, ignore_eos=self.ignore_eos,
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                logprobs=self.logprobs, logit_bias=self.logit_bias, constraint=constraint,
                skip_special_tokens=self.skip_special_tokens)
        except InvalidSamplingParams as e:
            raise bad_request(f"Invalid value for '{e.field}': {e}", param=e.field,
                              code="invalid_value") from None


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


__all__ = ["Sampling"]
