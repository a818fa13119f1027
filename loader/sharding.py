"""Tensor parallelism's split of a model over N devices, as Megatron-LM, nano-vllm and
InfiniLM's llama.cu split it.

Per layer, each device holds:

- attention: its share of the query heads (rows of `attn_q`), of the KV heads (rows of
  `attn_k` / `attn_v`; with fewer KV heads than devices each KV head is replicated on the
  devices whose query heads read it) and the matching columns of `attn_output`; its
  partial attention output is summed over the devices by one all-reduce;
- FFN: a share of the hidden features: rows of `ffn_gate` / `ffn_up`, columns of
  `ffn_down`, then one all-reduce;
- norms, QK-norms, rope factors and the token embedding: whole (replicated);
- the lm head: a share of the vocabulary (rows of `output`, or of `token_embd` when tied),
  the shares' logits gathered after it; replicated when the vocabulary does not divide.

Why the embedding is replicated and the lm head is not: a lookup reads a few rows, so a
vocabulary-parallel embedding would save only memory and cost one more all-reduce per
forward (and an offset-aware lookup kernel per block type); the lm head is the largest
product of a small model's decode (the demo model's: 168M of its 268M weights), and
splitting it splits that time (docs/performance.md has the measurement).

Quantized matrices are cut on block boundaries, never dequantized: a row split is always
whole rows; a column split must fall on the boundary of a block of every layer's matrix,
else the model is refused for that N, naming the tensor (`UnevenShard`). The FFN split
need not be even: its shares are whole blocks of `ffn_down`'s rows, as equal as they can
be (Llama 2 7B's 11,008 features are 43 superblocks of 256: 22 and 21 over two devices).
Heads must divide evenly (each device runs the same attention with its own head count).

`ShardedFile` is a view of a GGUFFile that reads each tensor's share: the weight loaders
of both backends (`build_weights` with their `fetch`, the slab loader) read through it
unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from math import lcm
from typing import Any, TypeVar

import numpy as np
from gguf import GGML_QUANT_SIZES

from eagerlm.errors import InvalidParameters
from eagerlm.loader.config import ModelConfig
from eagerlm.loader.gguf_file import GGUFFile, TensorInfo

T = TypeVar("T")

# What each tensor of a layer is cut by: the range of query heads ("q"), KV heads ("kv")
# or FFN features ("ffn") the device holds, along rows (axis 0) or columns (axis 1).
_LAYER_SPLITS: dict[str, tuple[str, int]] = {
    "attn_q.weight": ("q", 0), "attn_q.bias": ("q", 0),
    "attn_k.weight": ("kv", 0), "attn_k.bias": ("kv", 0),
    "attn_v.weight": ("kv", 0), "attn_v.bias": ("kv", 0),
    "attn_output.weight": ("q", 1),
    "ffn_gate.weight": ("ffn", 0), "ffn_up.weight": ("ffn", 0),
    "ffn_down.weight": ("ffn", 1),
}
# Held whole on every device. A tensor in neither table is refused: replicating a tensor
# that feeds an all-reduce would count it N times (a new architecture's tensors need a rule).
_LAYER_WHOLE = frozenset({"attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight",
                          "attn_k_norm.weight", "post_attention_norm.weight",
                          "post_ffw_norm.weight"})
_MODEL_WHOLE = frozenset({"token_embd.weight", "output_norm.weight", "rope_freqs.weight"})


class UnevenShard(InvalidParameters):
    """The model cannot be split over the devices asked for (heads that do not divide, a
    column split inside a quantized block, a tensor without a sharding rule)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="tensor_parallel")


@dataclass(frozen=True)
class Split:
    """A tensor's share: elements start .. stop - 1 along `axis` (0 rows, 1 columns)."""

    axis: int
    start: int
    stop: int


@dataclass(frozen=True)
class Shard:
    """Device `rank` of `size`: the ranges of heads, KV heads, FFN features and lm-head
    rows (vocabulary) it holds."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    vocab_parallel: bool = False  # the lm head is split (else whole on every device)

    @classmethod
    def whole(cls, cfg: ModelConfig) -> Shard:
        """The one device of an unsplit model."""
        return cls(0, 1, (0, cfg.n_heads), (0, cfg.n_kv_heads), (0, cfg.d_ff),
                   (0, cfg.vocab_size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this device's part: its head counts and FFN width (the forward's
        shapes, its KV cache's layout); the vocabulary stays the model's, which is what its
        gathered logits cover."""
        return dataclasses.replace(cfg, n_heads=self.heads[1] - self.heads[0],
                                   n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   d_ff=self.ffn[1] - self.ffn[0])

    def split(self, name: str, head_dim: int) -> Split | None:
        """How tensor `name` is cut for this device; None when it is held whole. Raises
        UnevenShard for a tensor without a rule."""
        if name == "output.weight":
            return Split(0, *self.vocab) if self.vocab_parallel else None
        if name in _MODEL_WHOLE:
            return None
        part = name.split(".", 2)[2] if name.startswith("blk.") and name.count(".") >= 2 \
            else name
        if part in _LAYER_WHOLE:
            return None
        rule = _LAYER_SPLITS.get(part)
        if rule is None:
            raise UnevenShard(f"tensor {name!r} has no tensor-parallel sharding rule; this "
                              f"model cannot run over {self.size} devices")
        what, axis = rule
        lo, hi = {"q": self.heads, "kv": self.kv_heads, "ffn": self.ffn}[what]
        scale = 1 if what == "ffn" else head_dim
        return Split(axis, lo * scale, hi * scale)


def _block(info: TensorInfo) -> int:
    return GGML_QUANT_SIZES[info.qtype][0]


def plan_shards(cfg: ModelConfig, tensors: dict[str, TensorInfo], n: int, *,
                split_lm_head: bool = True) -> list[Shard]:
    """Each device's share of the model over `n` devices, checked against every tensor of
    the file (UnevenShard names what cannot be split). `split_lm_head=False` keeps the lm
    head whole on every device (the measurement's other arm; the module says why not)."""
    if n < 1:
        raise InvalidParameters(f"tensor_parallel must be at least 1, not {n}",
                                param="tensor_parallel")
    if n == 1:
        return [Shard.whole(cfg)]
    if cfg.n_heads % n:
        raise UnevenShard(f"the model's {cfg.n_heads} attention heads "
                          f"({cfg.architecture}.attention.head_count) cannot be split evenly "
                          f"over {n} devices")
    if cfg.n_kv_heads % n and n % cfg.n_kv_heads:
        raise UnevenShard(f"the model's {cfg.n_kv_heads} KV heads "
                          f"({cfg.architecture}.attention.head_count_kv) can be neither split "
                          f"over nor replicated on {n} devices")
    # FFN features in units of whole blocks of every layer's ffn_down rows
    downs = [info for name, info in tensors.items() if name.endswith("ffn_down.weight")]
    unit = lcm(1, *(_block(info) for info in downs))
    units = cfg.d_ff // unit
    if cfg.d_ff % unit or units < n:
        raise UnevenShard(f"tensor {downs[0].name!r} ({downs[0].qtype.name}, blocks of {unit} "
                          f"values) has {units} blocks per row, fewer than the {n} devices")
    vocab_split = split_lm_head and cfg.vocab_size % n == 0
    per_vocab = cfg.vocab_size // n
    heads, kv = cfg.n_heads // n, max(1, cfg.n_kv_heads // n)
    shards = []
    for r in range(n):
        kv_first = r * cfg.n_kv_heads // n  # replicated KV heads: the one its queries read
        shards.append(Shard(
            r, n, (r * heads, (r + 1) * heads), (kv_first, kv_first + kv),
            (r * units // n * unit, (r + 1) * units // n * unit),
            (r * per_vocab, (r + 1) * per_vocab) if vocab_split else (0, cfg.vocab_size),
            vocab_split))
    for info in tensors.values():  # every tensor has a rule; column splits on block bounds
        for s in shards:
            cut = s.split(info.name, cfg.head_dim)
            if cut is not None and cut.axis == 1 and (cut.start % _block(info)
                                                      or cut.stop % _block(info)):
                raise UnevenShard(
                    f"tensor {info.name!r} ({info.qtype.name}, blocks of {_block(info)} "
                    f"values) cannot be split over {n} devices on block boundaries: device "
                    f"{s.rank} would hold its columns {cut.start} .. {cut.stop - 1}")
    return shards


def shard_info(info: TensorInfo, cut: Split | None) -> TensorInfo:
    """The header entry of a tensor's share (offset 0: it is read by `shard_bytes`)."""
    if cut is None:
        return info
    shape = list(info.shape)
    shape[len(shape) - 1 if len(shape) == 1 else cut.axis] = cut.stop - cut.start
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    n = int(np.prod(shape))
    return dataclasses.replace(info, shape=tuple(shape), n_bytes=n // block * type_size)


def shard_bytes(raw: np.ndarray, info: TensorInfo, cut: Split | None) -> np.ndarray:
    """A tensor's share of its raw bytes (`raw` as the file stores it), whole blocks: a
    view for rows, a copy of each row's blocks for columns."""
    if cut is None:
        return raw
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    if len(info.shape) == 1:
        return raw[cut.start // block * type_size:cut.stop // block * type_size]
    rows = raw.reshape(info.shape[0], -1)
    if cut.axis == 0:
        return rows[cut.start:cut.stop].reshape(-1)
    return np.ascontiguousarray(
        rows[:, cut.start // block * type_size:cut.stop // block * type_size]).reshape(-1)


class ShardedFile:
    """A GGUFFile as one device's loader sees it: `tensor_info` is the file's entry (so
    `build_weights` checks the file's shapes), `shard_info` the device's share, and
    `tensor_bytes` reads only that share."""

    def __init__(self, f: GGUFFile, shard: Shard, head_dim: int) -> None:
        self.file = f
        self.shard = shard
        self.path = f.path
        self.tensors = f.tensors
        self._cuts = {name: shard.split(name, head_dim) for name in f.tensors}

    def tensor_info(self, name: str) -> TensorInfo:
        return self.file.tensor_info(name)

    def shard_info(self, name: str) -> TensorInfo:
        return shard_info(self.file.tensor_info(name), self._cuts[name])

    def tensor_bytes(self, tensor: str | TensorInfo) -> np.ndarray:
        """The device's share of a tensor's bytes, by name or by its (share's) entry."""
        name = tensor if isinstance(tensor, str) else tensor.name
        return shard_bytes(self.file.tensor_bytes(name), self.file.tensor_info(name),
                           self._cuts[name])

    def drop_pages(self, tensor: str | TensorInfo) -> None:
        self.file.drop_pages(tensor if isinstance(tensor, str) else tensor.name)

    def fetching(self, fetch: Callable[[TensorInfo], T]) -> Callable[[TensorInfo], T]:
        """`fetch` handed each tensor's share instead of the file's entry."""
        return lambda info: fetch(self.shard_info(info.name))

    def __getattr__(self, name: str) -> Any:  # metadata and the rest: the file's
        return getattr(self.file, name)
