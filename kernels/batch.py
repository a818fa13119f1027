"""What one forward pass computes: a flat batch of tokens from several sessions.

The dispatcher plans rounds in these terms (prefill chunks and decode steps mixed in one
batch); the forward and the ops read nothing else about the sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class SessionKV(Protocol):
    """A session's KV cache as the ops see it: per-layer K and V of shape
    `[capacity, n_kv_heads, head_dim]`, position p at index p."""

    capacity: int

    def k(self, layer: int) -> np.ndarray: ...

    def v(self, layer: int) -> np.ndarray: ...


@dataclass
class SeqSlice:
    """One session's part of a batch: rows [start, start + n_new) of the flat token array
    are its positions n_past .. n_past + n_new - 1."""

    start: int
    n_new: int
    n_past: int
    kv: SessionKV

    @property
    def end(self) -> int:
        return self.start + self.n_new

    @property
    def n_total(self) -> int:
        return self.n_past + self.n_new


@dataclass
class ForwardBatch:
    tokens: np.ndarray  # int32 [T]
    seqs: list[SeqSlice]
    logit_rows: np.ndarray  # int64 [R]: rows of the batch whose next-token logits are wanted
    # A backend's own description of the batch, already on its device (a captured CUDA
    # graph reads every per-round value from fixed buffers): when set, the ops use it
    # instead of deriving one from `seqs`.
    device_meta: Any = None
    positions: np.ndarray = field(init=False)  # int32 [T]
    # What a backend's ops derive from the batch once and reuse in every layer (the cpu
    # backend's table of decode rows, kernels/cpu_attention.py), keyed by its type.
    ops_cache: dict[Any, Any] = field(init=False, default_factory=dict, repr=False,
                                      compare=False)

    def __post_init__(self) -> None:
        total = sum(s.n_new for s in self.seqs)
        if total != len(self.tokens):
            raise ValueError(f"batch has {len(self.tokens)} tokens but its sessions {total}")
        for s in self.seqs:
            if s.n_total > s.kv.capacity:
                raise ValueError(f"session needs {s.n_total} KV slots, has {s.kv.capacity}")
        self.positions = np.concatenate(
            [np.arange(s.n_past, s.n_total, dtype=np.int32) for s in self.seqs]
        ) if self.seqs else np.zeros(0, np.int32)

    @classmethod
    def single(cls, tokens: np.ndarray | list[int], n_past: int, kv: SessionKV,
               logit_rows: np.ndarray | None = None) -> ForwardBatch:
        """One session's next tokens; logits for the given rows (default: the last)."""
        toks = np.asarray(tokens, dtype=np.int32)
        rows = np.array([len(toks) - 1]) if logit_rows is None else logit_rows
        return cls(toks, [SeqSlice(0, len(toks), n_past, kv)], np.asarray(rows, np.int64))
