"""The device flags mean the same in every command: `generate`, `chat` and `serve` (through
`EngineSettings`) and `profile` and `bench` (through `DispatchSettings`) hand
--memory-fraction, --no-cuda-graphs and --kv-budget-mib to the dispatcher unchanged; every
command that runs a model, `perplexity` too, lists them."""

from __future__ import annotations

import pytest

from eagerlm.service.api.engine_settings import EngineSettings
from eagerlm.service.cli.commands import _engine_settings, build_parser
from eagerlm.service.measure.harness import engine_settings

FLAGS = ["--memory-fraction", "0.5", "--no-cuda-graphs", "--kv-budget-mib", "64"]


def _parse(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("argv", [["generate", "-p", "hi"], ["chat"], ["serve"]])
def test_engine_commands_pass_the_flags_to_the_dispatcher(argv):
    config = EngineSettings(**_engine_settings(_parse(argv + FLAGS))).dispatcher_config()
    assert config.memory_fraction == 0.5
    assert config.control.cuda_graphs is False
    assert config.kv_budget_bytes == 64 << 20


@pytest.mark.parametrize("argv", [["profile"], ["bench", "offline"], ["bench", "online"]])
def test_profile_and_bench_pass_the_flags_to_the_dispatcher(argv):
    for sync in (False, True):
        config = engine_settings(_parse(argv + FLAGS)).dispatcher_config(sync)
        assert config.memory_fraction == 0.5
        assert config.control.cuda_graphs is False
        assert config.control.sync is sync
        assert config.kv_budget_bytes == 64 << 20


def test_defaults_replay_graphs_and_keep_a_tenth_of_the_gpu_free():
    args = _parse(["generate", "-p", "hi"])
    config = EngineSettings(**_engine_settings(args)).dispatcher_config()
    assert config.control.cuda_graphs is True and config.memory_fraction == 0.9
    # no budget: the dispatcher sizes the pool for the context (dispatch/kv_capacity.py)
    assert config.kv_budget_bytes is None


def test_the_old_spelling_of_the_kv_budget_flag_still_works():
    assert _parse(["bench", "offline", "--kv-budget-mb", "32"]).kv_budget_mib == 32


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "half"])
def test_a_memory_fraction_outside_0_1_is_refused_with_the_reason(value, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["generate", "-p", "hi", "--memory-fraction", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--memory-fraction" in err and ("not in (0, 1]" in err or "not a number" in err)


@pytest.mark.parametrize("argv", [["generate"], ["chat"], ["serve"], ["perplexity"],
                                  ["profile"], ["bench", "offline"], ["bench", "online"]])
def test_every_command_that_runs_a_model_lists_the_device_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parse([*argv, "--help"])
    assert e.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--device", "--memory-fraction", "--no-cuda-graphs", "--kv-budget-mib"):
        assert flag in usage, (argv, flag)
