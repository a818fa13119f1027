"""The responses the Responses API keeps (`store`, the default), for `previous_response_id`
and `GET /v1/responses/{id}`: in memory, bounded in count and in bytes, the oldest evicted
first. A server restart forgets them all; an evicted or never-stored id is a 404.

Each entry is the response body as the client got it and the conversation it ended (the
conversation before it, in the chat template's form, then its own output as an assistant
turn), which a follow-up request continues. Its size is counted as the JSON text of both,
so one huge conversation cannot hold more than `max_bytes`; one larger than that alone is
not kept (the client still gets its response).

Used from the server's event loop only (no locking).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # up to and including this response's output
    size: int  # bytes, as counted against the store's budget


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep a response under its id; False when it alone is over the byte budget."""
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        if size > self.max_bytes or self.max_count < 1:
            return False
        self.delete(body["id"])
        self._entries[body["id"]] = StoredResponse(body, conversation, size)
        self.bytes += size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True


__all__ = ["ResponseStore", "StoredResponse"]
