"""The front door: `import eagerlm` gives everything a user handles, every error eagerlm
raises on purpose is an `EagerLMError`, and the CLI and the server each map it in one
place: one line and exit status 2 (an engine failure: 1), or OpenAI's error body with a
4xx (a closed engine: 503; an engine failure: 500)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import eagerlm
import eagerlm.errors
from eagerlm.dispatch.errors import EmptyPrompt, PromptTooLong, RequestError, TokenOutOfVocabulary
from eagerlm.dispatch.kv_capacity import KVPoolTooSmall
from eagerlm.kernels.cublaslt import CublasLtUnavailable
from eagerlm.kernels.nvrtc_build import KernelCompileError, NvrtcUnavailable
from eagerlm.kernels.sampling import InvalidSamplingParams
from eagerlm.loader.chat_template import ChatTemplateError
from eagerlm.loader.demo_model import DemoModelMissing
from eagerlm.loader.errors import (
    GGUFFormatError,
    InvalidMetadata,
    MissingKey,
    UnknownArchitecture,
    UnsupportedTensorType,
)
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.cli.commands import build_parser, main
from eagerlm.vmm.cuda_driver import CudaError, NoCudaDevice
from tests.test_gguf_file import gguf_bytes, llama_kvs, llama_tensors

E = eagerlm.errors
CATEGORIES = [E.ModelFileError, E.UnsupportedModel, E.ModelNotFound, E.ContextTooLong,
              E.InvalidParameters, E.ModelTooLarge, E.DeviceUnavailable, E.EngineClosed,
              E.EngineFailure]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("front") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=48)))


# -- the namespace ----------------------------------------------------------------------------

def test_everything_in_all_imports_from_the_front_door():
    assert len(set(eagerlm.__all__)) == len(eagerlm.__all__)
    namespace: dict[str, object] = {}
    exec(f"from eagerlm import {', '.join(eagerlm.__all__)}", namespace)
    assert all(namespace[name] is getattr(eagerlm, name) for name in eagerlm.__all__)
    for name in ("Engine", "SyncEngine", "SamplingParams", "EagerLMError", "Chunk",
                 "Completion", "FinishReason", "TokenLogprobs", "Logprob", "Prompt",
                 "EngineSettings", "GenerationError"):
        assert name in eagerlm.__all__
    assert all(c.__name__ in eagerlm.__all__ for c in CATEGORIES)


def test_the_errors_module_imports_nothing_from_eagerlm():
    tree = ast.parse(Path(E.__file__).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)]
    assert imported == ["__future__"]


# -- the hierarchy ----------------------------------------------------------------------------

@pytest.mark.parametrize("category", CATEGORIES)
def test_every_error_category_is_an_eagerlm_error(category):
    assert issubclass(category, eagerlm.EagerLMError)


@pytest.mark.parametrize("error, category", [
    (GGUFFormatError, E.ModelFileError), (MissingKey, E.ModelFileError),
    (InvalidMetadata, E.ModelFileError), (ChatTemplateError, E.ModelFileError),
    (UnsupportedTensorType, E.UnsupportedModel), (UnknownArchitecture, E.UnsupportedModel),
    (DemoModelMissing, E.ModelNotFound), (KVPoolTooSmall, E.ContextTooLong),
    (RequestError, E.InvalidParameters), (PromptTooLong, E.InvalidParameters),
    (EmptyPrompt, E.InvalidParameters), (TokenOutOfVocabulary, E.InvalidParameters),
    (InvalidSamplingParams, E.InvalidParameters), (NoCudaDevice, E.DeviceUnavailable),
    (NvrtcUnavailable, E.DeviceUnavailable), (CublasLtUnavailable, E.DeviceUnavailable),
    (eagerlm.GenerationError, E.EngineFailure), (CudaError, E.EngineFailure),
    (KernelCompileError, E.EngineFailure),
])
def test_each_concrete_error_is_in_its_category(error, category):
    assert issubclass(error, category)


@pytest.mark.parametrize("error, builtin", [
    (E.InvalidParameters, ValueError), (E.ContextTooLong, ValueError),
    (E.ModelTooLarge, MemoryError), (E.ModelNotFound, FileNotFoundError),
    (DemoModelMissing, RuntimeError), (E.EngineClosed, RuntimeError),
    (E.EngineFailure, RuntimeError), (E.DeviceUnavailable, RuntimeError),
])
def test_builtin_bases_are_kept_for_callers_that_catch_them(error, builtin):
    assert issubclass(error, builtin)


def test_engine_failures_are_apart_from_the_users_mistakes():
    users = [c for c in CATEGORIES if c is not E.EngineFailure]
    assert not any(issubclass(E.EngineFailure, c) or issubclass(c, E.EngineFailure)
                   for c in users)


# -- the CLI: one line, exit status 2 -----------------------------------------------------------

def _unsupported_model(tmp_path) -> str:
    path = tmp_path / "mamba.gguf"
    path.write_bytes(gguf_bytes(llama_kvs("mamba"), llama_tensors()))
    return str(path)


def _corrupt_model(tmp_path) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all, just text" * 4)
    return str(path)


def _too_large(monkeypatch) -> None:
    from eagerlm.kernels import cpu_backend
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: 1)


CLI_CASES = [  # (argv after `generate -m MODEL -q`, or a model of its own; category; words)
    pytest.param(["-m", "/no/such/model.gguf", "-p", "hi"], E.ModelNotFound,
                 "model file not found", id="missing model file"),
    pytest.param(["-m", _corrupt_model, "-p", "hi"], E.ModelFileError, "bad magic",
                 id="corrupt model file"),
    pytest.param(["-m", _unsupported_model, "-p", "hi"], E.UnsupportedModel, "mamba",
                 id="unsupported architecture"),
    pytest.param(["-p", "hi", "--ctx", "1000"], E.ContextTooLong, "exceeds",
                 id="context too long"),
    pytest.param(["-p", "hi " * 60], E.InvalidParameters, "context", id="prompt too long"),
    pytest.param(["-p", "hi", "--temperature", "-1"], E.InvalidParameters, "temperature",
                 id="temperature -1"),
    pytest.param(["-p", "hi", "--rope-scale", "-2"], E.InvalidParameters, "--rope-scale",
                 id="rope scale -2"),
    pytest.param(["-p", "hi", "--device", "tpu"], E.InvalidParameters, "unknown device",
                 id="unknown device"),
    pytest.param(["-p", "hi", "--device", "cuda:99"], E.DeviceUnavailable, "CUDA device",
                 id="no such GPU"),
    pytest.param(["-p", "hi"], E.ModelTooLarge, "memory is available", id="model too large"),
]


@pytest.mark.parametrize("argv, category, words", CLI_CASES)
def test_the_cli_prints_each_category_as_one_line_with_status_2(
        model_path, tmp_path, monkeypatch, capsys, argv, category, words):
    if category is E.ModelTooLarge:
        _too_large(monkeypatch)
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    if "-m" not in argv:
        argv = ["-m", model_path, *argv]
    argv = ["generate", "-q", *argv]
    args = build_parser().parse_args(argv)
    with pytest.raises(category):  # what main() maps, raised as this category
        args.func(args)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagerlm: error:") and err.count("\n") == 1, err
    assert words in err


def test_an_unreadable_text_file_is_a_parameter_error(model_path, tmp_path, capsys):
    assert main(["tokenize", "-m", model_path, str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagerlm: error: cannot read") and err.count("\n") == 1


def test_an_engine_failure_is_one_line_with_status_1(model_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise CudaError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr("eagerlm.service.cli.commands._open_engine", fail)
    assert main(["generate", "-m", model_path, "-p", "hi", "-q"]) == 1
    err = capsys.readouterr().err
    assert err == "eagerlm: error: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)\n"


def test_only_eagerlm_errors_are_mapped_a_stray_value_error_is_a_bug(monkeypatch):
    def buggy(args: argparse.Namespace) -> int:
        raise ValueError("a bug, not the user's mistake")

    monkeypatch.setattr("eagerlm.service.cli.commands.cmd_tokenize", buggy)
    with pytest.raises(ValueError, match="a bug"):
        main(["tokenize", "-"])


# -- the server: OpenAI's error body, 4xx -------------------------------------------------------

@pytest.mark.parametrize("error, status, param", [
    (E.InvalidParameters("temperature must be >= 0", param="temperature"), 400, "temperature"),
    (InvalidSamplingParams("top_p", "must be in (0, 1]"), 400, "top_p"),
    (PromptTooLong(50, 48), 400, None),
    (TokenOutOfVocabulary("logit_bias", 99, 10, param="logit_bias"), 400, "logit_bias"),
    (E.ContextTooLong("--ctx 1000 exceeds the model's context length 48"), 400, None),
    (ChatTemplateError("roles must alternate"), 400, "messages"),
    (E.EngineClosed("the engine is shut down"), 503, None),
    (eagerlm.GenerationError("the engine failed"), 500, None),
])
def test_the_server_maps_each_category_to_an_openai_error(error, status, param):
    pytest.importorskip("fastapi")
    from eagerlm.service.http.openai_errors import as_openai_error

    body = as_openai_error(error)
    assert (body.status, body.param) == (status, param)
    assert str(error) in body.message
    assert body.body()["error"]["type"] == ("invalid_request_error" if status == 400
                                            else "server_error")


def test_the_server_answers_a_closed_engine_with_503_and_bad_input_with_400(model_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from eagerlm import Engine
    from eagerlm.service.http.server import create_app

    engine = Engine.load(model_path, page_size=16384, kv_budget_bytes=16 << 20,
                         model_name="tiny")
    with engine, TestClient(create_app(engine)) as http:
        vocab = engine.tokenizer.vocab_size
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                "max_tokens": 2, "logit_bias": {vocab: 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                  "max_tokens": 2}).status_code == 200
        engine.shutdown()
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                "max_tokens": 2})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_closed"
        assert "shut down" in error["message"]
