"""Token ids of recent chat turns, so the next turn's prompt reuses their KV exactly.

The dispatcher reuses KV through its prefix cache: a new prompt that starts with the tokens
of a finished session (prompt + reply) prefills only the rest. A chat client sends the
whole conversation as text each turn, and re-tokenizing the model's reply rarely gives
back the ids it generated (a BPE model may sample "ab" + "c" where the tokenizer says
"abc"), so the common prefix would end where the previous reply began.

`TurnMemory` remembers, for each recent turn, the rendered text of prompt + reply and the
ids behind it. A new conversation whose rendered text starts with a remembered text gets
those ids followed by the encoded rest. The rest is used only when it starts at a special
token (the end-of-turn marker every chat template puts after a reply), where splitting the
text cannot change how either side tokenizes; otherwise the whole text is encoded and the
prefix cache still reuses what matches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from eagerlm.loader.tokenizer import Tokenizer

DEFAULT_MAX_TURNS = 256  # EngineSettings.chat_turns_remembered


class TurnMemory:
    def __init__(self, tokenizer: Tokenizer, max_turns: int = DEFAULT_MAX_TURNS) -> None:
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self._turns: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()  # encode runs on worker threads
        self.hits = 0

    def __len__(self) -> int:
        return len(self._turns)

    def encode(self, text: str) -> list[int]:
        """The ids of the rendered conversation `text`, reusing a remembered turn's ids."""
        tok = self.tokenizer
        with self._lock:
            best = max((k for k in self._turns if text.startswith(k)), key=len, default=None)
            ids = self._turns[best] if best is not None else None
            if best is not None:
                self._turns.move_to_end(best)
        if best is not None and ids is not None and len(text) > len(best):
            rest = tok.encode(text[len(best):], add_special=False)
            if rest and tok.is_special(rest[0]):
                with self._lock:
                    self.hits += 1
                return [*ids, *rest]
        return tok.encode(text)

    def remember(self, prompt_text: str, prompt_ids: Sequence[int], reply_text: str,
                 reply_ids: Sequence[int]) -> None:
        """Record a finished turn: the rendered prompt, the reply as shown, and their ids.

        A final end-of-turn token is left out (the template writes its own after the
        reply). A reply whose ids do not decode to its text (cut by a stop string, or a
        cancelled reply that lost held-back bytes) is not remembered.
        """
        tok = self.tokenizer
        ids = list(reply_ids)
        if ids and ids[-1] in tok.end_ids:
            ids.pop()
        if tok.decode(ids) != reply_text:
            return
        with self._lock:
            self._turns[prompt_text + reply_text] = (*prompt_ids, *ids)
            self._turns.move_to_end(prompt_text + reply_text)
            while len(self._turns) > self.max_turns:
                self._turns.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._turns.clear()
