"""Errors a request can end with before or instead of generating: kinds of
`InvalidParameters` (eagerlm.errors). A request to an engine shut down gets `EngineClosed`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from eagerlm.errors import InvalidParameters

if TYPE_CHECKING:
    from eagerlm.kernels.sampling import SamplingParams


class RequestError(InvalidParameters):
    """The request itself is invalid; other requests are unaffected. `param`: the field of
    an OpenAI request at fault, where one is (the HTTP error names it)."""


class PromptTooLong(RequestError):
    def __init__(self, n_prompt: int, context: int) -> None:
        super().__init__(f"prompt has {n_prompt} tokens but the context holds {context} "
                         f"(at least one must remain for the reply)")
        self.n_prompt = n_prompt
        self.context = context


class EmptyPrompt(RequestError):
    def __init__(self) -> None:
        super().__init__("prompt is empty (no tokens after tokenization)")


class TokenOutOfVocabulary(RequestError):
    """A token id (in the prompt, or named by the logit bias) the model does not have."""

    def __init__(self, where: str, token: int, vocab: int, param: str) -> None:
        super().__init__(f"{where} names token {token}, but the vocabulary has {vocab} "
                         f"tokens (ids 0 to {vocab - 1})")
        self.token = token
        self.vocab = vocab
        self.param = param

    @classmethod
    def check(cls, prompt_ids: Sequence[int], vocab: int, params: SamplingParams,
              logits_width: int) -> None:
        """Raise for the first id of the prompt outside [0, vocab), or a logit bias naming
        a token past the model's logits."""
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise cls("the prompt", bad, vocab, param="prompt")
        if params.logit_bias and params.logit_bias[-1][0] >= logits_width:
            raise cls("logit_bias", params.logit_bias[-1][0], logits_width,
                      param="logit_bias")
