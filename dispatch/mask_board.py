"""Where constrained sessions' token masks pass from the host to the sampler.

The mask for a session's token t+1 depends on token t, which the eager dispatcher does not
know when it launches the round that samples t+1 (shared/DESIGN.md, "One round, eagerly").
So the round is launched anyway, and the dependency is carried by this board:

- the service thread, as soon as a round's tokens land on the host, advances each
  constrained session's grammar with its token and posts the mask for the session's next
  sample (`post(session, generation index, mask)`); the first mask is posted when the
  request is submitted;
- the round that samples that token runs its forward without waiting and samples its
  unconstrained rows first; only then does it `take` its constrained rows' masks, waiting
  if the host is not done yet (dispatch/round_work.py).

In a steady eager decode the host advances the grammar (tens of microseconds) while the
next round's forward runs, so the mask is there before it is needed; the time a round did
wait is its `RoundTrace.mask_wait`. A session that finishes is `close`d: a round in flight
that still samples for it (its token will be discarded) takes no mask instead of waiting
for one that will never come. `shutdown` releases every wait.
"""

from __future__ import annotations

import threading
import time

import numpy as np


class MaskBoard:
    """Masks keyed by (session id, generation index), posted by the service thread and
    taken by the sampler. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._masks: dict[int, dict[int, np.ndarray]] = {}  # open sessions' posted masks
        self._shut = False

    def open(self, session_id: int) -> None:
        """Register a constrained session, before any round can sample for it."""
        with self._cond:
            self._masks[session_id] = {}

    def post(self, session_id: int, generation: int, mask: np.ndarray) -> None:
        """The mask for the session's `generation`-th sampled token (0: the first)."""
        with self._cond:
            masks = self._masks.get(session_id)
            if masks is not None:
                masks[generation] = mask
                self._cond.notify_all()

    def close(self, session_id: int) -> None:
        """The session has finished: drop its masks, release any wait for one."""
        with self._cond:
            if self._masks.pop(session_id, None) is not None:
                self._cond.notify_all()

    def shutdown(self) -> None:
        """Release every wait, now and later (the engine is stopping)."""
        with self._cond:
            self._shut = True
            self._masks.clear()
            self._cond.notify_all()

    def take(self, session_id: int, generation: int) -> tuple[np.ndarray | None, float]:
        """The mask for that sample, waiting until it is posted, and the seconds waited.
        None when the session is closed (or unknown): its token will be discarded, so any
        token will do."""
        with self._cond:
            masks = self._masks.get(session_id)
            if masks is not None and generation in masks:
                return masks.pop(generation), 0.0
            t0 = time.perf_counter()
            while True:
                masks = self._masks.get(session_id)
                if masks is None or self._shut:
                    return None, time.perf_counter() - t0
                mask = masks.pop(generation, None)
                if mask is not None:
                    return mask, time.perf_counter() - t0
                self._cond.wait()

    def open_sessions(self) -> int:
        with self._cond:
            return len(self._masks)


__all__ = ["MaskBoard"]
