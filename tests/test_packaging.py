"""The distribution is one package, `eagerlm`, and nothing else.

The five source folders (vmm/, loader/, dispatch/, kernels/, service/) have names that
other distributions on PyPI own (`kernels` is Hugging Face's kernel hub, which
transformers imports): installed at the top level, pip would let one overwrite the other's
files. So the wheel built from this checkout must hold `eagerlm/` and its dist-info alone,
every module of the checkout under its `eagerlm.` name, the CUDA sources NVRTC compiles at
run time, and an `eagerlm` command that works from a fresh environment where `import
kernels` fails.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from eagerlm.loader.demo_model import DEMO_PACKAGE
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("vmm", "loader", "dispatch", "kernels", "service")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, checkout_copy) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy (conftest.checkout_copy), so no build/ is left in the checkout;
    # no build isolation: CI has setuptools and wheel (the test extra), and no network is
    # needed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(checkout_copy)], check=True,
                   capture_output=True, text=True)
    (whl,) = out.glob("eagerlm-*.whl")
    return whl


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("m") / "tiny.gguf",
                                 tiny_spec("llama"))


def wheel_path(source: Path) -> str:
    """Where a checkout file lands in the wheel, by pyproject.toml's package-dir."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    best = max((name for name, folder in mapping.items()
                if source.is_relative_to(ROOT / folder)),
               key=lambda name: len(mapping[name]))
    inside = source.relative_to(ROOT / mapping[best])
    return "/".join([*best.split("."), *inside.parts])


def test_the_wheel_holds_nothing_at_top_level_but_eagerlm_and_its_dist_info(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"eagerlm", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}"
                    ".dist-info"}, tops
    assert not any(n.split("/")[0] in FOLDERS for n in names)


def test_every_module_cuda_source_and_chat_page_file_of_the_checkout_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*")
               if p.suffix in (".py", ".cu", ".cuh", ".html", ".js", ".css")
               and "__pycache__" not in p.parts]
    assert any(p.suffix == ".cu" for p in sources)
    assert {p.name for p in sources} >= {"index.html", "chat.js", "chat.css"}
    missing = [str(p.relative_to(ROOT)) for p in sources if wheel_path(p) not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_the_wheel_declares_the_eagerlm_command(wheel):
    archive = zipfile.ZipFile(wheel)
    (entry_points,) = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
    text = archive.read(entry_points).decode()
    assert "eagerlm = eagerlm.service.cli.commands:main" in text


def environment_site_dirs(python: Path) -> list[str]:
    """The site-packages folders `python` imports from: its virtualenv's and, where that
    sees them, the system's; or the system's alone outside a virtualenv."""
    done = subprocess.run([str(python), "-c", "import json, sys; print(json.dumps(sys.path))"],
                          cwd="/", capture_output=True, text=True, check=True)
    return [p for p in json.loads(done.stdout)
            if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def fresh_environment(venv: Path, wheel: Path, parent: Path) -> Path:
    """A new virtualenv holding the wheel and nothing else, whose other imports (numpy,
    jinja2, ...: the wheel's dependencies) come from `parent`'s environment, by path.

    Not `--system-site-packages`: inside a virtualenv that reaches the base interpreter's
    packages, not the virtualenv's, where the dependencies were installed. The parent's
    folders are listed in a .pth file written after the install (so pip sees no other
    eagerlm there); a .pth file's folders come after the virtualenv's own, so its eagerlm
    is the wheel's, and the .pth files inside them are not run, so an editable install of
    this checkout in the parent stays out."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    (site,) = environment_site_dirs(python)
    (Path(site) / "parent-environment.pth").write_text(
        "".join(f"{d}\n" for d in environment_site_dirs(parent)))
    return python


PROBE = ("import eagerlm, importlib.util as u; print(eagerlm.__file__); "
         "from eagerlm import Engine, SyncEngine, SamplingParams; "
         "print([n for n in ('vmm', 'loader', 'dispatch', 'kernels', 'service') "
         "if u.find_spec(n) is not None]); "
         "from eagerlm.service.http.webui import asset; "
         "print(b'chat.js' in asset('index.html'))")


def probe(python: Path, venv: Path) -> None:
    """eagerlm imports from the virtualenv's wheel, with every dependency, and reads the
    chat page it carries; the bare folder names do not import."""
    done = subprocess.run([str(python), "-c", PROBE], cwd=venv.parent, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    where, bare, page = done.stdout.splitlines()
    assert where.startswith(str(venv)), where
    assert bare == "[]", f"importable at top level: {bare}"
    assert page == "True", "the chat page is not in the installed package"


def test_installed_in_a_fresh_environment_eagerlm_works_and_the_bare_names_do_not(
        wheel, tmp_path, tiny_model_path):
    venv = tmp_path / "venv"
    probe(fresh_environment(venv, wheel, Path(sys.executable)), venv)
    gen = subprocess.run([str(venv / "bin" / "eagerlm"), "generate", "--model",
                          str(tiny_model_path), "--prompt", "hello", "--max-tokens", "3",
                          "--temperature", "0", "-q"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    if importlib.util.find_spec(DEMO_PACKAGE) is not None:  # the demo extra is installed
        demo = subprocess.run([str(venv / "bin" / "eagerlm"), "generate", "--prompt",
                               "The capital of France is", "--max-tokens", "4", "-q"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert demo.returncode == 0, demo.stderr
        assert demo.stdout.strip() and "generated 4 tokens" in demo.stderr, demo


def test_the_fresh_environment_gets_its_dependencies_from_a_virtualenv_too(wheel, tmp_path):
    """Made from inside a virtualenv (as most people run the tests, and as .ci/run does),
    the fresh environment must see that virtualenv's packages, not the base interpreter's:
    with `--system-site-packages` `import llguidance` failed there. The running
    interpreter may or may not be a virtualenv; here the parent is one for certain (made
    from the running one, so it sees the same packages)."""
    parent_venv = tmp_path / "parent"
    parent = fresh_environment(parent_venv, wheel, Path(sys.executable))
    assert subprocess.run([str(parent), "-c", "import sys; assert sys.prefix != "
                           "sys.base_prefix"], check=False).returncode == 0
    venv = tmp_path / "venv"
    python = fresh_environment(venv, wheel, parent)
    assert environment_site_dirs(parent)[0] in environment_site_dirs(python)
    probe(python, venv)
