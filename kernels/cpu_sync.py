"""How compiled code on the cpu backend's threads waits for other threads without the GIL:
atomic counters in int64 arrays, a spin that gives the core away, a cycle counter.

The decode replay's threads (kernels/cpu_decode_program.py) claim a step's chunks from an
atomic counter and wait for its done count; the devices of a tensor-parallel group meet
in an all-reduce the same way (kernels/host_collective.py's `Exchange`), from the replay's
table or from the ops. A wait spins `SPINS` checks (the awaited thread is usually
microseconds away), then calls the C library's `sched_yield` per check, so that on a
machine busier than its cores a waiting thread does not keep the one it waits for off a
core. `sched_yield`'s address is this process's: it is passed in at each call, never
compiled in (numba caches the code).
"""

from __future__ import annotations

import ctypes
import functools
import time

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from eagerlm.kernels.numba_settings import JIT

SCHED_YIELD = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
SPINS = 2000


@intrinsic
def atomic_add(typingctx, counters, index, value):
    """counters[index] += value, atomically; the value before."""
    sig = types.int64(counters, index, value)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", builder.gep(array.data, [args[1]]), args[2],
                                  "seq_cst")
    return sig, codegen


@intrinsic
def atomic_load(typingctx, counters, index):
    """counters[index], read atomically (what another thread last stored there)."""
    sig = types.int64(counters, index)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(array.data, [args[1]]), "seq_cst", 8)
    return sig, codegen


@intrinsic
def call_void(typingctx, fn):
    """A call of the C function `void f(void)` at address `fn`."""
    def codegen(context, builder, signature, values):
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(builder.inttoptr(values[0], fnty.as_pointer()), [])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (`rdtsc` on x86): `cycles_per_second` of them a second."""
    def codegen(context, builder, signature, values):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter",
                                              fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])
    return types.int64(), codegen


@njit(**JIT)
def spin_until(counters, index, target, stop, sched_yield) -> bool:
    """Wait until counters[index] >= target: True, or False as soon as counters[stop] is
    not 0 (stop < 0: never)."""
    spins = 0
    while atomic_load(counters, index) < target:
        if stop >= 0 and atomic_load(counters, stop) != 0:
            return False
        spins += 1
        if spins > SPINS:  # the others are not running: give them the core
            call_void(sched_yield)
    return True


@njit(**JIT)
def _read_cycles() -> int:
    return cycles()


@functools.cache
def cycles_per_second() -> float:
    """The cycle counter's rate, measured once against the clock over 20 ms."""
    t0, c0 = time.perf_counter(), _read_cycles()
    time.sleep(0.02)
    return (_read_cycles() - c0) / (time.perf_counter() - t0)
