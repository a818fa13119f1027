"""What each metadata key this engine reads must hold: its type, and the range of values a
real model can have.

The parser (gguf_file.py) checks that a file is well formed; this table checks that what
it holds means something before anything is sized from it. Without it a block count of
2^32-1 built a four-billion-entry tuple, a block count stored as a float read as 0 layers,
and zero heads divided by zero. Types follow llama.cpp, which reads each key as one type
(`llama_model_loader::get_key`) and refuses another, with two leniencies here that change
no value: an integer key may be stored in any integer width (not as a bool or a float), and
a float key as float32 or float64. Per-layer keys (head counts, feed-forward length) may
be one value or an array with one entry per layer, as llama.cpp's `get_key_or_arr` reads
them. Keys absent from the table are not read and not checked.

The bounds are far beyond any real model (llama.cpp itself allows 512 layers) and exist
so that a corrupt value is an error naming the key, never a multi-GB allocation.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from eagerlm.loader.errors import InvalidMetadata
from eagerlm.loader.gguf_file import GGUFFile

V = GGUFValueType

MAX_LAYERS = 4096  # llama.cpp: LLAMA_MAX_LAYERS = 512; the deepest real models have ~130
MAX_WIDTH = 1 << 20  # embedding and feed-forward widths (real: up to ~53k)
MAX_HEADS = 1 << 14  # real: up to 128
MAX_HEAD_DIM = 1 << 14  # real: up to 512
MAX_CONTEXT = 1 << 30  # tokens (real: up to 10M)
MAX_VOCAB = 1 << 24  # tokens (real: up to 262k)
MAX_EXPERTS = 1 << 16  # real: up to 384
MAX_ROPE_BASE = 1e15  # real: up to ~1e8
MAX_FACTOR = 1e6  # rope scaling factors, attention factors, soft-caps


class Kind(enum.Enum):
    """A family of GGUF value types that one key may be stored as."""

    INT = (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)
    FLOAT = (V.FLOAT32, V.FLOAT64)
    BOOL = (V.BOOL,)
    STRING = (V.STRING,)

    @property
    def noun(self) -> str:
        return {"INT": "an integer", "FLOAT": "a float", "BOOL": "a bool",
                "STRING": "a string"}[self.name]

    @property
    def plural(self) -> str:
        return {"INT": "integers", "FLOAT": "floats", "BOOL": "bools",
                "STRING": "strings"}[self.name]


@dataclass(frozen=True)
class KeySpec:
    """What one key holds: a scalar of `kind` (or, with `array`, an array of them; with
    `per_layer`, either a scalar or an array of that kind with one entry per layer), its
    values within [minimum, maximum] (above `minimum` when `exclusive_minimum`), arrays
    with a length within `length`. Floats must also be finite."""

    kind: Kind
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    array: bool = False
    per_layer: Kind | None = None
    length: tuple[int, int] | None = None

    def check(self, f: GGUFFile, key: str, n_layers: int | None) -> None:
        """Raise InvalidMetadata unless the value of `key` in `f` is of this spec."""
        vtype, etype = f.value_types[key]
        value = f.metadata[key]

        def fail(message: str) -> InvalidMetadata:
            return InvalidMetadata(message, path=f.path, field=key)

        if vtype == V.ARRAY and (self.array or self.per_layer is not None):
            kind = self.kind if self.array else self.per_layer
            if etype not in kind.value:
                raise fail(f"stored as an array of {etype.name}, expected an array of "
                           f"{kind.plural}")
            n = len(value)
            if self.length is not None and not self.length[0] <= n <= self.length[1]:
                raise fail(f"an array of {n} entries, expected {self.length[0]} to "
                           f"{self.length[1]}")
            if self.per_layer is not None and n_layers is not None and n != n_layers:
                raise fail(f"{n} per-layer entries for {n_layers} layers")
            if kind in (Kind.INT, Kind.FLOAT) and not self.array and n:
                self._check_range(np.asarray(value), fail)
            return
        if self.array or vtype not in self.kind.value:
            expected = f"an array of {self.kind.plural}" if self.array else self.kind.noun
            raise fail(f"stored as {_type_name(vtype, etype)}, expected {expected}")
        if self.kind in (Kind.INT, Kind.FLOAT):
            self._check_range(np.asarray([value]), fail)

    def _check_range(self, values: np.ndarray, fail: Any) -> None:
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise fail(f"{_first(values, ~np.isfinite(values))} is not a finite number")
        low, high = self.minimum, self.maximum
        if low is not None:
            bad = values <= low if self.exclusive_minimum else values < low
            if bad.any():
                relation = "above" if self.exclusive_minimum else "at least"
                raise fail(f"{_first(values, bad)} is out of range: it must be {relation} "
                           f"{_number(low)}")
        if high is not None and (values > high).any():
            raise fail(f"{_first(values, values > high)} is out of range: it must be at most "
                       f"{_number(high)}")


def _first(values: np.ndarray, mask: np.ndarray) -> str:
    """The first offending value, as a message quotes it."""
    v = values[mask][0]
    return str(int(v)) if values.dtype.kind in "iu" else f"{float(v):g}"


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e12 else f"{bound:g}"


def _type_name(vtype: GGUFValueType, etype: GGUFValueType | None) -> str:
    return f"an array of {etype.name}" if vtype == V.ARRAY and etype is not None else vtype.name


def _count(minimum: int, maximum: int) -> KeySpec:
    return KeySpec(Kind.INT, minimum, maximum)


def _per_layer(minimum: int, maximum: int) -> KeySpec:
    return KeySpec(Kind.INT, minimum, maximum, per_layer=Kind.INT)


def _float(minimum: float, maximum: float, exclusive_minimum: bool = False) -> KeySpec:
    return KeySpec(Kind.FLOAT, minimum, maximum, exclusive_minimum)


STRING = KeySpec(Kind.STRING)
BOOL = KeySpec(Kind.BOOL)
ANY_INT = KeySpec(Kind.INT)

# Keys outside any architecture.
GENERAL_KEYS: Mapping[str, KeySpec] = {
    "general.architecture": STRING,
    "general.name": STRING,
    # general.alignment is checked by the parser, which needs it first
    "tokenizer.ggml.model": STRING,
    "tokenizer.ggml.pre": STRING,
    "tokenizer.ggml.tokens": KeySpec(Kind.STRING, array=True, length=(1, MAX_VOCAB)),
    "tokenizer.ggml.scores": KeySpec(Kind.FLOAT, array=True, length=(0, MAX_VOCAB)),
    "tokenizer.ggml.token_type": KeySpec(Kind.INT, array=True, length=(0, MAX_VOCAB)),
    "tokenizer.ggml.merges": KeySpec(Kind.STRING, array=True),
    # special token ids: any integer; one past the vocabulary is ignored, as llama.cpp does
    **{f"tokenizer.ggml.{name}": ANY_INT for name in (
        "bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id",
        "seperator_token_id", "padding_token_id", "mask_token_id", "fim_pre_token_id",
        "fim_suf_token_id", "fim_mid_token_id", "fim_pad_token_id", "fim_rep_token_id",
        "fim_sep_token_id", "prefix_token_id", "suffix_token_id", "middle_token_id")},
    "tokenizer.ggml.add_bos_token": BOOL,
    "tokenizer.ggml.add_eos_token": BOOL,
    "tokenizer.ggml.add_space_prefix": BOOL,
    "tokenizer.chat_template": STRING,
}

# Keys under "{architecture}.".
ARCH_KEYS: Mapping[str, KeySpec] = {
    "block_count": _count(1, MAX_LAYERS),
    "embedding_length": _count(1, MAX_WIDTH),
    "feed_forward_length": _per_layer(1, MAX_WIDTH),
    "context_length": _count(1, MAX_CONTEXT),
    "vocab_size": _count(1, MAX_VOCAB),
    "attention.head_count": _per_layer(1, MAX_HEADS),
    "attention.head_count_kv": _per_layer(1, MAX_HEADS),
    "attention.key_length": _count(1, MAX_HEAD_DIM),
    "attention.value_length": _count(1, MAX_HEAD_DIM),
    "attention.layer_norm_rms_epsilon": _float(0.0, 1.0),
    "attention.sliding_window": _count(0, MAX_CONTEXT),  # phi-4 files write 0: none
    # gemma3: the period of global layers, or a per-layer bool array (true: sliding window)
    "attention.sliding_window_pattern": KeySpec(Kind.INT, 0, MAX_LAYERS, per_layer=Kind.BOOL),
    "rope.dimension_count": _count(1, MAX_HEAD_DIM),
    # base^(-2i/d) with base <= 1 has no decreasing frequencies (and YaRN divides by ln base)
    "rope.freq_base": _float(1.0, MAX_ROPE_BASE, exclusive_minimum=True),
    "rope.freq_base_swa": _float(1.0, MAX_ROPE_BASE, exclusive_minimum=True),
    "rope.scaling.type": STRING,
    "rope.scaling.factor": _float(0.0, MAX_FACTOR),  # 0: none, as llama.cpp reads it
    "rope.scale_linear": _float(0.0, MAX_FACTOR),
    "rope.scaling.original_context_length": _count(1, MAX_CONTEXT),
    "rope.scaling.attn_factor": _float(0.0, MAX_FACTOR, exclusive_minimum=True),
    "final_logit_softcapping": _float(0.0, MAX_FACTOR),
    "attn_logit_softcapping": _float(0.0, MAX_FACTOR),
    "expert_count": _count(0, MAX_EXPERTS),
    "expert_used_count": _per_layer(0, MAX_EXPERTS),
    "expert_feed_forward_length": _per_layer(1, MAX_WIDTH),
    "expert_shared_feed_forward_length": _count(0, MAX_WIDTH),
    "expert_weights_scale": _float(0.0, MAX_FACTOR),
    "attention.scale": _float(0.0, MAX_FACTOR),
}


def check_metadata(f: GGUFFile) -> None:
    """Check every key of the table that `f` holds, the architecture's keys included, so
    that the config and tokenizer read only values of the right type and range."""
    for key, spec in GENERAL_KEYS.items():
        if key in f.metadata:
            spec.check(f, key, None)
    arch = f.metadata.get("general.architecture")
    if not isinstance(arch, str):
        return  # absent: config_from_gguf says so
    block_count = f"{arch}.block_count"
    n_layers: int | None = None
    if block_count in f.metadata:
        ARCH_KEYS["block_count"].check(f, block_count, None)
        n_layers = int(f.metadata[block_count])
    for name, spec in ARCH_KEYS.items():
        key = f"{arch}.{name}"
        if key in f.metadata:
            spec.check(f, key, n_layers)

