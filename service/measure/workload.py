"""The workloads the profiler and the benchmarks run: how many requests, how long their
prompts and outputs are, and when they arrive.

Shaped like the benchmarks engines are compared with: nano-vllm's `bench.py` (random token
ids, input and output lengths drawn uniformly from ranges, EOS ignored so every request
produces exactly its output length) and vLLM's serving benchmark (Poisson arrivals at a
request rate; an infinite rate sends everything at once). A seed fixes all of it, so the
same workload can be run on eagerlm and on a peer in the same run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from eagerlm.errors import InvalidParameters


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of token counts; `parse("100-1024")` or `parse("32")`."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise InvalidParameters(f"bad length range {self.low}-{self.high}: need "
                                    f"1 <= low <= high")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        low, sep, high = text.partition("-")
        try:
            return cls(int(low), int(high) if sep else int(low))
        except ValueError:
            message = f"bad length range {text!r}: expected N or MIN-MAX"
            raise InvalidParameters(message) from None

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


# A JSON array of short strings that cannot end before a thousand items: a constrained
# request of the workload yields its whole output length, as the others do.
CONSTRAINED_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12},
                      "minItems": 1000}


@dataclass(frozen=True)
class WorkloadSpec:
    n_requests: int
    input_len: LengthRange
    output_len: LengthRange
    request_rate: float = math.inf  # requests per second, Poisson; inf: all at time 0
    seed: int = 0
    # every k-th request (0: none) is constrained to JSON that outlasts its output length
    # (`CONSTRAINED_SCHEMA`): what constrained rows cost the rounds they share
    constrained_every: int = 0

    def __post_init__(self) -> None:
        if self.n_requests < 1:
            raise InvalidParameters("the workload needs at least one request")
        if not self.request_rate > 0:
            raise InvalidParameters("the request rate must be positive (inf: all at once)")
        if self.constrained_every < 0:
            raise InvalidParameters("--constrained-every must be >= 0 (0: none)")


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run
    constrained: bool = False  # its output follows CONSTRAINED_SCHEMA


def make_workload(spec: WorkloadSpec, vocab_size: int,
                  context_length: int | None = None) -> list[PlannedRequest]:
    """Draw the requests. Prompt tokens are uniform over the vocabulary; lengths that would
    not fit the context are cut, the prompt first (a request needs prompt + output tokens,
    and the engine refuses a prompt that fills the context)."""
    rng = random.Random(spec.seed)
    t = 0.0
    out = []
    for i in range(spec.n_requests):
        n_in = rng.randint(spec.input_len.low, spec.input_len.high)
        n_out = rng.randint(spec.output_len.low, spec.output_len.high)
        if context_length is not None:
            n_out = min(n_out, context_length - 2)
            n_in = max(1, min(n_in, context_length - 1 - n_out))
        prompt = [rng.randrange(vocab_size) for _ in range(n_in)]
        if math.isfinite(spec.request_rate) and i > 0:
            t += rng.expovariate(spec.request_rate)
        constrained = spec.constrained_every > 0 and i % spec.constrained_every == 0
        out.append(PlannedRequest(i, prompt, n_out, t, constrained))
    return out


def total_tokens(requests: Sequence[PlannedRequest]) -> tuple[int, int]:
    """(prompt tokens, output tokens) the workload asks for."""
    return (sum(len(r.prompt_ids) for r in requests), sum(r.max_tokens for r in requests))
