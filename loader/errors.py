"""Typed errors raised while reading a model file.

Every error names the file and, where it applies, the field and byte offset, so a user
with a broken download or an unsupported model knows what is wrong without a traceback
from deep inside numpy.
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


class ModelFileError(Exception):
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


class GGUFFormatError(ModelFileError):
    """The bytes are not a well-formed GGUF file (bad magic, truncation, absurd shapes...)."""


class UnsupportedTensorType(ModelFileError):
    """A tensor uses a ggml type this engine cannot dequantize."""


class UnknownArchitecture(ModelFileError):
    """`general.architecture` names a model family this engine does not implement."""


class MissingKey(ModelFileError):
    """A metadata key or tensor the architecture requires is absent."""


class InvalidMetadata(ModelFileError):
    """A metadata value has the wrong type for its key, or a value no real model has
    (zero heads, four billion layers, a NaN rope base)."""
