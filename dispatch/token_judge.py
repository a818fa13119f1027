"""What the host decides about each generated token, in one place.

Both the sequential loop and the service thread feed a request's tokens, in order, to a
`TokenJudge`: it detokenizes incrementally, holds back text that may start a stop string,
and says when the request is finished and why (an end token, a stop string, max tokens or
the context). Keeping this logic once is what makes "the dispatcher's output equals the
request run alone" a statement about scheduling, not about two copies of these rules.
"""

from __future__ import annotations

from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.stop_strings import StopMatcher
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.detokenizer import IncrementalDetokenizer
from eagerlm.loader.tokenizer import Tokenizer


class TokenJudge:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_new: int) -> None:
        self.max_new = max_new
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopMatcher(params.stop)
        self.end_ids = frozenset() if params.ignore_eos else tokenizer.end_ids
        self.generated: list[int] = []

    def accept(self, token: int) -> tuple[str, FinishReason | None]:
        """The text this token releases, and the finish reason if it ends the request."""
        self.generated.append(token)
        if token in self.end_ids:  # the end token itself is never shown
            return self.stops.push(self.detok.flush()) + self.stops.flush(), FinishReason.STOP
        text = self.stops.push(self.detok.push(token))
        if self.stops.stopped:
            return text, FinishReason.STOP
        if len(self.generated) >= self.max_new:
            text += self.stops.push(self.detok.flush()) + self.stops.flush()
            return text, FinishReason.STOP if self.stops.stopped else FinishReason.LENGTH
        return text, None
