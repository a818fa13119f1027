"""Stop strings found across token boundaries, without ever showing the stop string.

Text is released only once it can no longer be the beginning of a stop string, so a stop
string split over several tokens is caught and none of it reaches the user.

The server's tool-call parsing (service/tool_calls.py) uses the same matcher with the
marker that opens a call as its one "stop string": content is released up to the marker,
and `cut_off` hands over the text from the marker on.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.cut_off = ""  # once stopped: the stop string and what came after it in its push

    def push(self, text: str) -> str:
        """Feed newly decoded text; return what is safe to show. After a stop string is
        found, `stopped` is set and everything from the stop string on is dropped."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            return buf
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            self.cut_off = buf[cut:]
            return buf[:cut]
        keep = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, when generation ends for another reason."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
