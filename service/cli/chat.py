"""The interactive `eagerlm chat`: a conversation in the terminal.

Each turn sends the whole conversation through the model's chat template; the engine
reuses the KV of earlier turns (service/chat_tokens.py), so a turn prefills only the new
message. After each reply a dim line on stderr says how many prompt tokens were reused.

Ctrl-C while the model is answering stops the reply (the request is cancelled, what was
printed stays in the conversation) and returns to the prompt; at the prompt it only clears
the line. /exit, /quit or Ctrl-D leave; /reset starts a new conversation.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from eagerlm.dispatch.errors import RequestError
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.service.api.records import Chunk
from eagerlm.service.api.streams import GenerationError
from eagerlm.service.api.sync_engine import SyncEngine

HELP = "/reset starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"


@dataclass
class Conversation:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reply_tokens: int = 0
    first_token_s: float = 0.0
    total_s: float = 0.0
    finish: str = "-"

    def line(self, turn: int) -> str:
        decode_s = self.total_s - self.first_token_s
        rate = (self.reply_tokens - 1) / decode_s if self.reply_tokens > 1 and decode_s else 0.0
        return (f"[turn {turn}: prompt {self.prompt_tokens} tokens, {self.cached_tokens} "
                f"reused from earlier turns; reply {self.reply_tokens} tokens, first after "
                f"{self.first_token_s * 1000:.0f} ms, {rate:.1f} tokens/s; "
                f"finish: {self.finish}]")


class ChatLoop:
    def __init__(self, engine: SyncEngine, params: SamplingParams, system: str | None = None,
                 *, read: Callable[[str], str] = input, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr) -> None:
        self.engine = engine
        self.params = params
        self.conversation = Conversation(system)
        self.read = read
        self.out = out
        self.err = err
        self.turn = 0

    def run(self) -> int:
        self._note(f"chatting with {self.engine.name} ({HELP})")
        while True:
            try:
                line = self.read(">>> ")
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit", "/bye"):
                return 0
            if text == "/reset":
                self.conversation.reset()
                self.turn = 0
                self._note("[new conversation]")
                continue
            if text.startswith("/"):
                self._note(f"unknown command {text.split()[0]}: {HELP}")
                continue
            self._reply_to(line)

    def _reply_to(self, user_text: str) -> None:
        conv = self.conversation
        conv.add("user", user_text)
        stats, parts = TurnStats(), []
        t0 = time.perf_counter()
        try:
            with self.engine.chat(conv.messages, self.params) as stream:
                for chunk in stream:
                    self._count(stats, chunk, t0)
                    parts.append(chunk.text)
                    self.out.write(chunk.text)
                    self.out.flush()
        except KeyboardInterrupt:  # the stream cancelled its request on the way out
            stats.finish = "stopped by Ctrl-C"
        except (RequestError, GenerationError) as e:
            conv.messages.pop()
            hint = " (/reset starts a new conversation)" if "context" in str(e) else ""
            self._note(f"\nerror: {e}{hint}")
            return
        stats.total_s = time.perf_counter() - t0
        self.out.write("\n")
        self.out.flush()
        conv.add("assistant", "".join(parts))
        self.turn += 1
        self._note(stats.line(self.turn))

    @staticmethod
    def _count(stats: TurnStats, chunk: Chunk, t0: float) -> None:
        if chunk.token_ids and not stats.reply_tokens:
            stats.first_token_s = time.perf_counter() - t0
        stats.reply_tokens += len(chunk.token_ids)
        stats.prompt_tokens = chunk.prompt_tokens
        stats.cached_tokens = chunk.cached_tokens
        if chunk.finish_reason is not None:
            stats.finish = chunk.finish_reason.value

    def _note(self, text: str) -> None:
        """A status line on stderr, dim on a terminal."""
        if self.err.isatty():
            text = f"\x1b[2m{text}\x1b[0m"
        print(text, file=self.err, flush=True)
