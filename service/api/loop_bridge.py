"""Calling into an event loop from the dispatcher's service thread, under asyncio or trio.

The dispatcher hands a request's outputs to a sink on its service thread. That thread must
never wait for an event loop (one busy loop would then stall every request of the engine),
so the hop to the loop is fire-and-forget: asyncio's `call_soon_threadsafe` or trio's
`TrioToken.run_sync_soon`. anyio's `from_thread.run_sync` would block the service thread
until the loop ran the callback, which is exactly what must not happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class LoopWaker:
    """Schedules callbacks on the event loop running where it was created, from any
    thread, in order, without blocking. Create it inside the loop."""

    def __init__(self) -> None:
        try:
            self._schedule: Callable[..., Any] = asyncio.get_running_loop().call_soon_threadsafe
        except RuntimeError:  # not asyncio: trio is the other loop anyio runs on
            import trio

            self._schedule = trio.lowlevel.current_trio_token().run_sync_soon

    def call_soon(self, fn: Callable[..., object], *args: object) -> bool:
        """Run `fn(*args)` on the loop soon; False when the loop has already ended."""
        try:
            self._schedule(fn, *args)
        except RuntimeError:  # asyncio: loop closed; trio: RunFinishedError
            return False
        return True
