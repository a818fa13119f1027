"""A reasoning model's thinking, split out of its reply.

Models such as Qwen3 and the DeepSeek-R1 distills think first, in a `<think>...</think>`
block, then answer. Clients written for them (as for vLLM and llama-server) expect the
thinking in `reasoning_content` and only the answer in `content`; tool calls and stop
strings are about the answer too.

The format is llama-server's `--reasoning-format`: `deepseek` splits `<think>` blocks,
`none` leaves the text whole, `auto` (the default) is `deepseek` for a chat template that
writes `<think>` (Qwen3's, the R1 distills') and `none` otherwise. A harmony template
(gpt-oss: it writes `<|channel|>`) makes any format but `none` `harmony`, whose replies
dispatch/harmony.py splits, as llama.cpp's gpt-oss parser does whatever the format. A
reply is in reasoning when it opens with `<think>` (after whitespace) or when the prompt
already opened the block (the R1 distills' templates end the generation prompt with
`<think>\\n`); the reasoning runs to `</think>`, and a reply cut before it is all
reasoning, as llama.cpp treats it. The whitespace between `</think>` and the answer is
dropped (Qwen3 writes two newlines there).

`ReasoningStream` splits a streamed reply chunk by chunk, holding back only text that may
be the start of a tag; `split_reasoning` is the same machine run over a whole text, so a
streamed reply joins to exactly what a non-streamed one returns. `ReasoningGate` is the
dispatcher's side (dispatch/token_judge.py): it tells the raw reasoning text from the raw
answer without changing either, so stop strings are matched in the answer only (a stop
string the model happens to think about does not end its reply).

Here, not in the server, because the dispatcher's stop logic needs it and imports nothing
above itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from eagerlm.loader.chat_template import ChatTemplate

OPEN, CLOSE = "<think>", "</think>"


HARMONY_CHANNEL = "<|channel|>"  # what a harmony (gpt-oss) chat template writes


class ReasoningFormat(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    DEEPSEEK = "deepseek"
    HARMONY = "harmony"  # not a --reasoning-format choice: what a harmony template makes

    def resolve(self, template: ChatTemplate) -> ReasoningFormat:
        """AUTO made concrete for a model's chat template; a harmony template's replies are
        split as harmony unless splitting is off."""
        if self is ReasoningFormat.NONE:
            return self
        if HARMONY_CHANNEL in template.source:
            return ReasoningFormat.HARMONY
        if self is not ReasoningFormat.AUTO:
            return self
        return ReasoningFormat.DEEPSEEK if OPEN in template.source else ReasoningFormat.NONE


def prompt_opens_reasoning(prompt_text: str | None) -> bool:
    """True when the rendered prompt ends inside a `<think>` block the template opened."""
    if not prompt_text:
        return False
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the reply did not reason
    content: str


class ReasoningStream:
    """Splits one streamed reply: `push(text)` gives (reasoning, content) deltas, `finish()`
    what was held back."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = "reasoning" if in_reasoning else "start"
        self._held = ""
        self._strip_content = False  # drop whitespace that opens the answer
        self.reasoned = in_reasoning

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        while True:
            held = self._held
            if self._state == "start":
                lead = held.lstrip()
                if lead.startswith(OPEN):
                    self._state, self._held, self.reasoned = "reasoning", lead[len(OPEN):], True
                    continue
                if OPEN.startswith(lead):  # maybe the tag, not all here yet
                    return reasoning, content
                self._state = "content"
                continue
            if self._state == "reasoning":
                end = held.find(CLOSE)
                if end >= 0:
                    reasoning += held[:end]
                    self._held = held[end + len(CLOSE):]
                    self._state, self._strip_content = "content", True
                    continue
                keep = _partial_suffix(held, CLOSE)
                reasoning += held[:len(held) - keep]
                self._held = held[len(held) - keep:]
                return reasoning, content
            if self._strip_content:
                held = held.lstrip()
                if not held:
                    self._held = ""
                    return reasoning, content
                self._strip_content = False
            content += held
            self._held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: text held back as a possible tag is what it was."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "content" and self._strip_content:
            return "", held.lstrip()
        return "", held


class ReasoningBlock:
    """`SamplingParams.reasoning_block`'s values: whether a reply may hold a `<think>`
    block that stop strings skip."""

    NONE = ""  # plain text: stop strings match everywhere
    MAY_OPEN = "may_open"  # the reply may open with `<think>`
    OPEN = "open"  # the prompt opened the block: the reply starts in it
    HARMONY = "harmony"  # a harmony reply: the answer is its final channel (dispatch/harmony.py)


class ReasoningGate:
    """Raw reply text in, (reasoning, answer) out, neither changed: the reasoning part ends
    with `</think>`. Only a possible `<think>` at the very start is held back, until it is
    known to be one or not. (A harmony reply's: dispatch/harmony.py's `HarmonyGate`.)"""

    def __init__(self, opened: bool) -> None:
        self._state = "reasoning" if opened else "start"
        self._held = ""
        self._tail = ""  # the last characters of reasoning, for a `</think>` split in two

    def push(self, text: str) -> tuple[str, str]:
        if self._state == "content":
            return "", text
        if self._state == "start":
            text, self._held = self._held + text, ""
            lead = text.lstrip()
            if lead.startswith(OPEN):
                self._state = "reasoning"
            elif OPEN.startswith(lead):
                self._held = text
                return "", ""
            else:
                self._state = "content"
                return "", text
        buf = self._tail + text
        end = buf.find(CLOSE)
        if end >= 0:
            cut = end + len(CLOSE) - len(self._tail)
            self._state = "content"
            return text[:cut], text[cut:]
        self._tail = buf[-(len(CLOSE) - 1):]
        return text, ""

    def flush(self) -> tuple[str, str]:
        """The end of the reply: a held start was not a block."""
        held, self._held = self._held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, in_reasoning: bool = False) -> Split:
    """A whole reply split as `ReasoningStream` splits it streamed."""
    stream = ReasoningStream(in_reasoning)
    r1, c1 = stream.push(text)
    r2, c2 = stream.finish()
    return Split(r1 + r2 if stream.reasoned else None, c1 + c2)


__all__ = ["ReasoningBlock", "ReasoningFormat", "ReasoningGate", "ReasoningStream", "Split",
           "prompt_opens_reasoning", "split_reasoning"]
