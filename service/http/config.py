"""How the HTTP server is set up; its own module so the command line reads the defaults
without importing FastAPI."""

from __future__ import annotations

from dataclasses import dataclass

from eagerlm.errors import InvalidParameters


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20
    max_concurrency: int = 64  # requests generating at once
    max_queue: int = 256  # requests waiting for a slot before 429
    # on SIGTERM/SIGINT, how long requests in flight may take to finish before they are
    # ended (service/http/shutdown.py); under Kubernetes' default 30 s termination grace
    shutdown_grace_s: float = 10.0
    # `<think>` blocks split into reasoning_content: auto | none | deepseek
    # (service/api/reasoning.py)
    reasoning_format: str = "auto"
    # a comment on a stream idle this long, so proxies keep it open (0: never)
    sse_keepalive_s: float = 15.0
    # serve /v1/embeddings for any model (mean pooling unless the file says otherwise);
    # embedding GGUFs (a pooling type in the file) are served without it
    embeddings: bool = False
    # responses the Responses API keeps for previous_response_id and GET, at most this
    # many and this many bytes of JSON (the oldest evicted: service/http/response_store.py)
    responses_stored: int = 1024
    responses_store_bytes: int = 64 << 20
    # the chat page at / (service/http/webui.py); `eagerlm serve --no-webui` turns it off
    webui: bool = True

    def __post_init__(self) -> None:
        if self.reasoning_format not in ("auto", "none", "deepseek"):
            raise InvalidParameters(f"the reasoning format must be auto, none or deepseek, "
                                    f"not {self.reasoning_format!r}")
        if not self.shutdown_grace_s >= 0:
            raise InvalidParameters(f"the shutdown grace period must be 0 seconds or more, "
                                    f"not {self.shutdown_grace_s}")
