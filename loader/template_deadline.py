"""The time limit of a chat-template render: `run_bounded(fn, seconds)` raises
`TemplateLimitError` in the rendering thread once the deadline passes.

Chat templates arrive inside downloaded model files, so a template is untrusted code that
runs on the caller's thread (the CLI's main thread, a server worker thread). One watchdog
thread interrupts a render whose time is up with `PyThreadState_SetAsyncExc`, which raises
at the rendering thread's next bytecode boundary. Why this rather than the alternatives: a
deadline checked inside the template's loops misses recursion through macros and loops
inside filters; a render in another thread or process that is abandoned leaks the thread
(and a server's concurrency slot) or costs a process per request; SIGALRM works on the
main thread only. The async exception reaches every pure-Python loop of Jinja; what it
cannot interrupt is one long C call, which is why C calls are kept small
(loader/template_budget.py). The exception is a `BaseException` so no `except Exception`
in Jinja or a filter swallows it, and `run_bounded` clears it if it is still pending when
the render ends, so it can never surface in the caller's code afterwards (CPython only).
"""

from __future__ import annotations

import ctypes
import heapq
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from eagerlm.loader.template_budget import TemplateLimitError, fresh_budget

T = TypeVar("T")

# Real templates render in milliseconds; a few seconds is a runaway loop.
RENDER_TIME_LIMIT_S = 5.0


class _Alarm(BaseException):
    """Raised asynchronously in a render whose time is up (see the module docstring)."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Schedule `exc` in thread `thread_id` (None clears a scheduled one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


class _Watch:
    __slots__ = ("deadline", "done", "fired", "thread_id")

    def __init__(self, deadline: float, thread_id: int) -> None:
        self.deadline, self.thread_id = deadline, thread_id
        self.done = self.fired = False

    def __lt__(self, other: _Watch) -> bool:
        return self.deadline < other.deadline


class _Watchdog:
    """One daemon thread sleeping until the earliest deadline of the renders in progress.
    `done` and `fired` change only under the lock, so a render that ends just as its time
    is up is either interrupted (and `disarm` clears a pending alarm) or left alone."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._watches: list[_Watch] = []
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Watch:
        watch = _Watch(time.monotonic() + seconds, threading.get_ident())
        with self._wake:
            if self._thread is None or not self._thread.is_alive():  # first use, or forked
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="chat-template-watchdog")
                self._thread.start()
            heapq.heappush(self._watches, watch)
            if self._watches[0] is watch:
                self._wake.notify()
        return watch

    def disarm(self, watch: _Watch) -> None:
        with self._wake:
            watch.done = True
            fired = watch.fired
        if fired:
            _raise_in(watch.thread_id, None)  # delivered already, or cleared here

    def _run(self) -> None:
        with self._wake:
            while True:
                now = time.monotonic()
                while self._watches and (self._watches[0].done
                                         or self._watches[0].deadline <= now):
                    watch = heapq.heappop(self._watches)
                    if not watch.done:
                        watch.fired = True
                        _raise_in(watch.thread_id, _Alarm)
                self._wake.wait(self._watches[0].deadline - now if self._watches else None)


_WATCHDOG = _Watchdog()


def run_bounded(fn: Callable[[], T], time_limit_s: float) -> T:
    """`fn()` with a fresh build budget (loader/template_budget.py), raising
    TemplateLimitError after `time_limit_s`.

    Whatever happens, no alarm is pending and no budget is installed when this returns.
    """
    with fresh_budget():  # left after the watch is disarmed, when no alarm can come
        watch = _WATCHDOG.arm(time_limit_s)
        try:
            try:
                return fn()
            finally:
                _WATCHDOG.disarm(watch)
        except _Alarm:
            raise TemplateLimitError(f"chat template rendering exceeded the "
                                     f"{time_limit_s:g} s time limit") from None


__all__ = ["RENDER_TIME_LIMIT_S", "run_bounded"]
