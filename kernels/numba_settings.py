"""numba's settings for eagerlm's compiled cpu kernels: the process-wide ones, and the
options every kernel is compiled with (`JIT`).

Every kernel module takes `JIT` from here, so this runs before its first `@njit`: numba
picks a function's cache directory when the decorator runs, and reads the OpenMP wait
policy when it first starts its thread pool.
"""

from __future__ import annotations

import os
import tempfile

import numba

# numba caches compiled code in __pycache__ beside the kernel modules, or in the user's
# cache directory where that is not writable; where neither is (a read-only install with
# no home), a temporary directory keeps the cache for this machine's later runs.
if "NUMBA_CACHE_DIR" not in os.environ and not os.access(os.path.dirname(__file__), os.W_OK):
    numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), "eagerlm-numba-cache")

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
