"""Command-line settings from `EAGERLM_*` environment variables.

Containers and process managers configure servers through the environment (vLLM reads
`VLLM_*`, llama-server `LLAMA_ARG_*`); so every option of `eagerlm serve` may also come
from `EAGERLM_<OPTION>`, the long flag's name in capitals with `_` for `-`
(`--max-concurrency` is `EAGERLM_MAX_CONCURRENCY`, `--model` `EAGERLM_MODEL`). A flag
given on the command line wins over the variable, which wins over the default. A value is
checked as the flag's would be, and a bad one is a usage error naming the variable; a
switch (`--quiet`) takes 1/true/yes/on or 0/false/no/off.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "EAGERLM_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action) -> str | None:
    """The variable of an option: its first long flag, in capitals."""
    long = next((s for s in action.option_strings if s.startswith("--")), None)
    if long is None or action.dest == "help":
        return None
    return PREFIX + long[2:].upper().replace("-", "_")


def apply_env_defaults(parser: argparse.ArgumentParser,
                       environ: Mapping[str, str] | None = None) -> None:
    """Set the defaults of `parser`'s options from the environment."""
    env = os.environ if environ is None else environ
    for action in parser._actions:  # argparse has no public list of a parser's options
        name = env_name(action)
        if name is None or name not in env:
            continue
        text = env[name]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            flag = text.strip().lower()
            if flag not in _TRUE | _FALSE:
                parser.error(f"{name}={text!r}: expected 1/true/yes/on or 0/false/no/off")
            given = flag in _TRUE  # the switch given: its action's const
            action.default = action.const if given else not action.const
            continue
        if isinstance(action, argparse._AppendAction):
            continue  # repeatable flags (--stop, --logit-bias) stay on the command line
        try:
            value = action.type(text) if callable(action.type) else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            parser.error(f"{name}={text!r}: {e}")
        if action.choices is not None and value not in action.choices:
            parser.error(f"{name}={text!r}: choose from "
                         f"{', '.join(map(str, action.choices))}")
        action.default = value


__all__ = ["PREFIX", "apply_env_defaults", "env_name"]
