"""Synthetic GGUF models: any supported architecture and shape, random weights, a small
working tokenizer. The writer mirrors the reader (same keys, same tensor names).

Tests use tiny ones; benchmarks and GPU runs use real shapes (`SHAPES`), since real
models over 64 MiB cannot travel to the GPU machine. Weights are drawn with a seed and
scaled by 1/sqrt(fan_in) so activations stay in a realistic range through many layers.
Tensors are generated and written one at a time, so an 8B-shaped file needs no more
memory than its largest tensor; the real shapes draw their matrices uniform (same variance)
and convert to bf16 by bit arithmetic, so even the 8B file is written in well under a
minute on a GPU machine's cores; in K-quant and IQ types they draw only the block scales
(the 8B shape in Q4_K: 4.7 GB in 17 s on 2 cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

from eagerlm.loader import ggml_quants
from eagerlm.loader.architectures import ARCHITECTURES, Keys, config_from_keys
from eagerlm.loader.config import ModelConfig
from eagerlm.loader.tiny_vocab import TinyVocab, bpe_vocab, spm_vocab
from eagerlm.loader.weights import tensor_plan

Q = GGMLQuantizationType

# Byte offsets of the float16 block scales in the blocks that gguf-py cannot quantize
# (K-quants, IQ types): random bytes there are valid blocks once those scales are sane,
# since every other field is a bounded integer (sub-scales, grid and codebook indices,
# sign bits). IQ1_M has no such field: its scale is spread over four nibbles
# (`_set_iq1_m_scales`).
_SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q2_K: (80,),
    Q.Q3_K: (108,),
    Q.Q4_K: (0,),
    Q.Q5_K: (0,),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
}
# The K-quants with a block minimum: value = d * sc * q - dmin * m with sub-scales sc and
# mins m drawn alike, so dmin = E[q] * d (offset, E[q]) makes a block's values average zero,
# as trained weights do, instead of all sitting far on one side of it.
_MIN_OFFSETS: dict[GGMLQuantizationType, tuple[int, float]] = {
    Q.Q2_K: (82, 1.5),  # q in 0..3
    Q.Q4_K: (2, 7.5),  # q in 0..15
    Q.Q5_K: (2, 15.5),  # q in 0..31
}
IQ_TYPES = (Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S,
            Q.IQ1_M)
RANDOM_BYTE_TYPES = frozenset({*_SCALE_OFFSETS, Q.IQ1_M, Q.NVFP4, Q.MXFP4})


def _set_mxfp4_scales(raw: np.ndarray, scales: np.ndarray) -> None:
    """MXFP4's scale is its first byte, a power of two (e8m0: byte e means 2^(e - 128) per
    doubled e2m1 step, gguf-py's `e8m0_to_fp32_half`): the power nearest each wanted
    scale."""
    exponent = np.rint(np.log2(np.maximum(scales, 1e-30))) + 128
    raw[:, 0] = np.clip(exponent, 1, 254).astype(np.uint8)


def _set_iq1_m_scales(raw: np.ndarray, scales: np.ndarray) -> None:
    """IQ1_M keeps its float16 scale in the top nibbles of its four u16 sub-scale words
    (bytes 48-55, little-endian): bits 4k..4k+3 of the scale in word k's bits 12-15, which
    is the high nibble of byte 49 + 2k (gguf-py's `IQ1_M.dequantize_blocks`)."""
    bits = scales.astype(np.float16).view(np.uint16)
    for k in range(4):
        at = 49 + 2 * k
        nibble = ((bits >> (4 * k)) & 0xF).astype(np.uint8)
        raw[:, at] = (raw[:, at] & 0x0F) | (nibble << 4)


def random_blocks(qtype: GGMLQuantizationType, scales: np.ndarray,
                  rng: np.random.Generator) -> np.ndarray:
    """`len(scales)` blocks of `qtype` (one gguf-py cannot quantize: K-quants, IQ types, NVFP4),
    [blocks, bytes]: random bytes, each block's float16 scale set to its entry of
    `scales` (and a K-quant's minimum scale so that the block averages zero)."""
    if qtype not in RANDOM_BYTE_TYPES:
        raise ValueError(f"{qtype.name} is not written as random bytes")
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(len(scales), size), dtype=np.uint8)
    if qtype == Q.IQ1_M:
        _set_iq1_m_scales(raw, scales)
    elif qtype == Q.MXFP4:
        _set_mxfp4_scales(raw, scales)
    elif qtype == Q.NVFP4:  # four UE4M3 scales, one per 16 values, decoded halved
        raw[:, :4] = quants.NVFP4.fp32_to_ue4m3(2 * scales.astype(np.float32))[:, None]
    else:
        half = scales.astype(np.float16).view(np.uint8).reshape(len(scales), 2)
        for off in _SCALE_OFFSETS[qtype]:
            raw[:, off:off + 2] = half
        if qtype in _MIN_OFFSETS:
            off, mean_q = _MIN_OFFSETS[qtype]
            raw[:, off:off + 2] = (scales * mean_q).astype(np.float16).view(np.uint8).reshape(
                len(scales), 2)
    return raw


@cache
def _unit_scale_rms(qtype: GGMLQuantizationType) -> float:
    """The root mean square of the values of random `qtype` blocks whose scale is 1: what
    a block scale multiplies, so that scale = wanted RMS / this gives weights of the float
    draw's size (a block's values span from 2 to over 1000 times its scale, by type)."""
    raw = random_blocks(qtype, np.ones(256, np.float32), np.random.default_rng(0))
    values = quants.dequantize(raw, qtype).astype(np.float64)
    return float(np.sqrt(np.mean(values * values)))


@dataclass(frozen=True)
class SyntheticSpec:
    """The shape and numerics of a synthetic model."""

    architecture: str
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    vocab_size: int = 512
    context_length: int = 256
    weight_type: GGMLQuantizationType = Q.F32  # of the matrices; norms stay F32
    embedding_type: GGMLQuantizationType | None = None  # default: weight_type
    # of output.weight (untied); default: weight_type. Q4_K_M files hold it as Q6_K
    output_type: GGMLQuantizationType | None = None
    tied_embeddings: bool = False
    # the untied LM head's standard deviation, in units of 1/sqrt(d_model): the logits'
    # spread (1: about one unit; real models' next-token distributions are sharper)
    output_scale: float = 1.0
    rope_base: float = 10000.0
    # {arch}.rope.scaling.*: type ("linear", "yarn"; None writes no scaling keys), factor,
    # original_context_length and attn_factor (None: key not written)
    rope_scaling: str | None = None
    rope_scaling_factor: float | None = None
    rope_original_context: int | None = None
    rope_attn_factor: float | None = None
    # Llama 3.x's rope: per-frequency divisors in rope_freqs.weight, as convert_hf_to_gguf
    # writes them from rope_scaling {"rope_type": "llama3", "factor": F, ...}; 0 = none
    llama3_rope_factor: float = 0.0
    sliding_window: int = 16  # gemma3 local layers
    final_logit_softcap: float = 0.0
    norm_eps: float = 1e-6
    seed: int = 0
    # matrices drawn uniform (same variance as the normal draw) rather than normal: ten
    # times faster, for multi-GB shapes whose normal draws would take minutes. Matrices of
    # random-byte types (K-quants, IQ) then draw no values at all: each block's scale is
    # the draw's standard deviation, within +-10% (an 8B Q4_K file in seconds, not minutes)
    uniform_init: bool = False
    chat_template: str | None = None
    extra_specials: tuple[str, ...] = field(default=())
    # {arch}.pooling_type, llama.cpp's enum (1 mean, 2 CLS, 3 last): an embedding model;
    # None writes no key
    pooling_type: int | None = None
    # a mixture of experts (qwen3moe and gpt-oss always; llama when set: Mixtral): experts,
    # of which each token uses n_experts_used, each d_ff_expert wide (llama's: d_ff)
    n_experts: int = 0
    n_experts_used: int = 0
    d_ff_expert: int = 0
    expert_type: GGMLQuantizationType | None = None  # of the expert tensors; default weight_type
    d_ff_shared: int = 0  # a shared expert of this width beside the routed ones
    # the byte-level BPE pre-tokenizer in place of the architecture's ("tekken" makes a
    # llama model a Mistral file)
    pre: str | None = None
    rope_dim: int = 0  # rotated dims of each head; 0: all (phi3 rotates a part)
    fused_qkv: bool = True  # phi3: Q, K and V in one attn_qkv tensor, as Phi-3's files
    # LongRoPE (Phi-3 128k): rope_factors_short / _long tensors and the original context
    # (rope_original_context, default context_length / 32) that chooses between them
    long_rope: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}")
        if ARCHITECTURES[self.architecture].experts_only and not self.n_experts:
            raise ValueError(f"a {self.architecture} model needs n_experts")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"{self.n_experts_used} experts used of {self.n_experts}")

    def vocab(self) -> TinyVocab:
        arch, extra = self.architecture, self.extra_specials
        if arch == "gemma3":
            return spm_vocab(self.vocab_size, specials=("<start_of_turn>", "<end_of_turn>",
                                                        *extra))
        if arch == "phi3":
            return spm_vocab(self.vocab_size, specials=(
                "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", *extra))
        if arch == "gpt-oss":  # o200k_harmony's specials
            return bpe_vocab(self.vocab_size, pre=self.pre or "gpt-4o", specials=(
                "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>", *extra))
        if self.pre == "tekken":  # Mistral's tekken vocabularies
            return bpe_vocab(self.vocab_size, pre="tekken", specials=(
                "<unk>", "<s>", "</s>", "[INST]", "[/INST]", *extra))
        if arch == "llama":
            return bpe_vocab(self.vocab_size, pre=self.pre or "llama-bpe", specials=(
                "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", *extra))
        return bpe_vocab(self.vocab_size, pre=self.pre or "qwen2", specials=(
            "<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra))

    def tensor_config(self) -> ModelConfig:
        """The config a reader derives from the file this spec writes (loader/architectures.py,
        from the same metadata and tensor names), whose `tensor_plan` is the file's
        tensors. Without the rope scaling keys, which decide no tensor: a spec may write
        values the reader refuses, to test that it does."""
        metadata = {key: v for key, v in self.model_metadata().items()
                    if ".rope.scaling." not in key}
        return config_from_keys(Keys(metadata, self._tensor_names(), self.architecture),
                                self.vocab_size)

    def model_metadata(self) -> dict[str, object]:
        """The `{arch}.*` keys this spec writes, as values (the tokenizer's aside)."""
        w = GGUFWriter(os.devnull, self.architecture)
        _add_model_metadata(w, self)
        return {key: v.value for key, v in w.kv_data[0].items()}

    def _tensor_names(self) -> frozenset[str]:
        """The tensors whose presence the reader looks at (loader/architectures.py)."""
        names = set()
        if not self.tied_embeddings:
            names.add("output.weight")
        if self.llama3_rope_factor:
            names.add("rope_freqs.weight")
        if self.long_rope:
            names.add("rope_factors_long.weight")
        if self.architecture == "phi3" and self.fused_qkv:
            names.add("blk.0.attn_qkv.weight")
        return frozenset(names)


# Real shapes, for benchmarks and GPU runs (vocabularies as the real models have them).
SHAPES: dict[str, SyntheticSpec] = {
    "qwen3-0.6b": SyntheticSpec("qwen3", n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8,
                                head_dim=128, d_ff=3072, vocab_size=151936,
                                context_length=40960, rope_base=1e6, tied_embeddings=True,
                                weight_type=Q.BF16, uniform_init=True),
    # Qwen1.5-0.5B: the qwen2 architecture (QKV biases) with every row whole 256-value
    # superblocks (hidden 1024, FFN 2816), which Qwen2.5-0.5B's hidden 896 is not
    "qwen1.5-0.5b": SyntheticSpec("qwen2", n_layers=24, d_model=1024, n_heads=16,
                                  n_kv_heads=16, head_dim=64, d_ff=2816, vocab_size=151936,
                                  context_length=32768, rope_base=1e6, tied_embeddings=True,
                                  weight_type=Q.BF16, uniform_init=True),
    "llama-3.2-1b": SyntheticSpec("llama", n_layers=16, d_model=2048, n_heads=32,
                                  n_kv_heads=8, head_dim=64, d_ff=8192, vocab_size=128256,
                                  context_length=131072, rope_base=500000.0,
                                  llama3_rope_factor=32.0, tied_embeddings=True,
                                  weight_type=Q.BF16, uniform_init=True),
    "llama-3.2-3b": SyntheticSpec("llama", n_layers=28, d_model=3072, n_heads=24,
                                  n_kv_heads=8, head_dim=128, d_ff=8192, vocab_size=128256,
                                  context_length=131072, rope_base=500000.0,
                                  llama3_rope_factor=32.0, tied_embeddings=True,
                                  weight_type=Q.BF16, uniform_init=True),
    "llama-3.1-8b": SyntheticSpec("llama", n_layers=32, d_model=4096, n_heads=32,
                                  n_kv_heads=8, head_dim=128, d_ff=14336, vocab_size=128256,
                                  context_length=131072, rope_base=500000.0,
                                  llama3_rope_factor=8.0, weight_type=Q.BF16,
                                  uniform_init=True),
    # Qwen3-30B-A3B (and Qwen3-Coder-30B-A3B) as a Q4_K_M file holds it, about 18 GB: every
    # matrix Q4_K (Q4_K_M also puts some down projections and V in Q6_K), the lm head Q6_K
    "qwen3-30b-a3b": SyntheticSpec("qwen3moe", n_layers=48, d_model=2048, n_heads=32,
                                   n_kv_heads=4, head_dim=128, d_ff=6144, n_experts=128,
                                   n_experts_used=8, d_ff_expert=768, vocab_size=151936,
                                   context_length=40960, rope_base=1e6, weight_type=Q.Q4_K,
                                   output_type=Q.Q6_K, uniform_init=True),
    # gpt-oss-20b: MXFP4 experts as OpenAI ships them, the other matrices Q8_0 (rows of
    # 2880 values are not whole 256-value K-quant blocks), YaRN x32 over 4096
    "gpt-oss-20b": SyntheticSpec("gpt-oss", n_layers=24, d_model=2880, n_heads=64,
                                 n_kv_heads=8, head_dim=64, d_ff=2880, n_experts=32,
                                 n_experts_used=4, d_ff_expert=2880, vocab_size=201088,
                                 context_length=131072, rope_base=150000.0,
                                 rope_scaling="yarn", rope_scaling_factor=32.0,
                                 rope_original_context=4096, sliding_window=128,
                                 weight_type=Q.Q8_0, expert_type=Q.MXFP4, uniform_init=True),
    "gemma3-270m": SyntheticSpec("gemma3", n_layers=18, d_model=640, n_heads=4, n_kv_heads=1,
                                 head_dim=256, d_ff=2048, vocab_size=262144,
                                 context_length=32768, rope_base=1e6, sliding_window=512,
                                 tied_embeddings=True, weight_type=Q.Q8_0,
                                 uniform_init=True),
}


# What a tiny model of each architecture has beyond `SyntheticSpec`'s defaults.
_TINY: dict[str, dict[str, object]] = {
    "qwen3moe": dict(n_experts=8, n_experts_used=2, d_ff_expert=32),
    # YaRN as the real files have it (factor 32 over 4096), scaled down
    "gpt-oss": dict(n_experts=4, n_experts_used=2, d_ff_expert=64, sliding_window=8,
                    rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_context=64),
    "phi3": dict(rope_dim=12),
}


def tiny_spec(architecture: str, **overrides: object) -> SyntheticSpec:
    """A few-layer model of the architecture, small enough for unit tests."""
    return SyntheticSpec(architecture, **{**_TINY.get(architecture, {}), **overrides})


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator,
            uniform: bool = False, output_scale: float = 1.0) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("attn_sinks.weight"):  # logits of the same size as attention scores
        return rng.standard_normal(shape).astype(np.float32)
    std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[-1])
    if name == "output.weight":
        std *= output_scale
    if uniform:  # uniform on [-a, a] has variance a^2 / 3
        out = rng.random(shape, dtype=np.float32)
        out -= np.float32(0.5)
        out *= np.float32(2 * np.sqrt(3.0) * std)
        return out
    out = rng.standard_normal(shape, dtype=np.float32)
    return out if std == 1.0 else (out * std).astype(np.float32)  # scaled in float64


def llama3_rope_factors(spec: SyntheticSpec, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 8192
                        ) -> np.ndarray:
    """Llama 3.x's per-pair rope divisors (rope_freqs.weight), by the rule of Meta's
    reference code that convert_hf_to_gguf applies: pairs whose wavelength is shorter than
    original_context / high_freq_factor keep their frequency (1), those longer than
    original_context / low_freq_factor are divided by the factor, and the band between
    blends the two smoothly."""
    factor = spec.llama3_rope_factor
    pair = np.arange(spec.head_dim // 2, dtype=np.float64)
    wavelength = 2 * np.pi * spec.rope_base ** (2 * pair / spec.head_dim)
    smooth = (original_context / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelength < original_context / high_freq_factor, 1.0,
                   np.where(wavelength > original_context / low_freq_factor, factor, blended))
    return out.astype(np.float32)


def longrope_factors(spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE's (short, long) per-pair divisors: near 1 for short contexts, growing
    towards the low frequencies (the last pairs) for long ones, as Phi-3's are."""
    ramp = np.linspace(0.0, 1.0, _rope_dim(spec) // 2)
    short = 1.0 + 0.2 * ramp
    long = 1.0 + 20.0 * ramp * ramp
    return short.astype(np.float32), long.astype(np.float32)


def _rope_dim(spec: SyntheticSpec) -> int:
    return spec.rope_dim or spec.head_dim


def bf16_bits(values: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even: gguf's `quants.quantize(.., BF16)`
    for finite values (what synthetic weights are), without its NaN pass, a chunk at a
    time so the temporaries stay in cache (several times faster on multi-GB models)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(flat.size, np.uint16)
    for at in range(0, flat.size, chunk):
        bits = flat[at:at + chunk]
        out[at:at + chunk] = (bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16
    return out.reshape(values.shape)


def _encode(values: np.ndarray, qtype: GGMLQuantizationType,
            rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes in `qtype` (a float array for F32/F16, uint8 rows otherwise)."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype == Q.BF16:  # _values draws finite values only
        return bf16_bits(values).view(np.uint8).reshape(*values.shape[:-1], -1)
    if qtype in RANDOM_BYTE_TYPES:
        block, _ = GGML_QUANT_SIZES[qtype]
        blocks = values.reshape(-1, block)
        # each block as large as its float draw (RMS)
        rms = np.sqrt(np.mean(np.square(blocks, dtype=np.float64), axis=1))
        scale = rms / _unit_scale_rms(qtype)
        return random_blocks(qtype, scale, rng).reshape(*values.shape[:-1], -1)
    return ggml_quants.quantize(values, qtype)


def _random_block_matrix(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                         rng: np.random.Generator) -> np.ndarray:
    """A matrix of random `qtype` blocks without a float draw behind it: each block's RMS
    the draw's standard deviation (`_values`) times a factor uniform in [0.9, 1.1], the
    spread of a block's RMS around it. `_encode` of a uniform draw would take the same
    scales from the values, at the cost of drawing and squaring them (minutes for 8B)."""
    block, _ = GGML_QUANT_SIZES[qtype]
    std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[-1])
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block
    scale = rng.uniform(0.9, 1.1, n_blocks) * (std / _unit_scale_rms(qtype))
    return random_blocks(qtype, scale, rng).reshape(*shape[:-1], -1)


def _add_model_metadata(w: GGUFWriter, spec: SyntheticSpec) -> None:
    """The `{arch}.*` keys of the model (what the config is read from)."""
    arch = spec.architecture
    w.add_name(f"synthetic {arch}")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.d_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_rope_freq_base(spec.rope_base)
    w.add_rope_dimension_count(_rope_dim(spec))
    if spec.rope_scaling is not None:
        w.add_rope_scaling_type(RopeScalingType(spec.rope_scaling))
    if spec.rope_scaling_factor is not None:
        w.add_rope_scaling_factor(spec.rope_scaling_factor)
    original = spec.rope_original_context
    if original is None and spec.long_rope:
        original = spec.context_length // 32
    if original is not None:
        w.add_rope_scaling_orig_ctx_len(original)
    if spec.rope_attn_factor is not None:
        w.add_rope_scaling_attn_factors(spec.rope_attn_factor)
    if arch in ("gemma3", "gpt-oss"):
        w.add_sliding_window(spec.sliding_window)
    if spec.final_logit_softcap:
        w.add_final_logit_softcapping(spec.final_logit_softcap)
    if spec.n_experts:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.n_experts_used)
        if arch != "llama":  # llama's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(spec.d_ff_expert or spec.d_ff)
        if spec.d_ff_shared:
            w.add_expert_shared_feed_forward_length(spec.d_ff_shared)


def write_synthetic_model(path: str | os.PathLike[str], spec: SyntheticSpec) -> Path:
    """Write the model described by `spec` to `path` and return the path."""
    path = Path(path)
    arch = spec.architecture
    vocab = spec.vocab()
    if len(vocab.tokens) != spec.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab.tokens)} tokens, spec {spec.vocab_size}")
    config = spec.tensor_config()
    w = GGUFWriter(path, arch)
    _add_model_metadata(w, spec)
    for key, value in vocab.metadata().items():
        add_metadata(w, key, value)
    if spec.chat_template is not None:
        w.add_chat_template(spec.chat_template)
    if spec.pooling_type is not None:
        w.add_uint32(f"{arch}.pooling_type", spec.pooling_type)

    rng = np.random.default_rng(spec.seed)
    plan = []
    for tensor in tensor_plan(config):
        name, shape = tensor.name, tensor.shape
        qtype = spec.weight_type if tensor.matrix else Q.F32
        if len(shape) == 3 and spec.expert_type is not None:
            qtype = spec.expert_type
        if name == "token_embd.weight" and spec.embedding_type is not None:
            qtype = spec.embedding_type
        if name == "output.weight" and spec.output_type is not None:
            qtype = spec.output_type
        block, size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise ValueError(f"{name}: rows of {shape[-1]} values do not fill {qtype.name} "
                             f"blocks of {block}")
        n_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * shape[-1] // block * size
        plan.append((name, shape, qtype))
        dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype, np.uint8)
        raw_shape = shape if dtype is not np.uint8 else (*shape[:-1], shape[-1] // block * size)
        w.add_tensor_info(name, raw_shape, np.dtype(dtype), n_bytes,
                          raw_dtype=None if dtype is not np.uint8 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    short, long = longrope_factors(spec)
    fixed = {"rope_freqs.weight": lambda: llama3_rope_factors(spec),
             "rope_factors_short.weight": lambda: short, "rope_factors_long.weight": lambda: long}
    for name, shape, qtype in plan:
        if spec.uniform_init and len(shape) >= 2 and qtype in RANDOM_BYTE_TYPES:
            w.write_tensor_data(_random_block_matrix(name, shape, qtype, rng))
            continue
        values = (fixed[name]() if name in fixed else
                  _values(name, shape, rng, spec.uniform_init, spec.output_scale))
        w.write_tensor_data(_encode(values, qtype, rng))
    w.close()
    return path


def add_metadata(w: GGUFWriter, key: str, value: object) -> None:
    """One metadata key/value, typed as llama.cpp reads it (ints as uint32)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value) if not isinstance(value, np.ndarray) else value.tolist())
