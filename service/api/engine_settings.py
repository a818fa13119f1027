"""`EngineSettings`: how an engine is set up (every setting of `Engine.open` / `Engine.load`
but the model path and the device), with each default taken from the layer that owns it."""

from __future__ import annotations

from dataclasses import dataclass

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import DispatcherConfig
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.errors import InvalidParameters
from eagerlm.loader.config import RopeOverride
from eagerlm.service.api.chat_tokens import DEFAULT_MAX_TURNS
from eagerlm.service.api.model_loading import WEIGHTS_CHOICES


@dataclass(frozen=True)
class EngineSettings:
    """How an engine is set up. The defaults suit one user on one machine; each is the
    default of the layer that owns the setting (DispatcherConfig, ControlConfig,
    SchedulerConfig, TurnMemory), so the engine and a bare dispatcher agree."""

    # context length in tokens (--ctx); default the model's trained context. Beyond it
    # only as far as the rope scaling supports (ModelConfig.context_for)
    max_context: int | None = DispatcherConfig.max_context
    # the user's rope scaling in place of the file's (loader/config.py RopeOverride):
    # "none", "linear" or "yarn", the factor, YaRN's original context; None keeps the file's
    rope_scaling: str | None = None
    rope_scale: float | None = None
    yarn_orig_ctx: int | None = None
    # cpu KV pool; None: fits the context (kv_capacity)
    kv_budget_bytes: int | None = DispatcherConfig.kv_budget_bytes
    # of memory left after weights: cuda pool, cpu cap
    memory_fraction: float = DispatcherConfig.memory_fraction
    page_size: int | None = None  # KV page bytes (cpu; default 2 MiB)
    max_batch: int = SchedulerConfig.max_batch  # sessions per round
    max_round_tokens: int = SchedulerConfig.max_round_tokens  # prefill + decode tokens per round
    lookahead: int = ControlConfig.lookahead  # rounds launched ahead of the service thread
    # keep finished sessions' KV for prompts that share a prefix
    prefix_cache: bool = ControlConfig.prefix_cache
    # replay decode rounds as CUDA graphs (cuda; off: run eagerly)
    cuda_graphs: bool = ControlConfig.cuda_graphs
    chat_turns_remembered: int = DEFAULT_MAX_TURNS  # see service/api/chat_tokens.py
    model_name: str | None = None  # the name clients use; default: the file's stem
    # how the backend holds the matrices: "quantized" (the file's blocks, read by the
    # kernels), "float" (cpu: float32) or "bf16" (cuda); None: quantized
    weights: str | None = None
    # speculative decoding for requests that do not choose (dispatch/speculation.py):
    # "ngram" (prompt lookup), "draft" (needs draft_model) or "off"; drafts per round
    speculative: str = SpeculationConfig.method
    num_speculative_tokens: int = SpeculationConfig.num_tokens
    draft_model: str | None = None  # a GGUF with the same vocabulary (--draft-model)
    # devices the model is split over (-tp; docs/tensor_parallel.md): cpu devices, each
    # a share of the cores, or GPUs from the device's ordinal on; 1: one device
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        self.rope_override()  # bad values fail here, before anything is loaded
        if self.weights is not None and self.weights not in WEIGHTS_CHOICES:
            raise InvalidParameters(f"weights must be 'quantized' or 'float' (cpu), "
                                    f"'quantized' or 'bf16' (cuda), not {self.weights!r}")
        self.speculation()  # likewise
        if isinstance(self.tensor_parallel, bool) or not isinstance(
                self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise InvalidParameters(f"tensor_parallel must be a positive integer, not "
                                    f"{self.tensor_parallel!r}", param="tensor_parallel")
        if self.tensor_parallel > 1 and (self.speculative == "draft"
                                         or self.draft_model is not None):
            raise InvalidParameters("speculative decoding with a draft model is not "
                                    "supported yet with tensor_parallel > 1 (prompt "
                                    "lookup, 'ngram', is)", param="speculative")
        if self.speculative == "draft" and self.draft_model is None:
            raise InvalidParameters("speculative 'draft' needs a draft model "
                                    "(--draft-model PATH)", param="draft_model")

    def speculation(self) -> SpeculationConfig:
        return SpeculationConfig(self.speculative, self.num_speculative_tokens)

    def rope_override(self) -> RopeOverride | None:
        """The rope scaling settings as the loader takes them (None: the file's)."""
        return RopeOverride.from_settings(self.rope_scaling, self.rope_scale,
                                          self.yarn_orig_ctx)

    def dispatcher_config(self) -> DispatcherConfig:
        control = ControlConfig(SchedulerConfig(max_batch=self.max_batch,
                                                max_round_tokens=self.max_round_tokens),
                                lookahead=self.lookahead, prefix_cache=self.prefix_cache,
                                cuda_graphs=self.cuda_graphs, speculation=self.speculation())
        return DispatcherConfig(control=control, kv_budget_bytes=self.kv_budget_bytes,
                                memory_fraction=self.memory_fraction,
                                max_context=self.max_context)


__all__ = ["EngineSettings"]
