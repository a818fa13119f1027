"""Reading GGUF files: values as written, and a typed error naming the place for every
kind of broken file. Files here are assembled byte by byte from the GGUF spec, so the
tests do not depend on any writer."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from eagerlm.loader import ggml_quants
from eagerlm.loader.architectures import config_from_gguf
from eagerlm.loader.errors import (
    GGUFFormatError,
    MissingKey,
    UnknownArchitecture,
    UnsupportedTensorType,
)
from eagerlm.loader.gguf_file import GGUFFile
from eagerlm.loader.weights import (
    SUPPORTED_TYPES,
    build_weights,
    dequantize_blocks,
    load_numpy_weights,
)
from tests import block_reference
from tests.block_reference import LLAMA_CPP_TYPES

STRING, ARRAY, UINT32, FLOAT32, BOOL, INT32 = 8, 9, 4, 6, 7, 5
Q = GGMLQuantizationType


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, value) -> bytes:
    out = _str(key) + struct.pack("<I", vtype)
    if vtype == STRING:
        return out + _str(value)
    if vtype == UINT32:
        return out + struct.pack("<I", value)
    if vtype == FLOAT32:
        return out + struct.pack("<f", value)
    if vtype == BOOL:
        return out + struct.pack("<?", value)
    if vtype == ARRAY:
        etype, items = value
        body = struct.pack("<IQ", etype, len(items))
        if etype == STRING:
            return out + body + b"".join(_str(s) for s in items)
        return out + body + np.asarray(items, dtype="<i4" if etype == INT32 else "<f4").tobytes()
    raise AssertionError(vtype)


def gguf_bytes(kvs: list[bytes], tensors: list[tuple[str, list[int], int, bytes]],
               magic: bytes = b"GGUF", version: int = 3) -> bytes:
    """A GGUF file: header, metadata, tensor infos (ne order), aligned data."""
    head = magic + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    infos, data = b"", b""
    for name, ne, ggml_type, payload in tensors:
        infos += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        infos += struct.pack("<IQ", ggml_type, len(data))
        data += payload + b"\0" * (-len(payload) % 32)
    out = head + infos
    return out + b"\0" * (-len(out) % 32) + data


def f32_tensor(name: str, *shape_ne: int) -> tuple[str, list[int], int, bytes]:
    n = int(np.prod(shape_ne))
    return name, list(shape_ne), 0, np.arange(n, dtype="<f4").tobytes()


def llama_kvs(arch: str = "llama", skip: str = "") -> list[bytes]:
    kvs = [
        ("general.architecture", STRING, arch),
        (f"{arch}.block_count", UINT32, 1),
        (f"{arch}.embedding_length", UINT32, 8),
        (f"{arch}.feed_forward_length", UINT32, 16),
        (f"{arch}.attention.head_count", UINT32, 2),
        (f"{arch}.attention.head_count_kv", UINT32, 1),
        (f"{arch}.context_length", UINT32, 64),
        (f"{arch}.attention.layer_norm_rms_epsilon", FLOAT32, 1e-5),
    ]
    return [_kv(*kv) for kv in kvs if kv[0] != skip]


def llama_tensors(d: int = 8, ff: int = 16, vocab: int = 4) -> list:
    return [
        f32_tensor("token_embd.weight", d, vocab),
        f32_tensor("blk.0.attn_norm.weight", d),
        f32_tensor("blk.0.attn_q.weight", d, d),
        f32_tensor("blk.0.attn_k.weight", d, d // 2),
        f32_tensor("blk.0.attn_v.weight", d, d // 2),
        f32_tensor("blk.0.attn_output.weight", d, d),
        f32_tensor("blk.0.ffn_norm.weight", d),
        f32_tensor("blk.0.ffn_gate.weight", d, ff),
        f32_tensor("blk.0.ffn_up.weight", d, ff),
        f32_tensor("blk.0.ffn_down.weight", ff, d),
        f32_tensor("output_norm.weight", d),
    ]


def write(tmp_path, data: bytes):
    p = tmp_path / "m.gguf"
    p.write_bytes(data)
    return p


def test_values_and_tensors_read_back_as_written(tmp_path):
    kvs = llama_kvs() + [_kv("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "▁b", "<0x0A>"])),
                         _kv("tokenizer.ggml.scores", ARRAY, (FLOAT32, [0.5, -1.0, 2.0])),
                         _kv("x.flag", BOOL, True)]
    with GGUFFile.open(write(tmp_path, gguf_bytes(kvs, llama_tensors()))) as f:
        assert f.architecture == "llama"
        assert f.metadata["llama.block_count"] == 1
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "▁b", "<0x0A>"]
        np.testing.assert_array_equal(f.metadata["tokenizer.ggml.scores"], [0.5, -1.0, 2.0])
        assert f.metadata["x.flag"] is True
        info = f.tensor_info("blk.0.ffn_down.weight")
        assert info.shape == (8, 16)  # numpy order: ne reversed
        raw = f.tensor_bytes("blk.0.ffn_down.weight").view("<f4")
        np.testing.assert_array_equal(raw, np.arange(128, dtype=np.float32))
        cfg = config_from_gguf(f)
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 1, 4, 4)
        assert cfg.tied_embeddings


def test_bad_magic(tmp_path):
    with pytest.raises(GGUFFormatError, match="bad magic"):
        GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs(), [], magic=b"GGML")))


def test_not_a_file_and_tiny_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        GGUFFile.open(tmp_path / "missing.gguf")
    with pytest.raises(GGUFFormatError, match="too small"):
        GGUFFile.open(write(tmp_path, b"GGUF"))


def test_unsupported_version(tmp_path):
    with pytest.raises(GGUFFormatError, match="version 7"):
        GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs(), [], version=7)))


@pytest.mark.parametrize("cut", [30, 100, 400])
def test_truncated_header_names_offset(tmp_path, cut):
    data = gguf_bytes(llama_kvs(), llama_tensors())
    with pytest.raises(GGUFFormatError, match="truncated") as e:
        GGUFFile.open(write(tmp_path, data[:cut]))
    assert e.value.offset is not None and e.value.offset <= cut


def test_a_cut_anywhere_in_a_string_array_is_truncation_at_or_before_the_cut(tmp_path):
    head = gguf_bytes([], [])[:24]  # magic, version, 0 tensors, then the count of kvs
    head = head[:16] + struct.pack("<Q", 1)
    kv = _kv("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "▁bc", "", "<0x0A>"]))
    data = head + kv
    GGUFFile.open(write(tmp_path, data + b"\0" * 32)).close()  # whole: reads fine
    for cut in range(len(head) + 30, len(data)):
        with pytest.raises(GGUFFormatError, match="truncated") as e:
            GGUFFile.open(write(tmp_path, data[:cut]))
        assert e.value.offset is not None and e.value.offset <= cut


def test_string_array_pieces_that_are_not_utf8_stay_recoverable(tmp_path):
    kv = _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2)
    kv += struct.pack("<Q", 2) + b"\xe2\x96" + struct.pack("<Q", 1) + b"x"  # half a '▁'
    with GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs() + [kv], llama_tensors()))) as f:
        pieces = f.metadata["tokenizer.ggml.tokens"]
    assert pieces[1] == "x"
    assert pieces[0].encode("utf-8", "surrogateescape") == b"\xe2\x96"


def test_absurd_string_length_in_an_array(tmp_path):
    kv = _str("tokenizer.ggml.tokens") + struct.pack("<IIQQ", ARRAY, STRING, 1, 1 << 62)
    with pytest.raises(GGUFFormatError, match="absurd string length"):
        GGUFFile.open(write(tmp_path, gguf_bytes([kv], [])))


def test_tensor_data_past_end_of_file(tmp_path):
    data = gguf_bytes(llama_kvs(), llama_tensors())
    with pytest.raises(GGUFFormatError, match="past the end") as e:
        GGUFFile.open(write(tmp_path, data[:-16]))
    assert "output_norm.weight" in str(e.value)


@pytest.mark.parametrize("ne", [[0, 4], [1 << 50, 1], [2, 2, 2, 2, 2]])
def test_absurd_shapes(tmp_path, ne):
    t = ("bad.weight", ne, 0, b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="bad.weight"):
        GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs(), [t])))


def test_absurd_array_length(tmp_path):
    kv = _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 60)
    with pytest.raises(GGUFFormatError, match="absurd array length"):
        GGUFFile.open(write(tmp_path, gguf_bytes([kv], [])))


def test_unknown_tensor_type(tmp_path):
    t = ("weird.weight", [32], 99, b"\0" * 64)
    with pytest.raises(UnsupportedTensorType, match="unknown ggml type 99"):
        GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs(), [t])))


def test_known_but_unsupported_tensor_type_is_named(tmp_path):
    tensors = llama_tensors()
    # Q8_K (15): 256-element blocks of 292 bytes; a real type this engine does not run
    tensors[2] = ("blk.0.attn_q.weight", [256, 8], 15, b"\0" * 292 * 8)
    kvs = [k for k in llama_kvs()]
    with GGUFFile.open(write(tmp_path, gguf_bytes(kvs, tensors))) as f:
        cfg = config_from_gguf(f)
        with pytest.raises((UnsupportedTensorType, GGUFFormatError)) as e:
            build_weights(f, cfg, lambda info: None)
        assert "attn_q" in str(e.value)


def test_unsupported_type_with_matching_shape_is_named(tmp_path):
    kvs = [_kv("general.architecture", STRING, "llama"), *llama_kvs()[1:]]
    kvs[2] = _kv("llama.embedding_length", UINT32, 256)
    kvs[3] = _kv("llama.feed_forward_length", UINT32, 256)
    tensors = llama_tensors(d=256, ff=256)
    # Q8_K: a ggml type of known size that only ever holds activations, not in a model
    tensors[2] = ("blk.0.attn_q.weight", [256, 256], 15, b"\0" * 292 * 256)
    with GGUFFile.open(write(tmp_path, gguf_bytes(kvs, tensors))) as f:
        with pytest.raises(UnsupportedTensorType, match="Q8_K"):
            build_weights(f, config_from_gguf(f), lambda info: None)


def test_unknown_architecture(tmp_path):
    with GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs("mamba"), llama_tensors()))) as f:
        with pytest.raises(UnknownArchitecture, match="mamba"):
            config_from_gguf(f)


def test_missing_required_key(tmp_path):
    data = gguf_bytes(llama_kvs(skip="llama.block_count"), llama_tensors())
    with GGUFFile.open(write(tmp_path, data)) as f:
        with pytest.raises(MissingKey, match="llama.block_count"):
            config_from_gguf(f)


def test_missing_tensor(tmp_path):
    tensors = [t for t in llama_tensors() if t[0] != "blk.0.ffn_up.weight"]
    with GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs(), tensors))) as f:
        with pytest.raises(MissingKey, match="blk.0.ffn_up.weight"):
            build_weights(f, config_from_gguf(f), lambda info: None)


def test_wrong_tensor_shape(tmp_path):
    tensors = llama_tensors()
    tensors[7] = f32_tensor("blk.0.ffn_gate.weight", 8, 12)
    with GGUFFile.open(write(tmp_path, gguf_bytes(llama_kvs(), tensors))) as f:
        with pytest.raises(GGUFFormatError, match="ffn_gate"):
            build_weights(f, config_from_gguf(f), lambda info: None)


def test_a_q1_0_tensor_loads_as_llama_cpps_values(tmp_path):
    """Q1_0 (ggml type 41, which gguf-py 0.19 sizes but cannot dequantize) is read like
    every other type: a file whose attn_q is Q1_0 loads, its values llama.cpp's
    (tests/block_reference.py)."""
    kvs = [_kv("general.architecture", STRING, "llama"), *llama_kvs()[1:]]
    kvs[2] = _kv("llama.embedding_length", UINT32, 256)
    kvs[3] = _kv("llama.feed_forward_length", UINT32, 256)
    tensors = llama_tensors(d=256, ff=256)
    raw = block_reference.fixture_blocks(Q.Q1_0, 256 * 256 // 128, np.random.default_rng(0))
    tensors[2] = ("blk.0.attn_q.weight", [256, 256], 41, raw.tobytes())
    with GGUFFile.open(write(tmp_path, gguf_bytes(kvs, tensors))) as f:
        assert f.tensor_info("blk.0.attn_q.weight").qtype == Q.Q1_0
        wq = load_numpy_weights(f, config_from_gguf(f)).layers[0].wq
    want = block_reference.dequantize(raw.reshape(256, -1), Q.Q1_0)
    np.testing.assert_array_equal(wq, want)


def test_q1_0_dequantization_is_llama_cpps_to_the_bit():
    """Reference: llama.cpp's dequantizer on the fixture's blocks, special scales
    (infinities, NaN, signed zeros) included, repeated past two steps of the chunked
    loop."""
    blocks, values = block_reference.llama_cpp_blocks()
    with np.errstate(all="ignore"):
        got = dequantize_blocks(np.tile(blocks, (9, 1)).reshape(-1), Q.Q1_0)
    assert got.dtype == np.float32 and got.size > 2 * (1 << 18)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  np.tile(values, (9, 1)).reshape(-1).view(np.uint32))


def test_q1_0_quantization_is_llama_cpps_to_the_bit():
    """Reference: llama.cpp's `ggml_quantize_chunk` (what `llama-quantize` writes a Q1_0
    file with) on the fixture's rows, a block of zeros and exact zeros among them: what
    loader/synthetic.py writes a Q1_0 model with."""
    with np.load(block_reference.FIXTURE) as f:
        rows, want = f["rows"], f["quantized"]
    np.testing.assert_array_equal(ggml_quants.quantize(rows, Q.Q1_0), want)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES - {0, 1, 30} - LLAMA_CPP_TYPES,
                                         key=int))  # quantized, gguf-py dequantizes them
def test_dequantization_is_gguf_pys_to_the_bit(qtype):
    """Reference: gguf-py's `quants.dequantize`, on random bytes (every bit pattern of
    scales and values; the non-finite results of non-finite scales compare by their bits),
    more blocks than one step of the chunked loop and a partial last step."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = (1 << 19) // block // 3 + 1  # just over 2 steps of 256k elements; 3 blocks a row
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (rows, 3 * type_size), np.uint8)
    with np.errstate(all="ignore"):
        want = quants.dequantize(raw, qtype).reshape(-1)
        got = dequantize_blocks(raw.reshape(-1), qtype)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
