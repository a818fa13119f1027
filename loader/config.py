"""Model hyper-parameters per architecture, read from GGUF metadata.

One frozen dataclass holds everything the forward needs, so the forward never looks at
metadata keys or architecture names: a difference between families (rope style, QK-norm,
post-norms, embedding scale, sliding-window layers...) is a field here. The defaults and
derivations follow llama.cpp's `llama-model.cpp` hparams loading for each family.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from loader.errors import ModelFileError, UnknownArchitecture
from loader.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


class RopeStyle(enum.Enum):
    """How rotary embedding pairs the dimensions of a head.

    NORM rotates adjacent pairs (x[2i], x[2i+1]) - llama.cpp's LLAMA_ROPE_TYPE_NORM, used by
    `llama` (whose converter permutes Q/K so this matches HF's rotate-half). NEOX rotates
    x[i] with x[i + d/2] - used by qwen2, qwen3 and gemma3.
    """

    NORM = "norm"
    NEOX = "neox"


class Activation(enum.Enum):
    """Gated FFN activation: down(act(gate(x)) * up(x))."""

    SWIGLU = "swiglu"  # silu
    GEGLU = "geglu"  # gelu, tanh approximation


class UnsupportedModel(ModelFileError):
    """The file is well formed but uses a feature this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_style: RopeStyle
    rope_dim: int  # leading dims of each head that are rotated
    rope_base: float
    rope_scale: float  # position multiplier (1 / linear scaling factor)
    activation: Activation
    attention_scale: float  # multiplies Q before QK^T
    # per-layer: window size in tokens (0 = full causal attention)
    sliding_window: tuple[int, ...]
    rope_base_swa: float = 10000.0  # rope base of sliding-window layers
    rope_scale_swa: float = 1.0
    embedding_scale: float = 1.0  # multiplies embedding rows after lookup
    qk_norm: bool = False  # RMSNorm over each head of Q and K before rope
    qkv_bias: bool = False
    post_norms: bool = False  # gemma-style norms on attention / FFN outputs
    tied_embeddings: bool = False  # lm head is token_embd^T
    final_logit_softcap: float = 0.0  # 0 = off
    rope_freq_factors: bool = False  # llama3-style per-frequency divisors (rope_freqs.weight)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModel(f"{self.n_heads} query heads are not a multiple of "
                                   f"{self.n_kv_heads} KV heads")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise UnsupportedModel(f"rope dimension {self.rope_dim} does not fit head dim "
                                   f"{self.head_dim}")
        if len(self.sliding_window) != self.n_layers:
            raise ValueError("sliding_window needs one entry per layer")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_swa(self, layer: int) -> bool:
        return self.sliding_window[layer] > 0

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(base, position scale) of the rotary embedding of one layer."""
        if self.is_swa(layer):
            return self.rope_base_swa, self.rope_scale_swa
        return self.rope_base, self.rope_scale


def swa_pattern(n_layers: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's `set_swa_pattern(period)`: every `period`-th layer (the last of each group)
    is global, the others use the sliding window."""
    if period <= 0:
        return (False,) * n_layers
    return tuple(il % period < period - 1 for il in range(n_layers))


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """Build the config of the model in `f`, raising a typed error for what is unsupported."""
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnknownArchitecture(
            f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            path=f.path, field="general.architecture")

    def key(name: str) -> Any:
        return f.require(f"{arch}.{name}")

    def opt(name: str, default: Any) -> Any:
        return f.get(f"{arch}.{name}", default)

    n_layers = int(key("block_count"))
    d_model = int(key("embedding_length"))
    n_heads = _per_layer_constant(f, arch, "attention.head_count", key("attention.head_count"))
    n_kv_heads = _per_layer_constant(f, arch, "attention.head_count_kv",
                                     opt("attention.head_count_kv", n_heads))
    head_dim = int(opt("attention.key_length", d_model // n_heads))
    if int(opt("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel("key and value head dimensions differ", path=f.path,
                               field=f"{arch}.attention.value_length")
    d_ff = _per_layer_constant(f, arch, "feed_forward_length", key("feed_forward_length"))
    embd = f.tensor_info("token_embd.weight")
    vocab_size = embd.shape[0]
    if embd.shape[1] != d_model:
        raise ModelFileError(f"token_embd.weight has shape {embd.shape}, expected "
                             f"(vocab, {d_model})", path=f.path, field="token_embd.weight")

    rope_scale = 1.0
    scaling = str(opt("rope.scaling.type", "none"))
    factor = float(opt("rope.scaling.factor", opt("rope.scale_linear", 0.0)) or 0.0)
    if scaling in ("linear", "none") or factor in (0.0, 1.0):
        rope_scale = 1.0 / factor if factor else 1.0
    else:
        raise UnsupportedModel(f"rope scaling {scaling!r} is not supported", path=f.path,
                               field=f"{arch}.rope.scaling.type")

    common: dict[str, Any] = dict(
        architecture=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        vocab_size=vocab_size,
        context_length=int(key("context_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_dim=int(opt("rope.dimension_count", head_dim)),
        rope_base=float(opt("rope.freq_base", 10000.0)),
        rope_scale=rope_scale,
        tied_embeddings="output.weight" not in f.tensors,
        final_logit_softcap=float(opt("final_logit_softcapping", 0.0)),
    )
    if float(opt("attn_logit_softcapping", 0.0)):
        raise UnsupportedModel("attention logit soft-capping is not supported", path=f.path)

    if arch == "llama":
        return ModelConfig(
            **common, rope_style=RopeStyle.NORM, activation=Activation.SWIGLU,
            attention_scale=1.0 / math.sqrt(head_dim), sliding_window=(0,) * n_layers,
            rope_freq_factors="rope_freqs.weight" in f.tensors)
    if arch in ("qwen2", "qwen3"):
        return ModelConfig(
            **common, rope_style=RopeStyle.NEOX, activation=Activation.SWIGLU,
            attention_scale=1.0 / math.sqrt(head_dim), sliding_window=(0,) * n_layers,
            qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2")
    # gemma3
    window = int(key("attention.sliding_window"))
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, np.ndarray | list):
        swa = tuple(bool(x) for x in pattern)
        if len(swa) != n_layers:
            raise ModelFileError("sliding_window_pattern has one entry per layer", path=f.path,
                                 field=f"{arch}.attention.sliding_window_pattern")
    else:
        swa = swa_pattern(n_layers, int(pattern))
    # llama.cpp: the 27B (62 layers) scales by d_model / n_heads, the others by the head dim
    scale_dim = d_model // n_heads if n_layers == 62 else head_dim
    return ModelConfig(
        **common, rope_style=RopeStyle.NEOX, activation=Activation.GEGLU,
        attention_scale=1.0 / math.sqrt(scale_dim),
        sliding_window=tuple(window if s else 0 for s in swa),
        rope_base_swa=float(opt("rope.freq_base_swa", 10000.0)), rope_scale_swa=1.0,
        embedding_scale=math.sqrt(d_model), qk_norm=True, post_norms=True)


def _per_layer_constant(f: GGUFFile, arch: str, name: str, value: Any) -> int:
    """Some converters store per-layer arrays; this engine needs them uniform."""
    if isinstance(value, np.ndarray | list):
        values = {int(v) for v in value}
        if len(values) != 1:
            raise UnsupportedModel(f"per-layer varying {name} is not supported", path=f.path,
                                   field=f"{arch}.{name}")
        return values.pop()
    return int(value)
