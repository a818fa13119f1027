"""Every error eagerlm raises on purpose derives from `EagerLMError`.

    EagerLMError
    ├── ModelFileError       the model file is malformed (names the path, field, offset)
    │   └── UnsupportedModel     well formed, but uses what this engine does not implement
    ├── ModelNotFound        no model file at the path given (a FileNotFoundError)
    ├── ContextTooLong       more context than the model or the KV pool can hold
    ├── InvalidParameters    a parameter or request out of range (a ValueError)
    ├── ModelTooLarge        the weights do not fit in memory (a MemoryError)
    ├── DeviceUnavailable    the device asked for cannot run here (no CUDA, no NVRTC...)
    ├── EngineClosed         the engine was shut down before the request came
    └── EngineFailure        the engine failed, not the user: a CUDA call, a kernel build

All but `EngineFailure` are the user's to fix: the command line prints them as one line
with exit status 2, and the HTTP server answers them with a 4xx (503 for a closed
engine). An `EngineFailure` is printed as one line with exit status 1, or a 500. Concrete
errors (`GGUFFormatError`, `PromptTooLong`, `InvalidSamplingParams`, `CudaError`...) are
defined where they are raised and subclass one of these.

This module imports nothing from eagerlm, so every layer can raise these.
"""

from __future__ import annotations

QUOTE_CHARS = 80


def quoted(text: str | bytes, limit: int = QUOTE_CHARS) -> str:
    """`text` as an error message quotes it: its repr, cut to `limit` characters with its
    full length said. Keys, names and strings come from the file, which may hold a
    200 MB one; the message must stay one short line whatever the file holds (and
    formatting the whole once cost gigabytes)."""
    if len(text) <= limit:
        return repr(text)
    unit = "bytes" if isinstance(text, bytes) else "characters"
    return f"{text[:limit]!r}... ({len(text)} {unit})"


class EagerLMError(Exception):
    """Base of every error eagerlm raises on purpose. `param`: the field of an OpenAI
    request at fault, where one is (the HTTP error names it)."""

    param: str | None = None


class ModelFileError(EagerLMError):
    """Base of every error about the contents of a model file."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None,
                 offset: int | None = None) -> None:
        self.path = path
        self.field = field
        self.offset = offset
        where = []
        if path:
            where.append(str(path))
        if field:
            where.append(f"field {quoted(field)}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class UnsupportedModel(ModelFileError):
    """The file is well formed but uses a feature this engine does not implement."""


class ModelNotFound(EagerLMError, FileNotFoundError):
    """There is no model file at the path given (or no demo model installed)."""


class ContextTooLong(EagerLMError, ValueError):
    """A context longer than the model (with its rope scaling) supports, or than the KV
    pool can hold, was asked for."""


class InvalidParameters(EagerLMError, ValueError):
    """A parameter, a setting or a request is invalid; nothing else is affected."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class ModelTooLarge(EagerLMError, MemoryError):
    """The model's weights, as the backend holds them, exceed the memory available."""


class DeviceUnavailable(EagerLMError, RuntimeError):
    """The device asked for cannot run a model here (no CUDA driver or GPU, no NVRTC)."""


class EngineClosed(EagerLMError, RuntimeError):
    """The engine was shut down: it takes no more requests."""


class EngineFailure(EagerLMError, RuntimeError):
    """The engine itself failed (a CUDA call, a kernel build, a request's generation):
    not the user's input, so exit status 1 or HTTP 500."""
