"""Whether the engine behind the server can still serve, and what the server does when it
cannot.

An engine whose control or service thread has died answers every request with an error,
forever; a process in that state should not look healthy to a load balancer or stay up for
an orchestrator to find by hand. So `/health` answers 503 once `Engine.failure` says why
it cannot serve, and `EngineWatchdog` polls the same and stops the server, which then
exits non-zero (`EngineDied`, an `EngineFailure`: exit status 1 in the CLI) so that a
supervisor (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from eagerlm.errors import EngineFailure

log = logging.getLogger("eagerlm.server")

WATCH_INTERVAL_S = 0.5


class EngineDied(EngineFailure):
    """The engine stopped serving while the server ran."""


class EngineWatchdog:
    """A daemon thread calling `on_failure(reason)` once `failure()` returns a reason."""

    def __init__(self, failure: Callable[[], str | None], on_failure: Callable[[str], None],
                 interval_s: float = WATCH_INTERVAL_S) -> None:
        self._failure = failure
        self._on_failure = on_failure
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="eagerlm-watchdog",
                                        daemon=True)

    def start(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the server is ending for another reason)."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            reason = self._failure()
            if reason is not None:
                self.reason = reason
                log.error("the engine cannot serve any more (%s): stopping the server",
                          reason)
                self._on_failure(reason)
                return


__all__ = ["EngineDied", "EngineWatchdog"]
