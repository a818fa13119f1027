"""Finished sessions' KV regions kept for reuse, keyed by the tokens they hold.

A new session whose prompt starts with a cached sequence maps the whole-page part of the
common prefix from the cached region (shared physical pages) and copies the partial page,
so it prefills only the rest: a second chat turn, or a shared system prompt. Entries are
evicted least recently used first when the pool needs pages.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from eagerlm.vmm.device import Event
from eagerlm.vmm.kv_region import KVRegion


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]
    region: KVRegion
    # recorded after the last work that touched the region: the round that wrote it last,
    # or a later copy of its partial page into a session that shares its prefix
    event: Event | None
    # the draft model's part of the cache holds these tokens too (a session that
    # speculated with the draft model wrote it; dispatch/speculation.py)
    draft_kv: bool = False


class PrefixCache:
    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, tokens: list[int], region: KVRegion, event: Event | None,
            draft_kv: bool = False) -> None:
        """Keep `region` (holding the KV of `tokens`, the draft model's too with
        `draft_kv`); evicts the oldest beyond capacity."""
        self._entries[self._next] = CachedPrefix(tuple(tokens), region, event, draft_kv)
        self._next += 1
        while len(self._entries) > self.max_entries:
            self.evict_one()

    def longest(self, tokens: list[int],
                need_draft: bool = False) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that prefix's length
        (only among entries holding the draft model's KV too, with `need_draft`)."""
        best, best_n, best_key = None, 0, None
        for key, entry in self._entries.items():
            if need_draft and not entry.draft_kv:
                continue
            n = _common_prefix(entry.tokens, tokens)
            if n > best_n:
                best, best_n, best_key = entry, n, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best, best_n

    def evict_one(self) -> CachedPrefix | None:
        """Release the least recently used entry (its pages return once its event has
        completed) and return it; None when the cache is empty."""
        if not self._entries:
            return None
        _, entry = self._entries.popitem(last=False)
        entry.region.release(after=entry.event)
        return entry

    def clear(self) -> None:
        while self.evict_one() is not None:
            pass


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
