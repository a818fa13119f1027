"""gpt-oss's replies in OpenAI's harmony format, split into reasoning, answer and tool calls.

A harmony reply is a run of messages, each a header, `<|message|>`, a body and `<|end|>`
(the last ends the generation with `<|return|>` or `<|call|>`, end tokens the text does
not show), the ones after the first opened by `<|start|>assistant` (the prompt opened the
first). The header names the message's channel and, for a tool call, its recipient:

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}
    <|channel|>final<|message|>It is sunny.

As llama.cpp's gpt-oss parser reads them (common/chat-parsers/gpt-oss.cpp): `analysis`
bodies are the reasoning (`reasoning_content`), `final` bodies and `commentary` bodies
without a recipient (preambles) are the answer (`content`), and a message to a recipient
(`to=functions.NAME`, in the channel's header or the role's) is a tool call whose body is
its arguments. A header may carry a stray `<|channel|>commentary` before the real one,
which gpt-oss-20b writes at times.

`HarmonyStream` splits a streamed reply chunk by chunk into (reasoning, answer) deltas, as
`ReasoningStream` (dispatch/reasoning.py) splits `<think>` blocks; a tool call goes into
the answer written as `call_text(recipient, arguments)`, one marked block that the
server's tool-call parser (service/api/tool_calls.py, format `harmony`) takes out of the
answer, or leaves as text when it is not a call of the request's tools, as it leaves any
malformed call. Text that does not follow the format (a model that writes plain text) is
the answer as it is.

`HarmonyGate` is the dispatcher's side (dispatch/token_judge.py), as `ReasoningGate` is
for `<think>`: the raw reply cut, unchanged, into the analysis messages it opens with and
everything after, so stop strings are matched after the reasoning only. Here, beside
reasoning.py, because the dispatcher needs it and imports nothing above itself.
"""

from __future__ import annotations

import re

from eagerlm.dispatch.reasoning import Split

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
CALL = "<|call|>"
MAX_HEADER = 512  # characters: a longer "header" is not one, and shows as text

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_HEADER_STARTS = (CHANNEL, START, " to=", "to=", "<|constrain|>")


def call_text(recipient: str, arguments: str) -> str:
    """A tool call as it is left in the answer for the tool-call parser."""
    return f"{CHANNEL}commentary to={recipient}{MESSAGE}{arguments}{CALL}"


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class HarmonyStream:
    """Splits one streamed harmony reply: `push(text)` gives (reasoning, answer) deltas,
    `finish()` what was held back."""

    def __init__(self) -> None:
        self._state = "header"  # header | reasoning | answer | call | text
        self._held = ""
        self.reasoned = False

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, answer = "", ""
        while self._held:
            if self._state == "text":  # not harmony: everything is the answer
                answer += self._held
                self._held = ""
                break
            if self._state == "header":
                entered, shown = self._header()
                answer += shown
                if not entered:
                    break
                continue
            held = self._held
            end = held.find(END)
            stop = end if end >= 0 else len(held) - _partial_suffix(held, (END,))
            body, self._held = held[:stop], held[stop:]
            if self._state == "reasoning":
                reasoning += body
            else:
                answer += body
            if end < 0:
                break
            self._held = self._held[len(END):]
            if self._state == "call":
                answer += CALL
            self._state = "header"
        return reasoning, answer

    def _header(self) -> tuple[bool, str]:
        """Read the next message's header if it is all here: (whether a message was
        entered, answer text it shows: a call's marked header, see `call_text`)."""
        held = self._held
        lead = held.lstrip()
        if not lead:
            return False, ""
        if not any(lead.startswith(s) or s.startswith(lead) for s in _HEADER_STARTS):
            self._state = "text"
            return True, ""
        at = held.find(MESSAGE)
        if at < 0:
            if len(held) > MAX_HEADER:
                self._state = "text"
                return True, ""
            return False, ""
        header, self._held = held[:at], held[at + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        channels = _CHANNEL_NAME.findall(header)
        if recipient is not None and recipient.group(1) != "assistant":
            self._state = "call"
            return True, f"{CHANNEL}commentary to={recipient.group(1)}{MESSAGE}"
        if channels and channels[-1] == "analysis":
            self._state, self.reasoned = "reasoning", True
        else:  # final, or a commentary preamble
            self._state = "answer"
        return True, ""

    def finish(self) -> tuple[str, str]:
        """The end of the reply: text held back is what it was; a call cut at the end of
        the generation (its `<|call|>` is an end token the text does not show) is closed."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "call":
            return "", held + CALL
        return "", held


class HarmonyGate:
    """Raw reply text in, (reasoning, answer) out, neither changed: the analysis messages
    the reply opens with (headers, bodies and ends) are reasoning, everything after the
    header of its first other message is the answer."""

    def __init__(self) -> None:
        self._state = "header"  # header | analysis | answer
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        if self._state == "answer":
            return "", text
        self._held += text
        reasoning = ""
        while True:
            held = self._held
            if self._state == "analysis":
                end = held.find(END)
                if end < 0:
                    keep = _partial_suffix(held, (END,))
                    self._held = held[len(held) - keep:]
                    return reasoning + held[:len(held) - keep], ""
                reasoning += held[:end + len(END)]
                self._held, self._state = held[end + len(END):], "header"
                continue
            lead = held.lstrip()
            at = held.find(MESSAGE)
            harmony = any(lead.startswith(s) or s.startswith(lead) for s in _HEADER_STARTS)
            if not lead or (harmony and at < 0 and len(held) <= MAX_HEADER):
                return reasoning, ""  # a header on its way
            if harmony and at >= 0:
                header = held[:at + len(MESSAGE)]
                channels = _CHANNEL_NAME.findall(header)
                if channels and channels[-1] == "analysis" and not _RECIPIENT.search(header):
                    reasoning += header
                    self._held, self._state = held[len(header):], "analysis"
                    continue
                reasoning, held = reasoning + header, held[len(header):]
            self._held, self._state = "", "answer"
            return reasoning, held

    def flush(self) -> tuple[str, str]:
        """The end of the reply: what was held back, as what it was part of."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "analysis" else ("", held)


def split_harmony(text: str) -> Split:
    """A whole reply split as `HarmonyStream` splits it streamed."""
    stream = HarmonyStream()
    r1, a1 = stream.push(text)
    r2, a2 = stream.finish()
    return Split(r1 + r2 if stream.reasoned else None, a1 + a2)
