"""numba's settings for eagerlm's compiled cpu kernels: the process-wide ones, and the
options every kernel is compiled with (`JIT`).

Every kernel module takes `JIT` from here, so this runs before its first `@njit`: numba
picks a function's cache directory when the decorator runs, and reads the OpenMP wait
policy when it first starts its thread pool.
"""

from __future__ import annotations

import glob
import hashlib
import os
import tempfile
from collections.abc import Iterable

import numba

_KERNELS = os.path.dirname(os.path.abspath(__file__))
# what compiled code depends on: the kernel modules, and the constants they read
_SOURCES = (*glob.glob(os.path.join(_KERNELS, "*.py")),
            os.path.join(os.path.dirname(_KERNELS), "loader", "config.py"))


def source_digest(paths: Iterable[str]) -> str:
    """A digest of the files' names and contents (those that exist)."""
    h = hashlib.sha256()
    for path in sorted(paths):
        if os.path.isfile(path):
            h.update(os.path.basename(path).encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()[:16]


# numba caches compiled code in a folder named for a digest of the sources, in
# __pycache__ beside the kernel modules, or in a temporary directory where that is not
# writable (a read-only install). Why a digest: numba checks a cached kernel against its
# own file's time stamp only, so a kernel that inlines a function of another module
# (the decode replay's table inlines the row ops, the routing, the attention rows) kept
# its old code after that module changed, and an editable install updated by `git pull`
# computed with it. A user's NUMBA_CACHE_DIR wins (the tests' cold-cache checks set it).
if "NUMBA_CACHE_DIR" not in os.environ:
    _root = os.path.join(_KERNELS, "__pycache__") if os.access(_KERNELS, os.W_OK) else \
        os.path.join(tempfile.gettempdir(), "eagerlm-numba-cache")
    numba.config.CACHE_DIR = os.path.join(_root, "numba-" + source_digest(_SOURCES))

# numba's OpenMP workers spin after each parallel loop by default, and on a machine with
# few cores they then starve other threads (BLAS's, the engine's own; a 6-token prefill of
# the demo model once took 13 s instead of 0.25 s on 2 cores); passive workers sleep
# instead. A user's own setting (or GOMP_SPINCOUNT) wins.
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Cached on disk, the GIL released while a kernel runs, and `fastmath` so float32 sums may
# be reassociated, i.e. vectorized (a different summation order than numpy's or BLAS's,
# within float32 rounding of it).
JIT = {"cache": True, "nogil": True, "fastmath": True}

# The weight kernels (kernels/cpu_quant_loops.py, cpu_float_loops.py, their decoders and the
# activations' quantizer): float operations in the order written, nothing reassociated or
# contracted but where a kernel says so (`cpu_simd.muladd`). A row of x then gives the same
# bits whether it is multiplied alone or in a batch, by whichever path: the 8-bit
# activations amplify a last-bit difference into a whole rounding step, and a batched
# request would otherwise drift from the same request alone. The kernels vectorize by
# their explicit vectors (kernels/cpu_simd.py), not by reassociation.
JIT_ORDERED = {**JIT, "fastmath": False}
