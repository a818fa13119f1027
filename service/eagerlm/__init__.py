"""eagerlm: a GGUF inference engine with a virtual-memory KV cache and eager autoregression.

The front door: everything a user of the Python API handles is importable from here.

    from eagerlm import Engine, SamplingParams
"""

from eagerlm.dispatch.messages import FinishReason
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.service.api.engine import (
    Chunk,
    Completion,
    Engine,
    EngineSettings,
    GenerationError,
    Logprob,
    Prompt,
    TokenLogprobs,
)
from eagerlm.service.api.sync_engine import SyncEngine

__all__ = [
    "Chunk",
    "Completion",
    "Engine",
    "EngineSettings",
    "FinishReason",
    "GenerationError",
    "Logprob",
    "Prompt",
    "SamplingParams",
    "SyncEngine",
    "TokenLogprobs",
]
