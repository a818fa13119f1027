"""What the host decides about each generated token, in one place.

Both the sequential loop and the service thread feed a request's tokens, in order, to a
`TokenJudge`: it detokenizes incrementally, holds back text that may start a stop string,
and says when the request is finished and why (an end token, a stop string, its grammar
complete, max tokens or the context). A constrained request's grammar is advanced here, by
each token as it is accepted, so the next mask is ready as soon as the token is judged.
Keeping this logic once is what makes "the dispatcher's output equals the request run
alone" a statement about scheduling, not about two copies of these rules.
"""

from __future__ import annotations

import numpy as np

from eagerlm.dispatch.grammar import GrammarMatcher
from eagerlm.dispatch.harmony import HarmonyGate
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.reasoning import ReasoningBlock, ReasoningGate
from eagerlm.dispatch.stop_strings import StopMatcher
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.detokenizer import IncrementalDetokenizer
from eagerlm.loader.tokenizer import Tokenizer


class TokenJudge:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_new: int,
                 grammar: GrammarMatcher | None = None) -> None:
        self.max_new = max_new
        self.grammar = grammar
        self.error: str | None = None  # why it finished with `error`
        self.error_param: str | None = None  # the request field at fault, if it was
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopMatcher(params.stop)
        # stop strings match in the answer only, after a reasoning block (dispatch/reasoning.py,
        # a harmony reply's analysis: dispatch/harmony.py)
        self.gate: ReasoningGate | HarmonyGate | None = None
        if params.reasoning_block and params.stop:
            self.gate = HarmonyGate() if params.reasoning_block == ReasoningBlock.HARMONY \
                else ReasoningGate(params.reasoning_block == ReasoningBlock.OPEN)
        self.end_ids = frozenset() if params.ignore_eos else tokenizer.end_ids
        # a grammar allows an end token where it may end; ignore_eos takes that away
        self._banned = sorted(tokenizer.end_ids) if params.ignore_eos else []
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
        if self.grammar is not None and not self.grammar.accept(token):
            if self.grammar.over_limits:  # the constraint's doing (dispatch/grammar.py)
                failure = self.grammar.failure()
                self.error, self.error_param = str(failure), failure.param
            else:  # the mask allowed it, so this is a bug, not the user's mistake
                self.error = (f"token {token} breaks the request's grammar: "
                              f"{self.grammar.error}")
            return "", FinishReason.ERROR
        text = self._release(self.detok.push(token))
        if self.stops.stopped:
            return text, FinishReason.STOP
        if self.grammar is not None and self.grammar.finished:
            return text + self._release_all(), FinishReason.STOP
        if len(self.generated) >= self.max_new:
            text += self._release_all()
            return text, FinishReason.STOP if self.stops.stopped else FinishReason.LENGTH
        return text, None

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    def next_mask(self) -> np.ndarray:
        """The allowed-token mask of the next token (a constrained request); with
        ignore_eos, end tokens are not allowed unless nothing else is. Raises
        `ConstraintFailed` for a grammar whose step went beyond the parser limits."""
        assert self.grammar is not None
        mask = self.grammar.mask()
        if self._banned:
            kept = mask.copy()
            words = kept.view(np.uint32)
            for t in self._banned:
                words[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))
            if kept.any():
                mask = kept
        return mask
