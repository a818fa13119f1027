"""Tensor parallelism's split of a model over N devices, as Megatron-LM, nano-vllm and
InfiniLM's llama.cu split it.

Per layer, each device holds:

- attention: its share of the query heads (rows of `attn_q`), of the KV heads (rows of
  `attn_k` / `attn_v`; with fewer KV heads than devices each KV head is replicated on the
  devices whose query heads read it) and the matching columns of `attn_output`; its
  partial attention output is summed over the devices by one all-reduce;
- FFN: a share of the hidden features: rows of `ffn_gate` / `ffn_up`, columns of
  `ffn_down`, then one all-reduce;
- a mixture of experts: of every expert, a share of its features as the dense FFN's
  (rows of its gate / up and their biases, columns of its down), the router whole (every
  device picks the same experts), one all-reduce of the weighted sum; a shared expert as
  the dense FFN;
- gpt-oss's attention sinks: those of its query heads; a bias added after an all-reduced
  product (gpt-oss's attention output and experts' down biases): device 0's, zeros on
  the others, so that it counts once;
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

# What each tensor of a layer is cut by, and along which axis of its numpy shape: the
# range of query heads ("q": head_dim values each; "heads": one value each, gpt-oss's
# sinks), of KV heads ("kv"), of the dense FFN's features ("ffn"), of every expert's
# features ("experts": the rows of each expert's gate / up, `[n_experts, out, in]`, the
# columns of its down) or of the shared expert's ("shared").
_LAYER_SPLITS: dict[str, tuple[str, int]] = {
    "attn_q.weight": ("q", 0), "attn_q.bias": ("q", 0),
    "attn_k.weight": ("kv", 0), "attn_k.bias": ("kv", 0),
    "attn_v.weight": ("kv", 0), "attn_v.bias": ("kv", 0),
    "attn_output.weight": ("q", 1), "attn_sinks.weight": ("heads", 0),
    "ffn_gate.weight": ("ffn", 0), "ffn_up.weight": ("ffn", 0),
    "ffn_down.weight": ("ffn", 1),
    "ffn_gate_exps.weight": ("experts", 1), "ffn_up_exps.weight": ("experts", 1),
    "ffn_down_exps.weight": ("experts", 2),
    "ffn_gate_exps.bias": ("experts", 1), "ffn_up_exps.bias": ("experts", 1),
    "ffn_gate_shexp.weight": ("shared", 0), "ffn_up_shexp.weight": ("shared", 0),
    "ffn_down_shexp.weight": ("shared", 1),
}
# The down product of each kind of FFN range: its columns are cut on block boundaries
_DOWNS = {"ffn": "ffn_down.weight", "experts": "ffn_down_exps.weight",
          "shared": "ffn_down_shexp.weight"}
# Held whole on every device. A tensor in no table is refused: replicating a tensor that
# feeds an all-reduce would count it N times (a new architecture's tensors need a rule).
# The router (and the shared expert's gate) reads the whole hidden state on every device,
# so every device picks the same experts and runs its share of each.
_LAYER_WHOLE = frozenset({"attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight",
                          "attn_k_norm.weight", "post_attention_norm.weight",
                          "post_ffw_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias",
                          "ffn_gate_inp_shexp.weight"})
# Biases added after a product whose output is all-reduced (gpt-oss's): device 0 holds
# them, the others zeros of the same shape, so the sum counts them once.
_LAYER_ONCE = frozenset({"attn_output.bias", "ffn_down_exps.bias"})
_MODEL_WHOLE = frozenset({"token_embd.weight", "output_norm.weight", "rope_freqs.weight"})


class UnevenShard(InvalidParameters):
    """The model cannot be split over the devices asked for (heads that do not divide, a
    column split inside a quantized block, a tensor without a sharding rule)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="tensor_parallel")


@dataclass(frozen=True)
class Split:
    """A tensor's share: elements start .. stop - 1 along `axis` of its numpy shape; or,
    with `zeros`, the whole shape of zeros (a bias another device adds: `_LAYER_ONCE`)."""

    axis: int
    start: int
    stop: int
    zeros: bool = False


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
    # a mixture's features of each expert, and of its shared expert
    experts: tuple[int, int] = (0, 0)
    shared: tuple[int, int] = (0, 0)

    @classmethod
    def whole(cls, cfg: ModelConfig) -> Shard:
        """The one device of an unsplit model."""
        moe = cfg.moe
        return cls(0, 1, (0, cfg.n_heads), (0, cfg.n_kv_heads), (0, cfg.d_ff),
                   (0, cfg.vocab_size), experts=(0, moe.d_ff if moe else 0),
                   shared=(0, moe.d_ff_shared if moe else 0))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this device's part: its head counts and FFN widths (the forward's
        shapes, its KV cache's layout); the vocabulary stays the model's, which is what its
        gathered logits cover."""
        moe = cfg.moe and dataclasses.replace(
            cfg.moe, d_ff=self.experts[1] - self.experts[0],
            d_ff_shared=self.shared[1] - self.shared[0])
        return dataclasses.replace(cfg, n_heads=self.heads[1] - self.heads[0],
                                   n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   d_ff=self.ffn[1] - self.ffn[0], moe=moe)

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
        if part in _LAYER_ONCE:
            return None if self.rank == 0 else Split(0, 0, 0, zeros=True)
        rule = _LAYER_SPLITS.get(part)
        if rule is None:
            raise UnevenShard(f"tensor {name!r} has no tensor-parallel sharding rule; this "
                              f"model cannot run over {self.size} devices")
        what, axis = rule
        lo, hi = {"q": self.heads, "heads": self.heads, "kv": self.kv_heads, "ffn": self.ffn,
                  "experts": self.experts, "shared": self.shared}[what]
        scale = head_dim if what in ("q", "kv") else 1
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
    moe = cfg.moe
    ffn = _feature_ranges(tensors, "ffn", cfg.d_ff, n)
    experts = _feature_ranges(tensors, "experts", moe.d_ff if moe else 0, n)
    shared = _feature_ranges(tensors, "shared", moe.d_ff_shared if moe else 0, n)
    vocab_split = split_lm_head and cfg.vocab_size % n == 0
    per_vocab = cfg.vocab_size // n
    heads, kv = cfg.n_heads // n, max(1, cfg.n_kv_heads // n)
    shards = []
    for r in range(n):
        kv_first = r * cfg.n_kv_heads // n  # replicated KV heads: the one its queries read
        shards.append(Shard(
            r, n, (r * heads, (r + 1) * heads), (kv_first, kv_first + kv), ffn[r],
            (r * per_vocab, (r + 1) * per_vocab) if vocab_split else (0, cfg.vocab_size),
            vocab_split, experts[r], shared[r]))
    for info in tensors.values():  # every tensor has a rule; column splits on block bounds
        for s in shards:
            cut = s.split(info.name, cfg.head_dim)
            if cut is not None and cut.axis == len(info.shape) - 1 and (
                    cut.start % _block(info) or cut.stop % _block(info)):
                raise UnevenShard(
                    f"tensor {info.name!r} ({info.qtype.name}, blocks of {_block(info)} "
                    f"values) cannot be split over {n} devices on block boundaries: device "
                    f"{s.rank} would hold its columns {cut.start} .. {cut.stop - 1}")
    return shards


def _feature_ranges(tensors: dict[str, TensorInfo], kind: str, width: int,
                    n: int) -> list[tuple[int, int]]:
    """Each device's range of an FFN's `width` features (`kind`: the dense FFN, every
    expert, the shared expert), in units of whole blocks of every layer's down product's
    rows, as equal as they can be; the whole range on every device for a model without
    such an FFN (a mixture's dense width)."""
    downs = [info for name, info in tensors.items() if name.endswith(_DOWNS[kind])]
    if not downs:
        return [(0, width)] * n
    unit = lcm(1, *(_block(info) for info in downs))
    units = width // unit
    if width % unit or units < n:
        raise UnevenShard(f"tensor {downs[0].name!r} ({downs[0].qtype.name}, blocks of {unit} "
                          f"values) has {units} blocks per row, fewer than the {n} devices")
    return [(r * units // n * unit, (r + 1) * units // n * unit) for r in range(n)]


def shard_info(info: TensorInfo, cut: Split | None) -> TensorInfo:
    """The header entry of a tensor's share (offset 0: it is read by `shard_bytes`)."""
    if cut is None or cut.zeros:
        return info
    shape = list(info.shape)
    shape[cut.axis] = cut.stop - cut.start
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    n = int(np.prod(shape))
    return dataclasses.replace(info, shape=tuple(shape), n_bytes=n // block * type_size)


def shard_bytes(raw: np.ndarray, info: TensorInfo, cut: Split | None) -> np.ndarray:
    """A tensor's share of its raw bytes (`raw` as the file stores it), whole blocks: a
    view for a range of the first axis, else a copy (each row's blocks for columns, each
    expert's rows for a range of an expert tensor's middle axis); zeros for `cut.zeros`
    (zero bytes are zeros in every ggml type)."""
    if cut is None:
        return raw
    if cut.zeros:
        return np.zeros_like(raw)
    return np.ascontiguousarray(_share_view(raw, info, cut)).reshape(-1)


def _share_view(raw: np.ndarray, info: TensorInfo, cut: Split) -> np.ndarray:
    """The share as a view of `raw`, shaped as the tensor with its last axis in bytes."""
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    *outer, last = info.shape
    values = raw.reshape(*outer, last // block * type_size)
    if cut.axis == len(info.shape) - 1:
        return values[..., cut.start // block * type_size:cut.stop // block * type_size]
    return values[(slice(None),) * cut.axis + (slice(cut.start, cut.stop),)]


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

    def in_place(self, tensor: str | TensorInfo) -> bool:
        """Whether the device's share of a tensor is a view of the file's bytes: the whole
        tensor, or a range of an expert tensor's middle axis (a range of each expert's
        rows: one stretch of each expert's bytes). Any other share is a copy."""
        name = tensor if isinstance(tensor, str) else tensor.name
        cut = self._cuts[name]
        return cut is None or (len(self.file.tensor_info(name).shape) == 3
                               and cut.axis == 1 and not cut.zeros)

    def mapped_bytes(self, tensor: str | TensorInfo) -> np.ndarray:
        """The device's share of a tensor the backend reads in place (GGUFFile's
        `mapped_bytes`): the map itself, `[n_experts, rows, row bytes]` for a range of
        each expert's rows (`in_place`), else a copy (`tensor_bytes`)."""
        name = tensor if isinstance(tensor, str) else tensor.name
        cut = self._cuts[name]
        if cut is None:
            return self.file.mapped_bytes(name)
        if not self.in_place(name):
            return self.tensor_bytes(name)
        return _share_view(self.file.mapped_bytes(name), self.file.tensor_info(name), cut)

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
