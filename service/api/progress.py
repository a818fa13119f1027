"""The two ways a model load is shown: a bar on a terminal (the CLI) and log lines (the
async API, the server). Both are `ProgressCallback`s of `load_model`, which reports the
weights' bytes the same way for every backend.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from eagerlm.service.api.model_loading import LoadProgress

log = logging.getLogger("eagerlm")


class ProgressBar:
    """Weights loaded, with their size and rate, on one line of `stream`; then the load time.

    On a terminal the line is redrawn in place when its percentage changes, at most ten
    times a second; elsewhere (a log, a pipe) it is written once, when the weights are all
    loaded, so no control characters reach the file."""

    WIDTH = 30

    def __init__(self, stream: TextIO | None = None, label: str = "weights") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.tty = self.stream.isatty()
        self._t0: float | None = None
        self._drawn_at = 0.0
        self._percent = -1
        self._done = False

    def __call__(self, p: LoadProgress) -> None:
        if p.stage == "weights":
            self.update(p.done, p.total)
        elif p.stage == "compile":
            self.stream.write("compiling cpu kernels (first use, cached)... " if p.seconds is None
                              else f"{p.seconds:.1f} s\n")
            self.stream.flush()
        elif p.stage == "ready":
            self.stream.write(f"loaded in {p.elapsed_s:.1f} s\n")
            self.stream.flush()

    def update(self, done: int, total: int) -> None:
        """Draw `done` of `total` bytes; the line ends when `done` reaches `total`."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        if self._done:
            return
        fraction = min(1.0, done / total) if total > 0 else 1.0
        percent = int(fraction * 100)
        final = fraction >= 1.0
        if not final and (not self.tty or percent == self._percent
                          or now - self._drawn_at < 0.1):
            return
        self._percent, self._drawn_at, self._done = percent, now, final
        unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
        rate = done / (now - self._t0) / scale if now > self._t0 else 0.0
        filled = int(fraction * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        start, end = ("\r" if self.tty else ""), ("\n" if final else "")
        self.stream.write(f"{start}{self.label} [{bar}] {percent:3d}% "
                          f"{done / scale:.2f}/{total / scale:.2f} {unit} {rate:.2f} {unit}/s{end}")
        self.stream.flush()


def log_progress(p: LoadProgress) -> None:
    """The load on the "eagerlm" logger: the weights' size once loaded, then the time."""
    if p.stage == "ready":
        log.info("model loaded in %.1f s", p.elapsed_s)
    elif p.stage == "compile" and p.seconds is not None:
        log.info("compiling cpu kernels (first use, cached): %.1f s", p.seconds)
    elif p.stage == "weights" and p.done == p.total:
        log.info("weights: %.1f MiB", p.total / 2**20)
