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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from eagerlm.loader.config import ModelConfig
from eagerlm.loader.errors import GGUFFormatError, UnsupportedTensorType, quoted
from eagerlm.loader.gguf_file import GGUFFile, TensorInfo

T = TypeVar("T")

Q = GGMLQuantizationType
# Types we dequantize (through gguf-py's numpy reference); anything else is refused by name.
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M,
    Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4,
})


@dataclass
class LayerWeights(Generic[T]):
    attn_norm: T
    wq: T
    wk: T
    wv: T
    wo: T
    ffn_norm: T
    w_gate: T
    w_up: T
    w_down: T
    bq: T | None = None
    bk: T | None = None
    bv: T | None = None
    q_norm: T | None = None
    k_norm: T | None = None
    post_attn_norm: T | None = None
    post_ffn_norm: T | None = None


@dataclass
class ModelWeights(Generic[T]):
    token_embd: T
    output_norm: T
    output: T  # the lm head; the same object as token_embd when tied
    layers: list[LayerWeights[T]]
    rope_freq_factors: T | None = None

    def handles(self) -> Iterator[T]:
        """Every distinct weight handle once (for freeing device memory, counting bytes)."""
        seen: set[int] = set()
        tops = [self.token_embd, self.output_norm, self.output, self.rope_freq_factors]
        for w in tops + [getattr(lw, fl.name) for lw in self.layers for fl in fields(lw)]:
            if w is not None and id(w) not in seen:
                seen.add(id(w))
                yield w


Fetch = Callable[[TensorInfo], T]


def build_weights(f: GGUFFile, cfg: ModelConfig, fetch: Fetch[T]) -> ModelWeights[T]:
    """Check every tensor the config implies against the file and fetch it.

    `fetch` turns one tensor of the file into the backend's handle (dequantized array,
    uploaded buffer...). Every shape and type is checked before anything is fetched, so a
    wrong file fails fast with the tensor's name; so is a tensor the model does not use,
    which llama.cpp refuses too ("wrong number of tensors"): a renamed output.weight would
    otherwise silently tie the lm head to the embedding.
    """
    used: set[str] = set()
    _assemble(f, cfg, lambda info: used.add(info.name))
    unused = [name for name in f.tensors if name not in used]
    if unused:
        raise GGUFFormatError(f"tensor {quoted(unused[0])} is not part of a "
                              f"{cfg.architecture} model ({len(unused)} unused tensors)",
                              path=f.path, field=unused[0])
    return _assemble(f, cfg, fetch)


def _assemble(f: GGUFFile, cfg: ModelConfig, fetch: Fetch[T]) -> ModelWeights[T]:
    """The weights the config implies, each shape and type checked, then fetched."""
    d, qd, kvd = cfg.d_model, cfg.q_dim, cfg.kv_dim

    def get(name: str, shape: tuple[int, ...]) -> T:
        info = f.tensor_info(name)
        if info.shape != shape:
            raise GGUFFormatError(f"tensor {name!r} has shape {info.shape}, expected {shape}",
                                  path=f.path, field=name)
        if info.qtype not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(
                f"tensor {name!r} uses ggml type {info.qtype.name}, which is not supported "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})",
                path=f.path, field=name)
        return fetch(info)

    def maybe(name: str, shape: tuple[int, ...], present: bool) -> T | None:
        if not present:
            return None
        return get(name, shape)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight", (d,)),
            wq=get(p + "attn_q.weight", (qd, d)),
            wk=get(p + "attn_k.weight", (kvd, d)),
            wv=get(p + "attn_v.weight", (kvd, d)),
            wo=get(p + "attn_output.weight", (d, qd)),
            ffn_norm=get(p + "ffn_norm.weight", (d,)),
            w_gate=get(p + "ffn_gate.weight", (cfg.d_ff, d)),
            w_up=get(p + "ffn_up.weight", (cfg.d_ff, d)),
            w_down=get(p + "ffn_down.weight", (d, cfg.d_ff)),
            bq=maybe(p + "attn_q.bias", (qd,), cfg.qkv_bias),
            bk=maybe(p + "attn_k.bias", (kvd,), cfg.qkv_bias),
            bv=maybe(p + "attn_v.bias", (kvd,), cfg.qkv_bias),
            q_norm=maybe(p + "attn_q_norm.weight", (cfg.head_dim,), cfg.qk_norm),
            k_norm=maybe(p + "attn_k_norm.weight", (cfg.head_dim,), cfg.qk_norm),
            post_attn_norm=maybe(p + "post_attention_norm.weight", (d,), cfg.post_norms),
            post_ffn_norm=maybe(p + "post_ffw_norm.weight", (d,), cfg.post_norms),
        ))
    token_embd = get("token_embd.weight", (cfg.vocab_size, d))
    output = token_embd if cfg.tied_embeddings else get("output.weight", (cfg.vocab_size, d))
    return ModelWeights(
        token_embd=token_embd,
        output_norm=get("output_norm.weight", (d,)),
        output=output,
        layers=layers,
        rope_freq_factors=maybe("rope_freqs.weight", (cfg.rope_dim // 2,),
                                cfg.rope_freq_factors),
    )


def dequantize(f: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A tensor of the file as a float32 array of its numpy shape."""
    raw = f.tensor_bytes(info.name)
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
    to `quants.dequantize`), handed 256k elements per call. gguf-py works through 16 rows
    per numpy pass, and on short rows its per-pass overhead dominated: 2-4x slower, and the
    demo model's Q8_0 embedding (262k rows of 640) alone took 3.6 s to load."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    out = np.empty(len(blocks) * block, np.float32)
    step = max(1, _DEQUANT_STEP // block)
    for start in range(0, len(blocks), step):
        part = blocks[start:start + step]
        out[start * block:(start + len(part)) * block] = \
            quants.dequantize(part.reshape(1, -1), qtype).reshape(-1)
    return out


def load_numpy_weights(f: GGUFFile, cfg: ModelConfig) -> ModelWeights[np.ndarray]:
    """All weights dequantized to float32, for the cpu backend."""
    return build_weights(f, cfg, lambda info: dequantize(f, info))
