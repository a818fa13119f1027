"""Request fields that are accepted and ignored, because ignoring them cannot change the
output a client gets.

Clients written for OpenAI's API send fields that steer OpenAI's platform, not the model:
where a completion is stored (`store`, `metadata`), which capacity tier serves it
(`service_tier`), how OpenAI's own prompt cache is keyed (`prompt_cache_key`,
`prompt_cache_retention`), abuse tracking (`safety_identifier`, `user`), a guess at the reply
that only speeds OpenAI up (`prediction`: the reply is the same with or without it), and
vLLM's scheduling `priority`. Refusing them (a 400) breaks such clients for nothing, so they
are dropped, and each name is logged once per process, so an operator can see what clients
send without a log line per request.

`reasoning_effort` reaches the chat template, which may act on it; for a template that
never reads it, it changes nothing and is logged the same way (`log_once`).

Fields that would change the output (`audio`, `functions`, `web_search_options`,
`verbosity`, ...) are not here: they stay 400s naming the field
(service/http/openai_parsing.py).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("eagerlm.server")

IGNORED_FIELDS = frozenset({
    "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "prediction", "priority",
})

_logged: set[str] = set()
_lock = threading.Lock()


def is_ignored(field: str) -> bool:
    """True for a field to drop (and log the first time this process sees it)."""
    if field not in IGNORED_FIELDS:
        return False
    log_once(field, "it cannot change the output")
    return True


def log_once(field: str, why: str) -> None:
    """Say once per process that `field` is ignored, and why."""
    with _lock:
        first = field not in _logged
        _logged.add(field)
    if first:
        log.info("ignoring the request field %r: %s (logged once)", field, why)


__all__ = ["IGNORED_FIELDS", "is_ignored", "log_once"]
