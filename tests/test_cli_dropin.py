"""The command line as llama.cpp and vLLM users type it: llama.cpp's spellings as aliases
of the same settings, `eagerlm serve MODEL`, and every server setting from an `EAGERLM_*`
environment variable (the command line winning)."""

from __future__ import annotations

import argparse

import pytest

from eagerlm.errors import InvalidParameters
from eagerlm.service.cli.commands import build_parser, cmd_serve
from eagerlm.service.cli.env_settings import apply_env_defaults


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("alias, flag", [
    (["-c", "2048"], ["--ctx", "2048"]), (["--ctx-size", "2048"], ["--ctx", "2048"]),
    (["--temp", "0.3"], ["--temperature", "0.3"]), (["-s", "7"], ["--seed", "7"]),
    (["--n-predict", "9"], ["--max-tokens", "9"])])
def test_llama_cpp_spellings_mean_the_same_as_ours(alias, flag):
    assert parse("generate", "-p", "x", *alias) == parse("generate", "-p", "x", *flag)


@pytest.mark.parametrize("alias, flag", [
    (["-np", "4"], ["--max-concurrency", "4"]), (["--parallel", "4"],
                                                 ["--max-concurrency", "4"]),
    (["-a", "m"], ["--served-model-name", "m"]), (["-c", "512"], ["--ctx", "512"])])
def test_llama_server_spellings_of_serve_flags(alias, flag):
    assert parse("serve", *alias) == parse("serve", *flag)


def test_serve_takes_the_model_as_its_argument_as_vllm_serve():
    assert parse("serve", "m.gguf").model_path == "m.gguf"
    args = parse("serve", "a.gguf", "--model", "b.gguf")
    with pytest.raises(InvalidParameters, match="two models"):
        cmd_serve(args)


def serve_parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    apply_env_defaults(sub.choices["serve"], environ)
    return parser


def test_server_settings_come_from_eagerlm_environment_variables():
    env = {"EAGERLM_PORT": "9001", "EAGERLM_HOST": "0.0.0.0", "EAGERLM_MODEL": "m.gguf",
           "EAGERLM_MAX_CONCURRENCY": "3", "EAGERLM_REASONING_FORMAT": "none",
           "EAGERLM_QUIET": "true", "EAGERLM_NO_CUDA_GRAPHS": "1",
           "EAGERLM_SERVED_MODEL_NAME": "alias", "EAGERLM_CTX": "4096"}
    args = serve_parser(env).parse_args(["serve"])
    assert (args.port, args.host, args.model, args.max_concurrency, args.reasoning_format,
            args.quiet, args.cuda_graphs, args.served_model_name, args.ctx) == \
        (9001, "0.0.0.0", "m.gguf", 3, "none", True, False, "alias", 4096)
    assert serve_parser(env).parse_args(["serve", "--port", "9002"]).port == 9002
    assert serve_parser({"EAGERLM_QUIET": "0"}).parse_args(["serve"]).quiet is False


@pytest.mark.parametrize("env", [{"EAGERLM_PORT": "eighty"},
                                 {"EAGERLM_REASONING_FORMAT": "maybe"},
                                 {"EAGERLM_QUIET": "perhaps"},
                                 {"EAGERLM_MEMORY_FRACTION": "2"}])
def test_a_bad_environment_value_is_a_usage_error_naming_the_variable(env, capsys):
    with pytest.raises(SystemExit) as e:
        serve_parser(env)
    assert e.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_the_new_serve_flags_default_to_the_servers_config():
    from eagerlm.service.http.config import ServerConfig

    args = parse("serve")
    assert (args.reasoning_format, args.sse_keepalive, args.embeddings) == (
        ServerConfig.reasoning_format, ServerConfig.sse_keepalive_s, ServerConfig.embeddings)
    assert (not args.no_webui) is ServerConfig.webui
    assert parse("serve", "--no-webui").no_webui
    assert serve_parser({"EAGERLM_NO_WEBUI": "1"}).parse_args(["serve"]).no_webui
