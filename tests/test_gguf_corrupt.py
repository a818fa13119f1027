"""Hostile and careless model files: every corruption of a valid file's header is a short,
typed error (one line and exit 2 from the CLI), never a traceback, a hang or gigabytes of
memory, and the few corruptions that change nothing the model means still load.

The corrupt files (tests/gguf_corruption.py) come from one valid tiny model. Every case is
loaded in one child process under an address-space limit, so a regression to a multi-GB
allocation fails its case instead of taking down the machine; a representative case of
each kind also runs through the real CLI.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagerlm.loader.errors import InvalidMetadata
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec
from tests.gguf_corruption import (
    ARCH,
    HARMLESS,
    U32_MAX,
    UNDETECTED,
    Layout,
    V,
    all_cases,
    array,
    gguf_string,
    kv_bytes,
    scalar,
)

REPO = Path(__file__).resolve().parent.parent
ADDRESS_SPACE_LIMIT = 3 << 30  # a valid tiny model runs under 1 GiB; a 7 GB peak cannot
CLI_TIMEOUT_S = 60
MAX_MESSAGE_CHARS = 300


# -- running them ----------------------------------------------------------------------


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _child_env() -> dict[str, str]:
    # one BLAS thread: each reserves address space the limit would count
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                         os.environ.get("PYTHONPATH")]))}


def run_cli(path: Path) -> subprocess.CompletedProcess[str]:
    """`eagerlm generate` on `path`, memory- and time-bounded."""
    return subprocess.run(
        [sys.executable, "-m", "eagerlm", "generate", "--model", str(path), "--prompt",
         "hi", "--max-tokens", "1", "--quiet"],
        cwd=REPO, env=_child_env(), preexec_fn=_limit_address_space, capture_output=True,
        text=True, timeout=CLI_TIMEOUT_S)


def _shown(text: str) -> str:
    """`text` cut for an assertion message (a regression could print gigabytes)."""
    return text if len(text) <= 3000 else f"{text[:1500]}... ({len(text)} characters)"


def assert_clean_cli_error(result: subprocess.CompletedProcess[str]) -> None:
    """Exit status 2 and exactly one short line on stderr, the CLI's error line."""
    err = result.stderr
    clean = (result.returncode == 2 and err.count("\n") == 1 and err.endswith("\n")
             and err.startswith("eagerlm: error:") and len(err) < MAX_MESSAGE_CHARS + 20)
    assert clean, f"exit {result.returncode}, stderr: {_shown(err)}"


# made once at collection: the case names depend on the model's keys and tensors
LAYOUT = Layout.of_model()
CASES = all_cases(LAYOUT)


@pytest.fixture(scope="module")
def layout() -> Layout:
    return LAYOUT


@pytest.fixture(scope="module")
def valid_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("valid") / "valid.gguf"
    path.write_bytes(LAYOUT.data)
    return path


@pytest.fixture(scope="module")
def outcomes(layout, tmp_path_factory) -> dict[str, dict]:
    """Every case written to a file and loaded in one child process under the
    address-space limit: case name -> the child's JSON line."""
    folder = tmp_path_factory.mktemp("corrupt")
    files: dict[str, str] = {}
    for i, case in enumerate(all_cases(layout)):
        path = folder / f"c{i:03d}.gguf"
        path.write_bytes(case.build(layout))
        files[str(path)] = case.name
    # the generator module builds nothing on import: the child starts fast
    code = "import sys, tests.gguf_corruption as g; g.load_each(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", code, *files], cwd=REPO, env=_child_env(),
                            preexec_fn=_limit_address_space, capture_output=True, text=True,
                            timeout=300)
    got = {}
    for line in result.stdout.splitlines():
        record = json.loads(line)
        got[files[record.pop("path")]] = record
    if len(got) != len(files):
        missing = [name for name in files.values() if name not in got]
        pytest.fail(f"the child died (exit {result.returncode}) before {missing[0]}: "
                    f"{result.stderr[-3000:]}")
    return got


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corrupt_file_is_a_short_typed_error_or_harmless(case, outcomes):
    got = outcomes[case.name]
    if case.expect in (HARMLESS, UNDETECTED):
        assert got["outcome"] == "ok", got
        return
    assert got["outcome"] == "error", got
    message = got["message"]
    assert "\n" not in message and got["length"] < MAX_MESSAGE_CHARS, _shown(message)


def test_the_valid_model_runs_under_the_address_space_limit(valid_model):
    result = run_cli(valid_model)
    assert result.returncode == 0, _shown(result.stderr)


# one case of each kind through the real CLI: exit status 2 and one line on stderr
CLI_CASES = (
    "magic", "version-4", "tensor_count-u64-max", "kv_count-plus-1",
    "kv[general.architecture].key-length-200MB", "kv[tokenizer.ggml.tokens].value-type-13",
    "kv[general.name].string-length-past-eof", "kv[tokenizer.ggml.tokens].element-type-array",
    "kv[tokenizer.ggml.scores].array-length-u64-max", "key-bytes-duplicate-key",
    "tensor[token_embd.weight].name-length-i64-max", "tensor[token_embd.weight].n-dims-5",
    "tensor[token_embd.weight].dim0-u64-max", "tensor[token_embd.weight].ggml-type-f16",
    "tensor[token_embd.weight].offset-plus-1", "block_count-as-float32",
    "block_count-2^32-1", "attention.head_count-zero", "attention.head_count_kv-zero",
    "context_length-i64-max", "rope.freq_base-nan", "tokens-as-int32-array",
    "alignment-as-array", "deeply-nested-array", "architecture-unknown-and-long",
    "truncated-by-one-byte",
)


@pytest.mark.parametrize("name", CLI_CASES)
def test_the_cli_reports_a_corrupt_file_in_one_line_with_exit_2(name, layout, tmp_path):
    case = next(c for c in CASES if c.name == name)
    path = tmp_path / "bad.gguf"
    path.write_bytes(case.build(layout))
    assert_clean_cli_error(run_cli(path))


@pytest.mark.parametrize("name", ["garbage-appended", "version-2"])
def test_the_cli_runs_a_file_whose_change_means_nothing(name, layout, tmp_path):
    case = next(c for c in CASES if c.name == name)
    path = tmp_path / "ok.gguf"
    path.write_bytes(case.build(layout))
    result = run_cli(path)
    assert result.returncode == 0, _shown(result.stderr)


# -- the failures reported in the issue ------------------------------------------------


def test_a_200_mb_metadata_key_is_refused_before_it_is_read(layout, tmp_path):
    """The key's bytes are really in the file (a sparse one: zeros cost no disk), and its
    value type is unknown, an error whose message names the key: formatting the whole
    key into it used to take 7 GB."""
    kv = layout.kvs["general.name"]
    size = 200 << 20
    path = tmp_path / "long-key.gguf"
    with open(path, "wb") as fh:
        fh.write(layout.data[:kv.start] + struct.pack("<Q", size))
        fh.seek(size, os.SEEK_CUR)
        fh.write(struct.pack("<I", 13) + layout.data[kv.parts[2].end:])
    result = run_cli(path)
    assert_clean_cli_error(result)
    assert "key" in result.stderr


def test_a_block_count_of_four_billion_is_refused_before_anything_is_sized(layout, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(layout.with_value(f"{ARCH}.block_count", V.UINT32,
                                       scalar(V.UINT32, U32_MAX)))
    result = run_cli(path)
    assert_clean_cli_error(result)
    assert "block_count" in result.stderr


def test_a_block_count_stored_as_float32_is_a_type_error(layout, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(layout.patched(layout.kv_value_type_at(f"{ARCH}.block_count"), "<I",
                                    V.FLOAT32))
    result = run_cli(path)
    assert_clean_cli_error(result)
    assert "block_count" in result.stderr and "FLOAT32" in result.stderr


@pytest.mark.parametrize("key", ["attention.head_count", "attention.head_count_kv"])
def test_zero_heads_are_refused_by_name(layout, tmp_path, key):
    path = tmp_path / "bad.gguf"
    path.write_bytes(layout.with_value(f"{ARCH}.{key}", V.UINT32, scalar(V.UINT32, 0)))
    result = run_cli(path)
    assert_clean_cli_error(result)
    assert key in result.stderr


def _vocabulary(layout: Layout, n_tokens: int) -> bytes:
    """The file with the tokenizer of a tiny model of `n_tokens` tokens, its tensors
    keeping the rows they have."""
    md = tiny_spec(ARCH, vocab_size=n_tokens).vocab().metadata()
    data = layout.data
    for key, etype in (("tokenizer.ggml.tokens", V.STRING),
                       ("tokenizer.ggml.scores", V.FLOAT32),
                       ("tokenizer.ggml.token_type", V.INT32),
                       ("tokenizer.ggml.merges", V.STRING)):
        items = list(md[key]) if etype == V.STRING else np.asarray(md[key]).tolist()
        data = Layout.of_bytes(data).with_value(key, V.ARRAY, array(etype, items))
    return data


def test_a_token_embedding_with_fewer_rows_than_the_vocabulary_is_refused_at_load(
        layout, tmp_path):
    """512 embedding rows for 600 tokens: a prompt with id 599 used to fail deep in the
    forward with an IndexError. llama.cpp requires the rows to equal the vocabulary."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(_vocabulary(layout, 600))
    result = run_cli(path)
    assert_clean_cli_error(result)
    assert "token_embd.weight" in result.stderr and "600" in result.stderr


def test_a_token_embedding_with_more_rows_than_the_vocabulary_is_refused(layout, tmp_path):
    """Sampling could pick a row no token has: llama.cpp refuses this shape too."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(_vocabulary(layout, 400))
    assert_clean_cli_error(run_cli(path))


# -- gemma3's own keys, in-process ------------------------------------------------------

GEMMA3 = Layout.of_model("gemma3")
G = "gemma3.attention"


@pytest.mark.parametrize("build, match", [
    (lambda: GEMMA3.with_value(f"{G}.sliding_window", V.UINT32, scalar(V.UINT32, 0)),
     "0 is out of range"),
    (lambda: GEMMA3.with_value(f"{G}.sliding_window", V.UINT64, scalar(V.UINT64, 1 << 63)),
     "out of range"),
    (lambda: GEMMA3.with_value(f"{G}.sliding_window", V.FLOAT32, scalar(V.FLOAT32, 16.0)),
     "stored as FLOAT32"),
    (lambda: GEMMA3.with_extra_kv(kv_bytes(f"{G}.sliding_window_pattern", V.STRING,
                                           gguf_string("6"))), "stored as STRING"),
    (lambda: GEMMA3.with_extra_kv(kv_bytes(f"{G}.sliding_window_pattern", V.ARRAY,
                                           array(V.BOOL, [True] * 3))), "3 per-layer entries"),
    (lambda: GEMMA3.with_extra_kv(kv_bytes(f"{G}.sliding_window_pattern", V.UINT32,
                                           scalar(V.UINT32, U32_MAX))), "out of range"),
    (lambda: GEMMA3.with_extra_kv(kv_bytes("gemma3.rope.freq_base_swa", V.FLOAT32,
                                           scalar(V.FLOAT32, float("nan")))), "not a finite"),
], ids=["window-zero", "window-huge", "window-as-float32", "pattern-as-string",
        "pattern-of-wrong-length", "pattern-huge", "swa-base-nan"])
def test_gemma3_sliding_window_keys_are_checked(tmp_path, build, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(build())
    with pytest.raises(InvalidMetadata, match=match):
        ModelFile.open(path)


def test_gemma3_per_layer_sliding_window_pattern_loads(tmp_path):
    """A bool per layer (true: sliding window) is a valid pattern."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(GEMMA3.with_extra_kv(kv_bytes(f"{G}.sliding_window_pattern", V.ARRAY,
                                                   array(V.BOOL, [True, False]))))
    model = ModelFile.open(path)
    assert model.config.sliding_window == (16, 0)
    model.close()
