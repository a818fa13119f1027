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
cache. The split balances weighted compile times (`_COLD_SECONDS`) and the helper's own
start-up. If the helper fails, this process compiles its share itself.

The decode replay's table (kernels/cpu_decode_program.py) is only an optimization: the
forward runs op by op without it, with the same results. So when it is not in the cache
yet, the load does not wait for it: the helper compiles it last, after its share (it calls
the row ops and the attention rows, by then in the cache), the load returns once
everything else is compiled, and a thread here loads the table from the cache when the
helper is done (`cpu_decode_program.TABLE_READY`; until then decode batches run op by op,
and a forward never compiles it). A helper still compiling when this process exits
finishes on its own: numba writes each cache file under a temporary name and renames it,
so a helper cut short (Ctrl-C) leaves no half-written entry, only at worst an index entry
whose data a later compile writes again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
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

# CPU seconds to compile each group with an empty cache, and a helper process's start-up
# (Python, numpy, numba, eagerlm): weights for the split, not measurements. The groups'
# own seconds measured on the quiet machine (row ops 2.0, attention 3.3, the replay 4.8,
# Q5_0 2.9, Q8_0 1.7, Q4_K 2.3, Q6_K 1.7: docs/performance.md) split the demo model's
# cold load worse than these (loaded in 10.0 / 10.2 s against 8.9 / 9.7 s, alternating):
# both processes pay imports and numba's own start-up on top, and the helper the table.
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
    `qtypes` runs, and nothing else; returns the seconds the load waited for. The first
    forward would otherwise pay it. A decode replay's table not in the cache yet compiles
    in the helper process after this returns (the module's docstring)."""
    t0 = time.perf_counter()
    groups = _groups(qtypes)
    cold = [g for g in groups if not g.cached() and not g.after]
    later = [g for g in groups if g.after and not g.cached()]
    helper_share = _helper_share(cold) if core_count() > 1 else []
    helper = _Helper.start([*helper_share, *later]) if helper_share or later else None
    for g in groups:
        if g not in helper_share and not g.after:
            g.warm_up()
    if helper is not None:
        helper.wait_for([g.name for g in helper_share])
        if not later:
            helper.process.wait()
    for g in helper_share:  # from the cache the helper filled (or compiled here)
        g.warm_up()
    for g in groups:
        if g.after and (helper is None or g not in later):
            g.warm_up()
            cpu_decode_program.TABLE_READY.set()
    if helper is not None and later:
        cpu_decode_program.TABLE_READY.clear()
        threading.Thread(target=_load_when_compiled, args=(helper, later), daemon=True,
                         name="eagerlm-replay-table").start()
    return time.perf_counter() - t0


def _load_when_compiled(helper: _Helper, later: Sequence[_Group]) -> None:
    """Once the helper has compiled `later` (the replay's table) into the cache, load it
    here and let the forward use it. If the helper failed, the forward stays op by op
    for this process (compiling the table here would take the GIL from the forward for
    seconds); the next load compiles it again."""
    helper.wait_for([g.name for g in later])
    helper.process.wait()
    if not all(g.name in helper.done and g.cached() for g in later):
        return
    for g in later:
        g.warm_up()
    cpu_decode_program.TABLE_READY.set()


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


class _Helper:
    """The helper process, which names each group on a line of its stdout once that group
    is in the cache."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.done: set[str] = set()

    @classmethod
    def start(cls, groups: Sequence[_Group]) -> _Helper | None:
        """The helper compiling `groups` in order, on the generated modules this process
        made (`_Group.cached` made them); None if it cannot start."""
        try:
            return cls(subprocess.Popen(
                [sys.executable, "-m", "eagerlm.kernels.cpu_compile", *(g.name for g in groups)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True))
        except OSError:
            return None

    def wait_for(self, names: Sequence[str]) -> None:
        """Until the helper has reported each of `names` done, or ended (then the ones it
        did not report are compiled by whoever warms them up)."""
        assert self.process.stdout is not None
        while not self.done.issuperset(names):
            line = self.process.stdout.readline()
            if not line:
                self.process.wait()
                return
            self.done.add(line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """The helper: compile the named groups into numba's disk cache, in the order named,
    naming each on stdout when it is there."""
    names = list(sys.argv[1:] if argv is None else argv)
    qtypes = [GGMLQuantizationType[n] for n in names if n in GGMLQuantizationType.__members__]
    if any(q not in BLOCK_TYPES for q in qtypes):
        return 2
    groups = {g.name: g for g in _groups(qtypes)}
    for name in names:
        groups[name].warm_up()
        # the loading process may have exited: the cache is this helper's point
        with contextlib.suppress(OSError):
            os.write(1, f"{name}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
