"""Compiling the cpu kernels a model needs: only those, once per machine, split over the
cores the first time.

A model needs the weight kernels of the types its file holds (kernels/cpu_kernel_registry.py:
no other type's are even generated; with their row kernels, the decode replay's), the row
ops, the attention rows, the decode replay's table (kernels/cpu_decode_program.py) and the
activations' quantizer. numba caches each compiled kernel on disk, so this costs a second or less
after the first load; the first costs several seconds of CPU, and numba compiles one
function at a time in a process (a global lock). So when some of the kernels are not in
the cache yet and the machine has more than one core, a helper process
(`python -m eagerlm.kernels.cpu_compile GROUP ...`) compiles part of them into the same
disk cache while this process compiles the rest, then this one loads the helper's from the
cache. The split balances measured compile times (`_COLD_SECONDS`) and the helper's own
start-up. If the helper fails, this process compiles its share itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gguf import GGMLQuantizationType

from eagerlm.kernels import cpu_attention, cpu_decode_program
from eagerlm.kernels import cpu_row_ops as row_ops
from eagerlm.kernels.cpu_activations import quantize_into, quantize_superblocks_into
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES, kernels
from eagerlm.kernels.cpu_threads import core_count
from eagerlm.kernels.quantized import warm_up

# CPU seconds to compile each group with an empty cache (this project's 2-core machine,
# docs/performance.md), and a helper process's start-up (Python, numpy, numba, eagerlm)
_COLD_SECONDS = {"row_ops": 1.5, "attention": 2.2, "replay": 3.7}
_TYPE_COLD_SECONDS = 1.3
_HELPER_START_SECONDS = 1.0


@dataclass(frozen=True)
class _Group:
    """Kernels compiled together: `warm_up` compiles (or loads) them, `dispatchers` are
    the numba functions that hold them (to ask whether the disk cache has them)."""

    name: str
    warm_up: Callable[[], None]
    dispatchers: Callable[[], list]
    # compiled last, in this process: it calls other groups' kernels (the decode
    # replay's table calls the row ops and the attention rows), which it would otherwise
    # compile again here while the helper compiles them
    after: bool = False

    @property
    def seconds(self) -> float:
        return _COLD_SECONDS.get(self.name, _TYPE_COLD_SECONDS)

    def cached(self) -> bool:
        """Whether numba's disk cache holds each of its kernels (for some CPU: a cache
        made on another machine is only found out by compiling)."""
        for dispatcher in self.dispatchers():
            index = getattr(getattr(getattr(dispatcher, "_cache", None), "_cache_file", None),
                            "_index_path", None)
            if index is None or not os.path.exists(index):
                return False
        return True


def _groups(qtypes: Iterable[GGMLQuantizationType]) -> list[_Group]:
    fixed = [
        _Group("row_ops", row_ops.warm_up, lambda: list(row_ops.KERNELS)),
        _Group("attention", cpu_attention.warm_up, lambda: list(cpu_attention.KERNELS)),
        _Group("replay", cpu_decode_program.warm_up, lambda: list(cpu_decode_program.KERNELS),
               after=True),
    ]
    types = [_Group(q.name, lambda q=q: warm_up([q]),
                    lambda q=q: [kernels(q).gemv, kernels(q).dequant, *_quantizer(q)])
             for q in sorted(set(qtypes), key=int)]
    return fixed + types


def _quantizer(qtype: GGMLQuantizationType) -> list:
    """The activations' quantizer `qtype`'s gemv takes its input from (none: float32)."""
    block_type = BLOCK_TYPES[qtype]
    if block_type.superblocks:
        return [quantize_superblocks_into]
    return [quantize_into] if block_type.activation_group else []


def compile_kernels(qtypes: Iterable[GGMLQuantizationType]) -> float:
    """Compile (or load from numba's disk cache) the kernels a model with matrices of
    `qtypes` runs, and nothing else; returns the seconds it took. The first forward would
    otherwise pay it."""
    t0 = time.perf_counter()
    groups = _groups(qtypes)
    cold = [g for g in groups if not g.cached() and not g.after]
    helper_share = _helper_share(cold) if core_count() > 1 else []
    helper = _start_helper(helper_share) if helper_share else None
    for g in groups:
        if g not in helper_share and not g.after:
            g.warm_up()
    if helper is not None:
        helper.wait()
    for g in helper_share:  # from the cache the helper filled (or compiled here)
        g.warm_up()
    for g in groups:
        if g.after:
            g.warm_up()
    return time.perf_counter() - t0


def _helper_share(cold: Sequence[_Group]) -> list[_Group]:
    """The groups a helper process should compile: the larger first, each to whichever
    side would finish it sooner."""
    mine, helper, share = 0.0, _HELPER_START_SECONDS, []
    for g in sorted(cold, key=lambda g: -g.seconds):
        if helper + g.seconds < mine + g.seconds:
            helper += g.seconds
            share.append(g)
        else:
            mine += g.seconds
    return share


def _start_helper(share: Sequence[_Group]) -> subprocess.Popen | None:
    """The helper, on the generated modules this process made (`_Group.cached` made
    them)."""
    try:
        return subprocess.Popen([sys.executable, "-m", "eagerlm.kernels.cpu_compile",
                                 *(g.name for g in share)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """The helper: compile the named groups into numba's disk cache."""
    names = list(sys.argv[1:] if argv is None else argv)
    qtypes = [GGMLQuantizationType[n] for n in names if n in GGMLQuantizationType.__members__]
    if any(q not in BLOCK_TYPES for q in qtypes):
        return 2
    for g in _groups(qtypes):
        if g.name in names:
            g.warm_up()
    return 0


if __name__ == "__main__":
    sys.exit(main())
