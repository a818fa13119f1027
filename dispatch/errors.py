"""Errors a request can end with before or instead of generating."""

from __future__ import annotations


class RequestError(ValueError):
    """The request itself is invalid; other requests are unaffected."""


class PromptTooLong(RequestError):
    def __init__(self, n_prompt: int, context: int) -> None:
        super().__init__(f"prompt has {n_prompt} tokens but the context holds {context} "
                         f"(at least one must remain for the reply)")
        self.n_prompt = n_prompt
        self.context = context


class EmptyPrompt(RequestError):
    def __init__(self) -> None:
        super().__init__("prompt is empty (no tokens after tokenization)")
