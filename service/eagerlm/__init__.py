"""eagerlm: a GGUF inference engine with a virtual-memory KV cache and eager autoregression.

The front door: everything a user of the Python API handles is importable from here.

    from eagerlm import Engine, SamplingParams

Every error eagerlm raises on purpose is an `EagerLMError` (eagerlm.errors): the user's
mistakes are one of its categories (`ModelFileError`, `InvalidParameters`,
`ContextTooLong`...), the engine's own failures an `EngineFailure` (`GenerationError`).
"""

from eagerlm.dispatch.messages import FinishReason
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
from eagerlm.kernels.sampling import Constraint, SamplingParams
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.engine_settings import EngineSettings
from eagerlm.service.api.records import Chunk, Completion, Logprob, Prompt, TokenLogprobs
from eagerlm.service.api.streams import GenerationError
from eagerlm.service.api.sync_engine import SyncEngine

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
