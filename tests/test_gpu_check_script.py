""".ci/gpu_check.sh runs from a bare copy of the checkout, as the GPU machine gets it.

The GPU machine is lent to few sessions, receives the checkout without anything of ours
installed, and has no network. A script that breaks there (a moved test file, a package
that no longer imports from the checkout, a benchmark flag renamed) costs device minutes;
here it costs a red CI. So the script runs on a copy of the tracked files: its `tests` part
with a few emulated-GPU cases selected, and its `dry` part, which starts every benchmark it
would run with `--help` (imports and flags checked, nothing measured).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def gpu_check(copy: Path, out: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(OUT=str(out), TMPDIR=str(out.parent), **env)
    return subprocess.run(["bash", ".ci/gpu_check.sh", *argv], cwd=copy, env=environ,
                          capture_output=True, text=True, timeout=900)


def test_the_tests_part_imports_eagerlm_from_the_copy_and_runs_emulated_cases(checkout_copy,
                                                                             tmp_path):
    out = tmp_path / "out"
    done = gpu_check(checkout_copy, out, "tests",
                     GPU_CHECK_TESTS="emulated and (embed or rms_norm) and not reverse")
    log = (out / "gpu_tests.log").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in log and " failed" not in log and "error" not in log.lower(), log
    where = (out / "device.txt").read_text()
    assert f"eagerlm from {checkout_copy.resolve()}" in where, where  # not this checkout


def test_the_dry_part_starts_every_benchmark_the_script_runs(checkout_copy, tmp_path):
    out = tmp_path / "out"
    done = gpu_check(checkout_copy, out, "dry")
    assert done.returncode == 0, done.stdout + done.stderr
    logs = "".join(p.read_text() for p in out.glob("*.log"))
    started = logs.count("== ")
    assert started >= 8, logs
    assert logs.count("usage:") == started, logs
