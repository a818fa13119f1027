"""Model hyper-parameters per architecture, read from GGUF metadata.

One frozen dataclass holds everything the forward needs, so the forward never looks at
metadata keys or architecture names: a difference between families (rope style, QK-norm,
post-norms, embedding scale, sliding-window layers...) is a field here. The defaults and
derivations follow llama.cpp's `llama-model.cpp` hparams loading for each family.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagerlm.errors import ContextTooLong, InvalidParameters, UnsupportedModel
from eagerlm.loader.errors import ModelFileError, UnknownArchitecture, quoted
from eagerlm.loader.gguf_file import GGUFFile
from eagerlm.loader.metadata_schema import check_metadata

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


class RopeStyle(enum.Enum):
    """How rotary embedding pairs the dimensions of a head.

    NORM rotates adjacent pairs (x[2i], x[2i+1]) - llama.cpp's LLAMA_ROPE_TYPE_NORM, used by
    `llama` (whose converter permutes Q/K so this matches HF's rotate-half). NEOX rotates
    x[i] with x[i + d/2] - used by qwen2, qwen3 and gemma3.
    """

    NORM = "norm"
    NEOX = "neox"


class RopeScalingType(enum.Enum):
    """How the rotary embedding is stretched past the context it was trained on.

    LINEAR divides every angle by the factor (position interpolation). YARN interpolates
    the low frequencies, keeps the high ones and blends the band between them (YaRN,
    Peng et al. 2023, as llama.cpp implements it in ggml's `rope_yarn`)."""

    NONE = "none"
    LINEAR = "linear"
    YARN = "yarn"

    @classmethod
    def parse(cls, name: str) -> RopeScalingType:
        """The type a user named (--rope-scaling), or a ValueError listing the choices."""
        try:
            return cls(name)
        except ValueError:
            raise InvalidParameters(f"--rope-scaling must be one of "
                                    f"{', '.join(t.value for t in cls)}, got {name!r}") from None


class Activation(enum.Enum):
    """Gated FFN activation: down(act(gate(x)) * up(x))."""

    SWIGLU = "swiglu"  # silu
    GEGLU = "geglu"  # gelu, tanh approximation


@dataclass(frozen=True)
class RopeParams:
    """One layer's rotary embedding: the parameters llama.cpp's graphs hand to
    `ggml_rope_ext`, so `ops.rope` computes what ggml computes.

    The angle of pair i at position p is, with theta_e = p * base^(-2i/dim) / ff_i
    (extrapolated) and theta_i = freq_scale * theta_e (interpolated):

        theta = theta_i * (1 - r_i) + theta_e * r_i,  r_i = ext_factor * ramp(i)
        ramp(i) = 1 - clamp((i - low) / max(0.001, high - low), 0, 1)

    with (low, high) = `corr_dims()`; cos and sin are multiplied by `mscale`. With
    ext_factor 0 this is plain (linearly scaled) rope: theta = freq_scale * theta_e.
    """

    style: RopeStyle
    dim: int  # leading dims of each head that are rotated
    base: float
    freq_scale: float = 1.0  # 1 / scaling factor (llama.cpp's rope_freq_scale)
    ext_factor: float = 0.0  # YaRN's weight of the extrapolated angle on the ramp; 0 = off
    attn_factor: float = 1.0  # llama.cpp's cparams.yarn_attn_factor (see `mscale`)
    beta_fast: float = 32.0  # YaRN: rotations over the original context where the ramp
    beta_slow: float = 1.0  # starts (fast) and ends (slow)
    original_context: int = 0  # YaRN: llama.cpp's n_ctx_orig_yarn

    def corr_dims(self) -> tuple[float, float]:
        """YaRN's correction range (low, high) in pair indices: ggml's
        `ggml_rope_yarn_corr_dims`. Pair i turns p * base^(-2i/dim) per position, so over
        the original context it makes n rotations at i = dim * ln(ctx / (2 pi n)) /
        (2 ln base); pairs below `low` (more than beta_fast rotations) are extrapolated,
        above `high` (fewer than beta_slow) interpolated. (ggml works in float32; this
        float64 value differs only where it lies within rounding of an integer.)"""

        def dim_of(n_rot: float) -> float:
            return (self.dim * math.log(self.original_context / (n_rot * 2 * math.pi))
                    / (2 * math.log(self.base)))

        low = math.floor(dim_of(self.beta_fast))
        high = math.ceil(dim_of(self.beta_slow))
        return float(max(0, low)), float(min(self.dim - 1, high))

    @property
    def mscale(self) -> float:
        """What cos and sin are multiplied by: ggml's `rope_yarn` multiplies attn_factor by
        1 + 0.1 ln(1 / freq_scale) whenever ext_factor is not 0."""
        if self.ext_factor == 0.0:
            return self.attn_factor
        return self.attn_factor * (1.0 + 0.1 * math.log(1.0 / self.freq_scale))


@dataclass(frozen=True)
class RopeScaling:
    """The model's rope scaling, with the values llama.cpp derives from it (hparams
    loading in llama-model.cpp, then `llama_context`'s cparams).

    `context` is the longest context this scaling supports, beyond the trained context
    (`ModelConfig.context_length`) where it extends it; 0 when it does not (see
    `ModelConfig.max_context`).
    """

    type: RopeScalingType = RopeScalingType.NONE
    factor: float = 1.0  # context extension factor (rope.scaling.factor)
    # llama.cpp's n_ctx_orig_yarn: rope.scaling.original_context_length, or the trained
    # context; YaRN's correction dims are computed over it
    original_context: int = 0
    attn_factor: float = 1.0  # rope.scaling.attn_factor: multiplies cos/sin, any type
    # llama.cpp's defaults; it reads rope.scaling.yarn_beta_* only for other architectures
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    context: int = 0

    def __post_init__(self) -> None:
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"rope scaling factor {self.factor} is not positive")
        if self.original_context < 0 or self.context < 0:
            raise ValueError("contexts are token counts")

    @property
    def freq_scale(self) -> float:
        """Position multiplier; llama.cpp never scales with type none."""
        return 1.0 if self.type is RopeScalingType.NONE else 1.0 / self.factor

    @property
    def ext_factor(self) -> float:
        """llama.cpp's default yarn_ext_factor: 1 with YaRN, 0 otherwise."""
        return 1.0 if self.type is RopeScalingType.YARN else 0.0

    @property
    def yarn_attn_factor(self) -> float:
        """llama.cpp's cparams.yarn_attn_factor (llama-context.cpp). With YaRN on it is
        get_mscale(factor) / (1 + 0.1 ln factor), get_mscale(s) = 1 + 0.1 ln s for s > 1
        else 1, because `rope_yarn` multiplies by 1 + 0.1 ln(1 / freq_scale) again: a
        scaled layer ends with attn_factor * get_mscale(factor), a layer with its own
        freq_scale of 1 (gemma3's sliding-window layers) with this alone. Then times
        rope.scaling.attn_factor, for every type."""
        a = 1.0
        if self.ext_factor != 0.0:
            factor = 1.0 / self.freq_scale
            get_mscale = 1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0
            a = get_mscale / (1.0 + 0.1 * math.log(factor))
        return a * self.attn_factor


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
    activation: Activation
    attention_scale: float  # multiplies Q before QK^T
    # per-layer: window size in tokens (0 = full causal attention)
    sliding_window: tuple[int, ...]
    rope_scaling: RopeScaling = RopeScaling()
    rope_base_swa: float = 10000.0  # rope base of sliding-window layers
    rope_scale_swa: float = 1.0  # their freq_scale: llama.cpp never scales them
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

    @property
    def max_context(self) -> int:
        """The longest context the model supports: the trained context, or what its rope
        scaling extends it to."""
        return self.rope_scaling.context or self.context_length

    def context_for(self, requested: int | None) -> int:
        """The context a session gets: `requested` tokens (the user's --ctx), or by default
        the trained context (less where the user's rope scaling supports less). Raises
        ContextTooLong beyond `max_context`: past what the rope was trained or scaled for
        the model's output is garbage, so it is refused rather than run."""
        limit = self.max_context
        if not requested:
            return min(self.context_length, limit)
        if requested < 1:
            raise InvalidParameters(f"--ctx must be a positive number of tokens, got {requested}")
        if requested <= limit:
            return requested
        s = self.rope_scaling
        if s.context == 0:
            hint = ("; rope scaling can extend it (--rope-scaling yarn --rope-scale F "
                    "--yarn-orig-ctx N)" if s.type is RopeScalingType.NONE or s.factor == 1
                    else "")
            raise ContextTooLong(f"--ctx {requested} exceeds the model's context length "
                                 f"{limit}{hint}")
        what = f"{s.type.value} rope scaling by {s.factor:g}"
        if s.type is RopeScalingType.YARN:
            what += f" from an original context of {s.original_context}"
        elif s.type is RopeScalingType.NONE:
            what = "the model's rope without its scaling"
        raise ContextTooLong(f"--ctx {requested} exceeds the {limit} tokens that {what} "
                             f"supports")

    def layer_rope(self, layer: int) -> RopeParams:
        """The rotary embedding of one layer, as llama.cpp builds it: sliding-window layers
        have their own base and freq_scale (`get_rope_freq_base/scale`) but share YaRN's
        ext_factor, attn_factor, betas and original context with the others."""
        s = self.rope_scaling
        swa = self.is_swa(layer)
        return RopeParams(
            style=self.rope_style, dim=self.rope_dim,
            base=self.rope_base_swa if swa else self.rope_base,
            freq_scale=self.rope_scale_swa if swa else s.freq_scale,
            ext_factor=s.ext_factor, attn_factor=s.yarn_attn_factor, beta_fast=s.beta_fast,
            beta_slow=s.beta_slow, original_context=s.original_context)


@dataclass(frozen=True)
class RopeOverride:
    """The user's rope scaling in place of the file's, as llama.cpp's --rope-scaling,
    --rope-scale and --yarn-orig-ctx: a field left None keeps the file's value. Values that
    cannot be right whatever the file says are refused here (InvalidParameters); the rest
    when it is applied to a model (`apply`)."""

    scaling: RopeScalingType | None = None
    factor: float | None = None  # --rope-scale: context extension factor
    original_context: int | None = None  # --yarn-orig-ctx

    def __post_init__(self) -> None:
        if self.factor is not None and not (self.factor > 0 and math.isfinite(self.factor)):
            raise InvalidParameters(f"--rope-scale must be a positive number, got {self.factor}")
        if self.original_context is not None and (
                isinstance(self.original_context, bool) or self.original_context < 1):
            raise InvalidParameters(f"--yarn-orig-ctx must be a positive number of tokens, got "
                                    f"{self.original_context}")
        if self.scaling is RopeScalingType.NONE and self.factor is not None:
            raise InvalidParameters("--rope-scale does not apply with --rope-scaling none")
        if self.scaling is RopeScalingType.YARN and self.factor is not None \
                and self.factor < 1:
            raise InvalidParameters(f"YaRN extends the context: --rope-scale must be at least 1, "
                                    f"got {self.factor:g}")

    @classmethod
    def from_settings(cls, scaling: str | None, factor: float | None,
                      original_context: int | None) -> RopeOverride | None:
        """The override the user's settings name (--rope-scaling, --rope-scale,
        --yarn-orig-ctx, or the engine's fields of the same meaning), checked; None when
        they name none, so the file's scaling stays."""
        kind = None if scaling is None else RopeScalingType.parse(scaling)
        rope = cls(kind, factor, original_context)
        return None if rope.is_empty else rope

    @property
    def is_empty(self) -> bool:
        return self.scaling is None and self.factor is None and self.original_context is None

    def apply(self, config: ModelConfig) -> ModelConfig:
        """`config` with this rope scaling. Its longest context (`RopeScaling.context`):
        with YaRN, original context x factor (llama.cpp sets n_ctx_train to
        n_ctx_orig_yarn / freq_scale for a user's YaRN); linear, the model's unscaled
        context x factor; none, the unscaled context. The unscaled context is the file's
        original context for a YaRN file, its trained context / factor for a linear one
        (whose trained context counts its scaling), else its trained context."""
        if self.is_empty:
            return config
        file = config.rope_scaling
        kind = self.scaling or file.type
        if kind is RopeScalingType.NONE:
            if self.factor is not None:
                raise InvalidParameters("--rope-scale needs --rope-scaling linear or yarn: the "
                                        "model's rope scaling type is none")
            factor = 1.0
        elif self.factor is not None:
            factor = self.factor
        elif file.type is not RopeScalingType.NONE and file.factor != 1.0:
            factor = file.factor
        else:
            raise InvalidParameters(f"--rope-scaling {kind.value} needs --rope-scale F: the "
                                    f"model's rope has no scaling factor")
        if kind is RopeScalingType.YARN and factor < 1:
            raise InvalidParameters(f"YaRN extends the context: --rope-scale must be at least 1, "
                                    f"got {factor:g}")
        if self.original_context is not None and kind is not RopeScalingType.YARN:
            raise InvalidParameters(f"--yarn-orig-ctx applies only to --rope-scaling yarn (the "
                                    f"rope scaling here is {kind.value})")
        if file.type is RopeScalingType.YARN:
            unscaled = file.original_context
        elif file.type is RopeScalingType.LINEAR:
            unscaled = round(config.context_length / file.factor)
        else:
            unscaled = config.context_length
        original = self.original_context or file.original_context
        if kind is RopeScalingType.YARN:
            context = round(original * factor)
        else:
            context = round(unscaled * factor)
        scaling = RopeScaling(kind, factor, original, file.attn_factor, file.beta_fast,
                              file.beta_slow, context=max(1, context))
        return dataclasses.replace(config, rope_scaling=scaling)


def swa_pattern(n_layers: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's `set_swa_pattern(period)`: every `period`-th layer (the last of each group)
    is global, the others use the sliding window."""
    if period <= 0:
        return (False,) * n_layers
    return tuple(il % period < period - 1 for il in range(n_layers))


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """Build the config of the model in `f`, raising a typed error for what is unsupported.

    Every value read here has been checked for its type and range (metadata_schema), so
    what is left to check is how the values fit together."""
    check_metadata(f)
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnknownArchitecture(
            f"unknown architecture {quoted(arch)}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}", path=f.path, field="general.architecture")

    def key(name: str) -> Any:
        return f.require(f"{arch}.{name}")

    def opt(name: str, default: Any) -> Any:
        return f.get(f"{arch}.{name}", default)

    n_layers = int(key("block_count"))
    d_model = int(key("embedding_length"))
    n_heads = _per_layer_constant(f, arch, "attention.head_count", key("attention.head_count"))
    n_kv_heads = _per_layer_constant(f, arch, "attention.head_count_kv",
                                     opt("attention.head_count_kv", n_heads))
    if n_heads % n_kv_heads:
        raise UnsupportedModel(f"{n_heads} query heads are not a multiple of {n_kv_heads} "
                               "KV heads", path=f.path, field=f"{arch}.attention.head_count_kv")
    if f"{arch}.attention.key_length" not in f.metadata and d_model % n_heads:
        raise ModelFileError(f"embedding length {d_model} is not a multiple of {n_heads} "
                             "heads, and no key_length gives the head dimension", path=f.path,
                             field=f"{arch}.embedding_length")
    if int(opt("expert_count", 0)):
        raise UnsupportedModel("mixture-of-experts models are not supported", path=f.path,
                               field=f"{arch}.expert_count")
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

    context_length = int(key("context_length"))
    rope_scaling = _rope_scaling_from_gguf(f, arch, context_length)

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
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_dim=int(opt("rope.dimension_count", head_dim)),
        rope_base=float(opt("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
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


def _rope_scaling_from_gguf(f: GGUFFile, arch: str, context_length: int) -> RopeScaling:
    """llama.cpp's reading of `{arch}.rope.scaling.*` (llama-model.cpp): the type (absent:
    "linear", which with no factor is no scaling), the factor (or the older
    rope.scale_linear; 0 or absent = 1), original_context_length (default: the trained
    context) and attn_factor (default 1). llama.cpp reads the rope.scaling.yarn_* keys
    (ext_factor, attn_factor, beta_fast/slow, log_multiplier) only for other
    architectures (grok, deepseek2), so for these they keep llama.cpp's defaults here too.

    A YaRN file supports original context x factor tokens where that is more than its
    trained context (Qwen's model cards add YaRN to a config whose max_position_embeddings,
    a converted GGUF's context_length, stays the original 32768)."""
    field = f"{arch}.rope.scaling.type"
    name = str(f.get(field, "linear"))
    factor = float(f.get(f"{arch}.rope.scaling.factor",
                         f.get(f"{arch}.rope.scale_linear", 0.0)) or 0.0) or 1.0
    original = int(f.get(f"{arch}.rope.scaling.original_context_length", context_length))
    attn_factor = float(f.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    try:
        kind = RopeScalingType(name)
    except ValueError:
        if factor != 1.0:
            raise UnsupportedModel(f"rope scaling {quoted(name)} is not supported (supported: "
                                   f"{', '.join(t.value for t in RopeScalingType)})",
                                   path=f.path, field=field) from None
        kind = RopeScalingType.NONE  # a type with factor 1 scales nothing
    if factor <= 0 or not math.isfinite(factor):
        raise UnsupportedModel(f"rope scaling factor {factor} is not positive", path=f.path,
                               field=f"{arch}.rope.scaling.factor")
    if original <= 0:
        raise UnsupportedModel(f"rope scaling original context {original} is not positive",
                               path=f.path, field=f"{arch}.rope.scaling.original_context_length")
    context = 0
    if kind is RopeScalingType.YARN:
        context = max(context_length, round(original * factor))
    return RopeScaling(kind, factor, original, attn_factor, context=context)


def _per_layer_constant(f: GGUFFile, arch: str, name: str, value: Any) -> int:
    """Some converters store per-layer arrays; this engine needs them uniform."""
    if isinstance(value, np.ndarray | list):
        values = {int(v) for v in value}
        if len(values) != 1:
            raise UnsupportedModel(f"per-layer varying {name} is not supported", path=f.path,
                                   field=f"{arch}.{name}")
        return values.pop()
    return int(value)
