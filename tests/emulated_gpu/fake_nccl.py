"""NCCL for the emulated GPUs: the `nccl.bindings.nccl` calls kernels/nccl_collective.py
makes, answered on host memory under NCCL's documented contract, as fake_cublaslt.py
answers cuBLASLt's.

- Every call is bound to the real nccl4py binding's signature (`inspect.signature` of the
  Cython function: its parameter names and count) and each argument the binding declares
  as a C integer (`int`, `size_t`, `intptr_t`, read from its docstring) must be a Python
  integer, as the binding's conversion requires: a float, None or a tensor object where a
  pointer goes raises TypeError here as it would on a GPU. The real binding is not called:
  NCCL would dereference the fake communicator.
- `comm_init_all(ndev, devlist)`: distinct devices of the emulated driver, one
  communicator per device, rank r on `devlist[r]`.
- A collective's stream must be a stream of the communicator's device, its buffers that
  device's memory of `count` elements of `datatype` (ncclInvalidArgument otherwise); the
  data type and reduction must be NCCL's enums.
- The collective is enqueued on the stream (so it runs in stream order, and a capture
  records it into the graph); when the stream reaches it, it waits for the same
  collective on every rank (NCCL's ranks must call the same collectives in the same
  order with the same counts: a mismatch fails the streams instead of hanging), reads
  every rank's input, then each rank writes its output. Sums are float32 in rank order,
  rounded once to the data type (bf16 to nearest even).
- `comm_abort` releases ranks waiting in a collective: their streams fail.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nccl.bindings import nccl as real

from eagerlm.kernels.device_tensor import from_bf16_bits, to_bf16_bits

_C_INT = re.compile(r"\b(?:int|size_t|intptr_t)\s+(\w+)")
_NUMPY = {int(real.DataType.Float32): np.float32, int(real.DataType.Int32): np.int32,
          int(real.DataType.Bfloat16): np.uint16}


class FakeNcclError(Exception):
    """nccl4py's NCCLError, with the result's name."""

    def __init__(self, result: Any, what: str) -> None:
        super().__init__(f"{real.Result(result).name}: {what}")
        self.result = result


def _host(ptr: int, n: int, dtype: Any) -> np.ndarray:
    size = n * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=dtype, count=n)


@dataclass
class _Clique:
    """The ranks of one `comm_init_all`: where their collectives meet."""

    size: int
    barrier: threading.Barrier = field(init=False)
    posted: list[Any] = field(init=False)
    calls: int = 0  # collectives completed, for the tests

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.size)
        self.posted = [None] * self.size


@dataclass(eq=False)
class FakeComm:
    clique: _Clique
    rank: int
    device: int
    alive: bool = True


class FakeNccl:
    """The module `kernels.nccl_collective._nccl()` returns on the emulated driver."""

    DataType = real.DataType
    RedOp = real.RedOp
    Result = real.Result

    def __init__(self, drv: Any) -> None:
        self.drv = drv
        self.comms: list[FakeComm] = []
        self.groups = 0
        self._ids = itertools.count(1)

    # -- the binding's contract ------------------------------------------------------

    @staticmethod
    def _bind(name: str, *args: Any) -> None:
        fn = getattr(real, name)
        inspect.signature(fn).bind(*args)  # TypeError: a wrong count or name
        c_ints = set(_C_INT.findall((fn.__doc__ or "").split("\n", 1)[0]))
        for pname, value in zip(inspect.signature(fn).parameters, args, strict=False):
            if pname in c_ints and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}: {pname} must be an int, not {type(value).__name__}")

    def _comm(self, comm: Any) -> FakeComm:
        if not isinstance(comm, FakeComm) or not comm.alive:
            raise FakeNcclError(real.Result.InvalidArgument, "not a live communicator")
        return comm

    # -- communicators ---------------------------------------------------------------

    def comm_init_all(self, ndev: int, devlist: Any) -> list[FakeComm]:
        self._bind("comm_init_all", ndev, devlist)
        devs = [int(d) for d in devlist]
        if len(devs) != ndev or len(set(devs)) != ndev or not all(
                0 <= d < self.drv.n_devices for d in devs):
            raise FakeNcclError(real.Result.InvalidArgument, f"devlist {devs}")
        clique = _Clique(ndev)
        comms = [FakeComm(clique, r, d) for r, d in enumerate(devs)]
        self.comms += comms
        return comms

    def comm_destroy(self, comm: Any) -> None:
        self._bind("comm_destroy", comm)
        self._comm(comm).alive = False

    def comm_abort(self, comm: Any) -> None:
        self._bind("comm_abort", comm)
        c = self._comm(comm)
        c.alive = False
        c.clique.barrier.abort()

    def group_start(self) -> None:
        self._bind("group_start")
        self.groups += 1

    def group_end(self) -> None:
        self._bind("group_end")

    # -- collectives -----------------------------------------------------------------

    def _enqueue(self, c: FakeComm, stream: int, what: tuple[Any, ...],
                 reads: list[tuple[int, int]], write: Any) -> None:
        """Checks, then on the stream: meet the other ranks with `what` (the call's kind
        and sizes, equal on every rank), read (ptr, bytes) of every rank, write."""
        w = self.drv.streams.get(int(stream))
        if w is None or w.device != c.device:
            raise FakeNcclError(real.Result.InvalidArgument,
                                f"stream {stream} is not a stream of device {c.device}")
        for ptr, n in reads:
            if not self.drv._device_ok(ptr, n):
                raise FakeNcclError(real.Result.InvalidArgument, f"buffer {ptr:#x} ({n} B)")
        clique = c.clique

        def run() -> None:
            clique.posted[c.rank] = (what, reads)
            clique.barrier.wait()
            mine = clique.posted[c.rank]
            if any(p[0] != what for p in clique.posted):
                raise FakeNcclError(real.Result.InvalidUsage,
                                    f"ranks called different collectives: {clique.posted}")
            inputs = [bytes(ctypes.string_at(p[1][0][0], p[1][0][1])) for p in clique.posted]
            clique.barrier.wait()  # every rank has read before any writes
            write(inputs, mine)
            if c.rank == 0:
                clique.calls += 1

        w.put(run)

    def all_reduce(self, sendbuff: int, recvbuff: int, count: int, datatype: int, op: int,
                   comm: Any, stream: int) -> None:
        self._bind("all_reduce", sendbuff, recvbuff, count, datatype, op, comm, stream)
        c = self._comm(comm)
        dt = _NUMPY.get(int(datatype))
        if dt is None or int(op) != int(real.RedOp.Sum):
            raise FakeNcclError(real.Result.InvalidArgument, "only sums of f32/bf16/i32 here")
        n = count * np.dtype(dt).itemsize

        def write(inputs: list[bytes], _: Any) -> None:
            parts = [np.frombuffer(b, dt) for b in inputs]
            as_f32 = [from_bf16_bits(p) if dt is np.uint16 else p.astype(np.float32)
                      for p in parts] if dt is not np.int32 else parts
            total = as_f32[0].copy()
            for p in as_f32[1:]:
                total += p
            out = to_bf16_bits(total) if dt is np.uint16 else total.astype(dt)
            _host(recvbuff, count, dt)[:] = out

        self._enqueue(c, stream, ("all_reduce", count, int(datatype), int(op)),
                      [(sendbuff, n), (recvbuff, n)], write)

    def all_gather(self, sendbuff: int, recvbuff: int, sendcount: int, datatype: int,
                   comm: Any, stream: int) -> None:
        self._bind("all_gather", sendbuff, recvbuff, sendcount, datatype, comm, stream)
        c = self._comm(comm)
        dt = _NUMPY.get(int(datatype))
        if dt is None:
            raise FakeNcclError(real.Result.InvalidArgument, f"datatype {datatype}")
        n = sendcount * np.dtype(dt).itemsize

        def write(inputs: list[bytes], _: Any) -> None:
            ctypes.memmove(recvbuff, b"".join(inputs), n * c.clique.size)

        self._enqueue(c, stream, ("all_gather", sendcount, int(datatype)),
                      [(sendbuff, n), (recvbuff, n * c.clique.size)], write)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  comm: Any, stream: int) -> None:
        self._bind("broadcast", sendbuff, recvbuff, count, datatype, root, comm, stream)
        c = self._comm(comm)
        dt = _NUMPY.get(int(datatype))
        if dt is None or not 0 <= root < c.clique.size:
            raise FakeNcclError(real.Result.InvalidArgument, f"datatype {datatype}, root {root}")
        n = count * np.dtype(dt).itemsize

        def write(inputs: list[bytes], _: Any) -> None:
            ctypes.memmove(recvbuff, inputs[root], n)

        self._enqueue(c, stream, ("broadcast", count, int(datatype), root),
                      [(sendbuff, n), (recvbuff, n)], write)
