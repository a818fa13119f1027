"""The model families eagerlm runs, as one registry, and reading a model's config from GGUF.

An architecture is its `general.architecture` name, the tensor names it spells its own way,
and the few config fields its family sets (rope style, QK-norm, biases, sliding-window
layers, the mixture of experts...); everything every family shares is read once, in
`config_from_gguf`. Each entry follows llama.cpp's loading of that family
(src/models/<family>.cpp's `load_arch_hparams` and graph, llama-model.cpp's common
hparams), so a file means here what it means there. Adding a family is one function
and one `Architecture` row; the tensors it implies follow from the config
(loader/weights.py's `tensor_plan`), the forward from the config's fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eagerlm.errors import UnsupportedModel
from eagerlm.loader.config import (
    Activation,
    ExpertGating,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    RopeScalingType,
    RopeStyle,
)
from eagerlm.loader.errors import (
    InvalidMetadata,
    MissingKey,
    ModelFileError,
    UnknownArchitecture,
    quoted,
)
from eagerlm.loader.gguf_file import GGUFFile
from eagerlm.loader.metadata_schema import check_metadata


@dataclass(frozen=True)
class Keys:
    """A model's metadata under its architecture's prefix and the names of its tensors, as
    a family reads them: a file's (`config_from_gguf`), or what the synthetic writer is
    about to write (loader/synthetic.py), so both derive the config the same way."""

    metadata: Mapping[str, Any]
    tensors: Container[str]
    arch: str
    path: str = ""

    def require(self, name: str) -> Any:
        key = f"{self.arch}.{name}"
        if key not in self.metadata:
            raise MissingKey(f"required metadata key {quoted(key)} is missing",
                             path=self.path, field=key)
        return self.metadata[key]

    def get(self, name: str, default: Any) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.metadata

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def per_layer(self, name: str, value: Any) -> int:
        """A per-layer key this engine needs uniform (some converters store arrays)."""
        if isinstance(value, np.ndarray | list):
            values = {int(v) for v in value}
            if len(values) != 1:
                raise UnsupportedModel(f"per-layer varying {name} is not supported",
                                       path=self.path, field=f"{self.arch}.{name}")
            return values.pop()
        return int(value)

    def fail(self, message: str, name: str) -> ModelFileError:
        return ModelFileError(message, path=self.path, field=f"{self.arch}.{name}")

    def sliding_window(self) -> int:
        """`attention.sliding_window` of an architecture whose local layers slide: the
        schema lets 0 through (phi-4 files write 0 for "none"), but a sliding layer with
        a window of 0 would attend to nothing."""
        window = int(self.require("attention.sliding_window"))
        if window < 1:
            raise InvalidMetadata(f"{window} is out of range: this architecture's sliding "
                                  "layers need a window of at least 1",
                                  path=self.path, field=f"{self.arch}.attention.sliding_window")
        return window


Family = Callable[[Keys, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    """One family: its name in `general.architecture`, the config fields it sets
    (`fields(keys, common)`, `common` being what every family reads), and the tensors it
    names its own way (`tensor_names`: our name for the role -> the file's, without
    `blk.N.` and `.weight`). `experts_only`: every layer is a mixture of experts, so the
    file need not give a dense feed-forward width."""

    name: str
    fields: Family
    tensor_names: Mapping[str, str] = field(default_factory=dict)
    experts_only: bool = False

    def tensor(self, role: str) -> str:
        return self.tensor_names.get(role, role)


def swa_pattern(n_layers: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's `set_swa_pattern(period)`: every `period`-th layer (the last of each group)
    is global, the others use the sliding window."""
    if period <= 0:
        return (False,) * n_layers
    return tuple(il % period < period - 1 for il in range(n_layers))


def _swa_layers(k: Keys, n_layers: int, default_period: int) -> tuple[bool, ...]:
    """llama.cpp's `load_swa_pattern`: `attention.sliding_window_pattern` as a per-layer
    bool array (true: sliding window), or a period, or the family's default period."""
    pattern = k.get("attention.sliding_window_pattern", default_period)
    if isinstance(pattern, np.ndarray | list):
        swa = tuple(bool(x) for x in pattern)
        if len(swa) != n_layers:
            raise k.fail("sliding_window_pattern has one entry per layer",
                         "attention.sliding_window_pattern")
        return swa
    return swa_pattern(n_layers, int(pattern))


def _moe(k: Keys, common: Mapping[str, Any], *, gating: ExpertGating, normalize: bool,
         width: int | None = None, biases: bool = False) -> MoEConfig:
    """The mixture of experts of a file with `expert_count` experts: `expert_used_count`
    per token, each `expert_feed_forward_length` wide (or `width`: llama's experts are
    `feed_forward_length` wide; qwen3moe falls back to feed_forward_length / used, as
    llama.cpp does), with the family's gating and normalization."""
    n_experts = int(k.require("expert_count"))
    n_used = k.per_layer("expert_used_count", k.require("expert_used_count"))
    if width is None:
        if k.has("expert_feed_forward_length"):
            width = k.per_layer("expert_feed_forward_length",
                                k.require("expert_feed_forward_length"))
        elif common["d_ff"]:
            width = common["d_ff"] // n_used
        else:
            raise k.fail("no expert_feed_forward_length gives the experts' width",
                         "expert_feed_forward_length")
    shared = int(k.get("expert_shared_feed_forward_length", 0))
    if n_used > n_experts or n_used < 1:
        raise k.fail(f"{n_used} experts used per token of {n_experts}", "expert_used_count")
    return MoEConfig(n_experts=n_experts, n_used=n_used, d_ff=width, gating=gating,
                     normalize=normalize, scale=float(k.get("expert_weights_scale", 0.0)) or 1.0,
                     d_ff_shared=shared, biases=biases)


def _llama(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama (and Mistral's files, and Mixtral's: experts when `expert_count` is set, each
    feed_forward_length wide, softmax routing with the chosen weights normalized)."""
    head_dim = common["head_dim"]
    if common["rope_dim"] != head_dim:  # llama.cpp: "invalid n_rot"
        raise UnsupportedModel(f"rope dimension {common['rope_dim']} differs from the head "
                               f"dimension {head_dim}", path=k.path,
                               field=f"{k.arch}.rope.dimension_count")
    moe = None
    if int(k.get("expert_count", 0)):
        moe = _moe(k, common, gating=ExpertGating.SOFTMAX, normalize=True,
                   width=common["d_ff"])
    return dict(rope_style=RopeStyle.NORM, activation=Activation.SWIGLU,
                attention_scale=_attention_scale(k, head_dim),
                rope_freq_factors=k.has_tensor("rope_freqs.weight"),
                long_rope_factors=k.has_tensor("rope_factors_long.weight"), moe=moe)


def _attention_scale(k: Keys, head_dim: int) -> float:
    """llama's `attention.scale` where the file sets one (Granite-style), else
    1/sqrt(head_dim)."""
    return float(k.get("attention.scale", 0.0)) or 1.0 / math.sqrt(head_dim)


def _qwen2(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    return dict(rope_style=RopeStyle.NEOX, activation=Activation.SWIGLU,
                attention_scale=1.0 / math.sqrt(common["head_dim"]), qkv_bias=True)


def _qwen3(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    return dict(rope_style=RopeStyle.NEOX, activation=Activation.SWIGLU,
                attention_scale=1.0 / math.sqrt(common["head_dim"]), qk_norm=True)


def _qwen3moe(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    """qwen3's attention with a mixture of experts in every layer: softmax routing, the
    chosen weights always normalized (llama.cpp's qwen3moe graph passes norm_w = true
    whatever the file's norm_topk_prob)."""
    return dict(_qwen3(k, common),
                moe=_moe(k, common, gating=ExpertGating.SOFTMAX, normalize=True))


def _gemma3(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    n_layers, head_dim = common["n_layers"], common["head_dim"]
    window = k.sliding_window()
    swa = _swa_layers(k, n_layers, 6)
    # llama.cpp: the 27B (62 layers) scales by d_model / n_heads, the others by the head dim
    scale_dim = common["d_model"] // common["n_heads"] if n_layers == 62 else head_dim
    return dict(rope_style=RopeStyle.NEOX, activation=Activation.GEGLU,
                attention_scale=1.0 / math.sqrt(scale_dim),
                sliding_window=tuple(window if s else 0 for s in swa),
                rope_base_swa=float(k.get("rope.freq_base_swa", 10000.0)), rope_scale_swa=1.0,
                embedding_scale=math.sqrt(common["d_model"]), qk_norm=True, post_norms=True)


def _gpt_oss(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's gpt-oss (llama.cpp's openai-moe): biased Q/K/V and output projections,
    attention sinks, a sliding window on every other layer (period 2: even layers slide)
    whose rope is the file's own (YaRN included, base `rope.freq_base_swa` if set),
    experts with biases behind a top-k-then-softmax router, the clamped SwiGLU, and the
    FFN's pre-norm stored as `post_attention_norm`."""
    n_layers = common["n_layers"]
    window = k.sliding_window()
    swa = _swa_layers(k, n_layers, 2)
    scaling: RopeScaling = common["rope_scaling"]
    return dict(rope_style=RopeStyle.NEOX, activation=Activation.SWIGLU_OAI,
                attention_scale=1.0 / math.sqrt(common["head_dim"]),
                sliding_window=tuple(window if s else 0 for s in swa),
                rope_base_swa=float(k.get("rope.freq_base_swa", common["rope_base"])),
                rope_scale_swa=scaling.freq_scale, qkv_bias=True, attn_output_bias=True,
                attn_sinks=True,
                moe=_moe(k, common, gating=ExpertGating.SOFTMAX_WEIGHT, normalize=False,
                         biases=True))


def _phi3(k: Keys, common: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3 and Phi-4 (phi3): Q, K and V fused in attn_qkv (or apart), gate and up fused
    in ffn_up, partial rotary dims, LongRoPE's short and long factors where the file has
    them. llama.cpp disables Phi's sliding window (the converters write it wrongly), so
    every layer attends to the whole context here too."""
    return dict(rope_style=RopeStyle.NEOX, activation=Activation.SWIGLU,
                attention_scale=1.0 / math.sqrt(common["head_dim"]),
                long_rope_factors=k.has_tensor("rope_factors_long.weight"),
                fused_qkv=k.has_tensor("blk.0.attn_qkv.weight"), fused_gate_up=True)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", _llama),
    Architecture("qwen2", _qwen2),
    Architecture("qwen3", _qwen3),
    Architecture("qwen3moe", _qwen3moe, experts_only=True),
    Architecture("gemma3", _gemma3),
    Architecture("gpt-oss", _gpt_oss, {"ffn_norm": "post_attention_norm"}, experts_only=True),
    Architecture("phi3", _phi3),
)}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture(name: str) -> Architecture:
    """The registry entry of `name` (KeyError for an unknown one: files are checked by
    `config_from_gguf` first)."""
    return ARCHITECTURES[name]


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """Build the config of the model in `f`, raising a typed error for what is unsupported.

    Every value read here has been checked for its type and range (metadata_schema), so
    what is left to check is how the values fit together."""
    check_metadata(f)
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise UnknownArchitecture(
            f"unknown architecture {quoted(arch)}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}", path=f.path, field="general.architecture")
    k = Keys(f.metadata, f.tensors, arch, f.path)
    d_model = int(k.require("embedding_length"))
    embd = f.tensor_info("token_embd.weight")
    if embd.shape[1] != d_model:
        raise ModelFileError(f"token_embd.weight has shape {embd.shape}, expected "
                             f"(vocab, {d_model})", path=f.path, field="token_embd.weight")
    return config_from_keys(k, vocab_size=embd.shape[0])


def config_from_keys(k: Keys, vocab_size: int) -> ModelConfig:
    """The config of a model of `k.arch` with this metadata and these tensors."""
    arch, path = k.arch, k.path
    family = ARCHITECTURES[arch]
    n_layers = int(k.require("block_count"))
    d_model = int(k.require("embedding_length"))
    n_heads = k.per_layer("attention.head_count", k.require("attention.head_count"))
    n_kv_heads = k.per_layer("attention.head_count_kv", k.get("attention.head_count_kv", n_heads))
    if n_heads % n_kv_heads:
        raise UnsupportedModel(f"{n_heads} query heads are not a multiple of {n_kv_heads} "
                               "KV heads", path=path, field=f"{arch}.attention.head_count_kv")
    if not k.has("attention.key_length") and d_model % n_heads:
        raise ModelFileError(f"embedding length {d_model} is not a multiple of {n_heads} "
                             "heads, and no key_length gives the head dimension", path=path,
                             field=f"{arch}.embedding_length")
    head_dim = int(k.get("attention.key_length", d_model // n_heads))
    if int(k.get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel("key and value head dimensions differ", path=path,
                               field=f"{arch}.attention.value_length")
    d_ff = k.per_layer("feed_forward_length", k.get("feed_forward_length", 0)
                       if family.experts_only else k.require("feed_forward_length"))
    if float(k.get("attn_logit_softcapping", 0.0)):
        raise UnsupportedModel("attention logit soft-capping is not supported", path=path)

    context_length = int(k.require("context_length"))
    common: dict[str, Any] = dict(
        architecture=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        vocab_size=vocab_size,
        context_length=context_length,
        norm_eps=float(k.require("attention.layer_norm_rms_epsilon")),
        rope_dim=int(k.get("rope.dimension_count", head_dim)),
        rope_base=float(k.get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(k, context_length),
        tied_embeddings=not k.has_tensor("output.weight"),
        final_logit_softcap=float(k.get("final_logit_softcapping", 0.0)),
        sliding_window=(0,) * n_layers,
    )
    fields = family.fields(k, common)
    if int(k.get("expert_count", 0)) and fields.get("moe") is None:
        raise UnsupportedModel(f"mixture-of-experts {arch} models are not supported",
                               path=path, field=f"{arch}.expert_count")
    return ModelConfig(**{**common, **fields})


def _rope_scaling(k: Keys, context_length: int) -> RopeScaling:
    """llama.cpp's reading of `{arch}.rope.scaling.*` (llama-model.cpp): the type (absent:
    "linear", which with no factor is no scaling; "longrope", Phi-3's, scales linearly by
    its factor, which such files leave at 1: their factors are rope_factors_* tensors),
    the factor (or the older rope.scale_linear; 0 or absent = 1), original_context_length
    (default: the trained context) and attn_factor (default 1). llama.cpp reads the
    rope.scaling.yarn_* keys (ext_factor, attn_factor, beta_fast/slow, log_multiplier) only
    for other architectures (grok, deepseek2), so for these they keep llama.cpp's defaults
    here too.

    A YaRN file supports original context x factor tokens where that is more than its
    trained context (Qwen's model cards add YaRN to a config whose max_position_embeddings,
    a converted GGUF's context_length, stays the original 32768)."""
    arch, path = k.arch, k.path
    field_name = f"{arch}.rope.scaling.type"
    name = str(k.get("rope.scaling.type", "linear"))
    factor = float(k.get("rope.scaling.factor", k.get("rope.scale_linear", 0.0)) or 0.0) or 1.0
    original = int(k.get("rope.scaling.original_context_length", context_length))
    attn_factor = float(k.get("rope.scaling.attn_factor", 1.0))
    try:
        kind = RopeScalingType("linear" if name == "longrope" else name)
    except ValueError:
        if factor != 1.0:
            raise UnsupportedModel(f"rope scaling {quoted(name)} is not supported (supported: "
                                   f"{', '.join(t.value for t in RopeScalingType)})",
                                   path=path, field=field_name) from None
        kind = RopeScalingType.NONE  # a type with factor 1 scales nothing
    if factor <= 0 or not math.isfinite(factor):
        raise UnsupportedModel(f"rope scaling factor {factor} is not positive", path=path,
                               field=f"{arch}.rope.scaling.factor")
    if original <= 0:
        raise UnsupportedModel(f"rope scaling original context {original} is not positive",
                               path=path, field=f"{arch}.rope.scaling.original_context_length")
    context = 0
    if kind is RopeScalingType.YARN:
        context = max(context_length, round(original * factor))
    return RopeScaling(kind, factor, original, attn_factor, context=context)
