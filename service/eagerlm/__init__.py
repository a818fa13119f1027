"""eagerlm: a GGUF inference engine with a virtual-memory KV cache and eager autoregression.

The front door: everything a user of the Python API handles is importable from here.

    from eagerlm import Engine, SamplingParams

Every error eagerlm raises on purpose is an `EagerLMError` (eagerlm.errors): the user's
mistakes are one of its categories (`ModelFileError`, `InvalidParameters`,
`ContextTooLong`...), the engine's own failures an `EngineFailure` (`GenerationError`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from eagerlm.errors import (
    ContextTooLong,
    DeviceUnavailable,
    EagerLMError,
    EngineClosed,
    EngineFailure,
    InvalidParameters,
    ModelFileError,
    ModelNotFound,
    ModelTooLarge,
    UnsupportedModel,
)

if TYPE_CHECKING:
    from eagerlm.dispatch.messages import FinishReason
    from eagerlm.kernels.sampling import Constraint, SamplingParams
    from eagerlm.service.api.engine import Engine
    from eagerlm.service.api.engine_settings import EngineSettings
    from eagerlm.service.api.records import Chunk, Completion, Logprob, Prompt, TokenLogprobs
    from eagerlm.service.api.streams import GenerationError
    from eagerlm.service.api.sync_engine import SyncEngine

# Each name's module, imported on first use (PEP 562): `python -m eagerlm.kernels.cpu_compile`,
# the first-use compile's helper process, then starts without the engine, the server's
# modules or their imports (0.6 s of its start-up, kernels/cpu_compile.py).
_MODULES = {
    "FinishReason": "eagerlm.dispatch.messages",
    "Constraint": "eagerlm.kernels.sampling",
    "SamplingParams": "eagerlm.kernels.sampling",
    "Engine": "eagerlm.service.api.engine",
    "EngineSettings": "eagerlm.service.api.engine_settings",
    "Chunk": "eagerlm.service.api.records",
    "Completion": "eagerlm.service.api.records",
    "Logprob": "eagerlm.service.api.records",
    "Prompt": "eagerlm.service.api.records",
    "TokenLogprobs": "eagerlm.service.api.records",
    "GenerationError": "eagerlm.service.api.streams",
    "SyncEngine": "eagerlm.service.api.sync_engine",
}

__all__ = [
    "Chunk",
    "Completion",
    "Constraint",
    "ContextTooLong",
    "DeviceUnavailable",
    "EagerLMError",
    "Engine",
    "EngineClosed",
    "EngineFailure",
    "EngineSettings",
    "FinishReason",
    "GenerationError",
    "InvalidParameters",
    "Logprob",
    "ModelFileError",
    "ModelNotFound",
    "ModelTooLarge",
    "Prompt",
    "SamplingParams",
    "SyncEngine",
    "TokenLogprobs",
    "UnsupportedModel",
]


def __getattr__(name: str) -> object:
    if name not in _MODULES:
        raise AttributeError(f"module 'eagerlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
