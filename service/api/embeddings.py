"""Text embeddings: a sequence's final hidden states pooled into one unit vector.

Embedding GGUFs say how to pool in `{arch}.pooling_type` (llama.cpp's enum: 1 mean, 2 CLS,
i.e. the first token, 3 last token; Qwen3-Embedding is a qwen3 GGUF with last-token
pooling). Any other model can be asked for embeddings too (llama-server's `--embeddings`):
mean pooling then, unless the file says otherwise. The hidden states are those the lm head
reads (after the output norm, as llama.cpp's embeddings), with the model's own causal
attention; the pooled vector is L2-normalised, as such models' cards prescribe and
llama.cpp does by default.

Each input is one forward over a private contiguous KV cache (as perplexity's chunks), run
on the dispatcher's compute stream between its rounds (`Dispatcher.call_on_every_device`:
with a model split over devices, on every device's), so the ops are never used from two
threads at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from eagerlm.errors import InvalidParameters, UnsupportedModel
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.model import Transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import KVLayout


class Pooling(enum.IntEnum):
    """llama.cpp's `llama_pooling_type`, as GGUF files store it."""

    NONE = 0
    MEAN = 1
    CLS = 2
    LAST = 3
    RANK = 4


def file_pooling(model: ModelFile) -> Pooling | None:
    """The pooling an embedding GGUF declares (None: a file that declares none)."""
    value = model.gguf.metadata.get(f"{model.config.architecture}.pooling_type")
    if value is None:
        return None
    try:
        pooling = Pooling(int(value))
    except ValueError:
        raise UnsupportedModel(f"{model.path}: unknown pooling type {value}",
                               field=f"{model.config.architecture}.pooling_type") from None
    return None if pooling is Pooling.NONE else pooling


def pool(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    """One sequence's hidden states `[n, d]` pooled to `[d]`, L2-normalised."""
    if pooling is Pooling.MEAN:
        v = hidden.mean(axis=0, dtype=np.float64)
    elif pooling is Pooling.CLS:
        v = hidden[0].astype(np.float64)
    elif pooling is Pooling.LAST:
        v = hidden[-1].astype(np.float64)
    else:
        raise UnsupportedModel(f"pooling {pooling.name} gives no embedding")
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)


def embed_ids(transformer: Transformer, ids: Sequence[int], pooling: Pooling) -> np.ndarray:
    """The embedding of one token sequence (blocking; run it where the ops may run)."""
    if not ids:
        raise InvalidParameters("cannot embed an empty input", param="input")
    cfg, ops = transformer.config, transformer.ops
    kv = ops.contiguous_kv(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), len(ids))
    try:
        batch = ForwardBatch.single(np.asarray(ids, np.int32), 0, kv)
        hidden = ops.to_numpy(transformer.hidden_states(batch))
    finally:
        kv.free()
    return pool(hidden.reshape(len(ids), -1), pooling)


__all__ = ["Pooling", "embed_ids", "file_pooling", "pool"]
