"""A tensor-parallel group: one model split over N devices (loader/sharding.py), one
thread per device.

Each device's forward is the one `Transformer.forward`, on its share of the weights, and
meets the others in its collectives (`all_reduce`, `all_gather`). A collective waits for
every device, so the devices' forwards run on threads of their own, never one after the
other on one thread (NCCL says the same of its calls: a thread that drives several
devices must group them, and the forward's collectives are between other launches).
`DeviceThreads` are those threads, started once; each enters its device's context for
good (a cpu device: pinned to its share of the cores, `cpu_threads.device_cores`).

`TensorParallelModel` runs a forward on every device and hands back one device's logits:
what the sequential reference loop, the tests and the benchmarks drive. The dispatcher's
control threads, one per device, are the other driver (docs/architecture.md).

A failure on one device aborts the group's collectives, so the others raise instead of
waiting for it; `run` then raises the first real error.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.model import Transformer
from eagerlm.loader.config import ModelConfig
from eagerlm.loader.sharding import Shard, plan_shards
from eagerlm.vmm.kv_layout import KVLayout

T = TypeVar("T")
A = TypeVar("A")


class DeviceThreads:
    """One thread per device, each inside its device's context (`contexts[r]()`) from
    start to close; `run(calls)` runs `calls[r]` on device r's thread and returns every
    result. `abort` is called when one call fails, to release the others from their
    collectives."""

    def __init__(self, contexts: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]],
                 abort: Callable[[], None], name: str = "eagerlm-device") -> None:
        self._abort = abort
        self._queues: list[queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]] = [
            queue.SimpleQueue() for _ in contexts]
        self._threads = [threading.Thread(target=self._loop, args=(c, q), daemon=True,
                                          name=f"{name}-{r}")
                         for r, (c, q) in enumerate(zip(contexts, self._queues, strict=True))]
        self.contexts = list(contexts)
        for t in self._threads:
            t.start()

    def abort(self) -> None:
        """Release every device waiting in a collective (one has failed)."""
        self._abort()

    @staticmethod
    def _loop(context: Callable[[], contextlib.AbstractContextManager[Any]],
              work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]) -> None:
        with context():
            while (item := work.get()) is not None:
                call, done = item
                try:
                    done.set_result(call())
                except BaseException as exc:
                    done.set_exception(exc)

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        futures: list[Future[T]] = []
        for q, call in zip(self._queues, calls, strict=True):
            f: Future[T] = Future()
            f.add_done_callback(lambda f: f.exception() is not None and self._abort())
            q.put((call, f))
            futures.append(f)
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None
                      and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()


@dataclass
class TensorParallelModel(Generic[A]):
    """A model split over devices: each device's `Transformer` (`transformers[r]`, its
    config its share's), the model's `config`, and the threads that drive them."""

    config: ModelConfig
    shards: list[Shard]
    transformers: list[Transformer[A]]
    threads: DeviceThreads

    @property
    def size(self) -> int:
        return len(self.transformers)

    def kv_layout(self, rank: int) -> KVLayout:
        """Device `rank`'s KV cache layout: its KV heads only."""
        c = self.transformers[rank].config
        return KVLayout(c.n_layers, c.n_kv_heads, c.head_dim,
                        self.transformers[rank].ops.kv_dtype)

    def forward(self, batches: Sequence[ForwardBatch], rank: int = 0) -> np.ndarray:
        """One forward on every device (batch r, with device r's KV caches); device `rank`'s
        logits on the host (every device has the same after the gather)."""
        def call(r: int) -> Callable[[], Any]:
            tf, b = self.transformers[r], batches[r]
            return (lambda: tf.ops.to_numpy(tf.forward(b))) if r == rank else \
                (lambda: tf.forward(b))
        return np.asarray(self.threads.run([call(r) for r in range(self.size)])[rank])

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        return self.threads.run(calls)

    def abort(self) -> None:
        self.threads.abort()

    def close(self) -> None:
        self.threads.close()


def cpu_group(model: Any, size: int, *, weights: str = "quantized",
              split_lm_head: bool = True, **load: Any) -> TensorParallelModel[np.ndarray]:
    """`model` (a ModelFile) over `size` cpu devices: each a worker group pinned to its
    share of the cores (`cpu_threads.core_shares`), the all-reduces through shared host
    memory (kernels/host_collective.py). `load`: `cpu_transformer`'s loading options
    (`on_compile`, `context`), given to every device's."""
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.kernels.cpu_threads import core_shares, device_cores
    from eagerlm.kernels.host_collective import HostGroup

    shards = plan_shards(model.config, model.gguf.tensors, size, split_lm_head=split_lm_head)
    group = HostGroup(size)
    transformers = [cpu_transformer(model, weights=weights,  # type: ignore[arg-type]
                                    shard=s if size > 1 else None,
                                    collective=group.member(s.rank) if size > 1 else None,
                                    **load)
                    for s in shards]
    threads = DeviceThreads([lambda cores=cores: device_cores(cores)
                             for cores in core_shares(size)], group.abort)
    return TensorParallelModel(model.config, shards, transformers, threads)


def cuda_group(model: Any, size: int, *, ordinals: Sequence[int] | None = None,
               weights: str = "quantized", split_lm_head: bool = True,
               poison_outputs: bool = False) -> TensorParallelModel[Any]:
    """`model` over `size` GPUs (CUDA ordinals `ordinals`, default 0 .. size - 1): each
    device's share uploaded to it, its ops on its own compute stream, the collectives
    NCCL's (kernels/nccl_collective.py), one communicator per device."""
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.nccl_collective import NcclCollective, init_communicators
    from eagerlm.vmm.device import open_device

    ordinals = list(range(size)) if ordinals is None else list(ordinals)
    shards = plan_shards(model.config, model.gguf.tensors, size, split_lm_head=split_lm_head)
    devices = [open_device(f"cuda:{o}") for o in ordinals]
    comms = init_communicators(ordinals) if size > 1 else [None]
    collectives = [NcclCollective(c, r, size) if c is not None else None
                   for r, c in enumerate(comms)]
    transformers = [
        cuda_transformer(model, ops=CudaOps(dev, poison_outputs=poison_outputs,
                                            collective=col),
                         weights=weights, shard=s if size > 1 else None)  # type: ignore[arg-type]
        for dev, col, s in zip(devices, collectives, shards, strict=True)]

    @contextlib.contextmanager
    def bound(dev: Any) -> Any:
        dev.ctx.bind()  # the device's context, current on its thread
        yield

    def abort() -> None:
        for col in collectives:
            if col is not None and col.comm is not None:
                col.nccl.comm_abort(col.comm)
                col.comm = None

    threads = DeviceThreads([lambda dev=dev: bound(dev) for dev in devices], abort)
    return TensorParallelModel(model.config, shards, transformers, threads)
