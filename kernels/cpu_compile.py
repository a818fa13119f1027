"""Compiling the cpu kernels a model needs: only those, once per machine, split over the
cores the first time.

A model needs the weight kernels of the types its file holds (kernels/cpu_kernel_registry.py:
no other type's are even generated), the activations' quantizers they take their input
from, the row ops, the attention rows, and the decode replay's table (kernels/
cpu_decode_program.py) with the types' C entries only it calls. numba caches each
compiled kernel on disk, so this costs a second or less after the first load; the first
costs several seconds of CPU, and numba compiles one function at a time in a process (a
global lock). So when some of the kernels are not in
the cache yet and the machine has more than one core, a helper process
(`python -m eagerlm.kernels.cpu_compile TYPES GROUP ...`) compiles part of them into the
same disk cache while this process compiles the rest, then this one loads the helper's
from the cache. The split balances weighted compile times (`_COLD_SECONDS`) and the
helper's own start-up. If the helper fails, this process compiles its share itself. Each
kernel belongs to one group, so that none compiles in both processes: a type's `gemv`
compiles on zeros in its activations' layout, not through the quantizer that several
types share, which is a group of its own.

The decode replay's table (kernels/cpu_decode_program.py) is only an optimization: the
forward runs op by op without it, with the same results. So when it is not in the cache
yet, the load does not wait for it, nor for the types' C entries (`row_kernel`) that only
the table calls, each of which compiles its type's `gemv` into its own code again (a
quarter of the type's compile): the helper compiles them last, after its share (the
table calls the row ops and the attention rows, by then in the cache), the load returns
once everything else is compiled, and a thread here loads the table from the cache when the
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
from numba.core.caching import FunctionCache

from eagerlm.kernels import cpu_attention, cpu_decode_program, quantized
from eagerlm.kernels import cpu_row_ops as row_ops
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES, kernels
from eagerlm.kernels.cpu_threads import core_count

# CPU seconds to compile each group with an empty cache, and a helper process's start-up
# (Python, numpy, numba, eagerlm): weights for the split, measured on the quiet machine
# (docs/performance.md: row ops 1.7, attention 3.7 with numba's own start-up since its
# tiles (2.5 before), the activations' two quantizers 0.8, the demo model's types
# 1.4-1.7). The replay's group compiles after the load and needs no weight.
_COLD_SECONDS = {"row_ops": 1.7, "attention": 3.7, "activations": 0.8}
_TYPE_COLD_SECONDS = 1.5
_HELPER_START_SECONDS = 1.0


@dataclass(frozen=True)
class _Group:
    """Kernels compiled together: `warm_up` compiles (or loads) them, `dispatchers` are
    the numba functions that hold them and `c_functions` the Python functions it compiles
    as C functions (to ask whether the disk cache has them)."""

    name: str
    warm_up: Callable[[], None]
    dispatchers: Callable[[], list]
    c_functions: Callable[[], list] = list
    # compiled last, after the load: the decode replay's table, which calls other groups'
    # kernels (the row ops, the attention rows) that it would otherwise compile again
    # while the helper compiles them, and the types' C entries that only it calls
    after: bool = False

    @property
    def seconds(self) -> float:
        return _COLD_SECONDS.get(self.name, _TYPE_COLD_SECONDS)

    def cached(self) -> bool:
        """Whether numba's disk cache holds each of its kernels (for some CPU: a cache
        made on another machine is only found out by compiling)."""
        caches = [getattr(d, "_cache", None) for d in self.dispatchers()]
        caches += [FunctionCache(f) for f in self.c_functions()]
        for cache in caches:
            index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
            if index is None or not os.path.exists(index):
                return False
        return True


def _groups(qtypes: Iterable[GGMLQuantizationType]) -> list[_Group]:
    """The groups a model of matrices of `qtypes` needs: each compiled once, in one
    process or the other (the activations' quantizers, which several types share, are a
    group of their own)."""
    qtypes = sorted(set(qtypes), key=int)
    groups = [
        _Group("row_ops", row_ops.warm_up, lambda: list(row_ops.KERNELS)),
        _Group("attention", cpu_attention.warm_up, lambda: list(cpu_attention.KERNELS)),
        _Group("replay", lambda: _warm_up_replay(qtypes),
               lambda: list(cpu_decode_program.KERNELS),
               lambda: quantized.row_kernel_functions(qtypes), after=True),
    ]
    if quantized.activation_kernels(qtypes):
        groups.append(_Group("activations", lambda: quantized.warm_up_activations(qtypes),
                             lambda: quantized.activation_kernels(qtypes)))
    return groups + [_Group(q.name, lambda q=q: quantized.warm_up([q]),
                            lambda q=q: [kernels(q).gemv, kernels(q).dequant])
                     for q in qtypes]


def _warm_up_replay(qtypes: Sequence[GGMLQuantizationType]) -> None:
    """The types' C entries (`quantized.warm_up_row_kernels`), then the table."""
    quantized.warm_up_row_kernels(qtypes)
    cpu_decode_program.warm_up()


def compile_kernels(qtypes: Iterable[GGMLQuantizationType]) -> float:
    """Compile (or load from numba's disk cache) the kernels a model with matrices of
    `qtypes` runs, and nothing else; returns the seconds the load waited for. The first
    forward would otherwise pay it. A decode replay's table not in the cache yet compiles
    in the helper process after this returns (the module's docstring)."""
    return start_compile(qtypes).finish()


def start_compile(qtypes: Iterable[GGMLQuantizationType],
                  head_start: float = 0.0) -> KernelCompile:
    """`compile_kernels` begun: a helper process, if there is cold work to share, starts
    on its share now, while this process does about `head_start` seconds of other work
    (the cpu backend loads the weights) before `KernelCompile.finish` compiles the rest;
    the split gives the helper that much more."""
    qtypes = sorted(set(qtypes), key=int)
    groups = _groups(qtypes)
    cold = [g for g in groups if not g.cached() and not g.after]
    later = [g for g in groups if g.after and not g.cached()]
    share = _helper_share(cold, head_start) if core_count() > 1 else []
    # a helper with no share starts once this process is done: compiling the replay's
    # group beside this one's, it would compile their kernels too
    helper = _Helper.start(qtypes, [*share, *later]) if share else None
    return KernelCompile(qtypes, groups, later, share, helper)


@dataclass
class KernelCompile:
    """A first-use compile under way (`start_compile`): the groups of `qtypes`, those the
    helper compiles (`helper_share`, then the `later` ones) and the helper itself."""

    qtypes: list[GGMLQuantizationType]
    groups: list[_Group]
    later: list[_Group]
    helper_share: list[_Group]
    helper: _Helper | None

    def finish(self) -> float:
        """Compile this process's share, then load the helper's from the cache; returns
        the seconds it took."""
        t0 = time.perf_counter()
        groups, later, share = self.groups, self.later, self.helper_share
        for g in groups:
            if g not in share and not g.after:
                g.warm_up()
        helper = self.helper
        if helper is None and later:
            helper = _Helper.start(self.qtypes, later)
        if helper is not None:
            helper.wait_for([g.name for g in share])
            if not later:
                helper.process.wait()
        for g in share:  # from the cache the helper filled (or compiled here)
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


def _helper_share(cold: Sequence[_Group], head_start: float = 0.0) -> list[_Group]:
    """The groups a helper process should compile: the larger first, each to whichever
    side would finish it sooner, this process starting `head_start` seconds late."""
    mine, helper, share = head_start, _HELPER_START_SECONDS, []
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
    def start(cls, qtypes: Sequence[GGMLQuantizationType],
              groups: Sequence[_Group]) -> _Helper | None:
        """The helper compiling `groups` (of a model of `qtypes`) in order, on the
        generated modules this process made (`_Group.cached` made them); None if it cannot
        start."""
        try:
            return cls(subprocess.Popen(
                [sys.executable, "-m", "eagerlm.kernels.cpu_compile",
                 ",".join(q.name for q in qtypes), *(g.name for g in groups)],
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
    """The helper (`TYPES GROUP ...`, TYPES the model's types joined by commas): compile
    the named groups into numba's disk cache, in the order named, naming each on stdout
    when it is there."""
    types, *names = list(sys.argv[1:] if argv is None else argv)
    members = GGMLQuantizationType.__members__
    listed = [n for n in types.split(",") if n]
    if any(n not in members or members[n] not in BLOCK_TYPES for n in listed):
        return 2
    groups = {g.name: g for g in _groups(members[n] for n in listed)}
    if any(name not in groups for name in names):
        return 2
    for name in names:
        groups[name].warm_up()
        # the loading process may have exited: the cache is this helper's point
        with contextlib.suppress(OSError):
            os.write(1, f"{name}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
