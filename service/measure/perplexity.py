"""Perplexity computed the way llama.cpp's `llama-perplexity` computes it.

So that figures compare directly with llama.cpp's: the whole text is tokenized once (with
BOS when the model adds one), cut into `n_tokens // ctx` chunks of `ctx` tokens, the first
token of each chunk replaced by BOS, each chunk evaluated in a fresh context, and only the
second half of each chunk scored (tokens with at least ctx/2 tokens of context).

It runs on either backend: the forward is the transformer's, the chunk's KV cache its
backend's `contiguous_kv`, the logits brought to the host by its `to_numpy` (float32 on
both; cuda computes in bf16, so its value differs from the cpu's by bf16 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eagerlm.errors import InvalidParameters
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.model import Transformer
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.vmm.kv_layout import KVLayout


@dataclass
class PerplexityResult:
    perplexity: float
    n_tokens: int
    n_chunks: int
    n_scored: int
    chunk_nll: list[float]  # mean negative log-likelihood of each chunk's scored tokens


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def perplexity(transformer: Transformer, tokenizer: Tokenizer, text: str, ctx: int,
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Perplexity of `text` (as llama-perplexity reads a file: one trailing newline
    dropped). `on_chunk(i, running_ppl)` is called after each chunk."""
    cfg = transformer.config
    text = text.removesuffix("\n")
    tokens = tokenizer.encode(text, add_special=True)
    bos_id = tokenizer.bos_id if tokenizer.add_bos else None
    if ctx < 4:
        raise InvalidParameters(f"--ctx must be at least 4, got {ctx}")
    cfg.context_for(ctx)  # ContextTooLong past what the model (and its rope scaling) supports
    n_chunks = len(tokens) // ctx
    if n_chunks == 0:
        raise InvalidParameters(f"the text has {len(tokens)} tokens, fewer than one chunk of "
                                f"{ctx}")
    first = ctx // 2
    ops = transformer.ops
    # one cache for every chunk: each is a fresh context from position 0, which
    # overwrites what the previous chunk wrote before attention reads it
    kv = ops.contiguous_kv(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), ctx)
    chunk_nll: list[float] = []
    total = 0.0
    for c in range(n_chunks):
        chunk = np.array(tokens[c * ctx:(c + 1) * ctx], dtype=np.int32)
        targets = chunk[first + 1:].copy()
        if bos_id is not None:
            chunk[0] = bos_id
        rows = np.arange(first, ctx - 1, dtype=np.int64)
        batch = ForwardBatch.single(chunk, 0, kv, logit_rows=rows)
        logp = log_softmax(ops.to_numpy(transformer.forward(batch)))
        nll = -logp[np.arange(len(rows)), targets]
        total += float(nll.sum())
        chunk_nll.append(float(nll.mean()))
        if on_chunk is not None:
            on_chunk(c, math.exp(total / ((c + 1) * len(rows))))
    kv.free()  # after to_numpy, which waited for the last forward
    n_scored = n_chunks * (ctx - 1 - first)
    return PerplexityResult(math.exp(total / n_scored), len(tokens), n_chunks, n_scored,
                            chunk_nll)
