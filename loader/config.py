"""Model hyper-parameters: what the forward needs to know about a model.

One frozen dataclass holds everything the forward needs, so the forward never looks at
metadata keys or architecture names: a difference between families (rope style, QK-norm,
post-norms, embedding scale, sliding-window layers, a mixture of experts...) is a field
here. loader/architectures.py reads them from GGUF metadata, one registry entry per
family, following llama.cpp's hparams loading.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from eagerlm.errors import ContextTooLong, InvalidParameters, UnsupportedModel


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
    # gpt-oss's clamped SwiGLU, as ggml's `swiglu_oai` computes it: g = min(gate, 7),
    # u = clamp(up, -7, 7), out = g * sigmoid(1.702 g) * (u + 1)
    SWIGLU_OAI = "swiglu_oai"


# gpt-oss's clamped SwiGLU constants (llama.cpp's build_moe_ffn: alpha 1.702, limit 7)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


class ExpertGating(enum.Enum):
    """How a mixture-of-experts router turns its logits into the chosen experts' weights
    (llama.cpp's `llama_expert_gating_func_type`, as build_moe_ffn applies it).

    SOFTMAX: softmax over every expert, the top k of those probabilities, their
    probabilities the weights (Mixtral, Qwen MoE). SOFTMAX_WEIGHT: the top k of the raw
    logits, a softmax over those k the weights (gpt-oss). SIGMOID: sigmoid of each logit,
    the top k of those."""

    SOFTMAX = "softmax"
    SOFTMAX_WEIGHT = "softmax_weight"
    SIGMOID = "sigmoid"


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: `n_experts` expert FFNs of width `d_ff`, of
    which the router picks `n_used` per token.

    The chosen experts' weights come from `gating`, are divided by their sum when
    `normalize` (llama.cpp's norm_w: Mixtral, Qwen3 MoE; the sum clamped below at
    6.103515625e-5 as llama.cpp does), then multiplied by `scale`. With `d_ff_shared`, a
    shared expert of that width runs on every token and adds to the routed ones, gated
    by sigmoid(ffn_gate_inp_shexp . x) when `shared_gate`. `biases`: the router and each
    expert's three matrices have biases (gpt-oss)."""

    n_experts: int
    n_used: int
    d_ff: int
    gating: ExpertGating = ExpertGating.SOFTMAX
    normalize: bool = True
    scale: float = 1.0
    d_ff_shared: int = 0
    shared_gate: bool = False
    biases: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.n_used <= self.n_experts:
            raise UnsupportedModel(f"{self.n_used} experts used per token of "
                                   f"{self.n_experts}")


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
    # LongRoPE (Phi-3 128k): per-frequency divisors for contexts up to the original one
    # (rope_factors_short.weight) and beyond it (rope_factors_long.weight), chosen by the
    # context a model is run with (`rope_long_for`), as llama.cpp's get_rope_factors does
    long_rope_factors: bool = False
    attn_output_bias: bool = False  # attn_output.bias (gpt-oss)
    # a learned logit per query head that joins every softmax of attention (gpt-oss's
    # attention sinks, attn_sinks.weight): the weights of the real keys sum to less than 1
    attn_sinks: bool = False
    fused_qkv: bool = False  # Q, K and V rows in one attn_qkv.weight (phi3)
    fused_gate_up: bool = False  # gate then up rows in one ffn_up.weight (phi3)
    moe: MoEConfig | None = None  # every layer's FFN is a mixture of experts

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

    def rope_long_for(self, context: int) -> bool:
        """Whether LongRoPE's long factors apply to a model run with `context` tokens per
        session: beyond the original context (llama.cpp: n_ctx_seq > n_ctx_orig_yarn)."""
        return self.long_rope_factors and context > self.rope_scaling.original_context

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
