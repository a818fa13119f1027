"""Compiling the cpu kernels a model needs: only those, once per machine, split over the
cores the first time.

A model needs the weight kernels of the types its file holds (kernels/cpu_kernel_registry.py:
no other type's are even generated), the activations' quantizers they take their input
from, the row ops, the attention rows, a mixture of experts' routing (`experts`), F32's
row kernel where it holds float32 matrices (`float32`), and the decode replay's table
(kernels/cpu_decode_program.py) with the types' C entries only it calls. numba caches each
compiled kernel on disk, so this costs a second or less after the first load; the first
costs several seconds of CPU, and numba compiles one function at a time in a process (a
global lock). So when some of the kernels are not in
the cache yet and the machine has more than one core, a helper process
(`python -m eagerlm.kernels.cpu_compile TYPES`, the groups' names on its stdin) compiles
part of them into the same disk cache while this process compiles the rest, then this one
loads the helper's from the cache. The two take the cold groups from one list, the larger
first, each its next one when it is free: the helper starts while this process copies the
weights, and neither waits for the other for longer than the last group takes, however
the machine's load or the groups' sizes differ from an estimate (a fixed split by
weighted compile times left one process a second idle on the demo model). If the helper
fails, this process compiles what it was given. Each kernel belongs to one group, so that
none compiles in both processes: a type's `gemv` compiles on zeros in its activations'
layout, not through the quantizer that several types share, which is a group of its own,
and its `dequant` is another, compiled only for the types a forward dequantizes
(`quantized.dequantized_types`).

The decode replay's table (kernels/cpu_decode_program.py) and the prompts' 8-bit panels
(kernels/cpu_panel_gemm.py; each type's `pack_panels` and `panel_product`) are only
optimizations: the forward runs op by op without the first, with the same results,
and prompts take the float32 tiles (or runs) without the second (whose `dequant` the load
compiles). So when they are
not in the cache yet, the load does not wait for them (the helper compiles the panels
first, then the table; `quantized.PANELS_READY` is set once the panels are loaded
here, as `TABLE_READY` for the table below); nor for the types' C entries
(`row_kernel`) that only the table calls, each of which compiles its type's `gemv`
into its own code again (a quarter of the type's compile): the helper compiles them
last, after its share (the table calls the row ops and the attention rows, by then in
the cache), the load returns once everything else is compiled, and a thread here loads
the table from the cache when the helper is done (`cpu_decode_program.TABLE_READY`;
until then decode batches run op by op, and a forward never compiles it). A helper
still compiling when this process exits finishes on its own: numba writes each cache
file under a temporary name and renames it, so a helper cut short (Ctrl-C) leaves no
half-written entry, only at worst an index entry whose data a later compile writes
again.
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
from gguf import GGMLQuantizationType as Q
from numba.core.caching import FunctionCache

from eagerlm.kernels import cpu_attention, cpu_decode_program, cpu_moe, quantized
from eagerlm.kernels import cpu_row_ops as row_ops
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES, kernels
from eagerlm.kernels.cpu_row_kernel import warm_up_float32
from eagerlm.kernels.cpu_threads import core_count

# CPU seconds to compile each group with an empty cache, measured on the quiet machine
# (docs/performance.md: row ops 1.7, attention 3.7 with numba's own start-up, the
# activations' two quantizers 0.8, the demo model's types' `gemv` 1.2-1.6 and `dequant`
# 0.26-0.4): only the order the cold groups are taken in, the larger first, so that the
# last to finish is a short one. The replay's and the panels' groups compile after the
# load (not claimed: no estimate).
_COLD_SECONDS = {"row_ops": 1.7, "attention": 3.7, "activations": 0.8}
_TYPE_COLD_SECONDS = 1.4  # a type's `gemv`
_DEQUANT_COLD_SECONDS = 0.35  # a type's `dequant`
_DEQUANT = ".dequant"  # the suffix of a type's `dequant` group
_PANELS = ".panels"  # the suffix of a type's panels group (`pack_panels`, `panel_product`)


@dataclass(frozen=True)
class _Group:
    """Kernels compiled together: `warm_up` compiles (or loads) them, `dispatchers` are
    the numba functions that hold them and `c_functions` the Python functions it compiles
    as C functions (to ask whether the disk cache has them)."""

    name: str
    warm_up: Callable[[], None]
    dispatchers: Callable[[], list]
    c_functions: Callable[[], list] = list
    # compiled last, after the load, where cold: the decode replay's table, which calls
    # other groups' kernels (the row ops, the attention rows) that it would otherwise
    # compile again while the helper compiles them, and the types' C entries that only it
    # calls; the prompts' panels, which only speed prompts up. `ready` is set once they
    # are loaded here (cleared meanwhile): the forward takes another path until then.
    after: bool = False
    ready: threading.Event | None = None

    @property
    def seconds(self) -> float:
        if self.name.endswith(_DEQUANT):
            return _DEQUANT_COLD_SECONDS
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


def _groups(qtypes: Iterable[GGMLQuantizationType],
            dequantized: Iterable[GGMLQuantizationType] | None = None,
            paneled: Iterable[GGMLQuantizationType] | None = None,
            experts: bool = False, float32: bool = False) -> list[_Group]:
    """The groups a model of matrices of `qtypes` needs: each compiled once, in one
    process or the other (the activations' quantizers, which several types share, are a
    group of their own; each type's `dequant` too, for the types in `dequantized`, all
    by default: `quantized.dequantized_types`; for a mixture of experts (`experts`), the
    routing, the weighted sum and gpt-oss's activation; for float32 matrices (`float32`),
    F32's row kernel)."""
    qtypes = sorted(set(qtypes), key=int)
    dequantized = set(qtypes if dequantized is None else dequantized)
    groups = [
        _Group("row_ops", row_ops.warm_up, lambda: list(row_ops.KERNELS)),
        _Group("attention", cpu_attention.warm_up, lambda: list(cpu_attention.KERNELS)),
        _Group("replay", lambda: _warm_up_replay(qtypes),
               lambda: list(cpu_decode_program.KERNELS),
               lambda: quantized.row_kernel_functions(qtypes), after=True,
               ready=cpu_decode_program.TABLE_READY),
    ]
    if experts:
        groups.append(_Group("experts", cpu_moe.warm_up, lambda: list(cpu_moe.KERNELS)))
    if float32:
        groups.append(_Group("F32", warm_up_float32, list, lambda: [kernels(Q.F32).row_kernel]))
    if quantized.activation_kernels(qtypes):
        groups.append(_Group("activations", lambda: quantized.warm_up_activations(qtypes),
                             lambda: quantized.activation_kernels(qtypes)))
    groups += [_Group(q.name, lambda q=q: quantized.warm_up_gemv([q]),
                      lambda q=q: [kernels(q).gemv]) for q in qtypes]
    paneled = sorted(quantized.panel_types(qtypes) if paneled is None else paneled, key=int)
    ready = quantized.PANELS_READY
    groups += [_Group(q.name + _PANELS, lambda q=q: quantized.warm_up_panels([q]),
                      lambda q=q: [kernels(q).pack_panels, kernels(q).panel_product],
                      after=True, ready=ready)
               for q in paneled]
    return groups + [_Group(q.name + _DEQUANT, lambda q=q: quantized.warm_up_dequant([q]),
                            lambda q=q: [kernels(q).dequant])
                     for q in qtypes if q in dequantized]


def _warm_up_replay(qtypes: Sequence[GGMLQuantizationType]) -> None:
    """The types' C entries (`quantized.warm_up_row_kernels`), then the table."""
    quantized.warm_up_row_kernels(qtypes)
    cpu_decode_program.warm_up()


def compile_kernels(qtypes: Iterable[GGMLQuantizationType],
                    dequantized: Iterable[GGMLQuantizationType] | None = None,
                    experts: bool = False, float32: bool = False) -> float:
    """Compile (or load from numba's disk cache) the kernels a model with matrices of
    `qtypes` runs, and nothing else (`dequant` only for the types in `dequantized`, all
    by default); returns the seconds the load waited for. The first forward would
    otherwise pay it. A decode replay's table not in the cache yet compiles in the helper
    process after this returns (the module's docstring)."""
    return start_compile(qtypes, dequantized, experts, float32).finish()


def start_compile(qtypes: Iterable[GGMLQuantizationType],
                  dequantized: Iterable[GGMLQuantizationType] | None = None,
                  experts: bool = False, float32: bool = False) -> KernelCompile:
    """`compile_kernels` begun: if two groups or more are cold and there is another core,
    a helper process starts taking them now, while this process does other work (the
    cpu backend copies the weights) before `KernelCompile.finish` takes the rest."""
    qtypes = sorted(set(qtypes), key=int)
    groups = _groups(qtypes, dequantized, experts=experts, float32=float32)
    claims = _Claims([g for g in groups if not g.after and not g.cached()])
    # (the panels before the replay's table: a prompt comes before a decode batch)
    later = sorted((g for g in groups if g.after and not g.cached()),
                   key=lambda g: g.ready is cpu_decode_program.TABLE_READY)
    helper = None
    if len(claims.names) > 1 and core_count() > 1:
        # (with one cold group a helper starts once this process is done: compiling the
        # replay's group beside this one's, it would compile their kernels too)
        helper = _Helper.start(qtypes)
        if helper is not None:
            helper.serve(claims)
    return KernelCompile(qtypes, groups, later, claims, helper)


class _Claims:
    """The cold groups, the larger first (`_COLD_SECONDS`), each taken once by whichever
    process is free first: this one or the helper (two threads here)."""

    def __init__(self, groups: Iterable[_Group]) -> None:
        self._left = sorted(groups, key=lambda g: -g.seconds)
        self._lock = threading.Lock()
        self.names = {g.name for g in self._left}

    def claim(self) -> _Group | None:
        with self._lock:
            return self._left.pop(0) if self._left else None


@dataclass
class KernelCompile:
    """A first-use compile under way (`start_compile`): the groups of `qtypes`, the cold
    ones that this process and the helper take in turn (`cold`), the cold `later` ones
    (the prompts' panels, the replay's table) that the helper compiles after the load,
    and the helper itself."""

    qtypes: list[GGMLQuantizationType]
    groups: list[_Group]
    later: list[_Group]
    cold: _Claims
    helper: _Helper | None

    def finish(self) -> float:
        """Load the cached groups, compile cold ones until none is left, then load the
        helper's from the cache; returns the seconds it took."""
        t0 = time.perf_counter()
        for g in self.groups:  # from the cache: this process needs them all
            if not g.after and g.name not in self.cold.names:
                g.warm_up()
        while (g := self.cold.claim()) is not None:
            g.warm_up()
        helper = self.helper
        if helper is not None:
            for g in helper.served():  # from the cache the helper filled (or compiled here)
                g.warm_up()
        cold = {g.name for g in self.later}
        for g in self.groups:  # the cached ones of the later groups (the replay's table)
            if g.after and g.name not in cold:
                g.warm_up()
        pending = {g.ready for g in self.later}
        for ready in {g.ready for g in self.groups if g.after} - pending:
            ready.set()
        if not self.later:
            if helper is not None:
                helper.close()
                helper.process.wait()
            return time.perf_counter() - t0
        if helper is None:
            helper = _Helper.start(self.qtypes)
        if helper is None:  # none can start: compiled here
            for g in self.later:
                g.warm_up()
            for ready in pending:
                ready.set()
            return time.perf_counter() - t0
        for ready in pending:
            ready.clear()
        if helper.send([g.name for g in self.later]):  # (a helper that failed: the other
            helper.close()                                 # paths stay)
            threading.Thread(target=_load_when_compiled, args=(helper, self.later),
                             daemon=True, name="eagerlm-later-kernels").start()
        return time.perf_counter() - t0


def wait_for_later_kernels(timeout: float | None = None) -> bool:
    """Wait until the kernels a load on a cold cache left to the helper (the replay's
    table, the prompts' panels) are loaded here; whether they are. What a measurement of
    the engine's steady state waits for after the load."""
    return all(ready.wait(timeout) for ready in (cpu_decode_program.TABLE_READY,
                                                  quantized.PANELS_READY))


def _load_when_compiled(helper: _Helper, later: Sequence[_Group]) -> None:
    """As the helper compiles `later` into the cache (in their order: the panels, then
    the replay's table), load each kind here and set its `ready`: the forward switches to
    it. If the helper failed, the forward stays on its other path (op by op, the tiles)
    for this process (compiling here would take the GIL from the forward for seconds);
    the next load compiles them again."""
    kinds: dict[threading.Event, list[_Group]] = {}
    for g in later:
        kinds.setdefault(g.ready, []).append(g)
    for i, (ready, groups) in enumerate(kinds.items()):
        helper.wait_for([g.name for g in groups])
        if i == len(kinds) - 1:  # the last: the helper's exit, as the replay's always was
            helper.process.wait()
        if not all(g.name in helper.done and g.cached() for g in groups):
            return
        for g in groups:
            g.warm_up()
        ready.set()


class _Helper:
    """The helper process: it compiles the groups named on the lines of its stdin, in
    order, and names each on a line of its stdout once that group is in the cache."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.done: set[str] = set()
        self.taken: list[_Group] = []  # the cold groups it was given
        self._serving: threading.Thread | None = None

    @classmethod
    def start(cls, qtypes: Sequence[GGMLQuantizationType]) -> _Helper | None:
        """The helper for a model of `qtypes`, on the generated modules this process
        made (`_Group.cached` made them); None if it cannot start."""
        try:
            return cls(subprocess.Popen(
                [sys.executable, "-m", "eagerlm.kernels.cpu_compile",
                 ",".join(q.name for q in qtypes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True))
        except OSError:
            return None

    def serve(self, cold: _Claims) -> None:
        """Give it cold groups one at a time, the next once it has compiled the last,
        until none is left or it fails (a thread here)."""
        def serve() -> None:
            while (g := cold.claim()) is not None:
                self.taken.append(g)
                if not (self.send([g.name]) and self.wait_for([g.name])):
                    return
        self._serving = threading.Thread(target=serve, daemon=True,
                                         name="eagerlm-compile-helper")
        self._serving.start()

    def served(self) -> list[_Group]:
        """The cold groups it was given, once it is done with them (or has failed: then
        the ones it did not report are compiled by whoever warms them up)."""
        if self._serving is not None:
            self._serving.join()
        return self.taken

    def send(self, names: Sequence[str]) -> bool:
        """Whether `names` reached its stdin."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write("".join(f"{n}\n" for n in names))
            self.process.stdin.flush()
        except OSError:
            return False
        return True

    def close(self) -> None:
        """No more groups: it exits once it has compiled those it was sent."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def wait_for(self, names: Sequence[str]) -> bool:
        """Until the helper has reported each of `names` done (True), or ended (False)."""
        assert self.process.stdout is not None
        while not self.done.issuperset(names):
            line = self.process.stdout.readline()
            if not line:
                self.process.wait()
                return False
            self.done.add(line.strip())
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """The helper (`TYPES`, the model's types joined by commas): compile the groups named
    on the lines of stdin into numba's disk cache, in order, naming each on stdout when it
    is there, until stdin ends."""
    args = list(sys.argv[1:] if argv is None else argv)
    members = GGMLQuantizationType.__members__
    listed = [n for n in args[0].split(",") if n] if len(args) == 1 else None
    if listed is None or any(n not in members or members[n] not in BLOCK_TYPES
                             for n in listed):
        return 2
    qtypes = [members[n] for n in listed]
    # every panel group the loading process may name (it may take panels where this
    # process's default would not: a test forcing them)
    paneled = [q for q in qtypes if quantized.has_panels(q)]
    groups = {g.name: g for g in _groups(qtypes, paneled=paneled, experts=True,
                                         float32=True)}
    for line in sys.stdin:
        name = line.strip()
        if name not in groups:
            return 2
        groups[name].warm_up()
        # the loading process may have exited: the cache is this helper's point
        with contextlib.suppress(OSError):
            os.write(1, f"{name}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
