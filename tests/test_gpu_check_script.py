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
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bare_copy(tmp_path_factory) -> Path:
    """The checkout's files as git would hand them over: no build outputs, no install."""
    dest = tmp_path_factory.mktemp("checkout") / "eagerlm"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def gpu_check(copy: Path, out: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(OUT=str(out), TMPDIR=str(out.parent), **env)
    return subprocess.run(["bash", ".ci/gpu_check.sh", *argv], cwd=copy, env=environ,
                          capture_output=True, text=True, timeout=900)


def test_the_tests_part_imports_eagerlm_from_the_copy_and_runs_emulated_cases(bare_copy,
                                                                             tmp_path):
    out = tmp_path / "out"
    done = gpu_check(bare_copy, out, "tests",
                     GPU_CHECK_TESTS="emulated and (embed or rms_norm) and not reverse")
    log = (out / "gpu_tests.log").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in log and " failed" not in log and "error" not in log.lower(), log
    where = (out / "device.txt").read_text()
    assert f"eagerlm from {bare_copy.resolve()}" in where, where  # not this checkout


def test_the_dry_part_starts_every_benchmark_the_script_runs(bare_copy, tmp_path):
    out = tmp_path / "out"
    done = gpu_check(bare_copy, out, "dry")
    assert done.returncode == 0, done.stdout + done.stderr
    logs = "".join(p.read_text() for p in out.glob("*.log"))
    started = logs.count("== ")
    assert started >= 8, logs
    assert logs.count("usage:") == started, logs
