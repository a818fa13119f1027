"""Corrupt variants of a valid GGUF file, for tests/test_gguf_corrupt.py.

The layout of the valid file (the offset of every field) is read with gguf-py's
`GGUFReader`, a parser independent of ours. Each `Case` patches one field in place (same
size) or rewrites a value (another type or length: the header is re-emitted and the data
section kept, re-aligned), and says what loading the result must do.
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model

V = GGUFValueType
U32_MAX, U64_MAX, I64_MAX = (1 << 32) - 1, (1 << 64) - 1, (1 << 63) - 1
ARCH = "llama"

_FORMATS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
            V.INT32: "<i", V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q",
            V.FLOAT64: "<d"}


# -- the valid file's layout, from gguf-py ---------------------------------------------


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + size) of the file."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Field:
    """One key/value pair or tensor info: where it starts and ends and where its parts lie
    (gguf-py's `ReaderField.parts`, in file order)."""

    name: str
    start: int
    parts: tuple[Span, ...]

    @property
    def end(self) -> int:
        return self.parts[-1].end


@dataclass(frozen=True)
class Layout:
    """A valid file's bytes and the place of every header field in them."""

    data: bytes
    kvs: dict[str, Field]
    tensors: dict[str, Field]
    header_end: int  # end of the last tensor info
    data_offset: int  # start of the aligned data section

    @classmethod
    def of_model(cls, architecture: str = ARCH, **spec: object) -> Layout:
        """The layout of a tiny synthetic model (loader/synthetic.py)."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "valid.gguf"
            return cls.read(write_synthetic_model(path, tiny_spec(architecture, **spec)))

    @classmethod
    def of_bytes(cls, data: bytes) -> Layout:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.gguf"
            path.write_bytes(data)
            return cls.read(path)

    @classmethod
    def read(cls, path: Path) -> Layout:
        reader = GGUFReader(path)

        def field(name: str, f) -> Field:
            spans, at = [], f.offset
            for part in f.parts:
                spans.append(Span(at, part.nbytes))
                at += part.nbytes
            return Field(name, f.offset, tuple(spans))

        kvs = {k: field(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        tensors = {t.name: field(t.name, t.field) for t in reader.tensors}
        header_end = max(f.end for f in tensors.values())
        return cls(path.read_bytes(), kvs, tensors, header_end, reader.data_offset)

    # -- making corrupt variants -----------------------------------------------------

    def patched(self, at: int, fmt: str, value: object) -> bytes:
        """The file with one field overwritten in place (same size)."""
        raw = struct.pack(fmt, value)
        return self.data[:at] + raw + self.data[at + len(raw):]

    def with_header(self, header: bytes) -> bytes:
        """A file of `header` (magic to the last tensor info) and this file's data
        section, re-aligned: tensor offsets are relative to the data section."""
        return header + b"\0" * (-len(header) % 32) + self.data[self.data_offset:]

    def kv_value_type_at(self, key: str) -> int:
        return self.kvs[key].parts[2].offset

    def with_value(self, key: str, vtype: V, payload: bytes) -> bytes:
        """The file with the value of `key` (its type and bytes) replaced."""
        kv = self.kvs[key]
        at = self.kv_value_type_at(key)
        header = self.data[:at] + struct.pack("<I", vtype) + payload
        return self.with_header(header + self.data[kv.end:self.header_end])

    def with_extra_kv(self, kv: bytes) -> bytes:
        """The file with one more key/value pair (after the others)."""
        n_kv = struct.unpack_from("<Q", self.data, 16)[0]
        last_kv = max(f.end for f in self.kvs.values())
        header = (self.data[:16] + struct.pack("<Q", n_kv + 1) + self.data[24:last_kv] + kv
                  + self.data[last_kv:self.header_end])
        return self.with_header(header)


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def scalar(vtype: V, value: object) -> bytes:
    return struct.pack(_FORMATS[vtype], value)


def array(etype: V, items: list) -> bytes:
    body = struct.pack("<IQ", etype, len(items))
    if etype == V.STRING:
        return body + b"".join(gguf_string(s) for s in items)
    return body + b"".join(struct.pack(_FORMATS[etype], x) for x in items)


def kv_bytes(key: str, vtype: V, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + payload


# -- the cases -------------------------------------------------------------------------

ERROR, HARMLESS, UNDETECTED = "error", "harmless", "undetected"


@dataclass(frozen=True)
class Case:
    """A corrupt variant of the valid file and what loading it must do: ERROR (a typed,
    short error), HARMLESS (loads: the change means nothing to the model) or UNDETECTED
    (loads, wrongly: a change no check can see without refusing files llama.cpp loads)."""

    name: str
    build: Callable[[Layout], bytes]
    expect: str = ERROR


def _header_cases() -> list[Case]:
    cases = [Case("magic", lambda lay: b"GGUX" + lay.data[4:])]
    for version in (0, 1, 4, U32_MAX):
        cases.append(Case(f"version-{version}", lambda lay, v=version: lay.patched(4, "<I", v)))
    # v2 and v3 are the same layout on a little-endian machine
    cases.append(Case("version-2", lambda lay: lay.patched(4, "<I", 2), HARMLESS))
    for name, at in (("tensor_count", 8), ("kv_count", 16)):
        for label, change in (("zero", lambda n: 0), ("plus-1", lambda n: n + 1),
                              ("minus-1", lambda n: n - 1), ("u64-max", lambda n: U64_MAX),
                              ("i64-max", lambda n: I64_MAX), ("2^32-1", lambda n: U32_MAX)):
            cases.append(Case(f"{name}-{label}", lambda lay, at=at, change=change: lay.patched(
                at, "<Q", change(struct.unpack_from("<Q", lay.data, at)[0]))))
    return cases


def _string_length_cases(prefix: str, span_of: Callable[[Layout], Span]) -> list[Case]:
    """A string's u64 length (`span_of`: where the length lies): zero, one more, past the
    end of the file, 200 MB, 2^63-1 and 2^64-1."""
    out = []
    for label, change in (("zero", lambda n, left: 0), ("plus-1", lambda n, left: n + 1),
                          ("past-eof", lambda n, left: n + left + 1),
                          ("200MB", lambda n, left: 200 << 20),
                          ("i64-max", lambda n, left: I64_MAX),
                          ("u64-max", lambda n, left: U64_MAX)):
        def build(lay: Layout, change=change) -> bytes:
            span = span_of(lay)
            n = struct.unpack_from("<Q", lay.data, span.offset)[0]
            return lay.patched(span.offset, "<Q", change(n, len(lay.data) - span.end))
        out.append(Case(f"{prefix}-{label}", build))
    return out


KEYS_WITH_STRING_VALUES = ("general.architecture", "general.name", "tokenizer.ggml.model",
                           "tokenizer.ggml.pre")
ARRAY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges")


def _kv_structure_cases(keys: list[str]) -> list[Case]:
    """The framing of every key/value pair: key length, key bytes, value type, string
    lengths, array element types and lengths."""
    cases = []
    for key in keys:
        cases += _string_length_cases(f"kv[{key}].key-length",
                                      lambda lay, k=key: lay.kvs[k].parts[0])
        for vtype in (13, 0x100, U32_MAX):
            cases.append(Case(f"kv[{key}].value-type-{vtype}", lambda lay, k=key, t=vtype:
                              lay.patched(lay.kv_value_type_at(k), "<I", t)))
    for key in KEYS_WITH_STRING_VALUES:
        cases += _string_length_cases(f"kv[{key}].string-length",
                                      lambda lay, k=key: lay.kvs[k].parts[3])
    for key in ARRAY_KEYS:
        def etype_at(lay: Layout, k: str = key) -> int:
            return lay.kvs[k].parts[3].offset

        def count_at(lay: Layout, k: str = key) -> int:
            return lay.kvs[k].parts[4].offset

        for label, etype in (("unknown", 13), ("array", V.ARRAY), ("u32-max", U32_MAX),
                             ("uint8", V.UINT8), ("uint64", V.UINT64), ("string", V.STRING),
                             ("float32", V.FLOAT32), ("int32", V.INT32)):
            cases.append(Case(f"kv[{key}].element-type-{label}", lambda lay, at=etype_at,
                              t=etype: lay.patched(at(lay), "<I", t)))
        cases = [c for c in cases if not _is_same_type(c.name)]
        for label, change in (("zero", lambda n, left: 0), ("minus-1", lambda n, left: n - 1),
                              ("plus-1", lambda n, left: n + 1),
                              ("past-eof", lambda n, left: n + left),
                              ("i64-max", lambda n, left: I64_MAX),
                              ("u64-max", lambda n, left: U64_MAX)):
            def build(lay: Layout, at=count_at, change=change) -> bytes:
                offset = at(lay)
                n = struct.unpack_from("<Q", lay.data, offset)[0]
                return lay.patched(offset, "<Q", change(n, len(lay.data) - offset))
            cases.append(Case(f"kv[{key}].array-length-{label}", build))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        cases += _string_length_cases(f"kv[{key}].first-element-length",
                                      lambda lay, k=key: lay.kvs[k].parts[5])
    return cases


_SAME_TYPES = {"tokenizer.ggml.tokens": "string", "tokenizer.ggml.merges": "string",
               "tokenizer.ggml.scores": "float32", "tokenizer.ggml.token_type": "int32"}


def _is_same_type(name: str) -> bool:
    """An element-type "flip" to the type the array already has is no corruption."""
    return any(name == f"kv[{k}].element-type-{t}" for k, t in _SAME_TYPES.items())


def _key_bytes_cases() -> list[Case]:
    def renamed(key: str, new: str) -> Callable[[Layout], bytes]:
        assert len(new) == len(key)

        def build(lay: Layout) -> bytes:
            at = lay.kvs[key].parts[1].offset
            return lay.data[:at] + new.encode() + lay.data[at + len(new):]
        return build

    a = ARCH
    return [
        # a required key under another name is a missing key
        Case("key-bytes-block_count-renamed", renamed(f"{a}.block_count", f"{a}.block_counx")),
        # the same key twice (llama.cpp refuses duplicates)
        Case("key-bytes-duplicate-key", renamed(f"{a}.attention.key_length",
                                                f"{a}.attention.head_count")),
        Case("key-bytes-invalid-utf8", lambda lay: lay.patched(
            lay.kvs[f"{a}.block_count"].parts[1].offset, "<B", 0xFF)),
        # a key nothing reads: its name means nothing
        Case("key-bytes-general.name-renamed", renamed("general.name", "general.namx"),
             HARMLESS),
    ]


def _tensor_cases(names: list[str]) -> list[Case]:
    """Each tensor info's name length and bytes, dimension count, dimensions, ggml type and
    data offset."""
    cases = []
    for name in names:
        t = f"tensor[{name}]"
        cases += _string_length_cases(f"{t}.name-length",
                                      lambda lay, n=name: lay.tensors[n].parts[0])
        cases.append(Case(f"{t}.name-renamed", lambda lay, n=name: lay.patched(
            lay.tensors[n].parts[1].offset, "<B", ord("x"))))
        for n_dims in (0, 3, 5, U32_MAX):
            cases.append(Case(f"{t}.n-dims-{n_dims}", lambda lay, n=name, d=n_dims:
                              lay.patched(lay.tensors[n].parts[2].offset, "<I", d)))
        for label, change in (("zero", lambda d: 0), ("double", lambda d: 2 * d),
                              ("half", lambda d: d // 2), ("2^32-1", lambda d: U32_MAX),
                              ("i64-max", lambda d: I64_MAX), ("u64-max", lambda d: U64_MAX)):
            def build(lay: Layout, n=name, change=change) -> bytes:
                at = lay.tensors[n].parts[3].offset
                return lay.patched(at, "<Q", change(struct.unpack_from("<Q", lay.data, at)[0]))
            cases.append(Case(f"{t}.dim0-{label}", build))
        for label, qtype in (("unknown-99", 99), ("u32-max", U32_MAX), ("f16", 1),
                             ("q8_0", 8), ("tq2_0", 35), ("q4_k", 12)):
            # The last tensor in a smaller type: its data ends early, and the rest looks
            # like bytes after the data section, which llama.cpp allows (so do we).
            smaller = name == names[-1] and label in ("f16", "q8_0")
            cases.append(Case(f"{t}.ggml-type-{label}", lambda lay, n=name, q=qtype:
                              lay.patched(lay.tensors[n].parts[4].offset, "<I", q),
                              UNDETECTED if smaller else ERROR))
        for label, change in (("plus-1", lambda o: o + 1), ("plus-alignment", lambda o: o + 32),
                              ("minus-alignment", lambda o: max(0, o - 32)),
                              ("past-eof", lambda o: 1 << 40), ("u64-max", lambda o: U64_MAX)):
            def build(lay: Layout, n=name, change=change) -> bytes:
                at = lay.tensors[n].parts[5].offset
                return lay.patched(at, "<Q", change(struct.unpack_from("<Q", lay.data, at)[0]))
            cases.append(Case(f"{t}.offset-{label}", build))
    # token_embd is first: 32 bytes back is before the data section
    return [c for c in cases if c.name != "tensor[token_embd.weight].offset-minus-alignment"]


def _int_key_cases(key: str, per_layer: bool = False) -> list[Case]:
    """An integer hyper-parameter: another type (float32 with the same bits, string, bool,
    array), zero, negative, and values no model has."""
    k = f"{ARCH}.{key}"

    def value(vtype: V, v: object) -> Callable[[Layout], bytes]:
        return lambda lay: lay.with_value(k, vtype, scalar(vtype, v))

    cases = [
        Case(f"{key}-as-float32", lambda lay: lay.patched(lay.kv_value_type_at(k), "<I",
                                                          V.FLOAT32)),
        Case(f"{key}-as-string", lambda lay: lay.with_value(k, V.STRING, gguf_string("2"))),
        Case(f"{key}-as-bool", value(V.BOOL, True)),
        Case(f"{key}-zero", value(V.UINT32, 0)),
        Case(f"{key}-minus-1", value(V.INT32, -1)),
        Case(f"{key}-2^32-1", value(V.UINT32, U32_MAX)),
        Case(f"{key}-i64-max", value(V.INT64, I64_MAX)),
        Case(f"{key}-u64-max", value(V.UINT64, U64_MAX)),
        Case(f"{key}-as-string-array", lambda lay: lay.with_value(
            k, V.ARRAY, array(V.STRING, ["2", "2"]))),
    ]
    if per_layer:
        cases.append(Case(f"{key}-array-of-wrong-length", lambda lay: lay.with_value(
            k, V.ARRAY, array(V.UINT32, [2, 2, 2]))))
        cases.append(Case(f"{key}-array-with-zero", lambda lay: lay.with_value(
            k, V.ARRAY, array(V.UINT32, [0, 0]))))
        cases.append(Case(f"{key}-array-of-floats", lambda lay: lay.with_value(
            k, V.ARRAY, array(V.FLOAT32, [2.0, 2.0]))))
    else:
        cases.append(Case(f"{key}-as-int-array", lambda lay: lay.with_value(
            k, V.ARRAY, array(V.UINT32, [2, 2]))))
    return cases


def _float_key_cases(key: str) -> list[Case]:
    k = f"{ARCH}.{key}"

    def value(vtype: V, v: object) -> Callable[[Layout], bytes]:
        return lambda lay: lay.with_value(k, vtype, scalar(vtype, v))

    return [
        Case(f"{key}-as-uint32", lambda lay: lay.patched(lay.kv_value_type_at(k), "<I",
                                                         V.UINT32)),
        Case(f"{key}-as-string", lambda lay: lay.with_value(k, V.STRING, gguf_string("1"))),
        Case(f"{key}-negative", value(V.FLOAT32, -1.0)),
        Case(f"{key}-nan", value(V.FLOAT32, float("nan"))),
        Case(f"{key}-inf", value(V.FLOAT32, float("inf"))),
        Case(f"{key}-float64-max", value(V.FLOAT64, sys.float_info.max)),
        Case(f"{key}-as-float-array", lambda lay: lay.with_value(
            k, V.ARRAY, array(V.FLOAT32, [1.0, 1.0]))),
    ]


def _semantic_cases() -> list[Case]:
    a = ARCH
    cases: list[Case] = []
    cases += _int_key_cases("block_count")
    cases += _int_key_cases("embedding_length")
    cases += _int_key_cases("context_length")
    cases += _int_key_cases("attention.key_length")
    cases += _int_key_cases("attention.value_length")
    cases += _int_key_cases("rope.dimension_count")
    cases += _int_key_cases("attention.head_count", per_layer=True)
    cases += _int_key_cases("attention.head_count_kv", per_layer=True)
    cases += _int_key_cases("feed_forward_length", per_layer=True)
    cases += _float_key_cases("rope.freq_base")
    cases += _float_key_cases("attention.layer_norm_rms_epsilon")
    cases += [Case("rope.freq_base-zero", lambda lay: lay.with_value(
        f"{a}.rope.freq_base", V.FLOAT32, scalar(V.FLOAT32, 0.0))),
        Case("rope.freq_base-one", lambda lay: lay.with_value(
            f"{a}.rope.freq_base", V.FLOAT32, scalar(V.FLOAT32, 1.0)))]

    def u32(key: str, v: int, expect: str = ERROR) -> Case:
        return Case(f"{key}-{v}", lambda lay: lay.with_value(
            f"{a}.{key}", V.UINT32, scalar(V.UINT32, v)), expect)

    def extra(name: str, key: str, vtype: V, payload: bytes, expect: str = ERROR) -> Case:
        return Case(name, lambda lay: lay.with_extra_kv(kv_bytes(key, vtype, payload)), expect)

    cases += [
        u32("attention.head_count_kv", 3),  # 4 query heads are not a multiple of 3
        u32("attention.head_count_kv", 8),  # more KV heads than query heads
        u32("embedding_length", 65),  # the tensors say 64
        u32("feed_forward_length", 127),
        u32("attention.head_count", 8),  # 8 heads x head dim 16 != the tensors' 64
        u32("rope.dimension_count", 15),  # odd
        u32("rope.dimension_count", 32),  # more than the head dim
        u32("context_length", 1, HARMLESS),  # short, but a context
        # per-layer values that are the same in every layer, as converters write them
        Case("attention.head_count_kv-per-layer-array", lambda lay: lay.with_value(
            f"{a}.attention.head_count_kv", V.ARRAY, array(V.UINT32, [2, 2])), HARMLESS),
        Case("attention.head_count_kv-as-int64", lambda lay: lay.with_value(
            f"{a}.attention.head_count_kv", V.INT64, scalar(V.INT64, 2)), HARMLESS),
        # tokenizer
        Case("tokens-as-int32-array", lambda lay: lay.with_value(
            "tokenizer.ggml.tokens", V.ARRAY, array(V.INT32, list(range(512))))),
        Case("tokens-empty", lambda lay: lay.with_value(
            "tokenizer.ggml.tokens", V.ARRAY, array(V.STRING, []))),
        Case("scores-as-string-array", lambda lay: lay.with_value(
            "tokenizer.ggml.scores", V.ARRAY, array(V.STRING, ["0"] * 512))),
        Case("token_type-as-float32-array", lambda lay: lay.with_value(
            "tokenizer.ggml.token_type", V.ARRAY, array(V.FLOAT32, [1.0] * 512))),
        Case("merges-as-int32-array", lambda lay: lay.with_value(
            "tokenizer.ggml.merges", V.ARRAY, array(V.INT32, [1, 2]))),
        Case("tokenizer-model-as-uint32", lambda lay: lay.with_value(
            "tokenizer.ggml.model", V.UINT32, scalar(V.UINT32, 1))),
        Case("tokenizer-model-unknown", lambda lay: lay.with_value(
            "tokenizer.ggml.model", V.STRING, gguf_string("x" * 5000))),
        Case("tokenizer-pre-as-array", lambda lay: lay.with_value(
            "tokenizer.ggml.pre", V.ARRAY, array(V.STRING, ["llama-bpe"]))),
        Case("bos_token_id-as-string", lambda lay: lay.with_value(
            "tokenizer.ggml.bos_token_id", V.STRING, gguf_string("1"))),
        Case("add_bos_token-as-uint32", lambda lay: lay.with_value(
            "tokenizer.ggml.add_bos_token", V.UINT32, scalar(V.UINT32, 1))),
        # llama.cpp ignores a special token id past the vocabulary (with a warning)
        Case("bos_token_id-past-vocabulary", lambda lay: lay.with_value(
            "tokenizer.ggml.bos_token_id", V.UINT32, scalar(V.UINT32, U32_MAX)), HARMLESS),
        Case("architecture-as-uint32", lambda lay: lay.with_value(
            "general.architecture", V.UINT32, scalar(V.UINT32, 1))),
        Case("architecture-unknown-and-long", lambda lay: lay.with_value(
            "general.architecture", V.STRING, gguf_string("x" * 100_000))),
        Case("general.name-as-uint8", lambda lay: lay.with_value(
            "general.name", V.UINT8, scalar(V.UINT8, 1))),
        # keys a valid file may hold
        extra("alignment-zero", "general.alignment", V.UINT32, scalar(V.UINT32, 0)),
        extra("alignment-3", "general.alignment", V.UINT32, scalar(V.UINT32, 3)),
        extra("alignment-2^40", "general.alignment", V.UINT64, scalar(V.UINT64, 1 << 40)),
        extra("alignment-as-string", "general.alignment", V.STRING, gguf_string("32")),
        extra("alignment-as-array", "general.alignment", V.ARRAY, array(V.UINT32, [32])),
        extra("alignment-as-float32", "general.alignment", V.FLOAT32, scalar(V.FLOAT32, 32.0)),
        extra("alignment-32", "general.alignment", V.UINT32, scalar(V.UINT32, 32), HARMLESS),
        extra("nested-array", "x.nested", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1)
              + array(V.UINT32, [1])),
        extra("deeply-nested-array", "x.nested", V.ARRAY,
              struct.pack("<IQ", V.ARRAY, 1) * 100_000 + array(V.UINT32, [])),
        extra("unknown-key", "x.unknown", V.UINT32, scalar(V.UINT32, 7), HARMLESS),
        extra("vocab_size-mismatch", f"{a}.vocab_size", V.UINT32, scalar(V.UINT32, 1000)),
        extra("vocab_size-as-string", f"{a}.vocab_size", V.STRING, gguf_string("512")),
        extra("vocab_size-equal", f"{a}.vocab_size", V.UINT32, scalar(V.UINT32, 512),
              HARMLESS),
        extra("rope-scaling-factor-nan", f"{a}.rope.scaling.factor", V.FLOAT32,
              scalar(V.FLOAT32, float("nan"))),
        extra("rope-scaling-factor-negative", f"{a}.rope.scaling.factor", V.FLOAT32,
              scalar(V.FLOAT32, -2.0)),
        extra("rope-scaling-factor-as-string", f"{a}.rope.scaling.factor", V.STRING,
              gguf_string("2")),
        extra("rope-scaling-type-as-uint32", f"{a}.rope.scaling.type", V.UINT32,
              scalar(V.UINT32, 2)),
        extra("rope-scaling-original-context-zero",
              f"{a}.rope.scaling.original_context_length", V.UINT32, scalar(V.UINT32, 0)),
        extra("rope-scaling-attn-factor-nan", f"{a}.rope.scaling.attn_factor", V.FLOAT32,
              scalar(V.FLOAT32, float("nan"))),
        extra("chat-template-as-uint32", "tokenizer.chat_template", V.UINT32,
              scalar(V.UINT32, 1)),
        extra("expert_count-2^32-1", f"{a}.expert_count", V.UINT32, scalar(V.UINT32, U32_MAX)),
        extra("final-logit-softcapping-nan", f"{a}.final_logit_softcapping", V.FLOAT32,
              scalar(V.FLOAT32, float("nan"))),
    ]
    return cases


def _layout_cases() -> list[Case]:
    def padding(lay: Layout) -> bytes:
        assert lay.data_offset > lay.header_end, "the valid file has alignment padding"
        return lay.patched(lay.header_end, "<B", 0x5A)

    return [
        # writers pad with zeros; a byte that is not is header the counts do not cover
        # (with a tensor count one short, the last info, and every tensor 32 bytes off)
        Case("padding-byte", padding),
        Case("truncated-by-one-byte", lambda lay: lay.data[:-1]),
        Case("truncated-in-the-header", lambda lay: lay.data[:lay.header_end - 3]),
        Case("garbage-appended", lambda lay: lay.data + b"\xff" * 100, HARMLESS),
    ]


def all_cases(layout: Layout) -> list[Case]:
    tensor_names = list(layout.tensors)
    some_tensors = [tensor_names[0], tensor_names[len(tensor_names) // 2], tensor_names[-1]]
    return (_header_cases() + _kv_structure_cases(list(layout.kvs)) + _key_bytes_cases()
            + _tensor_cases(some_tensors) + _semantic_cases() + _layout_cases())


# -- loading them ------------------------------------------------------------------


def load_each(paths: list[str]) -> None:
    """Child process: load every file as the CLI does (header, config, tokenizer, the cpu
    weights) and print one JSON line per file: "ok", "error" (a ModelFileError, its
    message) or "crash" (anything else: the exception's type and message)."""
    from eagerlm.loader.errors import ModelFileError
    from eagerlm.service.api.model_loading import open_model

    for path in paths:
        try:
            open_model(path, "cpu").close()
            out = {"outcome": "ok"}
        except ModelFileError as e:
            message = str(e)
            out = {"outcome": "error", "type": type(e).__name__, "message": message[:2000],
                   "length": len(message)}
        except BaseException as e:  # MemoryError, RecursionError...: reported
            out = {"outcome": "crash", "type": type(e).__name__, "message": str(e)[:2000]}
        print(json.dumps({"path": path, **out}), flush=True)
