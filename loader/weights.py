"""Model weights: which tensors a model has, their expected shapes, and dequantization.

`ModelWeights` is generic in what a weight *is*: float32 numpy arrays on the cpu backend,
device buffers on cuda. The structure (names, shapes, which are optional) is decided once
here from the config, and each backend supplies the function that turns a tensor of the
file into its own handle, so the set of tensors is never listed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eagerlm.loader import ggml_quants
from eagerlm.loader.architectures import architecture
from eagerlm.loader.config import ModelConfig
from eagerlm.loader.errors import GGUFFormatError, UnsupportedTensorType, quoted
from eagerlm.loader.gguf_file import GGUFFile, TensorInfo

T = TypeVar("T")

Q = GGMLQuantizationType
# Types we read (dequantized in numpy by gguf-py's reference, or loader/ggml_quants.py's
# ports of ggml's for those gguf-py cannot); anything else is refused by name.
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M,
    Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4, Q.Q1_0,
})


@dataclass
class MoEWeights(Generic[T]):
    """A layer's mixture of experts: the router `[n_experts, d_model]`, and each expert
    matrix as one 3-D tensor of the file, `[n_experts, out, in]` (ffn_*_exps; the backend's
    handle keeps it in its blocks and hands out one expert's matrix as a view). Biases
    (gpt-oss) are `[n_experts]` for the router and `[n_experts, out]` for the experts; a
    shared expert (dense, on every token) has its three matrices and optionally a gate
    vector `[1, d_model]` (ffn_gate_inp_shexp)."""

    router: T
    gate: T
    up: T
    down: T
    router_bias: T | None = None
    gate_bias: T | None = None
    up_bias: T | None = None
    down_bias: T | None = None
    shared_gate: T | None = None
    shared_up: T | None = None
    shared_down: T | None = None
    shared_router: T | None = None


@dataclass
class LayerWeights(Generic[T]):
    attn_norm: T
    wq: T
    wk: T
    wv: T
    wo: T
    ffn_norm: T
    w_gate: T | None = None  # the dense FFN (None where the layer is a mixture of experts)
    w_up: T | None = None
    w_down: T | None = None
    bq: T | None = None
    bk: T | None = None
    bv: T | None = None
    bo: T | None = None
    q_norm: T | None = None
    k_norm: T | None = None
    post_attn_norm: T | None = None
    post_ffn_norm: T | None = None
    sinks: T | None = None  # attention sinks: one logit per query head
    moe: MoEWeights[T] | None = None


@dataclass
class ModelWeights(Generic[T]):
    token_embd: T
    output_norm: T
    output: T  # the lm head; the same object as token_embd when tied
    layers: list[LayerWeights[T]]
    rope_freq_factors: T | None = None
    # LongRoPE's divisors for contexts up to the original one and beyond it
    rope_factors_short: T | None = None
    rope_factors_long: T | None = None

    def handles(self) -> Iterator[T]:
        """Every distinct weight handle once (for freeing device memory, counting bytes)."""
        seen: set[int] = set()
        tops = [self.token_embd, self.output_norm, self.output, self.rope_freq_factors,
                self.rope_factors_short, self.rope_factors_long]
        for w in tops + [w for lw in self.layers for w in _layer_handles(lw)]:
            if w is not None and id(w) not in seen:
                seen.add(id(w))
                yield w

    def decode_bytes(self) -> int:
        """The bytes of the weights a decode step reads: every handle's but a token
        embedding's that is not also the lm head (a step looks up a row or two of it).
        A mixture's experts count whole, of which a step reads a few."""
        return sum(getattr(h, "nbytes", 0) for h in self.handles()
                   if h is not self.token_embd or h is self.output)


def _layer_handles(lw: LayerWeights[T]) -> Iterator[T | None]:
    for fl in fields(lw):
        if fl.name != "moe":
            yield getattr(lw, fl.name)
    if lw.moe is not None:
        yield from (getattr(lw.moe, fl.name) for fl in fields(lw.moe))


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a model's file holds: its name, numpy shape, whether it is a weight
    matrix (written in the file's weight type; otherwise float32), and the weight fields
    it fills: `(field, rows)` pairs, `rows` None for the whole tensor or the row range of a
    fused tensor (phi3's attn_qkv holds Q, K and V rows). A field is a `LayerWeights` or
    `ModelWeights` attribute, or `moe.<attribute>` of the layer's `MoEWeights`."""

    name: str
    shape: tuple[int, ...]
    matrix: bool
    parts: tuple[tuple[str, tuple[int, int] | None], ...]
    layer: int | None = None


def tensor_plan(cfg: ModelConfig) -> list[PlannedTensor]:
    """Every tensor the config implies, in the order the synthetic writer writes them
    (loader/synthetic.py mirrors this reader through it): the one list of a model's
    tensors, their names (the architecture's, loader/architectures.py) and shapes."""
    arch = architecture(cfg.architecture)
    d, qd, kvd, hd = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    plan: list[PlannedTensor] = []

    def add(name: str, shape: tuple[int, ...], target: str | None = None, *,
            matrix: bool = False, layer: int | None = None,
            parts: tuple[tuple[str, tuple[int, int] | None], ...] | None = None) -> None:
        plan.append(PlannedTensor(name, shape, matrix, parts or ((target or "", None),),
                                  layer))

    add("token_embd.weight", (cfg.vocab_size, d), "token_embd", matrix=True)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."

        def tensor(role: str, shape: tuple[int, ...], target: str, matrix: bool = False,
                   suffix: str = "weight", p: str = p, i: int = i) -> None:
            add(f"{p}{arch.tensor(role)}.{suffix}", shape, target, matrix=matrix, layer=i)

        tensor("attn_norm", (d,), "attn_norm")
        if cfg.fused_qkv:
            add(f"{p}attn_qkv.weight", (qd + 2 * kvd, d), matrix=True, layer=i,
                parts=(("wq", (0, qd)), ("wk", (qd, qd + kvd)),
                       ("wv", (qd + kvd, qd + 2 * kvd))))
        else:
            tensor("attn_q", (qd, d), "wq", True)
            tensor("attn_k", (kvd, d), "wk", True)
            tensor("attn_v", (kvd, d), "wv", True)
        if cfg.qkv_bias:
            tensor("attn_q", (qd,), "bq", suffix="bias")
            tensor("attn_k", (kvd,), "bk", suffix="bias")
            tensor("attn_v", (kvd,), "bv", suffix="bias")
        if cfg.qk_norm:
            tensor("attn_q_norm", (hd,), "q_norm")
            tensor("attn_k_norm", (hd,), "k_norm")
        tensor("attn_output", (d, qd), "wo", True)
        if cfg.attn_output_bias:
            tensor("attn_output", (d,), "bo", suffix="bias")
        if cfg.attn_sinks:
            tensor("attn_sinks", (cfg.n_heads,), "sinks")
        if cfg.post_norms:
            tensor("post_attention_norm", (d,), "post_attn_norm")
        tensor("ffn_norm", (d,), "ffn_norm")
        if cfg.moe is not None:
            m = cfg.moe
            e, ff = m.n_experts, m.d_ff
            tensor("ffn_gate_inp", (e, d), "moe.router")
            if m.biases:
                tensor("ffn_gate_inp", (e,), "moe.router_bias", suffix="bias")
            tensor("ffn_gate_exps", (e, ff, d), "moe.gate", True)
            tensor("ffn_up_exps", (e, ff, d), "moe.up", True)
            tensor("ffn_down_exps", (e, d, ff), "moe.down", True)
            if m.biases:
                tensor("ffn_gate_exps", (e, ff), "moe.gate_bias", suffix="bias")
                tensor("ffn_up_exps", (e, ff), "moe.up_bias", suffix="bias")
                tensor("ffn_down_exps", (e, d), "moe.down_bias", suffix="bias")
            if m.d_ff_shared:
                if m.shared_gate:
                    tensor("ffn_gate_inp_shexp", (1, d), "moe.shared_router")
                tensor("ffn_gate_shexp", (m.d_ff_shared, d), "moe.shared_gate", True)
                tensor("ffn_up_shexp", (m.d_ff_shared, d), "moe.shared_up", True)
                tensor("ffn_down_shexp", (d, m.d_ff_shared), "moe.shared_down", True)
        elif cfg.fused_gate_up:
            add(f"{p}ffn_up.weight", (2 * cfg.d_ff, d), matrix=True, layer=i,
                parts=(("w_gate", (0, cfg.d_ff)), ("w_up", (cfg.d_ff, 2 * cfg.d_ff))))
            tensor("ffn_down", (d, cfg.d_ff), "w_down", True)
        else:
            tensor("ffn_gate", (cfg.d_ff, d), "w_gate", True)
            tensor("ffn_up", (cfg.d_ff, d), "w_up", True)
            tensor("ffn_down", (d, cfg.d_ff), "w_down", True)
        if cfg.post_norms:
            tensor("post_ffw_norm", (d,), "post_ffn_norm")
    add("output_norm.weight", (d,), "output_norm")
    if not cfg.tied_embeddings:
        add("output.weight", (cfg.vocab_size, d), "output", matrix=True)
    if cfg.rope_freq_factors:  # last, so the synthetic writer's other draws do not move
        add("rope_freqs.weight", (cfg.rope_dim // 2,), "rope_freq_factors")
    if cfg.long_rope_factors:
        add("rope_factors_long.weight", (cfg.rope_dim // 2,), "rope_factors_long")
        add("rope_factors_short.weight", (cfg.rope_dim // 2,), "rope_factors_short")
    return plan


Fetch = Callable[[TensorInfo], T]


def build_weights(f: GGUFFile, cfg: ModelConfig, fetch: Fetch[T]) -> ModelWeights[T]:
    """Check every tensor the config implies against the file and fetch it.

    `fetch` turns one tensor of the file into the backend's handle (dequantized array,
    uploaded buffer...); a part of a fused tensor is handed over as a tensor of its own
    (`TensorInfo.rows`), so no backend knows about fusion. Every shape and type is checked
    before anything is fetched, so a wrong file fails fast with the tensor's name; so is a
    tensor the model does not use, which llama.cpp refuses too ("wrong number of
    tensors"): a renamed output.weight would otherwise silently tie the lm head to the
    embedding.
    """
    plan = tensor_plan(cfg)
    infos = [_checked(f, t) for t in plan]
    used = {t.name for t in plan}
    unused = [name for name in f.tensors if name not in used]
    if unused:
        raise GGUFFormatError(f"tensor {quoted(unused[0])} is not part of a "
                              f"{cfg.architecture} model ({len(unused)} unused tensors)",
                              path=f.path, field=unused[0])
    top: dict[str, T] = {}
    layer: list[dict[str, T]] = [{} for _ in range(cfg.n_layers)]
    experts: list[dict[str, T]] = [{} for _ in range(cfg.n_layers)]
    for t, info in zip(plan, infos, strict=True):
        for target, rows in t.parts:
            handle = fetch(info if rows is None else info.rows(*rows))
            if t.layer is None:
                top[target] = handle
            elif target.startswith("moe."):
                experts[t.layer][target[4:]] = handle
            else:
                layer[t.layer][target] = handle
    layers = [LayerWeights(**fields_, moe=MoEWeights(**moe) if moe else None)
              for fields_, moe in zip(layer, experts, strict=True)]
    if cfg.tied_embeddings:
        top["output"] = top["token_embd"]
    return ModelWeights(layers=layers, **top)


def _checked(f: GGUFFile, t: PlannedTensor) -> TensorInfo:
    """The file's entry for a planned tensor, its shape and type checked."""
    info = f.tensor_info(t.name)
    if info.shape != t.shape:
        raise GGUFFormatError(f"tensor {t.name!r} has shape {info.shape}, expected {t.shape}",
                              path=f.path, field=t.name)
    if info.qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(
            f"tensor {t.name!r} uses ggml type {info.qtype.name}, which is not supported "
            f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})",
            path=f.path, field=t.name)
    return info


def dequantize(f: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A tensor of the file (or a part of one) as a float32 array of its numpy shape."""
    raw = f.tensor_bytes(info)
    if info.qtype == Q.F32:
        out = raw.view(np.float32).copy()
    elif info.qtype == Q.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif info.qtype == Q.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif info.qtype in SUPPORTED_TYPES:
        out = dequantize_blocks(raw, info.qtype)
    else:
        raise UnsupportedTensorType(f"cannot dequantize ggml type {info.qtype.name}",
                                    path=f.path, field=info.name)
    return out.reshape(info.shape)


_DEQUANT_STEP = 1 << 18  # elements per gguf-py call: cache-sized temporaries


def dequantize_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantized bytes as float32, by gguf-py's own per-block arithmetic (so bit-identical
    to `quants.dequantize`; loader/ggml_quants.py's port of ggml's for the types gguf-py
    cannot dequantize), handed 256k elements per call. gguf-py works through 16 rows
    per numpy pass, and on short rows its per-pass overhead dominated: 2-4x slower, and the
    demo model's Q8_0 embedding (262k rows of 640) alone took 3.6 s to load."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    out = np.empty(len(blocks) * block, np.float32)
    step = max(1, _DEQUANT_STEP // block)
    for start in range(0, len(blocks), step):
        part = blocks[start:start + step]
        out[start * block:(start + len(part)) * block] = \
            ggml_quants.dequantize(part.reshape(1, -1), qtype).reshape(-1)
    return out


def load_numpy_weights(f: GGUFFile, cfg: ModelConfig) -> ModelWeights[np.ndarray]:
    """All weights dequantized to float32, for the cpu backend."""
    return build_weights(f, cfg, lambda info: dequantize(f, info))
