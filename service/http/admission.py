"""The server's concurrency limit: a fixed number of requests generate at once, a bounded
number wait their turn in arrival order, and the rest are refused at once (HTTP 429).

Refusing early is the point: an overloaded server that queues without bound answers
everyone late, while a 429 lets a client back off or go elsewhere. The gate lives on the
event loop (no locks); a ticket is released exactly once whatever happens to its request
(finished, failed, cancelled while waiting, client gone).
"""

from __future__ import annotations

from collections import deque

import anyio

from eagerlm.errors import InvalidParameters


class QueueFull(Exception):
    """Every slot is taken and the waiting queue is full."""


class AdmissionGate:
    def __init__(self, max_active: int, max_queued: int) -> None:
        if max_active < 1 or max_queued < 0:
            raise InvalidParameters("max_active must be >= 1 and max_queued >= 0")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self._waiting: deque[Ticket] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def enter(self) -> Ticket:
        """A ticket holding a slot, or waiting for one; QueueFull when there is no room."""
        ticket = Ticket(self)
        if self.active < self.max_active and not self._waiting:
            self.active += 1
            ticket.admitted = True
        elif len(self._waiting) >= self.max_queued:
            raise QueueFull(f"{self.active} requests running and {len(self._waiting)} "
                            f"waiting; try again later")
        else:
            ticket._event = anyio.Event()
            self._waiting.append(ticket)
        return ticket

    def _pass_on(self) -> None:
        """A slot came free: give it to the longest-waiting ticket, or count it free."""
        if self._waiting:
            ticket = self._waiting.popleft()
            ticket.admitted = True
            assert ticket._event is not None
            ticket._event.set()
        else:
            self.active -= 1


class Ticket:
    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate
        self.admitted = False
        self.released = False
        self._event: anyio.Event | None = None

    async def wait(self) -> None:
        """Until this ticket holds a slot. If the wait is cancelled the ticket is released
        (and a slot handed over meanwhile passes on)."""
        if self.admitted:
            return
        assert self._event is not None
        try:
            await self._event.wait()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give the slot back, or leave the queue (idempotent)."""
        if self.released:
            return
        self.released = True
        if self.admitted:
            self._gate._pass_on()
        else:
            self._gate._waiting.remove(self)
