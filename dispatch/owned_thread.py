"""The dispatcher's threads: each owns its state and talks to the others through queues.

`OwnedThread` is what the service thread, the control thread and a tensor-parallel group's
follower threads have in common: a daemon thread running the subclass's `_run`, started,
joined and watched the same way (the dispatcher checks `alive` to tell a dead thread from a
slow one).
"""

from __future__ import annotations

import threading


class OwnedThread:
    """A daemon thread named `name` that runs `self._run` once started."""

    def __init__(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
