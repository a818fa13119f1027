"""What the host decides about each generated token, in one place.

Both the sequential loop and the service thread feed a request's tokens, in order, to a
`TokenJudge`: it detokenizes incrementally, holds back text that may start a stop string,
and says when the request is finished and why (an end token, a stop string, max tokens or
the context). Keeping this logic once is what makes "the dispatcher's output equals the
request run alone" a statement about scheduling, not about two copies of these rules.
"""

from __future__ import annotations

from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.reasoning import ReasoningBlock, ReasoningGate
from eagerlm.dispatch.stop_strings import StopMatcher
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.detokenizer import IncrementalDetokenizer
from eagerlm.loader.tokenizer import Tokenizer


class TokenJudge:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_new: int) -> None:
        self.max_new = max_new
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(params.stop)
        # stop strings match in the answer only, after a reasoning block (dispatch/reasoning.py)
        self.gate = (ReasoningGate(params.reasoning_block == ReasoningBlock.OPEN)
                     if params.reasoning_block and params.stop else None)
        self.end_ids = frozenset() if params.ignore_eos else tokenizer.end_ids
        self.generated: list[int] = []

    def _release(self, text: str) -> str:
        if self.gate is None:
            return self.stops.push(text)
        reasoning, answer = self.gate.push(text)
        return reasoning + self.stops.push(answer)

    def _release_all(self) -> str:
        text = self._release(self.detok.flush())
        if self.gate is not None:
            text += self.stops.push(self.gate.flush()[1])
        return text + self.stops.flush()

    def accept(self, token: int) -> tuple[str, FinishReason | None]:
        """The text this token releases, and the finish reason if it ends the request."""
        self.generated.append(token)
        if token in self.end_ids:  # the end token itself is never shown
            return self._release_all(), FinishReason.STOP
        text = self._release(self.detok.push(token))
        if self.stops.stopped:
            return text, FinishReason.STOP
        if len(self.generated) >= self.max_new:
            text += self._release_all()
            return text, FinishReason.STOP if self.stops.stopped else FinishReason.LENGTH
        return text, None
