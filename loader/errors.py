"""Typed errors raised while reading a model file: kinds of `ModelFileError`, whose base
and `UnsupportedModel` live in eagerlm.errors with every other category of error.

Every error names the file and, where it applies, the field and byte offset, so a user
with a broken download or an unsupported model knows what is wrong without a traceback
from deep inside numpy.
"""

from __future__ import annotations

from eagerlm.errors import QUOTE_CHARS, ModelFileError, UnsupportedModel, quoted

__all__ = ["QUOTE_CHARS", "GGUFFormatError", "InvalidMetadata", "MissingKey", "ModelFileError",
           "UnknownArchitecture", "UnsupportedModel", "UnsupportedTensorType", "quoted"]


class GGUFFormatError(ModelFileError):
    """The bytes are not a well-formed GGUF file (bad magic, truncation, absurd shapes...)."""


class UnsupportedTensorType(UnsupportedModel):
    """A tensor uses a ggml type this engine cannot dequantize."""


class UnknownArchitecture(UnsupportedModel):
    """`general.architecture` names a model family this engine does not implement."""


class MissingKey(ModelFileError):
    """A metadata key or tensor the architecture requires is absent."""


class InvalidMetadata(ModelFileError):
    """A metadata value has the wrong type for its key, or a value no real model has
    (zero heads, four billion layers, a NaN rope base)."""
