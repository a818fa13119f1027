"""`eagerlm chat` driven through a pseudo-terminal, as a person would use it: turns
stream, the second turn reuses the first one's KV, Ctrl-C stops a reply without leaving,
/reset and /exit work."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time

import pytest

from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.cli.commands import main

STATS = re.compile(rb"\[turn (\d+): prompt (\d+) tokens, (\d+) reused from earlier turns; "
                   rb"reply (\d+) tokens.*?finish: ([a-zA-Z -]+)\]")
PROMPT = rb">>> "


class Terminal:
    """A child process on a pseudo-terminal: `send` types, `expect` reads until a
    pattern shows up (bounded by a timeout)."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            try:
                # Ctrl-C as a terminal's shell gives it: a suite started in the background
                # (`.ci/run &`, nohup) ignores SIGINT, and a child inherits that
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.buffer = b""

    def expect(self, pattern: re.Pattern[bytes] | bytes, timeout: float = 30.0) -> re.Match:
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.buffer)
            if match:
                self.buffer = self.buffer[match.end():]
                return match
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {regex.pattern!r}; got {self.buffer!r}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.1))
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"the terminal closed; got {self.buffer!r}")
                self.buffer += data

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.buffer += os.read(self.fd, 4096)
            except OSError:
                time.sleep(0.05)
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=4096)))


def chat(model_path: str, *flags: str) -> Terminal:
    return Terminal([sys.executable, "-m", "eagerlm", "chat", "--model", model_path,
                     "--temperature", "0", "--quiet", *flags])


def test_two_turns_the_second_reusing_the_first_ones_kv(model_path):
    term = chat(model_path, "--max-tokens", "12", "--ignore-eos")
    try:
        term.expect(PROMPT)
        term.send("tell me about the cat\n")
        first = term.expect(STATS)
        assert int(first[1]) == 1 and int(first[3]) == 0 and int(first[4]) == 12
        term.expect(PROMPT)
        term.send("and the mat?\n")
        second = term.expect(STATS)
        prompt1, reply1 = int(first[2]), int(first[4])
        assert int(second[1]) == 2
        # the whole first exchange is reused but the last reply token (never fed back)
        assert int(second[3]) == prompt1 + reply1 - 1
        assert int(second[2]) > int(second[3])
        term.expect(PROMPT)
        term.send("/reset\n")
        term.expect(b"[new conversation]")
        term.send("hi\n")
        assert int(term.expect(STATS)[1]) == 1
        term.expect(PROMPT)
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()


def test_ctrl_c_stops_the_reply_but_not_the_chat(model_path):
    term = chat(model_path, "--max-tokens", "4000", "--ignore-eos")
    try:
        term.expect(PROMPT)
        term.send("a very long answer please\n")
        term.expect(b"please\r\n")  # the echoed line
        term.expect(re.compile(rb"\S"))  # the reply has started
        term.send("\x03")  # Ctrl-C: SIGINT to the terminal's foreground process
        stats = term.expect(STATS)
        assert stats[5] == b"stopped by Ctrl-C"
        assert 0 < int(stats[4]) < 4000
        term.expect(PROMPT)
        term.send("\x04")  # Ctrl-D at the prompt leaves
        assert term.wait() == 0
    finally:
        term.close()


def test_a_device_without_a_backend_is_a_one_line_error(model_path, capsys):
    assert main(["chat", "--model", model_path, "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagerlm: error:") and "cuda" in err.lower()
    assert "Traceback" not in err
