"""Every engine setting has one default, held by the layer that owns it: SchedulerConfig
(max_batch, max_round_tokens), ControlConfig (lookahead, prefix_cache, cuda_graphs),
DispatcherConfig (kv_budget_bytes, memory_fraction, max_context). The layers above
(EngineSettings, the harness's DispatchSettings) and every command-line flag for a setting
start from that default, so the engine, `eagerlm profile`/`bench` and a bare dispatcher
run the same way unless told otherwise; likewise `eagerlm serve`'s flags and ServerConfig.
These tests fail when a layer disagrees again."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import DispatcherConfig
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.service.api.chat_tokens import TurnMemory
from eagerlm.service.api.engine_settings import EngineSettings
from eagerlm.service.cli.commands import _engine_settings, build_parser
from eagerlm.service.cli.device_args import kv_budget_bytes
from eagerlm.service.http.config import ServerConfig
from eagerlm.service.measure.harness import DispatchSettings, engine_settings
from eagerlm.service.measure.profiler import PROFILE_BATCH

OWNERS = (SchedulerConfig, ControlConfig, DispatcherConfig)


def owned_defaults() -> dict[str, Any]:
    """Each setting's default, from the config that owns it."""
    out: dict[str, Any] = {}
    for owner in OWNERS:
        for f in dataclasses.fields(owner):
            if f.default is not dataclasses.MISSING:
                assert f.name not in out, f"{f.name} is owned twice"
                out[f.name] = f.default
    return out


@pytest.mark.parametrize("settings", [EngineSettings, DispatchSettings])
def test_every_setting_a_lower_config_owns_has_the_owners_default(settings):
    owned = owned_defaults()
    shared = [f for f in dataclasses.fields(settings) if f.name in owned]
    assert len(shared) >= 5
    for f in shared:
        assert f.default == owned[f.name], f"{settings.__name__}.{f.name}"


def test_default_settings_give_the_default_dispatcher_config():
    assert EngineSettings().dispatcher_config() == DispatcherConfig()
    assert DispatchSettings().dispatcher_config(sync=False) == DispatcherConfig()
    assert kv_budget_bytes(DispatchSettings.kv_budget_mb) == DispatcherConfig.kv_budget_bytes


def test_the_engine_remembers_as_many_chat_turns_as_turn_memory_does_by_default():
    default = inspect.signature(TurnMemory).parameters["max_turns"].default
    assert EngineSettings.chat_turns_remembered == default


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for every subcommand, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


# flags named like a setting that deliberately mean or default to something else
OWN_DEFAULTS = {
    ("profile", "max_batch"): PROFILE_BATCH,  # the profiled workload's size
    ("perplexity", "ctx"): 512,  # a chunk length, not the engine's context
}
FLAG_SETTING = {"ctx": "max_context", "kv_budget_mib": "kv_budget_bytes"}


def test_every_flag_for_a_setting_defaults_to_the_owners_default_or_none():
    owned = owned_defaults()
    checked = 0
    for path, parser in _commands(build_parser()):
        for action in parser._actions:
            setting = FLAG_SETTING.get(action.dest, action.dest)
            if setting not in owned:
                continue
            checked += 1
            want = OWN_DEFAULTS.get((path[0], action.dest), owned[setting])
            assert action.default is None or action.default == want, (path, action.dest)
    assert checked >= 15


@pytest.mark.parametrize("argv", [["generate", "-p", "hi"], ["chat"], ["serve"]])
def test_engine_commands_without_flags_run_the_default_engine(argv):
    args = build_parser().parse_args(argv)
    extra = {"max_batch": args.max_batch} if argv == ["serve"] else {}
    assert EngineSettings(**_engine_settings(args, **extra)) == EngineSettings()


@pytest.mark.parametrize("argv", [["bench", "offline"], ["bench", "online"], ["profile"]])
def test_measuring_commands_without_flags_measure_the_default_engine(argv):
    got = engine_settings(build_parser().parse_args(argv))
    want = DispatchSettings(max_batch=PROFILE_BATCH) if argv == ["profile"] else (
        DispatchSettings())
    assert got == want
    assert dataclasses.replace(got, max_batch=SchedulerConfig.max_batch).dispatcher_config(
        sync=False) == DispatcherConfig()


def test_serve_flags_default_to_the_servers_config():
    args = build_parser().parse_args(["serve"])
    flags = {"host": args.host, "port": args.port, "max_body_bytes": args.max_body_bytes,
             "max_concurrency": args.max_concurrency, "max_queue": args.max_queue,
             "shutdown_grace_s": args.shutdown_grace}
    assert ServerConfig(**flags) == ServerConfig()
