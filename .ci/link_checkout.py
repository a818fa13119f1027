"""Make the checkout importable as the `eagerlm` package without installing it.

The GPU machine gets a bare copy of the checkout and no network (.ci/gpu_check.sh), so it
cannot `pip install -e .`. This builds, under DEST, a folder `eagerlm/` of symbolic links
that lays the checkout out as the wheel does, read from pyproject.toml's
`[tool.setuptools.package-dir]` (the one place the layout is written), and prints DEST to
put on PYTHONPATH. Usage: python3 .ci/link_checkout.py DEST
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def link_checkout(dest: Path) -> Path:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    package = dest / "eagerlm"
    package.mkdir(parents=True, exist_ok=True)
    for link in package.iterdir():
        if link.is_symlink():
            link.unlink()
    for path in (ROOT / mapping["eagerlm"]).iterdir():  # the package's own modules
        if path.suffix == ".py":
            (package / path.name).symlink_to(path)
    for name, folder in mapping.items():
        if name != "eagerlm":  # eagerlm.X: a whole folder of the checkout
            (package / name.removeprefix("eagerlm.")).symlink_to(ROOT / folder)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(link_checkout(Path(sys.argv[1]).resolve()))
